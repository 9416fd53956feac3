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

from atoll.core.config import DilocoConfig, MergeRule, Weighting
from atoll.core.merge import merge_fragment_unscaled
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.pseudograd import check_same_layout, outer_gradients
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.weights import Counters, cap_weight_share, contribution_weights, unweighable

__all__ = ["FragmentContribution", "FragmentRoundResult", "MergePolicy", "MergeWorkspace", "synchronize_fragment",
           "tensor_norms", "MIN_NORM_HISTORY"]

MIN_NORM_HISTORY = 3
"""Accepted update norms of a fragment the outlier guard needs before it compares against them."""

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class MergePolicy:
    """How a round turns a fragment's contributions into one update: the merge rule, the weighting
    and the guards on what learners send. A run has one (:meth:`from_config`); ``MergePolicy()``
    is the paper's merge (RDA, token weights) with no guards."""

    merge: MergeRule = "rda"
    """'rda' (radial-directional averaging, paper) or 'mean' (the plain weighted mean)."""

    weighting: Weighting = "tokens"
    """Contribution weights: 'tokens' (c_tokens^2 / c_steps, paper) or 'uniform'."""

    embedding_names: frozenset[str] = frozenset()
    """The fragment's embedding tensors: merged by the plain weighted mean unless ``rda_embeddings``
    (any collection of names given is held as a frozenset)."""

    rda_embeddings: bool = False
    """Apply RDA to embedding tensors too (paper: no)."""

    outlier_norm_ratio: float | None = None
    """Weight 0 for an outer gradient whose norm exceeds this multiple of the round's median (3 or
    more contributions) or of the fragment's recent merged update norms (:data:`MIN_NORM_HISTORY`
    or more); None: no guard (a run's DilocoConfig sets 100)."""

    max_weight_share: float | None = None
    """Largest normalised weight one contribution may get
    (:func:`~atoll.core.weights.cap_weight_share`); None: no cap."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "embedding_names", frozenset(self.embedding_names))

    @classmethod
    def from_config(cls, config: DilocoConfig, *, embedding_names: Collection[str] = ()) -> MergePolicy:
        """The merge ``config`` asks for, with the fragment plan's ``embedding_names``."""
        return cls(merge=config.merge, weighting=config.weighting, embedding_names=frozenset(embedding_names),
                   rda_embeddings=config.rda_embeddings, outlier_norm_ratio=config.outlier_norm_ratio,
                   max_weight_share=config.max_weight_share)


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

    delta_norms: Mapping[str, float] | None = None
    """:func:`tensor_norms` of ``delta``, measured where it was decoded (while in cache; None: not
    measured). A contribution against the current version has the delta as its outer gradient,
    and the merge then takes these norms instead of another pass over it."""


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


class _RoundBuffers:
    """Where one round writes its fragment-sized intermediates.

    The round's math asks this object for an output buffer at each step and gets views of the
    caller's :class:`MergeWorkspace`, or None without one (the math then allocates fresh tensors,
    with the same values bit for bit). Each re-anchored contribution and each older base of a
    round gets a buffer of its own; the counters that name them live here, not in the math.
    """

    def __init__(self, workspace: MergeWorkspace | None, like: Tensors) -> None:
        self._workspace = workspace
        self._like = like
        self._grads = 0
        self._anchors = 0

    def _views(self, role: str) -> dict[str, torch.Tensor] | None:
        return None if self._workspace is None else self._workspace.views(role, self._like)

    def reanchored(self, count: int) -> tuple[list[dict[str, torch.Tensor]] | None, dict[str, torch.Tensor] | None]:
        """Buffers for ``count`` outer gradients against one older base, and for that base's
        re-anchoring term ``current - base`` (written off the CPU only)."""
        if self._workspace is None:
            return None, None
        grads = [self._workspace.views(f"grad.{self._grads + i}", self._like) for i in range(count)]
        self._grads += count
        anchor = self._workspace.views(f"anchor.{self._anchors}", self._like)
        self._anchors += 1
        return grads, anchor

    def update(self, optimizer: NesterovOuterOptimizer) -> dict[str, torch.Tensor] | None:
        """Buffers for the merged update Delta."""
        if self._workspace is None or optimizer.momentum:
            return self._views("update")
        # mu = 0: the update becomes the momentum buffer, so it must not live in the workspace;
        # the optimizer's own buffer of that name is reused when it has one.
        return {n: b for n, b in optimizer.buffers.items()
                if n in self._like and b.shape == self._like[n].shape and b.dtype == torch.float32
                and b.device == self._like[n].device and b.is_contiguous()}

    def step(self) -> dict[str, torch.Tensor] | None:
        """Buffers for the outer step ``lr * (Delta + mu * b)`` on its way to the new parameters."""
        return self._views("step")


