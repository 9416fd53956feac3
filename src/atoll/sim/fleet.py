"""Fleet model: failure traces and the two data-parallel baselines.

A fleet of N chips is not simulated chip by chip. Chip failures form one Poisson process of rate
``N * failures_per_chip_year / year`` (at 1.2 M chips and one failure per chip-year: one failure
every ~26 s). Each failure carries a position in ``[0, 1)`` (which part of the fleet it hits, so a
split into islands knows whose it is) and a recovery delay drawn from :class:`RecoveryDelay`.
Every system is run on the *same* :class:`FailureTrace`, so differences between systems are never
sampling noise.

The data-parallel baselines are computed exactly from the trace with numpy (interval unions):

* **DP** (no elasticity): a failure stops all N chips until the failed part is back in the job
  and the job has restarted. By default the failed slice is swapped for a spare, so the outage is
  ``restart_s`` (swap, relaunch, reload the checkpoint, redo the lost steps);
  ``dp_waits_for_repair=True`` waits for the repair itself first (``recovery + restart_s``).
  A failure during an outage extends it: down time is the union of ``[f, f + outage)``.
* **Elastic DP**: keeps training on the healthy slices. Every membership change (a slice leaves
  at a failure, comes back after the recovery delay) stalls the whole fleet for ``reconfig_s``;
  between stalls it runs on ``N - slice_chips * (slices down)`` chips.

Goodput is useful chip-time divided by allocated chip-time (N x horizon); uptime is the fraction of
wall-clock during which the run as a whole makes progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "SECONDS_PER_YEAR",
    "CostModel",
    "FailureTrace",
    "RecoveryDelay",
    "SystemResult",
    "failure_trace",
    "simulate_dp",
    "simulate_elastic_dp",
]

SECONDS_PER_YEAR = 365.0 * 24 * 3600
TIMELINE_BINS = 240

RecoveryKind = Literal["fixed", "exponential", "weibull"]


@dataclass(frozen=True, kw_only=True)
class RecoveryDelay:
    """How long a failed chip (its slice) stays out before it is back in service."""

    kind: RecoveryKind = "fixed"
    """'fixed', 'exponential' or 'weibull' (shape < 1: heavy tail, > 1: concentrated)."""

    mean_s: float = 60.0
    """Mean delay in seconds (for every kind; the Weibull scale is derived from it)."""

    shape: float = 1.0
    """Weibull shape k (ignored otherwise); k = 1 is the exponential."""

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "exponential", "weibull"):
            raise ValueError(f"recovery kind must be 'fixed', 'exponential' or 'weibull', got {self.kind!r}")
        if not (math.isfinite(self.mean_s) and self.mean_s >= 0):
            raise ValueError(f"recovery mean_s must be finite and >= 0, got {self.mean_s!r}")
        if not (math.isfinite(self.shape) and self.shape > 0):
            raise ValueError(f"recovery shape must be finite and > 0, got {self.shape!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed" or self.mean_s == 0:
            return np.full(n, float(self.mean_s))
        if self.kind == "exponential":
            return rng.exponential(self.mean_s, n)
        scale = self.mean_s / math.gamma(1.0 + 1.0 / self.shape)
        return scale * rng.weibull(self.shape, n)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The fleet's failure behaviour and the price each system pays for it."""

    failures_per_chip_year: float = 1.0
    """Mean interruptions per chip per year (the paper: 1, i.e. MTBI of one year per chip)."""

    recovery: RecoveryDelay = field(default_factory=RecoveryDelay)
    """Delay until a failed chip's slice is repaired and back in service. Elastic DP and
    Decoupled DiLoCo train without the slice meanwhile."""

    restart_s: float = 30.0
    """Non-elastic DP: from a failure until the whole job trains again (swap a spare slice in
    for the failed one, relaunch, reload the checkpoint, redo the lost steps)."""

    dp_waits_for_repair: bool = False
    """True: non-elastic DP has no spare and waits for the failed slice's own recovery delay
    before the restart (down for recovery + restart_s instead of restart_s)."""

    reconfig_s: float = 10.0
    """Elastic DP: fleet-wide stall at every membership change. Decoupled DiLoCo: the stall of a
    learner that rejoins (it re-forms its mesh and loads the latest global state)."""

    slice_chips: int = 256
    """Chips that leave together when one of them fails (the elastic unit)."""

    def __post_init__(self) -> None:
        for name in ("failures_per_chip_year", "restart_s", "reconfig_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        if not (isinstance(self.slice_chips, int) and self.slice_chips >= 1):
            raise ValueError(f"slice_chips must be an integer >= 1, got {self.slice_chips!r}")


@dataclass(frozen=True)
class FailureTrace:
    """Chip failures over ``[0, horizon_s)``: when, where (fraction of the fleet), for how long."""

    chips: int
    horizon_s: float
    times_s: np.ndarray
    positions: np.ndarray
    recovery_s: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.times_s)
        if len(self.positions) != n or len(self.recovery_s) != n:
            raise ValueError("times_s, positions and recovery_s must have the same length")

    def __len__(self) -> int:
        return len(self.times_s)

    def subset(self, keep: np.ndarray) -> FailureTrace:
        """The same trace with only the failures where ``keep`` is True (fewer failures)."""
        keep = np.asarray(keep, dtype=bool)
        return FailureTrace(
            self.chips, self.horizon_s, self.times_s[keep], self.positions[keep], self.recovery_s[keep]
        )

    def in_range(self, lo: float, hi: float) -> FailureTrace:
        """Failures whose position falls in ``[lo, hi)`` (one island's share of the fleet)."""
        return self.subset((self.positions >= lo) & (self.positions < hi))


