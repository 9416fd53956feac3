"""The hostile-bucket harness: a real run (smoke recipe) with real :class:`Learner` objects and the
real :class:`Synchronizer` on a fake clock, driven in-process (the pattern of
tests/train/test_hostile_records.py), on a local folder or moto's S3 server, plus ways to write
anything behind the protocol's back."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from fsspec.core import url_to_fs

from atoll.core.rejection import Rejection
from atoll.storage import LearnerStore, RunHandle, RunReader, SynchronizerStore, paths
from atoll.storage.codec import dump_record, sha256_hex, tensors_to_bytes
from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, Keyring, seal
from atoll.storage.paths import join_url, to_url
from atoll.storage.records import KIND_COMMIT, KIND_CONTRIBUTION, CommitRecord
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.synchronizer import RoundSummary, Synchronizer

HONEST = ("learner-0", "learner-1")
H = TypeVar("H", bound=RunHandle)
SYNC_KEY = b"s" * 32

PRE_ROUNDS = 2
"""Rounds committed before an attack (the ``run`` fixture)."""


def learner_key(learner_id: str) -> bytes:
    return (learner_id.encode() * 8)[:32].ljust(16, b"k")


@dataclass
class Backend:
    """Where the run lives: ``local`` (a folder) or ``s3`` (moto)."""

    name: str
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return to_url(self.root) if self.name == "local" else self.root

    @property
    def local(self) -> bool:
        return self.name == "local"

    def open(self, *, keyring: Keyring | None = None, read_only: bool = False, fresh: bool = False,
             role: type[H] = RunReader) -> H:
        """A run handle as ``role`` (a bucket-policy role's class: the reader's by default);
        ``fresh=True`` gives it its own filesystem instance (another process)."""
        opts = dict(self.storage_options)
        if fresh and not self.local:
            opts["skip_instance_cache"] = True
        return role.open(self.url, opts, keyring=keyring if keyring is not None else Keyring(), read_only=read_only)

    def path(self, key: str) -> Path:
        assert self.local, "only a local run has paths"
        return Path(self.root) / key

    def pipe_many(self, objects: Mapping[str, bytes]) -> None:
        """Write many objects at once behind the protocol's back (S3: concurrent PUTs)."""
        if self.local:
            for key, data in objects.items():
                p = self.path(key)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            return
        fs, root = url_to_fs(self.url, **self.storage_options)
        fs.pipe({join_url(root, k): v for k, v in objects.items()})
        fs.invalidate_cache()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fragment_payload(shapes: Mapping[str, tuple[int, ...]], *, fill: float = 1e-4,
                     parts: Mapping[str, torch.Tensor] | None = None) -> tuple[bytes, dict[str, Any]]:
    """An fp32 delta payload for a fragment (``parts`` replaces the safetensors content) and its
    record's ``tensors`` table."""
    flat = dict(parts) if parts is not None else {
        f"{n}::data": torch.full(s, fill, dtype=torch.float32) for n, s in shapes.items()}
    meta = {n: {"codec": "fp32", "shape": list(s), "block_size": 0} for n, s in shapes.items()}
    return tensors_to_bytes(flat), meta


