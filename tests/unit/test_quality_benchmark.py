"""benchmarks/quality.py's bare sync DiLoCo row (plain PyTorch, no atoll) runs, learns and labels itself."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def quality(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCH))
    import quality

    yield quality
    sys.modules.pop("quality", None)


def test_bare_sync_diloco_row_trains(quality) -> None:  # type: ignore[no-untyped-def]
    from atoll.train.model import GPTConfig
    from corpora import corpus_spec

    gpt = GPTConfig.from_dict({"vocab_size": 256, "context_tokens": 16, "num_layers": 1, "num_heads": 2,
                               "embed_dim": 16})
    spec, _ = corpus_spec("prose", code_mb=1.0)
    spec = dataclasses.replace(spec, seed=0, shard="interleaved")
    a = argparse.Namespace(tokens=quality.M * 4 * 16 * 12, batch=4, evals=3, eval_batches=1)
    out = quality.run_bare_sync(a, gpt, spec, 3e-3, 0, 4)
    assert out["tokens"] == a.tokens and out["rounds"] == 3 and len(out["curve"]) == 3
    assert all(math.isfinite(v) for _, v in out["curve"])
    assert out["curve"][-1][1] < out["curve"][0][1] < math.log(256) + 0.5  # it learns
    assert quality.label_of("bare-sync", None, 3e-3, "8,0.8").startswith("sync DiLoCo H=8, mean, outer lr 0.8")
