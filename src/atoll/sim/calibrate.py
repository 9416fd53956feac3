"""Fix the simulator's free parameters from the paper's three goodput numbers.

The paper (arXiv 2604.21428) reports, at N = 1.2 M chips and one failure per chip-year:
goodput 27% for data-parallel, 58% for elastic data-parallel, 88% for Decoupled DiLoCo with
M = 8. In this simulator, to first order (failure rate of the fleet λ = N r / year):

* DP is down ``restart_s`` after every failure, outages merging when they overlap. The fraction of
  time with no outage in progress is exactly ``exp(-λ c)`` (Poisson): **c = -ln(G_DP) / λ**.
* Elastic DP stalls ``reconfig_s`` = e at every change (a slice leaves, a slice comes back: 2λ
  changes per second) and trains on the slices in service, missing a fraction ``y = r R S`` of the
  chips (R the recovery delay, S chips per slice): ``G_E ≈ exp(-2 λ e) (1 - y)``.
* Decoupled DiLoCo with M islands pays the same stalls, each on 1/M of the fleet:
  ``G_M ≈ exp(-2 λ e / M) (1 - y)``.

The last two give ``ln(G_8 / G_E) = 2 λ e (1 - 1/8)`` -> **e**, then **y**, then with S fixed
(256 chips per slice, a structural choice, not fitted) **R = y / (r S)**. So: restart cost from
DP alone; reconfiguration cost from the ratio elastic : M=8; recovery delay from what is left.
Everything else the simulator prints (other N, other M, uptime, rounds per hour, heterogeneity)
is a prediction. tests/sim/test_sim.py::test_calibration_reproduces_the_paper_within_two_points checks the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.sim.fleet import SECONDS_PER_YEAR, CostModel, RecoveryDelay

__all__ = ["PaperTargets", "calibrate"]


@dataclass(frozen=True, kw_only=True)
class PaperTargets:
    """The three published numbers the simulator is fitted to."""

    chips: int = 1_200_000
    failures_per_chip_year: float = 1.0
    goodput_dp: float = 0.27
    goodput_elastic: float = 0.58
    goodput_decoupled: float = 0.88
    decoupled_m: int = 8


def calibrate(
    targets: PaperTargets = PaperTargets(),
    *,
    slice_chips: int = 256,
    recovery_kind: str = "fixed",
    recovery_shape: float = 1.0,
) -> CostModel:
    """Solve the three first-order equations above for (restart_s, reconfig_s, recovery mean)."""
    t = targets
    if not (0 < t.goodput_dp < 1 and 0 < t.goodput_elastic < t.goodput_decoupled < 1 and t.decoupled_m > 1):
        raise ValueError("need 0 < DP < 1 and 0 < elastic < decoupled < 1, with M > 1")
    r = t.failures_per_chip_year / SECONDS_PER_YEAR  # per chip per second
    lam = t.chips * r
    restart = -math.log(t.goodput_dp) / lam
    two_lam_e = math.log(t.goodput_decoupled / t.goodput_elastic) / (1.0 - 1.0 / t.decoupled_m)
    reconfig = two_lam_e / (2.0 * lam)
    y = 1.0 - t.goodput_elastic * math.exp(two_lam_e)
    if not (0 <= y < 1):
        raise ValueError(f"targets imply an impossible capacity loss y={y:.3f}")
    recovery = y / (r * slice_chips)
    return CostModel(
        failures_per_chip_year=t.failures_per_chip_year,
        recovery=RecoveryDelay(kind=recovery_kind, mean_s=recovery, shape=recovery_shape),  # type: ignore[arg-type]
        restart_s=restart,
        reconfig_s=reconfig,
        slice_chips=slice_chips,
    )
