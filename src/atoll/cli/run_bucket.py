"""``atoll status``, ``atoll verify`` and ``atoll prune``: a run's report, its integrity check and
its retention, from its bucket alone (no Prefect)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from atoll.cli.flags import LibraryDefault, add_storage_option, bucket_options

if TYPE_CHECKING:
    from atoll.storage.reader import RunReader


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="round history of a run, from its bucket (no Prefect needed)")
    p.add_argument("run_url")
    p.add_argument("--last", type=int, default=20, help="show the last N rounds (0: all; default %(default)s)")
    p.add_argument("--plot", metavar="DIR", help="also write the run's plots as PNGs under DIR (loss, goodput and "
                                                 "merged-work share, contributors, bytes, learners)")
    p.add_argument("--tensorboard", metavar="DIR", help="also write the same figures as TensorBoard event files "
                                                        "under DIR, replacing the previous export (needs "
                                                        "pip install 'atoll[tensorboard]')")
    add_storage_option(p)
    p.set_defaults(handler=_status)


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="walk a run's commit chain and check every published object (reads only)")
    p.add_argument("run_url")
    add_storage_option(p)
    p.set_defaults(handler=_verify)


def add_prune(sub: argparse._SubParsersAction) -> None:
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
    add_storage_option(p)
    p.set_defaults(handler=_prune)


def open_existing(run_url: str, storage_options: dict[str, str] | None) -> RunReader:
    """The run at ``run_url``, opened read-only (no write, not even the create-once probe)."""
    from atoll.storage.reader import RunReader
    from atoll.storage.validation import RunNotFoundError

    store = RunReader.open(run_url, storage_options, read_only=True)
    if not store.exists():
        raise RunNotFoundError(f"no run at {run_url} (no run.json)")
    return store


def _status(args: argparse.Namespace) -> int:
    from atoll.runs.goodput import GoodputTracker
    from atoll.runs.report import run_status

    if args.last < 0:
        raise ValueError(f"--last must be >= 0, got {args.last}")
    store = open_existing(args.run_url, bucket_options(args))
    tracker = GoodputTracker(store)
    print("\n".join(run_status(store, last=args.last or None, tracker=tracker)))
    if args.plot:
        from atoll.runs.plots import write_plots

        written = write_plots(args.plot, tracker)
        print(f"plots: {', '.join(str(p) for p in written)}" if written else "plots: none (no round committed yet)")
    if args.tensorboard:
        from atoll.runs.tensorboard import write_tensorboard

        events = write_tensorboard(args.tensorboard, tracker)
        print(f"tensorboard: {events} (tensorboard --logdir {args.tensorboard})" if events
              else "tensorboard: nothing written (no round committed yet)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = open_existing(args.run_url, bucket_options(args))
    signed = store.signature_scheme()
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

    from atoll.storage.operator_side import OperatorStore
    from atoll.storage.retention import RetentionPolicy, apply_prune, plan_prune

    policy = RetentionPolicy(keep_rounds=args.keep_rounds, keep_checkpoints=args.keep_checkpoints,
                             min_age_s=args.min_age_s)
    options = bucket_options(args)
    open_existing(args.run_url, options)  # a clear error for a URL with no run, before any write
    store = OperatorStore.open(args.run_url, options, read_only=args.dry_run)
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
