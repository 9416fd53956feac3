"""Launching, watching and relaunching learner flow runs (the self-healing half of the training run).

Each learner of a run is one long-lived, **top-level** flow run of the learner deployment of its
work pool (not a subflow: cancelling or finishing whatever launched it must not take it down),
tagged ``atoll-run:<run_id>``, ``atoll-learner:<learner_id>`` and ``atoll-pool:<pool>``.
:class:`LearnerFleet` is the thin Prefect side: it reads every learner flow run of the run (by
flow name and run tag, all pages), joins each learner's newest one with the learner's liveness
from the bucket (newest lease, heartbeat, exit), asks the pure policy
(:func:`atoll.runs.healing.decide_learner`) and carries out the cancel and launch it decides.
Alive means a fresh heartbeat in the bucket, never a Prefect state; a relaunched learner takes a
newer lease, which fences any copy that is still around.

Deadlines of rounds never depend on this: the synchronizer closes rounds on its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from atoll.runs.healing import (
    ATOLL_CANCEL_PREFIX,
    HealingAction,
    HealingPolicy,
    LearnerObservation,
    decide_learner,
)
from atoll.tasks.events import LEARNER_RELAUNCHED, emit, learner_resource
from atoll.tasks.logs import task_logger
from atoll.tasks.queries import LEARNER_FLOW_NAME, learner_tag, pool_tag, read_flow_runs_paged, run_tag

__all__ = [
    "LEARNER_FLOW_NAME",
    "LearnerFleet",
    "LearnerAction",
    "run_tag",
    "learner_tag",
    "pool_tag",
    "learner_deployment_name",
    "liveness_age_s",
]


def learner_deployment_name(pool: str, deployments: Mapping[str, str] | None = None) -> str:
    """``flow/deployment`` of the learner deployment for ``pool`` (default: ``atoll-learner/<pool>``)."""
    return (deployments or {}).get(pool) or f"{LEARNER_FLOW_NAME}/{pool}"



def liveness_age_s(liveness: Any, now_unix: float) -> float | None:
    """Seconds since the newest incarnation last showed life: its heartbeat, or, before its first
    heartbeat, its lease (a lease taken a moment ago is a process starting, not a dead one). Both
    on the store's clock (atoll.storage.liveness), never the learner's."""
    age: float | None = liveness.heartbeat_age_s(now_unix)
    if age is None:
        age = liveness.lease_age_s(now_unix)
    return age


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

    # -- Prefect queries -----------------------------------------------------------------------
    def flow_runs(self, client: Any) -> dict[str, list[FlowRun]]:
        """Every learner flow run of this run, per learner, newest first (all pages)."""
        runs = read_flow_runs_paged(client, flow_names=[LEARNER_FLOW_NAME], tags=[run_tag(self.run_id)])
        out: dict[str, list[FlowRun]] = {s["learner_id"]: [] for s in self.learners}
        for fr in runs:  # already newest first
            for t in fr.tags:
                if t.startswith("atoll-learner:") and t.split(":", 1)[1] in out:
                    out[t.split(":", 1)[1]].append(fr)
        return out

    def launch(self, learner_id: str, pool: str, *, after: FlowRun | None = None, incarnations: int = 0) -> FlowRun:
        """Launch a flow run of the learner on its pool. ``after``: the newest flow run it replaces
        (its id makes the launch idempotent: two training-run processes that both decide to replace
        the same flow run create one new flow run between them); ``incarnations``: flow runs so far."""
        params = {"run_url": self.run_url, "learner_id": learner_id, **self.learner_parameters}
        if self.storage_options:
            params["storage_options"] = self.storage_options
        n = self.launches.get(learner_id, 0) + 1
        fr = run_deployment(
            learner_deployment_name(pool, self.deployments),
            idempotency_key=f"atoll:{self.run_id}:{learner_id}:after:{after.id if after is not None else 'none'}",
            parameters=params,
            timeout=0,
            tags=[run_tag(self.run_id), learner_tag(learner_id), pool_tag(pool)],
            flow_run_name=f"{learner_id}-{max(n, incarnations + 1)}",
            as_subflow=False,  # top level: outlives whatever launched it; `atoll stop` cancels it
        )
        self.launches[learner_id] = n
        self.last_launch[learner_id] = self.clock()
        return fr  # type: ignore[return-value]  # run_deployment is sync-compatible: a FlowRun here

    def observe(self, learner_id: str, latest: FlowRun | None, *, liveness: Any = None,
                finished: bool = False, stopped: bool = False, now_unix: float | None = None) -> LearnerObservation:
        """The policy's view of one learner: its newest flow run, its liveness in the bucket
        (an ``atoll.storage`` ``Liveness``: newest lease and heartbeat), our launches."""
        state = latest.state.type.value if latest is not None and latest.state is not None else None
        running_for = None
        if latest is not None and state == "RUNNING" and latest.start_time is not None:
            running_for = time.time() - latest.start_time.timestamp()
        message = (latest.state.message or "") if latest is not None and latest.state is not None else ""
        lease = getattr(liveness, "lease", None)
        holds = (latest is not None and lease is not None and lease.flow_run_id is not None
                 and str(lease.flow_run_id) == str(latest.id))
        last = self.last_launch.get(learner_id)
        return LearnerObservation(
            state=state, running_for_s=running_for,
            cancelled_by_atoll=state in ("CANCELLED", "CANCELLING") and message.startswith(ATOLL_CANCEL_PREFIX),
            heartbeat_age_s=None if liveness is None else liveness_age_s(liveness, now_unix or time.time()),
            exited=None if liveness is None else liveness.exited_reason,
            holds_lease=holds,
            launches=self.launches.get(learner_id, 0), since_launch_s=None if last is None else self.clock() - last,
            finished=finished, stopped=stopped,
        )

    # -- carrying out the policy ---------------------------------------------------------------
    def reconcile(self, *, liveness: Mapping[str, Any] | None = None, finished: bool = False,
                  stopped: bool = False) -> list[LearnerAction]:
        """Observe, decide (:func:`~atoll.runs.healing.decide_learner`) and act for each learner,
        sequentially (SQLite dislikes concurrent creates).

        ``liveness``: each learner's ``Liveness`` from the bucket (absent: never leased).
        """
        lives = dict(liveness or {})
        log = task_logger("atoll.learners")
        actions: list[LearnerAction] = []
        now = time.time()
        with get_client(sync_client=True) as client:
            runs = self.flow_runs(client)
            for spec in self.learners:
                lid, pool = spec["learner_id"], spec["pool"]
                mine = runs.get(lid, [])
                latest = mine[0] if mine else None
                sname = latest.state.name if latest is not None and latest.state is not None else None
                decision = decide_learner(self.observe(lid, latest, liveness=lives.get(lid), finished=finished,
                                                       stopped=stopped, now_unix=now), self.policy)
                run_id, state = (str(latest.id), sname) if latest is not None else (None, None)
                if decision.cancel and latest is not None:
                    log.warning(f"{lid}: flow run {latest.name}: {decision.reason}")
                    client.set_flow_run_state(latest.id, Cancelling(message=f"{ATOLL_CANCEL_PREFIX} zombie learner"),
                                              force=True)
                if decision.launch:
                    fr = self.launch(lid, pool, after=latest, incarnations=len(mine))
                    log.info(f"{lid}: launched flow run {fr.name} on pool {pool}: {decision.reason}")
                    if decision.action in (HealingAction.RELAUNCHED, HealingAction.ZOMBIE_RELAUNCHED):
                        emit(LEARNER_RELAUNCHED, learner_resource(self.run_id, lid, pool),
                             {"action": str(decision.action), "reason": decision.reason, "pool": pool,
                              "previous_state": sname, "flow_run": fr.name, "launches": self.launches.get(lid, 0)},
                             flow_runs={"flow-run": fr.id, "previous-flow-run": latest.id if latest else None})
                    run_id, state = str(fr.id), "Scheduled"
                elif decision.action == HealingAction.WAITING:
                    log.info(f"{lid}: {decision.reason}")
                actions.append(LearnerAction(lid, decision.action, run_id, state, pool, decision.reason))
        self.history.extend(a for a in actions if a.action not in (HealingAction.ADOPTED, HealingAction.FINISHED))
        return actions
