"""The training run's round retry (``atoll.flows.training``, ROUND_RETRY): a round that raises is
retried from the bucket's state; the run completes after fewer than ``ROUND_RETRY.attempts``
failures in a row, and fails with the round's own exception once they are used up.

The outer-round flow is replaced by a stand-in that raises on cue, else commits the round to the
bucket itself (no learners needed); the retry's delays are zeroed, the number of attempts is the
real policy's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from atoll.core.retry import ROUND_RETRY
from atoll.flows import training as training_mod
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.storage.paths import to_url
from atoll.tasks.context import RunContext

pytestmark = pytest.mark.timeout(240)


class RecordingLogger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.warnings.append(msg)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        pass


class FlakyRound:
    """Raises ``RuntimeError(f"round {r} boom {k}")`` on the k-th call for each k in ``fail``, else commits."""

    def __init__(self, fail: set[int]) -> None:
        self.fail = fail
        self.calls: list[int] = []

    def __call__(self, ctx: RunContext, r: int, run_id: str | None = None) -> dict[str, Any]:
        self.calls.append(r)
        if len(self.calls) in self.fail:
            raise RuntimeError(f"round {r} boom {len(self.calls)}")
        store = ctx.store
        p = (r - 1) % store.plan.num_fragments
        assert store.commit_round(r, p, params=store.read_global_fragment(p)).won
        ctx.synchronizer(r + 1)  # the real round leaves the synchronizer at the committed round
        return {"round": r, "goodput": 0.5}


@pytest.fixture
def retry(monkeypatch: pytest.MonkeyPatch) -> RecordingLogger:
    assert ROUND_RETRY.attempts == 3
    monkeypatch.setattr(training_mod, "ROUND_RETRY",
                        dataclasses.replace(ROUND_RETRY, base_delay_s=0.0, max_delay_s=0.0))
    log = RecordingLogger()
    monkeypatch.setattr(training_mod, "get_run_logger", lambda: log)
    return log


def _options(tmp_path: Path) -> TrainingRunOptions:
    # nest_rounds: the loop calls ``outer_round`` itself (replaced here); round flow runs of their own
    # would run the real flow through Prefect's engine.
    return TrainingRunOptions(run_url=to_url(str(tmp_path / "run")), preset="smoke", rounds=2, nest_rounds=True,
                              fleet=FleetOptions(manage=False))


def test_two_failed_rounds_in_a_row_are_retried(prefect_harness: None, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, retry: RecordingLogger) -> None:
    # Two failures of round 1, then two of round 2: a committed round resets the count.
    flaky = FlakyRound(fail={1, 2, 4, 5})
    monkeypatch.setattr(training_mod, "outer_round", flaky)
    out = training_mod.training_run(_options(tmp_path))
    assert out["rounds"] == 2 and out["goodput"] == 0.5
    assert flaky.calls == [1, 1, 1, 2, 2, 2]
    assert len(retry.warnings) == 4
    assert "round 1 failed (1 in a row): RuntimeError('round 1 boom 1'); retrying" in retry.warnings[0]
    assert "round 1 failed (2 in a row): RuntimeError('round 1 boom 2'); retrying" in retry.warnings[1]
    assert "round 2 failed (1 in a row): RuntimeError('round 2 boom 4')" in retry.warnings[2]
    assert "round 2 failed (2 in a row): RuntimeError('round 2 boom 5')" in retry.warnings[3]


def test_three_failed_rounds_in_a_row_fail_the_run(prefect_harness: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, retry: RecordingLogger) -> None:
    flaky = FlakyRound(fail={1, 2, 3})
    monkeypatch.setattr(training_mod, "outer_round", flaky)
    with pytest.raises(RuntimeError, match=r"^round 1 boom 3$"):
        training_mod.training_run(_options(tmp_path))
    assert flaky.calls == [1, 1, 1]
    assert [w.split(":")[0] for w in retry.warnings] == [f"round 1 failed ({k} in a row)" for k in (1, 2, 3)]


def test_a_failed_round_flow_run_of_its_own_is_retried(prefect_harness: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, retry: RecordingLogger) -> None:
    """Executed round flow runs of their own: the round's exception comes out of Prefect's
    engine into the loop, the round is retried, and the failed attempt stays a Failed flow run."""
    from prefect import Flow
    from prefect.client.orchestration import get_client

    from .test_flows import _round_runs

    flaky = FlakyRound(fail={1})

    def round_fn(ctx: Any, round_number: int, run_id: str | None = None) -> dict[str, Any]:
        return flaky(ctx, round_number, run_id)

    monkeypatch.setattr(training_mod, "ROUND_FLOW", Flow(fn=round_fn, name="atoll-round", persist_result=False))
    options = _options(tmp_path).model_copy(update={"nest_rounds": False, "record_rounds": False})
    out = training_mod.training_run(options)
    assert out["rounds"] == 2 and flaky.calls == [1, 1, 2]
    assert "round 1 failed (1 in a row): RuntimeError('round 1 boom 1'); retrying" in retry.warnings[0]
    with get_client(sync_client=True) as client:
        states = sorted((r.name, r.state.type.value) for r in _round_runs(client, out["run_id"]))
    assert states == [("round-000001", "COMPLETED"), ("round-000001", "FAILED"), ("round-000002", "COMPLETED")]
