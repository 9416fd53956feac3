"""Masters by replay (``DilocoConfig.master_snapshot_every``): a real synchronizer that writes a
fragment's fp32 master on two versions out of every M leaves a bucket whose every round reads
back bit for bit as a run writing every master does (masters, momentum, views), resumes exactly
from any round, writes fewer bytes, and refuses a replay that does not reproduce the sha256 its
record names. Contributions are published deterministically per round, one of them against the
fragment's previous version so that rounds re-anchor; on a local folder and on S3 (moto).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from atoll.core.downlink import downlink_step
from atoll.core.weights import Counters
from atoll.storage import LearnerStore, OperatorStore, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.storage.retention import GLOBAL_STATE, RetentionPolicy, apply_prune, plan_prune
from atoll.storage.validation import InvalidInput
from atoll.train.recipe import smoke_recipe
from atoll.train.run import TokenBounds, create_run
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions
from conftest import Backend

ROUNDS = 14  # fragment 0's versions 1, 3, ..., 13: depths 1, 2, 3, 0, 1, 2, 3 at M = 4
LEARNERS = ("learner-0", "learner-1")


@dataclass
class Run:
    url: str
    options: dict[str, Any] | None
    tokens_per_step: int
    published: set[int] = field(default_factory=set)

    def publish(self, learners: LearnerStore, round_: int, fragment: int, bases: tuple[int, int]) -> None:
        """Round ``round_``'s inputs, once per run: learner-0 against the fragment's current
        version, learner-1 against the version before it (the round re-anchors it)."""
        if round_ in self.published:
            return
        self.published.add(round_)
        shapes = learners.manifest.fragment_shapes(fragment)
        for i, (lid, base) in enumerate(zip(LEARNERS, bases, strict=True)):
            gen = torch.Generator().manual_seed(1000 * round_ + i)
            delta = {n: 1e-3 * torch.randn(s, generator=gen) for n, s in shapes.items()}
            learners.publish_contribution(lid, fragment, base, Counters(c_steps=2, c_tokens=2 * self.tokens_per_step),
                                          delta, info={"step_time_s": 1.0})


def new_run(backend: Backend, *, every: int, momentum: float) -> Run:
    config, recipe = smoke_recipe(len(LEARNERS), max_rounds=1000)
    url = P.join_url(backend.new_url(), f"run-{uuid.uuid4().hex[:8]}")
    create_run(url, config.replace(initial_grace_s=0.0, downlink_compression="int4", outer_momentum=momentum,
                                   master_snapshot_every=every), recipe, storage_options=backend.storage_options)
    bounds = TokenBounds.of_recipe(recipe)
    assert bounds is not None
    return Run(url, backend.storage_options, bounds.of(LEARNERS[0]))


def synchronizer(run: Run) -> Synchronizer:
    return Synchronizer(SynchronizerStore.open(run.url, run.options), options=SynchronizerOptions(poll_interval_s=0.01))


def drive(run: Run, sync: Synchronizer, until: int) -> None:
    """Publish each round's inputs and tick until round ``until`` is committed, both merged."""
    learners = LearnerStore.open(run.url, run.options)
    now = [0.0]
    sync.clock = lambda: now[0]
    while sync.round < until:
        r = sync.round + 1
        p = sync.fragment_of_round(r)
        current = sync.versions[p]
        previous = max(current - 2, 0)  # the fragment's version before (rounds alternate fragments)
        run.publish(learners, r, p, (current, previous))
        now[0] += 10.0
        out = sync.tick()
        if isinstance(out, RoundSummary):
            assert out.won and len(out.record.accepted) == len(LEARNERS), (out.line(), out.record.rejected)


