"""The compressed downlink's error feedback: the learners' view stays within one quantization
error of the master, version after version, and the error does not accumulate."""

from __future__ import annotations

import pytest
import torch

from atoll.core.compress import decode, encode
from atoll.core.downlink import apply_update, downlink_step, drift_bound

VERSIONS = 400
FP32_EPS = 2.0**-22  # the two fp32 operations' rounding, relative to their operands (with margin)


def random_walk(seed: int, shape: tuple[int, ...], scale: float) -> list[dict[str, torch.Tensor]]:
    """Master versions 0..VERSIONS of a two-tensor fragment: each version moves every element by
    up to ``scale`` (uneven per block, and with whole blocks of zeros now and then)."""
    g = torch.Generator().manual_seed(seed)
    w = {"w": torch.randn(shape, generator=g), "b": torch.randn(shape[0], generator=g)}
    out = [w]
    for v in range(VERSIONS):
        change = {n: (torch.rand(t.shape, generator=g) * 2 - 1) * scale * torch.rand(1, generator=g)
                  for n, t in w.items()}
        if v % 50 == 7:
            change["b"] = torch.zeros_like(change["b"])
        w = {n: w[n] + change[n] for n in w}
        out.append(w)
    return out


@pytest.mark.parametrize("codec", ["int4", "bf16"])
def test_every_version_is_within_one_quantization_error_of_the_master(codec: str) -> None:
    masters = random_walk(1, (37, 21), 0.01)  # 777 elements: blocks do not divide it
    view = dict(masters[0])
    for v in range(1, len(masters)):
        master = masters[v]
        residual = {n: master[n] - view[n] for n in master}
        step = downlink_step(master, view, codec, block_size=32)
        for n in master:
            drift = (master[n] - step.view[n]).abs()
            slack = FP32_EPS * (master[n].abs() + residual[n].abs())
            assert torch.all(drift <= drift_bound(residual[n], codec, block_size=32) + slack), (codec, v, n)
        view = step.view


@pytest.mark.parametrize(("codec", "ratio"), [("int4", 1 / 13), ("bf16", 2.0**-8 / (1 - 2.0**-8))])
def test_the_drift_does_not_accumulate(codec: str, ratio: float) -> None:
    """With error feedback the drift stays under ratio x the largest version-to-version change at
    every one of 400 versions; compressing each change and adding them up (no feedback) drifts
    far past that bound."""
    masters = random_walk(2, (64, 48), 0.02)
    biggest = max(float((masters[v][n] - masters[v - 1][n]).abs().max())
                  for v in range(1, len(masters)) for n in masters[0])
    view, naive = dict(masters[0]), dict(masters[0])
    worst, naive_end = 0.0, 0.0
    for v in range(1, len(masters)):
        view = downlink_step(masters[v], view, codec, block_size=32).view
        naive = apply_update(naive, {n: decode(encode(masters[v][n] - masters[v - 1][n], codec, block_size=32))
                                     for n in naive})
        worst = max(worst, max(float((masters[v][n] - view[n]).abs().max()) for n in view))
        naive_end = max(float((masters[v][n] - naive[n]).abs().max()) for n in naive)
    slack = FP32_EPS * max(float(t.abs().max()) for t in masters[-1].values())
    assert worst <= ratio * biggest + slack, (worst, ratio * biggest)
    assert naive_end > 3 * ratio * biggest, (naive_end, ratio * biggest)  # what error feedback prevents


def test_the_view_is_what_a_learner_computes_from_the_updates() -> None:
    """A learner applies the decoded updates with apply_update and holds the view to the last bit."""
    masters = random_walk(3, (10, 7), 0.05)
    view = dict(masters[0])
    learner = {n: t.clone() for n, t in masters[0].items()}
    for v in range(1, 30):
        step = downlink_step(masters[v], view, "int4", block_size=4)
        learner = apply_update(learner, {n: decode(e) for n, e in step.update.items()})
        view = step.view
        for n in view:
            assert torch.equal(learner[n], view[n])


@pytest.mark.parametrize("codec", ["int4", "bf16", "fp32"])
@pytest.mark.parametrize("block_size", [2, 4, 32])
def test_downlink_step_is_bit_identical_to_encode_decode_apply(codec: str, block_size: int) -> None:
    """One pass per tensor gives what the three separate steps give, version after version
    (whole-block and partial-block tensors, zero updates, signed zeros in the view)."""
    masters = random_walk(5, (9, 7), 0.3)
    view = dict(masters[0])
    view["b"] = view["b"].clone()
    view["b"][:2] = torch.tensor([-0.0, 0.0])
    for v in range(1, 40):
        step = downlink_step(masters[v], view, codec, block_size=block_size)
        update = {n: encode(masters[v][n].float() - view[n].float(), codec, block_size=block_size) for n in view}
        want = apply_update(view, {n: decode(e) for n, e in update.items()})
        for n in view:
            assert step.update[n].parts.keys() == update[n].parts.keys()
            for part, t in update[n].parts.items():
                assert torch.equal(step.update[n].parts[part].view(torch.uint8), t.view(torch.uint8)), (v, n, part)
            assert torch.equal(step.view[n].view(torch.int32), want[n].view(torch.int32)), (v, n)
        view = step.view


def test_fp32_downlink_is_the_master_and_bounds_are_exact() -> None:
    master = {"w": torch.tensor([1.0, -2.0, 3.0])}
    step = downlink_step(master, {"w": torch.zeros(3)}, "fp32")
    assert torch.equal(step.view["w"], master["w"])
    r = torch.tensor([0.7, -1.4, 0.0, 0.07, 2.8, 0.0])
    assert torch.equal(drift_bound(r, "int4", block_size=4), torch.tensor([0.1, 0.1, 0.1, 0.1, 0.2, 0.2]))
    assert torch.equal(drift_bound(r, "bf16"), r.abs() / 256)
    assert torch.equal(drift_bound(r, "fp32"), torch.zeros(6))


def test_mismatched_names_are_refused() -> None:
    with pytest.raises(ValueError, match="differ"):
        downlink_step({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, "int4")
    with pytest.raises(ValueError, match="differ"):
        apply_update({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
