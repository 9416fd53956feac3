"""Hostile-bucket suite: no single object can stop, steer or destroy a run.

Every attack runs on a local folder and on moto's S3 server against a real run (smoke recipe):
real :class:`Learner` objects and the real :class:`Synchronizer` on a fake clock, driven
in-process. Two rounds are committed, then the attack writes behind the protocol's back, and each
test asserts

(a) its outcome: a recorded rejection of a specific :class:`RejectionKind`, a detection
    (:class:`IntegrityError` naming the object, a void slot repaired), or a clear error;
(b) that every round committed before the attack still reads back exactly as it was (or, when the
    attack rewrote committed history, that ``verify()`` names the broken object);
(c) that the real synchronizer commits at least three more rounds with honest learners merged.

Attacks that have no analogue on S3 (a FIFO, a symlink) are skipped there.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

import pytest
import torch
from hostile_helpers import HONEST, PRE_ROUNDS, Backend, HostileRun, fragment_payload, learner_key

from atoll.core.rejection import RejectionKind
from atoll.storage import LearnerStore, RunReader, paths
from atoll.storage.codec import dump_record, sha256_hex
from atoll.storage.integrity import IntegrityError, seal
from atoll.storage.reader import LIST_LIMIT
from atoll.storage.records import KIND_COMMIT, KIND_HEAD, CommitRecord
from atoll.storage.store import NotRegularFileError
from atoll.storage.validation import InvalidInput, validate_id
from atoll.train.inner import RecipeLearner
from atoll.train.synchronizer import RoundSummary
from atoll.train.trust import MAX_TIMING_S


@pytest.fixture
def keyed_run(backend: Backend) -> HostileRun:
    """The ``run`` fixture's run (conftest.py), with a keyring: each learner signs with its own
    key, the synchronizer holds all."""
    r = HostileRun(backend, keyed=True)
    r.rounds(PRE_ROUNDS)
    r.before = r.reader(keyed=True).history()
    return r


def local_only(backend: Backend) -> None:
    if not backend.local:
        pytest.skip("a local-filesystem attack: object stores have no FIFOs or symlinks")


def rejected_and_goes_on(run: HostileRun, keys: str | list[str], kind: RejectionKind) -> str:
    """(c), then (a) the recorded kind of every key, then (b); returns the (last) recorded detail."""
    run.goes_on()
    detail = ""
    for key in [keys] if isinstance(keys, str) else keys:
        why = run.rejection(key)
        assert why.kind is kind, f"{key}: {why}"
        assert why.final
        detail = why.detail
    run.still_readable(run.before)
    return detail


def shapes_of_next(run: HostileRun) -> dict[str, tuple[int, ...]]:
    return run.store.manifest.fragment_shapes(run.next_fragment()[0])


def edit_bytes(old: bytes, new: bytes) -> Any:
    def edit(data: bytes) -> bytes:
        assert old in data, (old, data[:300])
        return data.replace(old, new, 1)
    return edit


# =================================================================================================
# Payloads and records
# =================================================================================================

def test_truncated_payload(run: HostileRun) -> None:
    payload, meta = fragment_payload(shapes_of_next(run))
    run.put(f"learners/evil/blobs/sha256/{sha256_hex(payload)}.safetensors", payload[: len(payload) // 2])
    key = run.contribution(payload=payload, meta=meta, write_payload=False)
    assert "bytes, record says" in rejected_and_goes_on(run, key, RejectionKind.TRUNCATED)


def test_oversize_declared_payload(run: HostileRun) -> None:
    payload, meta = fragment_payload(shapes_of_next(run))
    key = run.contribution(payload=payload, meta=meta,
                           changes={"payload": {"sha256": sha256_hex(payload), "nbytes": 2**40}})
    assert "cap" in rejected_and_goes_on(run, key, RejectionKind.OVERSIZE)


def test_oversize_actual_payload_behind_a_small_declared_size(run: HostileRun) -> None:
    """The record says 100 bytes; the object is far above the cap: a capped GET, never a full read."""
    cap = run.store.payload_cap(run.next_fragment()[0])
    blob = os.urandom(cap + 4096)
    key = run.contribution(payload=blob, changes={"payload": {"sha256": sha256_hex(blob), "nbytes": 100}})
    rejected_and_goes_on(run, key, RejectionKind.OVERSIZE)


def test_non_finite_payloads(run: HostileRun) -> None:
    """Two attacks in one round: a NaN and an Inf in a payload (two writers)."""
    keys = []
    for value, lid in ((float("nan"), "evil-nan"), (float("inf"), "evil-inf")):
        shapes = shapes_of_next(run)
        parts = {f"{n}::data": torch.zeros(s) for n, s in shapes.items()}
        parts[next(iter(parts))].view(-1)[-1] = value
        payload, meta = fragment_payload(shapes, parts=parts)
        keys.append(run.contribution(learner_id=lid, payload=payload, meta=meta))
    rejected_and_goes_on(run, keys, RejectionKind.NON_FINITE)


def test_wrong_dtype_payload(run: HostileRun) -> None:
    shapes = shapes_of_next(run)
    parts = {f"{n}::data": torch.zeros(s, dtype=torch.float16) for n, s in shapes.items()}  # half the size: not oversize
    payload, meta = fragment_payload(shapes, parts=parts)
    key = run.contribution(payload=payload, meta=meta)
    assert "dtype" in rejected_and_goes_on(run, key, RejectionKind.LAYOUT)


def test_wrong_shape_in_record(run: HostileRun) -> None:
    shapes = shapes_of_next(run)
    payload, meta = fragment_payload(shapes)
    name = next(iter(meta))
    meta[name] = {**meta[name], "shape": [1, 2, 3]}
    key = run.contribution(payload=payload, meta=meta)
    assert "shape" in rejected_and_goes_on(run, key, RejectionKind.LAYOUT)


def test_extra_tensor_names(run: HostileRun) -> None:
    shapes = {**shapes_of_next(run), "evil.extra": (4,)}
    payload, meta = fragment_payload(shapes)
    key = run.contribution(payload=payload, meta=meta)
    assert "evil.extra" in rejected_and_goes_on(run, key, RejectionKind.LAYOUT)


def test_corrupt_safetensors(run: HostileRun) -> None:
    blob = b"\xff" * 8 + os.urandom(4000)
    key = run.contribution(payload=blob)
    assert "safetensors" in rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


def test_missing_payload(run: HostileRun) -> None:
    key = run.contribution(write_payload=False)
    rejected_and_goes_on(run, key, RejectionKind.MISSING_PAYLOAD)


def test_bad_sha_payload(run: HostileRun) -> None:
    """Other bytes of the same length sit under the payload's sha256 name."""
    payload, meta = fragment_payload(shapes_of_next(run))
    other, _ = fragment_payload(shapes_of_next(run), fill=0.5)
    assert len(other) == len(payload)
    run.put(f"learners/evil/blobs/sha256/{sha256_hex(payload)}.safetensors", other)
    key = run.contribution(payload=payload, meta=meta, write_payload=False)
    assert "sha256" in rejected_and_goes_on(run, key, RejectionKind.CHECKSUM)


