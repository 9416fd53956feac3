"""The ``atoll`` command.

Each subcommand is a small function that parses its flags and calls library code; the library
does the work so a notebook can do the same without the CLI.

Errors: atoll's own (a bad run folder, a missing run, bad input, a bad config or argument) print
one line, ``atoll: error: <what>``, and exit with status 2. A traceback means a bug in atoll; add
``--debug`` (or set ``ATOLL_DEBUG=1``) to see one for the errors above too.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from atoll import __version__

if TYPE_CHECKING:
    from atoll.runs.options import TrainingRunOptions
    from atoll.storage.bucket import RunStore


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll",
        description="Decoupled DiLoCo across compute islands, on Prefect 3 and object storage.",
    )
    parser.add_argument("--version", action="version", version=f"atoll {__version__}")
    parser.add_argument("--debug", action="store_true", help="tracebacks for every error (or ATOLL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_simulate(sub)
    _add_plan(sub)
    _add_orchestration(sub)
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


def _add_plan(sub: argparse._SubParsersAction) -> None:
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
                   help="tokens a learner trains per inner step: adds bytes per token, records included")
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
                                  download_precision=args.download_precision,
                                  dp_precision=args.dp_precision).lines()))
    return 0


# -- orchestration (Prefect): up, deploy, train, resume, status, stop, supervise, learner, demo ----------------------
# Each handler parses flags and calls atoll.ops / atoll.flows / atoll.runs; `status` never imports Prefect.


def _add_orchestration(sub: argparse._SubParsersAction) -> None:
    for add in (_add_up, _add_deploy, _add_train_and_resume, _add_status, _add_verify, _add_prune, _add_learner,
                _add_stop, _add_supervise, _add_demo):
        add(sub)


def _add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option of the bucket, repeatable")


def _add_up(sub: argparse._SubParsersAction) -> None:
    from atoll.ops.defaults import DEFAULT_POOLS, DEFAULT_PORT

    p = sub.add_parser("up", help="start the local stack: Prefect server (SQLite or PostgreSQL) + a process "
                       "worker per pool")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port (default %(default)s, or a free one)")
    p.add_argument("--pools", nargs="+", default=list(DEFAULT_POOLS), help="local process pools (default: %(default)s)")
    p.add_argument("--home", default=None, help="PREFECT_HOME for the stack (default: your Prefect home)")
    p.add_argument("--no-deploy", action="store_true", help="do not register atoll's deployments")
    p.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite",
                   help="the server's database: SQLite in its home, or a private PostgreSQL cluster started "
                   "under <home>/postgres and stopped with the stack (needs the server binaries: "
                   "apt-get install postgresql, or ATOLL_POSTGRES_BIN)")
    p.add_argument("--database-url", default=None, metavar="URL",
                   help="run the server on a database you run yourself: postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB")
    p.set_defaults(handler=_up)


def _add_deploy(sub: argparse._SubParsersAction) -> None:
    from atoll.ops.defaults import DEFAULT_POOLS

    p = sub.add_parser("deploy", help="register the training-run deployment and one learner deployment per pool")
    p.add_argument("--pools", nargs="+", default=list(DEFAULT_POOLS), help="learner pools (default: %(default)s)")
    p.add_argument("--control-pool", default=None, help="pool of the training run (default: the first pool)")
    p.add_argument("--create-pools", action="store_true", help="create missing pools as process pools")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="env for every job (not credentials: see --secret-block)")
    p.add_argument("--image", default=None,
                   help="image for the learner deployments (and the training run, if its pool takes an image)")
    p.add_argument("--job-variable", action="append", default=[], metavar="KEY=VALUE",
                   help="job variable of every learner deployment, repeatable; JSON values are parsed "
                        "(gpu_count=2, node_selector='{\"k\": \"v\"}'); env.NAME=VALUE adds one env var")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="learner slots per pool (e.g. GPUs / gpu_count): sets each learner pool's concurrency limit")
    p.add_argument("--secret-block", default=None, metavar="NAME",
                   help="Prefect Secret block with the bucket credentials (a JSON object of env vars); "
                        "jobs get only its name, as ATOLL_SECRET_BLOCK")
    p.add_argument("--insecure-env", action="store_true",
                   help="allow credential-looking --env/--job-variable values (local test servers only)")
    p.set_defaults(handler=_deploy)


def _add_train_and_resume(sub: argparse._SubParsersAction) -> None:
    """``atoll train`` / ``atoll resume``: which run (written here), then every other
    TrainingRunOptions field as a flag generated from the model (:func:`option_flags`)."""
    p = sub.add_parser("train", help="start a training run from a preset or config file")
    p.add_argument("--bucket", default="runs", help="folder or fsspec URL holding runs (default ./runs)")
    p.add_argument("--name", default=None, help="run name (default run-<hex>)")
    _add_launch_flags(p)
    _add_option_flags(p, new_run=True)
    p.set_defaults(handler=_train)

    p = sub.add_parser("resume", help="continue a run from its bucket (or fork it from a round)")
    p.add_argument("run_url", help="the run to resume")
    p.add_argument("--fork-round", type=int, default=None, help="fork a new run from this round (0 = latest)")
    p.add_argument("--to", default=None, help="URL of the forked run")
    _add_launch_flags(p)
    _add_option_flags(p, new_run=False)
    p.set_defaults(handler=_train)


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    _add_storage_option(p)
    p.add_argument("--in-process", action="store_true",
                   help="run the training-run flow here instead of on its deployment")
    p.add_argument("--no-wait", action="store_true", help="return once the run is launched")


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="round history of a run, from its bucket (no Prefect needed)")
    p.add_argument("run_url")
    p.add_argument("--last", type=int, default=20, help="show the last N rounds (0: all; default %(default)s)")
    p.add_argument("--plot", metavar="DIR", help="also write the run's plots as PNGs under DIR (loss, goodput and "
                                                 "merged-work share, contributors, bytes, learners)")
    _add_storage_option(p)
    p.set_defaults(handler=_status)


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="walk a run's commit chain and check every published object (reads only)")
    p.add_argument("run_url")
    _add_storage_option(p)
    p.set_defaults(handler=_verify)


def _add_prune(sub: argparse._SubParsersAction) -> None:
    policy = "atoll.storage.retention:RetentionPolicy"
    p = sub.add_parser("prune", help="retention: delete old global state, contributions no round can use, replaced "
                                     "learner states (and old checkpoints if asked); safe while the run trains")
    p.add_argument("run_url")
    p.add_argument("--keep-rounds", type=int, default=LibraryDefault(policy, "keep_rounds"),
                   help="rounds at the head whose global state stays readable (default %(default)s; at least 2 x P)")
    p.add_argument("--keep-checkpoints", type=int, default=LibraryDefault(policy, "keep_checkpoints"),
                   help="newest complete checkpoints to keep (default: keep every checkpoint)")
    p.add_argument("--min-age-s", type=float, default=LibraryDefault(policy, "min_age_s"),
                   help="delete an unreferenced object only once it is this old (default %(default)s; at least 60)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    _add_storage_option(p)
    p.set_defaults(handler=_prune)


def _add_learner(sub: argparse._SubParsersAction) -> None:
    from atoll.runs.options import FleetOptions, default_of

    p = sub.add_parser("learner", help="run one learner flow here, by hand (it joins the run from the bucket)")
    p.add_argument("run_url")
    p.add_argument("--learner-id", required=True)
    p.add_argument("--threads", type=int, default=default_of(FleetOptions, "threads"),
                   help="torch threads of the learner process (default %(default)s)")
    _add_storage_option(p)
    p.add_argument("--device", default=None,
                   help="auto, cpu, cuda, cuda:N or mps (default: the recipe's LearnerSpec.device)")
    p.add_argument("--autocast", default=None, help="'' or bf16 (default: the recipe's LearnerSpec.autocast)")
    p.set_defaults(handler=_learner)


def _add_stop(sub: argparse._SubParsersAction) -> None:
    from atoll.runs.healing import STOP_GRACE_S

    p = sub.add_parser("stop", help="stop a run: mark it stopped in its bucket, let learners save and exit, "
                                    "cancel its flow runs")
    p.add_argument("run_url")
    p.add_argument("--reason", default="atoll stop", help="recorded in the bucket's stop marker")
    p.add_argument("--grace-s", type=float, default=STOP_GRACE_S,
                   help="wait this long for learners to save and exit before cancelling flow runs "
                        "(default %(default)s)")
    p.add_argument("--no-prefect", action="store_true", help="only mark the bucket (learners and the training run "
                   "read it and exit by themselves); no Prefect API calls")
    _add_storage_option(p)
    p.set_defaults(handler=_stop)


def _add_supervise(sub: argparse._SubParsersAction) -> None:
    from atoll.runs.supervision import SupervisionPolicy, SupervisorOptions

    loop, policy = SupervisorOptions(), SupervisionPolicy()
    p = sub.add_parser("supervise", help="run the supervisor here: relaunch crashed or zombie training runs")
    p.add_argument("--check-every-s", type=float, default=loop.check_every_s,
                   help="time between two passes (default %(default)s)")
    p.add_argument("--lifetime-s", type=float, default=float("inf"), help="stop after this long (default: never)")
    p.add_argument("--window-s", type=float, default=loop.window_s,
                   help="look at runs with a training-run flow run this recent (default %(default)s)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=policy.heartbeat_timeout_s,
                   help="a synchronizer with an older heartbeat is not alive (default %(default)s)")
    p.add_argument("--startup-grace-s", type=float, default=policy.startup_grace_s,
                   help="a Running training run with no lease after this long is a zombie (default %(default)s)")
    p.add_argument("--relaunch-backoff-s", type=float, default=policy.relaunch_backoff_s,
                   help="least time between a training run's creation and a relaunch (default %(default)s)")
    p.add_argument("--max-relaunches", type=int, default=policy.max_relaunches,
                   help=f"most relaunches of one run within {policy.window_s:g} s (default %(default)s)")
    p.add_argument("--stop-grace-s", type=float, default=loop.stop_grace_s,
                   help="a stop requested in the UI: time for learners to save and exit (default %(default)s)")
    p.set_defaults(handler=_supervise)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from atoll.ops.defaults import DEFAULT_PORT, DEMO_DIR
    from atoll.runs.options import TrainingRunOptions, default_of

    p = sub.add_parser("demo", help="what `make demo` runs: local stack, deploy, train the demo preset")
    p.add_argument("--dir", default=DEMO_DIR, help="where the bucket, Prefect home and logs go (default %(default)s)")
    p.add_argument("--learners", type=int, default=default_of(TrainingRunOptions, "learners"),
                   help="learners (default: the preset's)")
    p.add_argument("--rounds", type=int, default=default_of(TrainingRunOptions, "rounds"),
                   help="outer rounds (default: the preset's)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="server port (default %(default)s, or a free one)")
    p.add_argument("--keep-up", action="store_true", help="keep the stack up after training until Ctrl-C")
    p.set_defaults(handler=_demo)


# -- flags generated from TrainingRunOptions ---------------------------------------------------------------------

NEW_RUN_FIELDS = ("preset", "learners", "rounds", "config_path")
"""TrainingRunOptions fields that describe a new run: flags of `atoll train` (``rounds``: of `resume` too)."""

WHICH_RUN_FLAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "train": {"run_url": ("--bucket", "--name"), "storage_options": ("--storage-option",)},
    "resume": {"resume_from": ("run_url",), "fork_round": ("--fork-round",), "run_url": ("--to",),
               "storage_options": ("--storage-option",)},
}
"""The TrainingRunOptions fields whose flags are written by hand: which run, and its bucket's options."""

