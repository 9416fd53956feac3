"""The integrity chain and signatures: what a corrupt or forged commit and an unsigned contribution
do, on a local folder and on moto's S3 server (memory and GCS run the same code paths).

Each attack asserts its outcome (detected with an error naming the object, or rejected with a
kind) and that the committed history stays readable.
"""

from __future__ import annotations

import json

import pytest
import torch
from storage_helpers import counters, fragment_delta, init_run

from atoll.core.rejection import RejectionKind
from atoll.storage import LearnerStore, SynchronizerStore, paths
from atoll.storage.codec import dump_record, load_record
from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, IntegrityError, Keyring, seal
from atoll.storage.records import KIND_COMMIT, KIND_CONTRIBUTION
from atoll.storage.validation import LayoutError, ReadOnlyError

KEYS = Keyring({SYNCHRONIZER_KEY_ID: b"s" * 32, "l0": b"0" * 32, "l1": b"1" * 32})


@pytest.fixture
def run(hostile_backend):
    backend = hostile_backend
    url = backend.new_url()
    rs = backend.open(url, role=SynchronizerStore)
    init_run(rs)
    return backend, url, rs


def _commit(rs, r: int, fragment: int) -> None:
    state = rs.read_global_state()
    params = {n: t + 0.01 * r for n, t in state.params.items() if n in rs.plan.fragments[fragment]}
    assert rs.commit_round(r, fragment, params=params).won


def _rewrite(backend, url: str, key: str, edit) -> None:
    body = load_record(backend.raw_get(url, key), KIND_COMMIT)
    backend.raw_put(url, key, dump_record(KIND_COMMIT, edit(body)))


def test_a_flipped_digit_in_a_commit_is_detected_and_named(run):
    backend, url, rs = run
    _commit(rs, 1, 0)
    key = paths.commit_key(1)
    data = backend.raw_get(url, key)
    flipped = data.replace(b'"round":1', b'"round":7') if b'"round":1' in data else None
    assert flipped is not None
    backend.raw_put(url, key, flipped)
    reader = backend.open(url)
    with pytest.raises(IntegrityError, match=r"00000001\.json.*digest") as ei:
        reader.read_commit(1)
    assert ei.value.url.endswith("sync/commits/00000001.json")
    assert reader.latest_round() == 0  # a void slot is never used


def test_an_overwritten_older_commit_breaks_the_chain(run):
    backend, url, rs = run
    _commit(rs, 1, 0)
    _commit(rs, 2, 1)
    # A forger rewrites round 1 and recomputes its digest: the digest alone cannot tell ...
    _rewrite(backend, url, paths.commit_key(1), lambda b: seal(KIND_COMMIT, {**b, "committed_by": "forger"}))
    reader = backend.open(url)
    assert reader.read_commit(1).committed_by == "forger"
    # ... but round 2 links to the bytes round 1 had when it was committed.
    with pytest.raises(IntegrityError, match="chain broken"):
        reader.read_commit(2)


def test_a_forged_next_commit_is_refused_with_a_keyring_and_the_round_is_repaired(run):
    backend, url, rs = run
    signed = backend.open(url, keyring=KEYS, role=SynchronizerStore)
    _commit(signed, 1, 0)
    # A learner writes round 2 itself: chained correctly and sealed, but it has no synchronizer key.
    forged = dict(load_record(backend.raw_get(url, paths.commit_key(1)), KIND_COMMIT))
    from atoll.storage.codec import sha256_hex
    forged.update(round=2, fragment=1, committed_by="l0", prev_sha256=sha256_hex(backend.raw_get(url, paths.commit_key(1))))
    backend.raw_put(url, paths.commit_key(2), dump_record(KIND_COMMIT, seal(KIND_COMMIT, forged, b"0" * 32)))
    sync = backend.open(url, keyring=KEYS, role=SynchronizerStore)
    assert sync.latest_round() == 1
    with pytest.raises(IntegrityError, match="signature does not verify"):
        sync.read_commit(2)
    # The synchronizer commits round 2 to a repair slot; every keyed reader uses the repair.
    _commit(sync, 2, 1)
    again = backend.open(url, keyring=KEYS, role=SynchronizerStore)
    assert again.latest_round() == 2 and again.read_commit(2).committed_by == "synchronizer"
    assert backend.raw_get(url, paths.repair_key(2, 1)) is not None
    _commit(again, 3, 0)  # and the run goes on, chained through the repair
    assert backend.open(url, keyring=KEYS).latest_round() == 3


