"""benchmarks/replay_restart.py in its smallest form: a 0.1 M-parameter GPT, P = 4, masters on
every version and every 4th; the restart at the deepest depth replays and reports it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_restart_at_the_deepest_depth_is_timed(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import replay_restart

    try:
        assert replay_restart.main(["--size", "0.1M", "--fragments", "4", "--masters", "1,4"]) == 0
    finally:
        sys.modules.pop("replay_restart", None)
        sys.modules.pop("sync_throughput", None)
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["M", "round"])
    every, sparse = (line.split() for line in lines[head + 1:head + 3])
    assert every[:3] == ["1", "4", "0"]  # one pass, nothing to replay
    assert sparse[:3] == ["4", "12", "8"]  # 3 passes: every fragment at depth 3, 2 rounds each to replay
    assert float(every[3]) > 0 and float(sparse[3]) > 0