_FLAG_NAMES = {"config_path": "--config"}


@dataclass(frozen=True)
class OptionFlag:
    """One flag of `atoll train`/`atoll resume` generated from a TrainingRunOptions field."""

    path: tuple[str, ...]
    """The field: ``("segment_rounds",)``, ``("fleet", "threads")``."""
    flag: str
    dest: str
    default: Any
    """The field's default, which is the flag's."""
    annotation: Any
    description: str

    @property
    def kind(self) -> str:
        """``bool`` (--x/--no-x), ``mapping`` (repeatable KEY=VALUE) or ``scalar``."""
        if self.annotation is bool:
            return "bool"
        return "mapping" if typing.get_origin(self.annotation) is dict else "scalar"

    def scalar_type(self) -> Any:
        """The flag's argparse type: ``int | None`` parses as an int."""
        args = [a for a in typing.get_args(self.annotation) if a is not type(None)]
        return args[0] if typing.get_origin(self.annotation) in (Union, types.UnionType) else self.annotation

    def value(self, raw: Any) -> Any:
        """The field's value from what argparse parsed."""
        return _kv(raw, self.flag) if self.kind == "mapping" else raw


def option_flags(model: Any = None, prefix: tuple[str, ...] = ()) -> list[OptionFlag]:
    """A flag per field of TrainingRunOptions (nested models' fields prefixed with the model's
    field, ``--fleet-threads``), except the which-run fields written by hand."""
    from pydantic import BaseModel

    from atoll.runs.options import TrainingRunOptions, default_of

    model = model or TrainingRunOptions
    hand_written = {f for flags in WHICH_RUN_FLAGS.values() for f in flags}
    out: list[OptionFlag] = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        if not prefix and name in hand_written:
            continue
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out += option_flags(info.annotation, path)
            continue
        flag = _FLAG_NAMES.get(".".join(path)) or "--" + "-".join(path).replace("_", "-")
        out.append(OptionFlag(path=path, flag=flag, dest="__".join(path), default=default_of(model, name),
                              annotation=info.annotation, description=info.description or ""))
    return out


