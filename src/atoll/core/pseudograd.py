"""Pseudo-gradients (outer gradients) of one fragment.

Sign convention (paper arXiv 2604.21428, Sec. 3: outer gradients): a learner publishes ``delta = Theta_p(b) - theta_{m,p}``: the global
fragment at the base version b it last aligned to, minus its own current fragment. The
synchronizer re-anchors it at the *current* global value:

    v_m = Theta_p(current) - theta_{m,p} = (Theta_p(current) - Theta_p(b)) + delta_m

so a contribution computed against an old version is never applied as if it were fresh. With
b = current the correction term is zero and v_m = delta_m. All arithmetic is fp32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["learner_delta", "anchor_gradient", "outer_gradient", "check_same_layout"]

Tensors = Mapping[str, torch.Tensor]


def check_same_layout(a: Tensors, b: Tensors, *, what: str = "tensors") -> None:
    """Raise ValueError naming the first tensor whose name set or shape differs."""
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))
        raise ValueError(f"{what}: tensor names differ: {missing[:5]}")
    for name in a:
        if a[name].shape != b[name].shape:
            raise ValueError(f"{what}: shape of {name!r} is {tuple(b[name].shape)}, expected {tuple(a[name].shape)}")


def learner_delta(base: Tensors, local: Tensors) -> dict[str, torch.Tensor]:
    """delta = base - local, in fp32 (what a learner publishes for one fragment)."""
    check_same_layout(base, local, what="learner_delta")
    return {n: base[n].detach().float() - local[n].detach().float() for n in base}


def anchor_gradient(current: Tensors, base: Tensors) -> dict[str, torch.Tensor]:
    """current - base, in fp32: the re-anchoring term shared by every contribution against ``base``."""
    check_same_layout(current, base, what="outer_gradient(base)")
    return {n: current[n].detach().float() - base[n].detach().float() for n in current}


def outer_gradient(current: Tensors, base: Tensors, delta: Tensors, *,
                   anchor: Tensors | None = None) -> dict[str, torch.Tensor]:
    """v = (current - base) + delta, in fp32; equals ``current - theta_learner``.

    ``anchor`` is ``current - base`` when the caller has it already (:func:`anchor_gradient`, once
    per base version); the result is the same tensor for tensor. When ``base`` *is* ``current``
    (the same mapping) the correction is zero and v is ``delta`` itself (as fp32, not copied).
    """
    check_same_layout(current, base, what="outer_gradient(base)")
    check_same_layout(current, delta, what="outer_gradient(delta)")
    if base is current:
        return {n: delta[n].float() for n in current}
    if anchor is None:
        anchor = anchor_gradient(current, base)
    return {n: anchor[n] + delta[n].float() for n in current}
