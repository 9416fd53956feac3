"""The synchronizer's side of a run: :class:`SynchronizerStore`, what the bucket policy's
``atoll-synchronizer`` principal writes (docs/protocol.md section 8: ``SynchronizerWritesOnlySync``),
and :class:`CommitResult`, the outcome of committing a round."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from atoll.core.downlink import DownlinkStep
from atoll.core.rejection import Rejection
from atoll.storage import liveness, paths
from atoll.storage.codec import dump_record, encoded_to_bytes, finite_json, sha256_hex, tensors_sha256, tensors_to_bytes
from atoll.storage.handle import Tensors
from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, IntegrityError, seal
from atoll.storage.io_pool import io_map
from atoll.storage.lease_holder import LeaseHolder
from atoll.storage.liveness import Lease, StopMarker
from atoll.storage.reader import CheckpointInfo
from atoll.storage.records import (
    KIND_CHECKPOINT,
    KIND_COMMIT,
    KIND_EVAL,
    KIND_HEAD,
    AcceptedContribution,
    BlobRef,
    CommitRecord,
    DownlinkState,
    EvalRecord,
    FragmentState,
)
from atoll.storage.validation import RoundOrderError, check_finite, check_tensor_layout

__all__ = ["SynchronizerStore", "CommitResult", "RoundPayloads"]


@dataclass(frozen=True)
class CommitResult:
    """Outcome of :meth:`SynchronizerStore.commit_round`: did we win, and the record that is now committed."""

    won: bool
    record: CommitRecord


@dataclass(frozen=True)
class RoundPayloads:
    """A new version's payloads, durable in the bucket and not yet committed
    (:meth:`SynchronizerStore.write_round_payloads`): what round ``round``'s record will name for
    ``fragment``. Committed only while the fragment's entry is still ``base``."""

    round: int
    fragment: int
    base: FragmentState
    """The fragment's entry the payloads were written against (the downlink update's base)."""
    state: FragmentState
    """The entry the round's commit record holds for the fragment."""

    def entry_for(self, round_: int, fragment: int, current: FragmentState) -> FragmentState:
        """The entry to commit for ``fragment`` in round ``round_`` whose entry is ``current``;
        RoundOrderError if these payloads were written for another round or entry."""
        if (self.round, self.fragment, self.base) != (round_, fragment, current):
            raise RoundOrderError(f"round {round_}'s payloads were written for round {self.round}, fragment "
                                  f"{self.fragment} against another entry; write them again")
        return self.state


@dataclass(frozen=True)
class _RoundOutcome:
    """Who was in and out of a round and what it measured, checked before anything is written."""

    accepted: tuple[AcceptedContribution, ...]
    rejected: dict[str, Rejection]
    timings: dict[str, Any]
    stats: dict[str, Any]

    @classmethod
    def of(cls, accepted: Iterable[AcceptedContribution | Mapping[str, Any]], rejected: Mapping[str, Rejection] | None,
           timings: Mapping[str, Any] | None, stats: Mapping[str, Any] | None) -> _RoundOutcome:
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
        return cls(accepted_t, rejections, body_extra["timings"], body_extra["stats"])


