"""Fleet model: failure traces, the elastic mechanics of one island, and the two DP baselines.

A fleet of N chips is not simulated chip by chip. Chip failures form one Poisson process of rate
``N * failures_per_chip_year / year`` (at 1.2 M chips and one failure per chip-year: one failure
every ~26 s). Each failure carries a position in ``[0, 1)`` (which part of the fleet it hits, so a
split into islands knows whose it is) and a recovery delay drawn from :class:`RecoveryDelay`: the
time until the failed chip's slice (``slice_chips`` chips) is back in service. Every system is run
on the *same* :class:`FailureTrace`, so differences between systems are never sampling noise.

Two mechanisms, both alternating renewal processes (an outage that is in progress takes in every
failure that happens before it ends; it is never extended):

* **DP** (stall and restart): a failure stops all N chips for ``recovery + restart_s`` (wait for
  the failed slice, re-form the job, reload the latest state). Up periods are Exp(λ), so
  goodput = uptime -> ``1 / (1 + λ (E[recovery] + restart_s))`` (λ = failures per second).
* **Elastic** (:func:`elastic_schedule`; elastic DP is one island of N chips, Decoupled DiLoCo has M
  of them): a failure stalls the island for ``reconfig_s`` while it re-forms its mesh without the
  failed slice; the island then trains on ``chips - slice_chips x (slices out)``. A slice that is
  back is re-admitted by the next reconfiguration -- one in progress, or one a failure starts --
  or, if none starts within ``readmit_window_s``, by a reconfiguration of its own. Re-admissions
  thus ride on failure reconfigurations when failures are frequent (large islands) and cost a
  stall of their own when they are rare (small islands).

Goodput is useful chip-time divided by allocated chip-time (N x horizon); uptime is the fraction of
wall-clock during which the run as a whole makes progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np

__all__ = [
    "SECONDS_PER_YEAR",
    "CostModel",
    "FailureTrace",
    "RecoveryDelay",
    "Schedule",
    "SystemResult",
    "elastic_schedule",
    "failure_trace",
    "simulate_dp",
    "simulate_elastic_dp",
]

SECONDS_PER_YEAR = 365.0 * 24 * 3600
TIMELINE_BINS = 240

RecoveryKind = Literal["fixed", "exponential", "weibull", "exponentiated_weibull"]
_KINDS = ("fixed", "exponential", "weibull", "exponentiated_weibull")


@lru_cache(maxsize=64)
def _expweibull_unit_mean(shape: float, exponent: float) -> float:
    """Mean of the exponentiated Weibull with scale 1: ``∫ (1 - F(x)) dx``, F = (1 - e^{-x^k})^a."""
    # beyond x_max, 1 - F(x) <= a e^{-x^k} < 1e-18; integrate in z = ln x (smooth, no endpoint singularity)
    x_max = (math.log(max(exponent, 1.0) * 1e18)) ** (1.0 / shape)
    z = np.linspace(math.log(1e-12), math.log(x_max), 200_001)
    x = np.exp(z)
    y = (1.0 - (-np.expm1(-(x**shape))) ** exponent) * x
    return float(np.sum((y[1:] + y[:-1]) * np.diff(z)) / 2.0)


@dataclass(frozen=True, kw_only=True)
class RecoveryDelay:
    """How long a failed chip's slice stays out before it is back in service."""

    kind: RecoveryKind = "fixed"
    """'fixed', 'exponential', 'weibull' (shape k) or 'exponentiated_weibull' (shape k, exponent a:
    CDF ``(1 - exp(-(x/s)^k))^a``; a = 1 is the Weibull, k = a = 1 the exponential)."""

    mean_s: float = 60.0
    """Mean delay in seconds (for every kind; the scale is derived from it)."""

    shape: float = 1.0
    """Weibull shape k (ignored for fixed/exponential)."""

    exponent: float = 1.0
    """Exponentiation a of the exponentiated Weibull (ignored otherwise)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"recovery kind must be one of {', '.join(repr(k) for k in _KINDS)}, got {self.kind!r}")
        if not (math.isfinite(self.mean_s) and self.mean_s >= 0):
            raise ValueError(f"recovery mean_s must be finite and >= 0, got {self.mean_s!r}")
        if not (math.isfinite(self.shape) and 0.2 <= self.shape <= 20):
            raise ValueError(f"recovery shape must be in [0.2, 20], got {self.shape!r}")
        if not (math.isfinite(self.exponent) and 0.05 <= self.exponent <= 100):
            raise ValueError(f"recovery exponent must be in [0.05, 100], got {self.exponent!r}")

    @property
    def scale_s(self) -> float:
        """The (exponentiated) Weibull scale that gives ``mean_s``."""
        if self.kind == "weibull":
            return self.mean_s / math.gamma(1.0 + 1.0 / self.shape)
        if self.kind == "exponentiated_weibull":
            return self.mean_s / _expweibull_unit_mean(self.shape, self.exponent)
        return self.mean_s

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed" or self.mean_s == 0:
            return np.full(n, float(self.mean_s))
        if self.kind == "exponential":
            return rng.exponential(self.mean_s, n)
        if self.kind == "weibull":
            return self.scale_s * rng.weibull(self.shape, n)
        # inverse CDF: x = s (-ln(1 - u^{1/a}))^{1/k}
        u = rng.uniform(0.0, 1.0, n)
        return self.scale_s * (-np.log1p(-(u ** (1.0 / self.exponent)))) ** (1.0 / self.shape)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The fleet's failure behaviour and the price each system pays for it."""

    failures_per_chip_year: float = 1.0
    """Mean interruptions per chip per year (the paper: 1, i.e. MTBI of one year per chip)."""

    recovery: RecoveryDelay = field(default_factory=RecoveryDelay)
    """Delay until a failed chip's slice is back in service (repaired, or a spare in its place)."""

    restart_s: float = 30.0
    """DP: after the failed slice is back (see ``dp_waits_for_repair``), the time to re-form the
    whole job and reload the latest state before training resumes."""

    dp_waits_for_repair: bool = True
    """True: a DP outage is ``recovery + restart_s`` (DP cannot train without the failed slice).
    False: a spare is at hand and the outage is ``restart_s`` alone."""

    reconfig_s: float = 10.0
    """Elastic DP and each Decoupled island: stall of one reconfiguration (re-form the mesh on
    the slices in service and reshard the state)."""

    readmit_window_s: float = 0.0
    """Elastic: how long a slice that is back may wait for a reconfiguration that a failure
    starts before it gets one of its own (0: re-admitted at once)."""

    slice_chips: int = 256
    """Chips that leave together when one of them fails (the elastic unit)."""

    def __post_init__(self) -> None:
        for name in ("failures_per_chip_year", "restart_s", "reconfig_s", "readmit_window_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        if not (isinstance(self.slice_chips, int) and self.slice_chips >= 1):
            raise ValueError(f"slice_chips must be an integer >= 1, got {self.slice_chips!r}")

    @property
    def dp_outage_s(self) -> float:
        """Mean DP outage per failure R: ``E[recovery] + restart_s`` (or ``restart_s``)."""
        return self.restart_s + (self.recovery.mean_s if self.dp_waits_for_repair else 0.0)


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


def _edges(horizon_s: float) -> np.ndarray:
    return np.linspace(0.0, horizon_s, TIMELINE_BINS + 1)


def _binned(starts: np.ndarray, ends: np.ndarray, level: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of a piecewise-constant ``level`` (0 outside the disjoint ``[starts, ends)``) per bin."""
    pts = np.concatenate([[0.0], np.ravel(np.column_stack([starts, ends]))])
    cum = np.concatenate([[0.0], np.ravel(np.column_stack([np.zeros(len(starts)), level * (ends - starts)]))])
    at = np.interp(edges, pts, np.cumsum(cum)) if len(starts) else np.zeros(len(edges))
    return np.diff(at) / np.diff(edges)


def simulate_dp(trace: FailureTrace, costs: CostModel) -> SystemResult:
    """Non-elastic data-parallel: stall and restart (an alternating renewal process).

    A failure while the job trains stops every chip for ``recovery + restart_s`` (or
    ``restart_s`` without ``dp_waits_for_repair``); failures during that outage are taken in by the
    same restart. Goodput = uptime, ``1 / (1 + λ R)`` in expectation.
    """
    T = trace.horizon_s
    restart = costs.restart_s
    waits = costs.dp_waits_for_repair
    starts: list[float] = []
    ends: list[float] = []
    end = -1.0
    for f, r in zip(trace.times_s.tolist(), trace.recovery_s.tolist(), strict=True):
        if f >= end:
            end = f + restart + (r if waits else 0.0)
            starts.append(f)
            ends.append(min(end, T))
    ds, de = np.asarray(starts), np.asarray(ends)
    down = float(np.sum(de - ds)) if starts else 0.0
    # up intervals are the gaps between outages
    us = np.concatenate([[0.0], de])
    ue = np.concatenate([ds, [T]])
    keep = ue > us
    active = _binned(us[keep], ue[keep], np.ones(int(keep.sum())), _edges(T))
    up = 1.0 - down / T
    return SystemResult(
        system="DP",
        goodput=up,
        uptime=up,
        rounds_per_hour=None,
        timeline_t_s=_edges(T)[:-1],
        timeline_active=active,
        details={"failures": float(len(trace)), "outages": float(len(ds)), "down_s": down},
    )


@dataclass(frozen=True)
class Schedule:
    """One elastic island's timeline: when it trains, and on how many chips.

    Between ``run_start[i]`` and ``run_end[i]`` the island trains on ``run_chips[i]`` chips; outside
    those intervals it is reconfiguring. Intervals are sorted, disjoint and cover ``[0, horizon)``
    minus the stalls.
    """

    chips: float
    horizon_s: float
    run_start: np.ndarray
    run_end: np.ndarray
    run_chips: np.ndarray
    stalls: int
    """Reconfigurations started before the horizon."""

    readmit_stalls: int
    """Of those, reconfigurations started only to re-admit slices (the window ran out)."""

    @property
    def useful_chip_s(self) -> float:
        return float(np.sum(self.run_chips * (self.run_end - self.run_start)))

    @property
    def running_s(self) -> float:
        return float(np.sum(self.run_end - self.run_start))


class _ElasticIsland:
    """The state :func:`elastic_schedule` carries from event to event, and what each event does to it.

    The island alternates between training (from ``run_from``) and reconfiguring (until
    ``stall_end``); ``stall_end > run_from`` means a reconfiguration is pending or in progress.
    Every training interval it closes is appended to ``run_start`` / ``run_end`` / ``run_chips``.
    """

    def __init__(self, chips: float, costs: CostModel, failures: int) -> None:
        self.chips = float(chips)
        self.reconfig_s = costs.reconfig_s
        self.readmit_window_s = costs.readmit_window_s
        self.slice_chips = float(min(costs.slice_chips, chips))
        self.max_out = max(1, math.ceil(chips / self.slice_chips))  # slices counted out, at most
        self.status = bytearray(failures)  # per failed slice: 0 out (not back yet), 1 back and waiting, 2 re-admitted
        self.waiting: list[int] = []
        self.out = 0
        self.cap = float(chips)  # chips the island trains on between reconfigurations
        self.stall_end = -math.inf  # the island trains while t >= stall_end
        self.run_from = 0.0
        self.timeouts: list[tuple[float, int]] = []  # (deadline, slice) for returns that found it training
        self.run_start: list[float] = []
        self.run_end: list[float] = []
        self.run_chips: list[float] = []
        self.stalls = 0
        self.readmit_stalls = 0

    def stall(self, t: float, *, readmit: bool) -> None:
        """Close the training interval at ``t`` and start a reconfiguration (one of its own for a
        returned slice when ``readmit``)."""
        self.run_start.append(self.run_from)
        self.run_end.append(t)
        self.run_chips.append(self.cap)
        self.stall_end = t + self.reconfig_s
        self.run_from = t  # marks "stall pending" (stall_end > run_from)
        self.stalls += 1
        if readmit:
            self.readmit_stalls += 1

    def readmit(self) -> None:
        """A reconfiguration ends: every slice that is back rejoins, and the island's size follows."""
        for s in self.waiting:
            self.status[s] = 2
        self.out -= len(self.waiting)
        self.waiting.clear()
        self.cap = max(0.0, self.chips - self.slice_chips * min(self.out, self.max_out))

    def fail(self, t: float, stalled: bool) -> None:
        """A slice fails; a reconfiguration in progress takes it in, else one starts."""
        self.out += 1
        if not stalled:
            self.stall(t, readmit=False)

    def slice_back(self, t: float, s: int, stalled: bool) -> None:
        """Slice ``s`` is back in service: it waits for a reconfiguration (at most the window)."""
        self.status[s] = 1
        self.waiting.append(s)
        if not stalled:
            if self.readmit_window_s <= 0:
                self.stall(t, readmit=True)
            else:
                self.timeouts.append((t + self.readmit_window_s, s))

    def window_over(self, t: float, s: int, stalled: bool) -> None:
        """Slice ``s`` has waited the whole window: if no reconfiguration took it in, start one."""
        if self.status[s] == 1 and not stalled:
            self.stall(t, readmit=True)

    def schedule(self, horizon_s: float) -> Schedule:
        """The timeline up to ``horizon_s`` (empty intervals dropped)."""
        if not (self.stall_end > self.run_from):  # training at the horizon
            self.run_start.append(self.run_from)
            self.run_end.append(horizon_s)
            self.run_chips.append(self.cap)
        rs, re_, rc = np.asarray(self.run_start), np.asarray(self.run_end), np.asarray(self.run_chips)
        keep = re_ > rs
        return Schedule(self.chips, horizon_s, rs[keep], re_[keep], rc[keep], self.stalls, self.readmit_stalls)


def elastic_schedule(
    times_s: np.ndarray,
    recovery_s: np.ndarray,
    horizon_s: float,
    chips: float,
    costs: CostModel,
) -> Schedule:
    """Run the elastic mechanics of one island of ``chips`` chips over its failures.

    * A failure while the island trains starts a reconfiguration of ``reconfig_s``; failures and
      returns during a reconfiguration are taken in by it (it is not extended).
    * The failed slice is back ``recovery`` later. It is re-admitted at the end of the
      reconfiguration in progress, or of the next one a failure starts; if none starts within
      ``readmit_window_s`` of its return, a reconfiguration starts for it (and takes in every slice
      that is back).
    * Between reconfigurations the island trains on ``chips - slice_chips x (slices out)``
      (never below 0); at most ``chips / slice_chips`` slices are counted out.

    Events are taken in time order (a reconfiguration's end first, then a failure, a return, a
    window's end); :class:`_ElasticIsland` says what each does.
    """
    T = float(horizon_s)
    f = np.asarray(times_s, dtype=float).tolist()
    n = len(f)
    ready_t = np.asarray(times_s, dtype=float) + np.asarray(recovery_s, dtype=float)
    order = np.argsort(ready_t, kind="stable")
    ready = ready_t[order].tolist()
    ready_id = order.tolist()
    island = _ElasticIsland(chips, costs, n)
    timeouts = island.timeouts
    inf = math.inf
    i = j = ti = 0  # next failure, next return, next window timeout (in return order)
    while True:
        tf = f[i] if i < n else inf
        tr = ready[j] if j < n else inf
        tt = timeouts[ti][0] if ti < len(timeouts) else inf
        ts = island.stall_end if island.stall_end > island.run_from else inf  # a pending stall end
        t = min(tf, tr, tt, ts)
        if t >= T:
            break
        if ts == t:  # the reconfiguration ends: re-admit every slice that is back
            island.readmit()
            island.run_from = t
            continue
        stalled = t < island.stall_end
        if tf == t:
            i += 1
            island.fail(t, stalled)
        elif tr == t:
            j += 1
            island.slice_back(t, ready_id[j - 1], stalled)
        else:
            ti += 1
            island.window_over(t, timeouts[ti - 1][1], stalled)
        if costs.reconfig_s <= 0 and island.stall_end == island.run_from:
            island.readmit()  # zero-length reconfigurations: end them at once
            island.stall_end = -inf
    return island.schedule(T)


def simulate_elastic_dp(trace: FailureTrace, costs: CostModel) -> SystemResult:
    """Elastic data-parallel: the whole fleet is one elastic island (:func:`elastic_schedule`)."""
    T = trace.horizon_s
    N = trace.chips
    sch = elastic_schedule(trace.times_s, trace.recovery_s, T, N, costs)
    active = _binned(sch.run_start, sch.run_end, sch.run_chips / N, _edges(T))
    return SystemResult(
        system="elastic DP",
        goodput=sch.useful_chip_s / (N * T),
        uptime=sch.running_s / T,
        rounds_per_hour=None,
        timeline_t_s=_edges(T)[:-1],
        timeline_active=active,
        details={
            "failures": float(len(trace)),
            "stall_s": T - sch.running_s,
            "reconfigurations": float(sch.stalls),
            "readmit_reconfigurations": float(sch.readmit_stalls),
        },
    )