def test_digest_mismatch(run: HostileRun) -> None:
    key = run.contribution(edit=edit_bytes(b'"c_tokens":64', b'"c_tokens":65'))
    assert "digest" in rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


def test_non_json_constant(run: HostileRun) -> None:
    key = run.contribution(edit=edit_bytes(b'"created_at":0.0', b'"created_at":NaN'))
    rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


def test_deeply_nested_json(run: HostileRun) -> None:
    """200 000 nested arrays (400 KB, under the record cap): the JSON parser must not take the
    synchronizer down with a RecursionError."""
    depth = 200_000
    p, v = run.next_fragment()
    key = f"learners/evil/contributions/f{p:04d}/b{v:08d}/evil.s0000000002.{'ab' * 8}.json"
    run.put(key, b'{"schema":"atoll/contribution","schema_version":3,"info":' + b"[" * depth + b"]" * depth + b"}")
    rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


def test_huge_integer(run: HostileRun) -> None:
    key = run.contribution(changes={"c_tokens": 10**200})
    assert "2**53" in rejected_and_goes_on(run, key, RejectionKind.SCHEMA)


def test_unknown_schema_version(run: HostileRun) -> None:
    key = run.contribution(edit=edit_bytes(b'"schema_version":3', b'"schema_version":99'))
    assert "schema_version" in rejected_and_goes_on(run, key, RejectionKind.SCHEMA)


