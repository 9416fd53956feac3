"""The learner-healing policy against a table: observation in, action (and whether to cancel/launch) out."""

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
POLICY = HealingPolicy(stale_after_s=300.0, relaunch_backoff_s=5.0, max_launches=3, external_within_s=60.0)


def obs(**kw) -> LearnerObservation:
    return LearnerObservation(**kw)


# (case, observation, action, cancel, launch)
TABLE = [
    # -- the run is over: nothing is launched, whatever the state ---------------------------------
    ("finished, crashed", obs(state="CRASHED", launches=1, since_launch_s=900, finished=True), A.FINISHED,
     False, False),
    ("finished, no flow run", obs(finished=True), A.FINISHED, False, False),
    # -- no flow run yet -----------------------------------------------------------------------------
    ("first launch", obs(), A.LAUNCHED, False, True),
    ("external: contributing outside Prefect", obs(last_seen_age_s=12.0), A.EXTERNAL, False, False),
    ("external is bounded by external_within_s", obs(last_seen_age_s=61.0), A.LAUNCHED, False, True),
    ("no flow run, launched moments ago: back-off", obs(launches=1, since_launch_s=1.0), A.WAITING, False, False),
    ("no flow run, max_launches reached", obs(launches=3, since_launch_s=900), A.WAITING, False, False),
    # -- active flow runs are adopted ----------------------------------------------------------------
    *[(f"adopt {s.lower()}", obs(state=s, launches=1, since_launch_s=1.0), A.ADOPTED, False, False)
      for s in sorted(ACTIVE_STATES)],
    ("running, contributed recently", obs(state="RUNNING", running_for_s=4000, last_seen_age_s=20), A.ADOPTED,
     False, False),
    ("running, never seen, young", obs(state="RUNNING", running_for_s=120), A.ADOPTED, False, False),
    ("pending long ago is not stale (only running ones are)", obs(state="PENDING", last_seen_age_s=9999), A.ADOPTED,
     False, False),
    # -- stale: running but silent -------------------------------------------------------------------
    ("stale: silent since its last contribution", obs(state="RUNNING", running_for_s=4000, last_seen_age_s=400),
     A.STALE_RELAUNCHED, True, True),
    ("stale: running long, never contributed", obs(state="RUNNING", running_for_s=400), A.STALE_RELAUNCHED, True, True),
    ("a fresh incarnation is not blamed for its predecessor's silence",
     obs(state="RUNNING", running_for_s=30, last_seen_age_s=900, launches=2, since_launch_s=40), A.ADOPTED,
     False, False),
    ("stale at max_launches: cancelled, not relaunched",
     obs(state="RUNNING", running_for_s=4000, last_seen_age_s=400, launches=3, since_launch_s=4000), A.WAITING,
     True, False),
    # -- relaunch after the flow run ended while the run goes on -------------------------------------
    ("relaunch after Crashed", obs(state="CRASHED", launches=1, since_launch_s=60), A.RELAUNCHED, False, True),
    ("relaunch after Failed", obs(state="FAILED", launches=1, since_launch_s=60), A.RELAUNCHED, False, True),
    ("relaunch after Completed", obs(state="COMPLETED", launches=1, since_launch_s=60), A.RELAUNCHED, False, True),
    ("relaunch one started by someone else", obs(state="CRASHED"), A.RELAUNCHED, False, True),
    ("relaunch one we cancelled as stale", obs(state="CANCELLED", cancelled_by_us=True, launches=1, since_launch_s=60),
     A.RELAUNCHED, False, True),
    ("back-off: crashed right after its launch", obs(state="CRASHED", launches=1, since_launch_s=2.0), A.WAITING,
     False, False),
    ("back-off is over", obs(state="CRASHED", launches=1, since_launch_s=5.0), A.RELAUNCHED, False, True),
    ("max_launches reached", obs(state="FAILED", launches=3, since_launch_s=600), A.WAITING, False, False),
    # -- a person's cancel is respected --------------------------------------------------------------
    ("cancelled by a person", obs(state="CANCELLED", launches=1, since_launch_s=600), A.CANCELLED_BY_USER, False,
     False),
    ("cancelled by a person, even if it was contributing", obs(state="CANCELLED", last_seen_age_s=1.0),
     A.CANCELLED_BY_USER, False, False),
]


@pytest.mark.parametrize("case,observation,action,cancel,launch", TABLE, ids=[row[0] for row in TABLE])
def test_decide_learner(case: str, observation: LearnerObservation, action: HealingAction, cancel: bool,
                        launch: bool) -> None:
    decision = decide_learner(observation, POLICY)
    assert (decision.action, decision.cancel, decision.launch) == (action, cancel, launch), decision.reason
    assert decision.reason


def test_external_window_never_exceeds_stale_after() -> None:
    policy = HealingPolicy(stale_after_s=30.0, external_within_s=60.0)
    assert decide_learner(obs(last_seen_age_s=40.0), policy).action == A.LAUNCHED
    assert decide_learner(obs(last_seen_age_s=20.0), policy).action == A.EXTERNAL


def test_actions_keep_their_names() -> None:
    """The fleet reports these strings (logs, the watch-learners task result, docs/prefect.md)."""
    assert {str(a) for a in A} == {"finished", "adopted", "stale-relaunched", "cancelled-by-user", "external",
                                   "launched", "relaunched", "waiting"}
