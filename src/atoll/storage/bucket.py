"""The run layout: :class:`RunStore`, the API learners and the synchronizer use.

One run lives under one root URL. See docs/protocol.md for the layout; in short::

    run.json                                  frozen config, plan, shapes, version-0 fragments
    blobs/sha256/<hex>.safetensors            every tensor payload, named by its sha256
    contributions/f<p>/b<base>/<learner>.s<steps>.<sha16>.json
    commits/<round>.json                      create-once commit record per round
    head.json                                 hint: latest committed round (never trusted alone)
    learners/<learner>/state.json             learner state for rejoin
    checkpoints/<round>/model.safetensors     consolidated checkpoint (+ config.json)

A fragment's *version* is the number of the round that last wrote it (0 = initial), so
``read_global_fragment(p, v)`` is one GET of ``commits/<v>.json`` plus its payload.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from atoll.core.compress import CompressionError, EncodedTensor, encode
from atoll.core.config import DilocoConfig
from atoll.core.fragments import FragmentPlan
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.synchronize import FragmentContribution
from atoll.core.weights import Counters
from atoll.storage import paths
from atoll.storage.codec import (
    bytes_to_encoded,
    bytes_to_tensors,
    dump_record,
    encoded_to_bytes,
    finite_json,
    load_record,
    sha256_hex,
    tensors_to_bytes,
)
from atoll.storage.records import (
    KIND_CHECKPOINT,
    KIND_COMMIT,
    KIND_CONTRIBUTION,
    KIND_HEAD,
    KIND_LEARNER_STATE,
    KIND_RUN,
    AcceptedContribution,
    BlobRef,
    CommitRecord,
    ContributionRecord,
    FragmentState,
    LearnerStateRecord,
    RunManifest,
)
from atoll.core.retry import RetryPolicy
from atoll.storage.store import ObjectStore
from atoll.storage.validation import (
    InvalidInput,
    RoundOrderError,
    RunExistsError,
    RunNotFoundError,
    TransientStorageError,
    check_finite,
    check_shapes,
    check_tensor_layout,
    validate_id,
)

__all__ = [
    "RunStore",
    "CommitResult",
    "ContributionListing",
    "GlobalState",
    "LearnerState",
    "CheckpointInfo",
]

Tensors = Mapping[str, torch.Tensor]


class _HasCounters(Protocol):
    c_steps: int
    c_tokens: int


@dataclass(frozen=True)
class CommitResult:
    """Outcome of :meth:`RunStore.commit_round`: did we win, and the record that is now committed."""

    won: bool
    record: CommitRecord


@dataclass
class ContributionListing:
    """Contribution records found by one poll, and the ones whose record itself was unusable."""

    records: list[ContributionRecord] = field(default_factory=list)
    rejected: dict[str, Rejection] = field(default_factory=dict)


@dataclass
class GlobalState:
    """Everything the synchronizer (or a rejoining learner) needs, as of one committed round."""

    round: int
    versions: tuple[int, ...]
    params: dict[str, torch.Tensor]
    """Every parameter, fp32, at its fragment's version."""
    momentum: dict[int, dict[str, torch.Tensor]]
    """Per fragment, the outer optimizer's ``state_dict()`` (empty before its first update)."""
    timings: dict[str, Any]
    record: CommitRecord | None
    """The commit record of ``round`` (None for round 0, the initial state)."""


@dataclass
class LearnerState:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    saved_at: float


@dataclass(frozen=True)
class CheckpointInfo:
    round: int
    model_url: str
    config_url: str
    sha256: str