def test_wrong_record_kind(run: HostileRun) -> None:
    key = run.contribution(edit=edit_bytes(b'"schema":"atoll/contribution"', b'"schema":"atoll/commit"'))
    rejected_and_goes_on(run, key, RejectionKind.SCHEMA)


def test_record_under_the_wrong_key(run: HostileRun) -> None:
    """A sealed, valid record stored under a key its fields do not produce (c_steps 7, not 2)."""
    p, v = run.next_fragment()
    payload, meta = fragment_payload(shapes_of_next(run))
    sha = sha256_hex(payload)
    key = run.contribution(payload=payload, meta=meta,
                           key=f"learners/evil/contributions/f{p:04d}/b{v:08d}/evil.s0000000007.{sha[:16]}.json")
    assert "belongs at" in rejected_and_goes_on(run, key, RejectionKind.SCHEMA)


# =================================================================================================
# Overwrites of shared and committed objects, forged commits
# =================================================================================================

def assert_void(run: HostileRun, round_: int, *, keyed: bool = False) -> IntegrityError:
    """A fresh reader refuses round ``round_``'s slot with an IntegrityError naming it."""
    reader = run.reader(keyed=keyed)
    for r in range(1, round_):
        reader.read_commit(r)
    with pytest.raises(IntegrityError) as err:
        reader.read_commit(round_)
    assert err.value.url.endswith(paths.commit_key(round_)), err.value
    return err.value


def test_put_over_a_commit_record(run: HostileRun) -> None:
    """Garbage PUT over the latest commit: detected (IntegrityError naming it), never used; the
    synchronizer, running and restarted, goes on."""
    r = run.sync.round
    run.put(paths.commit_key(r), b"this is not the commit you are looking for")
    run.goes_on()
    assert_void(run, r)
    report = run.reader().verify()
    assert report.void == [r] and paths.commit_key(r) in report.problems[0]
    run.still_readable(run.before[: r - 1])
    run.goes_on(3, run.new_synchronizer(fresh=True))


def test_flipped_digit_in_a_commit(run: HostileRun) -> None:
    r = run.sync.round
    data = run.commit_bytes(r)
    m = re.search(rb'"created_at":(\d)', data)
    assert m is not None
    d = m.group(1)
    flipped = data[: m.start(1)] + (b"1" if d != b"1" else b"2") + data[m.end(1):]
    run.put(paths.commit_key(r), flipped)
    run.goes_on()
    assert "digest" in str(assert_void(run, r))
    assert run.reader().verify().void == [r]
    run.still_readable(run.before[: r - 1])


def test_forged_next_commit_with_a_broken_link_is_repaired(run: HostileRun) -> None:
    """Without keys: a forged commit for the next round that does not chain to the latest is void;
    the synchronizer commits the round to sync/repairs/ and never adopts the forgery."""
    r = run.sync.round + 1
    run.put(paths.commit_key(r), run.forged_commit(r, prev="0" * 64))
    done = run.goes_on()
    assert done[0].won and done[0].record.round == r and done[0].record.committed_by == "synchronizer"
    assert run.store.store.get_or_none(paths.repair_key(r, 1)) is not None
    reader = run.reader()
    assert [rec.committed_by for rec in reader.history()] == ["synchronizer"] * run.sync.round
    assert reader.verify().ok
    run.still_readable(run.before)


def test_fresh_reader_never_uses_a_forged_void_slot(run: HostileRun) -> None:
    """After the repair above, a fresh handle asked for that round alone (as read_global_fragment
    asks a rejoining learner's handle) must get the synchronizer's record, not the forgery."""
    r = run.sync.round + 1
    run.put(paths.commit_key(r), run.forged_commit(r, prev="0" * 64))
    run.goes_on()
    run.still_readable(run.before)
    assert run.reader().read_commit(r).committed_by == "synchronizer"


