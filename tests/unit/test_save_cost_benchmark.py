"""benchmarks/save_cost.py in its smallest form: the planned table, one short measured run; its
table, JSON and plot (the measurement itself is in docs/benchmarks.md, never asserted on time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import save_cost

    yield save_cost
    sys.modules.pop("save_cost", None)


def test_the_planned_table_and_a_measured_run_are_printed_and_written(bench, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert bench.main(["--steps", "60", "--runs", "demo-fixed-50", "--out", str(out)]) == 0
    data = json.loads((out / "save_cost.json").read_text())
    planned = {(r["name"], r["moments"]): r for r in data["planned"]}
    assert all(r["share"] <= 0.1 + 1e-9 for r in planned.values())
    (run,) = data["measured"]
    assert run["name"] == "demo-fixed-50" and run["steps"] == 60 and run["saves"] == 1  # step 50; step 60 on exit
    assert run["save_bytes"] > 0 and run["exit_save_bytes"] > 0 and run["other_up_bytes"] > 0
    assert (out / "save_cost.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "planned (byte formulas)" in printed and "gpu 1B" in printed and "demo-fixed-50" in printed