class HostileRun:
    """One smoke run: 3 honest learners, the real synchronizer (fake clock), a rogue handle."""

    def __init__(self, backend: Backend, *, keyed: bool = False) -> None:
        self.backend = backend
        config, recipe = smoke_recipe(len(HONEST), max_rounds=100_000)
        self.url = backend.url
        self.keys: dict[str, bytes] = {}
        if keyed:
            self.keys = {SYNCHRONIZER_KEY_ID: SYNC_KEY, **{lid: learner_key(lid) for lid in HONEST}}
        # A keyed run is created with the synchronizer's key: run.json is signed for the run.
        create_run(backend.open(keyring=Keyring(self.keys)), config.replace(initial_grace_s=0.0), recipe)
        self.store = backend.open(role=LearnerStore)  # a rogue learner's handle (no keys) and the test's reader
        self.learners = [
            RecipeLearner(backend.open(keyring=Keyring({lid: self.keys[lid]}), role=LearnerStore) if keyed else self.store,
                          lid, log=lambda _: None)
            for lid in HONEST
        ]
        self.clock = Clock()
        self.sync = self.new_synchronizer()
        self._seen = {id(lr): 0 for lr in self.learners}

    # -- the synchronizer and rounds ---------------------------------------------------------
    def new_synchronizer(self, *, fresh: bool = False) -> Synchronizer:
        """A (re)started synchronizer on its own handle (all keys when the run is keyed)."""
        return Synchronizer(self.backend.open(keyring=Keyring(self.keys), fresh=fresh, role=SynchronizerStore),
                            clock=self.clock)

    def rounds(self, n: int, sync: Synchronizer | None = None, *, max_ticks: int = 60,
               dt: float = 1.0) -> list[RoundSummary]:
        """Drive n rounds: every learner steps, the synchronizer ticks until nothing more closes."""
        sync = sync or self.sync
        out: list[RoundSummary] = []
        ticks = 0
        while len(out) < n:
            ticks += 1
            for lr in self.learners:
                lr.step()
            self.clock.t += dt
            while isinstance(s := sync.tick(), RoundSummary):
                out.append(s)
                self.learners_adopt()
            assert ticks < max_ticks or len(out) >= n, (
                f"only {len(out)} of {n} rounds closed in {max_ticks} ticks; round {sync.round + 1}: {s.reason}")
        return out

    def learners_adopt(self) -> None:
        for lr in self.learners:
            for rec in lr.store.poll_commits(self._seen[id(lr)]):
                self._seen[id(lr)] = rec.round
                if rec.updated:
                    lr.adopt(rec.round, rec.fragment, lr.store.read_global_fragment(rec.fragment, rec.round))

    def goes_on(self, n: int = 3, sync: Synchronizer | None = None, *, dt: float = 1.0) -> list[RoundSummary]:
        """(c): the synchronizer commits n more rounds, with honest learners merged."""
        sync = sync or self.sync
        start = sync.round
        done = self.rounds(n, sync, dt=dt)
        assert len(done) >= n
        assert [s.record.round for s in done] == list(range(start + 1, start + 1 + len(done)))
        merged = [a.learner_id for s in done for a in s.record.accepted]
        assert set(merged) & set(HONEST), f"no honest learner merged in rounds after {start}: {merged}"
        return done

    # -- reading -----------------------------------------------------------------------------
    def reader(self, *, keyed: bool = False, fresh: bool = False) -> RunReader:
        """A new read-only handle (its own record caches; the filesystem instance is shared unless
        ``fresh``)."""
        return self.backend.open(keyring=Keyring(self.keys) if keyed else Keyring(), read_only=True, fresh=fresh)

    def committed(self) -> list[CommitRecord]:
        """Every committed round, read by a fresh handle."""
        return self.reader().history()

    def still_readable(self, before: list[CommitRecord], *, keyed: bool = False) -> None:
        """(b): every round committed before the attack reads back exactly as it was."""
        assert before, "the attack must come after some committed rounds"
        again = self.reader(keyed=keyed).history(1, len(before))
        assert again == before

    def rejection(self, key: str, *, start: int = 1) -> Rejection:
        """The recorded rejection of ``key`` (AssertionError if no round recorded one)."""
        history = self.reader().history(start)
        for rec in history:
            if key in rec.rejected:
                return rec.rejected[key]
        accepted = [a.key for r in history for a in r.accepted]
        raise AssertionError(f"{key} was never rejected (accepted: {key in accepted})")

    def accepted_keys(self, start: int = 1) -> set[str]:
        return {a.key for r in self.reader().history(start) for a in r.accepted}

    # -- writing behind the protocol's back ----------------------------------------------------
    def next_fragment(self) -> tuple[int, int]:
        """The fragment of the next round and its current version."""
        p = self.sync.fragment_of_round(self.sync.round + 1)
        return p, self.sync.versions[p]

    def put(self, key: str, data: bytes) -> str:
        self.store.store.put(key, data)
        return key

    def contribution(
        self,
        *,
        learner_id: str = "evil",
        prefix_id: str | None = None,
        changes: Mapping[str, Any] | None = None,
        payload: bytes | None = None,
        meta: Mapping[str, Any] | None = None,
        fill: float = 1e-4,
        write_payload: bool = True,
        key: str | None = None,
        sign_with: bytes | None = None,
        fragment: int | None = None,
        edit: Callable[[bytes], bytes] | None = None,
    ) -> str:
        """Plant a sealed contribution record (and its payload) for the next round's fragment under
        ``learners/<prefix_id or learner_id>/``; returns its key. ``changes`` edits the body before
        sealing (a rogue writer can seal); ``edit`` edits the bytes after."""
        p, v = self.next_fragment()
        if fragment is not None:
            p = fragment
        owner = prefix_id or learner_id
        shapes = self.store.manifest.fragment_shapes(p)
        if payload is None:
            payload, auto = fragment_payload(shapes, fill=fill)
            meta = meta or auto
        elif meta is None:
            meta = fragment_payload(shapes)[1]
        sha = sha256_hex(payload)
        if write_payload:
            self.put(f"learners/{owner}/blobs/sha256/{sha}.safetensors", payload)
        body: dict[str, Any] = {
            "learner_id": learner_id, "fragment": p, "base_version": v, "c_steps": 2, "c_tokens": 64,
            "payload": {"sha256": sha, "nbytes": len(payload)}, "tensors": dict(meta), "created_at": 0.0,
            "info": {},
        }
        body.update(changes or {})
        if key is None:
            steps = body["c_steps"] if isinstance(body["c_steps"], int) and 0 <= body["c_steps"] < 10**10 else 2
            key = (f"learners/{owner}/contributions/f{p:04d}/b{v:08d}/"
                   f"{owner}.s{steps:010d}.{sha[:16]}.json")
        data = dump_record(KIND_CONTRIBUTION, seal(KIND_CONTRIBUTION, body, sign_with))
        if edit is not None:
            data = edit(data)
        return self.put(key, data)

    def commit_bytes(self, round_: int) -> bytes:
        data = self.store.store.get_or_none(paths.commit_key(round_))
        assert data is not None, f"round {round_} has no commit object"
        return data

    def forged_commit(self, round_: int, *, like: int | None = None, prev: str | None = None,
                      key: bytes | None = None, **changes: Any) -> bytes:
        """A sealed commit record for ``round_`` made from round ``like``'s (default the latest),
        chained to the latest commit's bytes unless ``prev`` is given: what a rogue writer who
        recomputes digests can produce."""
        like = like or self.sync.round
        body = json.loads(self.commit_bytes(like))
        body.pop("schema"), body.pop("schema_version")
        body.update(round=round_, committed_by="learner-0", nonce="f" * 32,
                    prev_sha256=prev if prev is not None else sha256_hex(self.commit_bytes(self.sync.round)))
        body.update(changes)
        return dump_record(KIND_COMMIT, seal(KIND_COMMIT, body, key))
