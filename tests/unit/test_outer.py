"""Nesterov outer optimizer and pseudo-gradients."""

from __future__ import annotations

import pytest
import torch

from atoll.core import NesterovOuterOptimizer, learner_delta, outer_gradient
from atoll.core.merge import BLOCK


def test_nesterov_two_steps_by_hand() -> None:
    opt = NesterovOuterOptimizer(lr=0.5, momentum=0.9)
    theta = {"w": torch.tensor([1.0, -2.0])}
    # step 1: b = d1 = [1, 2]; theta -= 0.5 * (d1 + 0.9 * b) = 0.5 * [1.9, 3.8]
    theta = opt.step(theta, {"w": torch.tensor([1.0, 2.0])})
    torch.testing.assert_close(theta["w"], torch.tensor([1.0 - 0.95, -2.0 - 1.9]))
    # step 2: b = 0.9 * [1, 2] + [0, -1] = [0.9, 0.8]; dir = [0, -1] + 0.9 * [0.9, 0.8] = [0.81, -0.28]
    theta = opt.step(theta, {"w": torch.tensor([0.0, -1.0])})
    torch.testing.assert_close(theta["w"], torch.tensor([0.05 - 0.405, -3.9 + 0.14]))
    torch.testing.assert_close(opt.buffers["w"], torch.tensor([0.9, 0.8]))


def test_matches_torch_sgd_nesterov() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, generator=g))
    ref = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    theta = {"p": p.detach().clone()}
    for _ in range(4):
        d = torch.randn(5, generator=g)
        p.grad = d.clone()
        ref.step()
        theta = opt.step(theta, {"p": d})
    torch.testing.assert_close(theta["p"], p.detach())


def test_state_round_trip_and_inputs_untouched() -> None:
    opt = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    theta = {"a": torch.ones(3), "b": torch.zeros(2)}
    before = {k: v.clone() for k, v in theta.items()}
    opt.step(theta, {"a": torch.full((3,), 0.1)})
    assert all(torch.equal(theta[k], before[k]) for k in theta)
    state = opt.state_dict()
    assert set(state) == {"momentum.a"}
    clone = NesterovOuterOptimizer(lr=0.7, momentum=0.9)
    clone.load_state_dict(state)
    u = {"a": torch.full((3,), -0.2)}
    torch.testing.assert_close(clone.step(theta, u)["a"], opt.step(theta, u)["a"])
    with pytest.raises(KeyError, match="unexpected outer optimizer state key 'velocity.a'"):
        clone.load_state_dict({"velocity.a": torch.ones(3)})


def test_outer_optimizer_errors() -> None:
    with pytest.raises(ValueError, match="outer_lr"):
        NesterovOuterOptimizer(lr=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        NesterovOuterOptimizer(momentum=1.0)
    opt = NesterovOuterOptimizer()
    with pytest.raises(KeyError, match=r"update names not in params: \['b'\]"):
        opt.step({"a": torch.ones(1)}, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"a": torch.ones(1)}, {"a": torch.ones(2)})


def test_pseudo_gradient_is_reanchored_at_current() -> None:
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(4, generator=g)}
    local = {"w": torch.randn(4, generator=g)}
    current = {"w": torch.randn(4, generator=g)}
    delta = learner_delta(base, local)
    torch.testing.assert_close(delta["w"], base["w"] - local["w"])
    v = outer_gradient(current, base, delta)
    # v == current - theta_learner, whatever the base was
    torch.testing.assert_close(v["w"], current["w"] - local["w"])
    # fresh contribution: no correction
    torch.testing.assert_close(outer_gradient(base, base, delta)["w"], delta["w"])
    with pytest.raises(ValueError, match="names differ"):
        learner_delta(base, {"x": torch.ones(4)})
    with pytest.raises(ValueError, match="shape"):
        outer_gradient(current, base, {"w": torch.ones(5)})


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_fork_steps_like_a_copy_and_leaves_the_original_intact(momentum: float) -> None:
    """A fork writes mu * b + Delta straight into its reused buffers: the same values bit for bit
    as a load_state_dict copy stepped in place, on the block-by-block path (a tensor larger than
    a block, with ``out``) and the whole-tensor one; the original's buffers keep their values, and
    a buffer the fork never stepped is copied when read."""
    g = torch.Generator().manual_seed(3)
    big, small = BLOCK * 2 + 5, 7
    theta = {"big": torch.randn(big, generator=g), "small": torch.randn(small, generator=g),
             "idle": torch.randn(small, generator=g)}
    opt = NesterovOuterOptimizer(lr=0.7, momentum=momentum)
    opt.step(theta, {n: torch.randn(t.shape, generator=g) for n, t in theta.items()})
    original = {n: b.clone() for n, b in opt.buffers.items()}
    reference = NesterovOuterOptimizer(lr=0.7, momentum=momentum)
    reference.load_state_dict(opt.state_dict())
    spare = {n: torch.full_like(b, 5.0) for n, b in opt.buffers.items()}
    fork = opt.fork(reuse=spare)
    update = {"big": torch.randn(big, generator=g), "small": torch.randn(small, generator=g)}
    out = {"big": torch.empty(big), "small": torch.empty(small)}
    got = fork.step(theta, {n: u.clone() for n, u in update.items()}, out=out)
    want = reference.step(theta, {n: u.clone() for n, u in update.items()}, out={n: torch.empty_like(t) for n, t in out.items()})
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(fork.buffers[n], reference.buffers[n]) for n in theta)
    assert all(torch.equal(opt.buffers[n], original[n]) for n in original)  # the original: untouched
    if momentum:  # the stepped buffers went into the reused tensors
        assert fork.buffers["big"] is spare["big"] and fork.buffers["small"] is spare["small"]
    assert fork.buffers["idle"] is spare["idle"] and torch.equal(spare["idle"], original["idle"])


def test_fork_without_reuse_or_of_a_fresh_optimizer() -> None:
    fresh = NesterovOuterOptimizer(lr=0.5, momentum=0.9).fork()
    assert fresh.buffers == {} and (fresh.lr, fresh.momentum) == (0.5, 0.9)
    opt = NesterovOuterOptimizer(lr=0.5, momentum=0.9)
    opt.step({"a": torch.ones(3)}, {"a": torch.full((3,), 0.1)})
    fork = opt.fork(reuse={"a": torch.zeros(4)})  # the wrong shape: a fresh copy instead
    assert fork.buffers["a"] is not opt.buffers["a"] and torch.equal(fork.buffers["a"], opt.buffers["a"])
