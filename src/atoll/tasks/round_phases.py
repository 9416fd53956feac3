"""A recorded round's phases as task runs of its flow run, and its log lines, at their real times.

A round that ran inline (recorded rounds, docs/prefect.md) still shows in the UI what it did: a
task run per phase (await-quorum, grace, merge, evaluate, commit) with the start and end the
synchronizer noted, and log lines timed when they happened (each phase's duration, what was
merged, what was not and why, the commit).
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any
from uuid import UUID

from atoll.runs.contributions import ContributionRow
from atoll.runs.names import plural
from atoll.tasks.prefect_private import emit_task_run_completed

__all__ = ["Phase", "emit_phase_task_runs", "round_log_lines"]

Phase = tuple[str, float, float]
"""A round's phase: (task name, start, end), seconds since the epoch."""


def _utc(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)


def emit_phase_task_runs(flow_run_id: UUID, round_: int, phases: Iterable[Phase]) -> dict[str, UUID]:
    """A task run per phase of a recorded round, with its real start and end, as Prefect's own
    task engine records them (:func:`~atoll.tasks.prefect_private.emit_task_run_completed`: one
    event each, no HTTP call), named ``<phase>-<round>``. Returns phase name -> task run id."""
    ids: dict[str, UUID] = {}
    for name, t0, t1 in phases:
        tid = uuid.uuid4()
        ids[name] = tid
        emit_task_run_completed(flow_run_id, tid, name=f"{name}-{round_}", task_key=f"atoll-round-{name}",
                                dynamic_key=str(round_), start_s=t0, end_s=max(t0, t1))
    return ids


def round_log_lines(flow_run_id: UUID, record: Any, rows: list[ContributionRow], phases: Iterable[Phase],
                    tasks: dict[str, UUID]) -> list[dict[str, Any]]:
    """The round's log lines, timed when they happened: each phase's, what was merged (learner,
    pool, tokens, steps, weight) and what was not and why. For ``POST /logs/`` (one call a batch)."""
    phases = list(phases)
    end = {name: t1 for name, _, t1 in phases}
    last = max(end.values(), default=time.time())

    def line(message: str, at: float, task: str | None = None, level: int = logging.INFO) -> dict[str, Any]:
        return {"name": "atoll.round", "level": level, "message": message, "timestamp": _utc(at).isoformat(),
                "flow_run_id": str(flow_run_id), "task_run_id": str(tasks[task]) if task in tasks else None}

    s = record.stats
    out = [line(f"{name}: {t1 - t0:.3f} s", t1, name) for name, t0, t1 in phases]
    when = end.get("merge", last)
    for r in rows:
        if r.status == "accepted":
            out.append(line(f"merged {r.learner} ({r.pool or '?'}): {r.tokens:,} tokens, {r.steps} steps, "
                            f"weight {r.weight:.3f}", when, "merge"))
        else:
            out.append(line(f"not merged: {r.learner} ({r.pool or '?'}): {r.status}", when, "merge",
                            logging.WARNING))
    loss = s.get("val_loss")
    out.append(line(f"round {record.round} (fragment {record.fragment}) committed: "
                    f"{plural(len(record.accepted), 'learner')} merged, {len(record.rejected)} not; closed because "
                    f"{s.get('reason', '-')}" + (f"; validation loss {loss:.4f}" if isinstance(loss, float) else ""),
                    last, "commit"))
    return out
