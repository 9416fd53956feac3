"""Synchronizer state machine in one process (fake clock, memory bucket): races, restarts, late."""

from __future__ import annotations

import uuid

import pytest
import torch

from atoll.core.quorum import Arrival, QuorumDecision, TimingEma
from atoll.core.retry import RetryPolicy
from atoll.core.synchronize import FragmentRoundResult
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage.records import AcceptedContribution, BlobRef, ContributionRecord
from atoll.storage.wire import WireCounts
from atoll.train.inner import RecipeLearner, run_learner
from atoll.train.learner import FetchError, LearnerOptions
from atoll.train.recipe import smoke_recipe
from atoll.train.round_stats import next_timings, round_stats
from atoll.train.run import create_run
from atoll.train.synchronizer import RoundPoll, RoundSummary, Synchronizer, SynchronizerOptions


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fresh_run() -> tuple[str, list[RecipeLearner]]:
    url = f"memory://atoll-test-{uuid.uuid4().hex[:8]}/run"
    config, recipe = smoke_recipe(3, max_rounds=1000)
    store = LearnerStore.beside(create_run(url, config.replace(initial_grace_s=0.0), recipe))
    return url, [RecipeLearner(store, s.learner_id, log=lambda _: None) for s in recipe.learners]


def test_two_synchronizers_race_and_the_loser_adopts_the_winner() -> None:
    url, learners = fresh_run()
    for lr in learners:
        lr.step()  # offsets (0, 1) with H = 2: step 1 publishes fragment 1
        lr.step()  # step 2 -> fragment 0
    clock = Clock()
    a = Synchronizer(SynchronizerStore.open(url), clock=clock)
    b = Synchronizer(SynchronizerStore.open(url), clock=clock)
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
    sync = Synchronizer(SynchronizerStore.open(url), clock=clock)
    store = RunReader.open(url)
    for _ in range(3):
        for lr in learners:
            lr.step()
            lr.step()
        clock.t += 1.0
        while isinstance(sync.tick(), RoundSummary):
            pass
        for lr in learners:  # what each learner's fetcher does: adopt what was committed
            for rec in store.history(max(lr.versions) + 1, sync.round):
                lr.adopt(rec.round, rec.fragment, store.read_global_fragment(rec.fragment, rec.round))
    committed = sync.round
    assert committed >= 3
    again = Synchronizer(SynchronizerStore.open(url), clock=clock)
    assert again.round == committed and again.versions == sync.versions
    assert again.ema.to_dict() == sync.ema.to_dict()
    # What a restart rebuilds: the keys consumed by the last 2P rounds (older ones are never listed
    # again: a round lists only the current and the previous version of its fragment).
    recent = store.history(max(1, committed - 2 * store.plan.num_fragments + 1), committed)
    window = {a.key for r in recent for a in r.accepted} | {k for r in recent for k, why in r.rejected.items()
                                                             if why.final}
    assert again.consumed >= sync.consumed & window and again.consumed == window


def test_late_contribution_is_reconsidered_by_the_next_round_of_its_fragment() -> None:
    url, learners = fresh_run()
    clock = Clock()
    sync = Synchronizer(SynchronizerStore.open(url), options=SynchronizerOptions(live_timeout_s=1e9), clock=clock)
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


# --- the pure pieces of a round's close ------------------------------------------------------

def _poll_with(records: dict, *, quorum_at: float | None, opened: float = 0.0, polled: float = 5.0,
               arrivals: tuple[float, ...] = ()) -> RoundPoll:
    accepted = tuple(Arrival(learner_id=r.learner_id, arrived_at_s=t, c_steps=r.c_steps, c_tokens=r.c_tokens, key=k)
                     for (k, r), t in zip(records.items(), arrivals, strict=True))
    decision = QuorumDecision(close=True, accepted=accepted, rejected=(), reason="test", grace_s=0.25,
                              quorum_at_s=quorum_at, close_at_s=polled, waiting_for=("l9",))
    return RoundPoll(round=3, fragment=1, decision=decision, opened_at_s=opened, polled_at_s=polled,
                     accepted=records, rejected={})


def _record(lid: str, steps: int, tokens: int, nbytes: int, **info) -> ContributionRecord:
    return ContributionRecord(key=f"k-{lid}", learner_id=lid, fragment=1, base_version=0, c_steps=steps,
                              c_tokens=tokens, payload=BlobRef(sha256="0" * 64, nbytes=nbytes), tensors={},
                              created_at=0.0, info=info)


