"""Hostile records cannot stop the synchronizer: each becomes a recorded rejection (or is ignored)
and the real synchronizer loop commits more rounds afterwards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from atoll.core.rejection import RejectionKind
from atoll.storage import LearnerStore, RunCreator, RunReader, SynchronizerStore, paths
from atoll.storage.codec import dump_record
from atoll.storage.integrity import seal
from atoll.storage.paths import to_url
from atoll.storage.records import KIND_CONTRIBUTION
from atoll.storage.validation import InvalidInput, validate_id
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.synchronizer import RoundSummary, Synchronizer
from atoll.train.trust import MAX_TIMING_S


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(tmp_path: Path) -> tuple[RunReader, list[RecipeLearner], Synchronizer, Clock]:
    config, recipe = smoke_recipe(3, max_rounds=1000)
    store = create_run(to_url(str(tmp_path / "run")), config.replace(initial_grace_s=0.0), recipe)
    learners = [RecipeLearner(LearnerStore.beside(store), s.learner_id, log=lambda _: None) for s in recipe.learners]
    clock = Clock()
    return store, learners, Synchronizer(SynchronizerStore.open(store.url), clock=clock), clock


def _rounds(learners: list[RecipeLearner], sync: Synchronizer, clock: Clock, n: int) -> list[RoundSummary]:
    """Drive n rounds: every learner steps, the synchronizer ticks until nothing more closes."""
    out: list[RoundSummary] = []
    seen = {id(lr): sync.round for lr in learners}
    while len(out) < n:
        for lr in learners:
            lr.step()
        clock.t += 1.0
        while isinstance(s := sync.tick(), RoundSummary):
            out.append(s)
            for lr in learners:  # learners see the new versions (no background fetcher here)
                for rec in lr.store.poll_commits(seen[id(lr)]):
                    seen[id(lr)] = rec.round
                    if rec.updated:
                        lr.adopt(rec.round, rec.fragment, lr.store.read_global_fragment(rec.fragment, rec.round))
    return out


def _plant(store: RunReader, fragment: int, name: str, body_changes: dict) -> str:
    """A record written behind the protocol's back under a well-formed key (payload: a real one)."""
    version = store.read_global_state().versions[fragment]
    listing = store.list_contributions(fragment, version)
    real = next(iter(listing.records), None)
    sha = real.payload.sha256 if real else "0" * 64
    key = paths.contribution_key(fragment, version, name, 2, sha)
    body = {"learner_id": name, "fragment": fragment, "base_version": version, "c_steps": 2, "c_tokens": 64,
            "payload": {"sha256": sha, "nbytes": real.payload.nbytes if real else 1},
            "tensors": dict(real.tensors) if real else {}, "created_at": 0.0, "info": {}}
    body.update(body_changes)
    data = dump_record(KIND_CONTRIBUTION, seal(KIND_CONTRIBUTION, body))  # a rogue writer can seal
    store.store.put(key, data)
    return key


def _rejections(store: RunReader) -> dict:
    return {k: v for r in store.history() for k, v in r.rejected.items()}


def _learner_has_published(store: RunReader, learners: list[RecipeLearner], sync: Synchronizer, clock: Clock) -> None:
    _rounds(learners, sync, clock, 2)


