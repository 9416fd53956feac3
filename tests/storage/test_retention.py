"""Retention (``atoll prune``) on real runs: what it deletes, what it keeps, and that the run trains on.

Runs are trained by the real Learner and Synchronizer objects on the virtual clock
(:func:`atoll.train.virtual.run_virtual`), on each backend. Objects are made "old" by planning
with a clock two hours ahead (``now=``), never by sleeping.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from atoll.storage import (
    ContributionRecord,
    LearnerStore,
    OperatorStore,
    PrunedError,
    RunHandle,
    RunReader,
    SynchronizerStore,
)
from atoll.storage import paths as P
from atoll.storage.paths import to_url
from atoll.storage.retention import (
    CHECKPOINT,
    CONTRIBUTION,
    GLOBAL_STATE,
    LEARNER_PAYLOAD,
    PROBE,
    NotPlainObjectError,
    PruneItem,
    PrunePlan,
    RetentionPolicy,
    RetentionRefused,
    apply_prune,
    key_class,
    plan_prune,
)
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual
from conftest import Backend

LATER = 2 * 3600.0  # plan "two hours from now": everything written so far is old enough


def _train(store: RunHandle, rounds: int) -> None:
    """About ``rounds`` more rounds (two per round's worth of tokens with K = 1 and P = 2)."""
    from atoll.train.run import load_recipe

    recipe = load_recipe(store)
    per_round = sum(s.batch_size for s in recipe.learners) * 64 * store.config.inner_steps
    run_virtual(SynchronizerStore.beside(store), token_budget=max(1, rounds // 2) * per_round)
    # The virtual driver keeps inner state in memory; save it the way a learner process does, twice
    # (each save writes a new payload: the first one is replaced).
    import torch

    learners = LearnerStore.beside(store)
    for i, spec in enumerate(recipe.learners):
        for step in (1, 2):
            learners.save_learner_state(spec.learner_id, {"adamw.w.exp_avg": torch.full((64,), float(i + step))},
                                     {"step": step})


def _recipe(checkpoint_every: int = 4) -> tuple[Any, Any]:
    config, recipe = smoke_recipe(3, max_rounds=100_000)
    return config, dataclasses.replace(recipe, checkpoint_every_rounds=checkpoint_every)


def _new_run(url: str) -> SynchronizerStore:
    return create_run(url, *_recipe())


def _init(store: RunHandle) -> SynchronizerStore:
    """A new run through a store the backend fixture opened (the GCS emulator needs its open options)."""
    return create_run(store, *_recipe())


def _keys(store: RunHandle, prefix: str = "") -> set[str]:
    """Every object under ``prefix`` (a walk with the store's own LISTs)."""
    out: set[str] = set()
    for info in store.store.list_info(prefix):
        key = prefix + info.name
        if info.is_dir:
            out |= _keys(store, key + "/")
        else:
            out.add(key)
    return out


def _contribution_keys(store: RunHandle) -> set[str]:
    return {k for k in _keys(store, P.LEARNERS_PREFIX) if "/contributions/" in k}


def test_prune_keeps_what_training_needs_and_the_run_trains_on(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    store = _new_run(url)
    _train(store, 40)
    run = OperatorStore.open(url)
    latest = run.latest_round()
    assert latest >= 30
    before = _keys(run)
    policy = RetentionPolicy(keep_rounds=6, keep_checkpoints=2)
    plan = plan_prune(run, policy, now=time.time() + LATER)
    for what in (GLOBAL_STATE, CONTRIBUTION, LEARNER_PAYLOAD, CHECKPOINT):
        assert plan.deleted(what)[0] > 0, what
    assert plan.through_round == latest - 6 and len(plan.floors) == 2
    assert {d.key for d in plan.deletes} <= before
    record = apply_prune(run, plan, by="test")
    after = _keys(run)
    assert after == before - {d.key for d in plan.deletes} | {P.PRUNE}
    assert record.deleted_objects == len(plan.deletes) and record.deleted_bytes == plan.bytes > 0

    fresh = RunReader.open(url)
    # Every commit record is still there and the chain verifies; deleted state is reported as such.
    assert all(P.commit_key(r) in after for r in range(1, latest + 1))
    report = fresh.verify()
    assert report.ok, report.problems
    assert report.verified == latest and report.pruned > 0 and report.prune == record
    # The head and the window read back; an old round is a clear error, not silently version 0.
    assert fresh.read_global_state().round == latest
    assert fresh.read_global_state(plan.through_round + 1).restored == {}
    with pytest.raises(PrunedError, match="retention floor"):
        fresh.read_global_state(2)
    # Two complete checkpoints are left, the newest ones, and they load.
    ckpts = fresh.list_checkpoints()
    assert len(ckpts) == 2 and ckpts[-1] == max(int(k.split("/")[2]) for k in before if "/checkpoints/" in k)
    assert fresh.load_checkpoint(ckpts[-1])
    # Every learner still rejoins from its saved inner state.
    for lid in fresh.learner_ids():
        assert fresh.load_learner_state(lid) is not None
    # No contribution below a floor is left, and every one at or above it kept its payload.
    for key in _contribution_keys(fresh):
        fragment, base = int(key.split("/f")[1][:4]), int(key.split("/b")[1][:8])
        assert base >= plan.floors[fragment], key
        rec = fresh._read_contribution_record(key)
        assert isinstance(rec, ContributionRecord) and fresh.load_contribution(rec).delta

    # The run trains on: learners rejoin, rounds merge contributions, the chain still verifies.
    _train(fresh, 12)
    resumed = OperatorStore.open(url)
    assert resumed.latest_round() > latest
    new = resumed.history(latest + 1)
    assert sum(len(r.accepted) for r in new) >= len(new) and all(r.updated for r in new)
    report = resumed.verify()
    assert report.ok and report.verified == resumed.latest_round(), report.problems

    # A second prune only moves forward: floors never go down, counts add up.
    again = plan_prune(resumed, policy, now=time.time() + LATER)
    second = apply_prune(resumed, again, by="test")
    assert all(a >= b for a, b in zip(second.floors, record.floors, strict=True))
    assert second.deleted_objects == record.deleted_objects + len(again.deletes)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained once, in a local folder (training on moto or the emulator takes 10x longer)."""
    root = tmp_path_factory.mktemp("trained") / "run"
    _train(_init(RunReader.open(to_url(str(root)))), 12)
    return root


def _copy_to(root: Path, store: RunHandle) -> None:
    """Every object of the local run at ``root``, byte for byte, into ``store`` (written now: new
    modification times, which is what the age guard looks at)."""
    from atoll.storage.store import io_map

    files = [f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".tmp-")]
    io_map(lambda f: store.store.put(f.relative_to(root).as_posix(), f.read_bytes()), files)


def test_prune_on_every_backend_keeps_young_objects_and_dry_run_deletes_nothing(
        backend: Backend, trained_run: Path) -> None:
    url = backend.new_url()
    _copy_to(trained_run, backend.open(url))
    run = backend.open(url, role=OperatorStore)
    latest = run.latest_round()
    before = _keys(run)
    # Every backend reports when an object was written (the age guard depends on it).
    infos = run.store.list_info(P.blobs_prefix())
    assert infos and all(i.modified_s is not None and abs(i.modified_s - time.time()) < 600 for i in infos)

    # Planned now, nothing unreferenced is old enough: only contributions no round can list (and
    # superseded complete checkpoints) go; every payload stays.
    policy = RetentionPolicy(keep_rounds=4, keep_checkpoints=1)
    now_plan = plan_prune(run, policy)
    assert now_plan.deleted(GLOBAL_STATE)[0] == now_plan.deleted(LEARNER_PAYLOAD)[0] == 0
    assert now_plan.young > 0
    assert {d.what for d in now_plan.deletes} <= {CONTRIBUTION, CHECKPOINT}

    later = plan_prune(run, policy, now=time.time() + LATER)
    assert later.deleted(GLOBAL_STATE)[0] > 0 and later.deleted(LEARNER_PAYLOAD)[0] > 0
    assert _keys(run) == before  # planning reads only
    apply_prune(run, later, by="test")
    fresh = backend.open(url, fresh=True)
    assert _keys(fresh) == before - {d.key for d in later.deletes} | {P.PRUNE}
    report = fresh.verify()
    assert report.ok and report.verified == latest and report.pruned > 0, report.problems
    assert fresh.read_global_state().round == latest
    for lid in fresh.learner_ids():
        assert fresh.load_learner_state(lid) is not None


def test_policy_errors_name_the_knob(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    run = _new_run(url)  # P = 2
    with pytest.raises(ValueError, match=r"at least 2 x P = 4.*--keep-rounds"):
        plan_prune(run, RetentionPolicy(keep_rounds=3))
    with pytest.raises(ValueError, match="--keep-checkpoints"):
        plan_prune(run, RetentionPolicy(keep_checkpoints=0))
    with pytest.raises(ValueError, match="--min-age-s"):
        plan_prune(run, RetentionPolicy(min_age_s=5.0))
    # A run with fewer rounds than the window: nothing of its state goes.
    plan = plan_prune(run, RetentionPolicy(keep_rounds=4), now=time.time() + LATER)
    assert plan.through_round == 0 and plan.floors == (0, 0) and plan.deletes == []


def test_a_prune_killed_midway_leaves_a_run_that_verifies_and_a_rerun_finishes(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    _train(_new_run(url), 20)
    run = OperatorStore.open(url)
    plan = plan_prune(run, RetentionPolicy(keep_rounds=4), now=time.time() + LATER)
    assert len(plan.deletes) > 10
    real = run.store.delete_many
    calls = []

    def dies(keys: Any, **kw: Any) -> int:  # the process dies after its first batch of deletes
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(keys, **kw)

    run.store.delete_many = dies  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        apply_prune(run, plan, chunk=5, by="test")
    # The retention record went first: nothing deleted so far reads as lost.
    report = RunReader.open(url).verify()
    assert report.ok and report.pruned > 0, report.problems
    rerun = OperatorStore.open(url)
    rest = plan_prune(rerun, RetentionPolicy(keep_rounds=4), now=time.time() + LATER)
    assert 0 < len(rest.deletes) == len(plan.deletes) - 5
    apply_prune(rerun, rest, by="test")
    assert plan_prune(RunReader.open(url), RetentionPolicy(keep_rounds=4), now=time.time() + LATER).deletes == []


def test_junk_and_unreadable_records_are_left_alone(tmp_path: Path) -> None:
    """Retention deletes only what it understands: an odd name, or the payloads of a learner whose
    state.json cannot be read, stay; a damaged retention record is reported by verify, not trusted."""
    url = to_url(str(tmp_path / "run"))
    _train(_new_run(url), 16)
    run = OperatorStore.open(url)
    junk = ["sync/blobs/sha256/not-a-sha.safetensors", "learners/learner-0/blobs/sha256/README",
            "learners/learner-0/contributions/f0000/bogus/x.json"]
    for key in junk:
        run.store.put(key, b"junk")
    run.store.put(P.learner_state_key("learner-1"), b"{not json")
    plan = plan_prune(run, RetentionPolicy(keep_rounds=4), now=time.time() + LATER)
    deleted = {d.key for d in plan.deletes}
    assert not deleted & set(junk)
    assert not any(k.startswith("learners/learner-1/blobs/") for k in deleted)
    assert any(k.startswith("learners/learner-0/blobs/") for k in deleted)
    apply_prune(run, plan, by="test")
    run.store.put(P.PRUNE, b'{"schema": "atoll/prune", "schema_version": 3, "floors": "all"}')
    report = RunReader.open(url).verify()
    assert not report.ok and any("retention record ignored" in p for p in report.problems)
    assert report.prune is None


def test_a_learner_whose_saved_state_is_gone_rejoins_with_fresh_inner_state(tmp_path: Path) -> None:
    """Its state.json names a payload that is gone (a learner frozen between the two writes for
    longer than min_age_s, or a storage fault): it rejoins from the global state and says why."""
    from atoll.train.inner import RecipeLearner

    url = to_url(str(tmp_path / "run"))
    _train(_new_run(url), 4)
    run = RunReader.open(url)
    saved = run.load_learner_state_record("learner-0")
    assert saved is not None
    run.store.delete(P.blob_key(saved.payload.sha256, "learner-0"))
    lines: list[str] = []
    learner = RecipeLearner(LearnerStore.open(url), "learner-0", log=lines.append)
    assert "missing_payload" in learner.summary.inner_state_lost and not learner.summary.resumed_inner_state
    assert any("rejoining with fresh optimizer state" in line for line in lines)
    assert learner.start_round == run.latest_round()


def test_atoll_prune_cli_dry_run_then_prune_then_verify_and_status(tmp_path: Path, capsys: Any) -> None:
    import os

    from atoll.cli import main

    url = to_url(str(tmp_path / "run"))
    _train(_new_run(url), 12)
    root = tmp_path / "run"
    old = time.time() - LATER  # written two hours ago, by the store's own clock (file mtimes)
    for f in root.rglob("*"):
        os.utime(f, (old, old))
    files = sorted(p for p in root.rglob("*") if p.is_file())

    assert main(["prune", url, "--keep-rounds", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "global state" in out and "learner payload" in out and "dry run: nothing deleted" in out
    assert sorted(p for p in root.rglob("*") if p.is_file()) == files

    assert main(["prune", url, "--keep-rounds", "3"]) == 2
    assert "--keep-rounds" in capsys.readouterr().err

    assert main(["prune", url, "--keep-rounds", "4", "--keep-checkpoints", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted" in out and "sync/prune.json" in out
    left = sorted(p for p in root.rglob("*") if p.is_file())
    assert len(left) < len(files) and len(list((root / "sync" / "checkpoints").iterdir())) == 1

    assert main(["verify", url]) == 0
    assert "deleted on purpose by retention" in capsys.readouterr().out
    assert main(["status", url]) == 0
    assert "retention: the global state of rounds 1.." in capsys.readouterr().out
    assert main(["prune", url, "--keep-rounds", "4"]) == 0
    assert "nothing to delete" in capsys.readouterr().out


def test_links_out_of_the_run_folder_are_never_followed(tmp_path: Path) -> None:
    """A local writer (a hostile learner on a shared file system) links folders of its prefix to
    somewhere outside the run: retention skips that learner, naming the link, deletes nothing of
    it (nor anything through the link), and prunes everyone else; a link among the synchronizer's
    own folders refuses the prune."""
    import os

    url = to_url(str(tmp_path / "run"))
    _train(_new_run(url), 16)
    root = tmp_path / "run"
    outside = tmp_path / "outside"
    (outside / "f0000" / "b00000000").mkdir(parents=True)
    (outside / "sha256").mkdir()
    victims = [outside / "f0000" / "b00000000" / "evil.s0000000001.0123456789abcdef.json",
               outside / "sha256" / (("ab" * 32) + ".safetensors")]
    for f in victims:
        f.write_bytes(b"precious")
    evil = root / "learners" / "evil"
    evil.mkdir()
    os.symlink(outside, evil / "contributions")  # contributions/f0000/b00000000/ leads out
    os.symlink(outside, evil / "blobs")  # blobs/sha256/<sha>.safetensors leads out
    old = time.time() - LATER
    for f in [*root.rglob("*"), *outside.rglob("*")]:
        os.utime(f, (old, old), follow_symlinks=False)
    run = OperatorStore.open(url)
    plan = plan_prune(run, RetentionPolicy(keep_rounds=4, keep_checkpoints=1), now=time.time() + LATER)
    assert [s.key for s in plan.skipped] == ["learners/evil/"] and "symlink" in plan.skipped[0].why
    assert plan.deletes and not any(d.key.startswith("learners/evil/") for d in plan.deletes)
    apply_prune(run, plan)
    with pytest.raises(NotPlainObjectError, match="link"):
        run.store.delete(f"learners/evil/blobs/sha256/{'ab' * 32}.safetensors")
    assert all(f.read_bytes() == b"precious" for f in victims)
    # the operator removes the links: retention runs again
    (evil / "contributions").unlink()
    (evil / "blobs").unlink()
    os.symlink(outside / "f0000", root / "sync" / "checkpoints" / "00000001")
    with pytest.raises(NotPlainObjectError, match="00000001"):
        plan_prune(run, RetentionPolicy(keep_rounds=4, keep_checkpoints=1), now=time.time() + LATER)
    (root / "sync" / "checkpoints" / "00000001").unlink()
    assert not plan_prune(run, RetentionPolicy(keep_rounds=4), now=time.time() + LATER).skipped


@pytest.mark.parametrize("link", ["blobs", "learner", "sha256"])
def test_a_link_inside_the_run_never_lets_prune_delete_committed_state(tmp_path: Path, link: str) -> None:
    """A learner links its own blobs folder (or its whole prefix, or its sha256 folder) to a folder
    INSIDE the run: listed through, every committed state object, version 0 included, was deleted.
    Retention skips that learner, naming the link, and deletes nothing of it; what it prunes of
    everyone else leaves a run that verifies."""
    import os

    url = to_url(str(tmp_path / "run"))
    _train(_new_run(url), 16)
    root = tmp_path / "run"
    evil = root / "learners" / "evil"
    if link == "blobs":
        evil.mkdir()
        os.symlink(root / "sync" / "blobs", evil / "blobs")
    elif link == "sha256":
        (evil / "blobs").mkdir(parents=True)
        os.symlink(root / "sync" / "blobs" / "sha256", evil / "blobs" / "sha256")
    else:
        os.symlink(root / "sync", evil)  # learners/evil/blobs/sha256/ is sync's
    old = time.time() - LATER
    for f in root.rglob("*"):
        os.utime(f, (old, old), follow_symlinks=False)
    before = sorted(p.name for p in (root / "sync" / "blobs" / "sha256").iterdir())
    run = OperatorStore.open(url)
    plan = plan_prune(run, RetentionPolicy(keep_rounds=4), now=time.time() + LATER)
    assert [s.key for s in plan.skipped] == ["learners/evil/"] and "link" in plan.skipped[0].why
    assert not any(d.key.startswith("learners/evil/") for d in plan.deletes)
    victim = f"learners/evil/blobs/sha256/{before[0]}"
    with pytest.raises(NotPlainObjectError, match="link"):
        run.store.delete(victim)
    # a plan made by hand that names the victim through the link is refused too, before any write
    forged = PrunePlan(latest=1, through_round=0, floors=(0, 0), deletes=[PruneItem(victim, GLOBAL_STATE, 1)])
    with pytest.raises(RetentionRefused):
        apply_prune(run, forged, by="test")
    assert sorted(p.name for p in (root / "sync" / "blobs" / "sha256").iterdir()) == before
    apply_prune(run, plan)
    assert RunReader.open(url).verify().ok


def test_prune_deletes_only_keys_whose_name_proves_class_and_owner() -> None:
    sha = "ab" * 32
    assert key_class(f"sync/blobs/sha256/{sha}.safetensors") == (GLOBAL_STATE, "sync")
    assert key_class(f"learners/l0/blobs/sha256/{sha}.safetensors") == (LEARNER_PAYLOAD, "l0")
    rec = "learners/l0/contributions/f0001/b00000002/l0.s0000000024.0123456789abcdef.json"
    assert key_class(rec) == (CONTRIBUTION, "l0")
    assert key_class(rec.replace("/l0.s", "/l1.s")) is None  # named for another learner
    assert key_class("sync/checkpoints/00000004/model.safetensors") == (CHECKPOINT, "sync")
    assert key_class("_probe/0123abcd") == (PROBE, "_probe")
    for key in ("run.json", "sync/commits/00000001.json", "sync/head.json", "learners/l0/state.json",
                f"learners/../sync/blobs/sha256/{sha}.safetensors", f"learners/l0/blobs/sha256/{sha}.json",
                "learners/l0/leases/00000001.json", "sync/prune.json"):
        assert key_class(key) is None, key
