"""The trust boundary's findings, each made impossible or harmless, on a local folder and moto's
S3 server: a confined learner's own heartbeat, lease or records with absurd numbers, links inside
the run under retention, a void past slot, a chain with a gap, signatures replayed across runs,
reserved ids and a rewritten run.json."""

from __future__ import annotations

import json
import os
import time

import pytest
from hostile_helpers import HONEST, PRE_ROUNDS, Backend, HostileRun

from atoll.storage import SynchronizerStore, paths
from atoll.storage import liveness as lc
from atoll.storage.codec import dump_record, sha256_hex

HUGE = "1" + "0" * 400  # a 400-digit integer, spelled in JSON




def local_only(backend: Backend) -> None:
    if not backend.local:
        pytest.skip("a local-filesystem attack: object stores have no FIFOs or symlinks")


def _raw_record(kind: str, fields: str) -> bytes:
    """A record with fields spelled by hand (numbers no JSON writer of ours would produce)."""
    return ('{"schema":"%s","schema_version":3,%s}' % (kind, fields)).encode()


# -- a learner's own heartbeat and lease with a 400-digit integer --------------------------------
@pytest.mark.parametrize("where", ["heartbeat-time", "heartbeat-step", "lease-started", "lease-pid"])
def test_huge_integer_in_own_liveness_records_is_skipped(run: HostileRun, where: str) -> None:
    lid = HONEST[0]
    lease = run.store.take_learner_lease(lid)
    run.store.write_heartbeat(lease)
    n = lease.incarnation
    if where.startswith("heartbeat"):
        field = "time" if where == "heartbeat-time" else "step"
        values = {"time": "1.5", "step": "3"}
        values[field] = HUGE
        body = (f'"holder":"{lid}","incarnation":{n},"status":"alive","reason":"","round":1,'
                f'"time":{values["time"]},"step":{values["step"]}')
        run.put(paths.learner_heartbeat_key(lid, n), _raw_record(lc.KIND_HEARTBEAT, body))
    else:
        started, pid = ("1e400", "1") if where == "lease-started" else ("1.5", HUGE)
        body = (f'"holder":"{lid}","incarnation":{n + 1},"started_at":{started},"host":"h","pid":{pid},'
                f'"flow_run_id":null')
        run.put(paths.learner_lease_key(lid, n + 1), _raw_record(lc.KIND_LEASE, body))
    reader = run.reader(fresh=True)
    live = reader.learner_liveness(lid)  # raised OverflowError before
    assert live.problems, live
    assert not live.is_alive(time.time(), 60.0)  # an unusable heartbeat or lease is no sign of life
    # every reader that watches the fleet survives it
    got = reader.learners_liveness(HONEST)
    assert set(got) == set(HONEST)
    run.goes_on()


def test_huge_numbers_in_stop_marker_and_prune_record_are_skipped(run: HostileRun) -> None:
    run.put(paths.STOP, _raw_record(lc.KIND_STOP, f'"stopped":true,"reason":"x","by":"y","time":{HUGE}'))
    run.put(paths.PRUNE, _raw_record("atoll/prune", f'"through_round":{HUGE},"floors":[0,0],"pruned_at":1e400,'
                                                     f'"by":"x","deleted_objects":0,"deleted_bytes":0'))
    reader = run.reader(fresh=True)
    marker, why = reader.read_stop_marker()
    assert marker is None and why
    record, why = reader.read_prune_record()
    assert record is None and why
    report = reader.verify()
    assert report.verified == PRE_ROUNDS and any("prune.json" in p for p in report.problems)


# -- a void past slot: every reader skips it -------------------------------------------------------
def _make_void(run: HostileRun, round_: int, how: str) -> None:
    key = paths.commit_key(round_)
    if how == "garbage":
        run.put(key, b"not a commit record")
    elif how == "huge-int":
        run.put(key, run.commit_bytes(round_).replace(b'"round":', b'"round":' + HUGE.encode() + b",\"x\":", 1))
    elif how == "fifo":
        path = run.backend.path(key)
        path.unlink()
        os.mkfifo(path)
    else:  # a folder where the record belongs
        path = run.backend.path(key)
        path.unlink()
        path.mkdir()
        (path / "x").write_bytes(b"{}")


