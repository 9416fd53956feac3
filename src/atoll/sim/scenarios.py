"""Run scenarios and present them: the goodput grid, the heterogeneous table, PNG plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from atoll.core.quorum import QuorumPolicy
from atoll.sim.decoupled import (
    DecoupledSetup,
    equal_islands,
    simulate_decoupled,
    two_speed_islands,
)
from atoll.sim.fleet import (
    SECONDS_PER_YEAR,
    CostModel,
    SystemResult,
    failure_trace,
    simulate_dp,
    simulate_elastic_dp,
)
from atoll.sim.presets import Scenario

__all__ = [
    "GridResult",
    "dp_renewal",
    "format_grid",
    "format_results",
    "format_rule_of_thumb",
    "plot_grid",
    "plot_timelines",
    "rule_sizes",
    "run_elastic_curve",
    "run_fleet",
    "run_grid",
    "run_heterogeneous",
    "write_report",
]


@dataclass
class GridResult:
    sizes: tuple[int, ...]
    systems: tuple[str, ...]
    results: dict[tuple[int, str], SystemResult] = field(default_factory=dict)
    heterogeneous: list[SystemResult] = field(default_factory=list)
    learners: tuple[int, ...] = ()
    elastic_curve: dict[int, SystemResult] = field(default_factory=dict)
    """Elastic DP at every N / M of the grid (and every N): the rule of thumb's other side."""
    costs: CostModel | None = None
    horizon_s: float = 0.0


def _policy(s: Scenario, k: int, grace_factor: float) -> QuorumPolicy:
    return QuorumPolicy(
        min_quorum=k,
        grace_factor=grace_factor,
        overlap_steps=s.overlap_steps,
        steps_between_rounds=s.inner_steps / s.num_fragments,
        poll_interval_s=1e9,  # the simulator knows every arrival; it never needs to poll
    )


def _setup(s: Scenario, islands, k: int, grace_factor: float, spread: float, label: str | None = None) -> DecoupledSetup:  # noqa: ANN001
    return DecoupledSetup(
        islands=islands,
        policy=_policy(s, k, grace_factor),
        num_fragments=s.num_fragments,
        inner_steps=s.inner_steps,
        step_s=s.step_s,
        step_spread=spread,
        sync_s=s.sync_s,
        label=label,
    )


def run_fleet(
    s: Scenario, chips: int, *, learners: Sequence[int] | None = None, quorum: str = "fast"
) -> list[SystemResult]:
    """DP, elastic DP and Decoupled DiLoCo (each M) on one failure trace of ``chips`` chips."""
    trace = failure_trace(chips, s.horizon_s, s.costs, seed=s.seed)
    out = [simulate_dp(trace, s.costs), simulate_elastic_dp(trace, s.costs)]
    for m in learners or s.learners:
        k = min(s.min_quorum, m)
        setup = _setup(s, equal_islands(m), k, s.grace_factor, s.step_spread)
        out.append(simulate_decoupled(trace, s.costs, setup, seed=s.seed, quorum=quorum))  # type: ignore[arg-type]
    return out


def rule_sizes(sizes: Sequence[int], learners: Sequence[int]) -> list[int]:
    """Every N and every N / M (rounded to a chip) of a grid, ascending."""
    return sorted({int(n) for n in sizes} | {max(1, round(n / m)) for n in sizes for m in learners})


def run_elastic_curve(s: Scenario, sizes: Sequence[int]) -> dict[int, SystemResult]:
    """Elastic DP alone at each size, each on its own trace (cheap: no learners)."""
    out = {}
    for n in sizes:
        out[n] = simulate_elastic_dp(failure_trace(n, s.horizon_s, s.costs, seed=s.seed), s.costs)
    return out


