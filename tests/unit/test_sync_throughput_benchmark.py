"""benchmarks/sync_throughput.py in its smallest form: a 0.1 M-parameter GPT, two rounds with their
inputs ready and a short emulated run, on a local folder; its table, JSON and plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import sync_throughput

    yield sync_throughput
    sys.modules.pop("sync_throughput", None)


@pytest.mark.parametrize(("masters", "name", "first_round", "writes"), [
    ("1", "0.1M P=8 M=2 int4", 1, 5),
    # Measured past the first pass: versions at depth 2 name their master and momentum, write neither.
    ("16", "0.1M P=8 M=2 int4 m16", 9, 3),
])
def test_the_smallest_configuration_fills_every_field(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      masters: str, name: str, first_round: int, writes: int) -> None:
    out = tmp_path / "out"
    assert bench.main(["--sizes", "0.1M", "--fragments", "8", "--learners", "2", "--codecs", "int4", "--rounds", "2",
                       "--master-every", masters,
                       "--emulate-s", "1.5", "--work-dir", str(tmp_path / "runs"), "--out", str(out)]) == 0
    (row,) = json.loads((out / "sync_throughput.json").read_text())["rows"]
    assert row["config"] == name and row["store"] == "local"
    assert 100_000 < row["params"] < 200_000
    for key in ("round_s", "cpu_s", "merge_s", "commit_s", "io_bound_s", "ratio", "arith_s", "floor_ratio",
                "rounds_per_s", "mb_read",
                "mb_written", "requests_read", "requests_written", "rss_gb"):
        assert row[key] > 0, key
    assert row["rounds_per_s"] == pytest.approx(1 / row["round_s"], rel=0.02)  # one measured round
    first, second = row["rounds"]
    assert (first["round"], first["fragment"], second["round"], second["fragment"]) == (first_round, 0,
                                                                                        first_round + 1, 1)
    for r in (first, second):
        assert r["merged"] == 2 and r["polls"] >= 1
        # fp32 master, momentum, the int4 update, the commit record, the head hint (the learners' view is
        # a snapshot only every downlink_snapshot_every versions: none in these)
        assert r["wire"]["puts"] == r["requests_written"] == writes
        assert r["ratio"] == pytest.approx(r["wall_s"] / r["io_bound_s"], rel=0.02)
        assert r["floor_ratio"] == pytest.approx(r["wall_s"] / (r["io_bound_s"] + r["arith_s"]), rel=0.02)
    assert row["back_to_back"]["sequential_round_s"] > 0 and row["back_to_back"]["pipelined_round_s"] > 0
    e = row["emulated"]
    assert e["seconds"] == 1.5 and e["needed_rounds_per_s"] == pytest.approx(1 / 0.06)
    assert e["rounds"] >= 1 and e["publishes"] >= e["rounds"] and not e["publish_errors"]
    assert e["effective_h"] > 0 and e["fleet_cores"] > 0
    assert (out / "sync_throughput.png").stat().st_size > 0
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # each run is deleted
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert lines[head].split()[:4] == ["config", "params", "round", "s"]
    assert lines[head + 2].startswith(name)


def test_a_size_that_does_not_fit_is_skipped_with_a_reason(bench, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    monkeypatch.setattr(bench, "available_gb", lambda: 4.0)
    args = bench.parse_args(["--sizes", "1B"])
    progress = bench.Progress()
    try:
        row = bench.measure(bench.Setup("1B", 8, 8, "fp32"), args, str(tmp_path), None, progress)
    finally:
        progress.close()
    assert row["skipped"].startswith("needs ~") and "4.0 GB available" in row["skipped"]
    assert 1.0e9 < row["params"] < 1.05e9
    assert "skipped:" in bench.table([row]).splitlines()[-1]


def test_quick_is_the_small_grid(bench) -> None:
    args = bench.parse_args(["--quick"])
    assert isinstance(args, argparse.Namespace)
    assert (args.sizes, args.fragments, args.learners, args.codecs) == ("10M,86M", "8", "4", "int4")


@pytest.mark.parametrize(("uplink", "downlink", "momentum"), [("int4", "int4", 0.9), ("bf16", "fp32", 0.0),
                                                              ("fp32", "fp32", 0.9)])
def test_the_arithmetic_floor_is_measured_once_per_fragment_size(monkeypatch: pytest.MonkeyPatch, uplink: str,
                                                                  downlink: str, momentum: float) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from round_floor import ArithmeticFloor

    floor = ArithmeticFloor(4096, 3, uplink, downlink, momentum, repeats=2)
    first = floor.seconds(4000)
    assert 0 < first < 10 and floor.seconds(4000) == first  # cached by size
    assert floor.seconds(1000) > 0 and len(floor._seconds) == 2
