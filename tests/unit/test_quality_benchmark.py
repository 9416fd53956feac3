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


def test_pareto_row_reports_its_bytes(quality, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A tiny row of the communication front (int4 up and down, H = 4) runs on counted stores and
    reports bytes up, down, requests and the effective H; its table row carries them."""
    from corpora import corpus_spec

    model = {"vocab_size": 256, "context_tokens": 16, "num_layers": 1, "num_heads": 2, "embed_dim": 16}
    spec, _ = corpus_spec("prose", code_mb=1.0)
    a = argparse.Namespace(tokens=quality.M * 2 * 16 * 12, batch=2, context=16, evals=2, eval_batches=1,
                           pareto_tol=0.02, pareto_target_fold=100, pareto_extra="")
    base = quality.diloco_configs(8, 0.8, 0.0)["decoupled"]
    pt = quality.ParetoPoint(up="int4", down="int4", h=4)
    config = quality.pareto_config(base, pt, fragments=2)
    assert (config.compression, config.downlink_compression, config.inner_steps, config.num_fragments) == ("int4", "int4", 4, 2)
    rounds: dict = {}  # one calibration serves both rows: codecs do not move virtual time
    r = quality.run_diloco(a, model, spec, config, 3e-3, 0, tmp_path, rounds_cache=rounds, wire=True)
    w = quality.wire_per_token(r)
    assert r["tokens"] >= a.tokens and w["up"] > 0 and w["down"] > 0 and w["req_k"] > 0 and w["sync"] > 0
    assert w["total"] == pytest.approx(w["up"] + w["down"]) and 0 < r["effective_h"] < 100 and 0 < r["merged_share"] <= 1
    ref = quality.run_diloco(a, model, spec, quality.pareto_config(base, quality.ParetoPoint(h=4), fragments=2), 3e-3,
                             0, tmp_path, rounds_cache=rounds, wire=True)
    assert len(rounds) == 1
    assert quality.wire_per_token(ref)["up"] > 3 * w["up"]  # fp32 deltas against int4's 4.5 bits per value
    lines: list[str] = []
    lr = 3e-3
    ref_key = quality.ParetoPoint().key(lr)  # the table's reference is H = 8 fp32; stand the H = 4 row in for it
    table = quality.pareto_table(a, {ref_key: {0: ref}, pt.key(lr): {0: r}}, {}, lr, 10_000, [0], lines.append)
    row = table["rows"][pt.key(lr)]
    assert row["up"] == w["up"] and row["down"] == w["down"] and row["dp_fold"] > 0 and row["n"] == 1
    assert any(line.startswith("up int4 / down int4, H=4") for line in lines)
    assert any("up B/tok" in line and "down B/tok" in line and "req/ktok" in line for line in lines)


def test_pareto_grid_and_front(quality) -> None:  # type: ignore[no-untyped-def]
    """The coordinate sweep varies one axis at a time; the cross product sheds, while too large, a
    value the sweep shows beaten on bytes and loss, then the worst loss, never the reference's; the
    front keeps the undominated points."""
    P = quality.ParetoPoint
    axes = {"up": ["fp32", "bf16", "int4"], "down": ["fp32", "bf16", "int4"], "h": [8, 16, 24, 48],
            "pacing": [0.0, 1.0]}
    coord = quality.coordinate_points(axes, P())
    assert coord[0] == P() and len(coord) == 9 and len(set(coord)) == 9
    assert all(sum(getattr(p, ax) != getattr(P(), ax) for ax in axes) == 1 for p in coord[1:])
    assert len(quality.cross_points(axes, P(), axes, 10**9)) == 72
    # (bytes per token, loss) of the sweep: bf16 costs more bytes than int4 for no better loss; H
    # = 48 has the worst loss; pacing saves bytes at a higher loss.
    sweep = {P(): (500.0, 2.60), P(up="bf16"): (400.0, 2.61), P(up="int4"): (300.0, 2.60),
             P(down="bf16"): (380.0, 2.61), P(down="int4"): (280.0, 2.60), P(h=16): (250.0, 2.62),
             P(h=24): (170.0, 2.66), P(h=48): (85.0, 2.79), P(pacing=1.0): (370.0, 2.70)}
    cross = quality.cross_points(axes, P(), axes, 24, sweep)
    assert len(cross) == 24 and P() in cross and P(up="int4", down="int4", h=16, pacing=1.0) in cross
    assert not any(p.up == "bf16" or p.down == "bf16" or p.h == 48 for p in cross)
    assert len(quality.cross_points(axes, P(), axes, 16)) <= 16  # no sweep: middle values go first
    assert quality.front({"a": (1.0, 3.0), "b": (2.0, 2.0), "c": (2.0, 2.5), "d": (3.0, 2.0)}) == ["a", "b"]
    assert P.from_key(P(up="bf16", h=24, pacing=1.0).key(6e-3)) == P(up="bf16", h=24, pacing=1.0)
    kept = P(h=24, extra="keep_local_progress:1;outer_lr:0.7")
    assert P.from_key(kept.key(6e-3)) == kept
    c = quality.pareto_config(quality.diloco_configs(8, 0.8, 0.0)["decoupled"], kept, fragments=8)
    assert (c.keep_local_progress, c.outer_lr, c.inner_steps, c.num_fragments) == (True, 0.7, 24, 8)
    # A point's own settings follow every point's (--pareto-extra): one invocation sweeps the outer step.
    own = quality.parse_point("int4/int4/8/1/keep_local_progress:1;outer_lr:0.5", "outer_momentum:0.5")
    assert own == P(up="int4", down="int4", h=8, pacing=1.0, extra="outer_momentum:0.5;keep_local_progress:1;outer_lr:0.5")
    assert quality.parse_point("int4/bf16/24/0") == P(up="int4", down="bf16", h=24)
    assert quality.has_settings(own.extra, "outer_momentum:0.5") and quality.has_settings(own.extra, "")
    assert not quality.has_settings(own.extra, "outer_momentum:0.9")
