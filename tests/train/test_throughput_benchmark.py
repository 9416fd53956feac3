"""benchmarks/throughput.py runs (quick mode, CPU): the table and the plot come out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import atoll.train.learner as learner_mod

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(learner_mod, "publish_due", learner_mod.publish_due)  # the benchmark patches it: restore
    import throughput

    assert throughput.main(["--quick", "--device", "cpu", "--fragment-mb", "1", "--island-ranks", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(a) learner tokens/s vs bare PyTorch loop" in out and "writing contributions in the step" in out
    assert "(d) bare loop + atoll.join vs the same, off" in out and "step time added by the hook" in out
    assert "(b) merge + outer step (rda, M=4) GB/s" in out and "(b) merge + outer step (mean, M=4) GB/s" in out
    assert (tmp_path / "throughput.png").stat().st_size > 0
    sys.modules.pop("throughput", None)