def _add_option_flags(p: argparse.ArgumentParser, *, new_run: bool) -> None:
    """The generated flags, grouped: the new run's, the training run's, and one group per nested
    model (the learner fleet)."""
    from atoll.runs.options import TrainingRunOptions

    groups = {"run": p.add_argument_group("new run" if new_run else "the resumed or forked run")}
    for f in option_flags():
        if f.path[0] in NEW_RUN_FIELDS and not new_run and f.path[0] != "rounds":
            continue
        group_key = "run" if f.path[0] in NEW_RUN_FIELDS else f.path[0] if len(f.path) > 1 else ""
        if group_key not in groups:
            about = TrainingRunOptions.model_fields[group_key].description if group_key else None
            title = f"orchestration: {group_key}" if group_key else "orchestration"
            groups[group_key] = p.add_argument_group(title, about)
        _add_option_flag(groups[group_key], f)


def _add_option_flag(group: Any, f: OptionFlag) -> None:
    text = f.description.replace("%", "%%")
    if f.kind == "bool":
        group.add_argument(f.flag, dest=f.dest, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f"{text} (default: {'on' if f.default else 'off'})")
    elif f.kind == "mapping":
        group.add_argument(f.flag, dest=f.dest, action="append", default=[f"{k}={v}" for k, v in f.default.items()],
                           metavar="KEY=VALUE", help=text + " Repeatable KEY=VALUE.")
    else:
        kind = f.scalar_type()
        metavar = "N" if kind is int else "S" if f.path[-1].endswith("_s") else f.path[-1].upper()
        shown = "" if f.default is None else " (default: %(default)s)"
        group.add_argument(f.flag, dest=f.dest, type=kind, default=f.default, metavar=metavar, help=text + shown)


