"""benchmarks/pacing.py in its smallest form: two short virtual runs, its columns and its plot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pacing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import pacing

    yield pacing
    sys.modules.pop("pacing", None)


def test_pacing_benchmark_rows_and_plot(pacing, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pacing.main(["--pacing", "0,1", "--steps", "24", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["round_pacing", "rounds", "merged/round", "effective", "H", "merged-work", "share",
                              "B/token", "val", "loss"]
    off, on = (line.split() for line in out[2:4])
    assert off[0] == "0" and on[0] == "1"
    assert int(on[1]) < int(off[1]) and float(on[3]) > float(off[3])  # fewer rounds, more steps per contribution
    assert (tmp_path / "pacing.png").stat().st_size > 0
