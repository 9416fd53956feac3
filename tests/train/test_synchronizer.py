"""Synchronizer state machine in one process (fake clock, memory bucket): races, restarts, late."""

from __future__ import annotations

import uuid

from atoll.storage import RunStore
from atoll.train.learner import Learner
from atoll.train.run import create_run
from atoll.train.recipe import smoke_recipe
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fresh_run() -> tuple[str, list[Learner]]:
    url = f"memory://atoll-test-{uuid.uuid4().hex[:8]}/run"
    config, recipe = smoke_recipe(3, max_rounds=1000)
    store = create_run(url, config.replace(initial_grace_s=0.0), recipe)
    return url, [Learner(store, s.learner_id, log=lambda _: None) for s in recipe.learners]


def test_two_synchronizers_race_and_the_loser_adopts_the_winner() -> None:
    url, learners = fresh_run()
    for lr in learners:
        lr.step()  # offsets (0, 1) with H = 2: step 1 publishes fragment 1
        lr.step()  # step 2 -> fragment 0
    clock = Clock()
    a = Synchronizer(RunStore.open(url), clock=clock)
    b = Synchronizer(RunStore.open(url), clock=clock)
    pa, pb = a.poll(), b.poll()
    assert pa.decision.close and pb.decision.close and pa.round == pb.round == 1
    ra, rb = a.close(pa), b.close(pb)
    assert isinstance(ra, RoundSummary) and isinstance(rb, RoundSummary)
    assert ra.won != rb.won
    winner = ra.record if ra.won else rb.record
    assert (ra.record.nonce, rb.record.nonce) == (winner.nonce, winner.nonce)
    assert a.round == b.round == 1 and a.versions == b.versions == [1, 0]
    for name in a.fragments[0]:
        assert a.fragments[0][name].equal(b.fragments[0][name])


def test_restarted_synchronizer_continues_with_the_next_round() -> None:
    url, learners = fresh_run()
    clock = Clock()
    sync = Synchronizer(RunStore.open(url), clock=clock)
    for _ in range(3):
        for lr in learners:
            lr.step()
            lr.step()
        clock.t += 1.0
        while isinstance(sync.tick(), RoundSummary):
            pass
    committed = sync.round
    assert committed >= 3
    again = Synchronizer(RunStore.open(url), clock=clock)
    assert again.round == committed and again.versions == sync.versions
    assert again.ema.to_dict() == sync.ema.to_dict()
    assert again.consumed >= sync.consumed - {k for r in RunStore.open(url).history() for k, why in r.rejected.items()
                                              if not why.final}


def test_late_contribution_is_reconsidered_by_the_next_round_of_its_fragment() -> None:
    url, learners = fresh_run()
    clock = Clock()
    sync = Synchronizer(RunStore.open(url), options=SynchronizerOptions(live_timeout_s=1e9), clock=clock)
    fast, slow = learners[0], learners[1]
    fast.step()
    fast.step()  # fragment 0 due at step 2
    clock.t = 1.0
    poll = sync.poll()  # quorum K=1 at t=1.0, grace 0 -> closes at once with only `fast`
    assert poll.decision.close and [r.learner_id for r in poll.accepted.values()] == [fast.learner_id]
    slow.step()
    slow.step()  # publishes fragment 0 after the poll decided: not part of this round
    summary = sync.close(poll)
    assert [a.learner_id for a in summary.record.accepted] == [fast.learner_id]
    # Round 2 is fragment 1; round 3 is fragment 0 again and must merge slow's (re-anchored) delta.
    for lr in (fast, slow):
        lr.step()
    clock.t = 2.0
    assert isinstance(sync.tick(), RoundSummary)  # round 2 (fragment 1)
    clock.t = 3.0
    r3 = sync.tick()
    if not isinstance(r3, RoundSummary):  # a (tiny, measured) grace window may be open
        clock.t = 10.0
        r3 = sync.tick()
    assert isinstance(r3, RoundSummary) and r3.record.fragment == 0
    merged = {a.learner_id: a.base_version for a in r3.record.accepted}
    assert merged.get(slow.learner_id) == 0  # its base was version 0; current is 1: re-anchored
