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

__all__ = ["BLOCK", "RDA_CANCEL_TOL", "blocked", "blocks", "merge_fragment", "merge_fragment_unscaled", "rda",
           "rda_direction", "scale_", "weighted_mean"]

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


BLOCK = 1 << 16
"""Elements per block of a blocked pass on the CPU (256 KiB of fp32): the running sum of a merge
stays in cache while the M inputs stream through it, instead of a pass over memory per input."""


def blocks(numel: int) -> range:
    """Start offsets of the blocks of a blocked pass over ``numel`` elements."""
    return range(0, numel, BLOCK)


def blocked(*tensors: torch.Tensor) -> bool:
    """Whether a pass over ``tensors`` runs block by block: CPU, fp32, contiguous, large enough to
    matter. Each block does the same element-wise operations in the same order as the whole-tensor
    pass would (so the values are the same); only reductions are never split."""
    first = tensors[0]
    return first.device.type == "cpu" and first.numel() > BLOCK and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _accumulate(terms: Sequence[tuple[torch.Tensor, float]], out: torch.Tensor | None) -> torch.Tensor:
    """``sum c x`` over ``terms`` as ``x0 * c0``, then ``+= x_i * c_i`` in order (into ``out``).

    On the CPU the sum is built one block at a time while the inputs stream through it (the
    same element-wise operations, in the same order): one read of each input and one write of
    the sum, instead of M reads and writes of the sum."""
    x0, c0 = terms[0]
    if out is None:
        out = torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
    if not blocked(out, *(x for x, _ in terms)):
        torch.mul(x0, c0, out=out)
        for x, c in terms[1:]:
            out.add_(x, alpha=c)
        return out
    flat = out.view(-1)
    xs = [(x.view(-1), c) for x, c in terms]
    for s in blocks(flat.numel()):
        block = flat[s:s + BLOCK]
        torch.mul(xs[0][0][s:s + BLOCK], xs[0][1], out=block)
        for x, c in xs[1:]:
            block.add_(x[s:s + BLOCK], alpha=c)
    return out


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float], *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """sum w v / sum w, in fp32 (into ``out`` if given: an fp32 tensor of the same shape, e.g. a
    reused workspace; the same values bit for bit)."""
    _check(tensors, weights)
    total = float(sum(weights))
    # The first term starts the sum: one pass, no zero-filled buffer.
    return _accumulate([(t.float(), w / total) for t, w in zip(tensors, weights, strict=True) if w], out)


def rda_direction(tensors: Sequence[torch.Tensor], weights: Sequence[float], *,
                  norms: Sequence[float] | None = None,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, float | None, float]:
    """RDA before its last pass: ``(direction, factor, radius)`` with ``rda(...) == direction *
    factor`` (``factor`` None: the result is zero, see RDA_CANCEL_TOL), for a caller that fuses the
    scaling into its own pass over the tensor. ``radius`` is the result's L2 norm (up to rounding)
    unless it is zero. See :func:`rda`."""
    _check(tensors, weights)
    if norms is not None and len(norms) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(norms)} norms")
    total = float(sum(weights))
    terms: list[tuple[torch.Tensor, float]] = []
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
        terms.append((x, w / total / norm))
        radius += w / total * norm
    if not terms:  # every outer gradient is zero
        if out is not None:
            return out.zero_(), None, 0.0
        return torch.zeros(tensors[0].shape, dtype=torch.float32, device=tensors[0].device), None, 0.0
    direction = _accumulate(terms, out)
    agreement = float(torch.linalg.vector_norm(direction))
    if agreement < RDA_CANCEL_TOL:
        return direction, None, 0.0
    return direction, radius / agreement, radius


def rda(tensors: Sequence[torch.Tensor], weights: Sequence[float], *,
        norms: Sequence[float] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Radial-directional average of one tensor's outer gradients, in fp32.

    ``norms`` are the tensors' L2 norms when the caller has them already (one pass less each).
    Each direction is accumulated as ``direction += (w / sum w) / ||v|| * v`` in one pass over v
    (no unit vector is materialised; block by block on the CPU), and the result is scaled in
    place: two passes over the merged tensor. Memory traffic, not arithmetic, is what a merge
    costs. ``out``: write the result there (fp32, same shape; a reused workspace: no fresh
    page-faulting buffer), same values.
    """
    direction, factor, _ = rda_direction(tensors, weights, norms=norms, out=out)
    return direction.zero_() if factor is None else direction.mul_(factor)


def scale_(t: torch.Tensor, factor: float | None) -> torch.Tensor:
    """The last pass of RDA: ``t *= factor``, or zero for ``None`` (see :func:`rda_direction`)."""
    return t.zero_() if factor is None else t.mul_(factor)


def merge_fragment(
    outer_grads: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    rule: str = "rda",
    embedding_names: Collection[str] = (),
    rda_embeddings: bool = False,
    norms: Sequence[Mapping[str, float]] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Merge per-learner outer gradients of one fragment, tensor by tensor.

    ``rule`` 'rda' uses RDA on every tensor except embeddings (unless ``rda_embeddings``);
    'mean' uses the weighted mean everywhere. ``norms[i][name]``, if given, is the L2 norm of
    ``outer_grads[i][name]`` (the caller computed them already). ``out[name]``, where given, receives
    the merged tensor (fp32, same shape: a reused buffer); other names get fresh tensors.
    """
    merged, factors, _ = merge_fragment_unscaled(outer_grads, weights, rule=rule, embedding_names=embedding_names,
                                                 rda_embeddings=rda_embeddings, norms=norms, out=out)
    for name, factor in factors.items():
        scale_(merged[name], factor)
    return merged


def merge_fragment_unscaled(
    outer_grads: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    rule: str = "rda",
    embedding_names: Collection[str] = (),
    rda_embeddings: bool = False,
    norms: Sequence[Mapping[str, float]] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float | None], dict[str, float]]:
    """:func:`merge_fragment` without RDA's last pass: the merged tensors, for each RDA tensor the
    factor to scale it by in place (:func:`scale_`), which the caller fuses into its next pass,
    and its norm once scaled (RDA's radius, or 0; up to rounding)."""
    if rule not in ("rda", "mean"):
        raise ValueError(f"merge rule must be 'rda' or 'mean', got {rule!r}")
    if not outer_grads:
        raise ValueError("nothing to merge: no contributions")
    names = list(outer_grads[0])
    for g in outer_grads[1:]:
        if set(g) != set(names):
            raise ValueError("contributions to one fragment must carry the same tensor names")
    merged: dict[str, torch.Tensor] = {}
    factors: dict[str, float | None] = {}
    radii: dict[str, float] = {}
    for name in names:
        column = [g[name] for g in outer_grads]
        use_rda = rule == "rda" and (rda_embeddings or name not in embedding_names)
        target = out.get(name) if out is not None else None
        if use_rda:
            merged[name], factors[name], radii[name] = rda_direction(
                column, weights, norms=[n[name] for n in norms] if norms is not None else None, out=target)
        else:
            merged[name] = weighted_mean(column, weights, out=target)
    return merged, factors, radii