def test_integer_beyond_float_range_is_a_schema_rejection(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    p = sync.fragment_of_round(sync.round + 1)
    key = _plant(store, p, "evil-tokens", {"c_tokens": 10**200})
    done = _rounds(learners, sync, clock, 4)
    assert len(done) >= 4
    why = _rejections(store)[key]
    assert why.kind is RejectionKind.SCHEMA and "2**53" in why.detail and why.final


def test_huge_reported_step_time_cannot_set_a_huge_grace_window(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    original = LearnerStore.publish_contribution

    def lying(self, *args, **kwargs):  # the learner's own number, as a hostile learner would send it
        kwargs["info"] = {**(kwargs.get("info") or {}), "step_time_s": 1e300}  # 10**400 is no record at all
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LearnerStore, "publish_contribution", lying)
        done = _rounds(learners, sync, clock, 4)
    assert len(done) >= 4
    step = sync.ema.get("step_s")
    assert step is not None and math.isfinite(step) and step <= MAX_TIMING_S


@pytest.mark.parametrize("junk", [{"bytes_up": 2**80, "puts": -5, "gets": "lots", "heads": True, "lists": 1.5,
                                   "tokens": 2**70, "meter": "../../etc"},
                                  "a string", [1, 2], None, {"deletes": {"nested": 1}}],
                         ids=["clipped", "string", "list", "null", "nested"])
def test_junk_wire_reports_are_clipped_or_left_out(tmp_path: Path, junk) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    original = LearnerStore.publish_contribution
    liar = learners[0].learner_id

    def lying(self, learner_id, *args, **kwargs):  # one learner reports junk as its traffic
        if learner_id == liar:
            kwargs["info"] = {**(kwargs.get("info") or {}), "wire": junk}
        return original(self, learner_id, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LearnerStore, "publish_contribution", lying)
        done = _rounds(learners, sync, clock, 4)
    assert len(done) >= 4
    reports = [r.record.stats.get("learner_wire", {}) for r in done]
    honest = [rep[lid] for rep in reports for lid in rep if lid != liar]
    assert honest and all(v["puts"] > 0 and v["tokens"] > 0 for v in honest)
    lies = [rep[liar] for rep in reports if liar in rep]
    if isinstance(junk, dict) and junk.get("bytes_up"):
        assert lies and all(v == {"puts": 0, "gets": 0, "heads": 0, "lists": 0, "deletes": 0, "bytes_up": 2**50,
                                  "bytes_down": 0, "tokens": 2**50, "meter": ""} for v in lies)
    else:
        assert not lies


def test_directory_where_a_record_belongs_is_a_rejection(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    p = sync.fragment_of_round(sync.round + 1)
    version = store.read_global_state().versions[p]
    key = paths.contribution_key(p, version, "evil-dir", 2, "0" * 64)
    (tmp_path / "run" / key).mkdir(parents=True)
    (tmp_path / "run" / key / "x").write_bytes(b"{}")
    done = _rounds(learners, sync, clock, 4)
    assert len(done) >= 4
    assert _rejections(store)[key].kind is RejectionKind.CORRUPT
    # A restarted synchronizer is not stopped by it either.
    again = Synchronizer(SynchronizerStore.open(store.url), clock=clock)
    assert len(_rounds(learners, again, clock, 2)) >= 2


def test_ids_are_matched_in_full() -> None:
    assert validate_id("learner-1") == "learner-1"
    with pytest.raises(InvalidInput, match="must be 1-128 characters"):
        validate_id("learner-1\n")


def test_a_record_cannot_smuggle_a_non_json_constant(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    p = sync.fragment_of_round(sync.round + 1)
    version = store.read_global_state().versions[p]
    key = paths.contribution_key(p, version, "evil-nan", 2, "0" * 64)
    store.store.put(key, dump_record(KIND_CONTRIBUTION, {"learner_id": "evil-nan"}).replace(b'"evil-nan"', b'NaN', 1))
    assert len(_rounds(learners, sync, clock, 3)) >= 3
    assert _rejections(store)[key].kind is RejectionKind.CORRUPT


def test_forged_next_commit_is_repaired_by_the_real_synchronizer_with_keys(tmp_path: Path) -> None:
    """A learner writes the next commit record itself (chained and sealed, but unsigned by the
    synchronizer). The keyed synchronizer never adopts it: it commits the round to a repair slot
    and the run goes on; learners keep merging."""
    from atoll.storage.codec import sha256_hex
    from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, Keyring

    config, recipe = smoke_recipe(3, max_rounds=1000)
    keys = {SYNCHRONIZER_KEY_ID: b"s" * 32, **{s.learner_id: s.learner_id.encode() * 4 for s in recipe.learners}}
    url = to_url(str(tmp_path / "run"))
    create_run(RunCreator.open(url, keyring=Keyring(keys)), config.replace(initial_grace_s=0.0), recipe)
    learners = [RecipeLearner(LearnerStore.open(url, keyring=Keyring({s.learner_id: keys[s.learner_id]})), s.learner_id,
                              log=lambda _: None) for s in recipe.learners]
    clock = Clock()
    sync = Synchronizer(SynchronizerStore.open(url, keyring=Keyring(keys)), clock=clock)
    assert len(_rounds(learners, sync, clock, 2)) >= 2
    store = RunReader.open(url)
    r = sync.round + 1
    prev = store.store.get_or_none(paths.commit_key(r - 1))
    assert prev is not None
    forged = dict(json.loads(prev))
    forged.update(round=r, committed_by="learner-0", prev_sha256=sha256_hex(prev), signature="0" * 64)
    store.store.put(paths.commit_key(r), json.dumps(forged).encode())
    done = _rounds(learners, sync, clock, 3)
    assert len(done) >= 3 and all(s.won for s in done)
    assert done[0].record.round == r and done[0].record.committed_by == "synchronizer"
    assert store.store.get_or_none(paths.repair_key(r, 1)) is not None
    keyed = RunReader.open(url, keyring=Keyring(keys))
    assert keyed.latest_round() == sync.round and keyed.read_commit(r).committed_by == "synchronizer"
    assert any(a.learner_id.startswith("learner-") for s in done for a in s.record.accepted)


def test_a_destroyed_state_object_does_not_stop_the_run(tmp_path: Path) -> None:
    """Bytes written over a committed global-state object (possible only where no bucket policy
    confines writers): fresh synchronizers and learners fall back to the fragment's newest
    verifying version, rounds go on, and `verify` names the object."""
    store, learners, sync, clock = _run(tmp_path)
    done = _rounds(learners, sync, clock, 6)
    latest = store.read_global_state()
    p = done[-1].record.fragment
    ref = latest.record.state[p].params
    store.store.put(paths.blob_key(ref.sha256), b"\0" * ref.nbytes)
    fresh = RunReader.open(store.url)
    state = fresh.read_global_state()
    assert p in state.restored and "checksum" in state.restored[p]
    restarted = Synchronizer(SynchronizerStore.open(store.url), clock=clock)
    rejoined = [RecipeLearner(LearnerStore.open(store.url), lr.learner_id, log=lambda _: None) for lr in learners]
    assert len(_rounds(rejoined, restarted, clock, 2 * store.plan.num_fragments)) >= 2 * store.plan.num_fragments
    assert not RunReader.open(store.url).read_global_state().restored  # republished by its next round
    report = RunReader.open(store.url, read_only=True).verify()
    assert any(ref.sha256 in line or "checksum" in line for line in report.problems)
