"""The merge's memory-traffic shortcuts change nothing but rounding-free bookkeeping."""

from __future__ import annotations

import pytest
import torch

from atoll.core.merge import rda, weighted_mean
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.pseudograd import anchor_gradient, outer_gradient
from atoll.core.synchronize import FragmentContribution, MergePolicy, synchronize_fragment
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
                               optimizer=NesterovOuterOptimizer(lr=1.0, momentum=0.0), policy=MergePolicy(merge="mean"))
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


def test_a_reused_workspace_and_output_change_no_bit_of_a_round() -> None:
    from atoll.core.synchronize import MergeWorkspace

    g = torch.Generator().manual_seed(5)
    shapes = {"a": (33, 7), "emb": (16, 4), "b": (129,)}
    current = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    old = {n: t - 0.1 * torch.randn(t.shape, generator=g) for n, t in current.items()}
    cs = [FragmentContribution(key=f"k{i}", learner_id=f"l{i}", base_version=5 if i % 2 else 4,
                               counters=Counters(c_steps=2 + i, c_tokens=10 * (i + 1)),
                               delta={n: 0.05 * torch.randn(s, generator=g) for n, s in shapes.items()})
          for i in range(4)]
    for merge in ("rda", "mean"):
        for momentum in (0.9, 0.0):
            plain, fast = (NesterovOuterOptimizer(lr=0.7, momentum=momentum) for _ in range(2))
            workspace, spare = MergeWorkspace(), {n: torch.full(s, 7.0) for n, s in shapes.items()}
            cur_plain, cur_fast = current, {n: t.clone() for n, t in current.items()}
            for _ in range(3):  # momentum carries over; the workspace is reused; outputs recycled
                want = synchronize_fragment(current=cur_plain, bases={5: cur_plain, 4: old}, contributions=cs,
                                            optimizer=plain, policy=MergePolicy(merge=merge, embedding_names={"emb"}))
                got = synchronize_fragment(current=cur_fast, bases={5: cur_fast, 4: old}, contributions=cs,
                                           optimizer=fast, policy=MergePolicy(merge=merge, embedding_names={"emb"}),
                                           workspace=workspace, out=spare)
                assert want is not None and got is not None
                for n in shapes:
                    assert torch.equal(got.new_params[n], want.new_params[n]), (merge, momentum, n)
                    assert torch.equal(got.update[n], want.update[n]), (merge, momentum, n)
                    assert torch.equal(fast.buffers[n], plain.buffers[n]), (merge, momentum, n)
                assert got.new_params["a"].data_ptr() == spare["a"].data_ptr()  # written in place
                assert got.update_norm == want.update_norm and got.norms == want.norms
                spare, cur_fast, cur_plain = cur_fast, got.new_params, want.new_params
    assert workspace.nbytes > 0


def test_blocked_passes_give_the_whole_tensor_passes_values_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, tensors above core.merge.BLOCK elements are merged and stepped block by block;
    the reference here runs every operation on whole tensors (the blocking switched off)."""
    import atoll.core.merge as merge_mod
    import atoll.core.outer as outer_mod
    from atoll.core.synchronize import MergeWorkspace

    g = torch.Generator().manual_seed(11)
    shapes = {"big": (3 * merge_mod.BLOCK + 77,), "mat": (2 * merge_mod.BLOCK // 64, 64), "small": (300,)}
    current = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    old = {n: t - 0.1 * torch.randn(t.shape, generator=g) for n, t in current.items()}
    cs = [FragmentContribution(key=f"k{i}", learner_id=f"l{i}", base_version=5 if i % 2 else 4,
                               counters=Counters(c_steps=2 + i, c_tokens=10 * (i + 1)),
                               delta={n: 0.05 * torch.randn(s, generator=g) for n, s in shapes.items()})
          for i in range(4)]

    def rounds(blocked: bool, merge: str, momentum: float) -> list[tuple[dict[str, torch.Tensor], ...]]:
        with monkeypatch.context() as m:
            if not blocked:
                m.setattr(merge_mod, "blocked", lambda *t: False)
                m.setattr(outer_mod, "blocked", lambda *t: False)
            opt = NesterovOuterOptimizer(lr=0.7, momentum=momentum)
            workspace, spare = MergeWorkspace(), {n: torch.zeros(s) for n, s in shapes.items()}
            cur, out = {n: t.clone() for n, t in current.items()}, []
            for _ in range(3):
                res = synchronize_fragment(current=cur, bases={5: cur, 4: old}, contributions=cs, optimizer=opt,
                                           policy=MergePolicy(merge=merge), workspace=workspace, out=spare)
                assert res is not None
                out.append(tuple({n: t.clone() for n, t in d.items()}
                                 for d in (res.new_params, res.update, opt.buffers)))
                spare, cur = cur, res.new_params
            return out

    for merge in ("rda", "mean"):
        for momentum in (0.9, 0.0):
            for got, want in zip(rounds(True, merge, momentum), rounds(False, merge, momentum), strict=True):
                for a, b in zip(got, want, strict=True):
                    for n in shapes:
                        assert torch.equal(a[n], b[n]), (merge, momentum, n)
