"""A learner's and the synchronizer's life in the bucket: leases, fencing, heartbeats, stop,
orphan timeout and SIGTERM (atoll.train.lease, run_learner, Synchronizer.hold_lease).

In-process tests drive the synchronizer and run_learner (in a thread) on a folder bucket; the
process test starts real learner processes (``python -m atoll.train.local learner``) and sends
them real signals.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from atoll.core.rejection import RejectionKind
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, RunHandle, RunReader, SynchronizerStore
from atoll.storage.liveness import SYNCHRONIZER_HOLDER
from atoll.storage.paths import to_url
from atoll.storage.records import ContributionRecord
from atoll.train.inner import run_learner
from atoll.train.learner import LearnerOptions, LearnerSummary
from atoll.train.lease import Fenced, LeaseKeeper, RunStopped, sigterm_flag
from atoll.train.local import LocalRun
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.sync_loop import run_synchronizer
from atoll.train.synchronizer import RoundPoll, RoundSummary, Synchronizer, SynchronizerOptions

L0, L1 = "learner-0", "learner-1"


def quiet(_: str) -> None:
    pass


def new_run(tmp_path: Path, max_rounds: int = 100) -> SynchronizerStore:
    config, recipe = smoke_recipe(2, max_rounds=max_rounds)
    return create_run(to_url(str(tmp_path / "run")), config, recipe)


def publish(store: RunHandle, learner_id: str, fragment: int, base: int, *, steps: int,
            incarnation: int, seed: int = 0) -> ContributionRecord:
    g = torch.Generator().manual_seed(seed)
    delta = {n: 1e-3 * torch.randn(*s, generator=g) for n, s in store.manifest.fragment_shapes(fragment).items()}
    return LearnerStore.beside(store).publish_contribution(learner_id, fragment, base,
                                                           Counters(c_steps=steps, c_tokens=4 * steps), delta,
                                                           incarnation=incarnation)


def close_round(sync: Synchronizer) -> RoundSummary:
    deadline = time.monotonic() + 30
    while True:
        polled = sync.poll()
        if isinstance(polled, RoundSummary):
            return polled
        if polled.decision.close:
            return sync.close(polled)
        assert time.monotonic() < deadline, polled.decision.reason
        time.sleep(0.02)


def test_synchronizer_fences_stale_incarnations_and_never_merges_two_of_one_learner(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    assert LearnerStore.beside(store).take_learner_lease(L0).incarnation == 1
    old = publish(store, L0, 0, 0, steps=2, incarnation=1)
    assert LearnerStore.beside(store).take_learner_lease(L0).incarnation == 2  # a second copy of learner-0 starts
    new = publish(store, L0, 0, 0, steps=1, incarnation=2, seed=1)  # sorts before the old one
    plain = publish(store, L1, 0, 0, steps=2, incarnation=0, seed=2)  # never leased: accepted
    sync = Synchronizer(store, options=SynchronizerOptions(poll_interval_s=0.01))
    polled = sync.poll()
    assert isinstance(polled, RoundPoll)
    why = polled.rejected[old.key]
    assert why.kind is RejectionKind.FENCED and why.final
    assert why.detail == "incarnation 1 fenced by incarnation 2"
    summary = close_round(sync)
    rec = summary.record
    assert {a.key for a in rec.accepted} == {new.key, plain.key}
    assert rec.rejected[old.key].kind is RejectionKind.FENCED
    assert [a.learner_id for a in rec.accepted].count(L0) == 1

    # Round 2 (fragment 1): the cached incarnation is re-read when a new record appears, so an
    # old copy that publishes after a newer lease was taken mid-round is fenced too.
    current = publish(store, L0, 1, 0, steps=2, incarnation=2)
    first = sync.poll()
    assert isinstance(first, RoundPoll) and current.key not in first.rejected
    assert LearnerStore.beside(store).take_learner_lease(L0).incarnation == 3
    late = publish(store, L0, 1, 0, steps=3, incarnation=2, seed=3)
    second = sync.poll()
    assert isinstance(second, RoundPoll)
    assert second.rejected[late.key].kind is RejectionKind.FENCED
    assert second.rejected[current.key].detail == "incarnation 2 fenced by incarnation 3"


def test_synchronizer_lease_heartbeats_stops_and_is_fenced(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    unleased = Synchronizer(store)
    store.mark_stopped("maintenance", by="alice")
    assert isinstance(unleased.poll(), RoundPoll)  # without a lease nothing changes

    sync = Synchronizer(store, options=SynchronizerOptions(heartbeat_interval_s=0.0))
    with pytest.raises(RunStopped, match="stopped by alice: maintenance"):
        sync.hold_lease("flow-run-1")
    lease = sync.lease
    assert lease is not None and lease.incarnation == 1 and lease.flow_run_id == "flow-run-1"
    with pytest.raises(RunStopped):
        sync.poll()
    store.clear_stopped(by="alice")
    assert isinstance(sync.poll(), RoundPoll)
    live = store.synchronizer_liveness()
    assert live.incarnation == 1 and live.heartbeat is not None and live.heartbeat.status == "alive"
    assert live.heartbeat.round == 0 and live.heartbeat_age_s(time.time()) < 30  # type: ignore[operator]

    # A rebuilt synchronizer object keeps holding the same lease.
    rebuilt = Synchronizer(store, options=SynchronizerOptions(heartbeat_interval_s=0.0))
    assert rebuilt.hold_lease(lease=lease) == lease and store.current_synchronizer_incarnation() == 1
    newer = store.take_synchronizer_lease()
    with pytest.raises(Fenced, match="incarnation 1 fenced by incarnation 2"):
        sync.poll()
    with pytest.raises(Fenced):
        rebuilt.poll()

    # run_synchronizer holds a lease; a stopped run makes it return with a final heartbeat.
    store.mark_stopped("done for today", by="bob")
    assert run_synchronizer(store, log=quiet) == 0
    last = store.synchronizer_liveness()
    assert last.incarnation == newer.incarnation + 1
    assert last.exited_reason == "stopped: done for today"


def learner_in_thread(store: RunReader, learner_id: str, options: LearnerOptions) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(run_learner(LearnerStore.open(store.url), learner_id, options=options, log=quiet))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stop_after_step(store: SynchronizerStore, step: int, *, reason: str, by: str) -> LearnerSummary:
    """Run learner-0 in a thread until it heartbeats at ``step``, mark the run stopped, return its summary."""
    options = LearnerOptions(heartbeat_interval_s=0.1, orphan_timeout_s=None, poll_interval_s=0.05)
    t, out = learner_in_thread(store, L0, options)

    def stepping() -> bool:
        hb = store.learner_liveness(L0).heartbeat
        return hb is not None and (hb.step or 0) >= step

    wait_for(stepping, 120, f"learner-0 to heartbeat at step {step}")
    store.mark_stopped(reason, by=by)
    t.join(60)
    summary = out[0]
    assert isinstance(summary, LearnerSummary), summary
    return summary


def test_stop_marker_makes_a_learner_save_and_exit_stopped(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    summary = stop_after_step(store, 3, reason="maintenance", by="alice")
    assert summary.exit_reason == "stopped" and summary.exit_detail == "stopped by alice: maintenance"
    assert summary.incarnation == 1
    saved = store.load_learner_state(L0)
    assert saved is not None and saved.meta["step"] == summary.steps  # saved at the very end
    live = store.learner_liveness(L0)
    assert live.exited_reason == "stopped by alice: maintenance" and live.heartbeat.step == summary.steps  # type: ignore[union-attr]
    # Every contribution it published carries its incarnation.
    recs = [r for p in range(2) for r in store.list_contributions(p, 0, [L0]).records]
    assert recs and {r.incarnation for r in recs} == {1}


def test_orphaned_learner_saves_and_exits(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    options = LearnerOptions(heartbeat_interval_s=0.1, orphan_timeout_s=3.0, poll_interval_s=0.05)
    t0 = time.monotonic()
    t, out = learner_in_thread(store, L0, options)
    t.join(120)
    summary = out[0]
    assert isinstance(summary, LearnerSummary), summary
    assert summary.exit_reason == "orphaned" and "no new commit" in summary.exit_detail
    assert time.monotonic() - t0 >= 3.0
    saved = store.load_learner_state(L0)
    assert saved is not None and saved.meta["step"] == summary.steps
    assert (store.learner_liveness(L0).exited_reason or "").startswith("orphaned")


def test_a_learner_without_a_lease_is_never_fenced_and_does_not_heartbeat(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    summary = run_learner(LearnerStore.beside(store), L1, options=LearnerOptions(take_lease=False, max_steps=4, handle_sigterm=False),
                          log=quiet)
    assert summary.exit_reason == "max_steps" and summary.incarnation == 0
    assert store.current_incarnation(L1) == 0 and store.learner_liveness(L1).heartbeat is None
    recs = [r for p in range(2) for r in store.list_contributions(p, 0, [L1]).records]
    assert recs and {r.incarnation for r in recs} == {0}


def log_of(tmp_path: Path, learner_id: str) -> str:
    return (tmp_path / "logs" / f"{learner_id}.log").read_text()


@pytest.mark.timeout(300)
def test_learner_processes_fencing_sigkill_staleness_and_sigterm(tmp_path: Path) -> None:
    """Real processes: a second copy of learner-0 fences the first (which exits "fenced" and
    publishes nothing after the fence); a SIGKILLed learner's heartbeat goes stale while a running
    one stays fresh; SIGTERM makes a learner save, write a final heartbeat and exit 0."""
    store = new_run(tmp_path, max_rounds=100_000)
    args = ("--heartbeat-interval-s", "0.2", "--orphan-timeout-s", "0", "--poll-interval-s", "0.05",
            "--log-every", "0")
    with LocalRun(store.url, log_dir=tmp_path / "logs") as run:
        first = run.start_learner(L0, *args)
        other = run.start_learner(L1, *args)

        def beating(lid: str, incarnation: int, step: int) -> bool:
            live = store.learner_liveness(lid)
            return (live.incarnation == incarnation and live.heartbeat is not None
                    and (live.heartbeat.step or 0) >= step)

        wait_for(lambda: beating(L0, 1, 6) and beating(L1, 1, 1), 120, "both learners to train")
        assert first.poll() is None
        second = run.start_learner(L0, *args)
        wait_for(lambda: first.poll() is not None, 120, "the first copy of learner-0 to exit")
        assert first.returncode == 0, log_of(tmp_path, L0)
        assert "exit_reason=fenced" in log_of(tmp_path, L0)
        lease2 = store.learner_liveness(L0).lease
        assert lease2 is not None and lease2.incarnation == 2
        fenced_hb = RunReader.open(store.url).store.get(f"learners/{L0}/heartbeats/00000001.json")
        assert b'"exited"' in fenced_hb and b"fenced by incarnation 2" in fenced_hb
        # Nothing of incarnation 1 was published after incarnation 2 took its lease (the old copy
        # checks the lease right before each publish; allow for the check-to-write latency).
        recs = [r for p in range(2) for r in store.list_contributions(p, 0, [L0]).records]
        old = [r for r in recs if r.incarnation == 1]
        assert old and max(r.created_at for r in old) <= lease2.started_at + 2.0

        # SIGKILL learner-1: its heartbeat goes stale; learner-0 (incarnation 2) stays fresh.
        wait_for(lambda: beating(L0, 2, 1), 120, "the second copy of learner-0 to train")
        run.kill(other)
        time.sleep(3.0)
        now = time.time()
        dead, alive = store.learner_liveness(L1), store.learner_liveness(L0)
        assert dead.heartbeat_age_s(now) >= 2.5 and dead.exited_reason is None  # type: ignore[operator]
        assert alive.heartbeat_age_s(now) < 2.0 and alive.is_alive(now, 2.0)  # type: ignore[operator]

        # SIGTERM: the step finishes, the state is saved, a final heartbeat says why, exit 0.
        t_term = time.time()
        second.terminate()
        assert second.wait(60) == 0, log_of(tmp_path, L0)
        assert "exit_reason=sigterm" in log_of(tmp_path, L0)
        saved = store.load_learner_state(L0)
        assert saved is not None and saved.saved_at >= t_term
        final = store.learner_liveness(L0)
        assert final.incarnation == 2 and final.exited_reason == "SIGTERM received"


def test_sigterm_flag_only_in_the_main_thread_and_the_previous_handler_comes_back() -> None:
    import os
    import signal

    calls: list[str] = []

    def previous(signum: int, frame: Any) -> None:  # stands in for Prefect's TerminationSignal bridge
        calls.append("previous")

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with sigterm_flag(lambda: calls.append("flag")) as installed:
            assert installed
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # Python runs handlers between bytecodes of the main thread
        assert calls == ["flag"] and signal.getsignal(signal.SIGTERM) is previous
        with sigterm_flag(lambda: calls.append("flag"), enabled=False) as installed:
            assert not installed and signal.getsignal(signal.SIGTERM) is previous
        seen: list[bool] = []

        def in_thread() -> None:
            with sigterm_flag(lambda: None) as installed:
                seen.append(installed)

        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
        assert seen == [False] and signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


def test_keeper_heartbeats_only_while_the_loop_progresses_and_notices_orphaning(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    lease = LearnerStore.beside(store).take_learner_lease(L0)
    now = [1000.0]
    latest = [0]
    keeper = LeaseKeeper(LearnerStore.beside(store), L0, lease, stall_timeout_s=10.0, orphan_timeout_s=30.0,
                         latest_round=lambda: latest[0], log=quiet, clock=lambda: now[0])
    keeper.tick(1)
    keeper.check_once()
    assert keeper.heartbeats == 1 and store.learner_liveness(L0).heartbeat.step == 1  # type: ignore[union-attr]
    now[0] += 11  # the loop hangs: no tick for longer than the stall timeout
    keeper.check_once()
    assert keeper.heartbeats == 1 and keeper.exit_reason is None
    keeper.tick(2)
    keeper.check_once()
    assert keeper.heartbeats == 2
    latest[0] = 1  # a new commit restarts the orphan clock
    now[0] += 25
    keeper.tick(3)
    keeper.check_once()
    assert keeper.exit_reason is None
    now[0] += 31
    keeper.tick(4)
    keeper.check_once()
    assert keeper.exit_reason == "orphaned"
    LearnerStore.beside(store).take_learner_lease(L0)
    keeper.check_once()  # a fence overrides any earlier reason, and stops the heartbeats
    assert keeper.exit_reason == "fenced" and keeper.fenced_by == 2 and keeper.heartbeats == 4
    assert not keeper.still_current()


def test_a_synchronizers_keeper_is_fenced_by_a_newer_synchronizer(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    lease = store.take_synchronizer_lease()
    errors: list[str] = []
    keeper = LeaseKeeper(store.sibling(), SYNCHRONIZER_HOLDER, lease, log=errors.append)
    assert keeper.still_current() and not errors
    store.take_synchronizer_lease()  # a second synchronizer starts on the same run
    assert not keeper.still_current()
    assert keeper.fenced_by == lease.incarnation + 1
    assert not [e for e in errors if "lease check failed" in e], errors


def test_a_keeper_paused_after_its_lease_check_checks_again_before_it_heartbeats(tmp_path: Path) -> None:
    """SIGSTOP can land between the lease check and the heartbeat; meanwhile a newer copy takes the
    lease. On waking, the keeper must not write "alive" on its stale answer."""
    store = new_run(tmp_path)
    lease = LearnerStore.beside(store).take_learner_lease(L0)
    now = [1000.0]
    keeper = LeaseKeeper(LearnerStore.beside(store), L0, lease, interval_s=5.0, stall_timeout_s=1e9, orphan_timeout_s=None,
                         latest_round=lambda: 0, log=quiet, clock=lambda: now[0])
    keeper.tick(1)
    keeper.check_once()
    assert keeper.heartbeats == 1
    real_check = keeper.still_current

    def check_then_frozen() -> bool:
        current = real_check()  # the lease is still ours when checked ...
        now[0] += 60.0  # ... then the process is frozen for a minute,
        LearnerStore.beside(store).take_learner_lease(L0)  # and a replacement takes the lease
        keeper.still_current = real_check  # type: ignore[method-assign]
        return current

    keeper.still_current = check_then_frozen  # type: ignore[method-assign]
    keeper.tick(2)
    keeper.check_once()
    assert keeper.heartbeats == 1 and keeper.exit_reason == "fenced"
    beat = store.learners_liveness([L0])[L0]
    assert beat.incarnation == 2 and beat.heartbeat is None  # the old copy wrote nothing for itself


def test_publishes_back_off_while_a_fragment_stalls() -> None:
    """Every interval while the synchronizer keeps up (a fragment is merged within a few), then
    intervals 8, 16, 32, ...: an hour without a synchronizer leaves a few dozen objects, not thousands."""
    from atoll.train.learner import STALLED_PUBLISHES, publish_due

    h = 8
    due = [n for n in range(1, 5000) if publish_due(n * h + 3, h)]
    assert due[:STALLED_PUBLISHES] == [1, 2, 3, 4]
    assert due[STALLED_PUBLISHES:] == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert publish_due(3, h)  # aligned mid-interval: the first publish is never held


def test_a_thawed_synchronizer_that_finds_its_round_committed_by_its_replacement_is_fenced(tmp_path: Path) -> None:
    """A frozen synchronizer's replacement commits the round the frozen one was waiting on; when
    the old one wakes up it must not adopt that round as its own (its round flow run would report
    Completed for a round it did not commit): it is fenced."""
    store = new_run(tmp_path)
    old = Synchronizer(store, options=SynchronizerOptions(heartbeat_interval_s=3600.0))
    old.hold_lease("old")
    assert isinstance(old.poll(), RoundPoll)  # waiting on round 1; its last lease check is recent
    new = Synchronizer(SynchronizerStore.open(store.url), options=SynchronizerOptions(heartbeat_interval_s=0.0))
    new.hold_lease("new")
    publish(store, "learner-0", 0, 0, steps=2, incarnation=0)
    publish(store, "learner-1", 0, 0, steps=2, incarnation=0)
    deadline = time.monotonic() + 30
    while store.latest_round() < 1 and time.monotonic() < deadline:
        new.tick()
        time.sleep(0.05)
    assert store.latest_round() == 1 and store.read_commit(1) is not None
    with pytest.raises(Fenced, match="incarnation 1 fenced by incarnation 2"):
        old.poll()


def test_a_long_running_learner_keeps_a_bounded_loss_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.train.learner as learner_module

    monkeypatch.setattr(learner_module, "LOSS_WINDOW", 2)  # days of steps, in six
    summary = stop_after_step(new_run(tmp_path), 6, reason="enough", by="test")
    assert summary.steps >= 6 and 2 <= len(summary.losses) < 4, (summary.steps, summary.losses)
    assert summary.losses[-1] == summary.last_loss
