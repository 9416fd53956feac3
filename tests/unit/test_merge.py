"""Weights and merges: token weighting, weighted mean, RDA properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.core import Counters, contribution_weights, merge_fragment, rda, weighted_mean
from atoll.core.merge import RDA_CANCEL_TOL
from atoll.core.rejection import RejectionKind


def norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def reference_rda(vs: list[torch.Tensor], ws: list[float]) -> torch.Tensor:
    """RDA as docs/training.md and the paper define it, written out literally, in float64."""
    vs64 = [v.double() for v in vs]
    sw = sum(ws)
    radius = sum(w * v.norm() for w, v in zip(ws, vs64, strict=True)) / sw
    d = sum(w * (v / v.norm()) for w, v in zip(ws, vs64, strict=True)) / sw
    return (radius * d / d.norm()).float()


def test_token_weights() -> None:
    res = contribution_weights(
        {"a": Counters(c_steps=4, c_tokens=400), "b": Counters(c_steps=2, c_tokens=400), "c": Counters(c_steps=0, c_tokens=0)}
    )
    # raw: a = 400^2/4 = 40000, b = 400^2/2 = 80000
    assert res.weights == pytest.approx({"a": 1 / 3, "b": 2 / 3})
    assert res.rejected["c"].kind is RejectionKind.NO_STEPS and "c_steps=0" in res.rejected["c"].detail
    assert contribution_weights({"a": Counters(c_steps=3, c_tokens=0)}).rejected["a"].kind is RejectionKind.NO_TOKENS
    uni = contribution_weights({"a": Counters(c_steps=4, c_tokens=400), "b": Counters(c_steps=1, c_tokens=9)}, rule="uniform")
    assert uni.weights == {"a": 0.5, "b": 0.5}
    with pytest.raises(ValueError, match="weighting rule"):
        contribution_weights({}, rule="loss")


def test_weighted_mean_matches_reference() -> None:
    g = torch.Generator().manual_seed(1)
    vs = [torch.randn(5, 3, generator=g) for _ in range(4)]
    ws = [1.0, 2.0, 0.5, 0.5]
    ref = sum(w * v for w, v in zip(ws, vs, strict=True)) / sum(ws)
    torch.testing.assert_close(weighted_mean(vs, ws), ref)


def test_rda_matches_literal_formula() -> None:
    g = torch.Generator().manual_seed(2)
    vs = [torch.randn(7, 11, generator=g) * s for s in (0.5, 1.0, 3.0)]
    ws = [0.2, 0.3, 0.5]
    torch.testing.assert_close(rda(vs, ws), reference_rda(vs, ws), rtol=1e-5, atol=1e-6)


def test_rda_of_one_learner_is_its_delta() -> None:
    v = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(rda([v], [1.0]), v)
    torch.testing.assert_close(rda([v, v, v], [1.0, 5.0, 0.1]), v)


@given(m=st.integers(1, 16), radius=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_orthogonal_equal_norm_deltas_keep_their_norm(m: int, radius: float, seed: int) -> None:
    dim = 32
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    vs = [(q[:, i] * radius).float() for i in range(m)]
    merged = rda(vs, [1.0] * m)
    assert math.isclose(norm(merged), radius, rel_tol=1e-4)
    # The plain mean shrinks as 1/sqrt(M): that is what RDA is for.
    assert math.isclose(norm(weighted_mean(vs, [1.0] * m)), radius / math.sqrt(m), rel_tol=1e-4)


def test_weights_scale_correctly() -> None:
    a = torch.tensor([1.0, 0.0])
    b = torch.tensor([0.0, 3.0])
    out = rda([a, b], [3.0, 1.0])
    # radius = (3*1 + 1*3)/4 = 1.5; direction = normalise(0.75*[1,0] + 0.25*[0,1])
    d = torch.tensor([0.75, 0.25])
    torch.testing.assert_close(out, 1.5 * d / d.norm())
    # Scaling all weights changes nothing.
    torch.testing.assert_close(rda([a, b], [30.0, 10.0]), out)
    # Zero weight drops a contribution entirely.
    torch.testing.assert_close(rda([a, b], [1.0, 0.0]), a)


def test_all_cancelling_directions_give_a_finite_zero() -> None:
    v = torch.randn(6, generator=torch.Generator().manual_seed(4))
    out = rda([v, -v], [1.0, 1.0])
    assert torch.isfinite(out).all() and norm(out) == 0.0
    z = rda([torch.zeros(3), torch.zeros(3)], [1.0, 1.0])
    assert torch.equal(z, torch.zeros(3))


def test_merge_fragment_uses_mean_for_embeddings() -> None:
    g = torch.Generator().manual_seed(5)
    grads = [{"emb": torch.randn(4, 3, generator=g), "w": torch.randn(3, 3, generator=g)} for _ in range(3)]
    ws = [0.5, 0.25, 0.25]
    out = merge_fragment(grads, ws, rule="rda", embedding_names={"emb"})
    torch.testing.assert_close(out["emb"], weighted_mean([x["emb"] for x in grads], ws))
    torch.testing.assert_close(out["w"], rda([x["w"] for x in grads], ws))
    everything = merge_fragment(grads, ws, rule="rda", embedding_names={"emb"}, rda_embeddings=True)
    torch.testing.assert_close(everything["emb"], rda([x["emb"] for x in grads], ws))
    mean = merge_fragment(grads, ws, rule="mean")
    torch.testing.assert_close(mean["w"], weighted_mean([x["w"] for x in grads], ws))


def test_merge_errors() -> None:
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_fragment([], [], rule="rda")
    with pytest.raises(ValueError, match="merge rule"):
        merge_fragment([{"a": torch.ones(1)}], [1.0], rule="median")
    with pytest.raises(ValueError, match="shapes"):
        rda([torch.ones(2), torch.ones(3)], [1.0, 1.0])
    with pytest.raises(ValueError, match="weights"):
        rda([torch.ones(2)], [-1.0])
    with pytest.raises(ValueError, match="non-finite"):
        rda([torch.tensor([float("nan"), 1.0])], [1.0])
    with pytest.raises(ValueError, match="same tensor names"):
        merge_fragment([{"a": torch.ones(1)}, {"b": torch.ones(1)}], [1.0, 1.0])


def test_rda_near_cancellation_returns_zero_not_amplified_noise() -> None:
    """v and -v one ulp apart: the mean direction is ~1e-8, far below RDA_CANCEL_TOL."""
    torch.manual_seed(0)
    v = torch.randn(1000)
    w = -torch.nextafter(v, v + torch.sign(v))  # -v, one ulp larger in magnitude
    out = rda([v, w], [1.0, 1.0])
    assert torch.equal(out, torch.zeros(1000))
    # Just above the tolerance the direction is kept and scaled to the mean radius.
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1e-5])
    kept = rda([a, b], [1.0, 1.0])
    assert float(torch.linalg.vector_norm(kept)) == pytest.approx(float((a.norm() + b.norm()) / 2), rel=1e-5)
    assert RDA_CANCEL_TOL == 1e-6