def training_options(args: argparse.Namespace, **which_run: Any) -> TrainingRunOptions:
    """The TrainingRunOptions the generated flags in ``args`` set, with ``which_run`` (run_url,
    resume_from, fork_round, storage_options) given by the caller."""
    from atoll.runs.options import TrainingRunOptions

    fields: dict[str, Any] = dict(which_run)
    given = vars(args)
    for f in option_flags():
        if f.dest in given:
            *parents, name = f.path
            target = fields
            for parent in parents:
                target = target.setdefault(parent, {})
            target[name] = f.value(given[f.dest])
    return TrainingRunOptions(**fields)


def _kv(pairs: Sequence[str], flag: str = "--storage-option/--env") -> dict[str, str]:
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _up(args: argparse.Namespace) -> int:
    from atoll.ops.stack import run_stack_forever

    return run_stack_forever(port=args.port, pools=args.pools, home=args.home, deploy=not args.no_deploy,
                             database=args.database, database_url=args.database_url)


def _deploy(args: argparse.Namespace) -> int:
    from atoll.ops.deploy import deploy_all, ensure_pools

    if args.create_pools:
        ensure_pools(args.pools)
    if args.image or args.job_variable or args.concurrency is not None or args.secret_block:
        return _deploy_images(args)
    for name, dep_id in deploy_all(args.pools, control_pool=args.control_pool, env=_kv(args.env)).items():
        print(f"deployed {name} ({dep_id})")
    return 0


