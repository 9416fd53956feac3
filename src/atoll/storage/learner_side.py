"""The learner's side of a run: :class:`LearnerStore`, what the bucket policy's
``atoll-learner-<id>`` principal writes (docs/protocol.md section 8: ``LearnerWritesOnlyItsPrefix``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from atoll.core.compress import CompressionError, EncodedTensor, encode
from atoll.core.rejection import Rejection
from atoll.storage import liveness, paths
from atoll.storage.codec import dump_record, encoded_to_bytes, finite_json
from atoll.storage.handle import Tensors
from atoll.storage.integrity import seal
from atoll.storage.lease_holder import LeaseHolder
from atoll.storage.liveness import Lease
from atoll.storage.records import KIND_CONTRIBUTION, KIND_LEARNER_STATE, ContributionRecord, LearnerStateRecord
from atoll.storage.validation import InvalidInput, check_shapes, validate_learner_id

__all__ = ["LearnerStore"]


class _HasCounters(Protocol):
    @property
    def c_steps(self) -> int: ...
    @property
    def c_tokens(self) -> int: ...


class LearnerStore(LeaseHolder):
    """A learner's handle: everything a reader does, and the writes of the bucket policy's
    ``atoll-learner-<id>`` role, each under ``learners/<id>/`` only (nothing under ``sync/``):

    * ``paths.blob_key(sha, id)``: its delta and inner-state payloads (content-addressed);
    * ``paths.contribution_key(...)``: its contribution records (create-once);
    * ``paths.learner_state_key(id)``: its rejoin state (overwritten);
    * ``paths.learner_lease_key(id, n)`` (create-once) and ``paths.learner_heartbeat_key(id, n)``.
    """

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
        c_steps, c_tokens = self._check_publish(learner_id, fragment, base_version, counters, incarnation)
        info = dict(info or {})
        if not finite_json(info):
            raise ValueError("info must be JSON-able without NaN/Inf")
        data, meta = self._encoded_delta(fragment, delta, codec, block_size)
        ref = self._write_blob_bytes(data, learner_id)
        key = paths.contribution_key(fragment, base_version, learner_id, c_steps, ref.sha256)
        record = ContributionRecord(key=key, learner_id=learner_id, fragment=fragment, base_version=base_version,
                                    c_steps=c_steps, c_tokens=c_tokens, payload=ref, tensors=meta,
                                    created_at=time.time(), info=info, incarnation=incarnation)
        body = seal(KIND_CONTRIBUTION, record.to_dict(), self._signer(learner_id))
        if not self.store.create(key, dump_record(KIND_CONTRIBUTION, body)):
            existing = self._read_contribution_record(key)
            if isinstance(existing, Rejection):
                raise InvalidInput("schema", f"a different, unreadable record already sits at {key}: {existing}")
            return existing
        return record

    def _check_publish(self, learner_id: str, fragment: int, base_version: int, counters: _HasCounters,
                       incarnation: int) -> tuple[int, int]:
        """Refuse a publish this handle may not make or whose numbers are impossible; its
        (c_steps, c_tokens)."""
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
        return c_steps, c_tokens

    def _encoded_delta(self, fragment: int, delta: Mapping[str, torch.Tensor | EncodedTensor], codec: str | None,
                       block_size: int | None) -> tuple[bytes, dict[str, dict[str, Any]]]:
        """The delta's payload bytes and per-tensor codec metadata, checked against the fragment's
        shapes and the payload cap."""
        expected = self.manifest.fragment_shapes(fragment)
        codec = codec or self.config.compression
        block_size = block_size or self.config.compression_block_size
        encoded: dict[str, EncodedTensor] = {}
        for name, value in delta.items():
            if isinstance(value, EncodedTensor):
                encoded[name] = value
                continue
            try:
                # Serialized below, before the publish returns: no copy of the delta is needed.
                encoded[name] = encode(value, codec, block_size=block_size, copy=False)
            except CompressionError as e:
                raise InvalidInput(e.kind, f"delta {name!r}: {e}") from None
        shapes = {n: e.shape for n, e in encoded.items()}
        check_shapes(shapes, expected, what=f"delta for fragment {fragment}")
        data, meta = encoded_to_bytes(encoded)
        cap = self.payload_cap(fragment)
        if len(data) > cap:
            raise InvalidInput("oversize", f"delta payload is {len(data)} bytes, cap is {cap}")
        return data, meta

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

    def take_learner_lease(self, learner_id: str, *, flow_run_id: str | None = None) -> Lease:
        """Take the next incarnation of ``learner_id`` (create-once ``learners/<id>/leases/<n>.json``,
        n = newest + 1; a lost race tries the next number). Every older incarnation is fenced from
        now on. Raises :class:`~atoll.storage.liveness.LeaseError` if no number could be taken."""
        validate_learner_id(learner_id)
        self._check_writable()
        return liveness.take_lease(self.store, learner_id, flow_run_id=flow_run_id)
