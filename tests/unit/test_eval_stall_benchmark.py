"""benchmarks/eval_stall.py in its smallest form: a micro GPT, a few rounds of each arm; its table,
JSON and plot (the measurement itself is in docs/benchmarks.md, never asserted on time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import eval_stall

    yield eval_stall
    sys.modules.pop("eval_stall", None)


def test_every_arm_runs_and_the_table_the_json_and_the_plot_are_written(bench, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert bench.main(["--model", "micro", "--rounds", "7", "--inline-rounds", "7", "--every", "2", "--interval-s",
                       "0", "--eval-batches", "1", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads((out / "eval_stall.json").read_text())
    rows = {r["arm"]: r for r in data["rows"]}
    assert set(rows) == {"none", "thread", "inline"} and data["tokens_per_evaluation"] == 16 * 64
    assert all(r["rounds"] == 3 for r in rows.values())  # 7 rounds, the first P = 4 warm up
    assert rows["none"]["evaluations"] == 0 and rows["none"]["p50_ratio"] == 1.0
    assert rows["inline"]["evaluations"] == 3  # rounds 2, 4, 6
    assert rows["thread"]["evaluations"] + rows["thread"]["skipped"] >= 1
    assert (out / "eval_stall.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "p50 ms" in printed and "evaluation every 2 rounds (1,024 tokens each)" in printed
