"""The reader's side of a run: :class:`RunReader`, what every principal of the bucket policy may do
(``s3:GetObject`` and ``s3:ListBucket`` on the run; docs/protocol.md section 8).

Contributions (listed and loaded with every check), the global state (fragments, their downlink
views and updates, the outer momentum), learners' saved state, leases and heartbeats, the stop
marker and the retention record, consolidated checkpoints, and :meth:`RunReader.verify`. A
fragment's *version* is the number of the round that last wrote it (0 = initial), so
``read_global_fragment(p, v)`` is one GET of ``sync/commits/<v>.json`` plus its payload.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from atoll.core.compress import DecodeBuffers
from atoll.core.downlink import apply_update
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.synchronize import FragmentContribution, tensor_norms
from atoll.core.weights import Counters
from atoll.storage import checkpoints, liveness, paths
from atoll.storage.chain import CommitChain
from atoll.storage.codec import bytes_to_encoded, bytes_to_tensors, load_record
from atoll.storage.handle import (
    CACHE_ENTRIES,
    MAX_CONTRIBUTION_RECORD_BYTES,
    MAX_HEAD_BYTES,
    MAX_LEARNER_STATE_RECORD_BYTES,
)
from atoll.storage.integrity import IntegrityError, check_seal
from atoll.storage.liveness import KIND_STOP, Liveness, StopMarker
from atoll.storage.reading import Skipped, read_parsed
from atoll.storage.records import (
    KIND_CONTRIBUTION,
    KIND_EVAL,
    KIND_LEARNER_STATE,
    KIND_PRUNE,
    CommitRecord,
    ContributionRecord,
    EvalRecord,
    FragmentState,
    LearnerStateRecord,
    PruneRecord,
)
from atoll.storage.replay import read_written_master, read_written_momentum, replay_master
from atoll.storage.store import io_map
from atoll.storage.validation import (
    InvalidInput,
    PrunedError,
    RoundOrderError,
    StorageError,
    TransientStorageError,
    check_shapes,
    check_tensor_layout,
    validate_learner_id,
)
from atoll.storage.verify import VerifyReport, verify_slots, verify_state
from atoll.storage.views import ViewChain, view_chain

__all__ = ["RunReader", "ContributionListing", "GlobalState", "LearnerState", "CheckpointInfo",
           "MAX_LISTED_PER_PREFIX", "LIST_LIMIT"]


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
    """Every parameter read, fp32, at its fragment's version (every fragment's, unless
    :meth:`RunReader.read_global_state` was given ``fragments``)."""
    momentum: dict[int, dict[str, torch.Tensor]]
    """Per fragment, the outer optimizer's ``state_dict()`` (empty before its first update)."""
    timings: dict[str, Any]
    record: CommitRecord | None
    """The commit record of ``round`` (None for round 0, the initial state)."""
    restored: dict[int, str] = field(default_factory=dict)
    """Fragments whose published state object did not verify, and what was used instead (an
    older version of the fragment, or its version 0); empty when everything verified."""
    previous: dict[int, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Per fragment whose master was rebuilt by replay: (version, master) of its version before,
    which the replay rebuilt on the way (a restarted synchronizer's next re-anchoring base)."""


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


class RunReader(CommitChain):
    """What every role reads (bucket policy: ``EveryoneReadsTheRun``; a role opened with
    ``read_only=True`` writes nothing at all, not even the capability probe). Writes no key: the
    writers are the role classes built on it."""

    # -- contributions -----------------------------------------------------------------------
    def _read_contribution_record(self, key: str) -> ContributionRecord | Rejection:
        """Parsed record, or the reason it is unusable. Cached: records are immutable."""
        with self._cache.contributions_lock:
            cached = self._cache.contributions.get(key)
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
                check_seal(KIND_CONTRIBUTION, body, url=url, key=self._verifier(record.learner_id),
                           require_signature=self._signatures_required())
            except IntegrityError as e:
                kind = RejectionKind.BAD_SIGNATURE if self._signatures_required() else RejectionKind.CORRUPT
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
        cache = self._cache
        with cache.contributions_lock:
            cache.contributions[key] = result
            while len(cache.contributions) > CACHE_ENTRIES:
                cache.contributions.popitem(last=False)
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

    def load_contribution(self, record: ContributionRecord, *, device: torch.device | None = None,
                          out: Mapping[str, torch.Tensor] | None = None, norms: bool = False) -> FragmentContribution:
        """Read, verify (size cap, sha256, names/shapes/dtypes, finiteness) and decode to fp32, on
        ``device`` (None: the host; elsewhere the encoded bytes are copied there and decoded there),
        into ``out`` where given (tensors of the fragment's shapes, by name). ``norms``: also
        measure the delta's norms right after decoding (``FragmentContribution.delta_norms``).

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
        delta = bytes_to_encoded(data, record.tensors, url=url, device=device, out=out)
        check_tensor_layout(delta, expected, what=f"contribution {record.key}", dtype=torch.float32)
        return FragmentContribution(
            key=record.key,
            learner_id=record.learner_id,
            base_version=record.base_version,
            counters=Counters(c_steps=record.c_steps, c_tokens=record.c_tokens),
            delta=delta,
            delta_norms=tensor_norms(delta) if norms else None,
        )

    def load_contributions(
        self, records: Iterable[ContributionRecord], *, device: torch.device | None = None,
        into: DecodeBuffers | None = None, norms: bool = True,
    ) -> tuple[list[FragmentContribution], dict[str, Rejection]]:
        """Load many (concurrently, results in the order given; decoded on ``device``, see
        :meth:`load_contribution`; into tensors taken from ``into`` where given, a bad payload's
        given back; each delta's norms measured on its I/O thread while it is in cache, the
        merge's pass over it); bad ones land in the second value as ``key -> Rejection`` instead
        of raising. A transient storage error is raised (the store is unwell, not a payload)."""
        def one(r: ContributionRecord) -> FragmentContribution | Rejection:
            out = None
            if into is not None and 0 <= r.fragment < self.plan.num_fragments:
                out = into.take(self.manifest.fragment_shapes(r.fragment), device or torch.device("cpu"))
            try:
                return self.load_contribution(r, device=device, out=out, norms=norms)
            except TransientStorageError:
                raise
            except Exception as e:  # noqa: BLE001 - no single object may stop the synchronizer
                if into is not None and out is not None:
                    into.give_back(out.values())
                if isinstance(e, InvalidInput):
                    return e.rejection
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
        """Fragment values at ``version`` (the round that wrote it; 0 = initial; None = latest):
        its master, read, or rebuilt by replay where the version writes none (:mod:`atoll.storage.replay`)."""
        self._check_fragment(fragment)
        if version is None:
            version = self._state_table(self.latest_round())[fragment].version
        st = self.fragment_state(fragment, version)
        return read_written_master(self, fragment, st) if st.master_written else replay_master(self, fragment, version).params

    def view_chain(self, fragment: int, version: int) -> ViewChain:
        """The objects that rebuild what learners hold of ``fragment`` at ``version``
        (:func:`atoll.storage.views.view_chain`): its own view, or the newest snapshot below it
        and the updates after it. InvalidInput if a record on the way is void or inconsistent."""
        try:
            return view_chain(fragment, version, lambda v: self.fragment_state(fragment, v))
        except (InvalidInput, TransientStorageError):
            raise
        except (StorageError, ValueError) as e:  # a void or missing slot on the way, or a wrong entry
            raise InvalidInput("corrupt", f"fragment {fragment} v{version}: the chain to its snapshot does not "
                                          f"read: {type(e).__name__}: {str(e)[:300]}") from None

    def read_fragment_view(self, fragment: int, version: int, *,
                           chain: ViewChain | None = None) -> dict[str, torch.Tensor]:
        """What learners hold of ``fragment`` at ``version``: its downlink view (a compressed
        downlink; rebuilt from ``chain``, by default :meth:`view_chain`, when the version publishes
        only its update), else the fp32 master itself. InvalidInput if an object is unreadable."""
        chain = self.view_chain(fragment, version) if chain is None else chain
        shapes = self.manifest.fragment_shapes(fragment)
        view = self._read_fp32_blob(chain.start, shapes, f"fragment {fragment} v{chain.snapshot} view")
        for v, _ in chain.updates:  # the synchronizer moved its view by exactly these, in this order
            view = apply_update(view, self.read_fragment_update(fragment, v)[1])
        return view

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
                          view: bool = False, fragments: Collection[int] | None = None) -> GlobalState:
        """All parameters, outer-optimizer state and timings as of ``round_`` (None = latest).

        ``fragments``: read only these fragments' parameters and momentum (a merger of a split
        synchronizer holds its own group's, 1/G of the model); ``versions`` still names every one.

        ``view=True``: each fragment as learners hold it (its downlink view where the run's
        downlink is compressed, rebuilt from its snapshot where need be, :meth:`read_fragment_view`;
        the master where it publishes none, or where the view does not read, noted in
        ``restored``): a joining learner's full state. ``momentum=False``: skip the outer momentum
        (learners never need it; a run with outer momentum 0 publishes none: empty buffers, and
        the outer step never reads them)."""
        round_ = self.latest_round() if round_ is None else round_
        table = self._state_table(round_)
        params: dict[str, torch.Tensor] = {}
        moments: dict[int, dict[str, torch.Tensor]] = {}
        restored: dict[int, str] = {}
        previous: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        for p, st in enumerate(table):
            moments[p] = {}
            if fragments is not None and p not in fragments:
                continue
            if view and st.downlink is not None:
                try:
                    params.update(self.read_fragment_view(p, st.version))
                    continue
                except InvalidInput as e:  # the master is within one quantization error of it
                    restored[p] = f"view of v{st.version} unreadable ({e.kind.value}); using the master"
            try:
                if st.master_written:
                    params.update(read_written_master(self, p, st))
                else:  # rebuilt by replay, with its momentum
                    rebuilt = replay_master(self, p, st.version)
                    params.update(rebuilt.params)
                    moments[p] = rebuilt.momentum if momentum else {}
                    if rebuilt.previous is not None:
                        previous[p] = rebuilt.previous
            except InvalidInput as e:
                values, used = self._fallback_fragment(round_, p, st, e)
                params.update(values)
                restored[p] = f"v{st.version} unreadable ({e.kind.value}); using v{used}" + (
                    "" if st.master_written else f": {e}"[:400])
            if momentum and st.momentum is not None and p not in restored:
                try:
                    moments[p] = read_written_momentum(self, p, st)
                except InvalidInput as e:
                    restored[p] = f"momentum of v{st.version} unreadable ({e.kind.value}); reset to zero"
        rec = self.read_commit(round_) if round_ else None
        return GlobalState(round=round_, versions=tuple(s.version for s in table), params=params,
                           momentum=moments, timings=dict(rec.timings) if rec else {}, record=rec,
                           restored=restored, previous=previous)

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
            if rec is not None and rec.fragment == p and rec.updated and rec.state[p].master_written:
                try:
                    return self._read_fp32_blob(rec.state[p].params, shapes, f"fragment {p} v{r}"), r
                except InvalidInput:
                    pass
            r -= self.plan.num_fragments
        return self._read_fp32_blob(self.manifest.initial[p], shapes, f"fragment {p} v0"), 0

    # -- learner state -----------------------------------------------------------------------
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
    def learner_liveness(self, learner_id: str) -> Liveness:
        """The learner's newest lease and its heartbeat (two LISTs, two GETs; unusable objects are
        ignored and named in ``problems``)."""
        validate_learner_id(learner_id)
        return liveness.read_liveness(self.store, learner_id)

    def learners_liveness(self, learner_ids: Iterable[str]) -> dict[str, Liveness]:
        """:meth:`learner_liveness` of each, concurrently (a fleet watch reads every learner's)."""
        ids = list(dict.fromkeys(learner_ids))
        return dict(zip(ids, io_map(self.learner_liveness, ids), strict=True))

    def synchronizer_liveness(self, group: tuple[int, int] | None = None) -> Liveness:
        """The synchronizer's, or with ``group`` (g, G) the merger's of that fragment group."""
        return liveness.read_liveness(self.store, liveness.synchronizer_holder(group))

    def current_incarnation(self, learner_id: str) -> int:
        """The learner's newest lease number (one LIST); 0 = never leased."""
        validate_learner_id(learner_id)
        return liveness.newest_incarnation(self.store, learner_id)

    def current_synchronizer_incarnation(self, group: tuple[int, int] | None = None) -> int:
        return liveness.newest_incarnation(self.store, liveness.synchronizer_holder(group))

    def stop_marker(self) -> StopMarker | None:
        """The stop marker; None if there is none or it is unusable (use :meth:`read_stop_marker`
        for the reason). None or ``stopped=False`` mean running."""
        return self.read_stop_marker()[0]

    def read_stop_marker(self) -> tuple[StopMarker | None, str | None]:
        """(the stop marker or None, why an existing one was ignored or None). With the
        synchronizer's key, a marker that is not signed with it for this run is ignored."""
        return liveness.read_stop_marker(self.store, check=self._operator_check(KIND_STOP))

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

    # -- evaluations -------------------------------------------------------------------------
    def eval_rounds(self) -> list[int]:
        """Rounds with an evaluation record in ``sync/evals/`` (one LIST; other names are ignored)."""
        return sorted({r for n in self.store.list(paths.evals_prefix()) if (r := paths.parse_eval_key(n))})

    def read_eval(self, round_: int) -> EvalRecord | None:
        """Round ``round_``'s evaluation record; None if there is none, or if it is unusable
        (malformed, oversized, for another round, or failing the synchronizer's seal)."""
        key = paths.eval_key(round_)
        check, url = self._operator_check(KIND_EVAL), self.store.key_url(key)

        def parse(data: bytes) -> EvalRecord:
            body = load_record(data, KIND_EVAL)
            check(body, url)
            rec = EvalRecord.from_body(body)
            if rec.round != round_:
                raise InvalidInput("schema", f"evaluation record of round {rec.round} under round {round_}'s key")
            return rec
        got = read_parsed(self.store, key, MAX_HEAD_BYTES * 4, parse)
        return None if isinstance(got, Skipped) else got

    def read_evals(self, rounds: Iterable[int]) -> dict[int, EvalRecord]:
        """The usable evaluation records of ``rounds`` (their GETs at once)."""
        wanted = sorted(set(rounds))
        return {r: rec for r, rec in zip(wanted, io_map(self.read_eval, wanted), strict=True) if rec is not None}

    # -- consolidated checkpoints ------------------------------------------------------------
    def list_checkpoints(self) -> list[int]:
        """Rounds that have a checkpoint folder (one LIST)."""
        return sorted(int(n) for n in self.store.list(paths.checkpoints_prefix())
                      if n.isascii() and n.isdigit() and len(n) <= 12)

    def load_checkpoint(self, round_: int) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, verified (:func:`atoll.storage.checkpoints.load_checkpoint`:
        its config's seal and fields, the model's size and sha256)."""
        return checkpoints.load_checkpoint(self, round_)

    # -- the whole run -----------------------------------------------------------------------
    def verify(self, *, on_round: Callable[[int], None] | None = None) -> VerifyReport:
        """Walk the whole chain from ``run.json`` to the latest round with a fresh handle: every
        commit's digest, link and (with the synchronizer's key) signature, and that every state
        object it publishes exists with its sha256. The commit slots are also listed: a slot past
        the end of the walk (a round committed after a missing one) is a gap, reported. Reads
        only; never raises for bad data."""
        fresh = RunReader(self.store, max_payload_bytes=self.max_payload_bytes, keyring=self.keyring, read_only=True)
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
        entries: dict[tuple[int, int], FragmentState] = {}  # (fragment, version) -> its entry: view chains
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
            verify_state(fresh, report, r, rec, seen, entries)
            if on_round is not None:
                on_round(r)
            r += 1
        report.latest = r - 1
        verify_slots(fresh, report)
        if report.latest and report.latest not in report.void:  # what a resume reads must rebuild
            for p, st in enumerate(fresh.read_commit(report.latest).state):  # type: ignore[union-attr]
                if not st.master_written:
                    try:
                        replay_master(fresh, p, st.version)
                    except InvalidInput as e:
                        report.problems.append(f"round {report.latest} state: fragment {p} v{st.version}'s master "
                                               f"cannot be rebuilt by replay: {e}")
        return report
