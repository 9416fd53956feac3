"""Round pacing in the quorum decision: it holds a quorate round for work, lets it go when the work
arrives or when its bound passes (dead learners), composes with K and grace, and says why."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.core import Arrival, ConfigError, DilocoConfig, QuorumPolicy, TimingEstimates, decide_round
from atoll.core.quorum import pace_until_s
from atoll.core.rejection import RejectionKind

ABCD = ["A", "B", "C", "D"]
STEP = TimingEstimates(step_s=1.0, quorum_s=0.0, sync_s=0.0)
"""One second per inner step: grace = 0.5 * (2 * 1 * 1) = 1 s; the hold ends 8 s after opening."""


def arr(lid: str, t: float, steps: int) -> Arrival:
    return Arrival(learner_id=lid, arrived_at_s=t, c_steps=steps, c_tokens=10 * steps, key=f"{lid}@{t}")


def paced(**kw) -> QuorumPolicy:
    return QuorumPolicy(**{"min_quorum": 1, "grace_factor": 0.5, "overlap_steps": 2, "pace_steps": 8.0, **kw})


def decide(now: float, arrivals: list[Arrival], live=ABCD, policy: QuorumPolicy | None = None,
           timings: TimingEstimates = STEP):
    return decide_round(now_s=now, opened_at_s=0.0, arrivals=arrivals, live_learners=live,
                        policy=policy or paced(), timings=timings)


def test_pacing_holds_a_quorate_round_until_the_work_is_in() -> None:
    got = [arr("A", 1.0, 10), arr("B", 2.0, 6)]  # 16 of 8 x 4 live = 32 steps
    d = decide(3.0, got)
    assert not d.close and d.accepted == ()
    assert d.reason == ("pacing: quorum 1 met (2 in) with 16/32 inner steps of new work (8 per live learner, "
                        "4 live); holding for 5.00s more at most")
    assert (d.quorum_at_s, d.close_at_s, d.paced_at_s, d.recheck_at_s) == (1.0, None, None, 4.0)
    assert d.waiting_for == ("C", "D")
    # without pacing the same round closed at quorum + grace, with A and B
    off = decide(3.0, got, policy=paced(pace_steps=0.0))
    assert off.close and off.close_at_s == 2.0 and [a.learner_id for a in off.accepted] == ["A", "B"]
    assert off.paced_at_s is None and "pac" not in off.reason


def test_pacing_lets_the_round_go_when_the_work_arrives_then_grace_runs() -> None:
    got = [arr("A", 1.0, 10), arr("B", 2.0, 12), arr("C", 3.0, 12)]  # 10, 22, 34 >= 32 at t = 3
    d = decide(3.5, got)
    assert not d.close and (d.quorum_at_s, d.paced_at_s, d.close_at_s, d.recheck_at_s) == (1.0, 3.0, 4.0, 4.0)
    assert d.reason == ("quorum 1 reached (3 in); grace window open for 0.50s more, waiting for 1 live learner(s); "
                        "paced: 34/32 inner steps of new work at +3.00s")
    late = arr("D", 4.5, 8)
    d = decide(5.0, [*got, late])
    assert d.close and [a.learner_id for a in d.accepted] == ["A", "B", "C"] and d.close_at_s == 4.0
    assert d.reason == ("quorum 1 reached at +1.00s, grace 1.00s over: 3 in, 1 live learner(s) not in time; "
                        "paced: 34/32 inner steps of new work at +3.00s")
    ((who, why),) = d.rejected
    assert who == late and why.kind is RejectionKind.LATE  # late counts from pacing's release + grace


def test_pacing_closes_early_once_every_live_learner_is_in_and_the_work_is_met() -> None:
    got = [arr("A", 1.0, 8), arr("B", 2.0, 8), arr("C", 3.0, 8)]
    assert not decide(3.0, got).close  # 24/32: C and its peers are in, D is not: still held
    d = decide(5.0, [*got, arr("D", 5.0, 9)])
    assert d.close and d.close_at_s == 5.0 and d.paced_at_s == 5.0 and len(d.accepted) == 4
    assert d.reason == ("every live learner contributed (4/4); closing early; "
                        "paced: 33/32 inner steps of new work at +5.00s")
    # every live learner in, but not the work: held (they will publish again, with more steps)
    short = [arr("A", 1.0, 2), arr("B", 2.0, 2)]
    assert not decide(3.0, short, live=["A", "B"]).close


def test_the_bound_lets_the_round_go_when_live_learners_cannot_supply_the_work() -> None:
    # C and D died but still count as live: A and B alone never reach 32 steps
    got = [arr("A", 1.0, 8), arr("B", 2.0, 8)]
    assert not decide(7.99, got).close
    d = decide(8.5, got)
    assert not d.close and (d.paced_at_s, d.close_at_s) == (8.0, 9.0)
    d = decide(9.0, got)
    assert d.close and [a.learner_id for a in d.accepted] == ["A", "B"] and d.close_at_s == 9.0
    assert d.reason == ("quorum 1 reached at +1.00s, grace 1.00s over: 2 in, 2 live learner(s) not in time; "
                        "pacing bound +8.00s passed with 16/32 inner steps of new work "
                        "(the live learners did not supply it in time)")
    # once C and D are no longer live, the target is what A and B can produce: 16 steps
    d = decide(2.0, got, live=["A", "B"])
    assert d.close and d.close_at_s == 2.0 and d.reason.endswith("paced: 16/16 inner steps of new work at +2.00s")
    # nobody live: nothing to wait for
    d = decide(2.0, got, live=[])
    assert d.close and d.paced_at_s is None and d.close_at_s == 2.0
    assert d.reason.endswith("; pacing: no live learner to wait for")


def test_the_bound_counts_from_the_opening_and_takes_the_earlier_of_work_and_bound() -> None:
    # the work arrives only after the bound passed: the round was let go at the bound
    d = decide(9.5, [arr("A", 1.0, 8), arr("B", 9.0, 30)])
    assert d.close and d.paced_at_s == 8.0 and d.close_at_s == 9.0 and len(d.accepted) == 2
    assert "pacing bound +8.00s passed with 8/32" in d.reason
    # every live learner in at the bound: close early at the bound, not at the last arrival
    d = decide(8.0, [arr("A", 1.0, 2), arr("B", 2.0, 2)], live=["A", "B"])
    assert d.close and d.close_at_s == 8.0 and d.paced_at_s == 8.0


def test_pacing_never_closes_below_k_and_quorum_still_counts_from_the_kth_arrival() -> None:
    pol = paced(min_quorum=2)
    d = decide(20.0, [arr("A", 1.0, 40)], policy=pol)  # the work, but not K, and no max_wait_s
    assert not d.close and d.reason.startswith("waiting for quorum: 1/2")
    d = decide(3.5, [arr("A", 1.0, 40), arr("B", 3.0, 1)], policy=pol)
    assert not d.close and d.quorum_at_s == 3.0 and d.paced_at_s == 1.0 and d.close_at_s == 4.0


def test_rejected_contributions_carry_no_work() -> None:
    got = [arr("A", 1.0, 20), arr("A", 1.5, 20), Arrival(learner_id="B", arrived_at_s=2.0, c_steps=0, c_tokens=0)]
    d = decide(3.0, got)
    assert not d.close and "20/32 inner steps" in d.reason and len(d.rejected) == 2


def test_hold_bound_without_a_step_time_and_with_max_wait() -> None:
    got = [arr("A", 1.0, 8)]
    d = decide(30.0, got, timings=TimingEstimates())  # no step time yet: bounded by the live learners
    assert not d.close and d.recheck_at_s == 31.0
    assert d.reason.endswith("holding while the live learners can add work (no step time measured yet)")
    pol = paced(max_wait_s=4.0)
    assert pace_until_s(pol, 0.0, 1.0) == 4.0 and pace_until_s(pol, 0.0, None) == 4.0
    assert pace_until_s(paced(), 2.0, 0.5) == 6.0 and pace_until_s(paced(), 0.0, None) is None
    assert pace_until_s(paced(pace_steps=0.0), 0.0, 1.0) is None
    d = decide(5.0, got, policy=pol)
    assert d.close and d.paced_at_s == 4.0 and d.close_at_s == 5.0


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=6),
    steps=st.lists(st.integers(1, 12), min_size=6, max_size=6),
    wait=st.floats(0.0, 10.0),
    n_live=st.integers(0, 6),
)
def test_pacing_never_closes_a_round_sooner_or_with_fewer(times, steps, wait, n_live) -> None:
    got = [arr(f"L{i}", t, steps[i]) for i, t in enumerate(times)]
    now = max(times) + wait  # the caller's clock: nothing has arrived in its future
    live = [f"L{i}" for i in range(n_live)]
    on, off = decide(now, got, live=live), decide(now, got, live=live, policy=paced(pace_steps=0.0))
    assert QuorumPolicy().pace_steps == 0.0 and off.paced_at_s is None
    if on.close:
        assert off.close and on.close_at_s is not None and off.close_at_s is not None
        assert on.close_at_s >= off.close_at_s
        assert {a.learner_id for a in on.accepted} >= {a.learner_id for a in off.accepted}


@settings(max_examples=200, deadline=None)
@given(
    fast=st.lists(st.tuples(st.floats(0.0, 20.0), st.integers(1, 12)), min_size=1, max_size=3),
    straggler_at=st.floats(0.0, 40.0),
    pace=st.sampled_from([0.25, 0.5, 1.0]),
    step_s=st.floats(0.1, 2.0),
)
def test_a_straggler_holds_a_paced_round_no_longer_than_the_bound_and_grace(fast, straggler_at, pace, step_s) -> None:
    """A live learner that is slow (or silent) never keeps a paced round open past the pacing bound
    (``pace_steps`` step times after the round opened) plus the grace window, counted from the
    later of that bound and the quorum; arriving after that cut, it is late."""
    h = 8
    policy = paced(pace_steps=pace * h)
    timings = TimingEstimates(step_s=step_s, quorum_s=0.0, sync_s=0.0)
    grace = 0.5 * 2 * step_s  # gamma * tau * xi_step (P = H, one step between rounds)
    got = [arr(f"F{i}", t, steps) for i, (t, steps) in enumerate(fast)]
    live = [a.learner_id for a in got] + ["S"]
    cut = max(min(a.arrived_at_s for a in got), policy.pace_steps * step_s) + grace
    arrivals = [*got, arr("S", straggler_at, h)]
    d = decide_round(now_s=cut, opened_at_s=0.0, arrivals=[a for a in arrivals if a.arrived_at_s <= cut],
                     live_learners=live, policy=policy, timings=timings)
    if max(a.arrived_at_s for a in got) <= cut:
        assert d.close and d.close_at_s is not None and d.close_at_s <= cut + 1e-9
    later = decide_round(now_s=max(cut, straggler_at) + 1.0, opened_at_s=0.0, arrivals=arrivals,
                         live_learners=live, policy=policy, timings=timings)
    assert later.close and later.close_at_s is not None and later.close_at_s <= cut + 1e-9
    late = {a.learner_id for a, why in later.rejected if why.kind is RejectionKind.LATE}
    assert late == {a.learner_id for a in arrivals if a.arrived_at_s > later.close_at_s}
    assert ("S" in late) == (straggler_at > later.close_at_s)


def test_config_round_pacing_is_a_fraction_of_h_validated_and_off_by_default() -> None:
    assert DilocoConfig().round_pacing == 0.0 and DilocoConfig().quorum_policy().pace_steps == 0.0
    c = DilocoConfig(num_fragments=8, inner_steps=8, round_pacing=0.75)
    assert c.quorum_policy().pace_steps == 6.0
    for bad in (-0.1, 1.01, math.nan, True):
        with pytest.raises(ConfigError, match="round_pacing"):
            DilocoConfig(round_pacing=bad)
    old = c.to_dict()
    del old["round_pacing"]  # a run created before the field existed
    assert DilocoConfig.from_dict(old).round_pacing == 0.0
    with pytest.raises(ValueError, match="pace_steps"):
        QuorumPolicy(pace_steps=-1.0)