@pytest.mark.parametrize("how", ["garbage", "huge-int", "fifo", "folder"])
def test_void_past_slot_is_skipped_by_every_reader(run: HostileRun, backend: Backend, how: str) -> None:
    from atoll.runs.goodput import GoodputTracker
    from atoll.runs.report import run_status
    from atoll.train.fetcher import Fetcher

    if how in ("fifo", "folder"):
        local_only(backend)
    run.goes_on(2)
    latest = run.sync.round
    _make_void(run, 2, how)
    reader = run.reader(fresh=True)
    # a learner that had seen round 1 follows on past the void slot (it stalled there before)
    assert [r.round for r in reader.poll_commits(1)] == list(range(3, latest + 1))
    assert [s.key for s in reader.skipped] == [paths.commit_key(2)]
    fetcher = Fetcher(run.reader(fresh=True), 1, 0.01, versions=[0] * run.store.plan.num_fragments, log=lambda _: None)
    fetcher.poll_once()
    assert fetcher.latest_round == latest
    # status, goodput, history and verify skip it and name it
    status = run.reader(fresh=True)
    assert [r.round for r in status.history()] == [1, *range(3, latest + 1)]
    assert run_status(status)
    GoodputTracker(run.reader(fresh=True)).update()
    report = run.reader(fresh=True).verify()
    assert report.void == [2] and not report.ok and report.verified == latest - 1
    assert status.readable_commit(2) is None  # the recorder's read
    run.goes_on(1)


def test_verify_reports_a_gap_in_the_chain(run: HostileRun) -> None:
    run.goes_on(2)
    latest = run.sync.round
    data = run.commit_bytes(3)
    run.store.store.delete(paths.commit_key(3))
    report = run.reader(fresh=True).verify()
    assert report.latest == 2 and report.gaps == [3] and not report.ok, report  # passed as OK before
    assert any("gap in the chain" in p for p in report.problems)
    assert report.slots == latest - 1
    run.store.store.put(paths.commit_key(3), data)
    assert run.reader(fresh=True).verify().ok


# -- keys and ids ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lid", ["synchronizer", "Synchronizer", "operator", "atoll-operator", "sync"])
def test_reserved_ids_are_refused_everywhere(run: HostileRun, lid: str) -> None:
    import dataclasses

    from atoll.core.config import ConfigError
    from atoll.storage.validation import InvalidInput
    from atoll.train.recipe import smoke_recipe

    _, recipe = smoke_recipe(2, max_rounds=10)
    with pytest.raises((InvalidInput, ConfigError, ValueError), match="reserved"):
        dataclasses.replace(recipe.learners[0], learner_id=lid)  # recipes, so create_run
    with pytest.raises(InvalidInput, match="reserved"):
        run.store.take_learner_lease(lid)  # join and the learner flow take a lease first
    with pytest.raises(InvalidInput, match="reserved"):
        paths.learner_prefix(lid)  # every key of a learner: publish, state, heartbeats
    # a prefix planted under the name is no learner: never listed, its records never read
    if lid == lid.lower():
        run.put(f"learners/{lid}/leases/00000001.json", b"{}")
        assert lid not in run.reader().learner_ids()
    run.goes_on(1)


def test_signatures_bind_the_run_id(backend: Backend) -> None:
    """Two runs share a keyring: a contribution or a commit signed in run A and copied into run B
    under the same key is a bad signature or a void slot there (both verified before)."""
    from atoll.core.rejection import RejectionKind

    a = HostileRun(backend, keyed=True)
    b = HostileRun(Backend(backend.name, backend.root + "-b", backend.storage_options), keyed=True)
    a.rounds(2)
    src, dst = a.store.store, b.store.store
    record_key = _any_contribution(src, HONEST[0])
    body = json.loads(src.get(record_key))
    p, v, sha = body["fragment"], body["base_version"], body["payload"]["sha256"]
    assert record_key in {r.key for r in a.new_synchronizer().store.list_contributions(p, v).records}
    dst.put(paths.blob_key(sha, HONEST[0]), src.get(paths.blob_key(sha, HONEST[0])))
    dst.put(record_key, src.get(record_key))
    listing = b.new_synchronizer().store.list_contributions(p, v, learner_ids=[HONEST[0]])
    assert record_key in listing.rejected, listing
    assert listing.rejected[record_key].kind is RejectionKind.BAD_SIGNATURE


def _any_contribution(store: object, lid: str) -> str:
    """The key of one contribution record of learner ``lid`` (a walk of its prefix)."""
    top = paths.learner_contributions_prefix(lid)
    for f in store.list(top):  # type: ignore[attr-defined]
        for b in store.list(f"{top}{f}/"):  # type: ignore[attr-defined]
            names = store.list(f"{top}{f}/{b}/")  # type: ignore[attr-defined]
            if names:
                return f"{top}{f}/{b}/{names[0]}"
    raise AssertionError(f"{lid} published nothing")


