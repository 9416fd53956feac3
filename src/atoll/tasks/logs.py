"""The logger of whatever runs a task: Prefect's run logger inside a flow or task run, plain logging
outside (a task's ``.fn()`` called from a test or a notebook)."""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

__all__ = ["task_logger"]


def task_logger(fallback: str) -> Any:
    """Prefect's run logger, or ``logging.getLogger(fallback)`` outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)