def failure_trace(
    chips: int, horizon_s: float, costs: CostModel, *, seed: int = 0
) -> FailureTrace:
    """Draw the fleet's failure trace: Poisson times at rate ``chips * rate / year``."""
    if not (isinstance(chips, int) and chips >= 1):
        raise ValueError(f"chips must be an integer >= 1, got {chips!r}")
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise ValueError(f"horizon_s must be finite and > 0, got {horizon_s!r}")
    rng = np.random.default_rng(seed)
    rate = chips * costs.failures_per_chip_year / SECONDS_PER_YEAR
    n = int(rng.poisson(rate * horizon_s))
    times = np.sort(rng.uniform(0.0, horizon_s, n))
    positions = rng.uniform(0.0, 1.0, n)
    recovery = costs.recovery.sample(rng, n)
    return FailureTrace(chips, float(horizon_s), times, positions, recovery)


@dataclass
class SystemResult:
    """What one system did on one trace."""

    system: str
    """'DP', 'elastic DP', or 'decoupled M=8' (with K/grace noted for non-default policies)."""

    goodput: float
    """Useful chip-time / allocated chip-time."""

    uptime: float
    """Fraction of wall-clock during which the run as a whole makes progress."""

    rounds_per_hour: float | None
    """Outer rounds closed per hour (Decoupled DiLoCo only)."""

    timeline_t_s: np.ndarray
    """Bin edges' left ends (seconds)."""

    timeline_active: np.ndarray
    """Fraction of the fleet computing in each bin."""

    details: dict[str, float] = field(default_factory=dict)
    """Extra numbers (failures, rounds, contributions accepted, chip-time lost by cause...)."""