@dataclass(frozen=True)
class _Measured:
    """A contribution re-anchored to the current version, with its outer gradient's norms."""

    contribution: FragmentContribution
    grad: dict[str, torch.Tensor]
    """v = Theta(current) - theta_learner."""

    tensor_norms: dict[str, float]
    """L2 norm of each tensor of v."""

    norm: float
    """L2 norm of v as a whole."""


@dataclass(frozen=True)
class _Weighed:
    """What the weighing step leaves for the merge."""

    accepted: list[_Measured]
    """Contributions with a weight > 0, in the order they were given."""

    weights: list[float]
    """Their normalised weights, in the same order."""

    norms: dict[str, float]
    """L2 norm of every contribution whose outer gradient is finite (outliers included)."""

    rejected: dict[str, Rejection]
    """Contributions that got weight 0 here, with the reason."""


def tensor_norms(t: Tensors) -> dict[str, float]:
    """Each tensor's L2 norm (fp32), as the merge measures an outer gradient's."""
    return {n: float(torch.linalg.vector_norm(v.float())) for n, v in t.items()}


def _grad_norms(c: FragmentContribution, v: Tensors) -> dict[str, float]:
    """The outer gradient ``v``'s norms: the delta's as measured at decoding when ``v`` is the
    delta itself (same tensors, so the same values), else measured here."""
    known = c.delta_norms
    if known is not None and known.keys() == v.keys() and all(v[n] is c.delta.get(n) for n in v):
        return dict(known)
    return tensor_norms(v)


def _total(norms: Mapping[str, float]) -> float:
    return math.sqrt(math.fsum(x**2 for x in norms.values()))


