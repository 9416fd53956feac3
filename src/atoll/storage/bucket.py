"""The run layout: :class:`RunStore`, the API learners and the synchronizer use.

One run lives under one root URL. See docs/protocol.md for the layout; in short::

    run.json                                   frozen config, plan, shapes, version-0 fragments
    learners/<id>/                             written by learner <id> only
        contributions/f<p>/b<base>/<id>.s<steps>.<sha16>.json
        blobs/sha256/<hex>.safetensors         its deltas and inner state, named by sha256
        state.json                             its rejoin state
    sync/                                      written by the synchronizer only
        commits/<round>.json                   create-once commit record per round (sealed, chained)
        repairs/<round>/r<n>.json              the round's commit, if its slot was found void
        blobs/sha256/<hex>.safetensors         global fragments, outer momentum, downlink views and updates
        head.json                              hint: latest committed round (never trusted alone)
        checkpoints/<round>/model.safetensors  consolidated checkpoint (+ config.json)
        prune.json                             what retention may have deleted (atoll prune)

A fragment's *version* is the number of the round that last wrote it (0 = initial), so
``read_global_fragment(p, v)`` is one GET of ``sync/commits/<v>.json`` plus its payload.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from atoll.core.compress import CompressionError, EncodedTensor, encode
from atoll.core.config import DilocoConfig
from atoll.core.downlink import DownlinkStep
from atoll.core.fragments import FragmentPlan
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.retry import RetryPolicy
from atoll.core.synchronize import FragmentContribution
from atoll.core.weights import Counters
from atoll.storage import liveness, paths
from atoll.storage.codec import (
    LAYOUT_SCHEMA_VERSION,
    bytes_to_encoded,
    bytes_to_tensors,
    dump_record,
    encoded_to_bytes,
    finite_json,
    load_record,
    record_version,
    sha256_hex,
    tensors_to_bytes,
)
from atoll.storage.integrity import KEYRING_ENV, SYNCHRONIZER_KEY_ID, IntegrityError, Keyring, check_seal, seal
from atoll.storage.liveness import KIND_STOP, SYNCHRONIZER_HOLDER, Heartbeat, Lease, Liveness, StopMarker
from atoll.storage.reading import Skipped, read_bytes, read_parsed, skip_of
from atoll.storage.records import (
    KIND_CHECKPOINT,
    KIND_COMMIT,
    KIND_CONTRIBUTION,
    KIND_HEAD,
    KIND_LEARNER_STATE,
    KIND_PRUNE,
    KIND_RUN,
    AcceptedContribution,
    BlobRef,
    CommitRecord,
    ContributionRecord,
    DownlinkState,
    FragmentState,
    LearnerStateRecord,
    PruneRecord,
    RunManifest,
)
from atoll.storage.store import ObjectStore, io_map
from atoll.storage.validation import (
    InvalidInput,
    LayoutError,
    PrunedError,
    ReadOnlyError,
    RoundOrderError,
    RunExistsError,
    RunNotFoundError,
    StorageError,
    TransientStorageError,
    check_finite,
    check_shapes,
    check_tensor_layout,
    validate_id,
    validate_learner_id,
)

__all__ = [
    "RunStore",
    "VerifyReport",
    "CommitResult",
    "ContributionListing",
    "GlobalState",
    "LearnerState",
    "CheckpointInfo",
]

Tensors = Mapping[str, torch.Tensor]


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"

# Every GET of a record is capped by the kind of object (a hostile object cannot make a reader
# download gigabytes); payloads are capped by the size a verified record declares.
MAX_MANIFEST_BYTES = 64 << 20
MAX_COMMIT_BYTES = 16 << 20
MAX_HEAD_BYTES = 4 << 10
MAX_CONTRIBUTION_RECORD_BYTES = 1 << 20
MAX_LEARNER_STATE_RECORD_BYTES = 1 << 20
MAX_CHECKPOINT_CONFIG_BYTES = 64 << 20
CACHE_ENTRIES = 65536
"""Bound on each per-handle cache (contribution records, commit records, chain links)."""


class _HasCounters(Protocol):
    @property
    def c_steps(self) -> int: ...
    @property
    def c_tokens(self) -> int: ...


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
    skipped: dict[str, int] = field(default_factory=dict)
    """Prefix -> record names listed beyond :data:`MAX_LISTED_PER_PREFIX` (not read; at most
    :data:`LIST_LIMIT` are listed, so this is a lower bound of what the prefix holds)."""


MAX_LISTED_PER_PREFIX = 256
"""Contribution records read per listed prefix (one learner, fragment and base version): the
newest by name (the highest ``c_steps``); the rest are counted, never read. An honest learner
writes one per publish while its base stays current, so this covers hours of a stalled
synchronizer; more can only be a learner filling its own prefix."""

LIST_LIMIT = 2 * MAX_LISTED_PER_PREFIX
"""Names listed per prefix (one request on S3 and GCS): a prefix holding millions of objects costs
a poll what one holding this many does. Past it, which names are listed is the backend's choice
(S3, GCS: the first in key order), so a learner that floods its own prefix can hide only its own
newer records."""


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
    restored: dict[int, str] = field(default_factory=dict)
    """Fragments whose published state object did not verify, and what was used instead (an
    older version of the fragment, or its version 0); empty when everything verified."""


@dataclass
class LearnerState:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    saved_at: float


@dataclass
class VerifyReport:
    """What :meth:`RunStore.verify` found."""

    latest: int = 0
    """The last round slot that holds an object."""
    verified: int = 0
    """Rounds whose commit (or repair) verified."""
    void: list[int] = field(default_factory=list)
    """Rounds whose slot holds something that does not verify and has no valid repair."""
    problems: list[str] = field(default_factory=list)
    """One line per problem, naming the object."""
    pruned: int = 0
    """State objects not checked because retention (``sync/prune.json``) may have deleted them."""
    prune: PruneRecord | None = None
    """The run's retention record, if it has one."""
    gaps: list[int] = field(default_factory=list)
    """Rounds missing from the chain while later rounds are stored (``sync/commits/`` or
    ``sync/repairs/``): the chain has a hole, and what follows it is not reachable."""
    slots: int = 0
    """Commit slots listed (rounds with an object in ``sync/commits/`` or a repair folder)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def check_blob(self, store: RunStore, ref: BlobRef, what: str) -> None:
        try:
            store._read_blob_bytes(ref)
        except (InvalidInput, TransientStorageError) as e:
            self.problems.append(f"{what}: {e}")
        except StorageError as e:  # a folder, a FIFO, a link out of the run where a payload belongs
            self.problems.append(f"{what}: {e}")


def _ranges(rounds: list[int]) -> str:
    """``1-3, 7`` for [1, 2, 3, 7] (the first 20 runs)."""
    runs: list[list[int]] = []
    for n in sorted(rounds):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:20])
    return text + (", ..." if len(runs) > 20 else "")


@dataclass(frozen=True)
class CheckpointInfo:
    round: int
    model_url: str
    config_url: str
    sha256: str


class RunStore:
    """One run in a bucket. Open with :meth:`open`. :meth:`init_run` writes a new run's manifest and
    version-0 weights (storage knows no models: :func:`atoll.train.run.create_run` builds them).

    Thread-compatible: one instance may be shared by threads that do not write the same round.
    """

    def __init__(self, store: ObjectStore, *, max_payload_bytes: int | None = None,
                 keyring: Keyring | None = None, read_only: bool = False) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        self.keyring = keyring if keyring is not None else Keyring()
        self.read_only = read_only
        self._commit_sha: OrderedDict[int, str] = OrderedDict()
        self._manifest_sha: str | None = None
        self._manifest: RunManifest | None = None
        self._manifest_body: dict[str, Any] | None = None
        self._commits: OrderedDict[int, CommitRecord] = OrderedDict()
        self._contrib_cache: OrderedDict[str, ContributionRecord | Rejection] = OrderedDict()
        self._contrib_lock = threading.Lock()  # records are read by several I/O threads at once
        self._latest: int | None = None
        self._run_keys: Keyring | None = None
        self.skipped: list[Skipped] = []
        """Void slots readers stepped over (the newest 100; :meth:`readable_commit`), for logs and tests."""

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
        keyring: Keyring | None = None,
        read_only: bool = False,
    ) -> RunStore:
        """Open the run rooted at ``url``: the one way to open a run, for every layer (a new run
        is then created by :func:`atoll.train.run.create_run`). A local path becomes an absolute
        ``file://`` URL, so the run's URL means the same to every process it is handed to.
        Credentials come from ``storage_options`` or fsspec's usual sources (environment, config
        files).

        ``check_create_once`` runs the capability probe (two creates of one scratch object; the
        second must be refused) and raises :class:`UnsafeStoreError` if the store does not refuse
        it. ``unsafe_allow_overwrite=True`` skips that refusal: only for a store with exactly one
        synchronizer (e.g. the GCS emulator, which ignores ``ifGenerationMatch``).
        ``max_payload_bytes`` caps any contribution payload (default: the fragment's fp32 size
        plus header slack). ``store`` injects a prepared :class:`ObjectStore` (tests).
        ``keyring``: HMAC keys (default: ``$ATOLL_KEYRING``, none if unset; see
        :mod:`atoll.storage.integrity`). ``read_only=True`` writes nothing, not even the probe:
        for ``atoll status``, ``verify`` and the source of a fork.
        """
        if store is None:
            store = ObjectStore.open(paths.to_url(url), storage_options, retry=retry)
        if check_create_once and not unsafe_allow_overwrite and not read_only:
            store.probe_create_once()
        return cls(store, max_payload_bytes=max_payload_bytes,
                   keyring=Keyring.from_env() if keyring is None else keyring, read_only=read_only)

    def _run_key(self, writer: str) -> bytes | None:
        """``writer``'s signing key for this run (:meth:`Keyring.for_run`: a signature binds the run id)."""
        if not self.keyring:
            return None
        if self._run_keys is None:
            self._run_keys = self.keyring.for_run(self.manifest.run_id)
        return self._run_keys.key(writer)

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{self.url} was opened read-only")

    def __repr__(self) -> str:
        return f"RunStore({self.store!r})"

    def sibling(self, *, metered_apart: bool = False) -> RunStore:
        """Another handle on the same run: shares the object store and the (immutable) manifest,
        but has its own record caches, so a second thread can poll without sharing state.
        ``metered_apart``: its object store counts its requests and bytes apart from this one's
        (:meth:`ObjectStore.metered_apart`; a handle for someone else in the process)."""
        store = self.store.metered_apart() if metered_apart else self.store
        other = RunStore(store, max_payload_bytes=self.max_payload_bytes, keyring=self.keyring,
                         read_only=self.read_only)
        other._manifest, other._manifest_sha = self._manifest, self._manifest_sha
        other._manifest_body = self._manifest_body
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
        self._check_writable()
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
        # Sealed, and signed for this run when the keyring holds the synchronizer's key: with a
        # keyring, run.json is checked (checked_manifest) before anything in it is acted on.
        sync_key = self.keyring.for_run(run_id).key(SYNCHRONIZER_KEY_ID) if self.keyring else None
        body = seal(KIND_RUN, manifest.to_dict(), sync_key)
        data = dump_record(KIND_RUN, body)
        if not self.store.create(paths.RUN_MANIFEST, data):
            raise RunExistsError(f"a run already exists at {self.url} (created concurrently)")
        self._manifest, self._manifest_sha, self._manifest_body = manifest, sha256_hex(data), body
        return manifest

    @property
    def manifest(self) -> RunManifest:
        if self._manifest is None:
            data = self._get_capped(paths.RUN_MANIFEST, MAX_MANIFEST_BYTES, denied_raises=True)
            if data is None:
                raise RunNotFoundError(f"no run at {self.url} ({paths.RUN_MANIFEST} missing); call init_run first")
            url = self.store.key_url(paths.RUN_MANIFEST)
            version = record_version(data)
            if isinstance(version, int) and not isinstance(version, bool) and version < LAYOUT_SCHEMA_VERSION:
                raise LayoutError(
                    f"the run at {self.url} uses bucket layout 1 (atoll 0.1: blobs/ and commits/ shared at "
                    f"the run root); this atoll writes layout 2 (learners/<id>/ and sync/ prefixes, "
                    f"schema_version {LAYOUT_SCHEMA_VERSION}) and cannot continue it. Start a new run, or "
                    f"read this one with atoll 0.1")
            body = load_record(data, KIND_RUN, url=url)
            self._manifest = RunManifest.from_body(body)
            self._manifest_sha, self._manifest_body = sha256_hex(data), body
        return self._manifest

    def checked_manifest(self) -> RunManifest:
        """``run.json`` once it is checked, for whatever acts on it (a learner host running its
        ``command``, the synchronizer importing its model module): signed for this run by the
        synchronizer's key when this handle's keyring holds it, or else chained: round 1's commit
        (or its repair) links to run.json's bytes. Raises :class:`IntegrityError` when the keyring
        holds the synchronizer's key and run.json is neither, or when round 1 is committed and does
        not link to it (a rewritten run.json). A run with no keyring and no round yet has nothing to
        check against: the bucket policy (docs/protocol.md section 8) is then the defence."""
        manifest = self.manifest
        url = self.store.key_url(paths.RUN_MANIFEST)
        key = self._run_key(SYNCHRONIZER_KEY_ID)
        problem: IntegrityError | None = None
        if key is not None:
            try:
                check_seal(KIND_RUN, self._manifest_body or {}, url=url, key=key)
                return manifest
            except IntegrityError as e:
                problem = e
        try:
            first = self.read_commit(1)  # verifies prev_sha256 against run.json's bytes
        except IntegrityError as e:
            raise IntegrityError(f"run.json does not match the chain (round 1 does not link to it): {e.what}",
                                 url) from None
        if first is None and problem is not None:
            raise problem
        return manifest

    @property
    def config(self) -> DilocoConfig:
        return self.manifest.config

    @property
    def plan(self) -> FragmentPlan:
        return self.manifest.plan

    # -- blobs -------------------------------------------------------------------------------
    def _write_blob(self, tensors: Tensors, learner_id: str | None = None) -> BlobRef:
        return self._write_blob_bytes(tensors_to_bytes(tensors), learner_id)

    def _write_blob_bytes(self, data: bytes, learner_id: str | None = None) -> BlobRef:
        """A payload under its writer's prefix (``learner_id=None``: the synchronizer's)."""
        self._check_writable()
        sha = sha256_hex(data)
        # Content-addressed: overwriting with the same bytes is harmless, so a plain put suffices.
        self.store.put(paths.blob_key(sha, learner_id), data)
        return BlobRef(sha, len(data))

    def _read_blob_bytes(self, ref: BlobRef, *, learner_id: str | None = None, max_bytes: int | None = None) -> bytes:
        key = paths.blob_key(ref.sha256, learner_id)
        url = self.store.key_url(key)
        if max_bytes is not None and ref.nbytes > max_bytes:
            raise InvalidInput("oversize", f"payload declares {ref.nbytes} bytes, cap is {max_bytes}", url=url)
        # Never read more than the (verified) record declares, plus one byte to detect "longer".
        data = self.store.get_or_none(key, max_bytes=ref.nbytes if max_bytes is None else max_bytes)
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
        tensors = bytes_to_tensors(self._read_blob_bytes(ref), url=url)  # global state: the synchronizer's
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
        incarnation: int = 0,
    ) -> ContributionRecord:
        """Write a learner's delta for ``fragment`` (payload first, then the record, create-once).

        ``delta`` maps every parameter of the fragment to a raw tensor (encoded here with
        ``codec``, default the run's ``config.compression``) or an already encoded
        :class:`~atoll.core.compress.EncodedTensor`. ``counters`` is anything with ``c_steps`` and
        ``c_tokens`` (``core.weights.Counters`` or ``core.align.FragmentCounters``).
        ``incarnation``: the publisher's lease incarnation (:meth:`take_learner_lease`; 0 = none),
        stored in the record (and signed with it) so the synchronizer can fence older copies.
        """
        validate_learner_id(learner_id)
        self._check_writable()
        self._check_fragment(fragment)
        if not isinstance(base_version, int) or base_version < 0:
            raise ValueError(f"base_version must be an integer >= 0, got {base_version!r}")
        if not isinstance(incarnation, int) or isinstance(incarnation, bool) or incarnation < 0:
            raise ValueError(f"incarnation must be an integer >= 0, got {incarnation!r}")
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
                # Serialized below, before this call returns: no copy of the delta is needed.
                encoded[name] = encode(value, codec, block_size=block_size, copy=False)
            except CompressionError as e:
                raise InvalidInput(e.kind, f"delta {name!r}: {e}") from None
        shapes = {n: e.shape for n, e in encoded.items()}
        check_shapes(shapes, expected, what=f"delta for fragment {fragment}")
        data, meta = encoded_to_bytes(encoded)
        cap = self.payload_cap(fragment)
        if len(data) > cap:
            raise InvalidInput("oversize", f"delta payload is {len(data)} bytes, cap is {cap}")
        ref = self._write_blob_bytes(data, learner_id)
        key = paths.contribution_key(fragment, base_version, learner_id, c_steps, ref.sha256)
        record = ContributionRecord(key=key, learner_id=learner_id, fragment=fragment, base_version=base_version,
                                    c_steps=c_steps, c_tokens=c_tokens, payload=ref, tensors=meta,
                                    created_at=time.time(), info=info, incarnation=incarnation)
        body = seal(KIND_CONTRIBUTION, record.to_dict(), self._run_key(learner_id))
        if not self.store.create(key, dump_record(KIND_CONTRIBUTION, body)):
            existing = self._read_contribution_record(key)
            if isinstance(existing, Rejection):
                raise InvalidInput("schema", f"a different, unreadable record already sits at {key}: {existing}")
            return existing
        return record

    def _read_contribution_record(self, key: str) -> ContributionRecord | Rejection:
        """Parsed record, or the reason it is unusable. Cached: records are immutable."""
        with self._contrib_lock:
            cached = self._contrib_cache.get(key)
        if cached is not None:
            return cached
        url = self.store.key_url(key)
        try:
            data = self._get_capped(key, MAX_CONTRIBUTION_RECORD_BYTES)
        except InvalidInput as e:  # oversize
            return self._cache_contribution(key, e.rejection)
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
            body = load_record(data, KIND_CONTRIBUTION, url=url)
            record = ContributionRecord.from_body(body, key)
            if paths.learner_of_key(key) != record.learner_id:
                raise InvalidInput("schema", f"record of {record.learner_id!r} outside its learner's prefix", url=url)
            try:
                check_seal(KIND_CONTRIBUTION, body, url=url, key=self._run_key(record.learner_id),
                           require_signature=bool(self.keyring))
            except IntegrityError as e:
                kind = RejectionKind.BAD_SIGNATURE if self.keyring else RejectionKind.CORRUPT
                return self._cache_contribution(key, Rejection(kind, e.what))
            expected_key = paths.contribution_key(record.fragment, record.base_version, record.learner_id,
                                                  record.c_steps, record.payload.sha256)
            if expected_key != key:
                raise InvalidInput("schema", f"record fields say it belongs at {expected_key}", url=url)
            result: ContributionRecord | Rejection = record
        except InvalidInput as e:
            result = e.rejection
        except Exception as e:  # noqa: BLE001 - no single record may stop a reader
            result = Rejection(RejectionKind.CORRUPT, f"record cannot be parsed: {type(e).__name__}: {str(e)[:200]}")
        return self._cache_contribution(key, result)

    def _cache_contribution(self, key: str, result: ContributionRecord | Rejection) -> ContributionRecord | Rejection:
        with self._contrib_lock:
            self._contrib_cache[key] = result
            while len(self._contrib_cache) > CACHE_ENTRIES:
                self._contrib_cache.popitem(last=False)
        return result

    def learner_ids(self) -> list[str]:
        """Learners that have a prefix in the bucket (one LIST of ``learners/``); odd names are
        skipped (they cannot be a learner's: ids are validated on every write)."""
        out = []
        for name in self.store.list(paths.LEARNERS_PREFIX):
            try:
                out.append(validate_learner_id(name.rstrip("/")))
            except InvalidInput:
                continue
        return sorted(out)

    def list_contributions(self, fragment: int, base_versions: int | Iterable[int],
                           learner_ids: Iterable[str] | None = None) -> ContributionListing:
        """Contribution records for ``fragment`` computed against the given base version(s).

        Each learner writes only under its own prefix, so this is one LIST per learner and base
        version (listing cache invalidated first; ``learner_ids=None`` finds the learners with one
        more LIST), then one GET per record not seen before (records are immutable and cached).
        The LISTs, then the GETs, run concurrently (:func:`~atoll.storage.store.io_map`): on an
        object store each one waits tens of milliseconds, and a round does this every poll.
        Payloads are not read here.
        """
        self._check_fragment(fragment)
        bases = [base_versions] if isinstance(base_versions, int) else sorted(set(base_versions))
        ids = self.learner_ids() if learner_ids is None else sorted(set(learner_ids))
        listing = ContributionListing()
        prefixes = [paths.contributions_prefix(fragment, base, lid) for lid in ids for base in bases]
        keys = []
        # One request per prefix however many objects a learner piles into it: at most
        # LIST_LIMIT names are listed, of which the newest MAX_LISTED_PER_PREFIX are read.
        for prefix, names in zip(prefixes, io_map(lambda p: self.store.list(p, limit=LIST_LIMIT), prefixes),
                                 strict=True):
            names = sorted(n for n in names if n.endswith(".json"))
            if len(names) > MAX_LISTED_PER_PREFIX:
                listing.skipped[prefix] = len(names) - MAX_LISTED_PER_PREFIX
                names = names[-MAX_LISTED_PER_PREFIX:]
            keys += [prefix + name for name in names]
        for key, rec in zip(keys, io_map(self._read_contribution_record, keys), strict=True):
            if isinstance(rec, Rejection):
                listing.rejected[key] = rec
            else:
                listing.records.append(rec)
        # Ordered by what the protocol itself says, never by a writer's clock: for one learner and
        # fragment, a higher base version is newer, and at one base version the counters only grow
        # between two publishes (they accumulate since the learner's last alignment).
        listing.records.sort(key=lambda r: (r.base_version, r.c_steps, r.key))
        return listing

    def load_contribution(self, record: ContributionRecord) -> FragmentContribution:
        """Read, verify (size cap, sha256, names/shapes/dtypes, finiteness) and decode to fp32.

        Raises InvalidInput with a specific ``kind`` for every bad-input class.
        """
        self._check_fragment(record.fragment)
        validate_learner_id(record.learner_id)
        url = self.store.key_url(paths.blob_key(record.payload.sha256, record.learner_id))
        expected = self.manifest.fragment_shapes(record.fragment)
        try:
            declared = {n: tuple(int(d) for d in m["shape"]) for n, m in record.tensors.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput("schema", f"contribution {record.key}: bad tensor shapes: {e}") from None
        check_shapes(declared, expected, what=f"contribution {record.key}")
        data = self._read_blob_bytes(record.payload, learner_id=record.learner_id,
                                     max_bytes=self.payload_cap(record.fragment))
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
        """Load many (concurrently, results in the order given); bad ones land in the second value as
        ``key -> Rejection`` instead of raising. A transient storage error is raised (the store is
        unwell, not a payload)."""
        def one(r: ContributionRecord) -> FragmentContribution | Rejection:
            try:
                return self.load_contribution(r)
            except InvalidInput as e:
                return e.rejection
            except TransientStorageError:
                raise
            except Exception as e:  # noqa: BLE001 - no single object may stop the synchronizer
                return Rejection(RejectionKind.CORRUPT, f"payload cannot be read: {type(e).__name__}: {e}")

        todo = list(records)
        ok: list[FragmentContribution] = []
        rejected: dict[str, Rejection] = {}
        for r, loaded in zip(todo, io_map(one, todo), strict=True):
            if isinstance(loaded, Rejection):
                rejected[r.key] = loaded
            else:
                ok.append(loaded)
        return ok, rejected

    # -- commits -----------------------------------------------------------------------------
    def read_commit(self, round_: int) -> CommitRecord | None:
        """The verified committed record of ``round_`` (one GET; cached), or None if not committed.

        The record must parse, match its digest, link to the previous commit this handle holds
        (``prev_sha256``; round 1 links to ``run.json``) and, when the keyring has the
        synchronizer's key, carry its signature. If the record at ``sync/commits/<round>.json``
        fails any of that, the slot is void: the synchronizer's repair record for the round
        (``sync/repairs/<round>/``) is used if one verifies, else :class:`IntegrityError` is
        raised naming the object. A void slot is never used.
        """
        cached = self._commits.get(round_)
        if cached is not None:
            return cached
        key = paths.commit_key(round_)
        found = self._verified_slot(round_, key)
        if found is None or isinstance(found, CommitRecord):
            return found
        problem = IntegrityError(found.why, self.store.key_url(key))
        for name in self.store.list(paths.repairs_prefix(round_)):  # rare: only after a void slot
            repaired = self._verified_slot(round_, paths.repairs_prefix(round_) + name)
            if isinstance(repaired, CommitRecord):
                return repaired
        raise problem

    def _verified_slot(self, round_: int, key: str) -> CommitRecord | Skipped | None:
        """The verified commit record at ``key``, None if nothing is there, or why it is void
        (oversize, a folder or FIFO, unparsable, a bad digest, link or signature)."""
        try:
            data = self._get_capped(key, MAX_COMMIT_BYTES)
            return None if data is None else self._verified_commit(round_, key, data)
        except TransientStorageError:
            raise
        except IntegrityError as e:
            return Skipped(key, RejectionKind.CORRUPT, e.what)
        except Exception as e:  # noqa: BLE001 - no object in a slot may stop a reader: the slot is void
            return skip_of(key, e)

    def _verified_commit(self, round_: int, key: str, data: bytes) -> CommitRecord:
        url = self.store.key_url(key)
        body = load_record(data, KIND_COMMIT, url=url)
        sync_key = self._run_key(SYNCHRONIZER_KEY_ID)
        check_seal(KIND_COMMIT, body, url=url, key=sync_key)
        record = CommitRecord.from_body(body, self.plan.num_fragments)
        if record.round != round_:
            raise IntegrityError(f"commit record says round {record.round}, it sits at round {round_}", url)
        expected_prev = self._expected_prev(round_)
        if expected_prev is not None:
            if record.prev_sha256 != expected_prev:
                raise IntegrityError(f"chain broken: prev_sha256 does not match the commit of round {round_ - 1}"
                                     + (" (run.json)" if round_ == 1 else ""), url)
        elif not self._links_to_stored(round_ - 1, record.prev_sha256):
            # A handle that does not hold round r-1 still checks one link back against the bytes
            # stored for it (its slot or one of its repairs): a forged far-future round or an
            # unchained forgery in a void slot has no such predecessor.
            raise IntegrityError(f"chain broken: no stored commit of round {round_ - 1} has the "
                                 f"sha256 this record names", url)
        self._commit_sha[round_] = sha256_hex(data)
        self._remember(record)
        return record

    def _links_to_stored(self, round_: int, sha: str) -> bool:
        """Whether a record naming ``sha`` as its predecessor may follow round ``round_``: True if
        the bytes stored for ``round_`` (its slot or a repair) hash to ``sha``, or if its slot holds
        only objects that are not sealed commit records (destroyed: the link cannot be checked,
        and that slot is reported void on its own). False if nothing is stored for ``round_`` or
        a sealed record is stored there with other bytes."""
        keys = [paths.commit_key(round_)]
        keys += [paths.repairs_prefix(round_) + n for n in self.store.list(paths.repairs_prefix(round_))]
        found = sealed = False
        for key in keys:
            try:
                data = self._get_capped(key, MAX_COMMIT_BYTES)
            except TransientStorageError:
                raise
            except Exception:  # noqa: BLE001 - unreadable: cannot be the link
                found = True
                continue
            if data is None:
                continue
            found = True
            if sha256_hex(data) == sha:
                return True
            try:
                body = load_record(data, KIND_COMMIT)
                check_seal(KIND_COMMIT, body, url=key)
                sealed = True
            except Exception:  # noqa: BLE001 - not a sealed commit record
                continue
        return found and not sealed

    def _expected_prev(self, round_: int) -> str | None:
        """The sha256 round ``round_``'s commit must name as ``prev_sha256``, if this handle knows
        it: ``run.json``'s for round 1, else the verified commit of round ``round_ - 1`` it holds."""
        if round_ == 1:
            _ = self.manifest  # reads run.json (and its sha) once
            return self._manifest_sha
        return self._commit_sha.get(round_ - 1)

    def _remember(self, record: CommitRecord) -> None:
        self._commits[record.round] = record
        for cache in (self._commits, self._commit_sha):
            while len(cache) > 4096:
                cache.popitem(last=False)

    def _get_capped(self, key: str, cap: int, *, denied_raises: bool = False) -> bytes | None:
        """GET at most ``cap`` bytes of a record; InvalidInput('oversize') if it is larger."""
        got = read_bytes(self.store, key, cap, denied_raises=denied_raises)  # a folder or a FIFO is Skipped
        if isinstance(got, Skipped):
            why = f"object is larger than the {_size_text(cap)} cap for its kind" if got.kind.value == "oversize" else got.why
            raise InvalidInput(got.kind, why, url=self.store.key_url(key))
        return got

    def verify(self, *, on_round: Callable[[int], None] | None = None) -> VerifyReport:
        """Walk the whole chain from ``run.json`` to the latest round with a fresh handle: every
        commit's digest, link and (with the synchronizer's key) signature, and that every state
        object it publishes exists with its sha256. The commit slots are also listed: a slot past
        the end of the walk (a round committed after a missing one) is a gap, reported. Reads
        only; never raises for bad data."""
        fresh = RunStore(self.store, max_payload_bytes=self.max_payload_bytes, keyring=self.keyring, read_only=True)
        report = VerifyReport()
        try:
            initial = fresh.manifest.initial
        except (InvalidInput, IntegrityError) as e:
            report.problems.append(f"{paths.RUN_MANIFEST}: {e}")
            return report
        report.prune, why = fresh.read_prune_record()
        if why is not None:
            report.problems.append(why)
        for ref in initial:
            report.check_blob(fresh, ref, "run.json initial")
        seen: set[str] = set()
        r = 1
        while True:
            try:
                rec = fresh.read_commit(r)  # None: nothing stored for round r, the chain ends
            except IntegrityError as e:
                report.problems.append(str(e))
                report.void.append(r)
                r += 1
                continue
            if rec is None:
                break
            report.verified += 1
            fresh._verify_state(report, r, rec, seen)
            if on_round is not None:
                on_round(r)
            r += 1
        report.latest = r - 1
        fresh._verify_slots(report)
        return report

    def _verify_state(self, report: VerifyReport, r: int, rec: CommitRecord, seen: set[str]) -> None:
        """Check every state object round ``r`` publishes (once per sha256), except those
        retention may have deleted."""
        for p, st in enumerate(rec.state):
            refs = st.refs()
            if report.prune is not None and report.prune.may_be_pruned(p, st.version):
                report.pruned += len([b for b in refs if b.sha256 not in seen])
                seen.update(b.sha256 for b in refs)
                continue  # deleted on purpose by retention, not lost
            for blob in refs:
                if blob.sha256 not in seen:
                    seen.add(blob.sha256)
                    report.check_blob(self, blob, f"round {r} state")

    def _verify_slots(self, report: VerifyReport) -> None:
        """List ``sync/commits/`` and ``sync/repairs/``: every slot past the walk's end is a gap
        (its round cannot be reached from run.json), and every entry that is not a slot is named."""
        commits: set[int] = set()
        for name in self.store.list(paths.commits_prefix()):
            n = paths.parse_commit_key(name)
            if n is None or n < 1:
                report.problems.append(f"{paths.commits_prefix()}{name}: not a commit slot")
            else:
                commits.add(n)
        slots = set(commits)
        for name in self.store.list(f"{paths.SYNC_PREFIX}repairs/"):
            if name.isascii() and name.isdigit() and len(name) == 8 and int(name) >= 1:
                slots.add(int(name))
        beyond = sorted(n for n in slots if n > report.latest)
        if beyond:  # the walk ended at a round with no commit object, and later rounds are stored
            report.gaps = [n for n in range(report.latest + 1, beyond[-1] + 1) if n not in commits]
            report.problems.append(f"gap in the chain: round(s) {_ranges(report.gaps)} missing, yet "
                                   f"round(s) {_ranges(beyond)} are stored after them (not reachable from run.json)")
        report.slots = len(slots)

    def _free_repair_key(self, round_: int) -> str:
        """The next unused repair slot of a void round (``sync/repairs/<round>/r<n>.json``)."""
        taken = set(self.store.list(paths.repairs_prefix(round_)))
        n = 1
        while paths.repair_key(round_, n).rsplit("/", 1)[-1] in taken:
            n += 1
        return paths.repair_key(round_, n)

    def latest_round(self) -> int:
        """Latest committed round (0 if none).

        The first call reads the ``head.json`` hint (or LISTs ``commits/`` if the hint is absent
        or wrong); every call then probes forward with GETs of the next commit keys, so a steady
        poll costs one GET and no LIST.
        """
        if self._latest is None:
            start = 0
            try:
                hint = self._get_capped(paths.HEAD, MAX_HEAD_BYTES)
            except InvalidInput:
                hint = None  # a hint only
            if hint is not None:
                try:
                    r = int(load_record(hint, KIND_HEAD).get("round", 0))
                    if r >= 1 and self._readable(r) is not None:
                        start = r
                except (InvalidInput, ValueError, TypeError):
                    pass
            if start == 0:
                rounds = sorted(parsed for n in self.store.list(paths.commits_prefix())
                                if (parsed := paths.parse_commit_key(n)) is not None)
                # Walk down past anything that does not verify (a forged far-future round, say).
                while rounds and self._readable(rounds[-1]) is None:
                    rounds.pop()
                start = rounds[-1] if rounds else 0
            self._latest = start
        r = self._latest
        while self._readable(r + 1) is not None:
            r += 1
        self._latest = r
        return r

    def _void(self, round_: int) -> bool:
        """Whether ``round_``'s slot holds something that does not verify (and no repair does)."""
        try:
            self.read_commit(round_)
        except IntegrityError:
            return True
        return False

    def readable_commit(self, round_: int) -> CommitRecord | None:
        """The verified record, or None if the round is not committed or its slot is void (the
        void slot is noted in :attr:`skipped`): what every reader that shows or follows rounds
        calls, so that one object never stops it. :meth:`read_commit` raises for a void slot."""
        try:
            return self.read_commit(round_)
        except IntegrityError as e:
            self.skipped.append(Skipped(paths.commit_key(round_), RejectionKind.CORRUPT, e.what[:400]))
            del self.skipped[:-100]
            return None

    _readable = readable_commit

    def poll_commits(self, after_round: int) -> list[CommitRecord]:
        """Records committed after ``after_round``, in order (GETs of the next keys; no LIST)."""
        out: list[CommitRecord] = []
        r = after_round + 1
        while True:
            rec = self._readable(r)
            if rec is None:
                # A void slot with no repair is skipped once the next slot verifies (a void past
                # slot must not hold a reader at it forever); the newest void slot waits for its repair.
                rec = self._readable(r + 1) if self._void(r) else None
                if rec is None:
                    break
            out.append(rec)
            r = rec.round + 1
        if out and (self._latest is None or out[-1].round > self._latest):
            self._latest = out[-1].round
        return out

    def history(self, start: int = 1, stop: int | None = None, *,
                skipped: list[Skipped] | None = None) -> list[CommitRecord]:
        """Commit records of rounds ``start`` .. ``stop`` (inclusive; default the latest). A void
        slot (docs/protocol.md section 8) is left out, and named in ``skipped`` if given: readers
        skip it, as the protocol says, instead of raising."""
        stop = self.latest_round() if stop is None else stop
        out = []
        for r in range(max(1, start), stop + 1):
            try:
                rec = self.read_commit(r)
            except IntegrityError as e:
                if skipped is not None:
                    skipped.append(Skipped(paths.commit_key(r), RejectionKind.CORRUPT, e.what[:400]))
                continue
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
        downlink: DownlinkStep | None = None,
        downlink_chained: bool = True,
    ) -> CommitResult:
        """Commit round ``round_`` for ``fragment``: new fragment values (None: no update), the
        outer optimizer's ``state_dict()`` for that fragment, who was in and out, timings and
        stats. Payloads first, then the record create-once.

        ``downlink`` (a compressed downlink only, with ``params``): the new version's update and
        view (:func:`atoll.core.downlink.downlink_step`), published beside the fp32 master as the
        entry's ``downlink``; ``downlink_chained=False`` publishes the view without the update
        (the update was not computed against the previous version's published view).

        Returns ``CommitResult(won=True, record=ours)``, or ``won=False`` with the record that a
        racing synchronizer committed first (nothing of ours is trusted then). Raises
        RoundOrderError if round ``round_ - 1`` is not committed.
        """
        if not isinstance(round_, int) or round_ < 1:
            raise ValueError(f"rounds start at 1, got {round_!r}")
        self._check_writable()
        self._check_fragment(fragment)
        void = False
        try:
            existing = self.read_commit(round_)
        except IntegrityError:
            existing, void = None, True  # something unverifiable sits in the slot: write a repair
        if existing is not None:
            return CommitResult(False, existing)
        state = list(self._state_table(round_ - 1))
        prev = self._expected_prev(round_)
        if prev is None:
            raise RoundOrderError(f"round {round_ - 1} is not verified in {self.url}; cannot chain round {round_}")
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
        if params is not None:
            state[fragment] = self._write_fragment_state(round_, fragment, state[fragment], params, momentum,
                                                         downlink, downlink_chained)
        elif downlink is not None:
            raise ValueError("a downlink is published with a new version (params) only")
        record = CommitRecord(
            round=round_, fragment=fragment, updated=params is not None, state=tuple(state),
            accepted=accepted_t, rejected=rejections, timings=body_extra["timings"],
            stats=body_extra["stats"], committed_by=committed_by, nonce=uuid.uuid4().hex, created_at=time.time(),
            prev_sha256=prev,
        )
        data = dump_record(KIND_COMMIT, seal(KIND_COMMIT, record.to_dict(), self._run_key(SYNCHRONIZER_KEY_ID)))
        key = paths.commit_key(round_) if not void else self._free_repair_key(round_)
        liveness.fault_hold_before_commit(round_)  # chaos tests only: no-op unless its env vars are set
        if self.store.create(key, data):
            self._commit_sha[round_] = sha256_hex(data)
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

    def _write_fragment_state(self, round_: int, fragment: int, prev: FragmentState, params: Tensors,
                              momentum: Tensors | None, downlink: DownlinkStep | None,
                              chained: bool) -> FragmentState:
        """Write a new version's payloads (fp32 master, momentum, compressed downlink); its entry."""
        expected = self.manifest.fragment_shapes(fragment)
        check_tensor_layout(params, expected, what=f"round {round_} params for fragment {fragment}")
        check_finite(params, what=f"round {round_} params")
        params_ref = self._write_blob({n: params[n].float() for n in expected})
        momentum_ref = prev.momentum
        if momentum is not None:
            check_tensor_layout(momentum, {f"momentum.{n}": s for n, s in expected.items()},
                                what=f"round {round_} momentum", allow_missing=True)
            check_finite(momentum, what=f"round {round_} momentum")
            momentum_ref = self._write_blob({n: t.float() for n, t in momentum.items()})
        dl = None if downlink is None else self._write_downlink(round_, fragment, prev.version, downlink, chained)
        return FragmentState(version=round_, params=params_ref, momentum=momentum_ref, downlink=dl)

    def _write_downlink(self, round_: int, fragment: int, base: int, step: DownlinkStep,
                        chained: bool) -> DownlinkState:
        """The view (fp32) and the update (the run's downlink codec) of a new version."""
        codec = self.config.downlink_compression
        if codec == "fp32":
            raise ValueError("this run's downlink is fp32: learners read the master, there is no downlink to publish")
        block_size = self.config.compression_block_size if codec == "int4" else 0
        expected = self.manifest.fragment_shapes(fragment)
        check_tensor_layout(step.view, expected, what=f"round {round_} downlink view of fragment {fragment}")
        check_finite(step.view, what=f"round {round_} downlink view")
        view_ref = self._write_blob({n: step.view[n].float() for n in expected})
        update_ref = None
        if chained:
            update = {n: step.update[n] for n in expected}
            odd = sorted(n for n, e in update.items() if e.codec != codec or e.block_size != block_size
                         or e.shape != expected[n])
            if odd or set(step.update) != set(expected):
                raise ValueError(f"round {round_} downlink update: {odd[:5] or sorted(step.update)[:5]} is not "
                                 f"{codec} (block {block_size}) in the fragment's shapes")
            update_ref = self._write_blob_bytes(encoded_to_bytes(update)[0])
        return DownlinkState(view=view_ref, update=update_ref, base=base, codec=codec, block_size=block_size)

    # -- global state ------------------------------------------------------------------------
    def fragment_state(self, fragment: int, version: int) -> FragmentState:
        """The state-table entry that published ``version`` of ``fragment`` (0: ``run.json``'s)."""
        self._check_fragment(fragment)
        if version == 0:
            return FragmentState(version=0, params=self.manifest.initial[fragment])
        rec = self.read_commit(version)
        if rec is None:
            raise RoundOrderError(f"version {version} of fragment {fragment}: round {version} is not committed")
        st = rec.state[fragment]
        if st.version != version:
            raise ValueError(f"round {version} did not write fragment {fragment} (it holds version {st.version})")
        return st

    def read_global_fragment(self, fragment: int, version: int | None = None) -> dict[str, torch.Tensor]:
        """Fragment values at ``version`` (the round that wrote it; 0 = initial; None = latest)."""
        self._check_fragment(fragment)
        if version is None:
            version = self._state_table(self.latest_round())[fragment].version
        ref = self.fragment_state(fragment, version).params
        return self._read_fp32_blob(ref, self.manifest.fragment_shapes(fragment), f"fragment {fragment} v{version}")

    def read_fragment_view(self, fragment: int, version: int) -> dict[str, torch.Tensor]:
        """What learners hold of ``fragment`` at ``version``: its downlink view (a compressed
        downlink), else the fp32 master itself. InvalidInput if the object is unreadable."""
        st = self.fragment_state(fragment, version)
        ref = st.downlink.view if st.downlink is not None else st.params
        return self._read_fp32_blob(ref, self.manifest.fragment_shapes(fragment), f"fragment {fragment} v{version} view")

    def read_fragment_update(self, fragment: int, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """(base, decoded update) of ``version``'s compressed downlink: ``view_version =
        view_base + update`` (:func:`atoll.core.downlink.apply_update`). InvalidInput if the
        version has no update or its payload is unreadable (size, sha256, parts, NaN/Inf)."""
        st = self.fragment_state(fragment, version)
        dl = st.downlink
        if dl is None or dl.update is None:
            raise InvalidInput("missing_payload", f"fragment {fragment} v{version} publishes no downlink update")
        shapes = self.manifest.fragment_shapes(fragment)
        data = self._read_blob_bytes(dl.update, max_bytes=self.payload_cap(fragment))
        meta = {n: {"codec": dl.codec, "shape": list(s), "block_size": dl.block_size} for n, s in shapes.items()}
        values = bytes_to_encoded(data, meta, url=self.store.key_url(paths.blob_key(dl.update.sha256)))
        check_tensor_layout(values, shapes, what=f"fragment {fragment} v{version} update", dtype=torch.float32)
        return dl.base, values

    def read_global_state(self, round_: int | None = None, *, momentum: bool = True,
                          view: bool = False) -> GlobalState:
        """All parameters, outer-optimizer state and timings as of ``round_`` (None = latest).

        ``view=True``: each fragment as learners hold it (its downlink view where the run's
        downlink is compressed; the master where it publishes none, or where the view does not
        read, noted in ``restored``): a joining learner's full state. ``momentum=False``: skip the
        outer momentum (learners never need it)."""
        round_ = self.latest_round() if round_ is None else round_
        table = self._state_table(round_)
        params: dict[str, torch.Tensor] = {}
        moments: dict[int, dict[str, torch.Tensor]] = {}
        restored: dict[int, str] = {}
        for p, st in enumerate(table):
            shapes = self.manifest.fragment_shapes(p)
            moments[p] = {}
            if view and st.downlink is not None:
                try:
                    params.update(self._read_fp32_blob(st.downlink.view, shapes, f"fragment {p} v{st.version} view"))
                    continue
                except InvalidInput as e:  # the master is within one quantization error of it
                    restored[p] = f"view of v{st.version} unreadable ({e.kind.value}); using the master"
            try:
                params.update(self._read_fp32_blob(st.params, shapes, f"fragment {p} v{st.version}"))
            except InvalidInput as e:
                values, used = self._fallback_fragment(round_, p, st, e)
                params.update(values)
                restored[p] = f"v{st.version} unreadable ({e.kind.value}); using v{used}"
            if momentum and st.momentum is not None and p not in restored:
                try:
                    mshapes = {f"momentum.{n}": s for n, s in shapes.items()}
                    got = bytes_to_tensors(self._read_blob_bytes(st.momentum))
                    check_tensor_layout(got, mshapes, what=f"fragment {p} momentum", dtype=torch.float32,
                                        allow_missing=True)
                    moments[p] = got
                except InvalidInput as e:
                    restored[p] = f"momentum of v{st.version} unreadable ({e.kind.value}); reset to zero"
        rec = self.read_commit(round_) if round_ else None
        return GlobalState(round=round_, versions=tuple(s.version for s in table), params=params,
                           momentum=moments, timings=dict(rec.timings) if rec else {}, record=rec,
                           restored=restored)

    def _fallback_fragment(self, round_: int, p: int, st: FragmentState,
                           e: InvalidInput) -> tuple[dict[str, torch.Tensor], int]:
        """Fragment ``p`` when its state object at ``st.version`` does not read: PrunedError if
        retention deleted it on purpose, else the newest older version that verifies."""
        pruned, _ = self.read_prune_record() if e.kind.value == "missing_payload" else (None, None)
        if pruned is not None and pruned.may_be_pruned(p, st.version):
            raise PrunedError(
                f"the global state of round {round_} is gone: fragment {p} v{st.version} is below the "
                f"retention floor v{pruned.floors[p]} ({pruned.by}, rounds up to {pruned.through_round}); "
                f"read a later round or a consolidated checkpoint", url=self.store.key_url(
                    paths.blob_key(st.params.sha256))) from None
        # A destroyed state object must not stop every reader for good: fall back to the
        # newest older version of this fragment that verifies (the same walk in every
        # process, so they all agree), at worst version 0 from run.json. The fragment's
        # next round publishes a fresh object. With the bucket policy no learner can
        # write under sync/, so this is for storage faults and unconfined writers.
        return self._older_fragment(p, st.version, self.manifest.fragment_shapes(p))

    def _older_fragment(self, p: int, version: int,
                        shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], int]:
        """Fragment ``p`` at the newest version before ``version`` whose object verifies."""
        r = version - self.plan.num_fragments
        for _ in range(64):  # bounded walk; then version 0
            if r < 1:
                break
            rec = self._readable(r)
            if rec is not None and rec.fragment == p and rec.updated:
                try:
                    return self._read_fp32_blob(rec.state[p].params, shapes, f"fragment {p} v{r}"), r
                except InvalidInput:
                    pass
            r -= self.plan.num_fragments
        return self._read_fp32_blob(self.manifest.initial[p], shapes, f"fragment {p} v0"), 0

    # -- learner state -----------------------------------------------------------------------
    def save_learner_state(self, learner_id: str, tensors: Tensors, meta: Mapping[str, Any] | None = None) -> None:
        """Overwrite learner ``learner_id``'s rejoin state (payload first, then the record)."""
        validate_learner_id(learner_id)
        self._check_writable()
        meta = dict(meta or {})
        if not finite_json(meta):
            raise ValueError("meta must be JSON-able without NaN/Inf")
        ref = self._write_blob(tensors, learner_id)
        rec = LearnerStateRecord(learner_id=learner_id, payload=ref, meta=meta, saved_at=time.time())
        self.store.put(paths.learner_state_key(learner_id), dump_record(KIND_LEARNER_STATE, rec.to_dict()))

    def load_learner_state_record(self, learner_id: str) -> LearnerStateRecord | None:
        """The learner's ``state.json`` (not its payload), or None if it never saved one."""
        key = paths.learner_state_key(learner_id)
        data = self._get_capped(key, MAX_LEARNER_STATE_RECORD_BYTES)
        if data is None:
            return None
        rec = LearnerStateRecord.from_body(load_record(data, KIND_LEARNER_STATE, url=self.store.key_url(key)))
        if rec.learner_id != learner_id:
            raise InvalidInput("schema", f"state at {key} belongs to {rec.learner_id!r}", url=self.store.key_url(key))
        return rec

    def load_learner_state(self, learner_id: str) -> LearnerState | None:
        """The learner's last saved state, or None if it never saved one."""
        rec = self.load_learner_state_record(learner_id)
        if rec is None:
            return None
        tensors = bytes_to_tensors(self._read_blob_bytes(rec.payload, learner_id=learner_id))
        return LearnerState(tensors=tensors, meta=dict(rec.meta), saved_at=rec.saved_at)

    # -- liveness: leases, heartbeats, stop marker (atoll.storage.liveness) --------------------
    def take_learner_lease(self, learner_id: str, *, flow_run_id: str | None = None) -> Lease:
        """Take the next incarnation of ``learner_id`` (create-once ``learners/<id>/leases/<n>.json``,
        n = newest + 1; a lost race tries the next number). Every older incarnation is fenced from
        now on. Raises :class:`~atoll.storage.liveness.LeaseError` if no number could be taken."""
        validate_learner_id(learner_id)
        self._check_writable()
        return liveness.take_lease(self.store, learner_id, flow_run_id=flow_run_id)

    def take_synchronizer_lease(self, *, flow_run_id: str | None = None) -> Lease:
        """Take the next incarnation of the synchronizer (``sync/leases/<n>.json``)."""
        self._check_writable()
        return liveness.take_lease(self.store, SYNCHRONIZER_HOLDER, flow_run_id=flow_run_id)

    def write_heartbeat(self, lease: Lease, *, status: str = "alive", reason: str = "",
                        step: int | None = None, round: int | None = None) -> Heartbeat:
        """Overwrite the heartbeat of ``lease``'s incarnation (``status`` "alive" or "exited")."""
        self._check_writable()
        return liveness.write_heartbeat(self.store, lease, status=status, reason=reason, step=step, round=round)

    def learner_liveness(self, learner_id: str) -> Liveness:
        """The learner's newest lease and its heartbeat (one LIST, two GETs; unusable objects are
        ignored and named in ``problems``)."""
        validate_learner_id(learner_id)
        return liveness.read_liveness(self.store, learner_id)

    def learners_liveness(self, learner_ids: Iterable[str]) -> dict[str, Liveness]:
        """:meth:`learner_liveness` of each, concurrently (a fleet watch reads every learner's)."""
        ids = list(dict.fromkeys(learner_ids))
        return dict(zip(ids, io_map(self.learner_liveness, ids), strict=True))

    def synchronizer_liveness(self) -> Liveness:
        return liveness.read_liveness(self.store, SYNCHRONIZER_HOLDER)

    def current_incarnation(self, learner_id: str) -> int:
        """The learner's newest lease number (one LIST); 0 = never leased."""
        validate_learner_id(learner_id)
        return liveness.newest_incarnation(self.store, learner_id)

    def current_synchronizer_incarnation(self) -> int:
        return liveness.newest_incarnation(self.store, SYNCHRONIZER_HOLDER)

    def mark_stopped(self, reason: str, by: str) -> StopMarker:
        """Write ``sync/stop.json`` with ``stopped: true``: learners and the synchronizer exit."""
        return self._write_stop_marker(stopped=True, reason=reason, by=by)

    def clear_stopped(self, *, reason: str = "cleared", by: str = "") -> StopMarker:
        """Overwrite the stop marker with ``stopped: false`` (nothing is ever deleted)."""
        return self._write_stop_marker(stopped=False, reason=reason, by=by)

    def _write_stop_marker(self, *, stopped: bool, reason: str, by: str) -> StopMarker:
        self._check_writable()
        return liveness.write_stop_marker(self.store, stopped=stopped, reason=reason, by=by,
                                          seal_with=self._operator_seal("the stop marker"))

    def stop_marker(self) -> StopMarker | None:
        """The stop marker; None if there is none or it is unusable (use :meth:`read_stop_marker`
        for the reason). None or ``stopped=False`` mean running."""
        return self.read_stop_marker()[0]

    def read_stop_marker(self) -> tuple[StopMarker | None, str | None]:
        """(the stop marker or None, why an existing one was ignored or None). With the
        synchronizer's key, a marker that is not signed with it for this run is ignored."""
        return liveness.read_stop_marker(self.store, check=self._operator_check(KIND_STOP))

    def _operator_seal(self, what: str) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
        """How a record only the operator (or the synchronizer) writes is sealed: a digest, and the
        synchronizer's signature for this run when this handle's keyring holds its key. A run whose
        ``run.json`` is signed refuses an unsigned one (its synchronizer would ignore it)."""
        key = self._run_key(SYNCHRONIZER_KEY_ID)
        if key is None and self._run_is_signed():
            raise PermissionError(f"this run signs its records and {what} would be ignored unsigned: set "
                                  f"${KEYRING_ENV} to a keyring holding the synchronizer's key "
                                  f"({SYNCHRONIZER_KEY_ID!r})")
        return lambda kind, body: seal(kind, body, key)

    def _run_is_signed(self) -> bool:
        try:
            _ = self.manifest
        except (InvalidInput, StorageError):  # no readable run.json: nothing says the run is signed
            return False
        return isinstance(self._manifest_body, dict) and "signature" in self._manifest_body

    def _operator_check(self, kind: str) -> Callable[[dict[str, Any], str], None]:
        """Check a sealed operator record (see :meth:`_operator_seal`): with the synchronizer's key
        its signature is required; without, a digest present must match (older records have none)."""
        key = self._run_key(SYNCHRONIZER_KEY_ID)

        def check(body: dict[str, Any], url: str) -> None:
            if key is not None or "digest" in body:
                check_seal(kind, body, url=url, key=key)
        return check

    # -- retention ---------------------------------------------------------------------------
    def read_prune_record(self) -> tuple[PruneRecord | None, str | None]:
        """(the run's retention record or None, why a stored one was ignored or None)."""
        num_fragments = self.plan.num_fragments
        check, url = self._operator_check(KIND_PRUNE), self.store.key_url(paths.PRUNE)

        def parse(data: bytes) -> PruneRecord:
            body = load_record(data, KIND_PRUNE)
            check(body, url)
            return PruneRecord.from_body(body, num_fragments)
        got = read_parsed(self.store, paths.PRUNE, MAX_HEAD_BYTES * 64, parse)
        if isinstance(got, Skipped):
            return None, f"retention record ignored: {self.store.key_url(paths.PRUNE)}: {got.kind.value}: {got.why}"
        return got, None

    def write_prune_record(self, record: PruneRecord) -> None:
        """Overwrite ``sync/prune.json`` (retention writes it before it deletes anything)."""
        self._check_writable()
        if len(record.floors) != self.plan.num_fragments:
            raise ValueError(f"floors must name {self.plan.num_fragments} fragments, got {len(record.floors)}")
        self.store.put(paths.PRUNE, dump_record(KIND_PRUNE, self._operator_seal("the retention record")(
            KIND_PRUNE, record.to_dict())))

    # -- consolidated checkpoints ------------------------------------------------------------
    def write_checkpoint(self, round_: int | None = None) -> CheckpointInfo:
        """Write ``checkpoints/<round>/model.safetensors`` (whole model, fp32, plain safetensors)
        and then ``config.json`` (run config, plan, versions, the model's sha256)."""
        self._check_writable()
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
        self.store.put(config_key, dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, body,
                                                                     self._run_key(SYNCHRONIZER_KEY_ID))))
        return CheckpointInfo(state.round, self.store.key_url(model_key), self.store.key_url(config_key), sha)

    def list_checkpoints(self) -> list[int]:
        """Rounds that have a checkpoint folder (one LIST)."""
        return sorted(int(n) for n in self.store.list(paths.checkpoints_prefix())
                      if n.isascii() and n.isdigit() and len(n) <= 12)

    def load_checkpoint(self, round_: int) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, verified against the sha256 in its config.json."""
        ckey = paths.checkpoint_config_key(round_)
        cdata = self._get_capped(ckey, MAX_CHECKPOINT_CONFIG_BYTES)
        if cdata is None:
            raise FileNotFoundError(f"no checkpoint config at {self.store.key_url(ckey)}")
        body = load_record(cdata, KIND_CHECKPOINT, url=self.store.key_url(ckey))
        if (key := self._run_key(SYNCHRONIZER_KEY_ID)) is not None:  # signed for this run: checked
            check_seal(KIND_CHECKPOINT, body, url=self.store.key_url(ckey), key=key)
        mkey = paths.checkpoint_model_key(round_)
        data = self.store.get_or_none(mkey)
        if data is None:
            raise InvalidInput("missing_payload", "checkpoint model file is missing", url=self.store.key_url(mkey))
        if sha256_hex(data) != body.get("model", {}).get("sha256"):
            raise InvalidInput("checksum", "checkpoint model sha256 differs from config.json",
                               url=self.store.key_url(mkey))
        return bytes_to_tensors(data, url=self.store.key_url(mkey))
