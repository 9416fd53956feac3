"""Prefect events a run emits, for automations and alerts (docs/prefect.md, "Events").

Every event's resource is the run or one of its learners, labelled with the run id, so an
automation can match one run (``{"atoll.run-id": "run-1a2b"}``) or all of them (``atoll.run.*``):

=============================  ===============================  ============================================
event                          resource id                      when
=============================  ===============================  ============================================
``atoll.round.committed``      ``atoll.run.<run id>``           a round's commit was recorded (off the
                                                                critical path, by the run's recorder)
``atoll.round.stalled``        ``atoll.run.<run id>``           a round is still open after every
                                                                ``fleet.watch_every_s`` of waiting
``atoll.learner.relaunched``   ``atoll.learner.<run id>.<id>``  the training run relaunched a learner
                                                                (crashed, failed, zombie, orphaned)
``atoll.run.handed-over``      ``atoll.run.<run id>``           a training-run segment handed the run to the
                                                                next segment (a new flow run)
``atoll.run.finished``         ``atoll.run.<run id>``           the run committed its last round, or was
                                                                stopped (``payload.stopped``)
=============================  ===============================  ============================================

Related resources name the flow runs involved (role ``flow-run``, ``training-run``,
``previous-flow-run``, ``next-segment``). Emitting only queues the event for Prefect's events
worker (a websocket, no HTTP call, never blocks); with no Prefect API configured it does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from atoll.runs.contributions import ContributionRow, steps_since_sync
from atoll.runs.goodput import GoodputReport
from atoll.storage.records import CommitRecord

__all__ = ["ROUND_COMMITTED", "ROUND_STALLED", "LEARNER_RELAUNCHED", "RUN_HANDED_OVER", "RUN_FINISHED", "EVENT_NAMES",
           "run_resource", "learner_resource", "emit", "emit_round_committed"]

ROUND_COMMITTED = "atoll.round.committed"
ROUND_STALLED = "atoll.round.stalled"
LEARNER_RELAUNCHED = "atoll.learner.relaunched"
RUN_HANDED_OVER = "atoll.run.handed-over"
RUN_FINISHED = "atoll.run.finished"
EVENT_NAMES = (ROUND_COMMITTED, ROUND_STALLED, LEARNER_RELAUNCHED, RUN_HANDED_OVER, RUN_FINISHED)

log = logging.getLogger("atoll.events")


def run_resource(run_id: str, run_url: str | None = None) -> dict[str, str]:
    out = {"prefect.resource.id": f"atoll.run.{run_id}", "prefect.resource.name": run_id, "atoll.run-id": run_id}
    if run_url:
        out["atoll.run-url"] = run_url
    return out


def learner_resource(run_id: str, learner_id: str, pool: str | None = None) -> dict[str, str]:
    out = {"prefect.resource.id": f"atoll.learner.{run_id}.{learner_id}", "prefect.resource.name": learner_id,
           "atoll.run-id": run_id, "atoll.learner-id": learner_id}
    if pool:
        out["atoll.pool"] = pool
    return out


def _flow_runs(related: Mapping[str, Any] | None) -> list[dict[str, str]]:
    return [{"prefect.resource.id": f"prefect.flow-run.{fid}", "prefect.resource.role": role}
            for role, fid in (related or {}).items() if fid]


def emit(event: str, resource: dict[str, str], payload: dict[str, Any], *,
         flow_runs: Mapping[str, Any] | None = None) -> Any:
    """Emit one event (queued; never raises: an event is for people, the bucket is the truth)."""
    try:
        from prefect.events import emit_event

        return emit_event(event=event, resource=resource, related=_flow_runs(flow_runs), payload=payload)
    except Exception as e:  # noqa: BLE001
        log.warning(f"could not emit {event}: {e!r}")
        return None


def emit_round_committed(run_id: str, run_url: str, record: CommitRecord, rows: Iterable[ContributionRow], *,
                         goodput: GoodputReport | None = None, flow_run_id: str | None = None) -> Any:
    rows = list(rows)
    s = record.stats
    payload = {
        "round": record.round, "fragment": record.fragment, "updated": record.updated,
        "contributors": sorted(a.learner_id for a in record.accepted), "weight_zero": len(record.rejected),
        "quorum_s": s.get("quorum_s"), "grace_s": s.get("grace_s"), "wait_s": s.get("wait_s"),
        "reason": s.get("reason"), "tokens": s.get("tokens"), "val_loss": s.get("val_loss"),
        "steps_since_sync": steps_since_sync(rows),
        "goodput": goodput.goodput if goodput is not None else None,
        "merged_share": goodput.merged_share if goodput is not None else None,
    }
    return emit(ROUND_COMMITTED, run_resource(run_id, run_url), payload, flow_runs={"flow-run": flow_run_id})
