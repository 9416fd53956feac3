"""benchmarks/codec_speed.py in its smallest form: a fragment of a 0.1 M-parameter GPT, once; the
plain codec and atoll's agree bit for bit (the script checks before it times), its table and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import codec_speed

    yield codec_speed
    sys.modules.pop("codec_speed", None)


def test_the_smallest_fragment_fills_every_row(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--size", "0.1M", "--repeats", "1", "--block-size", "6", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "codec_speed.json").read_text())
    assert doc["info"]["size"] == "0.1M" and doc["info"]["fragment_params"] > 0
    assert [r["what"].split(" (")[0] for r in doc["rows"]][:4] == ["decode payload", "decode", "encode",
                                                                    "downlink step"]
    for row in doc["rows"]:
        for key in ("old_wall_median_ms", "new_wall_median_ms", "old_cpu_best_ms", "speedup", "cpu_speedup"):
            assert row[key] >= 0, key
    assert "| per fragment | before ms |" in capsys.readouterr().out
