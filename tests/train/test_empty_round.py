"""A round that commits with nothing merged (``updated=False``), through the train loops.

The synchronizer commits such a round when the quorum let contributions in but the merge refused
every one of them; its versions, fragment values and outer momentum must stay put, in memory and
for a synchronizer restarted from the bucket. A learner's background fetcher must step over such
a round (there is no new fragment version to read) and keep adopting the versions that follow.
(tests/storage/test_empty_round.py covers the bucket side on every backend.)
"""

from __future__ import annotations

import uuid

import torch

from atoll.core.compress import EncodedTensor
from atoll.core.rejection import RejectionKind
from atoll.core.retry import RetryPolicy
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, SynchronizerStore
from atoll.train.inner import RecipeLearner, run_learner
from atoll.train.learner import LearnerOptions
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def new_run(learners: int, max_rounds: int) -> LearnerStore:
    """A new run, as its learners' handle."""
    config, recipe = smoke_recipe(learners, max_rounds=max_rounds)
    return LearnerStore.beside(create_run(f"memory://atoll-empty-{uuid.uuid4().hex[:8]}/run",
                                          config.replace(initial_grace_s=0.0), recipe))


def publish_nan(store: LearnerStore, fragment: int, base_version: int, learner_id: str = "rogue") -> str:
    """A contribution whose delta is NaN: valid on the wire, refused by the merge."""
    delta = {n: EncodedTensor("fp32", tuple(s), {"data": torch.full(tuple(s), float("nan"))})
             for n, s in store.manifest.fragment_shapes(fragment).items()}
    return store.publish_contribution(learner_id, fragment, base_version, Counters(c_steps=2, c_tokens=64), delta).key


def commit_next(sync: Synchronizer, clock: Clock) -> RoundSummary:
    """Tick until the open round commits, moving the fake clock to each recheck time (grace)."""
    for _ in range(100):
        out = sync.tick()
        if isinstance(out, RoundSummary):
            return out
        assert out.recheck_at_s is not None, out.reason
        clock.t = max(clock.t, out.recheck_at_s)
    raise AssertionError("the round never closed")


def snapshot(sync: Synchronizer) -> tuple:
    return (sync.versions.copy(), [{n: t.clone() for n, t in f.items()} for f in sync.fragments],
            [{k: v.clone() for k, v in opt.state_dict().items()} for opt in sync.optimizers])


def assert_same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    for fa, fb in zip(a[1] + a[2], b[1] + b[2], strict=True):
        assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_synchronizer_versions_values_and_momentum_stay_put_after_a_round_with_nothing_merged() -> None:
    store = new_run(3, max_rounds=1000)
    learners = [RecipeLearner(store, f"learner-{i}", log=lambda _: None) for i in range(3)]
    clock = Clock()
    sync = Synchronizer(SynchronizerStore.open(store.url), clock=clock, options=SynchronizerOptions(live_timeout_s=1e9))
    for lr in learners:
        lr.step()  # step 1 publishes fragment 1 (H = 2, P = 2)
        lr.step()  # step 2 publishes fragment 0
    clock.t = 1.0
    merged = [commit_next(sync, clock), commit_next(sync, clock)]  # rounds 1 (fragment 0) and 2 (fragment 1)
    assert all(s.record.updated for s in merged)
    assert sync.versions == [1, 2] and all(opt.state_dict() for opt in sync.optimizers)
    before = snapshot(sync)

    rogue = publish_nan(store, 0, base_version=1)  # the only candidate for round 3 (fragment 0)
    clock.t += 1.0
    out = commit_next(sync, clock)
    assert out.won
    rec = out.record
    assert (rec.round, rec.fragment, rec.updated, rec.accepted) == (3, 0, False, ())
    assert rec.rejected[rogue].kind is RejectionKind.NON_FINITE
    assert rec.versions == (1, 2)
    assert rec.stats["tokens"] == 0 and rec.stats["bytes_out_per_learner"] == 0 and rec.stats["update_norm"] == 0.0
    assert sync.round == 3
    assert_same(snapshot(sync), before)

    # A synchronizer restarted from the bucket sees the same state, and does not merge the rogue again.
    again = Synchronizer(SynchronizerStore.open(store.url), clock=clock, options=SynchronizerOptions(live_timeout_s=1e9))
    assert again.round == 3
    assert_same(snapshot(again), before)
    assert rogue in again.consumed

    # The next round of fragment 0 merges real work on top of the unchanged version 1.
    for lr in learners:
        for rec in lr.store.poll_commits(0):
            if rec.updated:
                lr.adopt(rec.round, rec.fragment, lr.store.read_global_fragment(rec.fragment, rec.round))
        assert lr.versions == [1, 2]
        lr.step()
        lr.step()
    clock.t += 1.0
    r4 = commit_next(again, clock)  # round 4: fragment 1
    r5 = commit_next(again, clock)  # round 5: fragment 0, on base version 1
    assert r4.record.updated and r5.record.fragment == 0 and r5.record.updated
    assert {a.base_version for a in r5.record.accepted} == {1}
    assert again.versions == [5, 4]


def test_the_learner_fetcher_steps_over_a_round_with_nothing_merged() -> None:
    """The real fetcher thread: round 1 merged nothing, round 2 has a new fragment-1 version.

    Reading "fragment 0 at version 1" would fail (round 1 wrote no fragment) and, with a retry
    policy of one attempt, stop the learner with FetchError; adopting it would count an alignment.
    """
    store = new_run(1, max_rounds=3)
    committer = SynchronizerStore.open(store.url)
    lines: list[str] = []
    state = {"round": 0}

    def should_stop() -> bool:  # called by the learner loop before every step
        if state["round"] == 0:
            committer.commit_round(1, 0, params=None)  # nothing merged
            frag1 = committer.read_global_fragment(1, 0)
            committer.commit_round(2, 1, params={n: t + 0.25 for n, t in frag1.items()})
            state["round"] = 2
        return False

    def log(line: str) -> None:
        lines.append(line)
        if state["round"] == 2 and " aligned 1 " in line:  # round 2's version was adopted
            committer.commit_round(3, 0, params=None)  # the last round, again with nothing merged
            state["round"] = 3

    summary = run_learner(store, "learner-0", should_stop=should_stop, log=log,
                          options=LearnerOptions(poll_interval_s=0.01, log_every_steps=1, max_steps=400,
                                                 fetch_retry=RetryPolicy(attempts=1, base_delay_s=0.0)))
    assert state["round"] == 3, lines[-3:]  # round 2's version arrived; the fetcher did not choke on round 1
    assert summary.aligned == 1  # round 2 only: rounds 1 and 3 carried no new version
    assert summary.steps < 400  # the loop ended because round 3 (the last) was seen
    assert not any("fetcher:" in line for line in lines)  # no failed poll
