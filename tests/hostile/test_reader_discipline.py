"""One reader discipline, and repairs that restore what an integrity failure touches: each test
names one way a bucket object used to stop a command (a damaged past commit, a forged checkpoint
folder, one learner's non-plain object, a FIFO where a record was, a malformed checkpoint config,
a rejected record that is gone or lies about its learner), and checks that the command now skips
it with a reason and carries on. Local folders for all; moto's S3 for the repair and retention
ones (the others plant what only a filesystem has: FIFOs and folders)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hostile_helpers import HONEST, Backend, HostileRun

from atoll.runs.contributions import contribution_rows
from atoll.runs.goodput import GoodputTracker
from atoll.runs.report import check_run, run_status
from atoll.storage import LearnerStore, SynchronizerStore, paths
from atoll.storage.codec import dump_record
from atoll.storage.integrity import IntegrityError, Keyring, seal
from atoll.storage.operator_side import OperatorStore
from atoll.storage.records import KIND_CHECKPOINT
from atoll.storage.retention import CHECKPOINT, RetentionPolicy, apply_prune, plan_prune
from atoll.storage.validation import InvalidInput
from atoll.train.inner import RecipeLearner
from atoll.train.run import load_recipe

NOW_LATER = time.time() + 10 * 86400
"""A prune's clock far enough ahead that every object is old enough to go."""


def _flip_one_bit(run: HostileRun, round_: int) -> None:
    data = bytearray(run.commit_bytes(round_))
    data[len(data) // 2] ^= 0x01
    run.put(paths.commit_key(round_), bytes(data))


@pytest.mark.parametrize("victim", [1, 2])
def test_a_damaged_past_commit_leaves_a_run_every_process_can_start(backend: Backend, victim: int) -> None:
    """One flipped bit in a past round's commit record (round 1 included): the recipe loads for
    every role, a new learner and a restarted synchronizer start, rounds go on, ``atoll status``
    and the resume check read the run, and ``atoll verify`` reports the void slot."""
    run = HostileRun(backend)
    run.rounds(4)
    _flip_one_bit(run, victim)
    assert load_recipe(run.reader(fresh=True)).learners  # the supervisor's and learners' first read
    check_run(run.reader(fresh=True))  # what resuming needs
    assert run_status(run.reader(fresh=True))
    RecipeLearner(run.backend.open(role=LearnerStore), HONEST[0], log=lambda _: None)
    run.sync = run.new_synchronizer(fresh=True)
    assert run.sync.round == 4
    run.goes_on(2)
    report = run.reader(fresh=True).verify()
    assert report.void == [victim] and report.latest == 6
    assert any(paths.commit_key(victim) in p for p in report.problems)
    handle = run.reader(fresh=True)
    handle.checked_manifest()
    assert victim != 1 or any(s.key == paths.commit_key(1) for s in handle.skipped)


def test_a_rewritten_run_json_is_still_refused_when_round_1_is_sealed(backend: Backend) -> None:
    """The void-round-1 allowance is for damage only: a sealed round 1 that links to other bytes
    than run.json's (run.json rewritten) still refuses the recipe, even with a damaged copy beside it."""
    run = HostileRun(backend)
    run.rounds(2)
    body = json.loads(run.store.store.get(paths.RUN_MANIFEST))
    body.pop("schema"), body.pop("schema_version")
    body["extra"]["recipe"]["model"] = "evil_module:build"
    run.put(paths.RUN_MANIFEST, dump_record("atoll/run", body))
    with pytest.raises(IntegrityError, match="does not match the chain"):
        load_recipe(run.reader(fresh=True))


def _checkpoint_run(backend: Backend, *, keyed: bool) -> tuple[HostileRun, OperatorStore, list[int]]:
    run = HostileRun(backend, keyed=keyed)
    keyring = Keyring(run.keys)
    sync = run.backend.open(keyring=keyring, role=SynchronizerStore)
    real = []
    for _ in range(2):
        run.rounds(1)
        real.append(sync.write_checkpoint().round)
    return run, run.backend.open(keyring=keyring, role=OperatorStore), real


@pytest.mark.parametrize("keyed", [False, True])
def test_prune_counts_only_checkpoints_that_verify(backend: Backend, keyed: bool) -> None:
    """Newer checkpoint folders holding a forged ``config.json`` (an empty record; a sealed copy
    of a real one with no model; one naming another round; unsigned in a keyed run) are never
    counted as complete: ``keep_checkpoints=1`` keeps the newest real, signed one, and each fake
    is reported as skipped."""
    run, operator, real = _checkpoint_run(backend, keyed=keyed)
    good = json.loads(run.store.store.get(paths.checkpoint_config_key(real[-1])))
    good.pop("schema"), good.pop("schema_version")
    model = run.store.store.get(paths.checkpoint_model_key(real[-1]))
    fakes = {
        900: dump_record(KIND_CHECKPOINT, {}),
        901: dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, {**good, "round": 901})),  # no model beside it
        902: dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, good)),  # round 2's config in round 902's folder
        903: dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, {**good, "round": 903, "model": "x"})),
    }
    for r, config in fakes.items():
        run.put(paths.checkpoint_config_key(r), config)
        if r != 901:
            run.put(paths.checkpoint_model_key(r), model)
    plan = plan_prune(operator, RetentionPolicy(keep_rounds=4, keep_checkpoints=1), now=NOW_LATER)
    deleted = {d.key for d in plan.deletes if d.what == CHECKPOINT}
    assert paths.checkpoint_config_key(real[-1]) not in deleted and paths.checkpoint_model_key(real[-1]) not in deleted
    assert paths.checkpoint_model_key(real[0]) in deleted  # the older real one goes: superseded
    skipped = {s.key for s in plan.skipped}
    assert {paths.checkpoint_config_key(r) for r in (900, 902, 903)} <= skipped
    # unsigned in a keyed run: its config is refused first; else the missing model is named
    assert (paths.checkpoint_config_key(901) if keyed else paths.checkpoint_model_key(901)) in skipped
    apply_prune(operator, plan)
    assert run.backend.open(keyring=Keyring(run.keys), read_only=True).load_checkpoint(real[-1])


