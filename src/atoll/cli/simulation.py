"""``atoll simulate`` and ``atoll plan``: the fleet simulator and the bandwidth planner (no run, no
Prefect)."""

from __future__ import annotations

import argparse

from atoll.cli.flags import LibraryDefault


def add_simulate(sub: argparse._SubParsersAction) -> None:
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
    from atoll.sim.scenarios import format_grid, format_results, run_grid, write_report

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


def add_plan(sub: argparse._SubParsersAction) -> None:
    def default(name: str) -> LibraryDefault:
        return LibraryDefault("atoll.sim.planner:plan", name)

    precisions = ["fp32", "bf16", "int4"]
    p = sub.add_parser("plan", help="bandwidth planner: bytes per round and per second per learner vs DP")
    p.add_argument("--params", type=float, required=True, help="model size in parameters (e.g. 12e9)")
    p.add_argument("--fragments", "-P", type=int, default=default("num_fragments"), help="P (default %(default)s)")
    p.add_argument("--inner-steps", "-H", type=int, default=default("inner_steps"), help="H (default %(default)s)")
    p.add_argument("--tau", type=int, default=default("overlap_steps"), help="overlap steps (default %(default)s)")
    p.add_argument("--precision", choices=precisions, default=default("precision"),
                   help="delta precision (default %(default)s)")
    p.add_argument("--download-precision", choices=precisions, default=default("download_precision"),
                   help="merged fragment precision (default %(default)s: the master copy learners fetch)")
    p.add_argument("--step-s", type=float, required=True, help="inner-step time (s)")
    p.add_argument("--wan-gbps", type=float, required=True, help="WAN bandwidth per learner (Gbit/s)")
    p.add_argument("--learners", "-M", type=int, default=default("learners"),
                   help="M, for the DP all-reduce (default %(default)s)")
    p.add_argument("--dp-precision", choices=["fp32", "bf16"], default=default("dp_precision"),
                   help="DP gradient precision (default %(default)s)")
    p.add_argument("--grace-factor", type=float, default=default("grace_factor"), help="gamma (default %(default)s)")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="tokens a learner trains per inner step: adds bytes per token, records included, "
                        "and what its inner-state saves cost")
    recipe = lambda name: LibraryDefault("atoll.train.recipe:Recipe", name)  # noqa: E731
    p.add_argument("--save-share", type=float, default=recipe("save_uplink_share"),
                   help="with --tokens-per-step: saves' byte budget, a share of a learner's other uplink "
                        "(Recipe.save_uplink_share, default %(default)s)")
    p.add_argument("--save-every-s", type=float, default=recipe("save_every_s"),
                   help="with --tokens-per-step: seconds between saves at least (default %(default)s)")
    p.add_argument("--save-moments", choices=["fp32", "bf16"], default=recipe("save_moments_dtype"),
                   help="with --tokens-per-step: dtype of the saved AdamW moments (default %(default)s)")
    p.add_argument("--saves", action="store_true",
                   help="also print what saves cost per token at the demo and paper presets and at 86M and 1B "
                        "(the gpu preset), at the recipe's default cadence")
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
    if args.tokens_per_step:
        from atoll.core.config import DilocoConfig
        from atoll.sim.planner import plan_wire

        config = DilocoConfig(num_learners=args.learners, num_fragments=args.fragments, inner_steps=args.inner_steps,
                              overlap_steps=args.tau, compression=args.precision)
        print("\n".join(plan_wire(config, params=int(args.params), tokens_per_step=args.tokens_per_step,
                                  download_precision=args.download_precision, dp_precision=args.dp_precision,
                                  save_every_steps=None, save_uplink_share=args.save_share or None,
                                  save_every_s=args.save_every_s, step_s=args.step_s,
                                  save_moments=args.save_moments).lines()))
    if args.saves:
        from atoll.train.save_costs import save_cost_lines

        print("\ninner-state saves per token a learner trains, at the recipe's default cadence (bytes up; "
              "share: of its contributions' bytes; fixed: the cadence the presets had before):")
        print("\n".join(save_cost_lines()))
    return 0