def _deploy_images(args: argparse.Namespace) -> int:
    """`atoll deploy --image IMG --job-variable k=v ... --concurrency N --secret-block NAME`."""
    from atoll.flows.credentials import SECRET_BLOCK_ENV
    from atoll.ops.deploy import (
        deploy_all,
        parse_job_variables,
        plaintext_credentials,
        pool_variables,
        set_pool_concurrency,
    )

    env = _kv(args.env)
    jv = parse_job_variables(args.job_variable)
    if args.image:
        jv["image"] = args.image
    leaked = plaintext_credentials({**jv, "env": {**env, **jv.get("env", {})}})
    if leaked and not args.insecure_env:
        print(f"refusing to put {', '.join(leaked)} in job variables (stored and shown in plaintext): put bucket "
              "credentials in a Prefect Secret block (--secret-block NAME) or the pool's secret "
              "(kubernetes: the credentials_secret variable); --insecure-env overrides for local test servers",
              file=sys.stderr)
        return 2
    if args.secret_block:
        env[SECRET_BLOCK_ENV] = args.secret_block
    control = args.control_pool or args.pools[0]
    declared = pool_variables(sorted({*args.pools, control}))
    for pool in args.pools:
        unknown = sorted(set(jv) - declared[pool] - {"env"})
        if unknown:
            print(f"note: pool {pool}'s job template does not declare {', '.join(unknown)} (ignored by its worker)")
    control_jv = {"image": args.image} if args.image and "image" in declared[control] else None
    deployed = deploy_all(args.pools, control_pool=control, env=env,
                          pool_job_variables={pool: jv for pool in args.pools}, control_job_variables=control_jv)
    for name, dep_id in deployed.items():
        print(f"deployed {name} ({dep_id})")
    if args.concurrency is not None:
        learner_pools = [p for p in args.pools if p != control]
        limits = set_pool_concurrency(learner_pools, args.concurrency)
        if control in args.pools:  # the training run and the supervisor each hold a slot of their pool
            limits.update(set_pool_concurrency([control], args.concurrency + 2))
            print(f"note: the training run and the supervisor share pool {control} with learners: its limit is "
                  f"{args.concurrency} + 2; a separate CPU control pool (--control-pool) keeps every slot for learners")
        for pool, limit in limits.items():
            print(f"work pool {pool}: concurrency limit {limit}")
    return 0


def _train(args: argparse.Namespace) -> int:
    if args.command == "resume" and args.fork_round is not None and not args.to:
        raise ValueError("--fork-round forks the run into a new one: give its URL with --to")
    storage_options = _kv(args.storage_option) or None
    if args.command == "train":
        from atoll.runs.manage import new_run_url

        which: dict[str, Any] = {"run_url": new_run_url(args.bucket, args.name)}
    else:
        _check_resumable(args, storage_options)
        which = {"resume_from": args.run_url, "fork_round": args.fork_round, "run_url": args.to}
    options = training_options(args, storage_options=storage_options, **which)

    from atoll.ops.client import launch_training

    return launch_training(options, in_process=args.in_process, wait=not args.no_wait)


def _check_resumable(args: argparse.Namespace, storage_options: dict[str, str] | None) -> None:
    """Read the source run (only read) before anything starts: a missing or broken run is a
    one-line error here, not a failed flow run later. A stopped run that is continued (not forked)
    has its stop cleared."""
    from atoll.runs.report import check_run

    source = _open_existing(args.run_url, storage_options)
    check_run(source)
    marker = source.stop_marker()
    if marker is not None and marker.stopped and args.fork_round is None:
        from atoll.storage.bucket import RunStore

        RunStore.open(args.run_url, storage_options).clear_stopped()
        print(f"the run was stopped ({marker.reason}); cleared", flush=True)


def _open_existing(run_url: str, storage_options: dict[str, str] | None) -> RunStore:
    """The run at ``run_url``, opened read-only (no write, not even the create-once probe)."""
    from atoll.storage.bucket import RunStore
    from atoll.storage.validation import RunNotFoundError

    store = RunStore.open(run_url, storage_options, read_only=True)
    if not store.exists():
        raise RunNotFoundError(f"no run at {run_url} (no run.json)")
    return store