class RunStore:
    """One run in a bucket. Open with :meth:`open`; create the run once with :meth:`init_run`.

    Thread-compatible: one instance may be shared by threads that do not write the same round.
    """

    def __init__(self, store: ObjectStore, *, max_payload_bytes: int | None = None) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        self._manifest: RunManifest | None = None
        self._commits: OrderedDict[int, CommitRecord] = OrderedDict()
        self._contrib_cache: dict[str, ContributionRecord | Rejection] = {}
        self._latest: int | None = None

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        check_create_once: bool = True,
        unsafe_allow_overwrite: bool = False,
        max_payload_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        store: ObjectStore | None = None,
    ) -> RunStore:
        """Open the run rooted at ``url``; credentials come from ``storage_options`` or fsspec's
        usual sources (environment, config files).

        ``check_create_once`` runs the capability probe (two creates of one scratch object; the
        second must be refused) and raises :class:`UnsafeStoreError` if the store does not refuse
        it. ``unsafe_allow_overwrite=True`` skips that refusal: only for a store with exactly one
        synchronizer (e.g. the GCS emulator, which ignores ``ifGenerationMatch``).
        ``max_payload_bytes`` caps any contribution payload (default: the fragment's fp32 size
        plus header slack). ``store`` injects a prepared :class:`ObjectStore` (tests).
        """
        if store is None:
            store = ObjectStore.open(url, storage_options, retry=retry)
        if check_create_once and not unsafe_allow_overwrite:
            store.probe_create_once()
        return cls(store, max_payload_bytes=max_payload_bytes)

    def __repr__(self) -> str:
        return f"RunStore({self.store!r})"

    def sibling(self) -> RunStore:
        """Another handle on the same run: shares the object store and the (immutable) manifest,
        but has its own record caches, so a second thread can poll without sharing state."""
        other = RunStore(self.store, max_payload_bytes=self.max_payload_bytes)
        other._manifest = self._manifest
        return other

    @property
    def url(self) -> str:
        return self.store.url

    # -- run manifest ------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.store.get_or_none(paths.RUN_MANIFEST) is not None

    def init_run(
        self,
        config: DilocoConfig,
        plan: FragmentPlan,
        initial_params: Tensors,
        *,
        run_id: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> RunManifest:
        """Write the version-0 fragments, then ``run.json`` create-once (RunExistsError if present)."""
        if run_id is None:
            run_id = self.url.rstrip("/").rsplit("/", 1)[-1]
        validate_id(run_id, "run id")
        if plan.num_fragments != config.num_fragments:
            raise ValueError(f"plan has {plan.num_fragments} fragments, config.num_fragments={config.num_fragments}")
        if plan.inner_steps != config.inner_steps:
            raise ValueError(f"plan.inner_steps={plan.inner_steps} != config.inner_steps={config.inner_steps}")
        extra = dict(extra or {})
        if not finite_json(extra):
            raise ValueError("extra must be JSON-able without NaN/Inf")
        if self.exists():
            raise RunExistsError(f"a run already exists at {self.url}")
        shapes = {n: tuple(int(d) for d in initial_params[n].shape) for n in plan.sizes if n in initial_params}
        check_tensor_layout(
            {n: t for n, t in initial_params.items()},
            {n: shapes.get(n, ()) for n in plan.sizes},
            what="initial parameters",
        )
        for n, s in shapes.items():
            if math.prod(s) != plan.sizes[n]:
                raise InvalidInput("layout", f"initial {n!r} has {math.prod(s)} elements, plan says {plan.sizes[n]}")
        check_finite(initial_params, what="initial parameters")
        initial = tuple(
            self._write_blob({n: initial_params[n].float() for n in frag}) for frag in plan.fragments
        )
        manifest = RunManifest(run_id=run_id, config=config, plan=plan, shapes=shapes, initial=initial,
                               created_at=time.time(), extra=extra)
        if not self.store.create(paths.RUN_MANIFEST, dump_record(KIND_RUN, manifest.to_dict())):
            raise RunExistsError(f"a run already exists at {self.url} (created concurrently)")
        self._manifest = manifest
        return manifest

    @property
    def manifest(self) -> RunManifest:
        if self._manifest is None:
            data = self.store.get_or_none(paths.RUN_MANIFEST)
            if data is None:
                raise RunNotFoundError(f"no run at {self.url} ({paths.RUN_MANIFEST} missing); call init_run first")
            self._manifest = RunManifest.from_body(
                load_record(data, KIND_RUN, url=self.store.key_url(paths.RUN_MANIFEST))
            )
        return self._manifest

    @property
    def config(self) -> DilocoConfig:
        return self.manifest.config

    @property
    def plan(self) -> FragmentPlan:
        return self.manifest.plan

    # -- blobs -------------------------------------------------------------------------------
    def _write_blob(self, tensors: Tensors) -> BlobRef:
        return self._write_blob_bytes(tensors_to_bytes(tensors))

    def _write_blob_bytes(self, data: bytes) -> BlobRef:
        sha = sha256_hex(data)
        # Content-addressed: overwriting with the same bytes is harmless, so a plain put suffices.
        self.store.put(paths.blob_key(sha), data)
        return BlobRef(sha, len(data))

    def _read_blob_bytes(self, ref: BlobRef, *, max_bytes: int | None = None) -> bytes:
        key = paths.blob_key(ref.sha256)
        url = self.store.key_url(key)
        if max_bytes is not None and ref.nbytes > max_bytes:
            raise InvalidInput("oversize", f"payload declares {ref.nbytes} bytes, cap is {max_bytes}", url=url)
        data = self.store.get_or_none(key, max_bytes=max_bytes)
        if data is None:
            raise InvalidInput("missing_payload", f"payload {ref.sha256} does not exist", url=url)
        if max_bytes is not None and len(data) > max_bytes:
            raise InvalidInput("oversize", f"payload is larger than the cap of {max_bytes} bytes", url=url)
        if len(data) < ref.nbytes:
            raise InvalidInput("truncated", f"payload has {len(data)} bytes, record says {ref.nbytes}", url=url)
        if len(data) > ref.nbytes:
            raise InvalidInput("checksum", f"payload has {len(data)} bytes, record says {ref.nbytes}", url=url)
        actual = sha256_hex(data)
        if actual != ref.sha256:
            raise InvalidInput("checksum", f"sha256 of payload is {actual}, expected {ref.sha256}", url=url)
        return data

    def _read_fp32_blob(self, ref: BlobRef, expected: Mapping[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
        url = self.store.key_url(paths.blob_key(ref.sha256))
        tensors = bytes_to_tensors(self._read_blob_bytes(ref), url=url)
        check_tensor_layout(tensors, expected, what=what, dtype=torch.float32)
        return tensors

    # -- contributions -----------------------------------------------------------------------
    def payload_cap(self, fragment: int) -> int:
        """Largest contribution payload accepted for ``fragment`` (bytes)."""
        if self.max_payload_bytes is not None:
            return self.max_payload_bytes
        names = self.plan.fragments[fragment]
        return 4 * self.plan.fragment_numel(fragment) + 4 * sum(len(n) + 128 for n in names) + 65536

    def _check_fragment(self, fragment: int) -> None:
        if not isinstance(fragment, int) or not 0 <= fragment < self.plan.num_fragments:
            raise ValueError(f"fragment must be in [0, {self.plan.num_fragments}), got {fragment!r}")

    def publish_contribution(
        self,
        learner_id: str,
        fragment: int,
        base_version: int,
        counters: _HasCounters,
        delta: Mapping[str, torch.Tensor | EncodedTensor],
        *,
        codec: str | None = None,
        block_size: int | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> ContributionRecord:
        """Write a learner's delta for ``fragment`` (payload first, then the record, create-once).

        ``delta`` maps every parameter of the fragment to a raw tensor (encoded here with
        ``codec``, default the run's ``config.compression``) or an already encoded
        :class:`~atoll.core.compress.EncodedTensor`. ``counters`` is anything with ``c_steps`` and
        ``c_tokens`` (``core.weights.Counters`` or ``core.align.FragmentCounters``).
        """
        validate_id(learner_id, "learner id")
        self._check_fragment(fragment)
        if not isinstance(base_version, int) or base_version < 0:
            raise ValueError(f"base_version must be an integer >= 0, got {base_version!r}")
        c_steps, c_tokens = int(counters.c_steps), int(counters.c_tokens)
        if c_steps < 0 or c_tokens < 0:
            raise ValueError(f"counters must be >= 0, got c_steps={c_steps}, c_tokens={c_tokens}")
        info = dict(info or {})
        if not finite_json(info):
            raise ValueError("info must be JSON-able without NaN/Inf")
        expected = self.manifest.fragment_shapes(fragment)
        codec = codec or self.config.compression
        block_size = block_size or self.config.compression_block_size
        encoded: dict[str, EncodedTensor] = {}
        for name, value in delta.items():
            if isinstance(value, EncodedTensor):
                encoded[name] = value
                continue
            try:
                encoded[name] = encode(value, codec, block_size=block_size)
            except CompressionError as e:
                raise InvalidInput(e.kind, f"delta {name!r}: {e}") from None
        shapes = {n: e.shape for n, e in encoded.items()}
        check_shapes(shapes, expected, what=f"delta for fragment {fragment}")
        data, meta = encoded_to_bytes(encoded)
        cap = self.payload_cap(fragment)
        if len(data) > cap:
            raise InvalidInput("oversize", f"delta payload is {len(data)} bytes, cap is {cap}")
        ref = self._write_blob_bytes(data)
        key = paths.contribution_key(fragment, base_version, learner_id, c_steps, ref.sha256)
        record = ContributionRecord(key=key, learner_id=learner_id, fragment=fragment, base_version=base_version,
                                    c_steps=c_steps, c_tokens=c_tokens, payload=ref, tensors=meta,
                                    created_at=time.time(), info=info)
        if not self.store.create(key, dump_record(KIND_CONTRIBUTION, record.to_dict())):
            existing = self._read_contribution_record(key)
            if isinstance(existing, Rejection):
                raise InvalidInput("schema", f"a different, unreadable record already sits at {key}: {existing}")
            return existing
        return record

    def _read_contribution_record(self, key: str) -> ContributionRecord | Rejection:
        """Parsed record, or the reason it is unusable. Cached: records are immutable."""
        cached = self._contrib_cache.get(key)
        if cached is not None:
            return cached
        url = self.store.key_url(key)
        try:
            data = self.store.get_or_none(key, max_bytes=1 << 20)
        except TransientStorageError:
            raise  # the store is unwell, not this record: the caller's retry policy decides
        except Exception as e:  # noqa: BLE001 - e.g. a directory or a FIFO where a record belongs
            return Rejection(RejectionKind.CORRUPT, f"record cannot be read: {type(e).__name__}: {e}")
        if data is None:
            # Not cached: it may be a listing race.
            return Rejection(RejectionKind.MISSING_PAYLOAD, "record listed but gone before it could be read")
        try:
            if len(data) > 1 << 20:
                raise InvalidInput("oversize", "contribution record larger than 1 MiB", url=url)
            record = ContributionRecord.from_body(load_record(data, KIND_CONTRIBUTION, url=url), key)
            expected_key = paths.contribution_key(record.fragment, record.base_version, record.learner_id,
                                                  record.c_steps, record.payload.sha256)
            if expected_key != key:
                raise InvalidInput("schema", f"record fields say it belongs at {expected_key}", url=url)
            result: ContributionRecord | Rejection = record
        except InvalidInput as e:
            result = e.rejection
        self._contrib_cache[key] = result
        return result

    def list_contributions(self, fragment: int, base_versions: int | Iterable[int]) -> ContributionListing:
        """Contribution records for ``fragment`` computed against the given base version(s).

        One LIST per base version (listing cache invalidated first), then one GET per record not
        seen before (records are immutable and cached). Payloads are not read here.
        """
        self._check_fragment(fragment)
        bases = [base_versions] if isinstance(base_versions, int) else sorted(set(base_versions))
        listing = ContributionListing()
        for base in bases:
            prefix = paths.contributions_prefix(fragment, base)
            for name in self.store.list(prefix):
                if not name.endswith(".json"):
                    continue
                key = prefix + name
                rec = self._read_contribution_record(key)
                if isinstance(rec, Rejection):
                    listing.rejected[key] = rec
                else:
                    listing.records.append(rec)
        listing.records.sort(key=lambda r: (r.created_at, r.key))
        return listing

    def load_contribution(self, record: ContributionRecord) -> FragmentContribution:
        """Read, verify (size cap, sha256, names/shapes/dtypes, finiteness) and decode to fp32.

        Raises InvalidInput with a specific ``kind`` for every bad-input class.
        """
        self._check_fragment(record.fragment)
        validate_id(record.learner_id, "learner id")
        url = self.store.key_url(paths.blob_key(record.payload.sha256))
        expected = self.manifest.fragment_shapes(record.fragment)
        try:
            declared = {n: tuple(int(d) for d in m["shape"]) for n, m in record.tensors.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput("schema", f"contribution {record.key}: bad tensor shapes: {e}") from None
        check_shapes(declared, expected, what=f"contribution {record.key}")
        data = self._read_blob_bytes(record.payload, max_bytes=self.payload_cap(record.fragment))
        delta = bytes_to_encoded(data, record.tensors, url=url)
        check_tensor_layout(delta, expected, what=f"contribution {record.key}", dtype=torch.float32)
        return FragmentContribution(
            key=record.key,
            learner_id=record.learner_id,
            base_version=record.base_version,
            counters=Counters(c_steps=record.c_steps, c_tokens=record.c_tokens),
            delta=delta,
        )

    def load_contributions(
        self, records: Iterable[ContributionRecord]
    ) -> tuple[list[FragmentContribution], dict[str, Rejection]]:
        """Load many; bad ones land in the second value as ``key -> Rejection`` instead of raising."""
        ok: list[FragmentContribution] = []
        rejected: dict[str, Rejection] = {}
        for r in records:
            try:
                ok.append(self.load_contribution(r))
            except InvalidInput as e:
                rejected[r.key] = e.rejection
        return ok, rejected

    # -- commits -----------------------------------------------------------------------------
    def read_commit(self, round_: int) -> CommitRecord | None:
        """The committed record of ``round_`` (one GET; cached), or None if not committed yet."""
        cached = self._commits.get(round_)
        if cached is not None:
            return cached
        key = paths.commit_key(round_)
        data = self.store.get_or_none(key)
        if data is None:
            return None
        body = load_record(data, KIND_COMMIT, url=self.store.key_url(key))
        record = CommitRecord.from_body(body, self.plan.num_fragments)
        if record.round != round_:
            raise InvalidInput("schema", f"commit record at {key} says round {record.round}",
                               url=self.store.key_url(key))
        self._remember(record)
        return record

    def _remember(self, record: CommitRecord) -> None:
        self._commits[record.round] = record
        while len(self._commits) > 4096:
            self._commits.popitem(last=False)

    def latest_round(self) -> int:
        """Latest committed round (0 if none).

        The first call reads the ``head.json`` hint (or LISTs ``commits/`` if the hint is absent
        or wrong); every call then probes forward with GETs of the next commit keys, so a steady
        poll costs one GET and no LIST.
        """
        if self._latest is None:
            start = 0
            hint = self.store.get_or_none(paths.HEAD)
            if hint is not None:
                try:
                    r = int(load_record(hint, KIND_HEAD).get("round", 0))
                    if r >= 1 and self.read_commit(r) is not None:
                        start = r
                except (InvalidInput, ValueError, TypeError):
                    pass
            if start == 0:
                rounds = [parsed for n in self.store.list(paths.commits_prefix())
                          if (parsed := paths.parse_commit_key(n)) is not None]
                start = max(rounds, default=0)
            self._latest = start
        r = self._latest
        while self.read_commit(r + 1) is not None:
            r += 1
        self._latest = r
        return r

    def poll_commits(self, after_round: int) -> list[CommitRecord]:
        """Records committed after ``after_round``, in order (GETs of the next keys; no LIST)."""
        out: list[CommitRecord] = []
        r = after_round + 1
        while (rec := self.read_commit(r)) is not None:
            out.append(rec)
            r += 1
        if out and (self._latest is None or out[-1].round > self._latest):
            self._latest = out[-1].round
        return out

    def history(self, start: int = 1, stop: int | None = None) -> list[CommitRecord]:
        """Commit records of rounds ``start`` .. ``stop`` (inclusive; default the latest)."""
        stop = self.latest_round() if stop is None else stop
        out = []
        for r in range(max(1, start), stop + 1):
            rec = self.read_commit(r)
            if rec is None:
                raise RoundOrderError(f"round {r} is not committed in {self.url}")
            out.append(rec)
        return out

    def _state_table(self, round_: int) -> tuple[FragmentState, ...]:
        if round_ == 0:
            return tuple(FragmentState(version=0, params=b) for b in self.manifest.initial)
        rec = self.read_commit(round_)
        if rec is None:
            raise RoundOrderError(f"round {round_} is not committed in {self.url}")
        return rec.state

    def commit_round(
        self,
        round_: int,
        fragment: int,
        *,
        params: Tensors | None,
        momentum: Tensors | None = None,
        accepted: Iterable[AcceptedContribution | Mapping[str, Any]] = (),
        rejected: Mapping[str, Rejection] | None = None,
        timings: Mapping[str, Any] | None = None,
        stats: Mapping[str, Any] | None = None,
        committed_by: str = "synchronizer",
    ) -> CommitResult:
        """Commit round ``round_`` for ``fragment``: new fragment values (None: no update), the
        outer optimizer's ``state_dict()`` for that fragment, who was in and out, timings and
        stats. Payloads first, then the record create-once.

        Returns ``CommitResult(won=True, record=ours)``, or ``won=False`` with the record that a
        racing synchronizer committed first (nothing of ours is trusted then). Raises
        RoundOrderError if round ``round_ - 1`` is not committed.
        """
        if not isinstance(round_, int) or round_ < 1:
            raise ValueError(f"rounds start at 1, got {round_!r}")
        self._check_fragment(fragment)
        existing = self.read_commit(round_)
        if existing is not None:
            return CommitResult(False, existing)
        state = list(self._state_table(round_ - 1))
        accepted_t = tuple(a if isinstance(a, AcceptedContribution) else AcceptedContribution.from_body(dict(a))
                           for a in accepted)
        rejections = dict(rejected or {})
        for key, why in rejections.items():
            if not isinstance(why, Rejection):
                raise TypeError(f"rejected[{key!r}] must be a Rejection, got {type(why).__name__}")
        body_extra = {"timings": dict(timings or {}), "stats": dict(stats or {})}
        for k, v in body_extra.items():
            if not finite_json(v):
                raise ValueError(f"{k} must be JSON-able without NaN/Inf")
        expected = self.manifest.fragment_shapes(fragment)
        if params is not None:
            check_tensor_layout(params, expected, what=f"round {round_} params for fragment {fragment}")
            check_finite(params, what=f"round {round_} params")
            params_ref = self._write_blob({n: params[n].float() for n in expected})
            momentum_ref = state[fragment].momentum
            if momentum is not None:
                check_tensor_layout(momentum, {f"momentum.{n}": s for n, s in expected.items()},
                                    what=f"round {round_} momentum", allow_missing=True)
                check_finite(momentum, what=f"round {round_} momentum")
                momentum_ref = self._write_blob({n: t.float() for n, t in momentum.items()})
            state[fragment] = FragmentState(version=round_, params=params_ref, momentum=momentum_ref)
        record = CommitRecord(
            round=round_, fragment=fragment, updated=params is not None, state=tuple(state),
            accepted=accepted_t, rejected=rejections, timings=body_extra["timings"],
            stats=body_extra["stats"], committed_by=committed_by, nonce=uuid.uuid4().hex, created_at=time.time(),
        )
        if self.store.create(paths.commit_key(round_), dump_record(KIND_COMMIT, record.to_dict())):
            self._remember(record)
            try:  # a hint only: readers verify it against the commit record
                self.store.put(paths.HEAD, dump_record(KIND_HEAD, {"round": round_}))
            except Exception:  # noqa: BLE001
                pass
            return CommitResult(True, record)
        winner = self.read_commit(round_)
        if winner is None:  # pragma: no cover - the store refused the create but has no object
            raise RoundOrderError(f"commit of round {round_} was refused but no record is readable at {self.url}")
        return CommitResult(False, winner)

    # -- global state ------------------------------------------------------------------------
    def read_global_fragment(self, fragment: int, version: int | None = None) -> dict[str, torch.Tensor]:
        """Fragment values at ``version`` (the round that wrote it; 0 = initial; None = latest)."""
        self._check_fragment(fragment)
        if version is None:
            version = self._state_table(self.latest_round())[fragment].version
        if version == 0:
            ref = self.manifest.initial[fragment]
        else:
            rec = self.read_commit(version)
            if rec is None:
                raise RoundOrderError(f"version {version} of fragment {fragment}: round {version} is not committed")
            st = rec.state[fragment]
            if st.version != version:
                raise ValueError(f"round {version} did not write fragment {fragment} (it holds version {st.version})")
            ref = st.params
        return self._read_fp32_blob(ref, self.manifest.fragment_shapes(fragment), f"fragment {fragment} v{version}")

    def read_global_state(self, round_: int | None = None) -> GlobalState:
        """All parameters, outer-optimizer state and timings as of ``round_`` (None = latest)."""
        round_ = self.latest_round() if round_ is None else round_
        table = self._state_table(round_)
        params: dict[str, torch.Tensor] = {}
        momentum: dict[int, dict[str, torch.Tensor]] = {}
        for p, st in enumerate(table):
            shapes = self.manifest.fragment_shapes(p)
            params.update(self._read_fp32_blob(st.params, shapes, f"fragment {p} v{st.version}"))
            if st.momentum is not None:
                mshapes = {f"momentum.{n}": s for n, s in shapes.items()}
                got = bytes_to_tensors(self._read_blob_bytes(st.momentum))
                check_tensor_layout(got, mshapes, what=f"fragment {p} momentum", dtype=torch.float32,
                                    allow_missing=True)
                momentum[p] = got
            else:
                momentum[p] = {}
        rec = self.read_commit(round_) if round_ else None
        return GlobalState(round=round_, versions=tuple(s.version for s in table), params=params,
                           momentum=momentum, timings=dict(rec.timings) if rec else {}, record=rec)

    # -- learner state -----------------------------------------------------------------------
    def save_learner_state(self, learner_id: str, tensors: Tensors, meta: Mapping[str, Any] | None = None) -> None:
        """Overwrite learner ``learner_id``'s rejoin state (payload first, then the record)."""
        validate_id(learner_id, "learner id")
        meta = dict(meta or {})
        if not finite_json(meta):
            raise ValueError("meta must be JSON-able without NaN/Inf")
        ref = self._write_blob(tensors)
        rec = LearnerStateRecord(learner_id=learner_id, payload=ref, meta=meta, saved_at=time.time())
        self.store.put(paths.learner_state_key(learner_id), dump_record(KIND_LEARNER_STATE, rec.to_dict()))

    def load_learner_state(self, learner_id: str) -> LearnerState | None:
        """The learner's last saved state, or None if it never saved one."""
        key = paths.learner_state_key(learner_id)
        data = self.store.get_or_none(key)
        if data is None:
            return None
        rec = LearnerStateRecord.from_body(load_record(data, KIND_LEARNER_STATE, url=self.store.key_url(key)))
        if rec.learner_id != learner_id:
            raise InvalidInput("schema", f"state at {key} belongs to {rec.learner_id!r}", url=self.store.key_url(key))
        tensors = bytes_to_tensors(self._read_blob_bytes(rec.payload))
        return LearnerState(tensors=tensors, meta=dict(rec.meta), saved_at=rec.saved_at)

    # -- consolidated checkpoints ------------------------------------------------------------
    def write_checkpoint(self, round_: int | None = None) -> CheckpointInfo:
        """Write ``checkpoints/<round>/model.safetensors`` (whole model, fp32, plain safetensors)
        and then ``config.json`` (run config, plan, versions, the model's sha256)."""
        state = self.read_global_state(round_)
        m = self.manifest
        data = tensors_to_bytes(state.params, metadata={"format": "atoll-checkpoint", "run_id": m.run_id,
                                                        "round": str(state.round)})
        model_key, config_key = paths.checkpoint_model_key(state.round), paths.checkpoint_config_key(state.round)
        self.store.put(model_key, data)
        sha = sha256_hex(data)
        body = {"run_id": m.run_id, "round": state.round, "versions": list(state.versions),
                "config": m.config.to_dict(), "plan": m.plan.to_dict(),
                "shapes": {n: list(s) for n, s in m.shapes.items()},
                "model": {"file": "model.safetensors", "sha256": sha, "nbytes": len(data)},
                "created_at": time.time()}
        self.store.put(config_key, dump_record(KIND_CHECKPOINT, body))
        return CheckpointInfo(state.round, self.store.key_url(model_key), self.store.key_url(config_key), sha)

    def list_checkpoints(self) -> list[int]:
        """Rounds that have a checkpoint folder (one LIST)."""
        return sorted(int(n) for n in self.store.list(paths.checkpoints_prefix()) if n.isdigit())

    def load_checkpoint(self, round_: int) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, verified against the sha256 in its config.json."""
        ckey = paths.checkpoint_config_key(round_)
        cdata = self.store.get_or_none(ckey)
        if cdata is None:
            raise FileNotFoundError(f"no checkpoint config at {self.store.key_url(ckey)}")
        body = load_record(cdata, KIND_CHECKPOINT, url=self.store.key_url(ckey))
        mkey = paths.checkpoint_model_key(round_)
        data = self.store.get_or_none(mkey)
        if data is None:
            raise InvalidInput("missing_payload", "checkpoint model file is missing", url=self.store.key_url(mkey))
        if sha256_hex(data) != body.get("model", {}).get("sha256"):
            raise InvalidInput("checksum", "checkpoint model sha256 differs from config.json",
                               url=self.store.key_url(mkey))
        return bytes_to_tensors(data, url=self.store.key_url(mkey))
