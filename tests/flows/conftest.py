"""Flows and tasks under an isolated Prefect: a temporary PREFECT_HOME (never the user's ~/.prefect)
and one ``prefect_test_harness`` server for the whole session."""

from __future__ import annotations

import os
import tempfile

# Before anything imports prefect: settings are read from the environment on first use.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="atoll-flows-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from atoll.runs.manage import RunInfo, prepare_run  # noqa: E402
from atoll.runs.options import FleetOptions, TrainingRunOptions  # noqa: E402
from atoll.storage.paths import to_url  # noqa: E402
from atoll.train.local import LocalRun  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@dataclass
class SmokeRun:
    info: RunInfo
    result: dict[str, Any]
    url: str


@pytest.fixture(scope="session")
def smoke_run(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    """A smoke run of 6 rounds: 3 learner processes (no Prefect) and the training-run flow."""
    from atoll.flows.training import training_run

    root: Path = tmp_path_factory.mktemp("smoke")
    url = to_url(str(root / "run-smoke"))
    info = prepare_run(url, preset="smoke", rounds=6)
    with LocalRun(url, log_dir=root / "logs") as run:
        for spec in info.learners:
            run.start_learner(spec["learner_id"])
        # Executed rounds (not the default): test_flows checks each round's task runs.
        result = training_run(TrainingRunOptions(run_url=url, fleet=FleetOptions(manage=False, watch_every_s=5.0),
                                                 record_rounds=False))
    return SmokeRun(info=info, result=result, url=url)
