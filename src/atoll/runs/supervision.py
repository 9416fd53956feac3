"""The training-run supervision policy: what to do about one run's training-run flow run, as a pure
function of what was observed (Prefect's view and the bucket's view), with a reason.

The supervisor (``atoll.flows.supervisor``) looks at every recent run every few seconds. For each
it observes the newest training-run flow run (its state, how long it has run, whether atoll
cancelled it) and the bucket (finished? stopped? the synchronizer's newest lease and heartbeat),
then :func:`decide_training_run` says:

=======================  ======================================================================
action                   when
=======================  ======================================================================
``finished``             the bucket has the run's last round: nothing to do
``stopped``              the bucket marks the run stopped (``atoll stop``): nothing is launched
``healthy``              Running, and its synchronizer heartbeats
``starting``             Scheduled / Pending / Running without a lease yet, within the grace
``zombie-relaunched``    Running in Prefect but its synchronizer's heartbeat is stale (or it
                         took no lease within ``startup_grace_s``): mark it crashed, relaunch
``relaunched``           it crashed, failed or completed short of the last round: relaunch
                         (the new one resumes from the bucket's last committed round)
``stop-requested``       a person cancelled it (Cancel in the UI): the supervisor finishes the
                         stop — marks the run stopped in the bucket and cancels its learners
``waiting``              a relaunch is due but held: back-off, or ``max_relaunches`` in the window
=======================  ======================================================================

Why a supervisor and not only a Prefect automation: Prefect's state is not liveness (a flow run
whose process died with its worker stays Running), an automation's action cannot read the bucket
(finished? stopped? heartbeating?), and relaunching needs the crashed run's own parameters. The
supervisor reads both, keeps no state of its own (launch counts come from Prefect), so any number
of its short-lived flow runs can come and go.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from atoll.runs.healing import STOP_GRACE_S, HealingPolicy

__all__ = ["SupervisionAction", "SupervisionPolicy", "SupervisorOptions", "TrainingRunObservation",
           "SupervisionDecision", "decide_training_run", "SUPERVISOR_INTERVAL_S", "supervisor_lifetime_s"]

SUPERVISOR_INTERVAL_S = 600.0
"""``atoll deploy`` schedules a supervisor flow run this often (each lives just under it)."""

SUPERVISOR_LIFETIME_MARGIN_S = 30.0
"""A scheduled supervisor ends this long before the next one starts: at most one watches at a time."""


def supervisor_lifetime_s(interval_s: float) -> float:
    """Lifetime of each supervisor flow run scheduled every ``interval_s``: just under it, so one is
    (almost) always watching and a crashed one is replaced at the next tick."""
    return max(1.0, interval_s - SUPERVISOR_LIFETIME_MARGIN_S)


class SupervisionAction(StrEnum):
    FINISHED = "finished"
    STOPPED = "stopped"
    HEALTHY = "healthy"
    STARTING = "starting"
    ZOMBIE_RELAUNCHED = "zombie-relaunched"
    RELAUNCHED = "relaunched"
    STOP_REQUESTED = "stop-requested"
    WAITING = "waiting"


@dataclass(frozen=True, kw_only=True)
class SupervisionPolicy:
    """Knobs of :func:`decide_training_run`; :class:`SupervisorOptions` sets the first four (its
    defaults are these)."""

    heartbeat_timeout_s: float = HealingPolicy.heartbeat_timeout_s
    """A synchronizer whose newest heartbeat is older than this is not alive. It heartbeats every
    few seconds, as a learner does (so the default is a learner's, :class:`HealingPolicy`), from a
    background thread while its process makes progress."""

    startup_grace_s: float = HealingPolicy.startup_grace_s
    """A Running training run with no lease after this long is a zombie (starting one takes what
    starting a learner takes: a process, imports, the bucket's state)."""

    relaunch_backoff_s: float = 10.0
    """Least time between the newest training-run flow run's creation and a relaunch."""

    max_relaunches: int = 10
    """Most relaunches of one run within ``window_s`` (a run that keeps failing needs a person)."""

    window_s: float = 3600.0
    """The window ``max_relaunches`` counts over."""


class SupervisorOptions(BaseModel):
    """Everything one supervisor is given: how it looks (its loop) and the knobs of what it decides
    (:meth:`policy`). The supervisor flow's parameters and ``atoll supervise``'s flags are generated
    from these fields, so each default is written here (or on :class:`SupervisionPolicy`) once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    check_every_s: float = Field(default=5.0, description="Time between two passes over the recent runs (s).")
    lifetime_s: float = Field(
        default=supervisor_lifetime_s(SUPERVISOR_INTERVAL_S),
        description="A supervisor stops after this long (s); a scheduled flow run ends before the deployment's "
        "schedule starts the next.")
    window_s: float = Field(
        default=86400.0, description="A pass looks at every run with a training-run flow run created this recently (s).")
    heartbeat_timeout_s: float = Field(
        default=SupervisionPolicy.heartbeat_timeout_s,
        description="A synchronizer whose newest heartbeat is older than this (s) is not alive.")
    startup_grace_s: float = Field(
        default=SupervisionPolicy.startup_grace_s,
        description="A Running training run that has taken no lease after this long (s) is a zombie.")
    relaunch_backoff_s: float = Field(
        default=SupervisionPolicy.relaunch_backoff_s,
        description="Least time between the newest training-run flow run's creation and a relaunch (s).")
    max_relaunches: int = Field(
        default=SupervisionPolicy.max_relaunches,
        description=f"Most relaunches of one run within {SupervisionPolicy.window_s:g} s (a run that keeps failing "
        "needs a person).")
    stop_grace_s: float = Field(
        default=STOP_GRACE_S,
        description="Finishing a stop requested in the UI: how long learners get to save and exit before their flow "
        "runs are cancelled (s).")

    def policy(self) -> SupervisionPolicy:
        return SupervisionPolicy(heartbeat_timeout_s=self.heartbeat_timeout_s, startup_grace_s=self.startup_grace_s,
                                 relaunch_backoff_s=self.relaunch_backoff_s, max_relaunches=self.max_relaunches)


@dataclass(frozen=True, kw_only=True)
class TrainingRunObservation:
    state: str | None
    """State type of the run's newest training-run flow run (``"RUNNING"`` …)."""

    running_for_s: float | None = None
    since_created_s: float | None = None
    cancelled_by_atoll: bool = False
    finished: bool = False
    stopped: bool = False
    heartbeat_age_s: float | None = None
    """Age of the synchronizer's newest heartbeat in the bucket; None: never leased."""
    exited: str | None = None
    holds_lease: bool = False
    """The newest flow run holds the synchronizer's newest lease."""
    recent_relaunches: int = 0
    """Relaunches by the supervisor within the policy's window."""


@dataclass(frozen=True)
class SupervisionDecision:
    action: SupervisionAction
    reason: str
    crash: bool = False
    """Mark the newest flow run Crashed (a zombie) before relaunching."""
    launch: bool = False
    stop: bool = False
    """Mark the run stopped in the bucket and cancel its learner flow runs."""


def _refused(obs: TrainingRunObservation, policy: SupervisionPolicy) -> str | None:
    if obs.recent_relaunches >= policy.max_relaunches:
        return (f"{obs.recent_relaunches} relaunches in the last {policy.window_s:.0f}s "
                f"(max_relaunches {policy.max_relaunches}): it needs a person")
    if obs.since_created_s is not None and obs.since_created_s < policy.relaunch_backoff_s:
        return f"back-off: its newest flow run is {obs.since_created_s:.0f}s old"
    return None


def _relaunch(obs: TrainingRunObservation, policy: SupervisionPolicy, why: str, *,
              zombie: bool = False) -> SupervisionDecision:
    refused = _refused(obs, policy)
    if refused:
        return SupervisionDecision(SupervisionAction.WAITING, f"{why}; relaunch held: {refused}", crash=zombie)
    action = SupervisionAction.ZOMBIE_RELAUNCHED if zombie else SupervisionAction.RELAUNCHED
    return SupervisionDecision(action, f"{why}; relaunched from the bucket", crash=zombie, launch=True)


def decide_training_run(obs: TrainingRunObservation, policy: SupervisionPolicy) -> SupervisionDecision:
    """What to do about one run's training-run flow run, and why. Pure."""
    if obs.finished:
        return SupervisionDecision(SupervisionAction.FINISHED, "the run has committed its last round")
    if obs.stopped:
        return SupervisionDecision(SupervisionAction.STOPPED, "the run is marked stopped in the bucket")
    alive = obs.exited is None and obs.heartbeat_age_s is not None and obs.heartbeat_age_s < policy.heartbeat_timeout_s
    beat = "no heartbeat" if obs.heartbeat_age_s is None else f"heartbeat {obs.heartbeat_age_s:.0f}s old"
    if obs.state == "RUNNING":
        if obs.holds_lease:
            if alive:
                return SupervisionDecision(SupervisionAction.HEALTHY, f"running ({beat})")
            return _relaunch(obs, policy, f"Running in Prefect but its synchronizer is not alive ({beat}, "
                                          f"heartbeat_timeout_s {policy.heartbeat_timeout_s:g})", zombie=True)
        if obs.running_for_s is None or obs.running_for_s < policy.startup_grace_s:
            return SupervisionDecision(SupervisionAction.STARTING, "running, no lease yet")
        return _relaunch(obs, policy, f"Running for {obs.running_for_s:.0f}s without a lease "
                                      f"(startup_grace_s {policy.startup_grace_s:g})", zombie=True)
    if obs.state in ("SCHEDULED", "PENDING", "PAUSED", "CANCELLING", None):
        return SupervisionDecision(SupervisionAction.STARTING, f"its flow run is {(obs.state or 'unknown').lower()}")
    if obs.state == "CANCELLED" and not obs.cancelled_by_atoll:
        return SupervisionDecision(SupervisionAction.STOP_REQUESTED,
                                   "a person cancelled the training run: the run is stopped and its learners cancelled",
                                   stop=True)
    why = "atoll cancelled it" if obs.state == "CANCELLED" else f"its flow run is {obs.state.lower()}"
    return _relaunch(obs, policy, f"{why} at a round short of the last")