def test_a_rewritten_run_json_is_never_acted_on(backend: Backend) -> None:
    """run.json rewritten to run another command and import another model module: with a keyring
    its signature fails; once round 1 is committed the chain fails too; load_recipe (what learner
    hosts and the synchronizer act on) raises before returning anything of it."""
    from atoll.storage.integrity import IntegrityError, Keyring
    from atoll.train.run import load_recipe

    keyed = HostileRun(backend, keyed=True)
    plain = HostileRun(Backend(backend.name, backend.root + "-plain", backend.storage_options))
    plain.rounds(1)  # round 1 links to run.json's bytes
    for r, keyring in ((keyed, Keyring(keyed.keys)), (plain, Keyring())):
        body = json.loads(r.store.store.get(paths.RUN_MANIFEST))
        body.pop("schema"), body.pop("schema_version")
        body["extra"]["recipe"]["learners"][0]["command"] = ["sh", "-c", "echo pwned"]
        body["extra"]["recipe"]["model"] = "evil_module:build"
        r.store.store.put(paths.RUN_MANIFEST, dump_record("atoll/run", body))
        handle = r.backend.open(keyring=keyring, read_only=True)
        with pytest.raises(IntegrityError):
            load_recipe(handle)
    # the untouched runs pass the same check
    fresh = HostileRun(Backend(backend.name, backend.root + "-ok", backend.storage_options), keyed=True)
    assert load_recipe(fresh.backend.open(keyring=Keyring(fresh.keys), read_only=True)).learners


def test_stop_marker_and_retention_record_are_signed_for_a_keyed_run(backend: Backend) -> None:
    """With a keyring, stop.json and prune.json carry the synchronizer's signature for the run:
    one written by anyone without the key (or copied from another run) is ignored with a reason
    by whoever holds the key; a handle without the key cannot write one the run would ignore."""
    from atoll.storage.integrity import Keyring, seal
    from atoll.storage.records import PruneRecord

    run = HostileRun(backend, keyed=True)
    run.rounds(1)
    sync = run.backend.open(keyring=Keyring(run.keys), role=SynchronizerStore)
    stop = {"stopped": True, "reason": "forged", "by": "x", "time": time.time()}
    prune = PruneRecord(through_round=1, floors=(1, 1), pruned_at=time.time(), by="x", deleted_objects=0,
                        deleted_bytes=0).to_dict()
    # with a correct digest (anyone can compute one), without the key's signature
    forged_stop, forged_prune = dump_record(lc.KIND_STOP, seal(lc.KIND_STOP, stop)), \
        dump_record("atoll/prune", seal("atoll/prune", prune))
    run.put(paths.STOP, forged_stop)
    run.put(paths.PRUNE, forged_prune)
    marker, why = sync.read_stop_marker()
    assert marker is None and why is not None and "not signed" in why, why
    prune, why = sync.read_prune_record()
    assert prune is None and why is not None and "not signed" in why, why
    run.put(paths.STOP, dump_record(lc.KIND_STOP, stop))  # no seal at all: the same
    assert sync.read_stop_marker()[0] is None
    run.goes_on(1)  # the synchronizer does not stop on the forged marker
    with pytest.raises(PermissionError, match="ATOLL_KEYRING"):
        run.backend.open(role=SynchronizerStore).mark_stopped("no key", by="operator")
    # written with the key: honoured; the same bytes in another keyed run are not (the run id)
    sync.mark_stopped("done", by="operator")
    marker, why = sync.read_stop_marker()
    assert marker is not None and marker.stopped and why is None
    other = HostileRun(Backend(backend.name, backend.root + "-b", backend.storage_options), keyed=True)
    other.put(paths.STOP, run.store.store.get(paths.STOP))
    marker, why = other.backend.open(keyring=Keyring(other.keys)).read_stop_marker()
    assert marker is None and why is not None and "signature does not verify" in why, why
    # an unkeyed run keeps plain markers (a digest, checked when present)
    plain = HostileRun(Backend(backend.name, backend.root + "-plain", backend.storage_options))
    SynchronizerStore.beside(plain.store).mark_stopped("done", by="operator")
    assert plain.store.stop_marker() is not None


def test_a_rewritten_checkpoint_config_is_refused_with_the_key(backend: Backend) -> None:
    """A checkpoint's config.json rewritten to point at other weights (model file and sha256 both
    replaced, digest recomputed): with the synchronizer's key, load_checkpoint raises before it
    reads the model; the untouched checkpoint loads."""
    from atoll.storage.integrity import IntegrityError, Keyring, seal

    run = HostileRun(backend, keyed=True)
    run.rounds(2)
    sync = run.backend.open(keyring=Keyring(run.keys), role=SynchronizerStore)
    info = sync.write_checkpoint()
    round_ = sync.list_checkpoints()[-1]
    assert sync.load_checkpoint(round_)
    cfg_key, model_key = paths.checkpoint_config_key(round_), paths.checkpoint_model_key(round_)
    body = json.loads(run.store.store.get(cfg_key))
    kind = body.pop("schema")
    body.pop("schema_version")
    run.put(model_key, run.store.store.get(model_key)[:-8] + b"\0" * 8)  # other weights ...
    body["model"]["sha256"] = sha256_hex(run.store.store.get(model_key))  # ... and their sha256
    run.put(cfg_key, dump_record(kind, seal(kind, body)))  # a correct digest, no signature
    with pytest.raises(IntegrityError, match="not signed"):
        sync.load_checkpoint(round_)
    assert info.round == round_