def state_of(reader: RunReader, round_: int) -> dict[str, torch.Tensor]:
    st = reader.read_global_state(round_)
    assert st.restored == {}, st.restored
    out = {f"param.{n}": t for n, t in st.params.items()}
    out.update({f"momentum.{p}.{n}": t for p, m in st.momentum.items() for n, t in m.items()})
    views = reader.read_global_state(round_, momentum=False, view=True)
    out.update({f"view.{n}": t for n, t in views.params.items()})
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_replayed_masters_read_back_bit_for_bit_and_resume_exactly(backend: Backend, momentum: float) -> None:
    every, sparse = new_run(backend, every=1, momentum=momentum), new_run(backend, every=4, momentum=momentum)
    drive(every, synchronizer(every), ROUNDS)
    first = synchronizer(sparse)
    drive(sparse, first, 11)  # fragment 0 at v11 (depth 2), fragment 1 at v10 (depth 1)
    first.shutdown()
    restarted = synchronizer(sparse)  # rebuilds v11 by replaying round 11 from the pair (v7, v9)
    held = restarted.merger.previous(0)
    assert held is not None and held[0] == 9 and restarted.merger.previous(1) is None
    assert_identical(held[1], RunReader.open(sparse.url, sparse.options).read_global_fragment(0, 9))
    drive(sparse, restarted, ROUNDS)  # and re-anchors round 13's contribution against that v9
    a, b = RunReader.open(every.url, every.options), RunReader.open(sparse.url, sparse.options)
    depths = [b.fragment_state(0, v).master_depth for v in range(1, ROUNDS, 2)]
    assert depths == [1, 2, 3, 0, 1, 2, 3]
    for r in range(1, ROUNDS + 1):
        assert_identical(state_of(a, r), state_of(b, r))
    # Fewer bytes: the masters (and momentum) of versions at depth 2 and 3 are named, not written.
    def stored(reader: RunReader) -> int:  # master and momentum bytes written (the downlink is the same)
        entries = [reader.read_commit(r).state[(r - 1) % 2] for r in range(1, ROUNDS + 1)]
        return sum(ref.nbytes for st in entries for ref in st.refs() if ref in (st.params, st.momentum))

    stored_a, stored_b = stored(a), stored(b)
    skipped = [r for r in range(1, ROUNDS + 1) if b.read_commit(r).state[(r - 1) % 2].master_depth > 1]
    assert len(skipped) == 8  # per fragment: depths 1, 2, 3, 0, 1, 2, 3
    left_out = [a.read_commit(r).state[(r - 1) % 2] for r in skipped]
    assert stored_a - stored_b >= sum(st.params.nbytes for st in left_out)
    assert all(b.read_commit(r).state[(r - 1) % 2].momentum is None for r in skipped)
    assert a.verify().ok and b.verify().ok
    # One fragment's state alone (a split synchronizer's merger): what the whole read holds of it.
    whole, part = b.read_global_state(ROUNDS), b.read_global_state(ROUNDS, fragments={1})
    assert part.versions == whole.versions and sorted(part.params) == sorted(b.plan.fragments[1])
    assert_identical(part.params, b.plan.select(whole.params, 1))
    assert part.momentum[0] == {} and part.momentum[1].keys() == whole.momentum[1].keys()
    assert_identical(part.momentum[1], whole.momentum[1])


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_replay_that_does_not_reproduce_its_master_is_refused_and_the_reader_falls_back(backend: Backend) -> None:
    run = new_run(backend, every=4, momentum=0.0)
    drive(run, synchronizer(run), 5)  # fragment 0: v1 (depth 1), v3 (2), v5 (3)
    reader = RunReader.open(run.url, run.options)
    assert reader.fragment_state(0, 5).master_depth == 3
    good = reader.read_global_fragment(0, 5)
    # A contribution v5's round merged is gone: its master cannot be rebuilt.
    key = reader.read_commit(5).accepted[0].key
    reader.store.delete(key)
    fresh = RunReader.open(run.url, run.options)
    with pytest.raises(InvalidInput):
        fresh.read_global_fragment(0, 5)
    st = fresh.read_global_state(5)
    assert st.restored[0].startswith("v5 unreadable") and "using v1" in st.restored[0]
    assert not torch.equal(st.params[next(iter(good))], good[next(iter(good))])


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_retention_keeps_what_a_replay_needs_and_the_run_resumes_after_a_prune(backend: Backend) -> None:
    every, sparse = new_run(backend, every=1, momentum=0.9), new_run(backend, every=4, momentum=0.9)
    drive(every, synchronizer(every), ROUNDS + 2)
    drive(sparse, synchronizer(sparse), ROUNDS)
    reader = RunReader.open(sparse.url, sparse.options)
    # The window is rounds 11-14: the versions current before it are v9 (fragment 0, depth 1) and
    # v10 (fragment 1, depth 1); v11 and v13 replay from the pair (v7, v9), v12 and v14 from (v8, v10).
    plan = plan_prune(reader, RetentionPolicy(keep_rounds=4, min_age_s=60), now=time.time() + 7200)
    assert plan.floors == (7, 8)
    apply_prune(OperatorStore.beside(reader), plan)
    assert plan.deleted(GLOBAL_STATE)[0] > 0
    fresh = RunReader.open(sparse.url, sparse.options)
    expected = RunReader.open(every.url, every.options)
    for r in range(11, ROUNDS + 1):
        assert_identical(state_of(fresh, r), state_of(expected, r))
    assert fresh.verify().ok
    drive(sparse, synchronizer(sparse), ROUNDS + 2)  # a restarted synchronizer after the prune
    assert_identical(state_of(RunReader.open(sparse.url, sparse.options), ROUNDS + 2), state_of(expected, ROUNDS + 2))


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_verify_reports_a_latest_master_that_cannot_be_rebuilt(backend: Backend) -> None:
    run = new_run(backend, every=4, momentum=0.0)
    drive(run, synchronizer(run), 5)
    reader = RunReader.open(run.url, run.options)
    reader.store.delete(reader.read_commit(5).accepted[0].key)
    report = RunReader.open(run.url, run.options).verify()
    assert not report.ok
    assert any("fragment 0 v5's master cannot be rebuilt by replay" in p for p in report.problems), report.problems


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_checkpoint_writes_the_synchronizers_copy_when_it_is_the_rounds_state(backend: Backend) -> None:
    run = new_run(backend, every=4, momentum=0.0)
    drive(run, synchronizer(run), 8)  # round 8: both fragments at depth 3, their masters not written
    store = SynchronizerStore.open(run.url, run.options)
    state = RunReader.open(run.url, run.options).read_global_state(8).params
    reads: list[object] = []
    read = store.read_global_state
    store.read_global_state = lambda *a, **kw: reads.append(a) or read(*a, **kw)  # type: ignore[method-assign]
    held = dict(reversed(list(state.items())))  # another order: the file keeps the bucket's
    info = store.write_checkpoint(8, params=held)
    assert reads == [] and info.round == 8
    saved = RunReader.open(run.url, run.options).load_checkpoint(8)
    assert saved.keys() == state.keys() and all(saved[n].equal(state[n]) for n in state)
    # A copy that is not the round's state is not written: the bucket's is, the same file.
    again = store.write_checkpoint(8, params={n: t + 1 for n, t in state.items()})
    assert len(reads) == 1 and again.sha256 == info.sha256


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_with_an_fp32_downlink_or_a_gpu_merge_every_master_is_written(backend: Backend) -> None:
    config, recipe = smoke_recipe(len(LEARNERS), max_rounds=1000)
    url = P.join_url(backend.new_url(), "fp32-down")
    create_run(url, config.replace(initial_grace_s=0.0, master_snapshot_every=16), recipe)  # learners read masters
    run = Run(url, None, TokenBounds.of_recipe(recipe).of(LEARNERS[0]))  # type: ignore[union-attr]
    drive(run, synchronizer(run), 6)
    reader = RunReader.open(url)
    assert all(st.master_depth == 0 for r in range(1, 7) for st in reader.read_commit(r).state)
    # A merge off the CPU names and writes its master whatever the config says (replay_masters=False).
    store = SynchronizerStore.open(new_run(backend, every=16, momentum=0.0).url)
    params = store.read_global_fragment(0, 0)
    for r in (1, 2, 3):
        new = {n: t + r for n, t in params.items()}
        step = downlink_step(new, params, "int4", block_size=store.config.compression_block_size)
        store.commit_round(r, 0, params=new, downlink=step, downlink_chained=False, replay_masters=False)
    assert [store.read_commit(r).state[0].master_depth for r in (1, 2, 3)] == [0, 0, 0]
