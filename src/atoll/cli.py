"""The ``atoll`` command.

Each subcommand is a small function that parses its flags and calls library code; the library
does the work so a notebook can do the same without the CLI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from atoll import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll",
        description="Decoupled DiLoCo across compute islands, on Prefect 3 and object storage.",
    )
    parser.add_argument("--version", action="version", version=f"atoll {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_simulate(sub)
    _add_plan(sub)
    return parser


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="fleet simulator: goodput of DP, elastic DP and Decoupled DiLoCo")
    p.add_argument("--preset", choices=["paper"], default="paper", help="base scenario (default: paper)")
    p.add_argument("--config", help="YAML fleet file (keys: chips, learners, hours, restart_s, ...)")
    p.add_argument("--chips", type=int, nargs="+", help="fleet size(s) N")
    p.add_argument("--learners", type=int, nargs="+", help="M values for Decoupled DiLoCo")
    p.add_argument("--hours", type=float, help="simulated hours per run (default 24)")
    p.add_argument("--step-s", type=float, help="inner-step time (s)")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--no-heterogeneous", action="store_true", help="skip the two-speed fleet table")
    p.add_argument("--out", default="out", help="folder for PNG plots (default: out/)")
    p.set_defaults(handler=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    import time

    from atoll.sim.presets import load_scenario, paper_scenario, scenario_from_mapping
    from atoll.sim.report import format_grid, format_results, run_grid, write_report

    t0 = time.perf_counter()
    scenario = paper_scenario()
    if args.config:
        scenario = load_scenario(args.config, scenario)
    flags = {
        "chips": args.chips,
        "learners": args.learners,
        "hours": args.hours,
        "step_s": args.step_s,
        "seed": args.seed,
        "heterogeneous": False if args.no_heterogeneous else None,
    }
    scenario = scenario_from_mapping({k: v for k, v in flags.items() if v is not None}, scenario)
    grid = run_grid(scenario)
    print(format_grid(grid))
    n = max(grid.sizes)
    print()
    print(format_results([grid.results[(n, s)] for s in grid.systems], f"details at N = {n:,} chips"))
    if grid.heterogeneous:
        print()
        print(
            format_results(
                grid.heterogeneous,
                f"two-speed fleet: N = {scenario.hetero_chips:,}, M = {scenario.hetero_m}, half "
                f"{100 * (scenario.hetero_slow_factor - 1):.0f}% slower, {100 * scenario.hetero_spread:.0f}% step noise",
            )
        )
    paths = write_report(grid, args.out)
    c = scenario.costs
    print()
    print(
        f"costs: restart {c.restart_s:.1f} s, reconfiguration {c.reconfig_s:.2f} s, recovery "
        f"{c.recovery.kind} mean {c.recovery.mean_s:.0f} s, slice {c.slice_chips} chips, "
        f"{c.failures_per_chip_year:g} failure/chip-year; {scenario.horizon_s / 3600:g} h simulated per run"
    )
    print(f"plots: {', '.join(str(p) for p in paths)}  ({time.perf_counter() - t0:.1f} s)")
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="bandwidth planner: bytes per round and per second per learner vs DP")
    p.add_argument("--params", type=float, required=True, help="model size in parameters (e.g. 12e9)")
    p.add_argument("--fragments", "-P", type=int, default=24, help="P (default 24)")
    p.add_argument("--inner-steps", "-H", type=int, default=24, help="H (default 24)")
    p.add_argument("--tau", type=int, default=2, help="overlap steps (default 2)")
    p.add_argument("--precision", choices=["fp32", "bf16", "int4"], default="bf16", help="delta precision")
    p.add_argument("--download-precision", choices=["fp32", "bf16", "int4"], help="merged fragment precision")
    p.add_argument("--step-s", type=float, required=True, help="inner-step time (s)")
    p.add_argument("--wan-gbps", type=float, required=True, help="WAN bandwidth per learner (Gbit/s)")
    p.add_argument("--learners", "-M", type=int, default=8, help="M, for the DP all-reduce (default 8)")
    p.add_argument("--dp-precision", choices=["fp32", "bf16"], default="bf16", help="DP gradient precision")
    p.add_argument("--grace-factor", type=float, default=0.5, help="gamma (default 0.5)")
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from atoll.sim.planner import plan

    result = plan(
        params=int(args.params),
        num_fragments=args.fragments,
        inner_steps=args.inner_steps,
        overlap_steps=args.tau,
        precision=args.precision,
        download_precision=args.download_precision,
        step_s=args.step_s,
        wan_gbps=args.wan_gbps,
        learners=args.learners,
        dp_precision=args.dp_precision,
        grace_factor=args.grace_factor,
    )
    print("\n".join(result.lines()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    return int(handler(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
