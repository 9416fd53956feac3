"""Launching, watching and relaunching learner flow runs (the self-healing half of the training run).

Each learner of a run is one long-lived flow run of the learner deployment of its work pool,
tagged ``atoll-run:<run_id>`` and ``atoll-learner:<learner_id>``. :class:`LearnerFleet` is the thin
Prefect side: it reads the learners' flow runs, turns each learner's newest one into a
:class:`~atoll.runs.healing.LearnerObservation`, asks the pure policy
(:func:`atoll.runs.healing.decide_learner`: adopt, launch, relaunch, leave alone, cancel a stale
one, respect a person's cancel, adopt a learner running outside Prefect) and carries out the
cancel and launch it decides. The policy's table is in :mod:`atoll.runs.healing`.

Deadlines of rounds never depend on this: the synchronizer closes rounds on its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.sorting import FlowRunSort
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from atoll.runs.healing import HealingAction, HealingPolicy, LearnerObservation, decide_learner
from atoll.tasks.logs import task_logger

if TYPE_CHECKING:
    from atoll.tasks.context import RunContext

__all__ = [
    "LEARNER_FLOW_NAME",
    "LearnerFleet",
    "LearnerAction",
    "run_tag",
    "learner_tag",
    "pool_tag",
    "learner_deployment_name",
    "watch_learners",
]

LEARNER_FLOW_NAME = "atoll-learner"


def run_tag(run_id: str) -> str:
    return f"atoll-run:{run_id}"


def learner_tag(learner_id: str) -> str:
    return f"atoll-learner:{learner_id}"


def pool_tag(pool: str) -> str:
    return f"atoll-pool:{pool}"


def learner_deployment_name(pool: str, deployments: Mapping[str, str] | None = None) -> str:
    """``flow/deployment`` of the learner deployment for ``pool`` (default: ``atoll-learner/<pool>``)."""
    return (deployments or {}).get(pool) or f"{LEARNER_FLOW_NAME}/{pool}"



@dataclass
class LearnerAction:
    """What the fleet did about one learner (the policy's action, with its reason)."""

    learner_id: str
    action: HealingAction
    flow_run_id: str | None = None
    state: str | None = None
    pool: str = ""
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"learner_id": self.learner_id, "action": str(self.action), "flow_run_id": self.flow_run_id,
                "state": self.state, "pool": self.pool, "reason": self.reason}


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
    policy: HealingPolicy = field(default_factory=HealingPolicy)
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
        return fr  # type: ignore[return-value]  # run_deployment is sync-compatible: a FlowRun here

    def observe(self, learner_id: str, latest: FlowRun | None, *, last_seen_age_s: float | None,
                finished: bool) -> LearnerObservation:
        """The policy's view of one learner: its newest flow run, its silence, our launches."""
        state = latest.state.type.value if latest is not None and latest.state is not None else None
        running_for = None
        if latest is not None and state == "RUNNING" and latest.start_time is not None:
            running_for = time.time() - latest.start_time.timestamp()
        last = self.last_launch.get(learner_id)
        return LearnerObservation(
            state=state, running_for_s=running_for, last_seen_age_s=last_seen_age_s,
            cancelled_by_us=latest is not None and str(latest.id) in self.cancelled_by_us,
            launches=self.launches.get(learner_id, 0), since_launch_s=None if last is None else self.clock() - last,
            finished=finished,
        )

    # -- carrying out the policy ---------------------------------------------------------------
    def reconcile(self, *, last_seen_age_s: Mapping[str, float] | None = None,
                  finished: bool = False) -> list[LearnerAction]:
        """Observe, decide (:func:`~atoll.runs.healing.decide_learner`) and act for each learner,
        sequentially (SQLite dislikes concurrent creates).

        ``last_seen_age_s``: seconds since each learner's newest contribution was first seen (from the
        synchronizer; absent = never seen by this process).
        """
        ages = dict(last_seen_age_s or {})
        log = task_logger("atoll.learners")
        actions: list[LearnerAction] = []
        with get_client(sync_client=True) as client:
            runs = self.flow_runs(client)
            for spec in self.learners:
                lid, pool = spec["learner_id"], spec["pool"]
                mine = runs.get(lid, [])
                latest = mine[0] if mine else None
                sname = latest.state.name if latest is not None and latest.state is not None else None
                decision = decide_learner(self.observe(lid, latest, last_seen_age_s=ages.get(lid), finished=finished),
                                          self.policy)
                run_id, state = (str(latest.id), sname) if latest is not None else (None, None)
                if decision.cancel and latest is not None:
                    log.warning(f"{lid}: flow run {latest.name}: {decision.reason}")
                    self.cancelled_by_us.add(str(latest.id))
                    client.set_flow_run_state(latest.id, Cancelling(message="atoll: stale learner"), force=True)
                if decision.launch:
                    fr = self.launch(lid, pool)
                    log.info(f"{lid}: launched flow run {fr.name} on pool {pool}: {decision.reason}")
                    run_id, state = str(fr.id), "Scheduled"
                elif decision.action == HealingAction.WAITING:
                    log.info(f"{lid}: {decision.reason}")
                actions.append(LearnerAction(lid, decision.action, run_id, state, pool, decision.reason))
        self.history.extend(a for a in actions if a.action not in (HealingAction.ADOPTED, HealingAction.FINISHED))
        return actions


@task(name="watch-learners", cache_policy=NO_CACHE, persist_result=False)
def watch_learners(ctx: RunContext) -> list[dict[str, Any]]:
    """Adopt / launch / relaunch the run's learner flow runs; returns what it did per learner."""
    if ctx.fleet is None:
        return []
    sync = ctx.synchronizer()
    return [a.as_dict() for a in ctx.fleet.reconcile(last_seen_age_s=ctx.last_seen_age_s(), finished=sync.finished)]