def merge_intervals(starts: np.ndarray, ends: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Union of half-open intervals, clipped to ``[0, horizon_s]``; returns sorted disjoint ones."""
    if len(starts) == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(starts, kind="stable")
    s = np.clip(starts[order], 0.0, horizon_s)
    e = np.clip(ends[order], 0.0, horizon_s)
    run_end = np.maximum.accumulate(e)
    # a new group starts where the start is beyond every earlier end
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    group_end = np.maximum.reduceat(e, idx)
    ms, me = s[idx], group_end
    keep = me > ms
    return ms[keep], me[keep]


def covered_in_bins(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Length of the (disjoint) intervals falling in each bin ``[edges[i], edges[i+1])``."""
    def cum(x: np.ndarray) -> np.ndarray:  # total covered length in [0, x)
        if len(starts) == 0:
            return np.zeros_like(x)
        lengths = np.concatenate([[0.0], np.cumsum(ends - starts)])
        i = np.searchsorted(starts, x, side="right")  # intervals starting before x
        partial = np.where(i > 0, np.minimum(x, ends[np.maximum(i - 1, 0)]) - starts[np.maximum(i - 1, 0)], 0.0)
        return lengths[np.maximum(i - 1, 0)] * (i > 0) + np.maximum(partial, 0.0)

    c = cum(edges)
    return np.diff(c)


def _edges(horizon_s: float) -> np.ndarray:
    return np.linspace(0.0, horizon_s, TIMELINE_BINS + 1)


def simulate_dp(trace: FailureTrace, costs: CostModel) -> SystemResult:
    """Non-elastic data-parallel: any failure stops everyone until the chip is back + restart."""
    T = trace.horizon_s
    outage = costs.restart_s + (trace.recovery_s if costs.dp_waits_for_repair else 0.0)
    ds, de = merge_intervals(trace.times_s, trace.times_s + outage, T)
    down = float(np.sum(de - ds))
    edges = _edges(T)
    width = np.diff(edges)
    active = 1.0 - covered_in_bins(ds, de, edges) / width
    up = 1.0 - down / T
    return SystemResult(
        system="DP",
        goodput=up,
        uptime=up,
        rounds_per_hour=None,
        timeline_t_s=edges[:-1],
        timeline_active=active,
        details={"failures": float(len(trace)), "outages": float(len(ds)), "down_s": down},
    )


def simulate_elastic_dp(trace: FailureTrace, costs: CostModel) -> SystemResult:
    """Elastic data-parallel: runs on the healthy slices, stalls ``reconfig_s`` at every change."""
    T = trace.horizon_s
    N = trace.chips
    f = trace.times_s
    back = f + trace.recovery_s
    changes = np.concatenate([f, back[back < T]])
    ss, se = merge_intervals(changes, changes + costs.reconfig_s, T)
    stall = float(np.sum(se - ss))
    # chips out of service over time: +slice at a failure, -slice when it is back
    slice_frac = min(costs.slice_chips, N) / N
    pts = np.concatenate([f, back, ss, se, [0.0, T]])
    pts = np.unique(np.clip(pts, 0.0, T))
    mids = 0.5 * (pts[:-1] + pts[1:])
    n_down = np.searchsorted(np.sort(f), mids, side="right") - np.searchsorted(np.sort(back), mids, side="right")
    cap = np.clip(1.0 - n_down * slice_frac, 0.0, 1.0)
    i = np.searchsorted(ss, mids, side="right") - 1
    stalled = (i >= 0) & (mids < se[np.maximum(i, 0)]) if len(ss) else np.zeros(len(mids), dtype=bool)
    rate = np.where(stalled, 0.0, cap)
    seg = np.diff(pts)
    useful = float(np.sum(rate * seg))
    # timeline: integrate the same piecewise-constant rate per bin
    edges = _edges(T)
    cum = np.concatenate([[0.0], np.cumsum(rate * seg)])
    at = np.interp(edges, pts, cum)
    active = np.diff(at) / np.diff(edges)
    return SystemResult(
        system="elastic DP",
        goodput=useful / T,
        uptime=1.0 - stall / T,
        rounds_per_hour=None,
        timeline_t_s=edges[:-1],
        timeline_active=active,
        details={"failures": float(len(trace)), "stall_s": stall, "reconfigurations": float(len(changes))},
    )
