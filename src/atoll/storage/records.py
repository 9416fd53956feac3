"""Typed records of the bucket protocol and their JSON (de)serialisation.

Every record is written as canonical JSON with ``schema`` and ``schema_version`` fields (see
:mod:`atoll.storage.codec`); ``from_body`` validates types and raises InvalidInput('schema').
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atoll.core.config import ConfigError, DilocoConfig
from atoll.core.fragments import FragmentPlan
from atoll.core.rejection import Rejection
from atoll.storage.validation import InvalidInput, validate_id, validate_learner_id

__all__ = [
    "KIND_RUN",
    "KIND_CONTRIBUTION",
    "KIND_COMMIT",
    "KIND_HEAD",
    "KIND_LEARNER_STATE",
    "KIND_CHECKPOINT",
    "KIND_PRUNE",
    "KIND_EVAL",
    "BlobRef",
    "RunManifest",
    "ContributionRecord",
    "FragmentState",
    "DownlinkState",
    "DOWNLINK_CODECS",
    "AcceptedContribution",
    "CommitRecord",
    "LearnerStateRecord",
    "PruneRecord",
    "EvalRecord",
]

KIND_RUN = "atoll/run"
KIND_CONTRIBUTION = "atoll/contribution"
KIND_COMMIT = "atoll/commit"
KIND_HEAD = "atoll/head"
KIND_LEARNER_STATE = "atoll/learner-state"
KIND_CHECKPOINT = "atoll/checkpoint"
KIND_PRUNE = "atoll/prune"
KIND_EVAL = "atoll/eval"


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidInput("schema", what)


MAX_RECORD_INT = 2**53
"""Largest integer a record may hold (exact in a float64; far beyond any real count). Bigger
integers are rejected so that no later float conversion can overflow."""


def _int(body: Mapping[str, Any], name: str, *, minimum: int = 0) -> int:
    v = body.get(name)
    if not (isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_RECORD_INT):
        shown = repr(v) if not isinstance(v, int) or v.bit_length() < 200 else f"an integer of {v.bit_length()} bits"
        raise InvalidInput("schema", f"{name} must be an integer in [{minimum}, 2**53], got {shown}")
    return int(v)


def _float(body: Mapping[str, Any], name: str) -> float:
    v = body.get(name)
    if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)):
        raise InvalidInput("schema", f"{name} must be a finite number, got {v!r}")
    return float(v)


def _dict(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    v = body.get(name, {})
    _need(isinstance(v, dict), f"{name} must be an object, got {type(v).__name__}")
    return dict(v)


def _sha_or_empty(value: Any) -> str:
    if not (value == "" or (isinstance(value, str) and len(value) == 64
                            and all(c in "0123456789abcdef" for c in value))):
        raise InvalidInput("schema", f"prev_sha256 must be 64 lowercase hex digits, got {value!r}")
    return str(value)


def _rejection(value: Any, key: str) -> Rejection:
    """A stored rejection: ``{"kind", "detail"}`` (schema 2), or the bare text of schema 1."""
    if isinstance(value, str):
        return Rejection.from_legacy_text(value)
    _need(isinstance(value, dict), f"rejected[{key!r}] must be an object with kind and detail")
    try:
        return Rejection.from_dict(value)
    except ValueError as e:
        raise InvalidInput("schema", f"rejected[{key!r}]: {e}") from None


@dataclass(frozen=True)
class BlobRef:
    """A content-addressed payload: ``blobs/sha256/<sha256>.safetensors`` of ``nbytes`` bytes."""

    sha256: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "nbytes": self.nbytes}

    @classmethod
    def from_body(cls, body: Any, what: str = "payload") -> BlobRef:
        _need(isinstance(body, dict), f"{what} must be an object")
        sha = body.get("sha256")
        _need(isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha),
              f"{what}.sha256 must be 64 lowercase hex digits, got {sha!r}")
        return cls(sha256=sha, nbytes=_int(body, "nbytes"))


@dataclass(frozen=True)
class RunManifest:
    """``run.json``: what never changes during a run."""

    run_id: str
    config: DilocoConfig
    plan: FragmentPlan
    shapes: Mapping[str, tuple[int, ...]]
    """Shape of every parameter (the plan only has element counts)."""
    initial: tuple[BlobRef, ...]
    """Version 0 of every fragment (fp32 safetensors, one blob per fragment)."""
    created_at: float
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Caller's JSON-able extras (model recipe, dataset, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "config": self.config.to_dict(),
            "plan": self.plan.to_dict(),
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "initial": [b.to_dict() for b in self.initial],
            "created_at": self.created_at,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RunManifest:
        try:
            config = DilocoConfig.from_dict(_dict(body, "config"))
            plan = FragmentPlan.from_dict(_dict(body, "plan"))
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise InvalidInput("schema", f"run manifest: bad config or plan: {e}") from None
        shapes_raw = _dict(body, "shapes")
        shapes = {}
        for n, s in shapes_raw.items():
            _need(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s), f"shape of {n!r} invalid")
            shapes[n] = tuple(s)
        _need(set(shapes) == set(plan.sizes), "run manifest: shapes do not cover the plan's parameters")
        initial = body.get("initial")
        if not (isinstance(initial, list) and len(initial) == plan.num_fragments):
            raise InvalidInput("schema", "run manifest: initial must list one payload per fragment")
        return cls(
            run_id=validate_id(body.get("run_id"), "run id"),
            config=config,
            plan=plan,
            shapes=shapes,
            initial=tuple(BlobRef.from_body(b, "initial[]") for b in initial),
            created_at=_float(body, "created_at"),
            extra=_dict(body, "extra"),
        )

    def fragment_shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: self.shapes[n] for n in self.plan.fragments[p]}


@dataclass(frozen=True)
class ContributionRecord:
    """A learner's delta for one fragment: counters, codec per tensor, and the payload it points at."""

    key: str
    """Run-relative key of this record (derived from the fields; unique)."""
    learner_id: str
    fragment: int
    base_version: int
    c_steps: int
    c_tokens: int
    payload: BlobRef
    tensors: Mapping[str, Mapping[str, Any]]
    """``name -> {"codec": "fp32"|"bf16"|"int4", "shape": [...], "block_size": int}``."""
    created_at: float
    info: Mapping[str, Any] = field(default_factory=dict)
    """Learner's JSON-able extras (pool, loss, hostname ...); informational only."""
    incarnation: int = 0
    """The lease incarnation of the learner process that published it (0: no lease, as written
    by the virtual driver, simulations and records older than leases). The synchronizer rejects
    a contribution whose incarnation is below the learner's newest lease (``fenced``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "learner_id": self.learner_id,
            "fragment": self.fragment,
            "base_version": self.base_version,
            "c_steps": self.c_steps,
            "c_tokens": self.c_tokens,
            "payload": self.payload.to_dict(),
            "tensors": {n: dict(m) for n, m in self.tensors.items()},
            "created_at": self.created_at,
            "info": dict(self.info),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], key: str) -> ContributionRecord:
        tensors = _dict(body, "tensors")
        for n, m in tensors.items():
            _need(isinstance(m, dict) and isinstance(m.get("shape"), list), f"tensors[{n!r}] needs a shape list")
        return cls(
            key=key,
            learner_id=validate_learner_id(body.get("learner_id")),
            fragment=_int(body, "fragment"),
            base_version=_int(body, "base_version"),
            c_steps=_int(body, "c_steps"),
            c_tokens=_int(body, "c_tokens"),
            payload=BlobRef.from_body(body.get("payload")),
            tensors=tensors,
            created_at=_float(body, "created_at"),
            info=_dict(body, "info"),
            incarnation=_int(body, "incarnation") if "incarnation" in body else 0,
        )


DOWNLINK_CODECS = ("bf16", "int4")
"""Codecs of a compressed downlink update (an fp32 downlink publishes no downlink entry)."""


@dataclass(frozen=True)
class DownlinkState:
    """What learners download of one fragment version when the run's downlink is compressed
    (``DilocoConfig.downlink_compression``; :mod:`atoll.core.downlink`)."""

    view: BlobRef | None
    """fp32 values learners hold at this version (``view_v``), published every
    ``DilocoConfig.downlink_snapshot_every`` versions of the fragment (a *snapshot*) and whenever
    there is no update. None: rebuild ``view_v`` from the newest snapshot at or below this version
    and the updates after it (:func:`atoll.storage.views.view_chain`), bit for bit."""
    update: BlobRef | None
    """``encode(master_v - view_base)``: parts ``<name>::<part>`` of ``codec``; ``view_v =
    view_base + decode(update)``. None: no chain from ``base`` (read ``view``)."""
    base: int
    """The version the update applies to (the fragment's previous version)."""
    codec: str
    block_size: int
    """int4's elements per scale block (0 for bf16)."""
    depth: int = 0
    """Updates from the newest snapshot at or below this version up to it: 0 when this version
    publishes its ``view`` (records written before snapshots have a view on every version and
    no ``depth`` key), else ``base``'s depth + 1."""

    def to_dict(self) -> dict[str, Any]:
        out = {"view": self.view.to_dict() if self.view else None,
               "update": self.update.to_dict() if self.update else None,
               "base": self.base, "codec": self.codec, "block_size": self.block_size}
        if self.depth:  # a snapshot's entry is byte for byte what it was before snapshots
            out["depth"] = self.depth
        return out

    @classmethod
    def from_body(cls, body: Any) -> DownlinkState:
        _need(isinstance(body, dict), "state[].downlink must be an object")
        codec, update, view = body.get("codec"), body.get("update"), body.get("view")
        _need(codec in DOWNLINK_CODECS, f"state[].downlink.codec must be one of {DOWNLINK_CODECS}, got {codec!r}")
        block_size = _int(body, "block_size")
        _need(codec != "int4" or (block_size >= 2 and block_size % 2 == 0),
              f"state[].downlink.block_size must be even and >= 2 for int4, got {block_size}")
        depth = _int(body, "depth") if "depth" in body else 0
        _need((view is None) == (depth > 0), "state[].downlink: a view is published exactly when depth is 0")
        _need(depth == 0 or update is not None, "state[].downlink: a version without a view needs an update")
        return cls(view=None if view is None else BlobRef.from_body(view, "state[].downlink.view"),
                   update=None if update is None else BlobRef.from_body(update, "state[].downlink.update"),
                   base=_int(body, "base"), codec=str(codec), block_size=block_size, depth=depth)


@dataclass(frozen=True)
class FragmentState:
    """One fragment in a commit record's state table."""

    version: int
    """The round that last wrote this fragment (0 = the run's initial value)."""
    params: BlobRef
    """fp32 values of the fragment's parameters at that version."""
    momentum: BlobRef | None = None
    """Nesterov buffers (``momentum.<name>``) after that round; None before the first update, and
    in a run with outer momentum 0 (its buffers are never read: resume restores zeros)."""
    downlink: DownlinkState | None = None
    """The compressed downlink of that version; None: learners hold ``params`` itself (an fp32
    downlink, version 0, and records written before compressed downlinks: the key is omitted)."""
    master_depth: int = 0
    """Versions of the fragment since the newest one that starts a pair of written masters
    (``DilocoConfig.master_snapshot_every``): 0 or 1 when this version's ``params`` (and
    ``momentum``) objects are written; 2 or more when ``params`` names the master's sha256 but no
    object, and ``momentum`` is None: rebuild both by replaying the rounds after the newest
    version at depth 1 (:mod:`atoll.storage.replay`). Omitted (0) in records written with a master
    on every version."""

    @property
    def master_written(self) -> bool:
        """Whether this version's master (and momentum) objects are in the bucket."""
        return self.master_depth <= 1

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "params": self.params.to_dict(),
            "momentum": self.momentum.to_dict() if self.momentum else None,
        }
        if self.downlink is not None:
            out["downlink"] = self.downlink.to_dict()
        if self.master_depth:
            out["master_depth"] = self.master_depth
        return out

    def refs(self) -> list[BlobRef]:
        """Every payload this entry names and writes (what retention keeps and ``atoll verify``
        checks): a master rebuilt by replay names an object that is never written."""
        refs = [] if not self.master_written else [self.params] + ([self.momentum] if self.momentum is not None else [])
        if self.downlink is not None:
            refs += [ref for ref in (self.downlink.view, self.downlink.update) if ref is not None]
        return refs

    @classmethod
    def from_body(cls, body: Any) -> FragmentState:
        _need(isinstance(body, dict), "state[] entries must be objects")
        m, d = body.get("momentum"), body.get("downlink")
        out = cls(
            version=_int(body, "version"),
            params=BlobRef.from_body(body.get("params"), "state[].params"),
            momentum=None if m is None else BlobRef.from_body(m, "state[].momentum"),
            downlink=None if d is None else DownlinkState.from_body(d),
            master_depth=_int(body, "master_depth") if "master_depth" in body else 0,
        )
        _need(out.downlink is None or out.downlink.base < out.version,
              f"state[].downlink.base must be below the version {out.version}")
        _need(out.master_written or (out.momentum is None and out.downlink is not None and out.version > 0),
              "state[]: a master rebuilt by replay has a compressed downlink and no momentum object")
        return out


