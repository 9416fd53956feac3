"""The learner-healing policy against a table: observation in, action (and whether to cancel/launch) out.

Liveness comes from the bucket (lease + heartbeat), never from Prefect's state alone."""

from __future__ import annotations

import pytest

from atoll.runs.healing import (
    ACTIVE_STATES,
    HealingAction,
    HealingPolicy,
    LearnerObservation,
    decide_learner,
)

A = HealingAction
POLICY = HealingPolicy(heartbeat_timeout_s=60.0, startup_grace_s=300.0, relaunch_backoff_s=5.0, max_launches=3)


def obs(**kw) -> LearnerObservation:
    return LearnerObservation(**kw)


ALIVE = {"holds_lease": True, "heartbeat_age_s": 3.0}
DEAD = {"holds_lease": True, "heartbeat_age_s": 400.0}

# (case, observation, action, cancel, launch)
TABLE = [
    # -- the run is over or stopped: nothing is launched, whatever the state ----------------------
    ("finished, crashed", obs(state="CRASHED", launches=1, since_launch_s=900, finished=True), A.FINISHED,
     False, False),
    ("finished, no flow run", obs(finished=True), A.FINISHED, False, False),
    ("stopped, crashed", obs(state="CRASHED", stopped=True), A.STOPPED, False, False),
    ("stopped, zombie", obs(state="RUNNING", running_for_s=900, stopped=True, **DEAD), A.STOPPED, False, False),
    # -- no flow run yet -----------------------------------------------------------------------------
    ("first launch", obs(), A.LAUNCHED, False, True),
    ("external: alive under a lease no flow run of ours holds", obs(heartbeat_age_s=12.0), A.EXTERNAL, False, False),
    ("a stale outside learner is replaced", obs(heartbeat_age_s=61.0), A.LAUNCHED, False, True),
    ("an outside learner that exited is replaced", obs(heartbeat_age_s=2.0, exited="orphaned"), A.LAUNCHED,
     False, True),
    ("no flow run, launched moments ago: back-off", obs(launches=1, since_launch_s=1.0), A.WAITING, False, False),
    ("no flow run, max_launches reached", obs(launches=3, since_launch_s=900), A.WAITING, False, False),
    # -- active flow runs --------------------------------------------------------------------------
    *[(f"adopt {s.lower()}", obs(state=s, launches=1, since_launch_s=1.0), A.ADOPTED, False, False)
      for s in sorted(ACTIVE_STATES - {"RUNNING"})],
    ("pending for long is adopted (waiting for a worker)", obs(state="PENDING", heartbeat_age_s=9999), A.ADOPTED,
     False, False),
    ("running and alive", obs(state="RUNNING", running_for_s=4000, **ALIVE), A.ADOPTED, False, False),
    ("running, starting: no lease yet", obs(state="RUNNING", running_for_s=20), A.ADOPTED, False, False),
    ("running, starting, predecessor's stale heartbeat is not its own",
     obs(state="RUNNING", running_for_s=20, heartbeat_age_s=900), A.ADOPTED, False, False),
    ("running, exiting by itself", obs(state="RUNNING", running_for_s=900, holds_lease=True, heartbeat_age_s=1.0,
                                       exited="orphaned"), A.ADOPTED, False, False),
    # -- zombies: Prefect says Running, the bucket says dead ----------------------------------------
    ("zombie: heartbeat stale (process gone, adopted on resume)",
     obs(state="RUNNING", running_for_s=4000, **DEAD), A.ZOMBIE_RELAUNCHED, True, True),
    ("zombie: exited long ago but still Running", obs(state="RUNNING", running_for_s=4000, holds_lease=True,
                                                      heartbeat_age_s=500.0, exited="sigterm"),
     A.ZOMBIE_RELAUNCHED, True, True),
    ("zombie: never took a lease within the startup grace", obs(state="RUNNING", running_for_s=400),
     A.ZOMBIE_RELAUNCHED, True, True),
    ("zombie at max_launches: cancelled, not relaunched",
     obs(state="RUNNING", running_for_s=4000, launches=3, since_launch_s=4000, **DEAD), A.WAITING, True, False),
    # -- relaunch after the flow run ended while the run goes on -------------------------------------
    ("relaunch after Crashed", obs(state="CRASHED", launches=1, since_launch_s=60), A.RELAUNCHED, False, True),
    ("relaunch after Crashed at once, though its last heartbeat is fresh",
     obs(state="CRASHED", launches=1, since_launch_s=60, **ALIVE), A.RELAUNCHED, False, True),
    ("relaunch after Failed", obs(state="FAILED", launches=1, since_launch_s=60), A.RELAUNCHED, False, True),
    ("relaunch after Completed (orphaned)", obs(state="COMPLETED", launches=1, since_launch_s=60, holds_lease=True,
                                                heartbeat_age_s=100.0, exited="orphaned"),
     A.RELAUNCHED, False, True),
    ("relaunch one started by someone else", obs(state="CRASHED"), A.RELAUNCHED, False, True),
    ("crashed, but another copy is alive outside Prefect", obs(state="CRASHED", heartbeat_age_s=2.0), A.EXTERNAL,
     False, False),
    ("relaunch one atoll cancelled", obs(state="CANCELLED", cancelled_by_atoll=True, launches=1, since_launch_s=60),
     A.RELAUNCHED, False, True),
    ("relaunch one atoll is still cancelling (its worker may be gone)",
     obs(state="CANCELLING", cancelled_by_atoll=True, launches=1, since_launch_s=60), A.RELAUNCHED, False, True),
    ("back-off: crashed right after its launch", obs(state="CRASHED", launches=1, since_launch_s=2.0), A.WAITING,
     False, False),
    ("back-off is over", obs(state="CRASHED", launches=1, since_launch_s=5.0), A.RELAUNCHED, False, True),
    ("max_launches reached", obs(state="FAILED", launches=3, since_launch_s=600), A.WAITING, False, False),
    # -- a person's cancel is respected --------------------------------------------------------------
    ("cancelled by a person", obs(state="CANCELLED", launches=1, since_launch_s=600), A.CANCELLED_BY_USER, False,
     False),
    ("cancelled by a person, even if it was alive", obs(state="CANCELLED", **ALIVE), A.CANCELLED_BY_USER, False,
     False),
]


@pytest.mark.parametrize("case,observation,action,cancel,launch", TABLE, ids=[row[0] for row in TABLE])
def test_decide_learner(case: str, observation: LearnerObservation, action: HealingAction, cancel: bool,
                        launch: bool) -> None:
    decision = decide_learner(observation, POLICY)
    assert (decision.action, decision.cancel, decision.launch) == (action, cancel, launch), decision.reason
    assert decision.reason


def test_actions_keep_their_names() -> None:
    """The fleet reports these strings (logs, the watch-learners task result, docs/prefect.md)."""
    assert {str(a) for a in A} == {"finished", "stopped", "adopted", "zombie-relaunched", "cancelled-by-user",
                                   "external", "launched", "relaunched", "waiting"}
