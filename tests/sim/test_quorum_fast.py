"""The simulator's fast quorum path is core's decision, field for field and run for run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atoll.core.quorum as core_quorum
import atoll.sim.decoupled as decoupled_mod
from atoll.core.quorum import (
    Arrival,
    QuorumPolicy,
    TimingEstimates,
    decide_round,
    grace_window_s,
)
from atoll.sim.decoupled import (
    DecoupledSetup,
    equal_islands,
    simulate_decoupled,
    two_speed_islands,
)
from atoll.sim.fleet import failure_trace
from atoll.sim.presets import paper_costs
from atoll.sim.quorum_fast import as_tuple, decide_fast

HOUR = 3600.0
IDS = [f"L{i}" for i in range(12)]  # L1 < L10 < L11 < L2 as strings: ties sort like core's

times = st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.5, 3.0, 7.25, 10.0]) | st.floats(0.0, 20.0)
arrival = st.builds(
    Arrival,
    learner_id=st.sampled_from(IDS),
    arrived_at_s=times,
    c_steps=st.integers(-1, 4),
    c_tokens=st.integers(-1, 4),
    key=st.sampled_from(["", "a", "b", "0/1/2"]),
)
policies = st.builds(
    QuorumPolicy,
    min_quorum=st.integers(1, 5),
    grace_factor=st.sampled_from([0.0, 0.25, 0.5, 0.9]),
    overlap_steps=st.integers(0, 3),
    steps_between_rounds=st.sampled_from([1.0, 2.0, 0.5]),
    initial_grace_s=st.sampled_from([0.0, 1.5]),
    poll_interval_s=st.sampled_from([0.1, 1.0, 1e9]),
    max_wait_s=st.none() | st.sampled_from([0.5, 3.0, 12.0]),
    pace_steps=st.sampled_from([0.0, 0.0, 1.0, 2.5, 4.0]),
)
timings = st.builds(
    TimingEstimates,
    step_s=st.none() | st.floats(0.0, 10.0),
    quorum_s=st.none() | st.floats(0.0, 5.0),
    sync_s=st.none() | st.floats(0.0, 5.0),
)


def assert_same(now, opened, arrivals, live, policy, tm) -> None:
    core = decide_round(
        now_s=now, opened_at_s=opened, arrivals=arrivals, live_learners=live, policy=policy, timings=tm
    )
    fast = decide_fast(now, opened, [as_tuple(a) for a in arrivals], set(live), policy, grace_window_s(policy, tm),
                       tm.step_s)
    assert fast.close == core.close
    assert list(fast.accepted) == [as_tuple(a) for a in core.accepted]
    assert list(fast.rejected) == [as_tuple(a) for a, _ in core.rejected]
    assert fast.quorum_at_s == core.quorum_at_s
    assert fast.close_at_s == core.close_at_s
    assert fast.recheck_at_s == core.recheck_at_s
    assert fast.paced_at_s == core.paced_at_s


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, max_size=10),
    live=st.lists(st.sampled_from(IDS), max_size=8),
    policy=policies,
    tm=timings,
    opened=st.floats(0.0, 5.0),
    dt=st.floats(0.0, 30.0),
)
def test_decide_fast_equals_decide_round(arrivals, live, policy, tm, opened, dt) -> None:
    assert_same(opened + dt, opened, arrivals, live, policy, tm)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), arrivals=st.lists(arrival, min_size=1, max_size=10), policy=policies, tm=timings)
def test_decide_fast_equals_decide_round_when_live_learners_are_in(data, arrivals, policy, tm) -> None:
    # live drawn from the contributors (plus maybe one more): exercises the early close and late rules
    pool = sorted({a.learner_id for a in arrivals}) + ["L11"]
    live = data.draw(st.lists(st.sampled_from(pool), max_size=len(pool)))
    now = data.draw(st.sampled_from([a.arrived_at_s for a in arrivals]) | st.floats(0.0, 25.0))
    assert_same(now, 0.0, arrivals, live, policy, tm)


def test_decide_fast_hand_cases() -> None:
    pol = QuorumPolicy(min_quorum=2, grace_factor=0.5, overlap_steps=2)
    tm = TimingEstimates(step_s=4.0, quorum_s=1.0, sync_s=1.0)  # grace = 0.5 * (8 - 2) = 3
    a = [Arrival(learner_id=f"L{i}", arrived_at_s=t, c_steps=1, c_tokens=1) for i, t in enumerate([1.0, 2.0, 6.0])]
    for now in (1.5, 2.0, 4.9, 5.0, 6.0, 9.0):
        for live in (["L0", "L1"], ["L0", "L1", "L2"], ["L0", "L1", "L2", "L3"], []):
            assert_same(now, 0.0, a[: 2 + (now >= 6.0)], live, pol, tm)
    d = decide_fast(5.0, 0.0, [as_tuple(x) for x in a], {"L0", "L1", "L2", "L3"}, pol, 3.0)
    assert d.close and [x[1] for x in d.accepted] == ["L0", "L1"] and d.close_at_s == 5.0
    assert [x[1] for x in d.rejected] == ["L2"]  # late: after 2.0 + 3.0


# -- the simulator gives identical runs with either path ----------------------------------------


def _setup(islands, k, gamma, spread, **kw) -> DecoupledSetup:
    pol = QuorumPolicy(min_quorum=k, grace_factor=gamma, overlap_steps=2, poll_interval_s=1e9, **kw)
    return DecoupledSetup(islands=islands, policy=pol, step_s=10.0, step_spread=spread, sync_s=1.0)


CASES = {
    "K=1+grace, M=8": (equal_islands(8), 1, 0.5, 0.0, {}),
    "two-speed K=M": (two_speed_islands(8), 8, 0.0, 0.1, {}),
    "two-speed K=1+grace": (two_speed_islands(8), 1, 0.5, 0.1, {}),
    "K=2, M=4, noise": (equal_islands(4), 2, 0.5, 0.2, {}),
    "K=3, max_wait": (equal_islands(5), 3, 0.3, 0.1, {"max_wait_s": 25.0}),
    "K=1+grace, paced": (two_speed_islands(6), 1, 0.5, 0.1, {"pace_steps": 12.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_simulation_is_identical_with_core_decisions(case: str) -> None:
    islands, k, gamma, spread, kw = CASES[case]
    costs = paper_costs()
    trace = failure_trace(1_200_000, 2 * HOUR, costs, seed=11)
    setup = _setup(islands, k, gamma, spread, **kw)
    fast = simulate_decoupled(trace, costs, setup, seed=3, quorum="fast")
    core = simulate_decoupled(trace, costs, setup, seed=3, quorum="core")
    assert fast.details["rounds"] > 50
    assert fast.goodput == core.goodput and fast.uptime == core.uptime
    assert fast.details == core.details
    assert fast.timeline_active.tolist() == core.timeline_active.tolist()


def test_core_path_closes_rounds_with_decide_round(monkeypatch: pytest.MonkeyPatch) -> None:
    assert decoupled_mod.decide_round is core_quorum.decide_round
    assert decoupled_mod.TimingEma is core_quorum.TimingEma
    calls = []

    def spy(**kw):
        d = core_quorum.decide_round(**kw)
        calls.append(d)
        return d

    monkeypatch.setattr(decoupled_mod, "decide_round", spy)
    costs = paper_costs()
    trace = failure_trace(100_000, HOUR, costs, seed=1)
    r = simulate_decoupled(trace, costs, _setup(equal_islands(4), 1, 0.5, 0.1), quorum="core")
    assert r.details["rounds"] == sum(d.close for d in calls) > 0
    calls.clear()
    simulate_decoupled(trace, costs, _setup(equal_islands(4), 1, 0.5, 0.1))  # the fast path is the default
    assert calls == []
    with pytest.raises(ValueError, match="quorum"):
        simulate_decoupled(trace, costs, _setup(equal_islands(2), 1, 0.5, 0.0), quorum="slow")  # type: ignore[arg-type]


def test_fast_path_sees_a_smaller_live_set_like_core() -> None:
    # a learner that pauses completes a round early in both paths (live set shrinks)
    pol = QuorumPolicy(min_quorum=1, grace_factor=0.5, overlap_steps=2)
    tm = TimingEstimates(step_s=10.0)
    a = [Arrival(learner_id="L0", arrived_at_s=1.0, c_steps=1, c_tokens=1)]
    assert_same(2.0, 1.0, a, ["L0", "L1"], pol, tm)
    assert_same(2.0, 1.0, a, ["L0"], pol, tm)
    assert decide_fast(2.0, 1.0, [as_tuple(a[0])], {"L0"}, pol, 10.0).close
    assert not decide_fast(2.0, 1.0, [as_tuple(a[0])], {"L0", "L1"}, pol, 10.0).close