@dataclass(frozen=True)
class AcceptedContribution:
    """A contribution merged in a round, with its normalised weight."""

    key: str
    learner_id: str
    weight: float
    base_version: int
    c_steps: int
    c_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_body(cls, body: Any) -> AcceptedContribution:
        _need(isinstance(body, dict) and isinstance(body.get("key"), str), "accepted[] entries need a key")
        return cls(
            key=body["key"],
            learner_id=validate_id(body.get("learner_id"), "learner id"),
            weight=_float(body, "weight"),
            base_version=_int(body, "base_version"),
            c_steps=_int(body, "c_steps"),
            c_tokens=_int(body, "c_tokens"),
        )


@dataclass(frozen=True)
class CommitRecord:
    """``commits/<round>.json``, written create-once: the round happened, exactly like this."""

    round: int
    fragment: int
    """The fragment this round synchronized."""
    updated: bool
    """False if the round closed without an update (nothing mergeable); the state is unchanged."""
    state: tuple[FragmentState, ...]
    """Every fragment's current version after this round (so resume needs only this record)."""
    accepted: tuple[AcceptedContribution, ...]
    rejected: Mapping[str, Rejection]
    """Contribution key -> why it got weight 0 / was refused. Stored as ``{"kind", "detail"}``
    (schema version 2); version-1 records stored only text, read back by
    :meth:`Rejection.from_legacy_text`."""
    timings: Mapping[str, Any]
    """The synchronizer's EMA timings (``TimingEma.to_dict()``) after this round."""
    stats: Mapping[str, Any]
    """Round facts for humans: quorum_s, grace_s, loss, bytes ... (free-form, JSON)."""
    committed_by: str
    nonce: str
    created_at: float
    prev_sha256: str = ""
    """sha256 of the previous commit record's bytes (round 1: of ``run.json``): the hash chain."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "prev_sha256": self.prev_sha256,
            "round": self.round,
            "fragment": self.fragment,
            "updated": self.updated,
            "state": [s.to_dict() for s in self.state],
            "accepted": [a.to_dict() for a in self.accepted],
            "rejected": {k: r.to_dict() for k, r in self.rejected.items()},
            "timings": dict(self.timings),
            "stats": dict(self.stats),
            "committed_by": self.committed_by,
            "nonce": self.nonce,
            "created_at": self.created_at,
        }

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(s.version for s in self.state)

    @classmethod
    def from_body(cls, body: Mapping[str, Any], num_fragments: int) -> CommitRecord:
        state = body.get("state")
        if not (isinstance(state, list) and len(state) == num_fragments):
            raise InvalidInput("schema", f"state must list all {num_fragments} fragments")
        accepted = body.get("accepted", [])
        _need(isinstance(accepted, list), "accepted must be a list")
        rejected = {k: _rejection(v, k) for k, v in _dict(body, "rejected").items()}
        updated = body.get("updated")
        if not isinstance(updated, bool):
            raise InvalidInput("schema", "updated must be a boolean")
        fragment = _int(body, "fragment")
        _need(fragment < num_fragments, f"fragment {fragment} out of range (P={num_fragments})")
        nonce, by = body.get("nonce"), body.get("committed_by")
        if not (isinstance(nonce, str) and isinstance(by, str)):
            raise InvalidInput("schema", "nonce and committed_by must be strings")
        return cls(
            round=_int(body, "round", minimum=1),
            fragment=fragment,
            updated=updated,
            state=tuple(FragmentState.from_body(s) for s in state),
            accepted=tuple(AcceptedContribution.from_body(a) for a in accepted),
            rejected=rejected,
            timings=_dict(body, "timings"),
            stats=_dict(body, "stats"),
            committed_by=by,
            nonce=nonce,
            created_at=_float(body, "created_at"),
            prev_sha256=_sha_or_empty(body.get("prev_sha256", "")),
        )


@dataclass(frozen=True)
class LearnerStateRecord:
    """``learners/<id>/state.json``: the learner's last saved inner state (overwritten each save)."""

    learner_id: str
    payload: BlobRef
    meta: Mapping[str, Any]
    saved_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"learner_id": self.learner_id, "payload": self.payload.to_dict(), "meta": dict(self.meta),
                "saved_at": self.saved_at}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> LearnerStateRecord:
        return cls(
            learner_id=validate_id(body.get("learner_id"), "learner id"),
            payload=BlobRef.from_body(body.get("payload")),
            meta=_dict(body, "meta"),
            saved_at=_float(body, "saved_at"),
        )


