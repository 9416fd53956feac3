"""The base of every role's handle on one run: :class:`RunHandle` (object store, keys, manifest, payloads).

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

Each principal of the bucket policy (docs/protocol.md section 8) opens the run through its own
role class, all built on this one: :class:`~atoll.storage.reader.RunReader` (everyone reads),
:class:`~atoll.storage.learner_side.LearnerStore`,
:class:`~atoll.storage.synchronizer_side.SynchronizerStore`,
:class:`~atoll.storage.operator_side.OperatorStore` and, to create a run,
:class:`~atoll.storage.creation.RunCreator`. ``<Role>.open(url, ...)`` opens a run for any role.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from atoll.core.config import DilocoConfig
from atoll.core.fragments import FragmentPlan
from atoll.core.rejection import Rejection
from atoll.core.retry import RetryPolicy
from atoll.storage import paths
from atoll.storage.codec import (
    LAYOUT_SCHEMA_VERSION,
    bytes_to_tensors,
    load_record,
    record_version,
    sha256_hex,
    tensors_to_bytes,
)
from atoll.storage.integrity import KEYRING_ENV, SYNCHRONIZER_KEY_ID, IntegrityError, Keyring, check_seal, seal
from atoll.storage.reading import Skipped, get_plain, read_bytes
from atoll.storage.records import KIND_RUN, BlobRef, CommitRecord, ContributionRecord, RunManifest
from atoll.storage.signing import (
    Ed25519Signer,
    Ed25519Verifier,
    HmacKey,
    PinnedKeys,
    Signer,
    Verifier,
    public_raw,
    run_context,
)
from atoll.storage.store import ObjectStore
from atoll.storage.validation import (
    InvalidInput,
    LayoutError,
    ReadOnlyError,
    RunNotFoundError,
    StorageError,
    check_tensor_layout,
)

__all__ = ["RunHandle", "HandleCache", "Tensors", "CACHE_ENTRIES"]

Tensors = Mapping[str, torch.Tensor]

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


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


@dataclass
class HandleCache:
    """What a handle has read and verified of its run. Records are immutable, so what is cached
    stays true; :meth:`RunHandle.beside` shares one cache between the role handles of one party."""

    manifest: RunManifest | None = None
    manifest_sha: str | None = None
    manifest_body: dict[str, Any] | None = None
    run_keys: Keyring | None = None
    pinned: PinnedKeys | None = None
    """The public keys run.json pins (None: an HMAC-signed or unsigned run)."""
    commits: OrderedDict[int, CommitRecord] = field(default_factory=OrderedDict)
    """Verified commit records by round."""
    commit_sha: OrderedDict[int, str] = field(default_factory=OrderedDict)
    """sha256 of each verified commit record's bytes: what the next round's ``prev_sha256`` names."""
    latest: int | None = None
    skipped: list[Skipped] = field(default_factory=list)
    contributions: OrderedDict[str, ContributionRecord | Rejection] = field(default_factory=OrderedDict)
    contributions_lock: threading.Lock = field(default_factory=threading.Lock)
    """Contribution records are read by several I/O threads at once."""


class RunHandle:
    """One run in a bucket, as one principal of the bucket policy sees it: the object store, the
    keyring, the manifest and checked payload reads. Open with :meth:`open` on the role class the
    caller needs.

    Thread-compatible: one instance may be shared by threads that do not write the same round.
    """

    def __init__(self, store: ObjectStore, *, max_payload_bytes: int | None = None,
                 keyring: Keyring | None = None, read_only: bool = False) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        self.keyring = keyring if keyring is not None else Keyring()
        self.read_only = read_only
        self._cache = HandleCache()

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
    ) -> Self:
        """Open the run rooted at ``url`` in this role: the one way to open a run, for every layer
        (a new run is then created by :func:`atoll.train.run.create_run`). A local path becomes an
        absolute ``file://`` URL, so the run's URL means the same to every process it is handed to.
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

    @classmethod
    def beside(cls, other: RunHandle) -> Self:
        """This role's handle on ``other``'s run, for one party that plays several roles (a test,
        a whole run in one process, whoever creates a run and then trains it): the same object
        store, keyring, payload cap and read-only flag, and the same cache (what either reads and
        verifies, the other holds too)."""
        handle = cls(other.store, max_payload_bytes=other.max_payload_bytes, keyring=other.keyring,
                     read_only=other.read_only)
        handle._cache = other._cache
        return handle

    def sibling(self, *, metered_apart: bool = False) -> Self:
        """Another handle of this role on the same run: shares the object store and the
        (immutable) manifest, but has its own record caches, so a second thread can poll without
        sharing state. ``metered_apart``: its object store counts its requests and bytes apart
        from this one's (:meth:`ObjectStore.metered_apart`; a handle for someone else in the
        process)."""
        store = self.store.metered_apart() if metered_apart else self.store
        other = type(self)(store, max_payload_bytes=self.max_payload_bytes, keyring=self.keyring,
                           read_only=self.read_only)
        other._cache.manifest, other._cache.manifest_sha = self._cache.manifest, self._cache.manifest_sha
        other._cache.manifest_body, other._cache.pinned = self._cache.manifest_body, self._cache.pinned
        return other

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r})"

    @property
    def url(self) -> str:
        return self.store.url

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{self.url} was opened read-only")

    # -- run manifest ------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.store.get_or_none(paths.RUN_MANIFEST) is not None

    @property
    def manifest(self) -> RunManifest:
        cache = self._cache
        if cache.manifest is None:
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
            manifest = RunManifest.from_body(body)
            cache.pinned = self._checked_pins(manifest, body, url)
            cache.manifest = manifest
            cache.manifest_sha, cache.manifest_body = sha256_hex(data), body
        return cache.manifest

    @property
    def config(self) -> DilocoConfig:
        return self.manifest.config

    @property
    def plan(self) -> FragmentPlan:
        return self.manifest.plan

    def _check_fragment(self, fragment: int) -> None:
        if not isinstance(fragment, int) or not 0 <= fragment < self.plan.num_fragments:
            raise ValueError(f"fragment must be in [0, {self.plan.num_fragments}), got {fragment!r}")

    def payload_cap(self, fragment: int) -> int:
        """Largest contribution payload accepted for ``fragment`` (bytes)."""
        if self.max_payload_bytes is not None:
            return self.max_payload_bytes
        names = self.plan.fragments[fragment]
        return 4 * self.plan.fragment_numel(fragment) + 4 * sum(len(n) + 128 for n in names) + 65536

    # -- keys and seals ----------------------------------------------------------------------
    def _checked_pins(self, manifest: RunManifest, body: dict[str, Any], url: str) -> PinnedKeys | None:
        """The public keys ``run.json`` pins, once run.json verifies with the synchronizer's one,
        and that one is this keyring's anchor (its synchronizer entry, public or private) where it
        has one. An anchored handle refuses a run.json that pins no key (a downgrade)."""
        anchor = self.keyring.public(SYNCHRONIZER_KEY_ID)
        if "signing" not in body:
            if anchor is not None:
                raise IntegrityError("run.json pins no synchronizer key, and this keyring expects one "
                                     "(unsigned, or rewritten without its signature)", url)
            return None
        try:
            pinned = PinnedKeys.from_body(body["signing"])
        except ValueError as e:
            raise IntegrityError(f"run.json's signing field is unusable: {e}", url) from None
        check_seal(KIND_RUN, body, url=url, key=Ed25519Verifier(pinned.synchronizer, run_context(manifest.run_id)),
                   require_signature=True)
        if anchor is not None and public_raw(anchor) != public_raw(pinned.synchronizer):
            raise IntegrityError("run.json pins another synchronizer key than this keyring's "
                                 f"{SYNCHRONIZER_KEY_ID!r} entry (a run.json rewritten under another key)", url)
        return pinned

    def _run_key(self, writer: str) -> bytes | None:
        """``writer``'s HMAC key for this run (:meth:`Keyring.for_run`: a signature binds the run id)."""
        if not self.keyring:
            return None
        if self._cache.run_keys is None:
            self._cache.run_keys = self.keyring.for_run(self.manifest.run_id)
        return self._cache.run_keys.key(writer)

    def _signer(self, writer: str) -> Signer | None:
        """How this handle signs as ``writer`` in this run: its Ed25519 private key, else its HMAC
        key for the run, else None (unsigned)."""
        if (private := self.keyring.private(writer)) is not None:
            # The synchronizer's private key is also the anchor run.json was checked against
            # (_checked_pins): a handle holding another one never gets this far.
            return Ed25519Signer(private, run_context(self.manifest.run_id))
        key = self._run_key(writer)
        return None if key is None else HmacKey(key)

    def _verifier(self, writer: str) -> Verifier | None:
        """What ``writer``'s records must verify with in this run, from public keys wherever the
        run pins them: the synchronizer's pinned key; a learner's own entry in this keyring (a
        rotated key), else the one run.json pins for it. In an HMAC run, the HMAC key for the run
        where this handle holds it. None: nothing to verify with."""
        try:
            context = run_context(self.manifest.run_id)
        except RunNotFoundError:
            if self.keyring:
                raise
            return None  # no run.json pins a key and this handle holds none: digests only
        pinned = self._cache.pinned
        if writer == SYNCHRONIZER_KEY_ID and pinned is not None:
            return Ed25519Verifier(pinned.synchronizer, context)
        if writer != SYNCHRONIZER_KEY_ID:
            if (own := self.keyring.public(writer)) is not None:
                return Ed25519Verifier(own, context)
            if pinned is not None:
                public = pinned.learners.get(writer)
                return None if public is None else Ed25519Verifier(public, context)
        key = self._run_key(writer)
        return None if key is None else HmacKey(key)

    def signature_scheme(self) -> str:
        """What this handle checks signatures with, in words (``atoll verify`` prints it)."""
        try:
            _ = self.manifest
        except (InvalidInput, StorageError):
            return "run.json unreadable"
        if (pinned := self._cache.pinned) is not None:
            return f"ed25519: the synchronizer's key run.json pins, {public_raw(pinned.synchronizer).hex()[:16]}..."
        if self._run_key(SYNCHRONIZER_KEY_ID) is not None:
            return "hmac-sha256: the synchronizer's key"
        return "digests and links only"

    def _signatures_required(self) -> bool:
        """Whether every contribution must be signed: the run pins keys, or this handle has a keyring."""
        _ = self.manifest
        return self._cache.pinned is not None or bool(self.keyring)

    def _operator_seal(self, what: str) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
        """How a record only the operator (or the synchronizer) writes is sealed: a digest, and the
        synchronizer's signature for this run when this handle's keyring holds its private (or
        HMAC) key. A run whose ``run.json`` is signed refuses an unsigned one (readers ignore it)."""
        key = self._signer(SYNCHRONIZER_KEY_ID)
        if key is None and self._run_is_signed():
            raise PermissionError(f"this run signs its records and {what} would be ignored unsigned: set "
                                  f"${KEYRING_ENV} to a keyring holding the synchronizer's private key "
                                  f"({SYNCHRONIZER_KEY_ID!r})")
        return lambda kind, body: seal(kind, body, key)

    def _run_is_signed(self) -> bool:
        try:
            _ = self.manifest
        except (InvalidInput, StorageError):  # no readable run.json: nothing says the run is signed
            return False
        return isinstance(self._cache.manifest_body, dict) and "signature" in self._cache.manifest_body

    def _operator_check(self, kind: str) -> Callable[[dict[str, Any], str], None]:
        """Check a sealed operator record (see :meth:`_operator_seal`): where the run pins the
        synchronizer's public key or this handle holds its HMAC key, its signature is required;
        otherwise a digest present must match (older records have none)."""
        def check(body: dict[str, Any], url: str) -> None:
            # the key is looked up only once there is a record to check: a run without one (or
            # without run.json yet) reads as "no marker", not as an error
            key = self._verifier(SYNCHRONIZER_KEY_ID)
            if key is not None or "digest" in body:
                check_seal(kind, body, url=url, key=key)
        return check

    # -- records and payloads ----------------------------------------------------------------
    def _get_capped(self, key: str, cap: int, *, denied_raises: bool = False) -> bytes | None:
        """GET at most ``cap`` bytes of a record; InvalidInput('oversize') if it is larger."""
        got = read_bytes(self.store, key, cap, denied_raises=denied_raises)  # a folder or a FIFO is Skipped
        if isinstance(got, Skipped):
            why = f"object is larger than the {_size_text(cap)} cap for its kind" if got.kind.value == "oversize" else got.why
            raise InvalidInput(got.kind, why, url=self.store.key_url(key))
        return got

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
        try:  # a folder, a FIFO or a link where the payload belongs is bad input, like a wrong digest
            data = get_plain(self.store, key, ref.nbytes if max_bytes is None else max_bytes)
        except InvalidInput as e:
            raise InvalidInput(e.kind, e.reason, url=url) from None
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