def test_forged_next_commit_chained_without_keys_is_adopted(run: HostileRun) -> None:
    """Documented limit (protocol §8): without keys, a writer who recomputes digest and link makes
    a valid commit; only the bucket policy stops it. Here it carries no update: the synchronizer
    adopts it (won=False), nothing committed before changes, and the run goes on."""
    r = run.sync.round + 1
    p = run.sync.fragment_of_round(r)
    run.put(paths.commit_key(r), run.forged_commit(r, fragment=p, updated=False, accepted=[], rejected={}))
    first = run.sync.tick()
    assert isinstance(first, RoundSummary) and not first.won and first.record.committed_by == "learner-0"
    run.learners_adopt()
    run.goes_on()
    run.still_readable(run.before)


def test_forged_next_commit_with_keyring_is_repaired(keyed_run: HostileRun) -> None:
    run = keyed_run
    r = run.sync.round + 1
    p = run.sync.fragment_of_round(r)
    forged = run.forged_commit(r, fragment=p, updated=False, accepted=[], rejected={}, key=learner_key("learner-0"))
    run.put(paths.commit_key(r), forged)
    done = run.goes_on()
    assert done[0].won and done[0].record.round == r and done[0].record.committed_by == "synchronizer"
    assert_void_then_repaired = run.reader(keyed=True)
    assert assert_void_then_repaired.read_commit(r).committed_by == "synchronizer"
    assert run.store.store.get_or_none(paths.repair_key(r, 1)) is not None
    assert run.reader(keyed=True).verify().ok
    run.still_readable(run.before, keyed=True)


def test_put_over_head(run: HostileRun) -> None:
    """Two attacks in turn: head.json pointing far ahead (no commit there), then garbage in it.
    A fresh reader and a restarted synchronizer find the real latest round each time."""
    for data in (dump_record(KIND_HEAD, {"round": 10**7}), b"\x00garbage{"):
        real = run.sync.round
        run.put(paths.HEAD, data)
        assert run.reader(fresh=True).latest_round() == real
        run.sync = run.new_synchronizer(fresh=True)
        assert run.sync.round == real
        run.goes_on(3)
    run.still_readable(run.before)


def test_learner_restarted_under_a_garbage_head_sees_new_commits(run: HostileRun) -> None:
    """A learner (re)started while head.json holds garbage finds the latest round by a LIST of
    sync/commits/, then must still see every later commit."""
    run.put(paths.HEAD, b"\x00garbage{")
    restarted = RecipeLearner(run.backend.open(fresh=True, role=LearnerStore), "learner-1", log=lambda _: None)
    run.learners[1] = restarted
    run._seen[id(restarted)] = restarted.start_round
    start = run.sync.round
    run.goes_on(3)
    assert run._seen[id(restarted)] >= start + 3, "the restarted learner never saw the new commits"
    run.still_readable(run.before)


def test_forged_far_future_commit(run: HostileRun) -> None:
    """A sealed commit for round 10**7 (digest right, link unverifiable) and head.json pointing at
    it: a fresh reader and a restarted synchronizer must not jump to it."""
    real = run.sync.round
    far = 10**7
    run.put(paths.commit_key(far), run.forged_commit(far, prev="0" * 64))
    run.goes_on()
    real = run.sync.round
    run.put(paths.HEAD, dump_record(KIND_HEAD, {"round": far}))
    assert run.reader().latest_round() == real
    restarted = run.new_synchronizer(fresh=True)
    assert restarted.round == real
    run.goes_on(3, restarted)
    run.still_readable(run.before)


def test_forged_far_future_commit_without_head(run: HostileRun) -> None:
    """The same forged round 10**7, found by the LIST a reader does when head.json is missing."""
    far = 10**7
    run.put(paths.commit_key(far), run.forged_commit(far, prev="0" * 64))
    run.goes_on()
    real = run.sync.round
    run.store.store.delete(paths.HEAD)
    assert run.reader().latest_round() == real
    run.goes_on(3, run.new_synchronizer(fresh=True))
    run.still_readable(run.before)


