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

__all__ = ["Counters", "WeightResult", "contribution_weights", "unweighable"]


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
