"""The training-run supervision policy against a table (pure: Prefect's view + the bucket's view in)."""

from __future__ import annotations

import pytest

from atoll.runs.supervision import (
    SupervisionAction,
    SupervisionPolicy,
    TrainingRunObservation,
    decide_training_run,
)

S = SupervisionAction
POLICY = SupervisionPolicy(heartbeat_timeout_s=60.0, startup_grace_s=300.0, relaunch_backoff_s=10.0,
                           max_relaunches=3)


def obs(state: str | None, **kw) -> TrainingRunObservation:
    return TrainingRunObservation(state=state, **{"since_created_s": 600.0, **kw})


ALIVE = {"holds_lease": True, "heartbeat_age_s": 2.0}

# (case, observation, action, crash, launch, stop)
TABLE = [
    ("finished", obs("CRASHED", finished=True), S.FINISHED, False, False, False),
    ("stopped: never relaunched", obs("CRASHED", stopped=True), S.STOPPED, False, False, False),
    ("stopped beats a person's cancel", obs("CANCELLED", stopped=True), S.STOPPED, False, False, False),
    ("healthy", obs("RUNNING", running_for_s=900, **ALIVE), S.HEALTHY, False, False, False),
    ("starting: no lease yet", obs("RUNNING", running_for_s=20), S.STARTING, False, False, False),
    ("starting: scheduled", obs("SCHEDULED"), S.STARTING, False, False, False),
    ("starting: pending", obs("PENDING"), S.STARTING, False, False, False),
    ("killed: crashed (worker saw exit -9)", obs("CRASHED"), S.RELAUNCHED, False, True, False),
    ("failed short of the last round", obs("FAILED"), S.RELAUNCHED, False, True, False),
    ("zombie: Running, heartbeat stale", obs("RUNNING", running_for_s=900, holds_lease=True, heartbeat_age_s=120.0),
     S.ZOMBIE_RELAUNCHED, True, True, False),
    ("zombie: Running, exited", obs("RUNNING", running_for_s=900, holds_lease=True, heartbeat_age_s=1.0,
                                    exited="fenced"), S.ZOMBIE_RELAUNCHED, True, True, False),
    ("zombie: no lease after the startup grace", obs("RUNNING", running_for_s=400), S.ZOMBIE_RELAUNCHED, True, True,
     False),
    ("relaunch held: back-off", obs("CRASHED", since_created_s=3.0), S.WAITING, False, False, False),
    ("relaunch held: too many in the window", obs("CRASHED", recent_relaunches=3), S.WAITING, False, False, False),
    ("zombie held: still marked crashed", obs("RUNNING", running_for_s=900, holds_lease=True, heartbeat_age_s=999,
                                              recent_relaunches=3), S.WAITING, True, False, False),
    ("a person cancelled it: stop the run", obs("CANCELLED"), S.STOP_REQUESTED, False, False, True),
    ("atoll cancelled it (not a stop): relaunch", obs("CANCELLED", cancelled_by_atoll=True), S.RELAUNCHED, False,
     True, False),
]


@pytest.mark.parametrize("case,observation,action,crash,launch,stop", TABLE, ids=[r[0] for r in TABLE])
def test_decide_training_run(case: str, observation: TrainingRunObservation, action: SupervisionAction,
                             crash: bool, launch: bool, stop: bool) -> None:
    d = decide_training_run(observation, POLICY)
    assert (d.action, d.crash, d.launch, d.stop) == (action, crash, launch, stop), d.reason
    assert d.reason