def _verify(args: argparse.Namespace) -> int:
    store = _open_existing(args.run_url, _kv(args.storage_option) or None)
    signed = "with the synchronizer's key" if store.keyring.key("synchronizer") else "digests and links only"
    print(f"verifying {store.url} ({signed}) ...", flush=True)

    def progress(r: int) -> None:
        if r % 1000 == 0:
            print(f"  round {r} verified", flush=True)

    report = store.verify(on_round=progress)
    for line in report.problems:
        print(f"  PROBLEM {line}")
    if report.prune is not None:
        print(f"  {report.pruned} state object(s) of rounds up to {report.prune.through_round} not checked: deleted "
              f"on purpose by retention ({report.prune.by})")
    print(f"{report.verified} of {report.latest} round(s) verified; {report.slots} commit slot(s) listed; void "
          f"slots: {report.void or 'none'}; gaps: {report.gaps or 'none'}; "
          + ("OK" if report.ok else f"{len(report.problems)} problem(s)"))
    return 0 if report.ok else 1


def _prune(args: argparse.Namespace) -> int:
    import getpass
    import socket

    from atoll.storage.bucket import RunStore
    from atoll.storage.retention import RetentionPolicy, apply_prune, plan_prune

    policy = RetentionPolicy(keep_rounds=args.keep_rounds, keep_checkpoints=args.keep_checkpoints,
                             min_age_s=args.min_age_s)
    options = _kv(args.storage_option) or None
    _open_existing(args.run_url, options)  # a clear error for a URL with no run, before any write
    store = RunStore.open(args.run_url, options, read_only=args.dry_run)
    policy.check(store.plan.num_fragments)

    def log(line: str) -> None:
        print(line, flush=True)

    print(f"planning retention for {store.url} (keep {policy.keep_rounds} rounds, "
          f"{'every' if policy.keep_checkpoints is None else policy.keep_checkpoints} checkpoint(s), "
          f"unreferenced objects older than {policy.min_age_s:.0f} s) ...", flush=True)
    plan = plan_prune(store, policy, log=log)
    print("\n".join(plan.table()))
    if plan.young:
        print(f"{plan.young} unreferenced object(s) younger than {policy.min_age_s:.0f} s kept (a writer may be "
              f"between a payload and its record)")
    if plan.through_round:
        print(f"rounds 1..{plan.through_round} keep their commit records (the chain verifies) but their global state "
              f"can no longer be read back; rounds {plan.through_round + 1}..{plan.latest} can")
    if args.dry_run:
        print("dry run: nothing deleted")
        return 0
    if not plan.deletes:
        print("nothing to delete")
        return 0
    by = f"atoll prune by {getpass.getuser()}@{socket.gethostname()}"
    record = apply_prune(store, plan, by=by, log=log)
    print(f"deleted {len(plan.deletes)} object(s); this run's retention so far: {record.deleted_objects} "
          f"object(s), {record.deleted_bytes / 2**20:.1f} MiB (sync/prune.json)")
    return 0


def _status(args: argparse.Namespace) -> int:
    from atoll.runs.report import GoodputTracker, run_status

    if args.last < 0:
        raise ValueError(f"--last must be >= 0, got {args.last}")
    store = _open_existing(args.run_url, _kv(args.storage_option) or None)
    tracker = GoodputTracker(store)
    print("\n".join(run_status(store, last=args.last or None, tracker=tracker)))
    if args.plot:
        from atoll.runs.plots import write_plots

        written = write_plots(args.plot, tracker)
        print(f"plots: {', '.join(str(p) for p in written)}" if written else "plots: none (no round committed yet)")
    return 0


def _learner(args: argparse.Namespace) -> int:
    from atoll.flows.learner import learner_flow

    learner_flow(args.run_url, args.learner_id, storage_options=_kv(args.storage_option) or None,
                 threads=args.threads, device=args.device, autocast=args.autocast)
    return 0


