"""Named scenarios: the paper's grid, the heterogeneous fleet, and a user's fleet from YAML."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atoll.sim.fleet import CostModel, RecoveryDelay

__all__ = ["PAPER_COSTS", "Scenario", "load_scenario", "paper_costs", "paper_scenario", "scenario_from_mapping"]

PAPER_SIZES = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_MS = (2, 4, 8, 16)


PAPER_COSTS = CostModel(
    failures_per_chip_year=1.0,
    recovery=RecoveryDelay(kind="exponentiated_weibull", mean_s=55.15, shape=2.0, exponent=2.0),
    restart_s=15.90,
    dp_waits_for_repair=True,
    reconfig_s=15.90,
    readmit_window_s=29.67,
    slice_chips=256,
)
"""``calibrate()`` of the paper's 27% / 58% / 88%, rounded (tests/sim checks that calibrate() still
gives these numbers, so the two cannot drift apart)."""


def paper_costs() -> CostModel:
    """Restart, reconfiguration, re-admission window and recovery fixed from 27% / 58% / 88%."""
    return PAPER_COSTS


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Everything ``atoll simulate`` needs: fleet sizes, costs, Decoupled knobs, what to print."""

    sizes: tuple[int, ...] = PAPER_SIZES
    """Fleet sizes N (chips) for the grid."""

    learners: tuple[int, ...] = PAPER_MS
    """M values for Decoupled DiLoCo in the grid."""

    costs: CostModel = field(default_factory=paper_costs)
    horizon_s: float = 24 * 3600.0
    """Simulated wall-clock per run."""

    step_s: float = 10.0
    """Inner-step time of a speed-1 island."""

    step_spread: float = 0.0
    """Relative step-time noise in the grid (the heterogeneous case sets its own)."""

    sync_s: float = 1.0
    """Merge + publish time of one round."""

    inner_steps: int = 24
    num_fragments: int = 24
    overlap_steps: int = 2
    min_quorum: int = 1
    grace_factor: float = 0.5

    heterogeneous: bool = True
    """Also run the two-speed fleet for K = M, K = 1 and K = 1 + grace."""

    hetero_chips: int = 1_200_000
    hetero_m: int = 8
    hetero_slow_factor: float = 1.18
    hetero_spread: float = 0.10
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or any(not (isinstance(n, int) and n >= 1) for n in self.sizes):
            raise ValueError(f"sizes must be positive chip counts, got {self.sizes!r}")
        if not self.learners or any(not (isinstance(m, int) and m >= 1) for m in self.learners):
            raise ValueError(f"learners must be integers >= 1, got {self.learners!r}")
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"horizon_s must be > 0, got {self.horizon_s!r}")


def paper_scenario(**overrides: Any) -> Scenario:
    """The paper's grid: N in {150k .. 2.4M} x {DP, elastic DP, M = 2, 4, 8, 16}, one day each."""
    return dataclasses.replace(Scenario(), **overrides)


_SCALARS = {f.name for f in dataclasses.fields(Scenario)} - {"costs", "sizes", "learners"}
_COSTS = {"failures_per_chip_year", "restart_s", "reconfig_s", "readmit_window_s", "slice_chips", "dp_waits_for_repair"}


def scenario_from_mapping(data: Mapping[str, Any], base: Scenario | None = None) -> Scenario:
    """Build a scenario from a plain mapping (a parsed YAML file); unknown keys are errors.

    Keys: ``chips`` (int or list), ``learners`` (int or list), ``hours``/``days``, the cost keys
    ``failures_per_chip_year restart_s reconfig_s readmit_window_s slice_chips
    dp_waits_for_repair``, a ``recovery: {kind, mean_s, shape, exponent}`` block, and any scalar field of :class:`Scenario`
    (``step_s``, ``step_spread``, ``min_quorum``, ``grace_factor``, ``heterogeneous``, ``seed``...).
    Missing cost keys keep the paper calibration.
    """
    base = base or paper_scenario()
    data = dict(data)
    changes: dict[str, Any] = {}
    cost_changes: dict[str, Any] = {}
    if "chips" in data:
        v = data.pop("chips")
        changes["sizes"] = tuple(int(x) for x in (v if isinstance(v, list | tuple) else [v]))
    if "learners" in data:
        v = data.pop("learners")
        changes["learners"] = tuple(int(x) for x in (v if isinstance(v, list | tuple) else [v]))
    if "hours" in data:
        changes["horizon_s"] = float(data.pop("hours")) * 3600.0
    if "days" in data:
        changes["horizon_s"] = float(data.pop("days")) * 86400.0
    if "recovery" in data:
        rec = dict(data.pop("recovery") or {})
        unknown = set(rec) - {"kind", "mean_s", "shape", "exponent"}
        if unknown:
            raise ValueError(f"unknown recovery key(s) {sorted(unknown)}; use kind, mean_s, shape, exponent")
        cost_changes["recovery"] = dataclasses.replace(base.costs.recovery, **rec)
    for key in list(data):
        if key in _COSTS:
            cost_changes[key] = data.pop(key)
        elif key in _SCALARS:
            changes[key] = data.pop(key)
    if data:
        raise ValueError(
            f"unknown fleet key(s) {sorted(data)}; known: chips, learners, hours, days, recovery, "
            f"{', '.join(sorted(_COSTS | _SCALARS))}"
        )
    if cost_changes:
        changes["costs"] = dataclasses.replace(base.costs, **cost_changes)
    return dataclasses.replace(base, **changes)


def load_scenario(path: str | Path, base: Scenario | None = None) -> Scenario:
    """Read a small YAML fleet description (see :func:`scenario_from_mapping`)."""
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of fleet keys at the top level")
    return scenario_from_mapping(data, base)

