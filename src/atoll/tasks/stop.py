"""Stopping a run: the bucket first, then Prefect.

``atoll stop`` (and the supervisor, when a person cancels a training run in the UI) marks the run
stopped in the bucket (``sync/stop.json``). Everything that trains the run reads that marker: the
training run ends at its next poll (Completed, ``stopped: True``), learners save their state and
exit within a heartbeat interval, the supervisor relaunches nothing. Then, after a grace period
that lets learners exit cleanly, every flow run of the run that is still not final (training run,
rounds, learners) is cancelled through Prefect, which kills whatever did not exit. Without a
Prefect server the marker alone stops everything that reads the bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect.states import Cancelling

from atoll.runs.healing import ATOLL_CANCEL_PREFIX, STOP_GRACE_S, HealingPolicy
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.tasks.queries import (
    ACTIVE_STATE_TYPES,
    LEARNER_FLOW_NAME,
    ROUND_FLOW_NAME,
    TRAINING_FLOW_NAME,
    read_flow_runs_paged,
)

__all__ = ["StopReport", "mark_stopped_and_wait", "cancel_flow_runs_of_run"]


@dataclass
class StopReport:
    exited: dict[str, str] = field(default_factory=dict)
    """Learners that exited by themselves within the grace: id -> exit reason."""
    still_alive: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    """Flow runs cancelled through Prefect (names)."""


def mark_stopped_and_wait(store: SynchronizerStore, *, reason: str, by: str, grace_s: float = STOP_GRACE_S,
                          heartbeat_timeout_s: float = HealingPolicy.heartbeat_timeout_s,
                          log: Callable[[str], None] = print,
                          sleep: Callable[[float], None] = time.sleep) -> StopReport:
    """Mark the run stopped, then wait up to ``grace_s`` for its live learners to exit by themselves."""
    store.mark_stopped(reason, by)
    report = StopReport()
    deadline = time.monotonic() + grace_s
    learner_ids = store.learner_ids()
    while True:
        now = time.time()
        alive = []
        for lid in learner_ids:
            live = store.learner_liveness(lid)
            age = live.heartbeat_age_s(now)
            if live.exited_reason is not None:
                report.exited[lid] = live.exited_reason
            elif age is not None and age < heartbeat_timeout_s:
                alive.append(lid)
        report.still_alive = alive
        if not alive or time.monotonic() >= deadline:
            break
        log(f"waiting for {len(alive)} learner(s) to save and exit: {', '.join(alive)}")
        sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    return report


def cancel_flow_runs_of_run(client: Any, run_tag: str, *, reason: str) -> list[str]:
    """Cancel every flow run of the run (training runs, rounds, learners) that is not final yet."""
    runs = read_flow_runs_paged(client, flow_names=[TRAINING_FLOW_NAME, ROUND_FLOW_NAME, LEARNER_FLOW_NAME],
                                tags=[run_tag], state_types=ACTIVE_STATE_TYPES)
    names = []
    for fr in runs:
        client.set_flow_run_state(fr.id, Cancelling(message=f"{ATOLL_CANCEL_PREFIX} {reason}"), force=True)
        names.append(fr.name)
    return names
