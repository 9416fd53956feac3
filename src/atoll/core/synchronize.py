"""One outer round for one fragment, as pure math: re-anchor, weigh, merge, outer step.

The synchronizer loop (atoll.train) reads contributions from the bucket, lets
:func:`atoll.core.quorum.decide_round` pick which are in, and hands the accepted ones here.
Nothing in this module touches storage or the clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from atoll.core.merge import merge_fragment_unscaled
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.pseudograd import check_same_layout, outer_gradients
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.weights import Counters, contribution_weights, unweighable

__all__ = ["FragmentContribution", "FragmentRoundResult", "MergeWorkspace", "synchronize_fragment"]

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class FragmentContribution:
    """A learner's delta for one fragment plus what it was computed against."""

    key: str
    """Unique id of this contribution (e.g. its record path)."""

    learner_id: str
    """Who sent it."""

    base_version: int
    """Global version b of the fragment the learner last aligned to."""

    counters: Counters
    """Steps and tokens since that alignment."""

    delta: Tensors
    """Theta_p(b) - theta_{m,p}, decoded to fp32."""


@dataclass
class FragmentRoundResult:
    """What one round did to one fragment."""

    new_params: dict[str, torch.Tensor]
    """Theta_p after the outer step."""

    update: dict[str, torch.Tensor]
    """The merged outer gradient Delta."""

    weights: dict[str, float]
    """Normalised weight per accepted contribution key."""

    rejected: dict[str, Rejection] = field(default_factory=dict)
    """Contribution key -> why it got weight 0."""

    norms: dict[str, float] = field(default_factory=dict)
    """L2 norm of each contribution's outer gradient v (for the round's table)."""

    update_norm: float = 0.0
    """L2 norm of Delta (for RDA tensors their radius, which is that norm up to rounding)."""


class MergeWorkspace:
    """Scratch buffers a merge reuses from round to round.

    A round writes several fragment-sized intermediates (the re-anchoring terms, re-anchored
    outer gradients, the merged update, the outer step). Fresh buffers of that size cost a page
    fault per 4 KiB page on the CPU each round (writing a fresh 64 MB buffer took ~3x a copy into
    an existing one, measured); the workspace keeps one flat fp32 buffer per role and device,
    grown to the largest fragment seen, and hands out views shaped like the fragment's tensors.
    Memory held: about (2 + older bases + re-anchored contributions) x the largest fragment, of
    which only what a round writes is ever touched (on the CPU the blocked passes keep the
    re-anchoring terms and the outer step in a block-sized buffer instead).

    What a round returns in a workspace view (``FragmentRoundResult.update`` when the outer
    momentum is not 0) is valid until the next round that uses the same workspace.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[str, torch.device], torch.Tensor] = {}

    def views(self, role: str, like: Tensors) -> dict[str, torch.Tensor]:
        """Views of ``role``'s buffer with ``like``'s names and shapes (fp32, on ``like``'s device)."""
        if not like:
            return {}
        device = next(iter(like.values())).device
        numel = sum(t.numel() for t in like.values())
        flat = self._flat.get((role, device))
        if flat is None or flat.numel() < numel:
            flat = self._flat[(role, device)] = torch.empty(numel, dtype=torch.float32, device=device)
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, t in like.items():
            out[name] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())


def _tensor_norms(t: Tensors) -> dict[str, float]:
    return {n: float(torch.linalg.vector_norm(v.float())) for n, v in t.items()}


def _total(norms: Mapping[str, float]) -> float:
    return math.sqrt(math.fsum(x**2 for x in norms.values()))