def test_round_stats_by_hand() -> None:
    recs = {"k-a": _record("a", 4, 400, 100, pool="fast", loss=2.5, step_time_s=0.1),
            "k-b": _record("b", 2, 200, 50, pool="slow", loss=float("nan"), step_time_s=0.3)}
    poll = _poll_with(recs, quorum_at=2.0, arrivals=(1.5, 2.0))
    accepted = [AcceptedContribution(key="k-a", learner_id="a", weight=1.0, base_version=0, c_steps=4, c_tokens=400)]
    result = FragmentRoundResult(new_params={}, update={}, weights={"k-a": 1.0}, update_norm=0.5)
    stats = round_stats(poll, accepted, result, fragment_numel=10)
    assert stats == {
        "quorum_s": 0.5,  # from the first arrival (1.5), not from the round's opening
        "grace_s": 0.25, "wait_s": 5.0, "reason": "test", "waiting_for": ["l9"],
        "tokens": 400, "steps": 4,  # only what was merged
        "bytes_in": 100, "bytes_out_per_learner": 40, "update_norm": 0.5,
        "pools": {"a": "fast", "b": "slow"}, "learner_loss": {"a": 2.5},  # NaN loss is not reported
    }
    nothing = round_stats(poll, [], None, fragment_numel=10)
    assert nothing["bytes_out_per_learner"] == 0 and nothing["update_norm"] == 0.0 and "val_loss" not in nothing


def test_round_stats_carry_the_round_s_traffic_and_each_contributor_s_report() -> None:
    wire = {"puts": 3, "gets": 9, "heads": 0, "lists": 4, "deletes": 0, "bytes_up": 1000, "bytes_down": 5000}
    recs = {"k-a": _record("a", 4, 400, 100, wire={**wire, "tokens": 800, "meter": "m-1"}),
            "k-b": _record("b", 2, 200, 50, wire={"bytes_up": -3, "gets": 2**60, "puts": 1.0, "tokens": "many",
                                                   "meter": "x" * 33}),
            "k-c": _record("c", 2, 200, 50, wire="not counts")}
    poll = _poll_with(recs, quorum_at=2.0, arrivals=(1.5, 2.0, 2.0))
    stats = round_stats(poll, [], None, fragment_numel=10, wire=WireCounts(gets=2, lists=7))
    assert stats["wire"] == {"puts": 0, "gets": 2, "heads": 0, "lists": 7, "deletes": 0, "bytes_up": 0, "bytes_down": 0}
    assert stats["learner_wire"] == {
        "a": {**wire, "tokens": 800, "meter": "m-1"},
        "b": {"puts": 0, "gets": 2**50, "heads": 0, "lists": 0, "deletes": 0, "bytes_up": 0, "bytes_down": 0,
              "tokens": 0, "meter": ""},  # clipped; a float or a string is not a count; a meter is a short name
    }  # c reported no counts at all: left out


def test_each_round_counts_the_synchronizer_s_traffic_since_its_previous_commit() -> None:
    url, learners = fresh_run()
    sync = Synchronizer(SynchronizerStore.open(url), clock=Clock())
    start = sync.store.store.wire_counts()
    rounds = []
    while len(rounds) < 3:
        for lr in learners:
            lr.step()
        sync.clock.t += 1.0  # type: ignore[attr-defined]
        while isinstance(s := sync.tick(), RoundSummary):
            rounds.append(s.record)
    per_round = [WireCounts(**r.stats["wire"]) for r in rounds]
    # Every byte the store sent is in exactly one round, or after the last commit.
    assert sum(per_round, WireCounts()) + sync.round_wire() == sync.store.store.wire_counts() - start
    assert all(w.lists >= 1 and w.bytes_down > 0 for w in per_round)  # each round listed and read deltas
    assert all(w.puts >= 3 for w in per_round[1:])  # the previous commit: fragment, momentum, record (+ head)
    assert rounds[-1].stats["learner_wire"].keys() == {a.learner_id for a in rounds[-1].accepted}


def test_next_timings_by_hand() -> None:
    recs = {"k-a": _record("a", 4, 400, 1, step_time_s=0.1), "k-b": _record("b", 4, 400, 1, step_time_s=0.3),
            "k-c": _record("c", 4, 400, 1, step_time_s=1e999), "k-d": _record("d", 4, 400, 1, step_time_s=True)}
    poll = _poll_with(recs, quorum_at=2.0, arrivals=(1.0, 2.0, 2.0, 2.0))
    ema = TimingEma(decay=0.5, values={"step_s": 1.0, "quorum_s": 4.0, "sync_s": 2.0})
    seen = {"a": 5.0, "b": 5.0, "c": 5.0, "d": 5.0}  # observed cadences (s per step) above every report
    out = next_timings(ema, poll, sync_s=0.5, steady=True, observed=seen)
    # step: median of the finite reports (0.1, 0.3) = 0.2; quorum: 2.0 - 1.0 = 1.0
    assert out.to_dict() == {"decay": 0.5, "step_s": 0.6, "quorum_s": 2.5, "sync_s": 1.25}
    assert ema.get("step_s") == 1.0  # pure: the input is untouched
    # The reports count only inside what was observed: 1e999 and True count as no report, and a
    # learner never observed twice gives no sample at all.
    tight = next_timings(ema, poll, sync_s=0.5, steady=True, observed={"a": 0.05, "b": 0.2})
    assert tight.get("step_s") == 0.5 * 1.0 + 0.5 * 0.125  # median(min(0.1, 0.05), min(0.3, 0.2))
    unseen = next_timings(ema, poll, sync_s=0.5, steady=True)
    assert unseen.get("step_s") == 1.0
    cold = next_timings(ema, poll, sync_s=0.5, steady=False, observed=seen)  # first round after a restart
    assert cold.get("quorum_s") == 4.0


