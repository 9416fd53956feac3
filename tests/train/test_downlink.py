"""The downlink, end to end on a real local-folder bucket: learners read only what they adopt, and
with a compressed downlink they hold the published view to the last bit, across a synchronizer
restart, a joiner, damaged objects and a run of learner threads that trains."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from atoll.core.downlink import downlink_step, drift_bound
from atoll.storage import LearnerStore, RunHandle, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.storage.paths import to_url
from atoll.storage.records import CommitRecord
from atoll.storage.wire import WireCounts
from atoll.train.evaluator import Evaluator
from atoll.train.fetcher import Fetcher, Follower
from atoll.train.inner import InnerLoop, RecipeLearner
from atoll.train.learner import Learner, LearnerOptions
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run, make_evaluator
from atoll.train.session import LearnerSession
from atoll.train.sync_loop import run_synchronizer
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

Tensors = dict[str, torch.Tensor]


def new_run(tmp_path: Path, codec: str = "int4", *, learners: int = 2, rounds: int = 1000,
            outer_momentum: float = 0.9, snapshot_every: int = 1) -> SynchronizerStore:
    """A run; ``snapshot_every=1`` (a view with every version) unless a test is about snapshots."""
    config, recipe = smoke_recipe(learners, max_rounds=rounds)
    config = config.replace(initial_grace_s=0.0, downlink_compression=codec, outer_momentum=outer_momentum,
                            downlink_snapshot_every=snapshot_every)
    return create_run(to_url(str(tmp_path / "run")), config, recipe)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def blob_file(store: RunHandle, sha256: str) -> Path:
    return Path(store.url.removeprefix("file://")) / P.blob_key(sha256)


class Committer:
    """New master versions by hand (the previous one plus noise), published as the synchronizer's
    commit path publishes them."""

    def __init__(self, store: SynchronizerStore) -> None:
        self.store = store
        self.master = [store.read_global_fragment(p, 0) for p in range(store.plan.num_fragments)]
        self.view = [dict(m) for m in self.master]
        self.g = torch.Generator().manual_seed(0)
        self.round = 0

    def commit(self, p: int) -> CommitRecord:
        self.round += 1
        new = {n: t + 0.01 * torch.randn(t.shape, generator=self.g) for n, t in self.master[p].items()}
        config = self.store.config
        step = downlink_step(new, self.view[p], config.downlink_compression, block_size=config.compression_block_size) \
            if config.downlink_compression != "fp32" else None
        assert self.store.commit_round(self.round, p, params=new, downlink=step).won
        self.master[p] = new
        self.view[p] = step.view if step is not None else new
        return self.store.read_commit(self.round)  # type: ignore[return-value]


def test_the_fetcher_reads_only_the_newest_version_of_each_fragment(tmp_path: Path) -> None:
    """Five versions land before a poll: one read per fragment (its newest), counted on the wire;
    two more before the learner takes them: each replaces the one waiting, nothing piles up."""
    store = new_run(tmp_path, codec="fp32")
    c = Committer(store)
    for p in (0, 1, 0, 1, 0):
        c.commit(p)
    joined = RunReader.open(store.url)
    _ = joined.manifest  # a learner read it when it joined
    reader = joined.sibling(metered_apart=True)
    fetcher = Fetcher(reader, 0, 0.01, versions=[0, 0], log=lambda _: None)
    before = reader.store.wire_counts()
    fetcher.poll_once()
    spent = reader.store.wire_counts() - before
    root = Path(store.url.removeprefix("file://"))
    records = sum((root / P.commit_key(r)).stat().st_size for r in range(1, 6))
    newest = [c.store.read_commit(5).state[0].params.nbytes, c.store.read_commit(4).state[1].params.nbytes]
    assert dict(fetcher.reads) == {"master": 2}
    assert spent.bytes_down == records + sum(newest)  # every version would have read 5 payloads
    assert fetcher.latest_round == 5
    c.commit(1)
    c.commit(0)
    fetcher.poll_once()  # the learner took nothing meanwhile
    assert dict(fetcher.reads) == {"master": 4}
    ready = fetcher.take()
    assert [(v, p) for v, p, _ in ready] == [(6, 1), (7, 0)]
    assert same(ready[1][2], c.master[0]) and same(ready[0][2], c.master[1])
    assert fetcher.take() == []


def test_a_learner_applies_the_chain_of_updates_or_reads_the_view_whichever_is_fewer_bytes(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    c = Committer(store)
    initial = [store.read_global_fragment(p, 0) for p in range(2)]
    follower = Follower(RunReader.open(store.url), [0, 0], dict(enumerate(initial)), log=lambda _: None)

    def follow() -> dict[int, tuple[int, Tensors]]:
        records = follower.store.poll_commits(max(follower.versions))
        return {p: (v, values) for v, p, values in follower.advance(records)}

    c.commit(0)
    c.commit(0)
    got = follow()  # two int4 updates are fewer bytes than one fp32 view
    assert dict(follower.reads) == {"update": 2} and got[0][0] == 2 and same(got[0][1], c.view[0])
    for _ in range(8):
        c.commit(0)
    got = follow()  # eight are more
    assert dict(follower.reads) == {"update": 2, "view": 1} and got[0][0] == 10 and same(got[0][1], c.view[0])
    # A damaged update is skipped with its reason; the view is read in full.
    dl = c.commit(0).state[0].downlink
    assert dl is not None and dl.update is not None
    blob_file(store, dl.update.sha256).write_bytes(b"garbage")
    got = follow()
    assert follower.reads["view"] == 2 and same(got[0][1], c.view[0])
    assert "fragment 0 v11: downlink update unreadable" in follower.skipped[-1] and "truncated" in follower.skipped[-1]
    # Update and view both gone: the fp32 master (within one quantization error); the next version
    # cannot be chained to it and is read in full.
    dl = c.commit(0).state[0].downlink
    assert dl is not None and dl.update is not None
    blob_file(store, dl.update.sha256).unlink()
    blob_file(store, dl.view.sha256).unlink()
    got = follow()
    assert follower.reads["master"] == 1 and same(got[0][1], c.master[0]) and 0 not in follower.views
    c.commit(0)
    got = follow()
    assert follower.reads["view"] == 3 and same(got[0][1], c.view[0])
    c.commit(1)
    assert same(follow()[1][1], c.view[1]) and follower.reads["update"] == 3


def test_a_far_behind_learner_rebuilds_the_view_from_its_snapshot(tmp_path: Path) -> None:
    """With a view every 4 versions, a learner that missed 10 versions reads the newest snapshot
    and the 2 updates after it (fewer bytes than 10 updates); one that missed 2 applies them."""
    store = new_run(tmp_path, snapshot_every=4)
    c = Committer(store)
    initial = [store.read_global_fragment(p, 0) for p in range(2)]
    near = Follower(RunReader.open(store.url), [0, 0], dict(enumerate(initial)), log=lambda _: None)
    far = Follower(RunReader.open(store.url), [0, 0], dict(enumerate(initial)), log=lambda _: None)

    def follow(f: Follower) -> dict[int, tuple[int, Tensors]]:
        return {p: (v, values) for v, p, values in f.advance(f.store.poll_commits(max(f.versions)))}

    records = [c.commit(0) for _ in range(2)]
    got = follow(near)
    assert dict(near.reads) == {"update": 2} and got[0][0] == 2 and same(got[0][1], c.view[0])
    records += [c.commit(0) for _ in range(8)]
    entries = [rec.state[0].downlink for rec in records]
    assert [dl.depth for dl in entries if dl is not None] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert [v for v, dl in enumerate(entries, 1) if dl is not None and dl.view is not None] == [4, 8]
    got = follow(far)
    assert dict(far.reads) == {"view": 1, "update": 2} and got[0][0] == 10 and same(got[0][1], c.view[0])
    got = follow(near)  # 8 updates (5 bytes a parameter) against a snapshot and 2 (5.25): the updates
    assert dict(near.reads) == {"update": 10} and same(got[0][1], c.view[0])
    assert not near.skipped and not far.skipped
    # The snapshot gone: the view cannot be rebuilt, the learner takes the master and says so.
    snapshot = entries[7]
    assert snapshot is not None and snapshot.view is not None
    blob_file(store, snapshot.view.sha256).unlink()
    c.commit(0)
    late = Follower(RunReader.open(store.url), [0, 0], dict(enumerate(initial)), log=lambda _: None)
    got = follow(late)
    assert late.reads["master"] == 1 and same(got[0][1], c.master[0]) and "v11: view unreadable" in late.skipped[-1]


def drive(sync: Synchronizer, learners: list[RecipeLearner], followers: list[Follower], rounds: int) -> None:
    """Every learner steps, the synchronizer commits what can close, every learner adopts through
    its follower (what its fetcher thread does), until ``rounds`` more rounds are committed."""
    target, now = sync.round + rounds, [0.0]
    sync.clock = lambda: now[0]
    while sync.round < target:
        for lr in learners:
            lr.step()
        now[0] += 1.0
        while isinstance(sync.tick(), RoundSummary):
            pass
        for lr, f in zip(learners, followers, strict=True):
            for v, p, values in f.advance(f.store.poll_commits(max(f.versions))):
                lr.adopt(v, p, values)


def assert_holds_the_views(learner: Learner, views: list[Tensors]) -> None:
    for p, view in enumerate(views):
        assert same({n: t.cpu() for n, t in learner.bases[p].items()}, view), (learner.learner_id, p)


def assert_resumes_exactly(sync: Synchronizer, again: Synchronizer) -> None:
    """A synchronizer rebuilt from the bucket holds what the one that wrote it holds, and its outer
    optimizer takes the same next step bit for bit (at mu = 0 from empty buffers: never read)."""
    g = torch.Generator().manual_seed(7)
    for p in range(len(sync.fragments)):
        assert same(again.fragments[p], sync.fragments[p])
        delta = {n: torch.randn(t.shape, generator=g) for n, t in sync.fragments[p].items()}
        steps = [s.merger.optimizer_copy(p, s.optimizers[p]).step(
            s.fragments[p], {n: d.clone() for n, d in delta.items()},
            out={n: torch.empty_like(t) for n, t in s.fragments[p].items()}) for s in (sync, again)]
        assert same(*steps)


@pytest.mark.parametrize(("snapshot_every", "outer_momentum"), [(1, 0.9), (4, 0.0), (4, 0.9)])
def test_a_restarted_synchronizer_keeps_the_view_and_a_joiner_reads_it(tmp_path: Path, snapshot_every: int,
                                                                      outer_momentum: float) -> None:
    store = new_run(tmp_path, snapshot_every=snapshot_every, outer_momentum=outer_momentum)
    learners = [RecipeLearner(LearnerStore.open(store.url), s, log=lambda _: None) for s in ("learner-0", "learner-1")]
    followers = [Follower(lr.store.sibling(), lr.versions, lr.held_views(), log=lambda _: None) for lr in learners]
    sync = Synchronizer(SynchronizerStore.open(store.url), options=SynchronizerOptions(live_timeout_s=1e9))
    drive(sync, learners, followers, 6)
    assert sync.views is not None
    for lr in learners:
        assert_holds_the_views(lr, sync.views)
    again = Synchronizer(SynchronizerStore.open(store.url), options=SynchronizerOptions(live_timeout_s=1e9))
    assert again.views is not None and again._unchained == set()
    assert all(same(a, b) for a, b in zip(again.views, sync.views, strict=True))
    assert_resumes_exactly(sync, again)
    drive(again, learners, followers, 6)
    assert all(f.reads["view"] == 0 and f.reads["master"] == 0 and f.reads["update"] > 0 for f in followers)
    for lr in learners:
        assert_holds_the_views(lr, again.views)
    # The view is not the master, within one quantization error of each fragment's residual.
    for p, view in enumerate(again.views):
        st = store.fragment_state(p, again.versions[p])
        assert st.downlink is not None
        base = store.read_fragment_view(p, st.downlink.base)
        master = again.fragments[p]
        assert not same(master, view)
        for n in view:
            assert torch.all((master[n] - view[n]).abs() <= drift_bound(master[n] - base[n], "int4") + 1e-6)
    # A joiner reads each fragment's view in full, and not the outer momentum.
    joiner_store = LearnerStore.open(store.url).sibling(metered_apart=True)
    joiner = RecipeLearner(joiner_store, "learner-1", log=lambda _: None)
    assert_holds_the_views(joiner, again.views)
    state = store.read_commit(again.round).state
    # Each fragment's snapshot and, between snapshots, the updates after it.
    views = sum(store.view_chain(p, st.version).nbytes for p, st in enumerate(state))
    momentum = sum(st.momentum.nbytes for st in state if st.momentum is not None)
    if snapshot_every > 1:
        assert any(st.downlink is not None and st.downlink.view is None for st in state)
    assert (momentum > 0) == (outer_momentum > 0)  # mu = 0: no round wrote any
    joined: WireCounts = joiner_store.store.wire_counts()
    fragment = min(st.params.nbytes for st in state)
    assert views <= joined.bytes_down < views + fragment, (views, momentum, joined)
    assert set(joiner.held_views() or {}) == {0, 1}


def test_a_view_lost_before_a_restart_is_published_again_in_full(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    learners = [RecipeLearner(LearnerStore.open(store.url), s, log=lambda _: None) for s in ("learner-0", "learner-1")]
    followers = [Follower(lr.store.sibling(), lr.versions, lr.held_views(), log=lambda _: None) for lr in learners]
    sync = Synchronizer(SynchronizerStore.open(store.url), options=SynchronizerOptions(live_timeout_s=1e9))
    drive(sync, learners, followers, 4)
    st = store.read_commit(sync.round).state[0]
    assert st.downlink is not None
    blob_file(store, st.downlink.view.sha256).unlink()
    again = Synchronizer(SynchronizerStore.open(store.url), options=SynchronizerOptions(live_timeout_s=1e9))
    assert again._unchained == {0}  # it cannot know the view learners hold: it stands in the master
    drive(again, learners, followers, 2)
    rec = store.read_commit(again.versions[0])
    dl = rec.state[0].downlink
    assert rec.round > sync.round and dl is not None and dl.update is None  # no chain: read the view
    assert all(f.reads["view"] == 1 for f in followers) and again._unchained == set()
    assert again.views is not None
    for lr in learners:
        assert_holds_the_views(lr, again.views)


def learner_thread(url: str, learner_id: str, out: dict[str, LearnerSession]) -> None:
    """A learner as its process runs it (lease, heartbeats, the fetcher thread), on atoll's own loop."""
    store = LearnerStore.open(url)
    loops: list[InnerLoop] = []

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
        loops.append(InnerLoop(store, learner_id))
        return loops[0].model, loops[0].opt, loops[0].describe()

    session = LearnerSession(store, learner_id, build, log=lambda _: None,
                             options=LearnerOptions(poll_interval_s=0.02, handle_sigterm=False, max_steps=2000))
    with session:
        assert session.learner is not None
        learner, loop = session.learner, loops[0]
        loop.resume(learner)
        while session.exit_reason_now() is None:
            tokens, loss, step_time_s = loop.step(learner)
            learner.record_step(tokens, loss=loss, step_time_s=step_time_s)
            session.after_step()
    out[learner_id] = session