def synchronize_fragment(
    *,
    current: Tensors,
    bases: Mapping[int, Tensors],
    contributions: Sequence[FragmentContribution],
    optimizer: NesterovOuterOptimizer,
    merge: str = "rda",
    weighting: str = "tokens",
    embedding_names: Collection[str] = (),
    rda_embeddings: bool = False,
    outlier_norm_ratio: float | None = None,
    workspace: MergeWorkspace | None = None,
    out: Tensors | None = None,
) -> FragmentRoundResult | None:
    """Merge ``contributions`` into ``current`` and take one Nesterov outer step.

    ``bases`` maps a global version number to the fragment's value at that version (at least
    every base version a contribution names). Contributions whose base is unknown, whose layout
    does not match, whose values are not finite, or whose outer-gradient norm exceeds
    ``outlier_norm_ratio`` times the median of the round get weight 0 with a reason. Returns
    None (and leaves the optimizer untouched) if nothing is left to merge.

    ``workspace`` (kept by the caller across rounds) holds the round's intermediates instead of
    fresh buffers; ``out`` (fp32 tensors of ``current``'s layout, aliasing no input, e.g. a
    retired version of this fragment) receives the new parameters. Neither changes a value: the
    operations and their order are the same, bit for bit.
    """
    rejected: dict[str, Rejection] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    counters: dict[str, Counters] = {}
    norms: dict[str, float] = {}
    tensor_norms: dict[str, dict[str, float]] = {}
    # Theta(current) - Theta(b), once per base version (not once per contribution); zero, and
    # skipped, for contributions computed against the current version itself.
    valid: list[FragmentContribution] = []
    seen: set[str] = set()
    for c in contributions:
        if c.key in seen:
            raise ValueError(f"duplicate contribution key {c.key!r}")
        seen.add(c.key)
        why = unweighable(c.counters.c_steps, c.counters.c_tokens)
        if why is not None:
            rejected[c.key] = why
            continue
        base = bases.get(c.base_version)
        if base is None:
            rejected[c.key] = Rejection(RejectionKind.UNKNOWN_BASE,
                                        f"base version {c.base_version} of this fragment is not available")
            continue
        try:
            check_same_layout(current, c.delta, what=f"delta from {c.learner_id}")
        except ValueError as e:
            rejected[c.key] = Rejection(RejectionKind.LAYOUT, str(e))
            continue
        valid.append(c)
    # Outer gradients, one base version at a time: Theta(current) - Theta(b) once per version
    # (not once per contribution; on the CPU with a workspace it never leaves the cache); nothing
    # for contributions computed against the current version itself (v is their delta).
    by_base: dict[int, list[FragmentContribution]] = {}
    for c in valid:
        by_base.setdefault(c.base_version, []).append(c)
    vs: dict[str, dict[str, torch.Tensor]] = {}
    reanchored = older = 0
    for version, group in by_base.items():
        base = bases[version]
        outs = anchor_out = None
        if workspace is not None and base is not current:
            outs = [workspace.views(f"grad.{reanchored + i}", current) for i in range(len(group))]
            reanchored += len(group)
            anchor_out = workspace.views(f"anchor.{older}", current)  # used off the CPU only
            older += 1
        for c, v in zip(group, outer_gradients(current, base, [c.delta for c in group], out=outs,
                                               anchor_out=anchor_out), strict=True):
            vs[c.key] = v
    for c in valid:
        v = vs[c.key]
        per_tensor = _tensor_norms(v)
        n = _total(per_tensor)
        if not math.isfinite(n):
            rejected[c.key] = Rejection(RejectionKind.NON_FINITE, "outer gradient has NaN/Inf values")
            continue
        grads[c.key], counters[c.key], norms[c.key], tensor_norms[c.key] = v, c.counters, n, per_tensor

    if outlier_norm_ratio is not None and len(norms) >= 3:
        median = statistics.median(norms.values())
        for key, n in list(norms.items()):
            if median > 0 and n > outlier_norm_ratio * median:
                rejected[key] = Rejection(RejectionKind.OUTLIER,
                                          f"norm {n:.3g} > {outlier_norm_ratio:g} x median {median:.3g}")
                del grads[key], counters[key]

    w = contribution_weights(counters, rule=weighting)
    rejected.update(w.rejected)
    keys = [k for k in grads if k in w.weights]
    if not keys:
        return None
    update_out: dict[str, torch.Tensor] | None = None
    if workspace is not None:
        update_out = workspace.views("update", current)
        if not optimizer.momentum:  # mu = 0: the update becomes the momentum buffer, so it must not
            # live in the workspace; the optimizer's own buffer of that name is reused when it has one.
            update_out = {n: b for n, b in optimizer.buffers.items()
                          if n in current and b.shape == current[n].shape and b.dtype == torch.float32
                          and b.device == current[n].device and b.is_contiguous()}
    update, factors, radii = merge_fragment_unscaled(
        [grads[k] for k in keys],
        [w.weights[k] for k in keys],
        rule=merge,
        embedding_names=embedding_names,
        rda_embeddings=rda_embeddings,
        norms=[tensor_norms[k] for k in keys],
        out=update_out,
    )
    # RDA's last pass (scaling the direction to the radius) is fused into the outer step's pass.
    new_params = optimizer.step(current, update, out=out, scale=factors,
                                scratch=workspace.views("step", current) if workspace is not None else None)
    return FragmentRoundResult(
        new_params=new_params,
        update=update,
        weights={k: w.weights[k] for k in keys},
        rejected=rejected,
        norms=norms,
        # An RDA tensor's norm is its radius (the weighted mean of the norms): no pass over it.
        update_norm=_total({n: radii[n] if n in radii else float(torch.linalg.vector_norm(u))
                            for n, u in update.items()}),
    )