def test_contributions_must_be_signed_when_the_run_has_keys(run):
    backend, url, rs = run
    l0 = backend.open(url, keyring=Keyring({"l0": b"0" * 32}), role=LearnerStore)
    good = l0.publish_contribution("l0", 0, 0, counters(), fragment_delta(rs, 0, seed=1))
    unkeyed = backend.open(url, keyring=Keyring(), role=LearnerStore)  # a learner with no key
    unsigned = unkeyed.publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0, seed=2))
    wrong = backend.open(url, keyring=Keyring({"l2": b"1" * 32}), role=LearnerStore)  # l2 signs with l1's key? no: l2 has no entry
    stranger = wrong.publish_contribution("l2", 0, 0, counters(), fragment_delta(rs, 0, seed=3))
    listing = backend.open(url, keyring=KEYS).list_contributions(0, 0)
    assert [r.key for r in listing.records] == [good.key]
    assert listing.rejected[unsigned.key].kind is RejectionKind.BAD_SIGNATURE
    assert "not signed" in listing.rejected[unsigned.key].detail
    assert listing.rejected[stranger.key].kind is RejectionKind.BAD_SIGNATURE
    # Without keys, all three are listed.
    assert len(backend.open(url, keyring=Keyring()).list_contributions(0, 0).records) == 3


def test_a_record_outside_its_learners_prefix_is_rejected(run):
    backend, url, rs = run
    rec = LearnerStore.beside(rs).publish_contribution("l0", 0, 0, counters(), fragment_delta(rs, 0))
    body = load_record(backend.raw_get(url, rec.key), KIND_CONTRIBUTION)
    # l1 copies l0's record into its own prefix under l0's name.
    key = paths.contributions_prefix(0, 0, "l1") + rec.key.rsplit("/", 1)[-1]
    backend.raw_put(url, key, dump_record(KIND_CONTRIBUTION, seal(KIND_CONTRIBUTION, body)))
    listing = backend.open(url).list_contributions(0, 0)
    assert listing.rejected[key].kind is RejectionKind.SCHEMA
    assert [r.key for r in listing.records] == [rec.key]


def test_read_only_handles_write_nothing(run):
    backend, url, rs = run
    ro = backend.open(url, read_only=True, role=LearnerStore)
    assert ro.latest_round() == 0
    with pytest.raises(ReadOnlyError, match="read-only"):
        ro.publish_contribution("l0", 0, 0, counters(), fragment_delta(rs, 0))
    with pytest.raises(ReadOnlyError, match="read-only"):
        SynchronizerStore.beside(ro).commit_round(1, 0, params=None)
    assert ro.list_contributions(0, 0).records == []


def test_an_old_layout_run_is_refused_clearly(run):
    backend, url, rs = run
    doc = json.loads(backend.raw_get(url, paths.RUN_MANIFEST))
    doc["schema_version"] = 2
    backend.raw_put(url, paths.RUN_MANIFEST, json.dumps(doc).encode())
    with pytest.raises(LayoutError, match="bucket layout 1.*Start a new run"):
        _ = backend.open(url).manifest


def test_global_state_lives_where_no_learner_writes(run):
    backend, url, rs = run
    _commit(rs, 1, 0)
    rec = LearnerStore.beside(rs).publish_contribution("l0", 0, 1, counters(), fragment_delta(rs, 0))
    state = rs.read_commit(1).state
    for st in state:
        assert backend.raw_get(url, paths.blob_key(st.params.sha256)) is not None  # sync/blobs
    assert backend.raw_get(url, paths.blob_key(rec.payload.sha256, "l0")) is not None  # learners/l0/blobs
    assert paths.learner_of_key(paths.blob_key(state[0].params.sha256)) is None
    got = backend.open(url).read_global_state()
    assert all(torch.isfinite(t).all() for t in got.params.values())


def test_verify_walks_the_chain_and_names_what_is_wrong(run):
    backend, url, rs = run
    for r, p in ((1, 0), (2, 1), (3, 0)):
        _commit(rs, r, p)
    report = backend.open(url, read_only=True).verify()
    assert report.ok and report.latest == 3 and report.verified == 3
    # Destroy a committed state object and forge round 2's record.
    blob = paths.blob_key(rs.read_commit(3).state[0].params.sha256)
    backend.raw_put(url, blob, b"\0" * 10)
    _rewrite(backend, url, paths.commit_key(2), lambda b: {**b, "committed_by": "forger"})
    report = backend.open(url, read_only=True).verify()
    assert not report.ok and report.void == [2]
    text = "\n".join(report.problems)
    assert "00000002.json: digest does not match" in text
    assert "round 3 state" in text and ("checksum" in text or "truncated" in text)
