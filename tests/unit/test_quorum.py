"""Quorum + grace decision: the paper's formula, early close, never below K, late arrivals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.core import Arrival, QuorumPolicy, TimingEma, TimingEstimates, decide_round, grace_window_s
from atoll.core.rejection import RejectionKind


def arr(lid: str, t: float, steps: int = 4, tokens: int = 100) -> Arrival:
    return Arrival(learner_id=lid, arrived_at_s=t, c_steps=steps, c_tokens=tokens)


@pytest.mark.parametrize(
    ("tau", "between", "gamma", "step", "quorum", "sync", "expected"),
    [
        (2, 1.0, 0.5, 1.0, 0.3, 0.2, 0.75),  # 0.5 * (2*1 - 0.5)
        (2, 1.0, 0.5, 0.1, 0.3, 0.2, 0.0),  # slack negative -> 0
        (4, 3.0, 0.25, 0.5, 1.0, 0.5, 1.125),  # 0.25 * (4*3*0.5 - 1.5)
        (0, 1.0, 0.9, 5.0, 0.0, 0.0, 0.0),  # tau = 0: no slack
        (2, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0),  # gamma = 0: no grace
    ],
)
def test_grace_matches_paper_formula(tau, between, gamma, step, quorum, sync, expected) -> None:
    pol = QuorumPolicy(overlap_steps=tau, steps_between_rounds=between, grace_factor=gamma)
    got = grace_window_s(pol, TimingEstimates(step_s=step, quorum_s=quorum, sync_s=sync))
    assert got == pytest.approx(expected)


def test_grace_before_any_measurement_uses_initial() -> None:
    assert grace_window_s(QuorumPolicy(initial_grace_s=2.5), TimingEstimates()) == 2.5


@given(
    tau=st.integers(0, 10),
    gamma=st.floats(0, 0.99),
    step=st.floats(0, 100),
    quorum=st.floats(0, 100),
    sync=st.floats(0, 100),
)
def test_grace_never_negative(tau, gamma, step, quorum, sync) -> None:
    pol = QuorumPolicy(overlap_steps=tau, grace_factor=gamma)
    assert grace_window_s(pol, TimingEstimates(step_s=step, quorum_s=quorum, sync_s=sync)) >= 0


TIMINGS = TimingEstimates(step_s=1.0, quorum_s=0.0, sync_s=0.0)  # grace = 0.5 * 2 * 1 = 1.0 s


def test_waits_below_quorum_and_says_why() -> None:
    pol = QuorumPolicy(min_quorum=2, poll_interval_s=0.5)
    d = decide_round(now_s=10.0, opened_at_s=0.0, arrivals=[arr("a", 3.0)], live_learners={"a", "b", "c"}, policy=pol, timings=TIMINGS)
    assert not d.close and d.recheck_at_s == 10.5 and d.quorum_at_s is None
    assert "1/2" in d.reason and d.waiting_for == ("b", "c")


def test_closes_after_grace_and_rejects_late() -> None:
    pol = QuorumPolicy(min_quorum=1)
    arrivals = [arr("a", 1.0), arr("b", 1.8), arr("c", 2.5)]
    live = {"a", "b", "c", "d"}
    d = decide_round(now_s=1.5, opened_at_s=0.0, arrivals=arrivals[:1], live_learners=live, policy=pol, timings=TIMINGS)
    assert not d.close and d.close_at_s == 2.0 and d.recheck_at_s == 2.0 and d.grace_s == 1.0
    # Polled late at 3.0: c arrived after the window closed at 2.0 -> rejected as late.
    d = decide_round(now_s=3.0, opened_at_s=0.0, arrivals=arrivals, live_learners=live, policy=pol, timings=TIMINGS)
    assert d.close and [a.learner_id for a in d.accepted] == ["a", "b"]
    assert [(a.learner_id, r.kind) for a, r in d.rejected] == [("c", RejectionKind.LATE)]
    assert not d.rejected[0][1].final  # the next round of this fragment reconsiders it
    assert d.quorum_at_s == 1.0 and d.waiting_for == ("c", "d")


def test_closes_early_when_every_live_learner_contributed() -> None:
    pol = QuorumPolicy(min_quorum=1)
    d = decide_round(
        now_s=1.2, opened_at_s=0.0, arrivals=[arr("a", 1.0), arr("b", 1.1)], live_learners={"a", "b"}, policy=pol, timings=TIMINGS
    )
    assert d.close and "every live learner" in d.reason and len(d.accepted) == 2


@given(
    k=st.integers(1, 5),
    times=st.lists(st.floats(0, 10), min_size=0, max_size=8),
    now=st.floats(0, 30),
    n_live=st.integers(0, 8),
)
@settings(max_examples=200, deadline=None)
def test_never_closes_below_k(k, times, now, n_live) -> None:
    arrivals = [arr(f"l{i}", t) for i, t in enumerate(times) if t <= now]
    live = {f"l{i}" for i in range(n_live)}
    d = decide_round(now_s=now, opened_at_s=0.0, arrivals=arrivals, live_learners=live, policy=QuorumPolicy(min_quorum=k), timings=TIMINGS)
    if d.close:
        assert len(d.accepted) >= k
        assert all(a.arrived_at_s <= d.close_at_s for a in d.accepted)
    else:
        assert d.recheck_at_s is not None and d.recheck_at_s > now


def test_rejects_zero_steps_and_duplicates() -> None:
    pol = QuorumPolicy(min_quorum=1)
    arrivals = [arr("a", 0.5, steps=0), arr("b", 1.0), arr("b", 1.1)]
    d = decide_round(now_s=5.0, opened_at_s=0.0, arrivals=arrivals, live_learners={"a", "b", "c"}, policy=pol, timings=TIMINGS)
    assert d.close and [a.learner_id for a in d.accepted] == ["b"]
    reasons = {a.learner_id + str(a.arrived_at_s): r for a, r in d.rejected}
    assert reasons["a0.5"].kind is RejectionKind.NO_STEPS and "c_steps=0" in reasons["a0.5"].detail
    assert reasons["b1.1"].kind is RejectionKind.DUPLICATE and reasons["b1.1"].final


def test_deadline_closes_below_quorum_only_with_something() -> None:
    pol = QuorumPolicy(min_quorum=3, max_wait_s=10.0)
    d = decide_round(now_s=11.0, opened_at_s=0.0, arrivals=[], live_learners={"a"}, policy=pol, timings=TIMINGS)
    assert not d.close and "only 1 live" in d.reason
    d = decide_round(now_s=11.0, opened_at_s=0.0, arrivals=[arr("a", 2.0)], live_learners={"a", "b", "c"}, policy=pol, timings=TIMINGS)
    assert d.close and d.reason.startswith("deadline")
    d = decide_round(now_s=5.0, opened_at_s=0.0, arrivals=[arr("a", 2.0)], live_learners={"a", "b", "c"}, policy=pol, timings=TIMINGS)
    assert not d.close and d.recheck_at_s == 6.0


def test_policy_validation() -> None:
    for kwargs, knob in [
        ({"min_quorum": 0}, "min_quorum"),
        ({"grace_factor": 1.0}, "grace_factor"),
        ({"overlap_steps": -1}, "overlap_steps"),
        ({"steps_between_rounds": 0}, "steps_between_rounds"),
        ({"poll_interval_s": 0}, "poll_interval_s"),
        ({"max_wait_s": -1}, "max_wait_s"),
    ]:
        with pytest.raises(ValueError, match=knob):
            QuorumPolicy(**kwargs)


def test_timing_ema() -> None:
    ema = TimingEma(decay=0.5)
    assert ema.estimates() == TimingEstimates()
    assert ema.update("step_s", 2.0) == 2.0  # first sample initialises
    assert ema.update("step_s", 4.0) == 3.0
    ema.update("sync_s", 1.0)
    restored = TimingEma.from_dict(ema.to_dict())
    assert restored.estimates() == ema.estimates() == TimingEstimates(step_s=3.0, sync_s=1.0)
    with pytest.raises(KeyError, match="unknown timing 'lunch_s'"):
        ema.update("lunch_s", 1.0)
    with pytest.raises(ValueError, match="timing sample for step_s must be finite and >= 0, got nan"):
        ema.update("step_s", float("nan"))
    with pytest.raises(ValueError, match="ema_decay"):
        TimingEma(decay=1.0)