def run_grid(s: Scenario) -> GridResult:
    systems = ("DP", "elastic DP") + tuple(f"decoupled M={m}" for m in s.learners)
    grid = GridResult(
        sizes=tuple(s.sizes), systems=systems, learners=tuple(s.learners), costs=s.costs, horizon_s=s.horizon_s
    )
    for n in s.sizes:
        for r in run_fleet(s, n):
            grid.results[(n, r.system)] = r
    extra = [n for n in rule_sizes(s.sizes, s.learners) if n not in s.sizes]
    grid.elastic_curve = {n: grid.results[(n, "elastic DP")] for n in s.sizes} | run_elastic_curve(s, extra)
    grid.elastic_curve = dict(sorted(grid.elastic_curve.items()))
    if s.heterogeneous:
        grid.heterogeneous = run_heterogeneous(s)
    return grid


def run_heterogeneous(s: Scenario) -> list[SystemResult]:
    """Two halves, one ``hetero_slow_factor`` slower, with step noise: K = M, K = 1, K = 1 + grace."""
    m = s.hetero_m
    trace = failure_trace(s.hetero_chips, s.horizon_s, s.costs, seed=s.seed)
    islands = two_speed_islands(m, s.hetero_slow_factor)
    cases = [
        (f"K=M={m} (lock-step)", m, 0.0),
        ("K=1, no grace", 1, 0.0),
        (f"K=1 + grace (gamma={s.grace_factor:g})", 1, s.grace_factor),
    ]
    return [
        simulate_decoupled(trace, s.costs, _setup(s, islands, k, g, s.hetero_spread, label), seed=s.seed)
        for label, k, g in cases
    ]


