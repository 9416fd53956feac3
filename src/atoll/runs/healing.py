"""The learner-healing policy: what to do about one learner, as a pure function of what was observed.

The training run keeps every learner of its run alive as one long-lived, top-level flow run on the
learner's work pool. Each time it looks (``atoll.tasks.fleet.LearnerFleet``) it observes, per
learner, two independent things and asks :func:`decide_learner` what to do, with a reason:

* **Prefect's view**: the learner's newest flow run (its state type, how long it has been running,
  whether atoll itself cancelled it);
* **the bucket's view**, which is the truth about liveness: the learner's newest lease (which
  incarnation, held by which flow run) and that incarnation's heartbeat (how old, and whether it
  exited, with its reason). *Alive* means a heartbeat younger than ``heartbeat_timeout_s`` that
  is not an exit. A flow run that Prefect says is Running but whose learner does not heartbeat is
  a **zombie** (its process is gone, or hung): it is cancelled and a new incarnation is launched,
  which fences the old one through the lease.

============================  ==================================================================
action                        when
============================  ==================================================================
``finished``                  the run has committed its last round: nothing is launched
``stopped``                   the run is marked stopped in the bucket (``atoll stop``): nothing
                              is launched; learners exit by themselves
``adopted``                   the newest flow run is active and its learner is alive (or still
                              starting, or waiting for a worker)
``zombie-relaunched``         the newest flow run is Running but its learner's heartbeat is
                              stale, or it took no lease within ``startup_grace_s``: cancel it
                              and launch a new incarnation
``cancelled-by-user``         a person cancelled its flow run: leave it cancelled (that is how to
                              take a learner out of a run)
``external``                  no live flow run, but the learner is alive under a lease that no
                              flow run of ours holds (started by hand, or outside Prefect)
``launched``                  no flow run yet: launch the first one
``relaunched``                its flow run crashed, failed or completed (or atoll cancelled it)
                              while the run goes on: launch a new one; it rejoins from the bucket
``waiting``                   a launch is due but held back: back-off since the last launch, or
                              ``max_launches`` reached
============================  ==================================================================

Prefect's state names are plain strings here (``"RUNNING"``, ``"CRASHED"`` … the values of
``prefect.client.schemas.objects.StateType``), so this module needs no Prefect. Deadlines of
rounds never depend on it: the synchronizer closes rounds on its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["ACTIVE_STATES", "RELAUNCH_STATES", "ATOLL_CANCEL_PREFIX", "STOP_GRACE_S", "HealingAction",
           "HealingPolicy", "LearnerObservation", "HealingDecision", "decide_learner"]

ACTIVE_STATES = frozenset({"SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"})
"""Flow-run state types of a learner that is (about to be) at work."""

RELAUNCH_STATES = frozenset({"CRASHED", "FAILED", "COMPLETED"})
"""Flow-run state types after which a learner of an unfinished run is launched again."""

ATOLL_CANCEL_PREFIX = "atoll:"
"""State messages of cancels atoll made itself start with this; any other cancel was a person's.
(It is kept in Prefect's database, so a restarted training run still tells the two apart.)"""

STOP_GRACE_S = 20.0
"""Once a run is marked stopped, its learners get this long to save and exit by themselves before
``atoll stop`` (or the supervisor finishing a stop) cancels their flow runs: a save is one state
upload, and learners read the marker within a heartbeat interval."""


class HealingAction(StrEnum):
    FINISHED = "finished"
    STOPPED = "stopped"
    ADOPTED = "adopted"
    ZOMBIE_RELAUNCHED = "zombie-relaunched"
    CANCELLED_BY_USER = "cancelled-by-user"
    EXTERNAL = "external"
    LAUNCHED = "launched"
    RELAUNCHED = "relaunched"
    WAITING = "waiting"


@dataclass(frozen=True, kw_only=True)
class HealingPolicy:
    """The knobs of :func:`decide_learner` (process-local: they change nothing that is trained).

    These are the defaults of every learner-liveness knob: ``FleetOptions``, ``atoll stop`` and the
    supervisor's :class:`~atoll.runs.supervision.SupervisionPolicy` read theirs from here."""

    heartbeat_timeout_s: float = 60.0
    """A learner whose newest heartbeat is older than this is not alive (learners heartbeat every
    few seconds; keep this well above their ``heartbeat_interval_s`` and any clock skew)."""

    startup_grace_s: float = 300.0
    """A Running flow run whose learner has taken no lease after this long is a zombie (starting
    takes a Python process, imports, the model and the bucket's state: seconds to a minute)."""

    relaunch_backoff_s: float = 5.0
    """Least time between two launches of one learner."""

    max_launches: int = 50
    """Most flow runs one training-run process launches per learner (then it only waits)."""


@dataclass(frozen=True, kw_only=True)
class LearnerObservation:
    """What was observed about one learner, at one moment."""

    state: str | None = None
    """State type of the learner's newest flow run (``"RUNNING"`` …); None: it has no flow run."""

    running_for_s: float | None = None
    """Seconds since that flow run started running; None: not started, or unknown."""

    cancelled_by_atoll: bool = False
    """The newest flow run is Cancelling/Cancelled by atoll (a zombie, or ``atoll stop``), not by a
    person (a zombie's Cancelling may never resolve when its worker is gone: it is not waited for)."""

    heartbeat_age_s: float | None = None
    """Seconds since the newest incarnation's last heartbeat (bucket); None: never leased."""

    exited: str | None = None
    """The newest incarnation's exit reason, if it exited (``orphaned``, ``sigterm`` …)."""

    holds_lease: bool = False
    """The newest flow run holds the learner's newest lease (its learner is that incarnation)."""

    launches: int = 0
    """Flow runs launched for this learner so far (by this process)."""

    since_launch_s: float | None = None
    """Seconds since the last launch; None: never launched."""

    finished: bool = False
    """The run has committed its last round."""

    stopped: bool = False
    """The run is marked stopped in the bucket."""


@dataclass(frozen=True)
class HealingDecision:
    action: HealingAction
    reason: str
    cancel: bool = False
    """Cancel the newest flow run (before launching, if ``launch``)."""
    launch: bool = False
    """Launch a new flow run of the learner on its pool."""


def _launch_refused(obs: LearnerObservation, policy: HealingPolicy) -> str | None:
    if obs.launches >= policy.max_launches:
        return f"{obs.launches} launches already (max_launches {policy.max_launches})"
    if obs.since_launch_s is not None and obs.since_launch_s < policy.relaunch_backoff_s:
        return f"back-off: launched {obs.since_launch_s:.1f}s ago (relaunch_backoff_s {policy.relaunch_backoff_s:g})"
    return None


def _alive(obs: LearnerObservation, policy: HealingPolicy) -> bool:
    return obs.exited is None and obs.heartbeat_age_s is not None and obs.heartbeat_age_s < policy.heartbeat_timeout_s


def _heartbeat_text(obs: LearnerObservation) -> str:
    if obs.heartbeat_age_s is None:
        return "no heartbeat"
    return f"heartbeat {obs.heartbeat_age_s:.0f}s old" + (f", exited ({obs.exited})" if obs.exited else "")


def _zombie(obs: LearnerObservation, policy: HealingPolicy, why: str) -> HealingDecision:
    refused = _launch_refused(obs, policy)
    if refused:
        return HealingDecision(HealingAction.WAITING, f"{why}; cancelled, relaunch held: {refused}", cancel=True)
    return HealingDecision(HealingAction.ZOMBIE_RELAUNCHED, f"{why}; cancelled and relaunched", cancel=True,
                           launch=True)


def _running(obs: LearnerObservation, policy: HealingPolicy) -> HealingDecision:
    """The newest flow run is Running: believe the bucket, not Prefect."""
    if obs.holds_lease:
        if _alive(obs, policy):
            return HealingDecision(HealingAction.ADOPTED, f"running and alive ({_heartbeat_text(obs)})")
        if obs.exited is not None and (obs.heartbeat_age_s or 0.0) < policy.heartbeat_timeout_s:
            return HealingDecision(HealingAction.ADOPTED, f"running, exiting ({obs.exited})")
        return _zombie(obs, policy, f"Running in Prefect but its learner is not alive ({_heartbeat_text(obs)}, "
                                    f"heartbeat_timeout_s {policy.heartbeat_timeout_s:g})")
    if obs.running_for_s is None or obs.running_for_s < policy.startup_grace_s:
        return HealingDecision(HealingAction.ADOPTED, "running, starting (no lease yet)")
    return _zombie(obs, policy, f"Running for {obs.running_for_s:.0f}s without taking a lease "
                                f"(startup_grace_s {policy.startup_grace_s:g})")


def decide_learner(obs: LearnerObservation, policy: HealingPolicy) -> HealingDecision:
    """What to do about one learner, and why. Pure: same observation, same decision."""
    if obs.finished:
        return HealingDecision(HealingAction.FINISHED, "the run has committed its last round")
    if obs.stopped:
        return HealingDecision(HealingAction.STOPPED, "the run is stopped (atoll stop); nothing is launched")
    if obs.state == "RUNNING":
        return _running(obs, policy)
    if obs.state in ACTIVE_STATES and not (obs.state == "CANCELLING" and obs.cancelled_by_atoll):
        return HealingDecision(HealingAction.ADOPTED, f"its flow run is {obs.state.lower()}")
    if obs.state == "CANCELLED" and not obs.cancelled_by_atoll:
        return HealingDecision(HealingAction.CANCELLED_BY_USER, "a person cancelled its flow run; left alone")
    # No live flow run of ours. A live learner under someone else's lease is left alone.
    if not obs.holds_lease and _alive(obs, policy):
        return HealingDecision(HealingAction.EXTERNAL,
                               f"alive outside our flow runs ({_heartbeat_text(obs)}): started by hand or elsewhere")
    if obs.state is None:
        refused = _launch_refused(obs, policy)
        if refused:
            return HealingDecision(HealingAction.WAITING, f"no flow run; launch held: {refused}")
        return HealingDecision(HealingAction.LAUNCHED, "no flow run yet", launch=True)
    why = "cancelled by atoll" if obs.state in ("CANCELLED", "CANCELLING") else f"its flow run is {obs.state.lower()}"
    refused = _launch_refused(obs, policy)
    if refused:
        return HealingDecision(HealingAction.WAITING, f"{why}; relaunch held: {refused}")
    return HealingDecision(HealingAction.RELAUNCHED, f"{why}; relaunched (it rejoins from the bucket)", launch=True)