def _stop(args: argparse.Namespace) -> int:
    import getpass
    import socket

    from atoll.storage.bucket import RunStore
    from atoll.tasks.stop import mark_stopped_and_wait

    storage_options = _kv(args.storage_option) or None
    _open_existing(args.run_url, storage_options)  # a one-line error if there is no run there
    store = RunStore.open(args.run_url, storage_options)
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    print(f"marking {store.url} stopped ({args.reason}); learners save and exit within seconds", flush=True)
    report = mark_stopped_and_wait(store, reason=args.reason, by=by, grace_s=args.grace_s)
    for lid, why in sorted(report.exited.items()):
        print(f"  {lid}: exited ({why})")
    for lid in report.still_alive:
        print(f"  {lid}: still alive after {args.grace_s:g}s")
    if args.no_prefect:
        return 0
    from prefect.client.orchestration import get_client

    from atoll.tasks.queries import run_tag
    from atoll.tasks.stop import cancel_flow_runs_of_run

    try:
        with get_client(sync_client=True) as client:
            cancelled = cancel_flow_runs_of_run(client, run_tag(store.manifest.run_id), reason=f"run stopped: {args.reason}")
    except Exception as e:  # noqa: BLE001 - the bucket marker already stops everything that reads it
        print(f"the run is stopped in its bucket, but its flow runs could not be cancelled through Prefect ({e!r}); "
              "they exit by themselves when they next read the bucket")
        return 1
    print(f"cancelled {len(cancelled)} flow run(s)" + (": " + ", ".join(cancelled) if cancelled else ""))
    print(f"`atoll resume {args.run_url}` continues it from its last committed round")
    return 0


def _supervise(args: argparse.Namespace) -> int:
    import time

    from prefect.client.orchestration import get_client

    from atoll.flows.supervisor import supervise_once
    from atoll.runs.supervision import SupervisionPolicy

    policy = SupervisionPolicy(heartbeat_timeout_s=args.heartbeat_timeout_s, startup_grace_s=args.startup_grace_s,
                               relaunch_backoff_s=args.relaunch_backoff_s, max_relaunches=args.max_relaunches)
    deadline = time.monotonic() + args.lifetime_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            for v in supervise_once(client, policy, window_s=args.window_s, stop_grace_s=args.stop_grace_s):
                print(f"{v.run_id}: {v.action} ({v.flow_run}): {v.reason}", flush=True)
            time.sleep(args.check_every_s)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from atoll.ops.client import run_demo

    return run_demo(args.dir, learners=args.learners, rounds=args.rounds, port=args.port, keep_up=args.keep_up)


class LibraryDefault:
    """A flag's default that lives in the library code owning the knob (a dataclass field or a
    function's parameter), read when it is first needed: a run of the command (:func:`main`
    resolves it) or its ``--help``. Importing that code imports torch, which `atoll --help` should not."""

    def __init__(self, owner: str, name: str) -> None:
        self.owner = owner
        """``module:Name`` of a dataclass or a function."""
        self.name = name

    def value(self) -> Any:
        module, _, attr = self.owner.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        if dataclasses.is_dataclass(obj):
            return next(f.default for f in dataclasses.fields(obj) if f.name == self.name)
        return inspect.signature(obj).parameters[self.name].default

    def __str__(self) -> str:  # argparse's %(default)s in --help
        return str(self.value())


def _resolve_defaults(args: argparse.Namespace) -> None:
    for key, value in vars(args).items():
        if isinstance(value, LibraryDefault):
            setattr(args, key, value.value())


MAX_ERROR_CHARS = 500
"""An error line is cut here (a hostile object's name or id could be megabytes long)."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """What atoll raises on purpose for bad runs, input, config or arguments (no traceback)."""
    from atoll.core.config import ConfigError
    from atoll.ops.postgres import PostgresError
    from atoll.storage.validation import InvalidInput, StorageError

    # OSError: a missing file, no permission, a broken mount: the machine's state, not a bug.
    # PostgresError: `atoll up --database postgres` without server binaries, or a cluster that won't start.
    return (StorageError, InvalidInput, ConfigError, ValueError, OSError, PostgresError)


def error_line(exc: BaseException) -> str:
    """``exc`` as one printable line of at most MAX_ERROR_CHARS characters."""
    from atoll.storage.validation import StorageError

    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, StorageError):  # "[Errno 13] ..." says too little
        text = f"{type(exc).__name__}: {text}"
    text = " ".join(text.split())
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_defaults(args)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    debug = args.debug or os.environ.get("ATOLL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    from atoll.ops.signals import exit_status, stop_on_signals

    try:
        # SIGTERM (and SIGHUP) unwind like Ctrl-C: every command stops its children on the way out.
        with stop_on_signals():
            return int(handler(args) or 0)
    except KeyboardInterrupt as e:
        print(f"atoll: interrupted ({e})" if str(e) else "atoll: interrupted", file=sys.stderr)
        return exit_status(e)
    except _user_errors() as e:
        if debug:
            raise
        print(f"atoll: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