def test_prune_skips_an_unsigned_checkpoint_in_a_signed_run(backend: Backend) -> None:
    """A keyed run: a newer checkpoint whose config is a real one resealed without the signature
    (digest recomputed) does not count; the signed one is kept."""
    run, operator, real = _checkpoint_run(backend, keyed=True)
    good = json.loads(run.store.store.get(paths.checkpoint_config_key(real[-1])))
    good.pop("schema"), good.pop("schema_version")
    run.put(paths.checkpoint_config_key(950), dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, {**good, "round": 950})))
    run.put(paths.checkpoint_model_key(950), run.store.store.get(paths.checkpoint_model_key(real[-1])))
    plan = plan_prune(operator, RetentionPolicy(keep_rounds=4, keep_checkpoints=1), now=NOW_LATER)
    deleted = {d.key for d in plan.deletes}
    assert paths.checkpoint_model_key(real[-1]) not in deleted
    assert paths.checkpoint_config_key(950) in {s.key for s in plan.skipped}


@pytest.mark.parametrize("what", ["fifo", "folder", "link"])
def test_one_learners_non_plain_object_does_not_stop_prune(tmp_path: Path, what: str) -> None:
    """A FIFO, a folder where an object belongs, or a link in one learner's own prefix: prune
    names that learner as skipped (none of its objects deleted) and plans everyone else's."""
    run = HostileRun(Backend("local", str(tmp_path / "run"), {}))
    run.rounds(8)
    run.store.take_learner_lease("evil")
    bad = run.backend.path(paths.learner_prefix("evil") + "contributions/f0000/b00000000/evil.s0000000002." + "a" * 16 + ".json")
    bad.parent.mkdir(parents=True, exist_ok=True)
    if what == "fifo":
        os.mkfifo(bad)
    elif what == "folder":
        bad.mkdir()
    else:
        os.symlink(tmp_path, bad)
    operator = run.backend.open(role=OperatorStore)
    plan = plan_prune(operator, RetentionPolicy(keep_rounds=4), now=NOW_LATER)
    assert [s.key for s in plan.skipped] == [paths.learner_prefix("evil")]
    assert not any(d.key.startswith(paths.learner_prefix("evil")) for d in plan.deletes)
    assert any(d.key.startswith(paths.learner_prefix(HONEST[0])) for d in plan.deletes)
    assert any("evil" in line and "skipped" in line for line in plan.table())
    apply_prune(operator, plan)
    assert run.reader(fresh=True).verify().ok