@dataclass(frozen=True)
class PruneRecord:
    """``sync/prune.json``: what retention (``atoll prune``) may have deleted. Overwritten by each
    prune; its numbers only ever rise. Readers use it to tell "deleted on purpose" from "lost"."""

    through_round: int
    """Rounds up to this one may have lost their global state objects and contributions."""
    floors: tuple[int, ...]
    """Per fragment: versions below this (except version 0, in run.json) may have no state object,
    and contributions computed against them may be gone."""
    pruned_at: float
    by: str
    deleted_objects: int = 0
    deleted_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"through_round": self.through_round, "floors": list(self.floors), "pruned_at": self.pruned_at,
                "by": self.by, "deleted_objects": self.deleted_objects, "deleted_bytes": self.deleted_bytes}

    @classmethod
    def from_body(cls, body: Mapping[str, Any], num_fragments: int) -> PruneRecord:
        floors = body.get("floors")
        _need(isinstance(floors, list) and len(floors) == num_fragments,
              f"floors must be a list of {num_fragments} versions")
        by = body.get("by", "")
        _need(isinstance(by, str) and len(by) <= 256, "by must be text of at most 256 characters")
        return cls(
            through_round=_int(body, "through_round"),
            floors=tuple(_int({"floor": f}, "floor") for f in (floors or [])),
            pruned_at=_float(body, "pruned_at"),
            by=by,
            deleted_objects=_int(body, "deleted_objects"),
            deleted_bytes=_int(body, "deleted_bytes"),
        )

    def may_be_pruned(self, fragment: int, version: int) -> bool:
        """Whether ``version`` of ``fragment`` is below this record's floor (its object may be gone)."""
        return 0 < version < self.floors[fragment]


