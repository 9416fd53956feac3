"""Launching, watching and relaunching learner flow runs (the self-healing half of the training run).

Each learner of a run is one long-lived flow run of the learner deployment of its work pool,
tagged ``atoll-run:<run_id>`` and ``atoll-learner:<learner_id>``. :class:`LearnerFleet` reconciles
what Prefect says with what the run needs, once per call:

* a learner with an active flow run (scheduled, pending, running) is **adopted**, whoever started
  it (this training run, an earlier incarnation of it, or a person from the UI);
* a learner whose latest flow run crashed, failed or completed while the run is not finished is
  **relaunched** on its pool (it rejoins from the bucket), with a short back-off;
* a running learner that has not contributed for ``stale_after_s`` is **stale**: its flow run is
  cancelled and a new one launched;
* a learner with no flow run at all but recent contributions in the bucket runs outside Prefect
  (``atoll learner`` by hand, ``python -m atoll.train.local learner``): it is adopted too;
* a flow run a person *cancelled* stays cancelled (that is how to take a learner out of a run).

Deadlines of rounds never depend on this: the synchronizer closes rounds on its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.deployments import run_deployment
from prefect.exceptions import MissingContextError
from prefect.states import Cancelling

__all__ = [
    "LEARNER_FLOW_NAME",
    "LearnerFleet",
    "LearnerAction",
    "run_tag",
    "learner_tag",
    "pool_tag",
    "learner_deployment_name",
    "watch_learners",
    "fleet_for",
]

LEARNER_FLOW_NAME = "atoll-learner"
ACTIVE = {StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING}
RELAUNCH = {StateType.CRASHED, StateType.FAILED, StateType.COMPLETED}


def run_tag(run_id: str) -> str:
    return f"atoll-run:{run_id}"


def learner_tag(learner_id: str) -> str:
    return f"atoll-learner:{learner_id}"


def pool_tag(pool: str) -> str:
    return f"atoll-pool:{pool}"


def learner_deployment_name(pool: str, deployments: Mapping[str, str] | None = None) -> str:
    """``flow/deployment`` of the learner deployment for ``pool`` (default: ``atoll-learner/<pool>``)."""
    return (deployments or {}).get(pool) or f"{LEARNER_FLOW_NAME}/{pool}"


def _logger() -> Any:
    try:
        return get_run_logger()
    except MissingContextError:
        import logging

        return logging.getLogger("atoll.learners")


@dataclass
class LearnerAction:
    learner_id: str
    action: str
    """'adopted', 'launched', 'relaunched', 'stale-relaunched', 'external', 'cancelled-by-user', 'waiting'."""
    flow_run_id: str | None = None
    state: str | None = None
    pool: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"learner_id": self.learner_id, "action": self.action, "flow_run_id": self.flow_run_id,
                "state": self.state, "pool": self.pool}


@dataclass
class LearnerFleet:
    """The learners of one run as Prefect sees them; :meth:`reconcile` heals what is broken."""

    run_url: str
    run_id: str
    learners: list[dict[str, str]]
    """[{"learner_id", "pool"}]."""
    deployments: dict[str, str] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None
    learner_parameters: dict[str, Any] = field(default_factory=dict)
    """Extra learner-flow parameters (threads, poll interval ...)."""
    stale_after_s: float = 300.0
    relaunch_backoff_s: float = 5.0
    max_launches: int = 50
    clock: Callable[[], float] = time.monotonic
    launches: dict[str, int] = field(default_factory=dict)
    last_launch: dict[str, float] = field(default_factory=dict)
    history: list[LearnerAction] = field(default_factory=list)
    cancelled_by_us: set[str] = field(default_factory=set)

    # -- Prefect queries -----------------------------------------------------------------------
    def flow_runs(self, client: Any) -> dict[str, list[FlowRun]]:
        """Every learner flow run of this run, per learner, newest first."""
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(self.run_id)])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200,
        )
        out: dict[str, list[FlowRun]] = {s["learner_id"]: [] for s in self.learners}
        for fr in runs:
            for t in fr.tags:
                if t.startswith("atoll-learner:") and t.split(":", 1)[1] in out:
                    out[t.split(":", 1)[1]].append(fr)
        for lst in out.values():
            lst.sort(key=lambda fr: fr.created.timestamp() if fr.created else 0.0, reverse=True)
        return out

    def launch(self, learner_id: str, pool: str) -> FlowRun:
        params = {"run_url": self.run_url, "learner_id": learner_id, **self.learner_parameters}
        if self.storage_options:
            params["storage_options"] = self.storage_options
        n = self.launches.get(learner_id, 0) + 1
        fr = run_deployment(
            learner_deployment_name(pool, self.deployments),
            parameters=params,
            timeout=0,
            tags=[run_tag(self.run_id), learner_tag(learner_id), pool_tag(pool)],
            flow_run_name=f"{learner_id}-{n}",
        )
        self.launches[learner_id] = n
        self.last_launch[learner_id] = self.clock()
        return fr  # type: ignore[return-value]

    # -- the policy ----------------------------------------------------------------------------
    def reconcile(self, *, last_seen_age_s: Mapping[str, float] | None = None, finished: bool = False,
                  launch: bool = True) -> list[LearnerAction]:
        """Adopt, launch or relaunch each learner (sequentially: SQLite dislikes concurrent creates).

        ``last_seen_age_s``: seconds since each learner's newest contribution was first seen (from the
        synchronizer; absent = never seen by this process).
        """
        ages = dict(last_seen_age_s or {})
        log = _logger()
        actions: list[LearnerAction] = []
        with get_client(sync_client=True) as client:
            runs = self.flow_runs(client)
            for spec in self.learners:
                lid, pool = spec["learner_id"], spec["pool"]
                mine = runs.get(lid, [])
                latest = mine[0] if mine else None
                state = latest.state.type if latest is not None and latest.state is not None else None
                sname = latest.state.name if latest is not None and latest.state is not None else None
                if finished:
                    actions.append(LearnerAction(lid, "finished", str(latest.id) if latest else None, sname, pool))
                    continue
                if latest is not None and state in ACTIVE:
                    age = ages.get(lid)
                    if age is None and state == StateType.RUNNING and latest.start_time is not None:
                        age = time.time() - latest.start_time.timestamp()
                    if state == StateType.RUNNING and age is not None and age > self.stale_after_s and launch:
                        log.warning(f"{lid}: flow run {latest.name} has not contributed for {age:.0f}s; "
                                    "cancelling it and launching a new one")
                        self.cancelled_by_us.add(str(latest.id))
                        client.set_flow_run_state(latest.id, Cancelling(message="atoll: stale learner"), force=True)
                        actions.append(self._relaunch(lid, pool, "stale-relaunched", log))
                        continue
                    actions.append(LearnerAction(lid, "adopted", str(latest.id), sname, pool))
                    continue
                if latest is not None and state == StateType.CANCELLED and str(latest.id) not in self.cancelled_by_us:
                    actions.append(LearnerAction(lid, "cancelled-by-user", str(latest.id), sname, pool))
                    continue
                if latest is None and lid in ages and ages[lid] < min(60.0, self.stale_after_s):
                    actions.append(LearnerAction(lid, "external", None, None, pool))
                    continue
                if not launch:
                    actions.append(LearnerAction(lid, "waiting", str(latest.id) if latest else None, sname, pool))
                    continue
                if latest is None:
                    fr = self.launch(lid, pool)
                    log.info(f"{lid}: launched flow run {fr.name} on pool {pool}")
                    actions.append(LearnerAction(lid, "launched", str(fr.id), "Scheduled", pool))
                else:
                    log.warning(f"{lid}: flow run {latest.name} is {sname}; relaunching it on pool {pool} "
                                "(it rejoins from the bucket)")
                    actions.append(self._relaunch(lid, pool, "relaunched", log))
        self.history.extend(a for a in actions if a.action not in ("adopted", "finished"))
        return actions

    def _relaunch(self, lid: str, pool: str, why: str, log: Any) -> LearnerAction:
        since = self.clock() - self.last_launch.get(lid, -1e9)
        if since < self.relaunch_backoff_s or self.launches.get(lid, 0) >= self.max_launches:
            return LearnerAction(lid, "waiting", None, None, pool)
        fr = self.launch(lid, pool)
        log.info(f"{lid}: launched flow run {fr.name} on pool {pool}")
        return LearnerAction(lid, why, str(fr.id), "Scheduled", pool)


_FLEETS: dict[str, LearnerFleet] = {}


def fleet_for(run_url: str, run_id: str, learners: list[dict[str, str]], **kwargs: Any) -> LearnerFleet:
    """The process-wide fleet of a run (launch counts and back-off survive between rounds)."""
    fleet = _FLEETS.get(run_url)
    if fleet is None:
        fleet = _FLEETS[run_url] = LearnerFleet(run_url=run_url, run_id=run_id, learners=learners, **kwargs)
    else:
        for k, v in kwargs.items():
            setattr(fleet, k, v)
    return fleet


@task(name="watch-learners", cache_policy=NO_CACHE, persist_result=False)
def watch_learners(run_url: str, run_id: str, learners: list[dict[str, str]], *,
                   last_seen_age_s: dict[str, float] | None = None, finished: bool = False,
                   deployments: dict[str, str] | None = None, storage_options: dict[str, Any] | None = None,
                   learner_parameters: dict[str, Any] | None = None, stale_after_s: float = 300.0,
                   launch: bool = True) -> list[dict[str, Any]]:
    """Adopt / launch / relaunch the run's learner flow runs; returns what it did per learner."""
    fleet = fleet_for(run_url, run_id, learners, deployments=dict(deployments or {}),
                      storage_options=storage_options, learner_parameters=dict(learner_parameters or {}),
                      stale_after_s=stale_after_s)
    return [a.as_dict() for a in fleet.reconcile(last_seen_age_s=last_seen_age_s, finished=finished, launch=launch)]
