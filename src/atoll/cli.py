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
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


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