def test_an_int4_downlink_run_of_learner_threads_trains_and_learners_hold_the_view(tmp_path: Path) -> None:
    rounds = 24
    # mu = 0.5: with H = 2 and contributions two versions stale, mu = 0.9 overshoots for a few
    # rounds (3.1 -> 8 and back, the same with an fp32 downlink); this test is about the downlink.
    store = new_run(tmp_path, rounds=rounds, outer_momentum=0.5)
    evaluate = make_evaluator(store)
    initial = evaluate(store.read_global_state(0).params)
    sessions: dict[str, LearnerSession] = {}
    threads = [threading.Thread(target=learner_thread, args=(store.url, lid, sessions)) for lid in ("learner-0", "learner-1")]
    for t in threads:
        t.start()
    sync_store = SynchronizerStore.open(store.url)
    last = run_synchronizer(sync_store, evaluator=Evaluator(sync_store, log=lambda _: None, evaluate=evaluate),
                            log=lambda _: None, options=SynchronizerOptions(poll_interval_s=0.02))
    for t in threads:
        t.join(timeout=120)
    assert last == rounds and set(sessions) == {"learner-0", "learner-1"}
    evals = store.read_evals(store.eval_rounds())  # measured off the rounds' path; the last one always
    losses = [rec.val_loss for rec in evals.values()]
    assert rounds in evals and losses[-1] < initial - 0.5, (initial, losses)  # it trains (ln 256 = 5.55 untrained)
    for lid, session in sessions.items():
        learner, fetcher = session.learner, session.fetcher
        assert learner is not None and fetcher is not None
        assert session.summary.exit_reason == "finished" and learner.summary.aligned > 0
        for p, v in enumerate(learner.versions):
            assert same({n: t.cpu() for n, t in learner.bases[p].items()}, store.read_fragment_view(p, v)), (lid, p)
        assert fetcher.reads["update"] > 0 and fetcher.reads["master"] == 0 and not fetcher.follower.skipped
    assert math.isfinite(losses[-1])
