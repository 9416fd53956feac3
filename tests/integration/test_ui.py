"""What the Prefect UI shows of a run, checked in a real browser (headless Debian Chromium).

A short run with recorded rounds (the default) trains against a real Prefect server with its UI:
two learner processes and the training run in this process. Then Chromium opens the pages a person
opens, and the checks read what the page rendered (its text after the app's scripts ran, its
images), not the API: a round's flow run shows a non-zero duration and its phases as task runs, and
the run's plots artifact shows PNG images. Screenshots go to out/ui/ for people to look at.

The browser comes from the machine (``make test`` installs it when missing: the Makefile's
``chromium`` target). Without one the tests skip, unless ``ATOLL_REQUIRE_CHROMIUM=1`` (CI sets it
in ``.ci/run``), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from atoll.ops import observe
from atoll.ops.procs import free_port
from atoll.ops.stack import LocalStack

from .browser import Chromium, find_chromium
from .stack_helpers import MARKER_VAR, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHOTS = Path(__file__).resolve().parents[2] / "out" / "ui"
"""Screenshots for people (the repository's out/, which git ignores)."""

ROUNDS = 3
"""Rounds of the run: enough for a few recorded rounds and a plot with more than one point."""

PAGE_TIMEOUT_S = 180.0
"""How long a page may take to render what is checked (the SPA's API calls on a loaded machine)."""


def _require_chromium() -> None:
    if find_chromium() is None:
        why = "no headless Chromium on this machine (make chromium, or apt-get install chromium, or ATOLL_CHROMIUM)"
        if os.environ.get("ATOLL_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"ATOLL_REQUIRE_CHROMIUM=1 and {why}")
        pytest.skip(why)


@dataclass
class UiRun:
    stack: LocalStack
    browser: Chromium
    run_id: str
    result: dict[str, Any]
    rounds: list[Any]
    """The run's round flow runs (API objects), oldest first."""
    artifacts: list[Any]
    """Every artifact of the run's keys, and those on its flow runs (API objects)."""


@pytest.fixture(scope="module")
def ui_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiRun]:
    """A real server with its UI, a recorded run of ROUNDS rounds on it, and a browser."""
    _require_chromium()
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    from atoll.flows.training import training_run
    from atoll.runs.manage import prepare_run
    from atoll.runs.options import FleetOptions, TrainingRunOptions
    from atoll.storage.paths import to_url
    from atoll.tasks.queries import ROUND_FLOW_NAME, read_flow_runs_paged, run_tag
    from atoll.train.local import LocalRun

    tmp = tmp_path_factory.mktemp("ui")
    marker = uuid.uuid4().hex
    env = {MARKER_VAR: marker}
    stack = LocalStack(home=tmp / "prefect", port=free_port(), pools=(), log_dir=tmp / "logs", env=env)
    url = to_url(str(tmp / "run-ui"))
    info = prepare_run(url, preset="smoke", learners=2, rounds=ROUNDS)
    browser: Chromium | None = None
    try:
        with LocalRun(url, log_dir=tmp / "logs", extra_env=env) as run:
            for spec in info.learners:  # they start training while the server comes up
                run.start_learner(spec["learner_id"])
            stack.start_server(timeout_s=240)  # a loaded machine: the suite beside it
            with stack.settings():
                # Prefect keeps one events worker per process whatever the server: one an earlier test
                # left behind would send this run's task runs and events to that test's server, now gone.
                EventsWorker.drain_all()
                result = training_run(TrainingRunOptions(run_url=url, fleet=FleetOptions(manage=False)))
                EventsWorker.drain_all()  # every task run and event on this server before the pages load
        browser = Chromium(env={**os.environ, **env}, log=tmp / "logs" / "chromium.log")
        with stack.settings(), get_client(sync_client=True) as client:
            rounds = sorted(read_flow_runs_paged(client, flow_names=[ROUND_FLOW_NAME], tags=[run_tag(result["run_id"])]),
                            key=lambda fr: fr.name)
            artifacts = list(client.read_artifacts())
        yield UiRun(stack=stack, browser=browser, run_id=result["run_id"], result=result, rounds=rounds,
                    artifacts=artifacts)
    finally:
        if browser is not None:
            browser.close()
        stack.stop()
        try:
            wait_for(lambda: not observe.processes_with(MARKER_VAR, marker), 30, "every process of the test to exit",
                     every_s=0.5)
        finally:
            for pid in observe.processes_with(MARKER_VAR, marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


DURATION = re.compile(r"^(?:(\d+)h\s*)?(?:(\d+)m\s*)?(?:(\d+(?:\.\d+)?)s)?$")


def _header_duration_s(text: str) -> float | None:
    """The flow run's duration as its page's header shows it ("3s", "1m 2s"), in seconds; None if absent."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        if re.fullmatch(r"\d+ Task runs?", ln) and i > 0:
            m = DURATION.match(lines[i - 1])
            if m and any(m.groups()):
                h, mi, s = (float(g) if g else 0.0 for g in m.groups())
                return 3600 * h + 60 * mi + s
    return None


def test_a_recorded_round_shows_its_duration_and_its_phases_as_task_runs(ui_run: UiRun) -> None:
    assert len(ui_run.rounds) == ROUNDS, [fr.name for fr in ui_run.rounds]
    # The round that took longest by the server's clock: its duration is the surest to show above 0 s.
    fr = max(ui_run.rounds, key=lambda r: r.total_run_time.total_seconds() if r.total_run_time else 0.0)
    b = ui_run.browser
    b.goto(f"{ui_run.stack.ui_url}/runs/flow-run/{fr.id}")
    text = b.wait_for(lambda t: fr.name in t and "Task run" in t and "Completed" in t, PAGE_TIMEOUT_S,
                      f"the flow run {fr.name} with its header")
    b.screenshot(SHOTS / "round.png")
    seconds = _header_duration_s(text)
    count = re.search(r"(\d+) Task runs?", text)
    assert seconds is not None and seconds > 0, f"no duration above 0 s in the header:\n{text[:1500]}"
    assert count is not None and int(count.group(1)) >= 2, f"no task runs in the header:\n{text[:1500]}"
    assert b.click("Task Runs")
    text = b.wait_for(lambda t: "await-quorum" in t and "merge" in t, PAGE_TIMEOUT_S, "the round's phases as task runs")
    b.screenshot(SHOTS / "round-task-runs.png")
    assert "Completed" in text


def test_a_recorded_round_shows_its_log_lines(ui_run: UiRun) -> None:
    fr = ui_run.rounds[-1]
    b = ui_run.browser
    b.goto(f"{ui_run.stack.ui_url}/runs/flow-run/{fr.id}")  # the Logs tab is the page's first
    # What it merged, and how it closed (its logger is atoll.round).
    text = b.wait_for(lambda t: fr.name in t and "merged learner-" in t and "committed:" in t, PAGE_TIMEOUT_S,
                      f"the log lines of {fr.name}")
    b.screenshot(SHOTS / "round-logs.png")
    assert "atoll.round" in text


def test_the_run_plots_artifact_renders_png_images(ui_run: UiRun) -> None:
    from atoll.tasks.round_artifacts import artifact_keys

    key = artifact_keys(ui_run.run_id)["plots"]
    versions = [a for a in ui_run.artifacts if a.key == key]
    assert versions, sorted({a.key for a in ui_run.artifacts if a.key})
    latest = max(versions, key=lambda a: a.created)
    b = ui_run.browser
    # Where a person finds it (Artifacts, then the key): every version, the newest first.
    b.goto(f"{ui_run.stack.ui_url}/artifacts/key/{key}")
    b.wait_for(lambda t: key in t and str(latest.id)[:8] in t, PAGE_TIMEOUT_S, f"the versions of artifact {key}")
    # The newest version's own page renders its markdown: the plots.
    b.goto(f"{ui_run.stack.ui_url}/artifacts/artifact/{latest.id}")

    def rendered(text: str) -> bool:
        return any(i["src"].startswith("data:image/png") and i["width"] > 0 for i in b.images())

    b.wait_for(rendered, PAGE_TIMEOUT_S, f"a PNG image in artifact {key}")
    b.screenshot(SHOTS / "run-plots.png", height=1900)
    pngs = [i for i in b.images() if i["src"].startswith("data:image/png")]
    assert pngs and all(i["complete"] and i["width"] > 100 and i["height"] > 100 for i in pngs), pngs
