"""A long run continues as chained training-run flow runs (segments) every ``segment_rounds``
rounds: one run to the user (same run tag, each segment linked to the next and back),
no round lost or run twice across a hand-over, and the supervisor neither mistakes a segment that
handed over for a finished run nor misses a crashed segment.

Segments are real flow runs of the ``atoll-training-run/default`` deployment (the harness has no
worker): the test executes each one in this process with ``run_flow(training_run, flow_run=...)``,
which is what a worker's process does with the flow run it picked up."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from atoll.runs.manage import prepare_run
from atoll.runs.names import round_flow_name, slug
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.runs.supervision import SupervisionAction, SupervisionPolicy
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.tasks.events import RUN_FINISHED, RUN_HANDED_OVER
from atoll.tasks.queries import (
    HANDED_OVER_TAG,
    SEGMENT_OF_TAG,
    SEGMENT_RUN_TAG,
    SEGMENT_TAG,
    TRAINING_FLOW_NAME,
    read_flow_runs_paged,
    run_tag,
)
from atoll.train.local import LocalRun

from .events_helpers import read_events
from .test_deploy import _client, deployed  # noqa: F401 - the fixture
from .test_flows import _round_runs

pytestmark = pytest.mark.timeout(600)

POLICY = SupervisionPolicy(heartbeat_timeout_s=30.0, startup_grace_s=300.0, relaunch_backoff_s=0.0, max_relaunches=5)


def _execute(client: Any, flow_run_id: Any) -> dict[str, Any]:
    """Run a scheduled training-run flow run here, as a worker's process would."""
    from prefect.flow_engine import run_flow

    from atoll.flows.training import training_run

    fr = client.read_flow_run(flow_run_id)
    options = TrainingRunOptions.model_validate(fr.parameters["options"])
    return run_flow(training_run, flow_run=fr, parameters={"options": options})  # type: ignore[return-value]


def _supervise(client: Any) -> dict[str, Any]:
    from atoll.flows.supervisor import supervise_once

    return {v.run_id: v for v in supervise_once(client, POLICY, stop_grace_s=0.0, log=lambda s: None)}


