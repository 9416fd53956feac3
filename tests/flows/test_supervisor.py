"""The supervisor against a real Prefect API (the test harness) and a real bucket: it relaunches a
crashed training run with its own options resuming its run, marks a zombie Crashed and relaunches
it, turns a person's Cancel into a stop of the run, never relaunches a stopped or finished run, and
is idempotent (two passes, or two supervisors, launch one flow run per crash)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from atoll.runs.manage import prepare_run
from atoll.runs.options import TrainingRunOptions
from atoll.runs.supervision import SupervisionAction, SupervisionPolicy
from atoll.storage import RunReader, SynchronizerStore
from atoll.storage.liveness import take_lease, write_heartbeat
from atoll.storage.paths import sync_heartbeat_key, to_url
from atoll.tasks.queries import learner_tag, run_tag

from .test_deploy import _client, deployed  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(240)

POLICY = SupervisionPolicy(heartbeat_timeout_s=30.0, startup_grace_s=300.0, relaunch_backoff_s=0.0, max_relaunches=5)


def _training_flow_run(client: Any, deployment_id: str, url: str, run_id: str, state: Any) -> Any:
    options = TrainingRunOptions(run_url=url, preset="smoke")
    fr = client.create_flow_run_from_deployment(UUID(deployment_id), parameters={"options": options.model_dump(mode="json")},
                                                tags=[run_tag(run_id)])
    client.set_flow_run_state(fr.id, state, force=True)
    return client.read_flow_run(fr.id)


def _run(tmp_path: Path, name: str) -> tuple[str, str]:
    url = to_url(str(tmp_path / name))
    info = prepare_run(url, preset="smoke", rounds=6)
    return url, info.run_id


def _verdicts(client: Any) -> dict[str, Any]:
    from atoll.flows.supervisor import supervise_once

    return {v.run_id: v for v in supervise_once(client, POLICY, stop_grace_s=0.0, log=lambda s: None)}


def test_supervisor_relaunches_crashed_and_zombie_runs(deployed: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    from prefect.states import Crashed, Running

    from atoll.flows.supervisor import RELAUNCH_TAG

    dep = deployed["atoll-training-run/default"]
    crashed_url, crashed_id = _run(tmp_path, "run-crashed")
    zombie_url, zombie_id = _run(tmp_path, "run-zombie")
    healthy_url, healthy_id = _run(tmp_path, "run-healthy")
    with _client() as client:
        crashed = _training_flow_run(client, dep, crashed_url, crashed_id, Crashed(message="exit -9"))
        zombie = _training_flow_run(client, dep, zombie_url, zombie_id, Running())
        healthy = _training_flow_run(client, dep, healthy_url, healthy_id, Running())
        # The zombie's synchronizer took its lease and heartbeated 100 s ago; the healthy one took its
        # lease a moment ago and has not heartbeated yet (starting, not dead).
        zstore = RunReader.open(zombie_url)
        lease = take_lease(zstore.store, "synchronizer", flow_run_id=str(zombie.id))
        write_heartbeat(zstore.store, lease, clock=lambda: time.time() - 100.0)
        old = time.time() - 100.0  # ages are on the store's clock: the object itself is 100 s old
        os.utime(zstore.store.path(sync_heartbeat_key(lease.incarnation)), (old, old))
        hstore = RunReader.open(healthy_url)
        take_lease(hstore.store, "synchronizer", flow_run_id=str(healthy.id))

        verdicts = _verdicts(client)
        assert verdicts[crashed_id].action == SupervisionAction.RELAUNCHED
        assert verdicts[zombie_id].action == SupervisionAction.ZOMBIE_RELAUNCHED
        assert verdicts[healthy_id].action == SupervisionAction.HEALTHY
        assert client.read_flow_run(zombie.id).state.type.value == "CRASHED"

        from atoll.tasks.queries import read_flow_runs_paged

        for rid, url, old in ((crashed_id, crashed_url, crashed), (zombie_id, zombie_url, zombie)):
            runs = read_flow_runs_paged(client, flow_names=["atoll-training-run"], tags=[run_tag(rid)])
            assert len(runs) == 2
            new = runs[0]
            assert new.id != old.id and RELAUNCH_TAG in new.tags and str(new.deployment_id) == dep
            options = TrainingRunOptions.model_validate(new.parameters["options"])
            assert options.target_url == url and options.resume_from == url and options.run_url is None

        # A second pass (or a second supervisor) sees the relaunched, scheduled flow runs: nothing new.
        again = _verdicts(client)
        assert again[crashed_id].action == SupervisionAction.STARTING and again[crashed_id].launched is None
        # Idempotent even when it decides again on the same crashed flow run.
        from atoll.flows.supervisor import relaunch

        opts = TrainingRunOptions.model_validate(crashed.parameters["options"])
        first = relaunch(client, crashed, opts, crashed_id, 9)
        second = relaunch(client, crashed, opts, crashed_id, 9)
        assert first.id == second.id


def test_supervisor_respects_stop_and_finish_and_turns_a_cancel_into_a_stop(
        deployed: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    from prefect.states import Cancelled, Crashed, Running

    dep = deployed["atoll-training-run/default"]
    stopped_url, stopped_id = _run(tmp_path, "run-stopped")
    cancel_url, cancel_id = _run(tmp_path, "run-cancel")
    with _client() as client:
        SynchronizerStore.open(stopped_url).mark_stopped("atoll stop", "test")
        _training_flow_run(client, dep, stopped_url, stopped_id, Crashed())
        _training_flow_run(client, dep, cancel_url, cancel_id, Cancelled(message="cancelled in the UI"))
        learner = client.create_flow_run_from_deployment(
            UUID(deployed["atoll-learner/pool-a"]), parameters={"run_url": cancel_url, "learner_id": "learner-0"},
            tags=[run_tag(cancel_id), learner_tag("learner-0")])
        client.set_flow_run_state(learner.id, Running(), force=True)

        verdicts = _verdicts(client)
        assert verdicts[stopped_id].action == SupervisionAction.STOPPED and verdicts[stopped_id].launched is None
        assert verdicts[cancel_id].action == SupervisionAction.STOP_REQUESTED
        marker = RunReader.open(cancel_url).stop_marker()
        assert marker is not None and marker.stopped and marker.by == "atoll-supervisor"
        state = client.read_flow_run(learner.id).state
        assert state.type.value in ("CANCELLING", "CANCELLED") and state.message.startswith("atoll:")
        assert _verdicts(client)[cancel_id].action == SupervisionAction.STOPPED
