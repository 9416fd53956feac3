"""``atoll train`` and ``atoll resume``: start a run, or continue or fork one from its bucket, on
the training-run deployment (or here); every TrainingRunOptions field is a flag generated from the
model."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from atoll.cli.flags import (
    OptionFlag,
    add_option_flag,
    add_storage_option,
    bucket_options,
    option_flags,
    options_from_args,
)
from atoll.cli.run_bucket import open_existing

if TYPE_CHECKING:
    from atoll.runs.options import TrainingRunOptions


def add_train_and_resume(sub: argparse._SubParsersAction) -> None:
    """``atoll train`` / ``atoll resume``: which run (written here), then every other
    TrainingRunOptions field as a flag generated from the model (:func:`training_flags`)."""
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
    add_storage_option(p)
    p.add_argument("--in-process", action="store_true",
                   help="run the training-run flow here instead of on its deployment")
    p.add_argument("--no-wait", action="store_true", help="return once the run is launched")


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


def training_flags() -> list[OptionFlag]:
    """A flag per field of TrainingRunOptions (nested models' fields prefixed with the model's
    field, ``--fleet-threads``), except the which-run fields written by hand."""
    from atoll.runs.options import TrainingRunOptions

    hand_written = {f for flags in WHICH_RUN_FLAGS.values() for f in flags}
    return option_flags(TrainingRunOptions, skip=hand_written, names=_FLAG_NAMES)


def _add_option_flags(p: argparse.ArgumentParser, *, new_run: bool) -> None:
    """The generated flags, grouped: the new run's, the training run's, and one group per nested
    model (the learner fleet)."""
    from atoll.runs.options import TrainingRunOptions

    groups = {"run": p.add_argument_group("new run" if new_run else "the resumed or forked run")}
    for f in training_flags():
        if f.path[0] in NEW_RUN_FIELDS and not new_run and f.path[0] != "rounds":
            continue
        group_key = "run" if f.path[0] in NEW_RUN_FIELDS else f.path[0] if len(f.path) > 1 else ""
        if group_key not in groups:
            about = TrainingRunOptions.model_fields[group_key].description if group_key else None
            title = f"orchestration: {group_key}" if group_key else "orchestration"
            groups[group_key] = p.add_argument_group(title, about)
        add_option_flag(groups[group_key], f)


def training_options(args: argparse.Namespace, **which_run: Any) -> TrainingRunOptions:
    """The TrainingRunOptions the generated flags in ``args`` set, with ``which_run`` (run_url,
    resume_from, fork_round, storage_options) given by the caller."""
    from atoll.runs.options import TrainingRunOptions

    return options_from_args(TrainingRunOptions, training_flags(), args, **which_run)


def _train(args: argparse.Namespace) -> int:
    if args.command == "resume" and args.fork_round is not None and not args.to:
        raise ValueError("--fork-round forks the run into a new one: give its URL with --to")
    storage_options = bucket_options(args)
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

    source = open_existing(args.run_url, storage_options)
    check_run(source)
    marker = source.stop_marker()
    if marker is not None and marker.stopped and args.fork_round is None:
        from atoll.storage.synchronizer_side import SynchronizerStore

        SynchronizerStore.open(args.run_url, storage_options).clear_stopped()
        print(f"the run was stopped ({marker.reason}); cleared", flush=True)
