"""The learner-healing policy: what to do about one learner, as a pure function of what was observed.

The training run keeps every learner of its run alive as one long-lived flow run on the learner's
work pool. Each time it looks (``atoll.tasks.learners.LearnerFleet``), it observes, per learner,
the newest flow run (its state type and how long it has been running), how long ago the
synchronizer last saw a contribution from the learner, and its own launch bookkeeping; then
:func:`decide_learner` says what to do, with a reason:

============================  ==================================================================
action                        when
============================  ==================================================================
``finished``                  the run has committed its last round: nothing is launched
``adopted``                   the newest flow run is active (scheduled, pending, running, paused,
                              cancelling), whoever started it
``stale-relaunched``          it is running but silent (no contribution, and running itself, for
                              longer than ``stale_after_s``): cancel it and launch a new one
``cancelled-by-user``         a person cancelled it: leave it cancelled (that is how to take a
                              learner out of a run)
``external``                  no flow run at all, but the synchronizer saw a contribution recently
                              (a learner started outside Prefect)
``launched``                  no flow run yet: launch the first one
``relaunched``                it crashed, failed or completed (or was cancelled by this policy)
                              while the run goes on: launch a new one; it rejoins from the bucket
``waiting``                   a relaunch is due but held back: back-off since the last launch,
                              or ``max_launches`` reached
============================  ==================================================================

Prefect's state names are plain strings here (``"RUNNING"``, ``"CRASHED"`` … the values of
``prefect.client.schemas.objects.StateType``), so this module needs no Prefect. Deadlines of
rounds never depend on it: the synchronizer closes rounds on its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["ACTIVE_STATES", "RELAUNCH_STATES", "HealingAction", "HealingPolicy", "LearnerObservation",
           "HealingDecision", "decide_learner"]

ACTIVE_STATES = frozenset({"SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"})
"""Flow-run state types of a learner that is (about to be) at work: adopted."""

RELAUNCH_STATES = frozenset({"CRASHED", "FAILED", "COMPLETED"})
"""Flow-run state types after which a learner of an unfinished run is launched again."""


class HealingAction(StrEnum):
    FINISHED = "finished"
    ADOPTED = "adopted"
    STALE_RELAUNCHED = "stale-relaunched"
    CANCELLED_BY_USER = "cancelled-by-user"
    EXTERNAL = "external"
    LAUNCHED = "launched"
    RELAUNCHED = "relaunched"
    WAITING = "waiting"


@dataclass(frozen=True, kw_only=True)
class HealingPolicy:
    """The knobs of :func:`decide_learner` (process-local: they change nothing that is trained)."""

    stale_after_s: float = 300.0
    """A running learner silent for longer than this is cancelled and replaced."""

    relaunch_backoff_s: float = 5.0
    """Least time between two launches of one learner."""

    max_launches: int = 50
    """Most flow runs one training-run process launches per learner (then it only waits)."""

    external_within_s: float = 60.0
    """A learner with no flow run counts as running outside Prefect if seen this recently
    (never longer than ``stale_after_s``)."""


@dataclass(frozen=True, kw_only=True)
class LearnerObservation:
    """What was observed about one learner, at one moment."""

    state: str | None = None
    """State type of the learner's newest flow run (``"RUNNING"`` …); None: it has no flow run."""

    running_for_s: float | None = None
    """Seconds since that flow run started running; None: not started, or unknown."""

    last_seen_age_s: float | None = None
    """Seconds since the synchronizer first saw the learner's newest contribution; None: never seen."""

    cancelled_by_us: bool = False
    """The newest flow run was cancelled by this policy (stale), not by a person."""

    launches: int = 0
    """Flow runs launched for this learner so far (by this process)."""

    since_launch_s: float | None = None
    """Seconds since the last launch; None: never launched."""

    finished: bool = False
    """The run has committed its last round."""


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


def _silent_for_s(obs: LearnerObservation) -> float | None:
    """How long a running learner has shown no sign of work: since its last contribution, but never
    longer than its flow run has been running (a fresh incarnation is not blamed for its
    predecessor's silence)."""
    ages = [a for a in (obs.last_seen_age_s, obs.running_for_s) if a is not None]
    return min(ages) if ages else None


def decide_learner(obs: LearnerObservation, policy: HealingPolicy) -> HealingDecision:
    """What to do about one learner, and why. Pure: same observation, same decision."""
    if obs.finished:
        return HealingDecision(HealingAction.FINISHED, "the run has committed its last round")
    if obs.state in ACTIVE_STATES:
        silent = _silent_for_s(obs)
        if obs.state == "RUNNING" and silent is not None and silent > policy.stale_after_s:
            why = f"running but silent for {silent:.0f}s (stale_after_s {policy.stale_after_s:g})"
            refused = _launch_refused(obs, policy)
            if refused:
                return HealingDecision(HealingAction.WAITING, f"{why}; cancelled, relaunch held: {refused}",
                                       cancel=True)
            return HealingDecision(HealingAction.STALE_RELAUNCHED, f"{why}; cancelled and relaunched",
                                   cancel=True, launch=True)
        return HealingDecision(HealingAction.ADOPTED, f"its flow run is {obs.state.lower()}")
    if obs.state == "CANCELLED" and not obs.cancelled_by_us:
        return HealingDecision(HealingAction.CANCELLED_BY_USER, "a person cancelled its flow run; left alone")
    if obs.state is None:
        seen = obs.last_seen_age_s
        if seen is not None and seen < min(policy.external_within_s, policy.stale_after_s):
            return HealingDecision(HealingAction.EXTERNAL,
                                   f"no flow run, but it contributed {seen:.0f}s ago (running outside Prefect)")
        refused = _launch_refused(obs, policy)
        if refused:
            return HealingDecision(HealingAction.WAITING, f"no flow run; launch held: {refused}")
        return HealingDecision(HealingAction.LAUNCHED, "no flow run yet", launch=True)
    why = "cancelled as stale" if obs.state == "CANCELLED" else f"its flow run is {obs.state.lower()}"
    refused = _launch_refused(obs, policy)
    if refused:
        return HealingDecision(HealingAction.WAITING, f"{why}; relaunch held: {refused}")
    return HealingDecision(HealingAction.RELAUNCHED, f"{why}; relaunched (it rejoins from the bucket)", launch=True)
