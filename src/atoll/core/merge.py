"""Merging outer gradients: weighted mean and radial-directional averaging (RDA).

RDA, per tensor (paper arXiv 2604.21428, radial-directional averaging)::

    Delta = (sum w ||v|| / sum w) * phi(sum w phi(v) / sum w),   phi(x) = x / ||x||, phi(0) = 0

The radius is the weighted mean of the norms and the direction is the normalised weighted mean
of directions, so the merged update does not shrink as M grows the way a plain mean of
near-orthogonal vectors does.

Cancellation: the mean of unit directions has a norm in [0, 1] that measures agreement. When it
falls below ``RDA_CANCEL_TOL`` (1e-6) the learners' directions have (numerically) cancelled and
the update is **zero**. Normalising such a residue would blow rounding noise up to the full
radius and concentrate it on a few entries (e.g. v and -v one ulp apart), so it is not done. Embeddings use the plain weighted mean (their rows are sparse and mostly disjoint across
learners, so norms are not comparable). Everything is accumulated in fp32, on the device of the
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch

__all__ = ["RDA_CANCEL_TOL", "weighted_mean", "rda", "merge_fragment"]

# Norms below this are treated as zero (phi(0) = 0) so a numerically-cancelled sum stays finite.
_EPS = 1e-30

RDA_CANCEL_TOL = 1e-6
"""Below this norm of the weighted mean of unit directions (1 = full agreement) RDA returns zero."""


def _check(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    if len(tensors) == 0:
        raise ValueError("nothing to merge: no tensors")
    if len(tensors) != len(weights):
        raise ValueError(f"{len(tensors)} tensors but {len(weights)} weights")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    shape = tensors[0].shape
    for t in tensors:
        if t.shape != shape:
            raise ValueError(f"cannot merge tensors of shapes {tuple(shape)} and {tuple(t.shape)}")


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum w v / sum w, in fp32."""
    _check(tensors, weights)
    total = float(sum(weights))
    out: torch.Tensor | None = None
    for t, w in zip(tensors, weights, strict=True):
        if not w:
            continue
        if out is None:  # the first term starts the sum: one pass, no zero-filled buffer
            out = torch.mul(t.float(), w / total)
        else:
            out.add_(t.float(), alpha=w / total)
    assert out is not None  # _check: some weight is positive
    return out


def rda(tensors: Sequence[torch.Tensor], weights: Sequence[float], *,
        norms: Sequence[float] | None = None) -> torch.Tensor:
    """Radial-directional average of one tensor's outer gradients, in fp32.

    ``norms`` are the tensors' L2 norms when the caller has them already (one pass less each).
    Each direction is accumulated as ``direction += (w / sum w) / ||v|| * v`` in one pass over v
    (no unit vector is materialised), and the result is scaled in place: two passes over the
    merged tensor. Memory traffic, not arithmetic, is what a merge costs.
    """
    _check(tensors, weights)
    if norms is not None and len(norms) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(norms)} norms")
    total = float(sum(weights))
    direction: torch.Tensor | None = None
    radius = 0.0
    for i, (t, w) in enumerate(zip(tensors, weights, strict=True)):
        if not w:
            continue
        x = t.float()
        norm = float(norms[i]) if norms is not None else float(torch.linalg.vector_norm(x))
        if not math.isfinite(norm):
            raise ValueError("cannot merge a non-finite outer gradient (NaN/Inf)")
        if norm <= _EPS:
            continue  # phi(0) = 0: adds nothing to the direction, and 0 to the radius
        if direction is None:  # the first term starts the sum: one pass, no zero-filled buffer
            direction = torch.mul(x, w / total / norm)
        else:
            direction.add_(x, alpha=w / total / norm)
        radius += w / total * norm
    if direction is None:  # every outer gradient is zero
        return torch.zeros(tensors[0].shape, dtype=torch.float32, device=tensors[0].device)
    agreement = float(torch.linalg.vector_norm(direction))
    if agreement < RDA_CANCEL_TOL:
        return direction.zero_()
    return direction.mul_(radius / agreement)


def merge_fragment(
    outer_grads: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    rule: str = "rda",
    embedding_names: Collection[str] = (),
    rda_embeddings: bool = False,
    norms: Sequence[Mapping[str, float]] | None = None,
) -> dict[str, torch.Tensor]:
    """Merge per-learner outer gradients of one fragment, tensor by tensor.

    ``rule`` 'rda' uses RDA on every tensor except embeddings (unless ``rda_embeddings``);
    'mean' uses the weighted mean everywhere. ``norms[i][name]``, if given, is the L2 norm of
    ``outer_grads[i][name]`` (the caller computed them already).
    """
    if rule not in ("rda", "mean"):
        raise ValueError(f"merge rule must be 'rda' or 'mean', got {rule!r}")
    if not outer_grads:
        raise ValueError("nothing to merge: no contributions")
    names = list(outer_grads[0])
    for g in outer_grads[1:]:
        if set(g) != set(names):
            raise ValueError("contributions to one fragment must carry the same tensor names")
    merged: dict[str, torch.Tensor] = {}
    for name in names:
        column = [g[name] for g in outer_grads]
        use_rda = rule == "rda" and (rda_embeddings or name not in embedding_names)
        if use_rda:
            merged[name] = rda(column, weights, norms=[n[name] for n in norms] if norms is not None else None)
        else:
            merged[name] = weighted_mean(column, weights)
    return merged