def test_learner_fetch_failures_are_bounded_and_loud(monkeypatch) -> None:
    url, learners = fresh_run()
    store = LearnerStore.open(url)
    calls = []

    def broken(self, after_round):
        calls.append(after_round)
        raise OSError("bucket unreachable")

    monkeypatch.setattr(LearnerStore, "poll_commits", broken)
    logs: list[str] = []
    with pytest.raises(FetchError, match="after 3 attempts.*bucket unreachable"):
        run_learner(store, "learner-0", log=logs.append,
                    options=LearnerOptions(fetch_retry=RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0),
                                           poll_interval_s=0.01))
    assert len(calls) == 3
    assert sum("retrying" in line for line in logs) == 2 and any("giving up" in line for line in logs)


def test_a_repeat_of_merged_work_lands_once_and_counts_once() -> None:
    """A learner's contribution is all its work on the fragment since it aligned it. One published
    against the same version as its previous, already merged contribution (it had not adopted
    that round yet) holds the merged work again. Merging it does not apply that work twice: the
    outer gradient is the distance from the *current* global fragment to the learner's, so with
    outer lr 1 and no momentum the global fragment becomes exactly the learner's fragment, not
    the base plus both deltas. Goodput and merged-work accounting count its steps once."""
    from atoll.runs.goodput import GoodputTracker, MergedWork

    url = f"memory://atoll-test-{uuid.uuid4().hex[:8]}/run"
    config, recipe = smoke_recipe(3, max_rounds=1000)
    create_run(url, config.replace(initial_grace_s=0.0, outer_lr=1.0, outer_momentum=0.0), recipe)
    store = LearnerStore.open(url)
    fast = RecipeLearner(store, recipe.learners[0].learner_id, log=lambda _: None)
    base = {n: t.clone() for n, t in fast.plan.select(fast.params, 0).items()}
    clock = Clock()
    sync = Synchronizer(SynchronizerStore.open(url), options=SynchronizerOptions(live_timeout_s=1e9), clock=clock)
    fast.step()
    fast.step()  # fragment 0 against version 0, 2 steps
    first = {n: t.clone() for n, t in fast.plan.select(fast.params, 0).items()}
    clock.t = 1.0
    r1 = sync.tick()
    assert isinstance(r1, RoundSummary) and r1.record.fragment == 0
    assert [(a.learner_id, a.c_steps) for a in r1.record.accepted] == [(fast.learner_id, 2)]
    fast.step()
    fast.step()  # fragment 0 again, still against version 0 (never adopted round 1): 4 steps, 2 merged
    endpoint = {n: t.clone() for n, t in fast.plan.select(fast.params, 0).items()}
    summaries = []
    while sync.round < 3 and clock.t < 20:
        clock.t += 1.0
        out = sync.tick()
        if isinstance(out, RoundSummary):
            summaries.append(out)
    r3 = summaries[-1]
    assert r3.record.round == 3 and r3.record.fragment == 0
    assert [(a.learner_id, a.base_version, a.c_steps) for a in r3.record.accepted] == [(fast.learner_id, 0, 4)]
    merged = store.read_global_fragment(0, 3)
    for n, t in merged.items():
        torch.testing.assert_close(t, endpoint[n], rtol=0, atol=1e-6)  # the learner's fragment, once
        twice = endpoint[n] + (first[n] - base[n])  # both deltas applied: the first 2 steps twice
        if (first[n] - base[n]).abs().max() > 1e-4:
            assert (t - twice).abs().max() > 1e-5
    # Work: 2 steps merged in round 1, 2 more in round 3 (not 2 + 4).
    ledger = MergedWork()
    new = [ledger.round(rec).get(fast.learner_id, (0, 0))[0] for rec in store.history(1, 3)]
    assert (new[0], new[2]) == (2, 2)
    tracker = GoodputTracker(store)
    tracker.update()
    fragment1 = sum(a.c_steps for rec in store.history(1, 3) if rec.fragment == 1 for a in rec.accepted)
    assert tracker.learners[fast.learner_id].merged_steps == 4 + fragment1
