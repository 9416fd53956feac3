"""The merge's memory-traffic shortcuts change nothing but rounding-free bookkeeping."""

from __future__ import annotations

import torch

from atoll.core.merge import rda, weighted_mean
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.pseudograd import anchor_gradient, outer_gradient
from atoll.core.synchronize import FragmentContribution, synchronize_fragment
from atoll.core.weights import Counters


def _tensors(m: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(257, generator=g) for _ in range(m)]


def test_rda_with_given_norms_is_the_same_tensor() -> None:
    ts, w = _tensors(4), [1.0, 2.0, 0.5, 3.0]
    norms = [float(torch.linalg.vector_norm(t)) for t in ts]
    assert torch.equal(rda(ts, w, norms=norms), rda(ts, w))
    # Against the formula: (sum w |v| / sum w) * phi(sum w phi(v) / sum w).
    total = sum(w)
    direction = sum(wi / total * t / t.norm() for wi, t in zip(w, ts, strict=True))
    want = sum(wi / total * t.norm() for wi, t in zip(w, ts, strict=True)) * direction / direction.norm()
    torch.testing.assert_close(rda(ts, w), want)
    # A zero vector adds nothing to the direction or the radius; all zeros merge to zero.
    torch.testing.assert_close(rda([*ts, torch.zeros(257)], [*w, 1.0]), rda(ts, w) * sum(w) / (sum(w) + 1.0))
    assert torch.equal(rda([torch.zeros(3), torch.zeros(3)], [1.0, 1.0]), torch.zeros(3))


def test_weighted_mean_skips_zero_weights_and_starts_from_the_first_term() -> None:
    ts = _tensors(3)
    want = torch.zeros(257).add_(ts[1], alpha=0.25).add_(ts[2], alpha=0.75)
    assert torch.equal(weighted_mean(ts, [0.0, 1.0, 3.0]), want)


def test_outer_gradient_shortcuts() -> None:
    cur, base, d = ({"w": t} for t in _tensors(3))
    assert outer_gradient(cur, cur, d)["w"] is d["w"]  # against the current version: delta itself
    anchor = anchor_gradient(cur, base)
    assert torch.equal(outer_gradient(cur, base, d, anchor=anchor)["w"], (cur["w"] - base["w"]) + d["w"])


def test_synchronize_reanchors_once_per_base_and_matches_the_formula() -> None:
    g = torch.Generator().manual_seed(3)
    current = {"w": torch.randn(64, generator=g)}
    old = {"w": current["w"] - 0.1 * torch.randn(64, generator=g)}
    deltas = [{"w": 0.05 * torch.randn(64, generator=g)} for _ in range(4)]
    cs = [FragmentContribution(key=f"k{i}", learner_id=f"l{i}", base_version=5 if i % 2 else 4,
                               counters=Counters(c_steps=2, c_tokens=10), delta=d) for i, d in enumerate(deltas)]
    res = synchronize_fragment(current=current, bases={5: current, 4: old}, contributions=cs,
                               optimizer=NesterovOuterOptimizer(lr=1.0, momentum=0.0), merge="mean")
    assert res is not None
    vs = [(current["w"] - old["w"]) + d["w"] if i % 2 == 0 else d["w"] for i, d in enumerate(deltas)]
    torch.testing.assert_close(res.update["w"], sum(vs) / 4)
    torch.testing.assert_close(res.new_params["w"], current["w"] - sum(vs) / 4)


def test_momentum_is_updated_in_place_but_loaded_state_is_a_copy() -> None:
    opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    theta = {"a": torch.ones(3)}
    opt.step(theta, {"a": torch.full((3,), 0.1)})
    clone = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    clone.load_state_dict(opt.state_dict())
    before = clone.buffers["a"].clone()
    opt.step(theta, {"a": torch.full((3,), 0.3)})
    assert torch.equal(clone.buffers["a"], before)
    torch.testing.assert_close(opt.buffers["a"], 0.9 * before + 0.3)