def test_forged_far_future_commit_with_keyring(keyed_run: HostileRun) -> None:
    """With keys, the forged round 10**7 (signed with a learner's key) and head.json pointing at it
    are walked past: a keyed reader and a restarted synchronizer stay on the real round."""
    run = keyed_run
    far = 10**7
    run.put(paths.commit_key(far), run.forged_commit(far, key=learner_key("learner-0")))
    run.goes_on()
    real = run.sync.round
    run.put(paths.HEAD, dump_record(KIND_HEAD, {"round": far}))
    assert run.reader(keyed=True).latest_round() == real
    restarted = run.new_synchronizer(fresh=True)
    assert restarted.round == real
    run.goes_on(3, restarted)
    run.still_readable(run.before, keyed=True)


def test_overwritten_older_commit_breaks_the_chain(run: HostileRun) -> None:
    """Round 1 rewritten with a re-sealed, altered record: the link held by round 2 no longer
    matches, and a fresh reader and verify() name round 2's object."""
    body = json.loads(run.commit_bytes(1))
    body.pop("schema"), body.pop("schema_version")
    body["stats"] = {**body["stats"], "forged": True}
    run.put(paths.commit_key(1), dump_record(KIND_COMMIT, seal(KIND_COMMIT, body)))
    run.goes_on()
    err = assert_void(run, 2)
    assert "chain broken" in str(err)
    report = run.reader().verify()
    assert 2 in report.void and any(paths.commit_key(2) in p for p in report.problems)
    # Everything after the broken link still verifies from its own neighbours.
    assert report.verified == run.sync.round - 1


def test_garbage_in_repairs(run: HostileRun) -> None:
    """Garbage under sync/repairs/ of the next round (and a junk folder there), then a void slot:
    the synchronizer repairs into the next free name; the garbage is never used."""
    r = run.sync.round + 1
    run.put(paths.repair_key(r, 1), b"{not json")
    run.put(paths.repairs_prefix(r) + "r0000.json", run.forged_commit(r, prev="0" * 64))
    run.put(paths.commit_key(r), b"\x00\x01 void")
    done = run.goes_on()
    assert done[0].won and done[0].record.round == r
    assert run.store.store.get_or_none(paths.repair_key(r, 2)) is not None
    assert run.reader().history()[r - 1].committed_by == "synchronizer"
    run.still_readable(run.before)


def test_folder_in_repairs(run: HostileRun) -> None:
    """A folder (on S3: a prefix) under sync/repairs/ of a void round."""
    r = run.sync.round + 1
    run.put(paths.repairs_prefix(r) + "junk/r0001.json", b"[]")
    run.put(paths.commit_key(r), b"\x00\x01 void")
    done = run.goes_on()
    assert done[0].won and done[0].record.round == r
    assert run.reader().history()[r - 1].committed_by == "synchronizer"
    run.still_readable(run.before)


def test_forged_repair_for_a_valid_round_is_never_used(run: HostileRun) -> None:
    forged = run.forged_commit(1, like=1, prev="0" * 64)
    run.put(paths.repair_key(1, 1), forged)
    run.goes_on()
    assert run.reader().read_commit(1).committed_by == "synchronizer"
    run.still_readable(run.before)


# =================================================================================================
# Counters and timestamps
# =================================================================================================

def test_tokens_beyond_steps_x_batch_x_context(run: HostileRun) -> None:
    key = run.contribution(changes={"c_steps": 2, "c_tokens": 10**12})
    assert "tokens per step" in rejected_and_goes_on(run, key, RejectionKind.IMPOSSIBLE_COUNTERS)


def test_absurd_step_count(run: HostileRun) -> None:
    key = run.contribution(changes={"c_steps": 10**9, "c_tokens": 10**9})
    assert "steps possible" in rejected_and_goes_on(run, key, RejectionKind.IMPOSSIBLE_COUNTERS)


def test_odd_created_at_is_informational(run: HostileRun) -> None:
    """Well-formed contributions stamped 30 million years ahead and behind (two writers) are merged
    like any other: the writer's clock is informational."""
    keys = [run.contribution(learner_id=lid, changes={"created_at": t})
            for lid, t in (("evil-future", 1e15), ("evil-past", -1e15))]
    run.goes_on()
    assert set(keys) <= run.accepted_keys()
    run.still_readable(run.before)


