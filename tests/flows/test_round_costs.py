"""What a round costs Prefect, counted rather than timed: HTTP calls to the Prefect API
per round, the task runs and artifacts of each round flow run, and the events a run emits, read
back from the API.

Calls are counted by wrapping httpx's ``Client.send`` / ``AsyncClient.send`` in this process (every
Prefect client goes through them; events travel on a websocket and are counted separately). Per
round = (calls of a run of 2 + N rounds - calls of a run of 2 rounds) / N, so the run's fixed costs
(start, lease, learners' flow runs, final summary) cancel out.
"""

from __future__ import annotations

import collections
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from atoll.runs.manage import prepare_run
from atoll.runs.names import slug
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.storage.paths import to_url
from atoll.tasks.events import ROUND_COMMITTED, ROUND_STALLED, RUN_FINISHED
from atoll.train.local import LocalRun

from .events_helpers import read_events

pytestmark = pytest.mark.timeout(400)

MAX_CALLS_PER_ROUND = 9.0
"""Calls per round other than log shipping and CSRF tokens. Measured 7.3 in all on 2 cores (8.25 besides logs in a
loaded CI run; 12.1-12.3 with nest_rounds). A round that makes a tagged task run pays ~0.4 s waiting for its
tag-concurrency call, and one that builds a Settings object ~0.6 s: the round path does neither."""

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class CallCounter:
    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def note(self, request: Any, status: int | None = None) -> None:
        """One request; one the server refused as busy (503, 429) counts under ``busy ...``."""
        busy = "busy " if status in (429, 503) else ""
        with self.lock:
            self.calls[f"{busy}{request.method} {UUID_RE.sub('{id}', request.url.path)}"] += 1

    def snapshot(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.calls)


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> CallCounter:
    import httpx

    c = CallCounter()
    send, asend = httpx.Client.send, httpx.AsyncClient.send

    def counted(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        response = send(self, request, *a, **k)
        c.note(request, response.status_code)
        return response

    async def acounted(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        response = await asend(self, request, *a, **k)
        c.note(request, response.status_code)
        return response

    monkeypatch.setattr(httpx.Client, "send", counted)
    monkeypatch.setattr(httpx.AsyncClient, "send", acounted)
    return c


def _train(root: Path, name: str, rounds: int, counter: CallCounter,
           **options: Any) -> tuple[dict[str, Any], collections.Counter[str]]:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    from atoll.flows.training import training_run

    url = to_url(str(root / name))
    info = prepare_run(url, preset="smoke", rounds=rounds)
    with LocalRun(url, log_dir=root / f"{name}-logs") as run:
        for spec in info.learners:
            run.start_learner(spec["learner_id"])
        before = counter.snapshot()
        out = training_run(TrainingRunOptions(run_url=url, fleet=FleetOptions(manage=False, watch_every_s=5.0),
                                              **options))
        APILogWorker.drain_all()
        EventsWorker.drain_all()
        return out, counter.snapshot() - before


def test_api_calls_per_round_are_bounded(prefect_harness: None, tmp_path: Path, counter: CallCounter) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    from .test_flows import _round_runs

    extra = 4
    _, short = _train(tmp_path, "run-short", 2, counter, record_rounds=False)  # executed rounds
    out, long = _train(tmp_path, "run-long", 2 + extra, counter, record_rounds=False)
    assert out["rounds"] == 2 + extra
    per_round = {k: (long[k] - short[k]) / extra for k in set(long) | set(short)}
    # Log shipping and CSRF tokens follow the clock (a background worker flushes logs every few
    # seconds; a token is fetched per new client), not the round's structure: reported, not counted.
    total = sum(v for k, v in per_round.items() if k not in ("POST /api/logs/", "GET /api/csrf-token"))
    table = "\n".join(f"{v:6.2f} {k}" for k, v in sorted(per_round.items(), key=lambda kv: -kv[1]))
    assert total <= MAX_CALLS_PER_ROUND, f"{total:.2f} API calls per round:\n{table}"
    # No task run asks for tag-concurrency slots (task runs of a round carry no tags).
    assert not any("increment-with-lease" in k for k in long), table
    # One artifact per round (summary and contributions), plus the run's progress and goodput on
    # their own cadence.
    assert per_round.get("POST /api/artifacts/", 0.0) <= 1.5, table

    run_id = out["run_id"]
    with get_client(sync_client=True) as client:
        rounds = _round_runs(client, run_id)
        assert len(rounds) == 2 + extra
        for fr in rounds:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            names = [t.name.rsplit("-", 1)[0] for t in tasks]  # await-quorum again after each watch_every_s
            assert set(names) == {"await-quorum", "merge-and-commit"} and names.count("merge-and-commit") == 1
            assert all(not t.tags for t in tasks)
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
            assert [a.type for a in arts] == ["markdown"]  # written by the recorder, on this flow run

        # Events, read back from the API: one round-committed per round, about the run, naming the
        # round's flow run; one run-finished.
        committed = read_events(client, ROUND_COMMITTED, resource_id=f"atoll.run.{run_id}", at_least=2 + extra)
        assert sorted(e.payload["round"] for e in committed) == list(range(1, 3 + extra))
        by_round = {int(fr.name.split("-")[1]): str(fr.id) for fr in rounds}
        for e in committed:
            assert e.resource["atoll.run-id"] == run_id and e.resource["atoll.run-url"] == out["run_url"]
            related = {r.id: r.role for r in e.related}
            assert related.get(f"prefect.flow-run.{by_round[e.payload['round']]}") == "flow-run"
            assert {"fragment", "contributors", "quorum_s", "grace_s", "steps_since_sync", "goodput"} <= set(e.payload)
            assert e.payload["contributors"]
        [finished] = read_events(client, RUN_FINISHED, resource_id=f"atoll.run.{run_id}")
        assert finished.payload["rounds"] == 2 + extra and finished.payload["stopped"] is False


def test_a_round_that_waits_emits_round_stalled(prefect_harness: None, tmp_path: Path) -> None:
    """No learner at first: round 1 stays open past ``watch_every_s``, which emits atoll.round.stalled;
    the learners start a few seconds later and the run finishes."""
    from prefect.client.orchestration import get_client

    from atoll.flows.training import training_run

    url = to_url(str(tmp_path / "run-stall"))
    info = prepare_run(url, preset="smoke", rounds=1)
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        timer = threading.Timer(3.0, lambda: [run.start_learner(s["learner_id"]) for s in info.learners])
        timer.start()
        try:
            out = training_run(TrainingRunOptions(run_url=url, fleet=FleetOptions(manage=False, watch_every_s=1.0)))
        finally:
            timer.cancel()
    assert out["rounds"] == 1
    with get_client(sync_client=True) as client:
        stalled = read_events(client, ROUND_STALLED, resource_id=f"atoll.run.{info.run_id}")
        assert stalled and all(e.payload["round"] == 1 and e.payload["open_for_s"] >= 1.0 for e in stalled)
        assert "reason" in stalled[0].payload


def test_nest_rounds_runs_rounds_as_subflows(prefect_harness: None, tmp_path: Path) -> None:
    """``nest_rounds``: each round flow run is a subflow of the training run (nested in the UI),
    with the same tasks and artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from atoll.flows.training import training_run

    from .test_flows import _round_runs

    url = to_url(str(tmp_path / "run-nested"))
    info = prepare_run(url, preset="smoke", rounds=2)
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        for spec in info.learners:
            run.start_learner(spec["learner_id"])
        out = training_run(TrainingRunOptions(run_url=url, nest_rounds=True,
                                              fleet=FleetOptions(manage=False, watch_every_s=5.0)))
    assert out["rounds"] == 2
    with get_client(sync_client=True) as client:
        rounds = _round_runs(client, info.run_id)
        assert len(rounds) == 2 and all(r.parent_task_run_id is not None for r in rounds)
        parents = {client.read_task_run(r.parent_task_run_id).flow_run_id for r in rounds}
        assert len(parents) == 1 and client.read_flow_run(parents.pop()).parameters["options"]["nest_rounds"]
        for fr in rounds:
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
            assert [a.type for a in arts] == ["markdown"]


MAX_RECORDED_CALLS_PER_ROUND = 4.0
"""Recorded rounds, all from the recorder's threads, none on the round's own path: the round's flow
run created Running when it opens and set Completed when it commits (two calls: a state's time is
the server's, so this is how its duration is the round's), its one artifact (summary and
contributions); its task runs go as events (the websocket), its log lines with the batch's
(``POST /logs/``, not counted here). 3 calls a round, plus retries: a loaded SQLite server answers
some calls 503 (its write lock is held by the task-run and event writes), and the recorder sends
them again within tens of ms; the calls the server refused as busy are counted apart (``busy
...``) and not in this bound. Two artifacts a round (a keyed summary and a keyed
contributions table) cost the server 35 ms of CPU where one without a key costs 11 ms."""


def _check_recorded_rounds_look_like_what_happened(client: Any, rounds: list[Any], run_url: str) -> None:
    """Each recorded round's flow run lasts from the round's opening to its commit (as long as its
    phases, within the recorder's lag), its phases are task runs in order inside it, and its logs
    say what it merged."""
    import time

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    from atoll.storage import RunReader

    EventsWorker.drain_all()
    APILogWorker.drain_all()
    store = RunReader.open(run_url)
    for fr in rounds:
        fr = client.read_flow_run(fr.id)
        assert fr.start_time is not None and fr.end_time is not None and fr.end_time > fr.start_time, fr
        assert fr.total_run_time.total_seconds() > 0
        deadline, tasks = time.monotonic() + 60, []
        while time.monotonic() < deadline:  # task runs come from events: the server records them a moment later
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            if len(tasks) >= 4:
                break
            time.sleep(0.5)
        order = ["await-quorum", "grace", "merge", "commit"]
        tasks = sorted(tasks, key=lambda t: order.index(t.name.rsplit("-", 1)[0]))
        names = [t.name.rsplit("-", 1)[0] for t in tasks]
        assert names[0] == "await-quorum" and names[-1] == "commit" and "merge" in names, names
        # One after the other (a phase may take no time: a round whose learners are all in closes at once).
        assert all(a.end_time <= b.start_time for a, b in zip(tasks, tasks[1:], strict=False)), \
            (fr.name, [(t.name, str(t.start_time), str(t.end_time)) for t in tasks])
        assert all(t.state is not None and t.state.is_completed() and t.end_time >= t.start_time for t in tasks)
        assert sum(t.total_run_time.total_seconds() for t in tasks) > 0
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
        record = store.read_commit(int(fr.name.split("-")[1]))
        assert record is not None
        text = "\n".join(entry.message for entry in logs)
        assert f"committed: {len(record.accepted)} learner" in text
        assert all(f"merged {a.learner_id} (" in text for a in record.accepted), text


def test_recorded_rounds_are_completed_flow_runs_written_after_the_commit(
        prefect_harness: None, tmp_path: Path, counter: CallCounter) -> None:
    """``record_rounds``: the rounds run inline in the training run (no engine), and each one still
    becomes a flow run a person can open: named and tagged like the others, Completed, lasting as
    long as the round did, with a task run per phase at its real times, its log lines, the round's
    summary and contributions and the round-committed event; the run gets its plots."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from atoll.tasks.queries import ROUND_TAG, SEGMENT_RUN_TAG, run_tag

    from .test_flows import _round_runs

    extra = 4
    _, short = _train(tmp_path, "rec-short", 2, counter, record_rounds=True)
    out, long = _train(tmp_path, "rec-long", 2 + extra, counter, record_rounds=True)
    assert out["rounds"] == 2 + extra
    per_round = {k: (long[k] - short[k]) / extra for k in set(long) | set(short)}
    total = sum(v for k, v in per_round.items()
                if k not in ("POST /api/logs/", "GET /api/csrf-token") and not k.startswith("busy "))
    table = "\n".join(f"{v:6.2f} {k}" for k, v in sorted(per_round.items(), key=lambda kv: -kv[1]))
    assert total <= MAX_RECORDED_CALLS_PER_ROUND, f"{total:.2f} API calls per round:\n{table}"
    assert per_round.get("POST /api/task_runs/", 0.0) == 0.0, table

    run_id = out["run_id"]
    with get_client(sync_client=True) as client:
        rounds = _round_runs(client, run_id)
        assert sorted(fr.name for fr in rounds) == [f"round-{r:06d}" for r in range(1, 3 + extra)]
        for fr in rounds:
            assert fr.state is not None and fr.state.is_completed(), fr.state
            assert "committed in" in (fr.state.message or "")
            assert {run_tag(run_id), ROUND_TAG} <= set(fr.tags)
            assert any(t.startswith(SEGMENT_RUN_TAG) for t in fr.tags)
            assert fr.parameters["round_number"] == int(fr.name.split("-")[1])
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
            assert [a.type for a in arts] == ["markdown"]
            assert "goodput so far" in arts[0].data and "merged-work share so far" in arts[0].data
        _check_recorded_rounds_look_like_what_happened(client, rounds, out["run_url"])
        plots = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": [f"{slug(run_id)}-plots"]}))
        assert plots and "data:image/png;base64," in plots[-1].data and "merged-work share" in plots[-1].data
        committed = read_events(client, ROUND_COMMITTED, resource_id=f"atoll.run.{run_id}", at_least=2 + extra)
        by_round = {int(fr.name.split("-")[1]): str(fr.id) for fr in rounds}
        for e in committed:
            related = {r.id: r.role for r in e.related}
            assert related.get(f"prefect.flow-run.{by_round[e.payload['round']]}") == "flow-run"

    # A second recorder of the same run (a relaunched training run that adopted round 1) gets the
    # same flow run back: one flow run per round, whoever records it.
    from atoll.storage import RunReader
    from atoll.tasks.recorder import RoundRecorder

    again = RoundRecorder(RunReader.open(out["run_url"]), run_id=run_id, max_rounds=2 + extra, inner_steps=2,
                          round_run_tags=[run_tag(run_id), ROUND_TAG])
    again.submit(1, None, seconds=0.1)
    again.flush()
    assert again.recorded == [1]  # a failed try (the server busy) is tried again
    with get_client(sync_client=True) as client:
        assert [fr.name for fr in _round_runs(client, run_id)].count("round-000001") == 1

    # A training run killed after a commit and before its recorder wrote the round leaves committed
    # rounds without a flow run (here: deleted). The next training run of the run (the default is
    # recorded rounds) records them when it starts, and only them.
    from atoll.flows.training import training_run

    with get_client(sync_client=True) as client:
        by_name = {fr.name: fr.id for fr in _round_runs(client, run_id)}
        for name in ("round-000003", "round-000005"):
            client.delete_flow_run(by_name[name])
    again_out = training_run(TrainingRunOptions(run_url=out["run_url"], fleet=FleetOptions(manage=False)))
    assert again_out["rounds"] == 2 + extra and again_out["action"] == "continued"
    with get_client(sync_client=True) as client:
        rounds = _round_runs(client, run_id)
        names = [fr.name for fr in rounds]
        assert sorted(names) == [f"round-{r:06d}" for r in range(1, 3 + extra)], names  # each exactly once
        for fr in rounds:
            if fr.name in ("round-000003", "round-000005"):
                assert fr.id != by_name[fr.name] and fr.state is not None and fr.state.is_completed()
                arts = client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
                assert [a.type for a in arts] == ["markdown"]
            else:
                assert fr.id == by_name[fr.name]

    # A recorder far behind when its training run died leaves a whole tail unrecorded: the walk
    # goes back a window at a time until a window holds a recorded round (windows of 2 here).
    with get_client(sync_client=True) as client:
        for fr in _round_runs(client, run_id):
            if fr.name != "round-000001":
                client.delete_flow_run(fr.id)
    walker = RoundRecorder(RunReader.open(out["run_url"]), run_id=run_id, max_rounds=2 + extra, inner_steps=2,
                           round_run_tags=[run_tag(run_id), ROUND_TAG])
    assert walker.backfill(2 + extra, window=2) == list(range(2, 3 + extra))
    walker.flush()
    assert walker.recorded == list(range(2, 3 + extra))
    with get_client(sync_client=True) as client:
        assert sorted(fr.name for fr in _round_runs(client, run_id)) == [f"round-{r:06d}" for r in range(1, 3 + extra)]

    # A training run that died between a commit and its flow run's state leaves it Running (or
    # Cancelled, if it closed): the next one completes that same flow run.
    from prefect.states import Cancelled, Running

    with get_client(sync_client=True) as client:
        by_name = {fr.name: fr.id for fr in _round_runs(client, run_id)}
        client.set_flow_run_state(by_name["round-000002"], Running(), force=True)
        client.set_flow_run_state(by_name["round-000003"], Cancelled(), force=True)
    ender = RoundRecorder(RunReader.open(out["run_url"]), run_id=run_id, max_rounds=2 + extra, inner_steps=2,
                          round_run_tags=[run_tag(run_id), ROUND_TAG])
    assert ender.backfill(2 + extra) == [2, 3]
    ender.flush()
    assert ender.recorded == [2, 3]
    with get_client(sync_client=True) as client:
        rounds = _round_runs(client, run_id)
        assert sorted(fr.name for fr in rounds) == [f"round-{r:06d}" for r in range(1, 3 + extra)]
        assert {fr.name: fr.id for fr in rounds} == by_name
        assert all(fr.state is not None and fr.state.is_completed() for fr in rounds)

    # A write that fails (the bucket or the server unwell) is tried again: the rounds whose flow
    # runs it already created keep them (no second one), and every round gets its artifact.
    from atoll.storage.validation import TransientStorageError

    with get_client(sync_client=True) as client:
        for fr in _round_runs(client, run_id):
            if fr.name in ("round-000004", "round-000006"):
                client.delete_flow_run(fr.id)
    flaky = RoundRecorder(RunReader.open(out["run_url"]), run_id=run_id, max_rounds=2 + extra, inner_steps=2,
                          round_run_tags=[run_tag(run_id), ROUND_TAG], retry_s=0.1)
    real_update, failures = flaky.tracker.update, []

    def update_failing_once() -> Any:
        if not failures:
            failures.append(1)
            raise TransientStorageError("injected: the bucket is unwell")
        return real_update()

    flaky.tracker.update = update_failing_once  # type: ignore[method-assign]
    flaky.start()
    flaky.submit(4, None, seconds=0.1)
    flaky.submit(6, None, seconds=0.1)
    flaky.flush()  # returns once the failed batch is written on its retry
    assert sorted(flaky.recorded) == [4, 6]
    flaky.close()
    assert failures and flaky.errors == 1 and sorted(flaky.recorded) == [4, 6]
    with get_client(sync_client=True) as client:
        rounds = _round_runs(client, run_id)
        assert sorted(fr.name for fr in rounds) == [f"round-{r:06d}" for r in range(1, 3 + extra)]
        for fr in rounds:
            if fr.name in ("round-000004", "round-000006"):
                arts = client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
                assert [a.type for a in arts] == ["markdown"]

    # The same on the caller's thread (a recorder never started drains inline when flushed).
    inline = RoundRecorder(RunReader.open(out["run_url"]), run_id=run_id, max_rounds=2 + extra, inner_steps=2,
                           round_run_tags=[run_tag(run_id), ROUND_TAG], retry_s=0.1)
    failures.clear()
    real_update = inline.tracker.update

    def inline_failing_once() -> Any:
        if not failures:
            failures.append(1)
            raise TransientStorageError("injected: the bucket is unwell")
        return real_update()

    inline.tracker.update = inline_failing_once  # type: ignore[method-assign]
    inline.submit(6, None, seconds=0.1)
    inline.flush()
    assert failures and inline.errors == 1 and inline.recorded == [6]
