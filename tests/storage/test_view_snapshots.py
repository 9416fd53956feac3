"""What a round writes: the learners' view only every ``downlink_snapshot_every`` versions (and at
every version without an update), no outer momentum at mu = 0; readers rebuild each view from its
snapshot and the updates after it, bit for bit what a run with a view on every version publishes.
On a local folder and on S3 (moto), committed the way the synchronizer's commit path commits."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from storage_helpers import init_run

from atoll.core.downlink import downlink_step
from atoll.core.outer import NesterovOuterOptimizer
from atoll.storage import OperatorStore, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.storage.paths import to_url
from atoll.storage.records import FragmentState
from atoll.storage.retention import RetentionPolicy, apply_prune, plan_prune
from atoll.storage.validation import InvalidInput
from conftest import Backend

Tensors = dict[str, torch.Tensor]
# Fragment per round, and rounds published without a chain (a synchronizer that lost its view).
SCHEDULE = [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]
UNCHAINED = {9}


def same(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def commit_all(store: SynchronizerStore, schedule: list[int] = SCHEDULE, *, seed: int = 0,
               unchained: set[int] = UNCHAINED) -> list[Tensors]:
    """Commit one new version per entry of ``schedule`` (master + noise, its downlink step, the
    outer momentum); returns the view after each round for its fragment."""
    g = torch.Generator().manual_seed(seed)
    master = [store.read_global_fragment(p, 0) for p in range(store.plan.num_fragments)]
    view = [dict(m) for m in master]
    views = []
    for r, p in enumerate(schedule, 1):
        names = sorted(master[p])  # one order in every run, however the fragment was read
        new = {n: master[p][n] + 0.01 * torch.randn(master[p][n].shape, generator=g) for n in names}
        step = downlink_step(new, view[p], "int4", block_size=store.config.compression_block_size)
        momentum = {f"momentum.{n}": torch.randn(new[n].shape, generator=g) for n in names}
        assert store.commit_round(r, p, params=new, momentum=momentum, downlink=step,
                                  downlink_chained=r not in unchained).won
        master[p], view[p] = new, step.view
        views.append(step.view)
    return views


def new_run(backend: Backend, **config: object) -> SynchronizerStore:
    store = backend.open(backend.new_url(), role=SynchronizerStore)
    init_run(store, downlink_compression="int4", compression_block_size=4, **config)
    return store


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_views_rebuilt_from_snapshots_are_bit_identical_to_a_view_on_every_version(backend: Backend) -> None:
    every = new_run(backend, downlink_snapshot_every=1)
    sparse = new_run(backend, downlink_snapshot_every=3)
    expected = commit_all(every)
    assert all(same(a, b) for a, b in zip(commit_all(sparse), expected, strict=True))
    a, b = backend.open(every.url, fresh=True), backend.open(sparse.url, fresh=True)  # readers of their own
    depths, views = [], []
    for r, p in enumerate(SCHEDULE, 1):
        dl_a, dl_b = a.fragment_state(p, r).downlink, b.fragment_state(p, r).downlink
        assert dl_a is not None and dl_b is not None and dl_a.view is not None and dl_a.depth == 0
        depths.append(dl_b.depth)
        views.append(dl_b.view is not None)
        assert same(b.read_fragment_view(p, r), expected[r - 1]) and same(a.read_fragment_view(p, r), expected[r - 1])
        assert same(a.read_global_fragment(p, r), b.read_global_fragment(p, r))  # the master, every round
        held_a, held_b = a.read_global_state(r, view=True, momentum=False), b.read_global_state(r, view=True)
        assert held_a.restored == held_b.restored == {} and same(held_a.params, held_b.params)
    # Fragment 0's versions 1, 3, 4, 6, 7, 9 (unchained: a snapshot), 10, 11, 13, ...; fragment 1's 2, 5, 8, 12.
    assert depths == [1, 1, 2, 0, 2, 1, 2, 0, 0, 1, 2, 1, 0, 1, 2, 0]
    assert views == [d == 0 for d in depths]
    chain = b.view_chain(0, 15)
    assert (chain.snapshot, [v for v, _ in chain.updates]) == (13, [14, 15])
    assert b.view_chain(1, 2).snapshot == 0 and b.view_chain(1, 2).start == b.manifest.initial[1]
    # Fewer bytes written: the views left out, nothing else.
    stored_a = sum(ref.nbytes for r, p in enumerate(SCHEDULE, 1) for ref in a.fragment_state(p, r).refs())
    stored_b = sum(ref.nbytes for r, p in enumerate(SCHEDULE, 1) for ref in b.fragment_state(p, r).refs())
    left_out = [a.fragment_state(p, r).downlink for r, p in enumerate(SCHEDULE, 1) if not views[r - 1]]
    assert stored_a - stored_b == sum(dl.view.nbytes for dl in left_out if dl is not None and dl.view is not None)
    assert a.verify().ok and b.verify().ok


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_mu_zero_writes_no_momentum_and_resume_is_exact(backend: Backend) -> None:
    store = new_run(backend, outer_momentum=0.0)
    commit_all(store, [0, 1, 0])
    reader = backend.open(store.url, fresh=True)
    assert all(st.momentum is None for r in (1, 2, 3) for st in reader.read_commit(r).state)  # type: ignore[union-attr]
    state = reader.read_global_state()
    assert state.momentum == {0: {}, 1: {}} and state.restored == {}
    # The outer step at mu = 0 never reads its buffer: a resumed optimizer (empty buffers) and one
    # that kept running (through the fused, blocked path) take the same step, bit for bit.
    g = torch.Generator().manual_seed(3)
    theta = {n: torch.randn(4096, generator=g) for n in ("a", "b")}
    running = NesterovOuterOptimizer(lr=0.8, momentum=0.0)
    running.step(theta, {n: torch.randn(4096, generator=g) for n in theta})
    resumed = NesterovOuterOptimizer(lr=0.8, momentum=0.0)
    resumed.load_state_dict(state.momentum[0])
    delta = {n: torch.randn(4096, generator=g) for n in theta}
    out_a, out_b = {n: torch.empty(4096) for n in theta}, {n: torch.empty(4096) for n in theta}
    got_a = running.step(theta, {n: d.clone() for n, d in delta.items()}, out=out_a, scale={"a": 0.5})
    got_b = resumed.step(theta, {n: d.clone() for n, d in delta.items()}, out=out_b, scale={"a": 0.5})
    assert same(got_a, got_b)
    # With mu > 0 every new version names its momentum: an exact resume needs the buffers.
    store = new_run(backend, outer_momentum=0.9)
    commit_all(store, [0, 1])
    rec = backend.open(store.url, fresh=True).read_commit(2)
    assert rec is not None and all(st.momentum is not None for st in rec.state)


def test_retention_keeps_the_chain_back_to_a_snapshot_and_verify_checks_it(tmp_path: Path) -> None:
    store = SynchronizerStore.open(to_url(str(tmp_path / "run")))
    init_run(store, downlink_compression="int4", compression_block_size=4, downlink_snapshot_every=4)
    schedule = [0, 1] * 12  # 12 versions of each fragment: snapshots at 4 and 8 (rounds 7, 15, 8, 16)
    expected = commit_all(store, schedule, unchained=set())
    plan = plan_prune(store, RetentionPolicy(keep_rounds=4, min_age_s=60), now=time.time() + 7200)
    assert plan.floors == (19, 20)  # the window is rounds 21-24; fragment 0's v19 is at depth 2 (snapshot v15)
    apply_prune(OperatorStore.beside(store), plan)
    fresh = RunReader.open(store.url)
    for r in range(19, 25):  # every version still readable: its view rebuilt from a snapshot below the floor
        p = schedule[r - 1]
        assert same(fresh.read_fragment_view(p, r), expected[r - 1])
    assert fresh.view_chain(0, 19).snapshot == 15 and fresh.view_chain(0, 23).snapshot == 23
    deleted = {P.parse_blob_name(d.key.rsplit("/", 1)[-1]) for d in plan.deletes}
    assert fresh.fragment_state(0, 15).params.sha256 in deleted  # the master below the floor goes
    assert fresh.fragment_state(0, 15).downlink.view.sha256 not in deleted  # type: ignore[union-attr]
    report = RunReader.open(store.url, read_only=True).verify()
    assert report.ok and report.pruned > 0, report.problems
    # The snapshot a kept version is rebuilt from, lost: verify names it, a reader falls back.
    snapshot = fresh.fragment_state(1, 16).downlink.view  # type: ignore[union-attr]
    assert snapshot is not None
    (Path(store.url.removeprefix("file://")) / P.blob_key(snapshot.sha256)).unlink()
    report = RunReader.open(store.url, read_only=True).verify()
    assert not report.ok and any(snapshot.sha256 in line and "fragment 1 v20's view" in line for line in report.problems)
    held = RunReader.open(store.url).read_global_state(22, view=True, momentum=False)
    assert "view of v22 unreadable (missing_payload)" in held.restored[1]


def bodies() -> Iterator[tuple[dict[str, object], bool]]:
    ref = {"sha256": "ab" * 32, "nbytes": 10}
    base = {"update": ref, "base": 2, "codec": "int4", "block_size": 32}
    yield {**base, "view": ref}, True  # a record written before snapshots: depth 0
    yield {**base, "view": None, "depth": 3}, True
    yield {**base, "view": ref, "depth": 0}, True
    yield {**base, "view": None}, False  # no view at depth 0
    yield {**base, "view": ref, "depth": 2}, False  # a view at depth 2
    yield {**base, "view": None, "update": None, "depth": 1}, False  # neither view nor update


@pytest.mark.parametrize(("body", "ok"), list(bodies()))
def test_downlink_entries_with_and_without_a_view(body: dict[str, object], ok: bool) -> None:
    entry = {"version": 5, "params": {"sha256": "cd" * 32, "nbytes": 10}, "momentum": None, "downlink": body}
    if not ok:
        with pytest.raises(InvalidInput, match="downlink"):
            FragmentState.from_body(entry)
        return
    st = FragmentState.from_body(entry)
    assert st.downlink is not None and FragmentState.from_body(st.to_dict()) == st
    assert ("depth" in st.to_dict()["downlink"]) == bool(st.downlink.depth)  # snapshots: byte for byte as before
    assert len(st.refs()) == 2 + (st.downlink.view is not None)