class SynchronizerStore(LeaseHolder):
    """The synchronizer's handle: everything a reader does, and the writes of the bucket policy's
    ``atoll-synchronizer`` role, all under ``sync/``:

    * ``paths.blob_key(sha)``: global fragments, outer momentum, downlink views and updates;
    * ``paths.commit_key(r)`` or, for a void slot, ``paths.repair_key(r, n)`` (create-once);
    * ``paths.HEAD`` (a hint, overwritten);
    * ``paths.checkpoint_model_key(r)`` and ``paths.checkpoint_config_key(r)``;
    * ``paths.eval_key(r)``, the evaluator's record of round r (create-once);
    * ``paths.sync_lease_key(n)`` (create-once) and ``paths.sync_heartbeat_key(n)``;
    * ``paths.STOP``, the stop marker. It is here and not on
      :class:`~atoll.storage.operator_side.OperatorStore`: the policy grants ``sync/stop.json`` to
      the synchronizer's principal (whoever runs ``atoll stop`` acts with that grant), and the
      marker is signed with the synchronizer's key.

    ``run.json`` is the synchronizer principal's too; it is written once, by
    :class:`~atoll.storage.creation.RunCreator`.
    """

    # -- commits -----------------------------------------------------------------------------
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
        payloads: RoundPayloads | None = None,
        replay_masters: bool = True,
    ) -> CommitResult:
        """Commit round ``round_`` for ``fragment``: new fragment values (None: no update), the
        outer optimizer's ``state_dict()`` for that fragment, who was in and out, timings and
        stats. Payloads first, then the record create-once.

        ``payloads``: the new version's payloads, already written by
        :meth:`write_round_payloads` (instead of ``params``, ``momentum`` and ``downlink``).

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
        existing, void = self._slot(round_)
        if existing is not None:
            return CommitResult(False, existing)
        state = list(self._state_table(round_ - 1))
        prev = self._expected_prev(round_)
        if prev is None:
            raise RoundOrderError(f"round {round_ - 1} is not verified in {self.url}; cannot chain round {round_}")
        outcome = _RoundOutcome.of(accepted, rejected, timings, stats)
        if payloads is None and params is not None:
            payloads = RoundPayloads(round_, fragment, state[fragment], self._write_fragment_state(
                round_, fragment, state[fragment], params, momentum, downlink, downlink_chained, replay_masters))
        elif downlink is not None:
            raise ValueError("a downlink is published with a new version (params) only")
        if payloads is not None:
            state[fragment] = payloads.entry_for(round_, fragment, state[fragment])
        record = CommitRecord(
            round=round_, fragment=fragment, updated=payloads is not None, state=tuple(state),
            accepted=outcome.accepted, rejected=outcome.rejected, timings=outcome.timings,
            stats=outcome.stats, committed_by=committed_by, nonce=uuid.uuid4().hex, created_at=time.time(),
            prev_sha256=prev,
        )
        return self._create_commit(record, void)

    def write_round_payloads(self, round_: int, fragment: int, *, params: Tensors, momentum: Tensors | None = None,
                             downlink: DownlinkStep | None = None, downlink_chained: bool = True,
                             after: int | None = None, replay_masters: bool = True) -> RoundPayloads:
        """The first half of :meth:`commit_round`: check and write a new version's payloads
        (nothing names them yet), so that a later ``commit_round(..., payloads=...)`` only creates
        the record. ``after``: a committed round whose state table holds the fragment's current
        entry (default ``round_ - 1``; the fragment's last version is enough, so the payloads of
        round r may be written before round r - 1 is committed)."""
        self._check_writable()
        self._check_fragment(fragment)
        base = self._state_table(round_ - 1 if after is None else after)[fragment]
        return RoundPayloads(round_, fragment, base, self._write_fragment_state(
            round_, fragment, base, params, momentum, downlink, downlink_chained, replay_masters))

    def _slot(self, round_: int) -> tuple[CommitRecord | None, bool]:
        """(the round's verified record, or None; whether its slot is void). Into a void slot
        (something unverifiable sits there) the commit goes as a repair record."""
        try:
            return self.read_commit(round_), False
        except IntegrityError:
            return None, True

    def _create_commit(self, record: CommitRecord, void: bool) -> CommitResult:
        """Create the sealed record in the round's slot (or a free repair slot), then the head hint.
        A refused create means another synchronizer won the round: its record is the result."""
        round_ = record.round
        data = dump_record(KIND_COMMIT, seal(KIND_COMMIT, record.to_dict(), self._signer(SYNCHRONIZER_KEY_ID)))
        key = paths.commit_key(round_) if not void else self._free_repair_key(round_)
        liveness.fault_hold_before_commit(round_)  # chaos tests only: no-op unless its env vars are set
        if self.store.create(key, data):
            self._remember(record, data)
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
                              chained: bool, replay_masters: bool = True) -> FragmentState:
        """Write a new version's payloads (fp32 master, momentum, compressed downlink); its entry.

        No momentum with outer momentum 0: the outer step never reads its buffer, so an exact
        resume needs none (the entry names none; a reader restores empty buffers).
        The payloads are written at once (:func:`~atoll.storage.io_pool.io_map`: each one's
        serialization, sha256 and PUT on its own thread); the caller names them in a record only
        after all of them are written. ``replay_masters=False`` writes the master whatever
        ``DilocoConfig.master_snapshot_every`` says (a merge that only its own device reproduces)."""
        expected = self.manifest.fragment_shapes(fragment)
        check_tensor_layout(params, expected, what=f"round {round_} params for fragment {fragment}")
        check_finite(params, what=f"round {round_} params")
        if not self.config.outer_momentum:
            momentum = None
        elif momentum is not None:
            check_tensor_layout(momentum, {f"momentum.{n}": s for n, s in expected.items()},
                                what=f"round {round_} momentum", allow_missing=True)
            check_finite(momentum, what=f"round {round_} momentum")
        writes: list[Callable[[], BlobRef | DownlinkState | None]] = [
            lambda: self._write_blob({n: params[n].float() for n in expected}),
            lambda: (None if not self.config.outer_momentum else prev.momentum if momentum is None
                     else self._write_blob({n: t.float() for n, t in momentum.items()})),
            lambda: None if downlink is None else self._write_downlink(round_, fragment, prev, downlink, chained),
        ]
        depth = self._master_depth(prev, replay_masters)
        if depth > 1:  # named, not written: readers replay the rounds since the newest depth-1 version
            writes[:2] = [lambda: self._blob_ref({n: params[n].float() for n in expected}), lambda: None]
        params_ref, momentum_ref, dl = io_map(lambda write: write(), writes)
        return FragmentState(version=round_, params=cast(BlobRef, params_ref), momentum=cast(BlobRef | None, momentum_ref),
                             downlink=cast(DownlinkState | None, dl), master_depth=depth)

    def _master_depth(self, prev: FragmentState, replay_masters: bool) -> int:
        """The new version's ``master_depth``: its master is written at 0 and 1 (a pair: the replay
        starts at the version at 1 and re-anchors against the one before it), replayed above."""
        every = self.config.master_snapshot_every
        if every <= 2 or not replay_masters or self.config.downlink_compression == "fp32":
            return 0
        return (prev.master_depth + 1) % every

    @staticmethod
    def _blob_ref(tensors: Tensors) -> BlobRef:
        """The ref a payload of ``tensors`` would have, without writing (or building) it."""
        return BlobRef(*tensors_sha256(tensors))

    def _write_downlink(self, round_: int, fragment: int, prev: FragmentState, step: DownlinkStep,
                        chained: bool) -> DownlinkState:
        """The update (the run's downlink codec) of a new version against ``prev``, and its view
        (fp32) when it is a snapshot: every ``downlink_snapshot_every`` versions of the fragment,
        and whenever there is no update (not ``chained``)."""
        codec = self.config.downlink_compression
        if codec == "fp32":
            raise ValueError("this run's downlink is fp32: learners read the master, there is no downlink to publish")
        block_size = self.config.compression_block_size if codec == "int4" else 0
        expected = self.manifest.fragment_shapes(fragment)
        check_tensor_layout(step.view, expected, what=f"round {round_} downlink view of fragment {fragment}")
        depth = (0 if prev.downlink is None else prev.downlink.depth) + 1
        if not chained or depth >= self.config.downlink_snapshot_every:
            depth = 0
        view_ref = None
        if depth == 0:  # a snapshot; between two, readers rebuild the view from the updates
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
        return DownlinkState(view=view_ref, update=update_ref, base=prev.version, codec=codec, block_size=block_size,
                             depth=depth)

    # -- lease, stop marker, checkpoints -------------------------------------------------------
    def take_synchronizer_lease(self, *, flow_run_id: str | None = None,
                                group: tuple[int, int] | None = None) -> Lease:
        """Take the next incarnation of the synchronizer (``sync/leases/<n>.json``) or, with
        ``group`` (g, G), of the merger of that fragment group (``sync/groups/<g>of<G>/leases/``)."""
        self._check_writable()
        return liveness.take_lease(self.store, liveness.synchronizer_holder(group), flow_run_id=flow_run_id)

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

    def write_eval(self, record: EvalRecord) -> bool:
        """Create ``sync/evals/<round>.json`` (sealed like the stop marker). False if the round
        already has one (another evaluator, or this one before a restart, measured it first)."""
        self._check_writable()
        if self.read_commit(record.round) is None:
            raise RoundOrderError(f"round {record.round} is not committed in {self.url}: nothing to evaluate")
        data = dump_record(KIND_EVAL, self._operator_seal("the evaluation record")(KIND_EVAL, record.to_dict()))
        return self.store.create(paths.eval_key(record.round), data)

    def write_checkpoint(self, round_: int | None = None, *, params: Tensors | None = None) -> CheckpointInfo:
        """Write ``checkpoints/<round>/model.safetensors`` (whole model, fp32, plain safetensors)
        and then ``config.json`` (run config, plan, versions, the model's sha256). ``params``: the
        whole model as of ``round_`` already in memory (the synchronizer's copy), used where every
        fragment of it hashes to what the round's record names; else the state is read from the
        bucket (rebuilding masters by replay where need be)."""
        self._check_writable()
        held = None if params is None or round_ is None else self._held_state(round_, params)
        if held is None:
            state = self.read_global_state(round_)
            held = (state.round, state.versions, state.params)
        round_, versions, values = held
        m = self.manifest
        data = tensors_to_bytes({n: values[n] for n in m.shapes},  # the model's order, however it was read
                                metadata={"format": "atoll-checkpoint", "run_id": m.run_id, "round": str(round_)})
        model_key, config_key = paths.checkpoint_model_key(round_), paths.checkpoint_config_key(round_)
        self.store.put(model_key, data)
        sha = sha256_hex(data)
        body = {"run_id": m.run_id, "round": round_, "versions": list(versions),
                "config": m.config.to_dict(), "plan": m.plan.to_dict(),
                "shapes": {n: list(s) for n, s in m.shapes.items()},
                "model": {"file": "model.safetensors", "sha256": sha, "nbytes": len(data)},
                "created_at": time.time()}
        self.store.put(config_key, dump_record(KIND_CHECKPOINT, seal(KIND_CHECKPOINT, body,
                                                                     self._signer(SYNCHRONIZER_KEY_ID))))
        return CheckpointInfo(round_, self.store.key_url(model_key), self.store.key_url(config_key), sha)

    def _held_state(self, round_: int, params: Tensors) -> tuple[int, tuple[int, ...], dict[str, torch.Tensor]] | None:
        """(round, versions, the model) if ``params`` is committed round ``round_``'s state,
        fragment by fragment by sha256; else None."""
        record = self.read_commit(round_)
        if record is None:
            return None
        ordered: dict[str, torch.Tensor] = {}
        for p, st in enumerate(record.state):
            fragment = {n: params[n] for n in self.manifest.fragment_shapes(p) if n in params}
            if len(fragment) != len(self.manifest.fragment_shapes(p)) or tensors_sha256(fragment)[0] != st.params.sha256:
                return None
            ordered.update(fragment)
        return round_, record.versions, ordered