def synchronize_fragment(
    *,
    current: Tensors,
    bases: Mapping[int, Tensors],
    contributions: Sequence[FragmentContribution],
    optimizer: NesterovOuterOptimizer,
    policy: MergePolicy | None = None,
    workspace: MergeWorkspace | None = None,
    out: Tensors | None = None,
    norm_history: Sequence[float] = (),
    reasons: dict[str, Rejection] | None = None,
) -> FragmentRoundResult | None:
    """Merge ``contributions`` into ``current`` as ``policy`` says (None: ``MergePolicy()``) and
    take one Nesterov outer step.

    ``bases`` maps a global version number to the fragment's value at that version (at least
    every base version a contribution names). Contributions whose base is unknown, whose layout
    does not match, whose values are not finite, or whose outer-gradient norm exceeds
    ``policy.outlier_norm_ratio`` times the median of the round (with 3 or more) or times the
    median of ``norm_history`` (the fragment's recent merged update norms, with
    :data:`MIN_NORM_HISTORY` or more: the guard that works with K = 1) get weight 0 with a
    reason. ``policy.max_weight_share`` caps any one contribution's normalised weight
    (:func:`~atoll.core.weights.cap_weight_share`). Returns None (and leaves the optimizer
    untouched) if nothing is left to merge; ``reasons``, if given, then receives why each
    contribution was left out (otherwise they are the result's ``rejected``).

    ``workspace`` (kept by the caller across rounds) holds the round's intermediates instead of
    fresh buffers; ``out`` (fp32 tensors of ``current``'s layout, aliasing no input, e.g. a
    retired version of this fragment) receives the new parameters. Neither changes a value: the
    operations and their order are the same, bit for bit.

    The round, step by step: validate (what can be re-anchored at all), re-anchor (each
    contribution's outer gradient against the current version), weigh (norms, outliers, the
    weighting rule), merge, outer step. Where each step writes is :class:`_RoundBuffers`' business.
    """
    policy = policy or MergePolicy()
    buffers = _RoundBuffers(workspace, current)
    valid, invalid = _validate(current, bases, contributions)
    grads = _reanchor(current, bases, valid, buffers)
    weighed = _weigh(valid, grads, policy, norm_history=norm_history)
    if not weighed.accepted:
        if reasons is not None:
            reasons.update({**invalid, **weighed.rejected})
        return None
    update, factors, radii = _merge(weighed, policy, out=buffers.update(optimizer))
    # RDA's last pass (scaling the direction to the radius) is fused into the outer step's pass.
    new_params = optimizer.step(current, update, out=out, scale=factors, scratch=buffers.step())
    return FragmentRoundResult(
        new_params=new_params,
        update=update,
        weights={m.contribution.key: w for m, w in zip(weighed.accepted, weighed.weights, strict=True)},
        rejected={**invalid, **weighed.rejected},
        norms=weighed.norms,
        update_norm=_update_norm(update, radii),
    )


def _validate(current: Tensors, bases: Mapping[int, Tensors], contributions: Sequence[FragmentContribution],
              ) -> tuple[list[FragmentContribution], dict[str, Rejection]]:
    """Contributions that can be re-anchored (in the order given), and why each other one cannot."""
    valid: list[FragmentContribution] = []
    rejected: dict[str, Rejection] = {}
    seen: set[str] = set()
    for c in contributions:
        if c.key in seen:
            raise ValueError(f"duplicate contribution key {c.key!r}")
        seen.add(c.key)
        why = unweighable(c.counters.c_steps, c.counters.c_tokens)
        if why is not None:
            rejected[c.key] = why
            continue
        if bases.get(c.base_version) is None:
            rejected[c.key] = Rejection(RejectionKind.UNKNOWN_BASE,
                                        f"base version {c.base_version} of this fragment is not available")
            continue
        try:
            check_same_layout(current, c.delta, what=f"delta from {c.learner_id}")
        except ValueError as e:
            rejected[c.key] = Rejection(RejectionKind.LAYOUT, str(e))
            continue
        valid.append(c)
    return valid, rejected


def _reanchor(current: Tensors, bases: Mapping[int, Tensors], valid: Sequence[FragmentContribution],
              buffers: _RoundBuffers) -> list[dict[str, torch.Tensor]]:
    """Each contribution's outer gradient v = (Theta(current) - Theta(b)) + delta, in ``valid``'s order.

    One base version at a time: Theta(current) - Theta(b) once per version (not once per
    contribution; on the CPU with a workspace it never leaves the cache); nothing for
    contributions computed against the current version itself (v is their delta)."""
    by_base: dict[int, list[FragmentContribution]] = {}
    for c in valid:
        by_base.setdefault(c.base_version, []).append(c)
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for version, group in by_base.items():
        base = bases[version]
        outs, anchor_out = buffers.reanchored(len(group)) if base is not current else (None, None)
        deltas = [c.delta for c in group]
        for c, v in zip(group, outer_gradients(current, base, deltas, out=outs, anchor_out=anchor_out), strict=True):
            grads[c.key] = v
    return [grads[c.key] for c in valid]


