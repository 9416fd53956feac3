"""Helpers for the real-stack tests (tests/integration/test_chaos.py): waiting, flow-run lookups
(by flow name and run tag, every page), finding processes by their marker, the stack's logs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atoll.ops import observe
from atoll.storage.codec import load_record
from atoll.storage.records import KIND_CONTRIBUTION
from atoll.tasks.queries import run_tag

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

POOLS = ("cpu-fast", "cpu-slow")
MARKER_VAR = "ATOLL_IT_MARKER"
"""The environment variable that marks a test stack's processes."""


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def flow_runs(client: Any, run_id: str, flow_name: str, *extra_tags: str) -> list[Any]:
    """Every flow run of ``flow_name`` of the run (all pages: a plain read stops at 200 rows)."""
    from atoll.tasks.queries import read_flow_runs_paged

    return read_flow_runs_paged(client, flow_names=[flow_name], tags=[run_tag(run_id), *extra_tags])


def processes_with(marker: str) -> list[int]:
    """Processes of the stack started with ``ATOLL_IT_MARKER=marker`` (atoll.ops.observe)."""
    return observe.processes_with(MARKER_VAR, marker)


def contribution_created_at(store: Any, key: str) -> float:
    data = store.store.get(key)
    return float(load_record(data, KIND_CONTRIBUTION)["created_at"])


def logs(tmp_path: Path) -> str:
    out = []
    for f in sorted((tmp_path / "logs").glob("*.log")):
        out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def tear_down(stack: Any, marker: str) -> dict[int, str]:
    """Cancel every flow run that is not final, stop the stack, then SIGKILL whatever still carries
    ``marker``. Returns what was left after ``stack.stop()`` (pid -> command line): a test asserts
    it is empty."""
    import signal

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    try:
        with stack.settings(), get_client(sync_client=True) as client:
            for fr in client.read_flow_runs():
                if fr.state is not None and not fr.state.is_final():
                    client.set_flow_run_state(fr.id, Cancelling(), force=True)
    except Exception:  # noqa: BLE001 - the server may be gone; the sweep below still runs
        pass
    stack.stop()
    left = {pid: cmdline(pid) for pid in processes_with(marker)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
