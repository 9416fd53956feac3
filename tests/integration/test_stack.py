"""The real thing: Prefect server (own SQLite) + two process work pools with a worker each + moto S3.

Deploys atoll's flows, trains a run with 3 learners across both pools, checks rounds, artifacts
and pools through the Prefect client against the bucket, then SIGKILLs a learner's process and
checks that the training run launches a new learner flow run on the same pool and that a later
round merges that learner again. Every process started here is stopped at the end.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atoll.ops.stack import LocalStack
from atoll.runs.manage import open_run
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.runs.report import round_flow_name
from atoll.storage.codec import load_record
from atoll.storage.records import KIND_CONTRIBUTION
from atoll.tasks.learners import learner_tag, run_tag
from atoll.train.recipe import LearnerSpec, Recipe, smoke_recipe
from atoll.train.run import create_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

POOLS = ("cpu-fast", "cpu-slow")


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def flow_runs(client: Any, run_id: str, flow_name: str, *extra_tags: str) -> list[Any]:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterTags

    return client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id), *extra_tags])),
    )


def pid_of_flow_run(flow_run_id: str) -> int | None:
    """The process running a flow run: the worker gives it PREFECT__FLOW_RUN_ID in its environment."""
    needle = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env:
            return int(d.name)
    return None


def processes_with(marker: str) -> list[int]:
    needle = f"ATOLL_IT_MARKER={marker}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def contribution_created_at(store: Any, key: str) -> float:
    data = store.store.get(key)
    return float(load_record(data, KIND_CONTRIBUTION)["created_at"])


def test_training_run_on_real_prefect_and_s3_heals_a_killed_learner(s3: Any, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.states import Cancelling

    from atoll.ops.deploy import deploy_all, start_training

    marker = uuid.uuid4().hex
    run_id = f"it-{marker[:8]}"
    url = f"s3://{s3.bucket}/{run_id}"
    config, recipe = smoke_recipe(3, max_rounds=500)  # never reached: the test stops the run
    learners = (LearnerSpec(learner_id="learner-0", batch_size=4, pool="cpu-fast"),
                LearnerSpec(learner_id="learner-1", batch_size=4, pool="cpu-fast"),
                LearnerSpec(learner_id="learner-2", batch_size=4, pool="cpu-slow", slowdown=1.5))
    recipe = Recipe.from_dict({**recipe.to_dict(), "learners": [vars(s) for s in learners], "eval_every_rounds": 10})
    create_run(url, config, recipe, storage_options=s3.storage_options)
    store = open_run(url, s3.storage_options)

    stack = LocalStack(home=tmp_path / "prefect", pools=POOLS, log_dir=tmp_path / "logs",
                       env={**s3.env, "ATOLL_IT_MARKER": marker})
    training = None
    try:
        stack.start()
        with stack.settings(), get_client(sync_client=True) as client:
            deploy_all(POOLS, env=s3.env)
            training = start_training(TrainingRunOptions(run_url=url, fleet=FleetOptions(watch_every_s=5.0)),
                                      tags=[run_tag(run_id)])

            # -- three rounds, as flow runs ------------------------------------------------------
            def three_rounds_done() -> bool:
                if training_state() in ("Failed", "Crashed"):
                    raise AssertionError(f"training run ended {training_state()}: {logs(tmp_path)}")
                done = [r for r in flow_runs(client, run_id, "atoll-round") if r.state and r.state.is_completed()]
                return len(done) >= 3

            def training_state() -> str:
                fr = client.read_flow_run(training.id)
                return fr.state.name if fr.state else "?"

            wait_for(three_rounds_done, 300, "three completed round flow runs")
            rounds = {r.name: r for r in flow_runs(client, run_id, "atoll-round")
                      if r.state and r.state.is_completed()}
            for n in (1, 2, 3):
                fr = rounds[round_flow_name(n)]
                assert {run_tag(run_id), "atoll-round"} <= set(fr.tags)
                assert fr.parent_task_run_id is not None  # a child of the training run
                arts = client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
                table = next(a for a in arts if a.type == "table")
                rows = json.loads(table.data) if isinstance(table.data, str) else table.data
                record = store.read_commit(n)
                assert record is not None
                assert {r["learner"]: r["weight"] for r in rows if r["status"] == "accepted"} == {
                    a.learner_id: round(a.weight, 6) for a in record.accepted}
                assert sum(1 for r in rows if r["status"] != "accepted") == len(record.rejected)
                assert any(a.type == "markdown" and f"# Round {n} of 500" in str(a.data) for a in arts)

            # -- learners ran on both pools ------------------------------------------------------
            def learners_running() -> dict[str, Any] | None:
                running = {}
                for fr in flow_runs(client, run_id, "atoll-learner"):
                    if fr.state and fr.state.is_running():
                        lid = next(t.split(":", 1)[1] for t in fr.tags if t.startswith("atoll-learner:"))
                        running[lid] = fr
                return running if len(running) == 3 else None

            running = wait_for(learners_running, 180, "three running learner flow runs")
            assert {fr.work_pool_name for fr in running.values()} == set(POOLS)
            assert running["learner-2"].work_pool_name == "cpu-slow"

            # -- SIGKILL learner-2's process ------------------------------------------------------
            victim = running["learner-2"]
            pid = wait_for(lambda: pid_of_flow_run(str(victim.id)), 60, "the learner's process")
            os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
            killed_round = store.latest_round()

            def relaunched() -> Any:
                runs = flow_runs(client, run_id, "atoll-learner", learner_tag("learner-2"))
                new = [fr for fr in runs if fr.id != victim.id]
                return new[0] if new else None

            new = wait_for(relaunched, 240, "a new flow run of learner-2")
            assert new.work_pool_name == "cpu-slow"
            old = client.read_flow_run(victim.id)
            assert old.state is not None and old.state.type.value in ("CRASHED", "FAILED"), old.state

            def merged_again() -> int | None:
                for rec in store.history(killed_round + 1, store.latest_round()):
                    for a in rec.accepted:
                        if a.learner_id == "learner-2" and contribution_created_at(store, a.key) > killed_at:
                            return rec.round
                return None

            again = wait_for(merged_again, 300, "a round that merges learner-2 again", every_s=2.0)
            assert again > killed_round
            assert training_state() == "Running"
    finally:
        try:
            with stack.settings(), get_client(sync_client=True) as client:
                if training is not None:
                    for fr in [client.read_flow_run(training.id), *flow_runs(client, run_id, "atoll-learner")]:
                        if fr.state is not None and not fr.state.is_final():
                            client.set_flow_run_state(fr.id, Cancelling(), force=True)
        except Exception:  # noqa: BLE001 - the server may already be gone; the sweep below still runs
            pass
        stack.stop()
        for pid in processes_with(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        assert processes_with(marker) == [], "processes left behind"


def logs(tmp_path: Path) -> str:
    out = []
    for f in sorted((tmp_path / "logs").glob("*.log")):
        out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)
