"""benchmarks/chaos.py without the stack: the seeded schedule, the table and the plot.

The soak itself needs a Prefect server, workers and moto for ~30 minutes; the real-stack chaos
test (tests/integration/test_chaos.py) covers the same recovery paths in make test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def chaos(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import chaos

    yield chaos
    sys.modules.pop("chaos", None)


def test_the_kill_schedule_is_seeded_and_shared_by_both_modes(chaos) -> None:
    a = chaos.kill_schedule(3, minutes=10, learners=4, learner_kills=100, run_kills=10)
    assert a == chaos.kill_schedule(3, minutes=10, learners=4, learner_kills=100, run_kills=10)
    assert a != chaos.kill_schedule(4, minutes=10, learners=4, learner_kills=100, run_kills=10)
    assert [k.at_s for k in a] == sorted(k.at_s for k in a) and all(30 <= k.at_s <= 570 for k in a)
    kinds = [k.kind for k in a]
    assert kinds.count("learner") == 100 and kinds.count("run-before-commit") == 5 and kinds.count("run") == 5
    assert {k.target for k in a if k.kind == "learner"} == {0, 1, 2, 3}


def test_the_table_and_the_plot(chaos, tmp_path: Path) -> None:
    def result(name: str, goodput: float) -> object:
        return chaos.ModeResult(
            name=name, wall_s=600, rounds=320, lost=0, duplicated=0, chain_ok=True, problems=[], worst_copies=1,
            learner_kills=100, run_kills=10, run_kills_before_commit=5, skipped=2,
            relaunch_s={"learner": [10.0, 12.0, 30.0], "run": [20.0]}, not_back=0, goodput_wall=goodput,
            work_share=0.7, faults={"held commits": 5}, timeline=[(1.0, 2, 0.5), (2.0, 3, goodput)], contributors=2.5)

    out = chaos.table([result("K=1+grace", 0.8), result("lock-step K=M", 0.5)])
    assert "K=1+grace" in out and "lock-step K=M" in out
    assert "80.0%" in out and "50.0%" in out and "12.0 / 30.0" in out and "10 (5)" in out
    assert chaos.plot([result("a", 0.8)], tmp_path).stat().st_size > 0
