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

from atoll.core.merge import merge_fragment
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.pseudograd import anchor_gradient, check_same_layout, outer_gradient
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.weights import Counters, contribution_weights, unweighable

__all__ = ["FragmentContribution", "FragmentRoundResult", "synchronize_fragment"]

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
    """L2 norm of Delta."""


def _norm(t: Tensors) -> float:
    return _total(_tensor_norms(t))


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
) -> FragmentRoundResult | None:
    """Merge ``contributions`` into ``current`` and take one Nesterov outer step.

    ``bases`` maps a global version number to the fragment's value at that version (at least
    every base version a contribution names). Contributions whose base is unknown, whose layout
    does not match, whose values are not finite, or whose outer-gradient norm exceeds
    ``outlier_norm_ratio`` times the median of the round get weight 0 with a reason. Returns
    None (and leaves the optimizer untouched) if nothing is left to merge.
    """
    rejected: dict[str, Rejection] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    counters: dict[str, Counters] = {}
    norms: dict[str, float] = {}
    tensor_norms: dict[str, dict[str, float]] = {}
    # Theta(current) - Theta(b), once per base version (not once per contribution); zero, and
    # skipped, for contributions computed against the current version itself.
    anchors: dict[int, dict[str, torch.Tensor] | None] = {}
    for c in contributions:
        if c.key in grads or c.key in rejected:
            raise ValueError(f"duplicate contribution key {c.key!r}")
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
        if c.base_version not in anchors:
            anchors[c.base_version] = None if base is current else anchor_gradient(current, base)
        v = outer_gradient(current, base, c.delta, anchor=anchors[c.base_version])
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
    update = merge_fragment(
        [grads[k] for k in keys],
        [w.weights[k] for k in keys],
        rule=merge,
        embedding_names=embedding_names,
        rda_embeddings=rda_embeddings,
        norms=[tensor_norms[k] for k in keys],
    )
    new_params = optimizer.step(current, update)
    return FragmentRoundResult(
        new_params=new_params,
        update=update,
        weights={k: w.weights[k] for k in keys},
        rejected=rejected,
        norms=norms,
        update_norm=_norm(update),
    )