def _n(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    return f"{n / 1e3:g}k" if n >= 1000 else str(n)


def format_grid(grid: GridResult) -> str:
    """Goodput (%) per fleet size and system, one row per size; then the rule of thumb."""
    head = ["chips"] + list(grid.systems)
    rows = [head]
    for n in grid.sizes:
        rows.append([_n(n)] + [f"{100 * grid.results[(n, sy)].goodput:.1f}" for sy in grid.systems])
    text = _table(rows, title="goodput (%) = useful chip-time / allocated chip-time")
    if grid.elastic_curve and grid.learners:
        text += "\n\n" + format_rule_of_thumb(grid)
    return text


def dp_renewal(costs: CostModel, chips: float) -> float:
    """DP's expected goodput, ``1 / (1 + λ R)`` (λ failures per second, R the mean outage)."""
    lam = chips * costs.failures_per_chip_year / SECONDS_PER_YEAR
    return 1.0 / (1.0 + lam * costs.dp_outage_s)


def format_rule_of_thumb(grid: GridResult) -> str:
    """Decoupled M at N next to elastic DP at N / M, and DP next to ``1 / (1 + λR)``."""
    head = ["chips"] + [f"M={m}: dec | el(N/M)" for m in grid.learners]
    if grid.costs is not None:
        head.append("DP | 1/(1+λR)")
    rows = [head]
    for n in grid.sizes:
        row = [_n(n)]
        for m in grid.learners:
            dec = grid.results[(n, f"decoupled M={m}")].goodput
            el = grid.elastic_curve[max(1, round(n / m))].goodput
            row.append(f"{100 * dec:.1f} | {100 * el:.1f}")
        if grid.costs is not None:
            row.append(f"{100 * grid.results[(n, 'DP')].goodput:.1f} | {100 * dp_renewal(grid.costs, n):.1f}")
        rows.append(row)
    text = _table(
        rows,
        title="rule of thumb: M learners on N chips vs elastic DP on N/M chips (goodput %); DP vs renewal formula",
    )
    if grid.costs is not None:
        c = grid.costs
        text += (
            f"\nmodel: DP outage R = E[recovery] + restart = {c.dp_outage_s:.1f} s; reconfiguration "
            f"{c.reconfig_s:.2f} s; re-admission window {c.readmit_window_s:.1f} s; recovery "
            f"{c.recovery.kind} (k={c.recovery.shape:g}, a={c.recovery.exponent:g}) mean {c.recovery.mean_s:.1f} s"
        )
    return text


def format_results(results: Sequence[SystemResult], title: str = "") -> str:
    rows = [["system", "goodput %", "uptime %", "rounds/h", "merged/round", "waiting %", "grace s"]]
    for r in results:
        d = r.details
        rows.append(
            [
                r.system,
                f"{100 * r.goodput:.1f}",
                f"{100 * r.uptime:.1f}",
                "-" if r.rounds_per_hour is None else f"{r.rounds_per_hour:.0f}",
                f"{d['merged_per_round']:.2f}" if "merged_per_round" in d else "-",
                f"{100 * d['blocked_frac']:.1f}" if "blocked_frac" in d else "-",
                f"{d['grace_s']:.1f}" if "grace_s" in d else "-",
            ]
        )
    return _table(rows, title=title)


def _table(rows: list[list[str]], title: str = "") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grid(grid: GridResult, path: Path) -> Path:
    """Goodput against fleet size (left) and against chips per learner (right, the rule of thumb)."""
    import numpy as np

    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {sy: f"C{i}" for i, sy in enumerate(grid.systems)}
    for sy in grid.systems:
        ax.plot(grid.sizes, [100 * grid.results[(n, sy)].goodput for n in grid.sizes], marker="o", label=sy, color=colors[sy])
    if grid.costs is not None:
        ns = np.geomspace(min(grid.sizes) / 2, max(grid.sizes) * 2, 100)
        ax.plot(ns, [100 * dp_renewal(grid.costs, x) for x in ns], ls=":", color=colors["DP"], label="DP: 1/(1+λR)")
    ax.scatter([1.2e6] * 3, [27, 58, 88], marker="x", color="k", s=60, zorder=5, label="paper (1.2M)")
    ax.set_xscale("log")
    ax.set_xlabel("fleet size N (chips)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Goodput vs fleet size (one failure per chip-year)")

    if grid.elastic_curve and grid.learners:
        xs = sorted(grid.elastic_curve)
        ax2.plot(
            xs,
            [100 * grid.elastic_curve[n].goodput for n in xs],
            color=colors["elastic DP"],
            marker=".",
            label="elastic DP on x chips",
        )
        for m in grid.learners:
            sy = f"decoupled M={m}"
            ax2.scatter(
                [n / m for n in grid.sizes],
                [100 * grid.results[(n, sy)].goodput for n in grid.sizes],
                color=colors[sy],
                marker="o",
                s=40,
                zorder=4,
                label=f"M={m} learners on {m}x chips",
            )
        ax2.set_xscale("log")
        ax2.set_xlabel("chips per learner x = N / M")
        ax2.set_ylabel("goodput (%)")
        ax2.set_ylim(min(40, ax2.get_ylim()[0]), 100)
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=8, loc="lower left")
        ax2.set_title("Rule of thumb: M learners on N chips ≈ elastic DP on N/M")
    else:
        ax2.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(results: Sequence[SystemResult], path: Path, title: str = "") -> Path:
    """Fraction of the fleet computing over time, one line per system."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ax.plot(r.timeline_t_s / 3600.0, 100 * r.timeline_active, label=r.system, lw=1)
    ax.set_xlabel("hours")
    ax.set_ylabel("fleet computing (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(grid: GridResult, out_dir: str | Path) -> list[Path]:
    """Write goodput.png, timeline.png (largest N) and heterogeneous.png; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_grid(grid, out / "goodput.png")]
    n = max(grid.sizes)
    paths.append(plot_timelines([grid.results[(n, sy)] for sy in grid.systems], out / "timeline.png", f"{_n(n)} chips"))
    if grid.heterogeneous:
        paths.append(plot_timelines(grid.heterogeneous, out / "heterogeneous.png", "two-speed fleet"))
    return paths