def _weigh(valid: Sequence[FragmentContribution], grads: Sequence[dict[str, torch.Tensor]], policy: MergePolicy, *,
           norm_history: Sequence[float] = ()) -> _Weighed:
    """Weight 0 for non-finite outer gradients and norm outliers; the policy's weighting rule for the rest."""
    measured: list[_Measured] = []
    rejected: dict[str, Rejection] = {}
    for c, v in zip(valid, grads, strict=True):
        per_tensor = _grad_norms(c, v)
        n = _total(per_tensor)
        if not math.isfinite(n):
            rejected[c.key] = Rejection(RejectionKind.NON_FINITE, "outer gradient has NaN/Inf values")
            continue
        measured.append(_Measured(contribution=c, grad=v, tensor_norms=per_tensor, norm=n))
    outliers = _outliers(measured, policy.outlier_norm_ratio)
    outliers.update(_history_outliers([m for m in measured if m.contribution.key not in outliers],
                                      policy.outlier_norm_ratio, norm_history))
    rejected.update(outliers)
    kept = [m for m in measured if m.contribution.key not in outliers]
    w = contribution_weights({m.contribution.key: m.contribution.counters for m in kept}, rule=policy.weighting)
    rejected.update(w.rejected)
    accepted = [m for m in kept if m.contribution.key in w.weights]
    shares = cap_weight_share(w.weights, policy.max_weight_share)
    return _Weighed(accepted=accepted, weights=[shares[m.contribution.key] for m in accepted],
                    norms={m.contribution.key: m.norm for m in measured}, rejected=rejected)


def _outliers(measured: Sequence[_Measured], ratio: float | None) -> dict[str, Rejection]:
    """Contributions whose norm exceeds ``ratio`` times the round's median (with 3 or more to compare)."""
    if ratio is None or len(measured) < 3:
        return {}
    median = statistics.median(m.norm for m in measured)
    if not median > 0:
        return {}
    return {m.contribution.key: Rejection(RejectionKind.OUTLIER,
                                          f"norm {m.norm:.3g} > {ratio:g} x median {median:.3g}")
            for m in measured if m.norm > ratio * median}


def _history_outliers(measured: Sequence[_Measured], ratio: float | None,
                      history: Sequence[float]) -> dict[str, Rejection]:
    """Contributions whose norm exceeds ``ratio`` times the median of the fragment's recent
    merged update norms: the outlier guard for rounds too small to compare within (K = 1).

    Skipped when two or more distinct learners are over it in one round (a real change of scale,
    e.g. a new learning-rate phase, that one learner alone cannot fake), so the fragment can
    never be locked out of updates by its own history."""
    usable = [h for h in history if math.isfinite(h) and h >= 0]
    if ratio is None or len(usable) < MIN_NORM_HISTORY:
        return {}
    median = statistics.median(usable)
    if not median > 0:
        return {}
    over = [m for m in measured if m.norm > ratio * median]
    if len({m.contribution.learner_id for m in over}) >= 2:
        return {}
    return {m.contribution.key: Rejection(
        RejectionKind.OUTLIER, f"norm {m.norm:.3g} > {ratio:g} x the recent median update norm {median:.3g} "
                               "(the fragment's, or the run's scaled to its size)")
        for m in over}


def _merge(weighed: _Weighed, policy: MergePolicy, *,
           out: Tensors | None) -> tuple[dict[str, torch.Tensor], dict[str, float | None], dict[str, float]]:
    """The accepted outer gradients merged by the policy's rule, RDA's last pass left to the outer step
    (see :func:`atoll.core.merge.merge_fragment_unscaled`); the norms measured while weighing are reused."""
    return merge_fragment_unscaled([m.grad for m in weighed.accepted], weighed.weights, rule=policy.merge,
                                   embedding_names=policy.embedding_names, rda_embeddings=policy.rda_embeddings,
                                   norms=[m.tensor_norms for m in weighed.accepted], out=out)


def _update_norm(update: Tensors, radii: Mapping[str, float]) -> float:
    """L2 norm of Delta; an RDA tensor's norm is its radius (the weighted mean of the norms): no pass over it."""
    return _total({n: radii[n] if n in radii else float(torch.linalg.vector_norm(u)) for n, u in update.items()})