def test_segments_chain_link_and_resume_without_losing_a_round(deployed: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.states import Crashed

    from atoll.flows.supervisor import RELAUNCH_TAG

    url = to_url(str(tmp_path / "run-seg"))
    info = prepare_run(url, preset="smoke", rounds=5)
    rid, tag = info.run_id, run_tag(info.run_id)
    options = TrainingRunOptions(run_url=url, segment_rounds=2, fleet=FleetOptions(manage=False, watch_every_s=5.0))
    with LocalRun(url, log_dir=tmp_path / "logs") as run, _client() as client:
        for spec in info.learners:
            run.start_learner(spec["learner_id"])
        first = client.create_flow_run_from_deployment(UUID(deployed["atoll-training-run/default"]),
                                                       parameters={"options": options.model_dump(mode="json")})
        out1 = _execute(client, first.id)
        # Segment 1: rounds 1-2, Completed, handed over (not finished) to a new flow run of the run.
        assert out1["rounds"] == 2 and not out1["stopped"] and out1["next_segment"]
        seg1 = client.read_flow_run(first.id)
        assert seg1.state.is_completed() and {tag, HANDED_OVER_TAG} <= set(seg1.tags)
        seg2 = client.read_flow_run(UUID(out1["next_segment"]))
        assert {tag, SEGMENT_TAG, f"{SEGMENT_OF_TAG}{seg1.id}"} <= set(seg2.tags)
        assert seg2.state.is_scheduled() and seg2.deployment_id == seg1.deployment_id
        assert seg2.parameters["options"]["resume_from"] == url and seg2.parameters["options"]["segment_rounds"] == 2
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[seg1.id])))
        [link] = [a for a in arts if a.key == f"{slug(rid)}-segment"]  # a link artifact (Prefect stores it as markdown)
        assert str(seg2.id) in str(link.data) and "next segment" in str(link.data)

        # The supervisor sees the run's newest flow run (the next segment, Scheduled): nothing to do.
        assert _supervise(client)[rid].action == SupervisionAction.STARTING
        # A segment that handed over, with no successor (as if its launch was lost): not finished.
        client.set_flow_run_state(seg2.id, Crashed(message="worker lost"), force=True)
        verdict = _supervise(client)[rid]  # a crashed segment is relaunched, resuming the run
        assert verdict.action == SupervisionAction.RELAUNCHED and verdict.launched
        [relaunched] = [fr for fr in read_flow_runs_paged(client, flow_names=[TRAINING_FLOW_NAME], tags=[tag])
                        if RELAUNCH_TAG in fr.tags]
        out2 = _execute(client, relaunched.id)
        assert out2["rounds"] == 4 and out2["next_segment"]
        out3 = _execute(client, UUID(out2["next_segment"]))
        assert out3["rounds"] == 5 and "next_segment" not in out3
        # The last segment continues the relaunched one and says so.
        seg3 = client.read_flow_run(UUID(out2["next_segment"]))
        assert f"{SEGMENT_OF_TAG}{relaunched.id}" in seg3.tags and HANDED_OVER_TAG not in seg3.tags
        md = {a.key: a.data for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[seg3.id]))) if a.type == "markdown"}
        assert str(relaunched.id) in md[f"{slug(rid)}-segment"]
        # Finished: the supervisor leaves it alone.
        assert rid not in _supervise(client)  # newest Completed without the hand-over tag

        # Every round once: one Completed round flow run per round, each under the segment that ran it.
        rounds = _round_runs(client, rid)
        assert sorted(r.name for r in rounds) == [round_flow_name(r) for r in range(1, 6)]
        assert all(r.state.is_completed() for r in rounds)
        parent = {r.name: UUID(next(t for t in r.tags if t.startswith(SEGMENT_RUN_TAG)).removeprefix(SEGMENT_RUN_TAG))
                  for r in rounds}
        assert {parent[round_flow_name(r)] for r in (1, 2)} == {seg1.id}
        assert {parent[round_flow_name(r)] for r in (3, 4)} == {relaunched.id}
        assert parent[round_flow_name(5)] == seg3.id
        handed = read_events(client, RUN_HANDED_OVER, resource_id=f"atoll.run.{rid}", at_least=2)
        assert [e.payload["round"] for e in handed] == [2, 4]
        [done] = read_events(client, RUN_FINISHED, resource_id=f"atoll.run.{rid}")
        assert done.payload["rounds"] == 5
    store = RunReader.open(url)
    assert store.latest_round() == 5 and [r.round for r in store.history(1, 5)] == [1, 2, 3, 4, 5]


def test_supervisor_relaunches_a_handed_over_segment_without_a_successor(deployed: dict[str, str],  # noqa: F811
                                                                         tmp_path: Path) -> None:
    from prefect.states import Completed

    url = to_url(str(tmp_path / "run-orphan-seg"))
    info = prepare_run(url, preset="smoke", rounds=6)
    options = TrainingRunOptions(run_url=url, preset="smoke")
    with _client() as client:
        fr = client.create_flow_run_from_deployment(UUID(deployed["atoll-training-run/default"]),
                                                    parameters={"options": options.model_dump(mode="json")},
                                                    tags=[run_tag(info.run_id), HANDED_OVER_TAG])
        client.set_flow_run_state(fr.id, Completed(), force=True)
        verdict = _supervise(client)[info.run_id]
        assert verdict.action == SupervisionAction.RELAUNCHED and verdict.launched
        # A Completed training run without the tag finished (or was stopped) by itself: not looked at.
        url2 = to_url(str(tmp_path / "run-done"))
        info2 = prepare_run(url2, preset="smoke", rounds=6)
        fr2 = client.create_flow_run_from_deployment(UUID(deployed["atoll-training-run/default"]),
                                                     parameters={"options": options.model_copy(
                                                         update={"run_url": url2}).model_dump(mode="json")},
                                                     tags=[run_tag(info2.run_id)])
        client.set_flow_run_state(fr2.id, Completed(), force=True)
        assert info2.run_id not in _supervise(client)
