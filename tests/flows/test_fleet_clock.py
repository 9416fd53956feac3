"""LearnerFleet takes time from its injectable clock: back-off and ``max_launches`` are decided on
that clock, with the fleet's own launch bookkeeping, and relaunches follow Failed and Completed
flow runs. Prefect is replaced by a small in-memory client and launcher (no server, no sleeping):
the real Prefect path is covered by test_deploy.py."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.states import Completed, Failed, Scheduled, State

from atoll.runs.healing import HealingAction, HealingPolicy
from atoll.tasks import fleet as learners_mod
from atoll.tasks.fleet import LearnerFleet, learner_tag, run_tag


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakePrefect:
    """The flow runs the fleet sees (newest first by ``created``) and a launcher that adds to them."""

    def __init__(self) -> None:
        self.runs: list[FlowRun] = []
        self.deployment_calls: list[dict[str, Any]] = []
        self._t0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)

    # the sync client, as a context manager
    def __enter__(self) -> FakePrefect:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def read_flow_runs(self, *, limit: int | None = None, offset: int = 0, **kwargs: Any) -> list[FlowRun]:
        rows = list(reversed(self.runs))
        return rows[offset:offset + limit] if limit else rows[offset:]

    def set_flow_run_state(self, flow_run_id: Any, state: State, force: bool = False) -> None:
        self.set_state(flow_run_id, state)

    def set_state(self, flow_run_id: Any, state: State) -> None:
        self.runs = [fr.model_copy(update={"state": state}) if fr.id == flow_run_id else fr for fr in self.runs]

    def run_deployment(self, name: str, **kwargs: Any) -> FlowRun:
        self.deployment_calls.append({"name": name, **kwargs})
        fr = FlowRun(name=kwargs["flow_run_name"], flow_id=uuid.uuid4(), state=Scheduled(), tags=kwargs["tags"],
                     parameters=kwargs["parameters"], created=self._t0 + dt.timedelta(seconds=len(self.runs)))
        self.runs.append(fr)
        return fr

    def newest(self) -> FlowRun:
        return self.runs[-1]


@pytest.fixture
def prefect(monkeypatch: pytest.MonkeyPatch) -> FakePrefect:
    fake = FakePrefect()
    monkeypatch.setattr(learners_mod, "get_client", lambda sync_client=True: fake)
    monkeypatch.setattr(learners_mod, "run_deployment", fake.run_deployment)
    return fake


def _fleet(clock: FakeClock, **policy: Any) -> LearnerFleet:
    return LearnerFleet(run_url="file:///nowhere/run-c", run_id="run-c", learners=[{"learner_id": "l0", "pool": "p"}],
                        policy=HealingPolicy(**policy), clock=clock)


def _action(fleet: LearnerFleet) -> tuple[HealingAction, str]:
    [a] = fleet.reconcile()
    return a.action, a.reason


def test_relaunch_waits_out_the_backoff_on_the_fleet_clock(prefect: FakePrefect) -> None:
    clock = FakeClock()
    fleet = _fleet(clock, relaunch_backoff_s=5.0, max_launches=10)
    assert _action(fleet)[0] == HealingAction.LAUNCHED
    assert fleet.last_launch == {"l0": 1000.0} and fleet.launches == {"l0": 1}
    first = prefect.newest()
    assert {run_tag("run-c"), learner_tag("l0")} <= set(first.tags) and first.name == "l0-1"
    assert prefect.deployment_calls[0]["name"] == "atoll-learner/p"

    prefect.set_state(first.id, Failed())
    clock.t = 1006.0  # past the back-off (no real time passes: the fleet must read this clock)
    assert _action(fleet)[0] == HealingAction.RELAUNCHED
    assert fleet.last_launch == {"l0": 1006.0} and prefect.newest().name == "l0-2"

    prefect.set_state(prefect.newest().id, Failed())
    clock.t = 1008.0  # 2 s after the relaunch: held back
    action, reason = _action(fleet)
    assert action == HealingAction.WAITING and "back-off: launched 2.0s ago" in reason
    clock.t = 1010.9
    assert _action(fleet)[0] == HealingAction.WAITING
    assert len(prefect.runs) == 2 and fleet.launches == {"l0": 2}  # waiting launches nothing
    clock.t = 1011.0  # exactly relaunch_backoff_s after the last launch
    assert _action(fleet)[0] == HealingAction.RELAUNCHED
    assert len(prefect.runs) == 3 and fleet.launches == {"l0": 3}
    assert [a.action for a in fleet.history] == ["launched", "relaunched", "waiting", "waiting", "relaunched"]


def test_relaunch_after_completed_and_max_launches(prefect: FakePrefect) -> None:
    clock = FakeClock()
    fleet = _fleet(clock, relaunch_backoff_s=1.0, max_launches=2)
    assert _action(fleet)[0] == HealingAction.LAUNCHED
    prefect.set_state(prefect.newest().id, Completed())  # the run goes on: a learner that returned rejoins
    clock.t += 1.0
    action, reason = _action(fleet)
    assert action == HealingAction.RELAUNCHED and "completed" in reason
    prefect.set_state(prefect.newest().id, Failed())
    clock.t += 3600.0  # however long it waits, max_launches holds
    action, reason = _action(fleet)
    assert action == HealingAction.WAITING and "2 launches already (max_launches 2)" in reason
    assert len(prefect.runs) == 2