def test_future_created_at_does_not_supersede(run: HostileRun) -> None:
    p, v = run.next_fragment()
    stale = run.contribution(changes={"c_steps": 1, "c_tokens": 32, "created_at": 1e15}, fill=2e-4)
    fresh = run.contribution(changes={"c_steps": 3, "c_tokens": 96, "created_at": 1.0})
    run.goes_on()
    assert fresh in run.accepted_keys()
    assert run.rejection(stale).kind is RejectionKind.SUPERSEDED
    run.still_readable(run.before)


def test_record_of_another_learner_under_my_prefix(run: HostileRun) -> None:
    key = run.contribution(learner_id="learner-1", prefix_id="evil")
    assert "outside its learner's prefix" in rejected_and_goes_on(run, key, RejectionKind.SCHEMA)


def test_forged_record_under_another_learners_prefix_with_keyring(keyed_run: HostileRun) -> None:
    """With keys, evil writes under learner-1's prefix, signed with its own key: bad_signature;
    learner-1's real contributions are still merged."""
    run = keyed_run
    key = run.contribution(learner_id="learner-1", sign_with=learner_key("evil"), fill=0.5)
    done = run.goes_on()
    why = run.rejection(key)
    assert why.kind is RejectionKind.BAD_SIGNATURE, why
    assert "learner-1" in {a.learner_id for s in done for a in s.record.accepted}
    run.still_readable(run.before, keyed=True)


def test_huge_step_time_in_info_is_clipped(run: HostileRun) -> None:
    """A reported step time of 1e300 s is clipped to a day (no overflow, no endless grace); one of
    10**400 makes the record unusable (a number out of bounds: schema)."""
    key = run.contribution(changes={"info": {"step_time_s": 1e300}})
    unusable = run.contribution(changes={"info": {"step_time_s": 10**400}, "c_steps": 3})
    run.goes_on(dt=3 * 3600.0)
    assert key in run.accepted_keys()
    assert run.rejection(unusable).kind is RejectionKind.SCHEMA
    step = run.sync.ema.get("step_s")
    assert step is not None and 0 <= step <= MAX_TIMING_S
    run.still_readable(run.before)


def test_huge_step_time_in_info_does_not_stall_rounds(run: HostileRun) -> None:
    run.contribution(changes={"info": {"step_time_s": 1e300}})
    run.rounds(1)
    assert len(run.rounds(3, max_ticks=12)) >= 3
    run.still_readable(run.before)


# =================================================================================================
# Identifiers
# =================================================================================================

BAD_IDS = {"newline": "evil\n", "dotdot": "ev..il", "unicode": "évil", "200 chars": "e" * 200,
           "slash": "evil/../learner-0"}


def test_bad_learner_ids_in_records(run: HostileRun) -> None:
    """Five attacks in one round: records under learners/evil/ whose learner_id has a trailing
    newline, '..', non-ASCII, 200 characters, a path escape."""
    keys = []
    for i, bad in enumerate(BAD_IDS.values()):
        with pytest.raises(InvalidInput):
            validate_id(bad)
        keys.append(run.contribution(learner_id=bad, prefix_id="evil", fill=1e-4 * (i + 1)))
    rejected_and_goes_on(run, keys, RejectionKind.BAD_ID)


def test_learner_prefix_that_is_not_an_id(run: HostileRun) -> None:
    """learners/-evil/ holds a well-formed record: that prefix is no learner's, so it is never
    listed, read or merged."""
    key = run.contribution(learner_id="-evil")
    assert "-evil" not in run.store.learner_ids()
    run.goes_on()
    assert key not in run.accepted_keys()
    assert all(key not in rec.rejected for rec in run.committed())
    run.still_readable(run.before)


# =================================================================================================
# Hostile run directories
# =================================================================================================

