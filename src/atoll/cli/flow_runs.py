"""``atoll learner``, ``atoll stop`` and ``atoll supervise``: a run's flow runs by hand: a learner
joined from here, a stop (bucket marker, then cancels), the supervisor's loop in a terminal."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from atoll.cli.flags import (
    add_option_flag,
    add_storage_option,
    bucket_options,
    field_flag,
    option_flags,
    options_from_args,
)
from atoll.cli.run_bucket import open_existing


def add_learner(sub: argparse._SubParsersAction) -> None:
    from atoll.runs.options import FleetOptions

    p = sub.add_parser("learner", help="run one learner flow here, by hand (it joins the run from the bucket)")
    p.add_argument("run_url")
    p.add_argument("--learner-id", required=True)
    add_option_flag(p, field_flag(FleetOptions, "threads"))
    add_storage_option(p)
    p.add_argument("--device", default=None,
                   help="auto, cpu, cuda, cuda:N or mps (default: the recipe's LearnerSpec.device)")
    p.add_argument("--autocast", default=None, help="'' or bf16 (default: the recipe's LearnerSpec.autocast)")
    p.set_defaults(handler=_learner)


def add_stop(sub: argparse._SubParsersAction) -> None:
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
    add_storage_option(p)
    p.set_defaults(handler=_stop)


def add_supervise(sub: argparse._SubParsersAction) -> None:
    """Every SupervisorOptions field as a flag; in a terminal the supervisor watches until stopped
    (a scheduled flow run ends before the next one starts)."""
    from atoll.runs.supervision import SupervisorOptions

    p = sub.add_parser("supervise", help="run the supervisor here: relaunch crashed or zombie training runs")
    for f in option_flags(SupervisorOptions):
        if f.path == ("lifetime_s",):
            f = dataclasses.replace(f, default=math.inf)
        add_option_flag(p, f)
    p.set_defaults(handler=_supervise)


def _learner(args: argparse.Namespace) -> int:
    from atoll.flows.learner import learner_flow

    learner_flow(args.run_url, args.learner_id, storage_options=bucket_options(args),
                 threads=args.threads, device=args.device, autocast=args.autocast)
    return 0


def _stop(args: argparse.Namespace) -> int:
    import getpass
    import socket

    from atoll.storage.synchronizer_side import SynchronizerStore
    from atoll.tasks.stop import mark_stopped_and_wait

    storage_options = bucket_options(args)
    open_existing(args.run_url, storage_options)  # a one-line error if there is no run there
    store = SynchronizerStore.open(args.run_url, storage_options)
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
    from atoll.flows.supervisor import RunVerdict, supervise
    from atoll.runs.supervision import SupervisorOptions

    def show(v: RunVerdict) -> None:
        print(f"{v.run_id}: {v.action} ({v.flow_run}): {v.reason}", flush=True)

    def warn(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    supervise(options_from_args(SupervisorOptions, option_flags(SupervisorOptions), args), warn=warn, on_verdict=show)
    return 0
