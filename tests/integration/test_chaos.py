"""Chaos on the real stack: Prefect server (own SQLite), two process pools with a worker each, the
supervisor, moto S3. A tiny run, stopped after at least 60 rounds, with Prefect queries paged by 25 rows
(``$ATOLL_QUERY_PAGE_SIZE``, in every process), so the training run's lookups outgrow one page of
flow runs (round flow runs carry the run's tag too), while, in turn:

1. the training-run process is SIGKILLed between a round's payload writes and its commit (the
   fault hook holds it there): its worker marks it Crashed and the supervisor relaunches it;
2. two learners are SIGKILLed: the training run relaunches them on their pools;
3. a learner is frozen (SIGSTOP: Prefect still says Running, the bucket has no heartbeat): it is a
   zombie, cancelled and relaunched; thawed, the old copy finds itself fenced;
4. the training-run process is frozen: a zombie, marked Crashed and relaunched by the supervisor;
   thawed, the old synchronizer finds itself fenced.

Along the way: rounds are flow runs whose artifacts match the bucket, and learners ran on both
pools. Then: every round 1..N committed exactly once (the chain verifies), no learner ever had two live
copies (sampled every second from the leases and /proc), no two incarnations of one learner were
ever merged out of order, every killed learner was merged again, and no process is left behind.
Recovery times are printed (``-s``) for the closing note.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from atoll.ops.deploy import deploy_all, learner_job_env, start_supervisor, start_training
from atoll.ops.observe import alive, live_copies, pid_state
from atoll.ops.stack import LocalStack
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.storage import SynchronizerStore
from atoll.tasks.queries import run_tag
from atoll.train.recipe import LearnerSpec, Recipe, smoke_recipe
from atoll.train.run import create_run

from .stack_helpers import MARKER_VAR, POOLS, flow_runs, logs, tear_down, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROUNDS = int(os.environ.get("ATOLL_CHAOS_ROUNDS", "60"))
"""Rounds to reach after the four faults; the run is then stopped (``atoll stop``). Its rounds are
recorded (the default): they come as fast as the learners publish, so the run's own length is
open-ended and the test decides when it is over."""
MAX_ROUNDS = 100_000
PAGE_SIZE = "25"  # rows per Prefect query: 60 round flow runs span three pages
HEARTBEAT_TIMEOUT_S = 30.0


class CopySampler(threading.Thread):
    def __init__(self, store: Any, learners: list[str], marker: str) -> None:
        super().__init__(daemon=True)
        self.store, self.learners, self.marker = store.sibling(), learners, marker
        self.stop = threading.Event()
        self.worst: dict[str, list[int]] = {}
        self.samples = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for lid in self.learners:
                try:
                    copies = live_copies(self.store, lid, env_var=MARKER_VAR, marker=self.marker,
                                         heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a flaky read is not a finding
                    continue
                if len(copies) > len(self.worst.get(lid, [])):
                    self.worst[lid] = copies
            self.samples += 1
            self.stop.wait(1.0)


def test_chaos_on_the_real_stack(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client

    marker = uuid.uuid4().hex
    run_id = f"chaos-{marker[:8]}"
    url = f"s3://{s3.bucket}/{run_id}"
    config, recipe = smoke_recipe(3, max_rounds=MAX_ROUNDS)
    # H = 8 and slower steps: fewer superseded contributions per round (cheaper rounds, same protocol).
    config = dataclasses.replace(config, inner_steps=8)
    learners = (LearnerSpec(learner_id="learner-0", batch_size=4, pool="cpu-fast", slowdown=2.0),
                LearnerSpec(learner_id="learner-1", batch_size=4, pool="cpu-slow", slowdown=2.0),
                LearnerSpec(learner_id="learner-2", batch_size=4, pool="cpu-slow", slowdown=3.0))
    recipe = Recipe.from_dict({**recipe.to_dict(), "learners": [vars(s) for s in learners],
                               "eval_every_rounds": 1000})
    create_run(url, config, recipe, storage_options=s3.storage_options)
    store = SynchronizerStore.open(url, s3.storage_options)  # it marks the run stopped at the end
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    env = {**s3.env, "ATOLL_IT_MARKER": marker, "ATOLL_QUERY_PAGE_SIZE": PAGE_SIZE}
    monkeypatch.setenv("ATOLL_QUERY_PAGE_SIZE", PAGE_SIZE)
    stack = LocalStack(home=tmp_path / "prefect", pools=POOLS, log_dir=tmp_path / "logs", env=env)
    sampler = CopySampler(store, [s.learner_id for s in learners], marker)
    times: dict[str, float] = {}
    frozen: list[int] = []
    try:
        stack.start()
        with stack.settings(), get_client(sync_client=True) as client:
            deploy_all(POOLS, env={**s3.env, "ATOLL_QUERY_PAGE_SIZE": PAGE_SIZE}, supervisor_interval_s=None)
            start_supervisor(parameters={"check_every_s": 2.0, "lifetime_s": 1100.0, "relaunch_backoff_s": 2.0,
                                         "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S})
            fleet = FleetOptions(watch_every_s=3.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, relaunch_backoff_s=2.0,
                                 startup_grace_s=120.0)
            # The first training run holds every round between its payload writes and its commit.
            fault_env = {**learner_job_env(), **env, "ATOLL_FAULT_HOLD_BEFORE_COMMIT_S": "120",
                         "ATOLL_FAULT_SIGNAL_DIR": str(fault_dir)}
            first = start_training(TrainingRunOptions(run_url=url, fleet=fleet), tags=[run_tag(run_id)],
                                   job_variables={"env": fault_env})
            sampler.start()

            def failed_early() -> None:
                fr = client.read_flow_run(first.id)
                if fr.state is not None and fr.state.type.value == "FAILED":
                    raise AssertionError(f"training run failed: {logs(tmp_path)}")

            # -- 1. SIGKILL the training run between payload writes and commit ----------------------
            def holding() -> list[Path]:
                failed_early()
                return sorted(fault_dir.glob("payloads-written-*"))

            [held] = wait_for(holding, 300, "the first training run holding before a commit")
            held_round = int(held.name.rsplit("-", 1)[1])
            assert store.read_commit(held_round) is None
            sync_pid = int(held.read_text().strip())
            os.kill(sync_pid, signal.SIGKILL)
            times["kill training run (before commit)"] = time.time()
            wait_for(lambda: store.read_commit(held_round) is not None, 240, f"round {held_round} committed by the "
                     f"relaunched training run: {logs(tmp_path)}", every_s=2.0)
            times["recovered: round committed"] = time.time()
            assert (fault_dir / held.name).exists() and len(list(fault_dir.glob("payloads-written-*"))) == 1

            # -- rounds are flow runs whose artifacts match the bucket; learners on both pools ------
            check_round_artifacts(client, store, run_id, [held_round + 1, held_round + 2])
            running = wait_for(lambda: learners_running(client, run_id), 180, "three running learner flow runs")
            assert {fr.work_pool_name for fr in running.values()} == set(POOLS)
            assert running["learner-2"].work_pool_name == "cpu-slow"
            assert all(fr.parent_task_run_id is None for fr in running.values())  # top level, not subflows

            # -- 2. SIGKILL two learners ------------------------------------------------------------
            kills: list[tuple[str, float, int]] = []
            for lid in ("learner-0", "learner-1"):
                live = wait_for(lambda lid=lid: alive(store, lid), 180, f"{lid} alive")
                os.kill(live.lease.pid, signal.SIGKILL)
                kills.append((lid, time.time(), live.incarnation))
                wait_for(lambda lid=lid, n=live.incarnation: alive(store, lid, newer_than=n), 180,
                         f"{lid} relaunched: {logs(tmp_path)}")
                times[f"{lid} relaunched after SIGKILL"] = time.time()

            # -- 3. freeze a learner: a zombie ------------------------------------------------------
            live = wait_for(lambda: alive(store, "learner-2"), 180, "learner-2 alive")
            os.kill(live.lease.pid, signal.SIGSTOP)
            frozen.append(live.lease.pid)
            kills.append(("learner-2", time.time(), live.incarnation))
            wait_for(lambda n=live.incarnation: alive(store, "learner-2", newer_than=n), 240,
                     f"learner-2 replaced as a zombie: {logs(tmp_path)}")
            times["learner-2 replaced as a zombie"] = time.time()
            try:
                os.kill(live.lease.pid, signal.SIGCONT)  # the old copy wakes up fenced
            except ProcessLookupError:
                pass  # or its worker already killed it on cancel
            wait_for(lambda pid=live.lease.pid: pid_state(pid) in (None, "Z"), 60, "the fenced learner gone")

            # -- 4. freeze the training run: a zombie -----------------------------------------------
            slive = store.synchronizer_liveness()
            assert slive.lease is not None and slive.incarnation >= 2
            before = store.latest_round()
            os.kill(slive.lease.pid, signal.SIGSTOP)
            frozen.append(slive.lease.pid)
            times["freeze training run"] = time.time()
            wait_for(lambda: store.latest_round() > before + 2, 300,
                     f"rounds committed by a relaunched training run: {logs(tmp_path)}", every_s=2.0)
            times["recovered from frozen training run"] = time.time()
            assert store.synchronizer_liveness().incarnation > slive.incarnation
            try:
                os.kill(slive.lease.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # already killed when its flow run was marked Crashed
            wait_for(lambda pid=slive.lease.pid: pid_state(pid) in (None, "Z"), 90, "the fenced training run gone")

            # -- past round ROUNDS, then atoll stop ------------------------------------------------
            wait_for(lambda: store.latest_round() >= ROUNDS, 900, f"round {ROUNDS}: {logs(tmp_path)}", every_s=3.0)
            store.mark_stopped("chaos test over", by="test_chaos")
            times["stopped"] = time.time()

            # the training run and the learners exit by themselves once the run is stopped; the
            # training run records its last rounds before it ends
            def all_ended() -> bool:
                runs = flow_runs(client, run_id, "atoll-learner") + flow_runs(client, run_id, "atoll-training-run")
                return all(fr.state is not None and fr.state.is_final() for fr in runs)

            wait_for(all_ended, 180, "every learner and training-run flow run final")
            sampler.stop.set()

        # -- assertions on the bucket -------------------------------------------------------------
        report = store.verify()
        assert report.ok, report.problems
        n_rounds = report.latest
        assert n_rounds >= ROUNDS and not report.void
        history = store.history(1, n_rounds)
        assert [rec.round for rec in history] == list(range(1, n_rounds + 1))  # none lost, none twice
        merged: dict[str, list[tuple[int, int]]] = {}
        for rec in history:
            for a in rec.accepted:
                c = store._read_contribution_record(a.key)
                assert not isinstance(c, Exception) and hasattr(c, "incarnation"), c
                merged.setdefault(a.learner_id, []).append((rec.round, c.incarnation))
        for lid, seq in merged.items():
            incs = [n for _, n in seq]
            assert incs == sorted(incs), f"{lid}: an older incarnation was merged after a newer one: {seq}"
        for lid, _killed_at, inc in kills:
            assert any(n > inc for _, n in merged[lid]), f"{lid} was never merged again after its kill"
        assert all(len(c) <= 1 for c in sampler.worst.values()), f"two live copies: {sampler.worst}"
        assert sampler.samples > 50
        # Prefect: every committed round has exactly one Completed round flow run, including the
        # rounds a killed training run committed and had not recorded yet (its successor did).
        with stack.settings(), get_client(sync_client=True) as client:
            completed: dict[str, int] = {}
            for fr in flow_runs(client, run_id, "atoll-round"):
                if fr.state is not None and fr.state.is_completed():
                    completed[fr.name] = completed.get(fr.name, 0) + 1
            assert max(completed.values()) == 1 and len(completed) == n_rounds, (n_rounds, len(completed))
            trainings = flow_runs(client, run_id, "atoll-training-run")
            assert len(trainings) >= 3  # the first, and two relaunches by the supervisor
        t0 = times.pop("kill training run (before commit)")
        print("\nchaos timings (s since the first kill):",
              {k: round(v - t0, 1) for k, v in times.items()}, "rounds", n_rounds, flush=True)
    finally:
        sampler.stop.set()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        left = tear_down(stack, marker)
    assert left == {}, f"processes left behind: {left}"


def learners_running(client: Any, run_id: str) -> dict[str, Any] | None:
    running = {}
    for fr in flow_runs(client, run_id, "atoll-learner"):
        if fr.state and fr.state.is_running():
            lid = next(t.split(":", 1)[1] for t in fr.tags if t.startswith("atoll-learner:"))
            running[lid] = fr
    return running if len(running) == 3 else None


def check_round_artifacts(client: Any, store: Any, run_id: str, rounds: list[int]) -> None:
    """Each round is a completed flow run, a child of the training run, tagged with the run, whose
    contributions table and summary match the commit record in the bucket."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from atoll.runs.names import round_flow_name
    from atoll.runs.render import contributions_from_markdown

    def done() -> dict[str, Any] | None:
        found = {r.name: r for r in flow_runs(client, run_id, "atoll-round") if r.state and r.state.is_completed()}
        return found if all(round_flow_name(n) in found for n in rounds) else None

    completed = wait_for(done, 300, f"round flow runs {rounds} completed")
    for n in rounds:
        fr = completed[round_flow_name(n)]
        assert {run_tag(run_id), "atoll-round"} <= set(fr.tags)
        # A flow run of its own, tagged with the training-run segment that ran it (nest_rounds=False).
        assert any(t.startswith("atoll-segment-run:") for t in fr.tags)

        def recorded(fr: Any = fr) -> list[Any] | None:  # the recorder writes them just after the round
            arts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
            return arts or None

        [art] = wait_for(recorded, 60, f"artifacts of {fr.name}")
        rows = contributions_from_markdown(str(art.data))
        record = store.read_commit(n)
        assert record is not None
        assert {r["learner"]: float(r["weight"]) for r in rows if r["status"] == "accepted"} == {
            a.learner_id: round(a.weight, 6) for a in record.accepted}
        assert sum(1 for r in rows if r["status"] != "accepted") == len(record.rejected)
        assert art.type == "markdown" and f"# Round {n} of {MAX_ROUNDS}" in str(art.data)


