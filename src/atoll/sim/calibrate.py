"""Fix the simulator's free parameters from the paper's three goodput numbers.

The paper (arXiv 2604.21428) reports, at N = 1.2 M chips and one failure per chip-year:
goodput 27% for data-parallel, 58% for elastic data-parallel, 88% for Decoupled DiLoCo with
M = 8. With λ = N r (failures per second of the fleet, r = 1 / year per chip):

* **DP** is an alternating renewal process (stall and restart): ``G_DP = 1 / (1 + λ R)`` exactly
  in expectation, R the mean outage. So **R = (1 / G_DP - 1) / λ** (71.0 s).
* A DP outage is "wait for the failed slice, then re-form the job": R = E[recovery] + restart.
  A restart is the same operation as an elastic reconfiguration (re-form the mesh on the slices in
  service and load the state), so **restart_s = reconfig_s = e** and **E[recovery] = R - e**.
  DP and elastic DP then differ in one thing only: DP waits for the failed slice, elastic does not.
* **Elastic DP** stalls e per reconfiguration and re-admits returned slices within a window W
  (:func:`atoll.sim.fleet.elastic_schedule`). **Decoupled DiLoCo** runs the same mechanics on each
  of its M islands, so M learners on N chips have the goodput of elastic DP on N / M chips (the
  paper's rule of thumb). The two remaining numbers are therefore two points of one curve:
  ``G_E(1.2 M) = 58%`` and ``G_E(1.2 M / 8) = 88%``. They fix **e** and **W**, solved numerically
  on long traces of the elastic mechanics itself (common random numbers, fixed seed).

Structural choices (not fitted): slice = 256 chips; the recovery delay is exponentiated Weibull
with shape k = 2 and exponent a = 2 (concentrated around its mean: few slices come back before
their own reconfiguration is over). Everything the simulator prints beyond the three numbers --
other N, other M, uptime, rounds per hour, the heterogeneous table -- is a prediction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from atoll.sim.fleet import SECONDS_PER_YEAR, CostModel, RecoveryDelay, elastic_schedule

__all__ = ["PaperTargets", "calibrate", "first_order"]


@dataclass(frozen=True, kw_only=True)
class PaperTargets:
    """The three published numbers the simulator is fitted to."""

    chips: int = 1_200_000
    failures_per_chip_year: float = 1.0
    goodput_dp: float = 0.27
    goodput_elastic: float = 0.58
    goodput_decoupled: float = 0.88
    decoupled_m: int = 8


def _root(fn: Callable[[float], float], lo: float, hi: float, tol: float, iters: int = 60) -> float:
    """Illinois regula falsi for a sign change of fn on [lo, hi]."""
    flo, fhi = fn(lo), fn(hi)
    if flo == 0:
        return lo
    if fhi == 0:
        return hi
    if (flo > 0) == (fhi > 0):
        raise ValueError("no sign change")
    side = 0
    x = lo
    for _ in range(iters):
        x = (lo * fhi - hi * flo) / (fhi - flo)
        fx = fn(x)
        if abs(fx) < tol or hi - lo < 1e-9 * max(1.0, abs(x)):
            return x
        if (fx > 0) == (fhi > 0):
            hi, fhi = x, fx
            if side == -1:
                flo /= 2
            side = -1
        else:
            lo, flo = x, fx
            if side == 1:
                fhi /= 2
            side = 1
    return x


_Trace = tuple[np.ndarray, np.ndarray, float]
"""Failure times (s), unit-mean recovery delays, horizon (s): one calibration trace."""


def calibrate(
    targets: PaperTargets = PaperTargets(),
    *,
    slice_chips: int = 256,
    recovery_kind: str = "exponentiated_weibull",
    recovery_shape: float = 2.0,
    recovery_exponent: float = 2.0,
    days: float = 10.0,
    seed: int = 20260423,
) -> CostModel:
    """Solve for (e = reconfig_s = restart_s, readmit_window_s, recovery mean) as described above.

    ``days`` sets the length of the calibration traces (of the N-chip fleet; the N/M one runs
    M times longer so both see about the same number of failures). Takes a few seconds.
    """
    t = targets
    if not (0 < t.goodput_dp < 1 and 0 < t.goodput_elastic < t.goodput_decoupled < 1 and t.decoupled_m > 1):
        raise ValueError("need 0 < DP < 1 and 0 < elastic < decoupled < 1, with M > 1")
    r = t.failures_per_chip_year / SECONDS_PER_YEAR  # per chip per second
    outage = (1.0 / t.goodput_dp - 1.0) / (t.chips * r)  # R = E[recovery] + restart
    unit = RecoveryDelay(kind=recovery_kind, mean_s=1.0, shape=recovery_shape, exponent=recovery_exponent)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    big = _draw_trace(rng, unit, t.chips * r, days * 86400.0)
    small = _draw_trace(rng, unit, t.chips / t.decoupled_m * r, days * 86400.0 * t.decoupled_m)
    fit = _ElasticFit(targets=t, outage_s=outage, unit=unit, slice_chips=slice_chips, big=big, small=small)
    return fit.solve()


def _draw_trace(rng: np.random.Generator, unit: RecoveryDelay, rate_per_s: float, horizon: float) -> _Trace:
    """Poisson failures at ``rate_per_s`` over ``horizon`` seconds, each with a unit-mean recovery."""
    n = int(rng.poisson(rate_per_s * horizon))
    return np.sort(rng.uniform(0.0, horizon, n)), unit.sample(rng, n), horizon


@dataclass(frozen=True, kw_only=True)
class _ElasticFit:
    """Elastic DP's goodput on the two calibration traces (N chips and N / M) as a function of
    (e, W), the mean outage R fixed by the DP target; :meth:`solve` places both on target."""

    targets: PaperTargets
    outage_s: float
    unit: RecoveryDelay
    """The recovery delay's shape, at mean 1 s (scaled by ``R - e``)."""
    slice_chips: int
    big: _Trace
    small: _Trace

    def costs(self, e: float, w: float) -> CostModel:
        return CostModel(
            failures_per_chip_year=self.targets.failures_per_chip_year,
            recovery=dataclasses.replace(self.unit, mean_s=max(0.0, self.outage_s - e)),
            restart_s=e,
            dp_waits_for_repair=True,
            reconfig_s=e,
            readmit_window_s=w,
            slice_chips=self.slice_chips,
        )

    def goodput(self, trace: _Trace, chips: float, e: float, w: float) -> float:
        times, unit_rec, horizon = trace
        c = self.costs(e, w)
        sch = elastic_schedule(times, unit_rec * c.recovery.mean_s, horizon, chips, c)
        return sch.useful_chip_s / (chips * horizon)

    def e_for(self, w: float) -> float:
        """The reconfiguration time that puts elastic DP at its target."""
        t = self.targets
        return _root(lambda e: self.goodput(self.big, t.chips, e, w) - t.goodput_elastic, 0.0, self.outage_s, 2e-5)

    def gap(self, w: float) -> float:
        """Decoupled (= elastic on N/M) minus its target, along the curve ``e_for``."""
        t = self.targets
        return self.goodput(self.small, t.chips / t.decoupled_m, self.e_for(w), w) - t.goodput_decoupled

    def solve(self) -> CostModel:
        # Along the curve G_E(N) = target, the N/M point first falls with W (re-admissions ride on
        # failure reconfigurations at N but not at N/M), then rises again (slices wait too long):
        # take the first crossing, the shortest window that fits.
        t = self.targets
        grid = [self.outage_s * x for x in (0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.4, 2.0, 3.0, 4.0)]
        prev_w, prev_gap = grid[0], self.gap(grid[0])
        for w in grid[1:]:
            g = self.gap(w)
            if (g > 0) != (prev_gap > 0):
                return self.costs(self.e_for(w_star := _root(self.gap, prev_w, w, 2e-5)), w_star)
            prev_w, prev_gap = w, g
        raise ValueError(
            f"cannot place elastic DP at {t.goodput_elastic:.0%} and decoupled M={t.decoupled_m} at "
            f"{t.goodput_decoupled:.0%} with any re-admission window in [0, {grid[-1]:.0f}] s: the "
            "targets are outside what stall-per-reconfiguration mechanics can produce"
        )


def first_order(costs: CostModel, chips: float) -> dict[str, float]:
    """Closed-form approximations used in docs/simulator.md (not used by the simulator).

    DP: exactly ``1 / (1 + λR)``. Elastic: ``1 / (1 + λ e (1 + q))``, where q is the share of
    returning slices that need a reconfiguration of their own, estimated as
    ``P(recovery > e) * exp(-λ W)`` (no failure reconfiguration within the window).
    """
    lam = chips * costs.failures_per_chip_year / SECONDS_PER_YEAR
    rec = costs.recovery
    e, w = costs.reconfig_s, costs.readmit_window_s
    rng = np.random.default_rng(0)
    p_late = float(np.mean(rec.sample(rng, 200_000) > e)) if rec.mean_s > 0 else 0.0
    q = p_late * math.exp(-lam * w)
    return {
        "dp": 1.0 / (1.0 + lam * costs.dp_outage_s),
        "elastic": 1.0 / (1.0 + lam * e * (1.0 + q)),
    }
