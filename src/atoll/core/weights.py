"""Contribution weights: w_m = c_tokens^2 / c_steps (quantity x tokens-per-step), normalised.

A learner that did many steps on big batches counts more; one that did few steps counts less.
Contributions that cannot be weighted (no steps, no tokens) get weight 0 and a reason, never an
exception, so a round with one bad contribution still closes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from atoll.core.rejection import Rejection, RejectionKind

__all__ = [
    "Counters",
    "WeightResult",
    "contribution_weights",
    "unweighable",
    "impossible_counters",
    "max_steps_since",
    "MIN_STEP_S",
    "plausible_steps",
    "UNOBSERVED_INTERVALS",
    "clip_counters",
    "cap_step_share",
    "cap_weight_share",
]


@dataclass(frozen=True, kw_only=True)
class Counters:
    """What a learner did to one fragment since it last aligned it."""

    c_steps: int
    """Inner steps since alignment."""

    c_tokens: int
    """Tokens consumed since alignment."""


@dataclass(frozen=True)
class WeightResult:
    """Normalised weights (summing to 1 over accepted keys) and the reasons for zero weights."""

    weights: dict[str, float]
    rejected: dict[str, Rejection]


def unweighable(c_steps: int, c_tokens: int) -> Rejection | None:
    """The one check for a contribution that cannot be weighed (no steps or no tokens since its
    learner aligned the fragment), used by the quorum decision, the weights and the merge alike."""
    if c_steps <= 0:
        return Rejection(RejectionKind.NO_STEPS, f"no inner steps since last alignment (c_steps={c_steps})")
    if c_tokens <= 0:
        return Rejection(RejectionKind.NO_TOKENS, f"no tokens since last alignment (c_tokens={c_tokens})")
    return None


MIN_STEP_S = 1e-3
"""The shortest inner step :func:`max_steps_since` allows for in the time since a base version
was committed: learners never wait for the synchronizer, so while rounds are slow (no quorum, a
slow merge) they keep stepping, and those steps are honest."""


def max_steps_since(base_version: int, round_: int, inner_steps: int, *, elapsed_s: float = 0.0) -> int:
    """The most inner steps an honest learner can have run on a fragment since it aligned to
    ``base_version``, as seen when round ``round_`` is being decided.

    Bound: ``H * (round_ - base_version + 2) + elapsed_s / MIN_STEP_S``, where ``elapsed_s`` is
    the time on the synchronizer's own clock since it saw ``base_version`` committed (or since it
    started, if that was earlier). Why it holds for an honest learner: it aligns to version ``b``
    only after round ``b`` committed, and its counters grow by one per inner step. The time term
    alone already bounds them for any learner stepping no faster than a millisecond; the round
    term is the steady state with no time at all: fragment p comes up once every P rounds and
    the learner publishes it every H steps, so ``c_steps`` is about H while the bound is at least
    ``H * (P + 2)`` against the current version (``H * (2P + 2)`` against the one before); the
    ``+ 2`` covers the tau < H steps between publishing and seeing the next version.

    What it does not see: steps run while no synchronizer was running (its clock starts when it
    does). A contribution that trained through a long synchronizer outage can be refused; the
    learner is not stuck: a refusal carries no update, so the fragment stays at ``b`` while the
    bound grows by H * P per P rounds (and by the elapsed time), far faster than the learner's
    ~H steps, and a later contribution passes.
    """
    rounds = max(0, int(round_) - int(base_version))
    extra = int(elapsed_s / MIN_STEP_S) if math.isfinite(elapsed_s) and elapsed_s > 0 else 0
    return int(inner_steps) * (rounds + 2) + extra


def impossible_counters(c_steps: int, c_tokens: int, *, max_steps: int | None = None,
                        max_tokens_per_step: int | None = None) -> Rejection | None:
    """IMPOSSIBLE_COUNTERS if the counters claim more than a learner can have done, else None.

    ``max_tokens_per_step`` is batch x context (a learner consumes exactly that many tokens per
    inner step); ``max_steps`` comes from :func:`max_steps_since`. None skips that check (a run
    with no recipe has no known batch). Counters that are not positive are left to
    :func:`unweighable`. Integers only: no float conversion, so no overflow.
    """
    if c_steps <= 0 or c_tokens <= 0:
        return None
    if max_steps is not None and c_steps > max_steps:
        return Rejection(RejectionKind.IMPOSSIBLE_COUNTERS,
                         f"c_steps={c_steps} is more than the {max_steps} steps possible since its base version")
    if max_tokens_per_step is not None and c_tokens > c_steps * max_tokens_per_step:
        return Rejection(RejectionKind.IMPOSSIBLE_COUNTERS,
                         f"c_tokens={c_tokens} is more than c_steps={c_steps} x {max_tokens_per_step} "
                         "tokens per step (batch x context)")
    return None


def contribution_weights(counters: Mapping[str, Counters], *, rule: str = "tokens") -> WeightResult:
    """Weights per contribution key. ``rule`` is 'tokens' (paper) or 'uniform'."""
    if rule not in ("tokens", "uniform"):
        raise ValueError(f"weighting rule must be 'tokens' or 'uniform', got {rule!r}")
    raw: dict[str, float] = {}
    rejected: dict[str, Rejection] = {}
    for key, c in counters.items():
        why = unweighable(c.c_steps, c.c_tokens)
        if why is not None:
            rejected[key] = why
        else:
            raw[key] = 1.0 if rule == "uniform" else float(c.c_tokens) ** 2 / float(c.c_steps)
    total = math.fsum(raw.values())
    weights = {k: v / total for k, v in raw.items()} if total > 0 else {}
    return WeightResult(weights=weights, rejected=rejected)


UNOBSERVED_INTERVALS = 4
"""The prior before anything has been observed: a contribution's weight counts at most this many
publication intervals of H inner steps, until the synchronizer has observed another learner's
step time. Two would hold steady state (one of fresh work, one carried from before it aligned);
four, because honest learners keep stepping while the synchronizer starts and its first rounds
are slow, and their first contributions carry more than 2 H steps."""


def plausible_steps(elapsed_s: float, *, min_step_s: float | None, inner_steps: int,
                    speedup: float | None, unobserved_steps: int | None = None) -> int | None:
    """The most inner steps a contribution's weight may count: what its observed time could
    have produced, ``H + speedup * elapsed_s / min_step_s``.

    ``elapsed_s`` is the time since its base version was committed, on the synchronizer's own
    clock (up to when the synchronizer first listed the record); ``min_step_s`` is the fleet's
    observed minimum plausible step time (of the *other* live learners: a learner's own reports
    never loosen its own bound); ``speedup`` is how much faster than that a learner may step.
    ``+ H`` covers the steps a learner may carry into a contribution from before it aligned
    (local progress kept past the overlap). An honest learner that is not more than ``speedup``
    times faster than the fastest other learner stays under it; a claim above it is clipped
    (:func:`clip_counters`), not rejected: the steps may be honest, the weight they ask for is
    not proven.

    With no step time to go by (a new run, a restarted synchronizer that read nothing back) the
    bound is the prior ``unobserved_steps`` (the synchronizer passes
    ``UNOBSERVED_INTERVALS * H``), not no bound; None when there is no prior either, or the
    bound is off (``speedup`` None).
    """
    if speedup is None:
        return None
    if min_step_s is None or not (min_step_s > 0 and math.isfinite(min_step_s)):
        return None if unobserved_steps is None else max(1, int(unobserved_steps))
    if not (math.isfinite(elapsed_s) and elapsed_s > 0):
        elapsed_s = 0.0
    return int(inner_steps) + int(speedup * elapsed_s / min_step_s)


def clip_counters(c: Counters, max_steps: int | None) -> Counters:
    """``c`` with ``c_steps`` at most ``max_steps`` and ``c_tokens`` cut in proportion (tokens per
    step unchanged), so its weight c_tokens^2 / c_steps is what ``max_steps`` steps could earn.
    Unchanged (the same object) when within the bound. Integers only."""
    if max_steps is None or c.c_steps <= max_steps or c.c_steps <= 0 or max_steps <= 0:
        return c
    return Counters(c_steps=max_steps, c_tokens=max(1, c.c_tokens * max_steps // c.c_steps))


def cap_step_share(counters: Mapping[str, Counters], max_share: float | None) -> dict[str, Counters]:
    """``counters`` with no one contribution carrying more than ``max_share`` of the round's
    inner steps (two or more contributions): the one above (at most one can be, the cap being at
    least a half) is clipped (:func:`clip_counters`) to ``max_share / (1 - max_share)`` times the
    others' steps together. Steps, not weights: an island's ranks multiply its tokens per step
    (its weight per step, from the recipe), never its steps, so an honest multi-rank island is
    no nearer the cap than a one-rank learner. The same objects when none is over (or
    ``max_share`` is None or 1). Integers only."""
    if max_share is None or max_share >= 1.0 or len(counters) < 2:
        return dict(counters)
    out = dict(counters)
    total = sum(max(0, c.c_steps) for c in counters.values())
    for key, c in counters.items():
        rest = total - max(0, c.c_steps)
        if c.c_steps > max_share * total and rest > 0:
            # share <= k  <=>  steps <= k / (1 - k) * rest; the fraction in integers, rounding down
            num, den = float(max_share).as_integer_ratio()
            out[key] = clip_counters(c, max(1, num * rest // (den - num)))
    return out


def cap_weight_share(weights: Mapping[str, float], max_share: float | None) -> dict[str, float]:
    """Normalised weights with no single one above ``max(max_share, 1 / n)``: capped ones are
    set to the cap and the rest scaled up in proportion to fill the remainder (repeated until
    none is over). The same values, bit for bit, when none is over the cap (or ``max_share`` is
    None, or there are fewer than two weights)."""
    n = len(weights)
    if max_share is None or n < 2:
        return dict(weights)
    cap = max(float(max_share), 1.0 / n)
    if all(w <= cap for w in weights.values()):
        return dict(weights)
    capped: set[str] = set()
    scaled = dict(weights)
    while True:
        free = 1.0 - cap * len(capped)
        rest = {k: w for k, w in weights.items() if k not in capped}
        total = math.fsum(rest.values())
        scaled = {k: (w * free / total if total > 0 else free / len(rest)) for k, w in rest.items()}
        over = {k for k, w in scaled.items() if w > cap}
        if not over or len(capped) + len(over) >= n:
            break
        capped |= over
    return {k: cap if k in capped else min(scaled[k], cap) for k in weights}
