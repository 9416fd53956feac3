"""The training-run, round and learner flows under prefect_test_harness; tasks through ``.fn()``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atoll.runs.goodput import GoodputTracker
from atoll.runs.manage import prepare_run
from atoll.runs.names import round_flow_name
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.runs.render import contributions_from_markdown
from atoll.runs.report import run_status
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.tasks.queries import SEGMENT_RUN_TAG, run_tag

pytestmark = pytest.mark.timeout(300)


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _round_runs(client, run_id: str):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterTags

    return client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=["atoll-round"])),
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id)])),
    )


def test_one_completed_round_flow_run_per_round_named_and_tagged(smoke_run) -> None:
    assert smoke_run.result["rounds"] == 6 and smoke_run.result["action"] == "continued"
    with _client() as client:
        runs = _round_runs(client, smoke_run.info.run_id)
        assert sorted(r.name for r in runs) == [round_flow_name(r) for r in range(1, 7)]
        assert all(r.state is not None and r.state.is_completed() for r in runs)
        assert all({run_tag(smoke_run.info.run_id), "atoll-round"} <= set(r.tags) for r in runs)
        # The UI shows the run and the round; the run's context (tensors) is never serialized.
        assert all(r.parameters == {"ctx": "<RunContext>", "round_number": int(r.name.split("-")[1]),
                                    "run_id": smoke_run.info.run_id} for r in runs)
        # A flow run of its own (no subflow bookkeeping), tagged with the training-run flow run that ran it.
        assert all(r.parent_task_run_id is None for r in runs)
        [segment_tag] = [t for t in runs[0].tags if t.startswith(SEGMENT_RUN_TAG)]
        parent = client.read_flow_run(segment_tag.removeprefix(SEGMENT_RUN_TAG))
        assert parent.parameters["options"]["run_url"] == smoke_run.url
        assert parent.parameters["options"]["fleet"]["manage"] is False
        # Each round ran its two tasks (its artifacts come from the run's recorder, off the critical path).
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
        names = {t.name.rsplit("-", 1)[0] for t in tasks}
        assert names == {"await-quorum", "merge-and-commit"}


def test_round_artifacts_match_the_bucket(smoke_run) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    store = RunReader.open(smoke_run.url)
    with _client() as client:
        for fr in _round_runs(client, smoke_run.info.run_id):
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
            # One artifact per round, with no key (a key would gather a version per round).
            [art] = arts
            assert art.type == "markdown" and art.key is None
            round_ = int(fr.name.split("-")[1])
            record = store.read_commit(round_)
            summary = art.data
            # Its contributions table is the commit record's: each merged learner with its weight,
            # and one line per contribution given weight 0.
            rows = contributions_from_markdown(summary)
            accepted = {r["learner"]: float(r["weight"]) for r in rows if r["status"] == "accepted"}
            assert accepted == {a.learner_id: round(a.weight, 6) for a in record.accepted}
            assert sum(1 for r in rows if r["status"] != "accepted") == len(record.rejected)
            assert all(r["pool"] == "cpu-fast" for r in rows if r["status"] == "accepted")
            assert f"# Round {round_} of 6" in summary and "quorum reached after" in summary
            assert "goodput so far" in summary and "| learner | goodput so far | merged-work share |" in summary
            assert "merged-work share so far" in summary
            assert "steps since last sync" in summary and "(H = " in summary
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(type={"any_": ["progress"]}))
        assert any(a.key == "run-smoke-run-summary-progress" and float(a.data) == 100.0 for a in progress)
        goodput = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["run-smoke-goodput"]}))
        assert goodput and all("goodput" in a.data and "merged-work share" in a.data for a in goodput)
        # The run's plots, drawn at the end of the training run, on it.
        [plots] = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["run-smoke-plots"]}))
        assert plots.type == "markdown" and plots.data.count("](data:image/png;base64,") == 5
        assert "goodput" in plots.data and "merged-work share" in plots.data
        assert len(plots.data) < 500_000  # small PNGs: far under what the server accepts


def test_goodput_and_status_come_from_the_bucket(smoke_run) -> None:
    store = RunReader.open(smoke_run.url)
    report = GoodputTracker(store).update()
    assert report.goodput is not None and 0.0 < report.goodput <= 1.0
    assert smoke_run.result["goodput"] == pytest.approx(report.goodput)
    assert report.merged_share is not None and 0.0 < report.merged_share <= 1.0
    assert smoke_run.result["merged_share"] == pytest.approx(report.merged_share)
    for t in report.learners.values():  # every second of a learner is training, waiting or restarting
        assert t.training_s + t.waiting_s + t.down_s == pytest.approx(t.available_s)
        assert 0 < t.goodput <= 1 and t.tokens_per_s is not None and t.tokens_per_s > 0
    tracker = GoodputTracker(store)
    lines = run_status(store, tracker=tracker)
    assert "6 of 6 rounds committed (finished)" in lines[1]
    assert any(line.startswith("goodput ") and "useful training steps" in line for line in lines)
    assert any(line.startswith("merged-work share ") for line in lines)
    assert sum(1 for line in lines if line.strip().split(" ")[0].isdigit()) == 6
    assert [p.round for p in tracker.series] == list(range(1, 7)) and tracker.series[-1].goodput == report.goodput
    assert any(p.val_loss is not None for p in tracker.series)


def test_status_plots_come_from_the_bucket(smoke_run, tmp_path) -> None:
    """``atoll status --plot DIR``: the run's PNGs from the bucket alone."""
    from atoll.cli import main

    assert main(["status", smoke_run.url, "--plot", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == sorted(f"{n}.png" for n in ("loss", "figures", "contributors", "bytes", "learners"))
    for p in (tmp_path / "plots").iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000


def test_training_run_on_a_finished_run_continues_and_commits_nothing(smoke_run) -> None:
    from atoll.flows.training import training_run

    out = training_run(TrainingRunOptions(resume_from=smoke_run.url, fleet=FleetOptions(manage=False)))
    assert out["rounds"] == 6 and out["action"] == "continued"


def test_fork_starts_a_new_run_from_a_committed_round(smoke_run, tmp_path: Path) -> None:
    src = RunReader.open(smoke_run.url)
    url = to_url(str(tmp_path / "fork"))
    info = prepare_run(url, resume_from=smoke_run.url, fork_round=3, rounds=4)
    assert info.action == "forked" and info.latest_round == 0 and info.max_rounds == 4
    dst = RunReader.open(url)
    assert dst.manifest.extra["forked_from"]["round"] == 3
    want = src.read_global_state(3).params
    got = dst.read_global_state(0).params
    assert all(torch.equal(want[n], got[n]) for n in want)
    # Calling it again (a restarted training run) continues the fork instead of failing.
    assert prepare_run(url, resume_from=smoke_run.url, fork_round=3).action == "continued"


def test_learner_flow_trains_and_reports(prefect_harness: None, tmp_path: Path) -> None:
    from atoll.flows.learner import learner_flow

    url = to_url(str(tmp_path / "run-l"))
    prepare_run(url, preset="smoke", rounds=3)
    out = learner_flow(url, "learner-1", max_steps=4, log_every_steps=2)
    assert out["steps"] == 4 and out["published"] == 4
    assert RunReader.open(url).load_learner_state("learner-1") is not None


def test_learner_flow_runs_a_users_own_loop_with_the_same_lease(prefect_harness: None, tmp_path: Path) -> None:
    """LearnerSpec.command / the flow's ``command``: the user's script joins with atoll.join, under
    the flow run's id; a failing script fails the flow run (so healing relaunches it)."""
    import subprocess
    import sys

    from atoll.flows.learner import learner_flow

    examples = Path(__file__).resolve().parents[2] / "examples"
    url = to_url(str(tmp_path / "run-byo"))
    subprocess.run([sys.executable, str(examples / "plain_loop.py"), "--create", url, "--learners", "2"], check=True)
    out = learner_flow(url, "learner-1", command=[sys.executable, str(examples / "plain_loop.py"), "--max-steps", "12"])
    assert out["exit_code"] == 0 and out["exit_detail"].startswith("should_stop"), out
    store = RunReader.open(url)
    live = store.learner_liveness("learner-1")
    assert live.lease is not None and live.lease.flow_run_id  # the flow run's id, in the script's lease
    saved = store.load_learner_state("learner-1")
    assert saved is not None and saved.meta["step"] == 12 and saved.meta["user"]["step"] == 12
    assert store.list_contributions(0, 0).records  # it published (fragment 0 against version 0)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        learner_flow(url, "learner-1", command=[sys.executable, "-c", "raise SystemExit(3)"])