@dataclass(frozen=True)
class EvalRecord:
    """``sync/evals/<round>.json``, written create-once by the synchronizer's evaluator: the
    validation loss of the global model as committed by ``round`` (the commit record itself is
    immutable, and evaluation runs after it, off the round's path)."""

    round: int
    """The committed round whose global state was evaluated."""
    val_loss: float
    """Mean next-token cross-entropy (nats/token) on the recipe's validation windows."""
    tokens: int
    """Tokens predicted in this evaluation (windows x context): its cost."""
    eval_s: float
    """Seconds the evaluation took (reading the state, the forward passes)."""
    device: str
    """Where it ran ('cpu', 'cuda:0', ...)."""
    evaluated_at: float
    """When it finished (the evaluator's clock, seconds since the epoch)."""
    by: str = ""
    """Who evaluated (the synchronizer id, or a standalone evaluator's)."""

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "val_loss": self.val_loss, "tokens": self.tokens, "eval_s": self.eval_s,
                "device": self.device, "evaluated_at": self.evaluated_at, "by": self.by}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> EvalRecord:
        device, by = body.get("device", ""), body.get("by", "")
        _need(isinstance(device, str) and len(device) <= 64, "device must be text of at most 64 characters")
        _need(isinstance(by, str) and len(by) <= 256, "by must be text of at most 256 characters")
        return cls(round=_int(body, "round", minimum=1), val_loss=_float(body, "val_loss"),
                   tokens=_int(body, "tokens"), eval_s=_float(body, "eval_s"), device=device,
                   evaluated_at=_float(body, "evaluated_at"), by=by)