def test_directory_where_a_record_belongs(run: HostileRun) -> None:
    p, v = run.next_fragment()
    key = f"learners/evil/contributions/f{p:04d}/b{v:08d}/evil.s0000000002.{'cd' * 8}.json"
    if run.backend.local:
        run.backend.path(key).mkdir(parents=True)
        run.backend.path(key + "/x").write_bytes(b"{}")
        rejected_and_goes_on(run, key, RejectionKind.CORRUPT)
    else:  # on S3 a "directory" is a prefix: the listed name has no object
        run.put(key + "/x", b"{}")
        run.goes_on()
        assert key not in run.accepted_keys()
        run.still_readable(run.before)


def _read_guarded(run: HostileRun, key: str) -> BaseException | None:
    """Read ``key`` in a thread; if it blocks (a FIFO opened for reading), unblock it and fail."""
    out: list[BaseException | None] = [None]

    def read() -> None:
        try:
            run.store.store.get(key)
        except BaseException as e:  # noqa: BLE001
            out[0] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        fd = os.open(run.backend.path(key), os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail(f"reading {key} blocked")
    return out[0]


def test_fifo_as_a_record(run: HostileRun, backend: Backend) -> None:
    local_only(backend)
    p, v = run.next_fragment()
    key = f"learners/evil/contributions/f{p:04d}/b{v:08d}/evil.s0000000002.{'ef' * 8}.json"
    backend.path(key).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(backend.path(key))
    assert isinstance(_read_guarded(run, key), NotRegularFileError)
    assert "FIFO" in rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


def test_symlinked_record_outside_the_run(run: HostileRun, backend: Backend, tmp_path) -> None:
    local_only(backend)
    outside = tmp_path / "outside.json"
    good = run.contribution(learner_id="evil")  # a valid record, copied outside and linked back in
    outside.write_bytes(backend.path(good).read_bytes())
    backend.path(good).unlink()
    key = good.replace("evil.s0000000002", "evil.s0000000002")
    os.symlink(outside, backend.path(key))
    assert isinstance(_read_guarded(run, key), NotRegularFileError)
    assert "outside the run folder" in rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


def test_symlinked_payload_outside_the_run(run: HostileRun, backend: Backend, tmp_path) -> None:
    local_only(backend)
    payload, meta = fragment_payload(shapes_of_next(run))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(payload)
    blob = backend.path(f"learners/evil/blobs/sha256/{sha256_hex(payload)}.safetensors")
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, blob)
    key = run.contribution(payload=payload, meta=meta, write_payload=False)
    rejected_and_goes_on(run, key, RejectionKind.CORRUPT)


# =================================================================================================
# Resource exhaustion
# =================================================================================================

def test_five_megabyte_record(run: HostileRun) -> None:
    key = run.contribution(changes={"info": {"pad": "x" * (5 << 20)}})
    assert "1 MiB" in rejected_and_goes_on(run, key, RejectionKind.OVERSIZE)


def test_thousands_of_junk_files_in_a_learner_prefix(run: HostileRun) -> None:
    """2000 junk objects in evil's contributions prefix: one LIST asks for LIST_LIMIT names (the
    first in key order); of those, the junk .json records are rejections (a few listed in the
    commit, the rest counted in its stats), the other suffixes are never read; the round still
    closes."""
    p, v = run.next_fragment()
    prefix = f"learners/evil/contributions/f{p:04d}/b{v:08d}/"
    junk = {f"{prefix}junk-{i:04d}.{'json' if i % 20 == 0 else 'txt'}": b"junk" for i in range(2000)}
    run.backend.pipe_many(junk)
    run.goes_on()
    rejected = {k: w for rec in run.committed() for k, w in rec.rejected.items() if k.startswith(prefix)}
    counted = sum(rec.stats.get("rejected_unlisted", {}).get("by_learner", {}).get("evil", {}).get("corrupt", 0)
                  for rec in run.committed())
    listed = sum(k.endswith(".json") for k in sorted(junk)[:LIST_LIMIT])  # 26 of the 100
    assert len(rejected) + counted == listed and all(w.kind is RejectionKind.CORRUPT for w in rejected.values())
    run.still_readable(run.before)


