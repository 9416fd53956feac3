"""synchronize_fragment: rejections with reasons, and nothing merged when nothing is valid."""

from __future__ import annotations

import pytest
import torch

from atoll.core import Counters, FragmentContribution, MergePolicy, NesterovOuterOptimizer, synchronize_fragment
from atoll.core.rejection import RejectionKind


def contrib(key: str, delta: torch.Tensor, base: int = 0, steps: int = 2, tokens: int = 10) -> FragmentContribution:
    return FragmentContribution(key=key, learner_id=key, base_version=base, counters=Counters(c_steps=steps, c_tokens=tokens), delta={"w": delta})


def test_each_bad_contribution_gets_a_reason_and_the_rest_merge() -> None:
    cur = {"w": torch.zeros(3)}
    opt = NesterovOuterOptimizer(lr=1.0, momentum=0.0)
    contributions = [
        contrib("good1", torch.tensor([0.1, 0.0, 0.0])),
        contrib("good2", torch.tensor([0.0, 0.1, 0.0])),
        contrib("good3", torch.tensor([0.0, 0.0, 0.1])),
        contrib("nan", torch.tensor([float("nan"), 0.0, 0.0])),
        contrib("shape", torch.zeros(4)),
        contrib("nobase", torch.ones(3), base=9),
        contrib("nosteps", torch.ones(3), steps=0),
        contrib("huge", torch.tensor([1e6, 0.0, 0.0])),
    ]
    res = synchronize_fragment(current=cur, bases={0: cur}, contributions=contributions, optimizer=opt,
                               policy=MergePolicy(outlier_norm_ratio=10.0))
    assert res is not None
    assert set(res.weights) == {"good1", "good2", "good3"}
    kinds = {k: r.kind for k, r in res.rejected.items()}
    assert kinds == {"nan": RejectionKind.NON_FINITE, "shape": RejectionKind.LAYOUT,
                     "nobase": RejectionKind.UNKNOWN_BASE, "nosteps": RejectionKind.NO_STEPS,
                     "huge": RejectionKind.OUTLIER}
    assert "NaN" in res.rejected["nan"].detail and "shape" in res.rejected["shape"].detail
    assert "base version 9" in res.rejected["nobase"].detail and "c_steps=0" in res.rejected["nosteps"].detail
    assert torch.isfinite(res.new_params["w"]).all()
    assert res.update_norm > 0
    # For RDA tensors the update's norm is its radius: the norm of Delta up to rounding.
    norm = float(torch.linalg.vector_norm(torch.cat([u.reshape(-1) for u in res.update.values()])))
    assert res.update_norm == pytest.approx(norm, rel=1e-5)


def test_nothing_valid_returns_none_and_keeps_optimizer_state() -> None:
    opt = NesterovOuterOptimizer()
    res = synchronize_fragment(current={"w": torch.zeros(2)}, bases={0: {"w": torch.zeros(2)}},
                               contributions=[contrib("a", torch.ones(2), steps=0)], optimizer=opt)
    assert res is None and opt.buffers == {}


def test_norms_measured_at_decoding_stand_in_for_the_merge_pass_only_where_the_delta_is_the_gradient() -> None:
    import dataclasses

    from atoll.core.synchronize import tensor_norms

    gen = torch.Generator().manual_seed(0)
    cur = {"w": torch.randn(300, generator=gen)}
    older = {"w": cur["w"] - 0.01 * torch.randn(300, generator=gen)}
    plain = [contrib(f"c{i}", 1e-2 * torch.randn(300, generator=gen), base=i % 2) for i in range(4)]
    measured = [dataclasses.replace(c, delta_norms=tensor_norms(c.delta)) for c in plain]

    def merge(contributions: list[FragmentContribution]) -> object:
        return synchronize_fragment(current=cur, bases={1: cur, 0: older}, contributions=contributions,
                                    optimizer=NesterovOuterOptimizer(lr=0.7, momentum=0.0))

    a, b = merge(plain), merge(measured)
    assert a is not None and b is not None and a.norms == b.norms and a.weights == b.weights
    assert torch.equal(a.new_params["w"], b.new_params["w"])  # the same norms, so the same bits
    # The norms are taken as given for a contribution against the current version (base 1 here),
    # and measured again for one re-anchored from an older base (its gradient is not its delta).
    told = [dataclasses.replace(c, delta_norms={"w": 123.0}) for c in plain]
    c = merge(told)
    assert c is not None
    assert {k: c.norms[k] == 123.0 for k in c.norms} == {"c0": False, "c1": True, "c2": False, "c3": True}
