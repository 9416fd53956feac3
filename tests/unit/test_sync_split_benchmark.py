"""benchmarks/sync_split.py in its smallest form: a 0.1 M-parameter GPT, one and two merger
processes over one pass of rounds and a short emulated run, on a local folder; its table, JSON
and plot, and no merger process left behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import sync_split

    yield sync_split
    for name in ("sync_split", "sync_throughput"):
        sys.modules.pop(name, None)


def test_one_and_two_mergers_fill_every_field(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, work = tmp_path / "out", tmp_path / "runs"
    work.mkdir()
    assert bench.main(["--sizes", "0.1M", "--fragments", "4", "--learners", "2", "--groups", "1,2", "--passes", "2",
                       "--emulate-s", "2", "--work", str(work), "--out", str(out)]) == 0
    rows = json.loads((out / "sync_split.json").read_text())["rows"]
    assert [r["groups"] for r in rows] == [1, 2]
    for r in rows:
        b, e = r["back_to_back"], r["emulated"]
        assert r["config"].startswith("0.1M P=4 M=2 int4") and 100_000 < r["params"] < 200_000
        assert b["round_s"] > 0 and b["cores"] > 0 and b["threads"] >= 1
        assert e["rounds"] >= 1 and e["rounds_per_s"] > 0 and e["effective_h"] > 0
    assert (out / "sync_split.png").stat().st_size > 0
    assert not any(work.iterdir())  # each run (and the mergers' go file) is deleted
    with pytest.raises(SystemExit):
        bench.parse_args(["--passes", "1"])
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert len(lines[head + 2].split()) >= 8 and "1.00x" in lines[head + 2]