def test_giant_rejection_detail(run: HostileRun) -> None:
    key = run.contribution(learner_id="e" * 900_000, prefix_id="evil")
    rejected_and_goes_on(run, key, RejectionKind.BAD_ID)
    biggest = max(len(run.commit_bytes(r)) for r in range(1, run.sync.round + 1))
    assert biggest < 64 << 10, f"a commit record of {biggest} bytes"


# =================================================================================================
# Concurrent writers
# =================================================================================================

def test_two_synchronizers_race_on_the_same_round(run: HostileRun) -> None:
    """Two real synchronizers on separate handles close the same rounds at the same moment:
    exactly one create wins each round, the other adopts the winner's record."""
    other = run.new_synchronizer(fresh=True)
    syncs = [run.sync, other]
    committed: list[RoundSummary] = []
    for _ in range(40):
        if len({s.round for s in syncs}) == 1 and len(committed) >= 2 * 3:
            break
        for lr in run.learners:
            lr.step()
        run.clock.t += 1.0
        polls = [s.poll() for s in syncs]
        closing = [(s, p) for s, p in zip(syncs, polls, strict=True)
                   if not isinstance(p, RoundSummary) and p.decision.close]
        results: list[RoundSummary] = [p for p in polls if isinstance(p, RoundSummary)]
        barrier = threading.Barrier(len(closing)) if closing else None

        def close(s, p, out=results, barrier=barrier) -> None:
            barrier.wait()
            out.append(s.close(p))

        threads = [threading.Thread(target=close, args=sp) for sp in closing]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        committed.extend(results)
        run.learners_adopt()
    by_round: dict[int, list[RoundSummary]] = {}
    for s in committed:
        by_round.setdefault(s.record.round, []).append(s)
    raced = {r: ss for r, ss in by_round.items() if len(ss) == 2}
    assert len(raced) >= 3, {r: len(ss) for r, ss in by_round.items()}
    for r, ss in raced.items():
        assert sorted(s.won for s in ss) == [False, True], r
        assert ss[0].record == ss[1].record
    assert run.sync.round == other.round >= PRE_ROUNDS + 3
    assert run.reader().verify().ok
    run.still_readable(run.before)
    run.goes_on(3, other)


def test_two_copies_of_a_learner_publish_the_same_fragment(run: HostileRun) -> None:
    """A second incarnation of learner-0 (a copy that did not die) publishes beside the first:
    at most one contribution of learner-0 is merged per round, the others are recorded."""
    twin = RecipeLearner(run.backend.open(fresh=True, role=LearnerStore), "learner-0", log=lambda _: None)
    run.learners.append(twin)
    run._seen[id(twin)] = run.sync.round
    done = run.goes_on(4)
    for s in done:
        ids = [a.learner_id for a in s.record.accepted]
        assert ids.count("learner-0") <= 1, (s.record.round, ids)
    keys_of_0 = {k for s in done for k in s.record.rejected if "/learner-0/" in k}
    kinds = {s.record.rejected[k].kind for s in done for k in s.record.rejected if k in keys_of_0}
    assert kinds <= {RejectionKind.SUPERSEDED, RejectionKind.DUPLICATE, RejectionKind.LATE}, kinds
    run.still_readable(run.before)


def test_committed_blobs_are_out_of_a_learners_reach(run: HostileRun) -> None:
    """A learner that PUTs over a committed state blob under its own
    prefix changes nothing (committed state lives under sync/); a PUT under sync/blobs/ (which
    the bucket policy forbids) is detected by verify() naming the object."""
    rec: CommitRecord = run.before[-1]
    sha = rec.state[rec.fragment].params.sha256
    run.put(f"learners/evil/blobs/sha256/{sha}.safetensors", b"overwritten")
    run.goes_on()
    assert run.reader().verify().ok
    run.put(paths.blob_key(sha), b"overwritten")
    report = run.reader().verify()
    assert not report.ok and any(paths.blob_key(sha) in p for p in report.problems)
    run.still_readable(run.before)


def test_control_run_without_attack_verifies(run: HostileRun) -> None:
    """A control: a run under no attack verifies end to end after more rounds."""
    run.goes_on()
    assert run.reader().verify().ok
    assert isinstance(run.reader(), RunReader)
    assert set(HONEST) <= set(run.store.learner_ids())
