"""The ``atoll`` command: its parser and :func:`main`.

Each subcommand is a small function that parses its flags and calls library code; the library
does the work so a notebook can do the same without the CLI. The subcommands live beside this
module by job: :mod:`~atoll.cli.simulation` (simulate, plan), :mod:`~atoll.cli.stack` (up, deploy,
demo), :mod:`~atoll.cli.training` (train, resume), :mod:`~atoll.cli.run_bucket` (status, verify,
prune), :mod:`~atoll.cli.flow_runs` (learner, stop, supervise) and :mod:`~atoll.cli.keys` (keys); :mod:`~atoll.cli.flags`
generates flags from the typed options models.

Errors: atoll's own (a bad run folder, a missing run, bad input, a bad config or argument) print
one line, ``atoll: error: <what>``, and exit with status 2. A traceback means a bug in atoll; add
``--debug`` (or set ``ATOLL_DEBUG=1``) to see one for the errors above too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from atoll import __version__
from atoll.cli import flow_runs, keys, run_bucket, simulation, stack, training
from atoll.cli.flags import resolve_defaults as _resolve_defaults

__all__ = ["main", "build_parser", "error_line", "MAX_ERROR_CHARS"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll",
        description="Decoupled DiLoCo across compute islands, on Prefect 3 and object storage.",
    )
    parser.add_argument("--version", action="version", version=f"atoll {__version__}")
    parser.add_argument("--debug", action="store_true", help="tracebacks for every error (or ATOLL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Orchestration (Prefect) handlers call atoll.ops / atoll.flows / atoll.runs; `status` never imports Prefect.
    for add in (simulation.add_simulate, simulation.add_plan, stack.add_up, stack.add_deploy,
                training.add_train_and_resume, run_bucket.add_status, run_bucket.add_verify, run_bucket.add_prune,
                flow_runs.add_learner, flow_runs.add_stop, flow_runs.add_supervise, stack.add_demo, keys.add_keys):
        add(sub)
    return parser


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
