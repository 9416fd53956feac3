"""A compressed downlink's objects in a real local-folder bucket: what a commit publishes beside the
fp32 master (each version's view and update), how they read back, and that ``atoll verify`` and
retention know them. Versions are committed by hand, the way the synchronizer's commit path does."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from atoll.core.config import DilocoConfig
from atoll.core.downlink import apply_update, downlink_step, drift_bound
from atoll.storage import OperatorStore, RunHandle, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.storage.paths import to_url
from atoll.storage.records import CommitRecord, FragmentState
from atoll.storage.retention import RetentionPolicy, apply_prune, plan_prune
from atoll.storage.validation import InvalidInput
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run


def new_run(tmp_path: Path, codec: str = "int4") -> SynchronizerStore:
    """A run that publishes the view with every version (snapshots: test_view_snapshots.py)."""
    config, recipe = smoke_recipe(2, max_rounds=1000)
    config = config.replace(downlink_compression=codec, downlink_snapshot_every=1)
    return create_run(to_url(str(tmp_path / "run")), config, recipe)


class Committer:
    """New master versions (the previous one plus noise) with their downlink step, committed."""

    def __init__(self, store: SynchronizerStore, seed: int = 0) -> None:
        self.store = store
        self.master = [store.read_global_fragment(p, 0) for p in range(store.plan.num_fragments)]
        self.view = [dict(m) for m in self.master]
        self.g = torch.Generator().manual_seed(seed)
        self.round = 0

    def commit(self, p: int, *, chained: bool = True) -> CommitRecord:
        self.round += 1
        new = {n: t + 0.01 * torch.randn(t.shape, generator=self.g) for n, t in self.master[p].items()}
        config = self.store.config
        step = downlink_step(new, self.view[p], config.downlink_compression, block_size=config.compression_block_size)
        result = self.store.commit_round(self.round, p, params=new, downlink=step, downlink_chained=chained)
        assert result.won
        self.master[p], self.view[p] = new, step.view
        return result.record


def blob_file(store: RunHandle, sha256: str) -> Path:
    return Path(store.url.removeprefix("file://")) / P.blob_key(sha256)


def test_a_version_publishes_its_view_and_update_and_they_read_back_exactly(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    c = Committer(store)
    rec = c.commit(0)
    dl = rec.state[0].downlink
    assert dl is not None and (dl.base, dl.codec, dl.block_size) == (0, "int4", 32) and dl.update is not None
    assert rec.state[1].downlink is None  # fragment 1 is still version 0: learners hold the master
    assert dl.update.nbytes < dl.view.nbytes / 5  # int4 codes and scales against fp32
    fresh = RunReader.open(store.url)  # a learner's handle: verifies the chain on its own
    view = fresh.read_fragment_view(0, 1)
    base, update = fresh.read_fragment_update(0, 1)
    assert base == 0
    initial = fresh.read_global_fragment(0, 0)
    master = fresh.read_global_fragment(0, 1)
    for n in view:
        assert torch.equal(view[n], c.view[0][n]) and torch.equal(apply_update(initial, update)[n], view[n])
        assert torch.equal(master[n], c.master[0][n]) and not torch.equal(master[n], view[n])
        assert torch.all((master[n] - view[n]).abs() <= drift_bound(master[n] - initial[n], "int4") + 1e-6)
    held = fresh.read_global_state(1, view=True, momentum=False)
    assert held.restored == {} and held.momentum == {0: {}, 1: {}}
    expected = {**fresh.read_global_fragment(1, 0), **view}
    assert held.params.keys() == expected.keys() and all(torch.equal(held.params[n], expected[n]) for n in expected)
    full = fresh.read_global_state(1)  # the synchronizer's: the fp32 master and its momentum
    assert all(torch.equal(full.params[n], master[n]) for n in master)


def test_an_fp32_run_publishes_no_downlink_and_older_records_read(tmp_path: Path) -> None:
    store = new_run(tmp_path, codec="fp32")
    frag = store.read_global_fragment(0, 0)
    step = downlink_step({n: t + 1 for n, t in frag.items()}, frag, "int4")
    with pytest.raises(ValueError, match="downlink is fp32"):
        store.commit_round(1, 0, params={n: t + 1 for n, t in frag.items()}, downlink=step)
    store.commit_round(1, 0, params={n: t + 1 for n, t in frag.items()})
    stored = json.loads((Path(store.url.removeprefix("file://")) / P.commit_key(1)).read_bytes())
    assert "downlink" not in json.dumps(stored)  # the record is byte for byte what it was before downlinks
    view, master = store.read_fragment_view(0, 1), store.read_global_fragment(0, 1)
    assert view.keys() == master.keys() and all(torch.equal(view[n], master[n]) for n in master)
    with pytest.raises(InvalidInput, match="no downlink update"):
        store.read_fragment_update(0, 1)
    # A manifest written before the field existed reads as an fp32 downlink.
    old = DilocoConfig().to_dict()
    del old["downlink_compression"]
    assert DilocoConfig.from_dict(old).downlink_compression == "fp32"
    ref = {"sha256": "ab" * 32, "nbytes": 10}
    assert FragmentState.from_body({"version": 3, "params": ref, "momentum": None}).downlink is None
    bad = [{"view": ref, "update": ref, "base": 0, "codec": "int2", "block_size": 32},
           {"view": ref, "update": ref, "base": 3, "codec": "int4", "block_size": 32},
           {"view": ref, "update": ref, "base": 0, "codec": "int4", "block_size": 3}]
    for body in bad:
        with pytest.raises(InvalidInput, match="downlink"):
            FragmentState.from_body({"version": 3, "params": ref, "momentum": None, "downlink": body})


def test_a_damaged_or_missing_update_is_refused_and_an_unchained_version_has_none(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    c = Committer(store)
    rec = c.commit(0)
    dl = rec.state[0].downlink
    assert dl is not None and dl.update is not None
    path = blob_file(store, dl.update.sha256)
    path.write_bytes(b"\x00" * dl.update.nbytes)
    with pytest.raises(InvalidInput) as e:
        RunReader.open(store.url).read_fragment_update(0, 1)
    assert e.value.kind.value == "checksum"
    path.unlink()
    with pytest.raises(InvalidInput) as e:
        RunReader.open(store.url).read_fragment_update(0, 1)
    assert e.value.kind.value == "missing_payload"
    # The view does not read: a joiner takes the master for that fragment and says so.
    blob_file(store, dl.view.sha256).unlink()
    held = RunReader.open(store.url).read_global_state(1, view=True, momentum=False)
    assert "view of v1 unreadable (missing_payload)" in held.restored[0]
    assert all(torch.equal(held.params[n], c.master[0][n]) for n in c.master[0])
    rec2 = c.commit(0, chained=False)  # published after a synchronizer lost the view it had published
    dl2 = rec2.state[0].downlink
    assert dl2 is not None and dl2.update is None and dl2.base == 1


def test_verify_and_retention_know_the_downlink_objects(tmp_path: Path) -> None:
    store = new_run(tmp_path)
    c = Committer(store)
    records = [c.commit(r % 2) for r in range(10)]
    assert RunReader.open(store.url, read_only=True).verify().ok
    named = {ref.sha256 for rec in records for st in rec.state for ref in st.refs()}
    downlink = {ref.sha256 for rec in records for st in rec.state if st.downlink is not None
                for ref in (st.downlink.view, st.downlink.update) if ref is not None}
    assert len(downlink) == 20 and downlink <= named
    # Retention keeps what the last 4 rounds (and the versions current before them) name, deletes the rest.
    plan = plan_prune(store, RetentionPolicy(keep_rounds=4, min_age_s=60), now=time.time() + 7200)
    kept = {ref.sha256 for rec in records[5:] for st in rec.state for ref in st.refs()}
    deleted = {P.parse_blob_name(d.key.rsplit("/", 1)[-1]) for d in plan.deletes}
    assert deleted and not deleted & kept and deleted <= named - kept
    assert {r.sha256 for rec in records[:4] for r in (rec.state[rec.fragment].downlink.view,)} <= deleted
    apply_prune(OperatorStore.beside(store), plan)
    report = RunReader.open(store.url, read_only=True).verify()
    assert report.ok and report.pruned > 0
    # A lost update is named by verify.
    last = records[-1].state[records[-1].fragment].downlink
    assert last is not None and last.update is not None
    blob_file(store, last.update.sha256).unlink()
    report = RunReader.open(store.url, read_only=True).verify()
    assert not report.ok and any(last.update.sha256 in line for line in report.problems)