def test_status_survives_a_merged_record_turned_into_a_fifo(tmp_path: Path) -> None:
    """A learner turns its own merged contribution record into a FIFO: ``atoll status``, goodput
    and the plots' tracker read the run on every later call."""
    run = HostileRun(Backend("local", str(tmp_path / "run"), {}))
    run.rounds(3)
    key = next(a.key for r in run.committed() for a in r.accepted)
    path = run.backend.path(key)
    path.unlink()
    os.mkfifo(path)
    for _ in range(2):
        lines = run_status(run.reader(fresh=True))
        assert any("rounds committed" in line for line in lines)
        tracker = GoodputTracker(run.reader(fresh=True))
        tracker.update()


@pytest.mark.parametrize("what", ["fifo", "folder"])
def test_resume_falls_back_over_a_non_plain_state_object(tmp_path: Path, what: str) -> None:
    """The latest committed state object of a fragment becomes a FIFO or a folder:
    ``read_global_state`` (resume) falls back to the fragment's older version and says so."""
    run = HostileRun(Backend("local", str(tmp_path / "run"), {}))
    run.rounds(4)
    reader = run.reader(fresh=True)
    latest = reader.read_commit(reader.latest_round())
    assert latest is not None
    ref = latest.state[latest.fragment].params
    path = run.backend.path(paths.blob_key(ref.sha256))
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    state = run.reader(fresh=True).read_global_state()
    assert latest.fragment in state.restored
    check_run(run.reader(fresh=True))


def test_load_checkpoint_on_a_malformed_config_is_typed(backend: Backend) -> None:
    """A checkpoint config whose ``model`` is not an object, or is a folder/oversized/garbage:
    ``load_checkpoint`` raises atoll's typed InvalidInput, never a raw AttributeError."""
    run = HostileRun(backend)
    run.rounds(1)
    sync = SynchronizerStore.beside(run.store)
    round_ = sync.write_checkpoint().round
    key = paths.checkpoint_config_key(round_)
    good = json.loads(run.store.store.get(key))
    good.pop("schema"), good.pop("schema_version")
    for body in ({**good, "model": "x"}, {**good, "model": {"sha256": 7}}, {**good, "model": {**good["model"], "nbytes": -1}}):
        run.put(key, dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, body)))
        with pytest.raises(InvalidInput):
            run.reader(fresh=True).load_checkpoint(round_)
    run.put(key, b"\xff not json")
    with pytest.raises(InvalidInput):
        run.reader(fresh=True).load_checkpoint(round_)


def test_status_names_the_prefix_owner_of_a_rejected_row(tmp_path: Path) -> None:
    """A rejected contribution of learner ``node.s1`` (an id with ``.s`` in it) whose record is
    then deleted, and another learner's rejected record rewritten to claim ``learner-0``: the
    status table names the owner of each key's prefix."""
    run = HostileRun(Backend("local", str(tmp_path / "run"), {}))
    run.rounds(1)
    gone = run.contribution(learner_id="node.s1", write_payload=False)  # no payload: rejected
    liar = run.contribution(learner_id="evil", write_payload=False)
    run.rounds(2)
    run.rejection(gone), run.rejection(liar)  # both recorded as rejected
    run.store.store.delete(gone)
    body = json.loads(run.store.store.get(liar))
    body.pop("schema"), body.pop("schema_version")
    run.put(liar, dump_record("atoll/contribution", seal("atoll/contribution", {**body, "learner_id": "learner-0"})))
    named: dict[str, str] = {}
    for record in run.reader().history():
        rows = contribution_rows(run.reader(fresh=True), record)[len(record.accepted):]
        named.update(zip(sorted(record.rejected), (r.learner for r in rows), strict=True))
    assert named[gone] == "node.s1"
    assert named[liar] == "evil"
