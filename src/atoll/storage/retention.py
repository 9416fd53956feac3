"""Retention: delete what a long run no longer needs, and nothing it does.

A run left going for days writes without end: every publish adds a delta payload, every saved
learner state a new inner-state payload (parameters and AdamW moments: three model copies),
every round a new global fragment and its momentum, every N rounds a whole-model checkpoint. The
bucket is the truth, so this module decides from the bucket alone what is dead:

* **Global state** (``sync/blobs``: each version's master, momentum and, with a compressed
  downlink, its update and, every few versions, its view): only the versions of each fragment
  written in the last ``keep_rounds`` rounds, and the one current when that window began, stay
  readable; for a kept version that publishes no view of its own, so do its snapshot's view and
  the updates after it (its view is rebuilt from them, docs/protocol.md). The
  synchronizer merges against the current and the previous version of a fragment (never older:
  ``Synchronizer.poll`` lists only those two base versions), so ``keep_rounds >= 2 P`` keeps
  every version a merge can need. Version 0 lives in ``run.json`` and is never deleted.
* **Contributions** (records and payloads under ``learners/<id>/``) computed against a version
  below that floor: the synchronizer never lists them again, whatever became of them.
* **Learner payloads** that nothing references any more: deltas of deleted contributions and
  inner states replaced by a newer ``state.json``.
* **Checkpoints** beyond the newest ``keep_checkpoints`` complete ones, only when asked: they are
  the run's deliverable.

Safe while the run trains: an object nothing references is deleted only once it is
``min_age_s`` old, because every writer puts a payload *before* the record that points at it
(a learner publishing or saving right now, a synchronizer between its payloads and its commit).
The retention record ``sync/prune.json`` is written *before* anything is deleted, so ``atoll
verify`` and readers can tell "deleted on purpose" from "lost" even if a prune is killed midway.
Commit records, leases and heartbeats are never deleted: they are small, and the chain and the
fencing need them.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from atoll.core.rejection import RejectionKind
from atoll.storage import paths
from atoll.storage.checkpoints import checked_checkpoint
from atoll.storage.integrity import IntegrityError
from atoll.storage.operator_side import OperatorStore
from atoll.storage.reader import RunReader
from atoll.storage.reading import MAX_WHY_CHARS, Skipped
from atoll.storage.records import BlobRef, CommitRecord, FragmentState, PruneRecord
from atoll.storage.replay import replay_chain
from atoll.storage.store import NotPlainObjectError, ObjectInfo, io_map
from atoll.storage.validation import InvalidInput, StorageError, TransientStorageError, validate_learner_id

__all__ = ["RetentionPolicy", "PrunePlan", "PruneItem", "plan_prune", "apply_prune", "key_class", "RetentionRefused",
           "NotPlainObjectError", "GLOBAL_STATE", "CONTRIBUTION", "LEARNER_PAYLOAD", "CHECKPOINT", "PROBE"]

GLOBAL_STATE = "global state"
CONTRIBUTION = "contribution record"
LEARNER_PAYLOAD = "learner payload"
CHECKPOINT = "checkpoint"
PROBE = "probe scratch"
CLASSES = (GLOBAL_STATE, CONTRIBUTION, LEARNER_PAYLOAD, CHECKPOINT, PROBE)

_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
_KEY_CLASSES = (
    (GLOBAL_STATE, re.compile(r"^(sync)/blobs/sha256/[0-9a-f]{64}\.safetensors$")),
    (CHECKPOINT, re.compile(r"^(sync)/checkpoints/\d{8,12}/(?:model\.safetensors|config\.json)$")),
    (LEARNER_PAYLOAD, re.compile(rf"^learners/({_ID})/blobs/sha256/[0-9a-f]{{64}}\.safetensors$")),
    (CONTRIBUTION, re.compile(rf"^learners/({_ID})/contributions/f\d{{4}}/b\d{{8}}/({_ID})\.s\d{{10}}\.[0-9a-f]{{16}}\.json$")),
    (PROBE, re.compile(rf"^(_probe)/{_ID}$")),
)


class RetentionRefused(StorageError):
    """Retention will not delete: a key whose name does not prove its class and owner, or an
    entry that is not a plain object (:class:`~atoll.storage.store.NotPlainObjectError`)."""


def key_class(key: str) -> tuple[str, str] | None:
    """(class, owner) of a key retention may delete, derived from the key's name alone: the class
    is one of :data:`CLASSES`; the owner is ``"sync"``, ``"_probe"`` or the learner id whose
    prefix holds it (a contribution's file name must name the same learner). None for any other
    key: retention never deletes it."""
    for what, pattern in _KEY_CLASSES:
        m = pattern.match(key)
        if m is None:
            continue
        owner = m.group(1)
        if what == CONTRIBUTION and m.group(2) != owner:
            return None  # a record named for another learner: not this owner's, never deleted
        if what in (CONTRIBUTION, LEARNER_PAYLOAD):
            try:
                validate_learner_id(owner)
            except InvalidInput:
                return None
        return what, owner
    return None


def _plain_files(infos: list[ObjectInfo], prefix: str, store_url: str) -> list[ObjectInfo]:
    """The entries of a folder that holds objects only: a folder among them is not a plain object."""
    for info in infos:
        if info.is_dir:
            raise NotPlainObjectError(f"{store_url}/{prefix}{info.name}", "a folder where only objects belong")
    return infos

@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """What retention (:func:`plan_prune`) keeps."""

    keep_rounds: int = 1000
    """Rounds at the head of the run whose global state stays readable (with the version of each
    fragment current when they began). At least 2 x P: a merge needs a fragment's current and
    previous version. Older rounds stay in the chain (their commit records are kept) but their
    state can no longer be read back: resume, fork and export from a later round or a checkpoint."""

    keep_checkpoints: int | None = None
    """Newest complete consolidated checkpoints to keep; None keeps every checkpoint."""

    min_age_s: float = 3600.0
    """An object nothing references is deleted only once it is this old (by the store's clock):
    it covers a writer between its payload and its record, and clock skew."""

    def check(self, num_fragments: int) -> None:
        """Raise ValueError naming the knob if this policy could delete something a run needs."""
        if self.keep_rounds < 2 * num_fragments:
            raise ValueError(f"keep_rounds must be at least 2 x P = {2 * num_fragments} for this run (P = "
                             f"{num_fragments}: a merge reads each fragment's current and previous version), "
                             f"got {self.keep_rounds}; raise keep_rounds (atoll prune --keep-rounds)")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 (or unset to keep all), got "
                             f"{self.keep_checkpoints}; raise keep_checkpoints (atoll prune --keep-checkpoints)")
        if not self.min_age_s >= 60.0:
            raise ValueError(f"min_age_s must be at least 60 s (a writer puts a payload before its record), "
                             f"got {self.min_age_s}; raise min_age_s (atoll prune --min-age-s)")


@dataclass(frozen=True)
class PruneItem:
    """One object to delete."""

    key: str
    what: str
    """One of :data:`CLASSES`."""
    size: int


@dataclass
class PrunePlan:
    """What :func:`plan_prune` found; :func:`apply_prune` carries it out."""

    latest: int
    """Latest committed round when the plan was made."""
    through_round: int
    """Rounds up to this one lose their global state."""
    floors: tuple[int, ...]
    """Per fragment, the oldest version whose state stays readable."""
    deletes: list[PruneItem] = field(default_factory=list)
    kept: Counter[str] = field(default_factory=Counter)
    """Objects kept, per class."""
    kept_bytes: Counter[str] = field(default_factory=Counter)
    young: int = 0
    """Unreferenced objects kept only because they are younger than ``min_age_s``."""
    skipped: list[Skipped] = field(default_factory=list)
    """What retention did not use, and why (a learner whose prefix holds a non-plain object, a
    checkpoint that does not verify): nothing it would have proven unreferenced is deleted."""

    def deleted(self, what: str) -> tuple[int, int]:
        """(objects, bytes) this plan deletes of class ``what``."""
        items = [d for d in self.deletes if d.what == what]
        return len(items), sum(d.size for d in items)

    @property
    def bytes(self) -> int:
        return sum(d.size for d in self.deletes)

    def table(self) -> list[str]:
        """A plain-text table: per class, objects and bytes deleted and kept."""
        lines = [f"{'what':<22}{'delete':>10}{'bytes':>12}{'keep':>10}{'bytes':>12}", "-" * 66]
        for what in CLASSES:
            n, b = self.deleted(what)
            if n or self.kept[what]:
                lines.append(f"{what:<22}{n:>10}{_size(b):>12}{self.kept[what]:>10}{_size(self.kept_bytes[what]):>12}")
        total_kept = sum(self.kept.values())
        lines.append(f"{'total':<22}{len(self.deletes):>10}{_size(self.bytes):>12}{total_kept:>10}"
                     f"{_size(sum(self.kept_bytes.values())):>12}")
        lines += [f"skipped {s}" for s in self.skipped]
        return lines


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


class _Planner:
    def __init__(self, run: RunReader, policy: RetentionPolicy, now: float, log: Callable[[str], None]) -> None:
        self.run, self.policy, self.now, self.log = run, policy, now, log
        self.store = run.store

    def old_enough(self, info: ObjectInfo) -> bool:
        # Unknown age: keep (a backend that reports no time cannot prove an object is old).
        return info.modified_s is not None and self.now - info.modified_s >= self.policy.min_age_s

    def keep(self, plan: PrunePlan, what: str, info: ObjectInfo) -> None:
        plan.kept[what] += 1
        plan.kept_bytes[what] += info.size

    def unreferenced(self, plan: PrunePlan, key: str, what: str, info: ObjectInfo) -> None:
        if self.old_enough(info):
            plan.deletes.append(PruneItem(key, what, info.size))
        else:
            plan.young += 1
            self.keep(plan, what, info)

    def plan(self) -> PrunePlan:
        run, policy = self.run, self.policy
        num_fragments = run.plan.num_fragments
        policy.check(num_fragments)
        latest = run.latest_round()
        start = max(1, latest - policy.keep_rounds + 1)  # first round whose state stays readable
        through = start - 1
        # The versions current when the window began are kept too; they and every version the
        # window's rounds wrote are what stays readable.
        before = self.state_table(through)
        floors = [st.version for st in before]
        kept_shas = {b.sha256 for b in run.manifest.initial}
        kept = {(p, st.version): st for p, st in enumerate(before)}
        for i, r in enumerate(range(start, latest + 1)):
            rec = self.commit(r)
            if rec is None:  # pragma: no cover - latest_round() said it is committed
                continue
            kept.update(((p, st.version), st) for p, st in enumerate(rec.state))
            if i and i % 500 == 0:
                self.log(f"  read {i} of {latest - start + 1} commit records in the window")
        # A master rebuilt by replay needs the written pair its chain starts from and the
        # contributions merged since: the fragment's floor goes down to the older of that pair.
        for (p, _), st in list(kept.items()):
            for held in self.replay_start(p, st):
                kept[(p, held.version)] = held
                floors[p] = min(floors[p], held.version)
        for (p, version), st in kept.items():
            kept_shas.update(ref.sha256 for ref in st.refs())
            kept_shas.update(ref.sha256 for ref in self.view_chain_refs(p, version, st))
        plan = PrunePlan(latest=latest, through_round=through, floors=tuple(floors))
        self.global_state(plan, kept_shas)
        self.checkpoints(plan)
        for prefix in (paths.SYNC_PREFIX, f"{paths.SYNC_PREFIX}blobs/"):
            self.store.list_plain(prefix)  # a link among the synchronizer's own folders refuses the prune
        learners = run.learner_ids()
        self.log(f"  global state: {plan.deleted(GLOBAL_STATE)[0]} objects to delete; "
                 f"looking at {len(learners)} learner(s)")
        for part in io_map(lambda lid: self.learner_or_skip(lid, plan.floors), learners):
            plan.deletes.extend(part.deletes)
            plan.kept.update(part.kept)
            plan.kept_bytes.update(part.kept_bytes)
            plan.young += part.young
            plan.skipped.extend(part.skipped)
        for info in self.files(paths.PROBE_PREFIX):
            self.unreferenced(plan, paths.PROBE_PREFIX + info.name, PROBE, info)
        return plan

    def commit(self, round_: int) -> CommitRecord | None:
        """A commit record of the window; a void slot stops retention (what it named is unknown,
        so nothing can be proven unreferenced)."""
        try:
            return self.run.read_commit(round_)
        except IntegrityError as e:
            raise RetentionRefused(f"round {round_}'s commit slot is void ({e.what}); retention cannot prove what "
                                   f"it referenced: run atoll verify, and prune once the slot is repaired") from None

    def replay_start(self, p: int, st: FragmentState) -> tuple[FragmentState, ...]:
        """For a version whose master is rebuilt by replay: the written pair its chain starts
        from (the version before the start, and the start); else nothing."""
        if st.master_written:
            return ()
        try:
            chain = replay_chain(self.run, p, st.version)
        except InvalidInput as e:
            raise RetentionRefused(f"fragment {p} v{st.version}'s master does not chain to a written pair ({e}); "
                                   f"retention cannot prove what it needs: run atoll verify") from None
        return chain.before, chain.start

    def view_chain_refs(self, p: int, version: int, st: FragmentState) -> list[BlobRef]:
        """The objects that rebuild the view of a kept version that publishes none of its own:
        its snapshot's view and the updates after it (below the floor too: they stay)."""
        if st.downlink is None or st.downlink.view is not None:
            return []
        try:
            return self.run.view_chain(p, version).refs
        except InvalidInput as e:
            raise RetentionRefused(f"fragment {p} v{version}'s view does not chain to a snapshot ({e}); retention "
                                   f"cannot prove what it needs: run atoll verify") from None

    def state_table(self, round_: int) -> tuple[FragmentState, ...]:
        if round_ == 0:
            return tuple(FragmentState(version=0, params=b) for b in self.run.manifest.initial)
        rec = self.commit(round_)
        if rec is None:
            raise RetentionRefused(f"round {round_} is not committed in {self.run.url}")
        return rec.state

    def files(self, prefix: str) -> list[ObjectInfo]:
        """The plain objects of a folder that holds objects only (refuses links, FIFOs, folders)."""
        return _plain_files(self.store.list_plain(prefix), prefix, self.store.url)

    def global_state(self, plan: PrunePlan, kept_shas: set[str]) -> None:
        prefix = paths.blobs_prefix()
        for info in self.files(prefix):
            sha = paths.parse_blob_name(info.name)
            if sha is None:
                continue  # not a payload of ours: retention deletes only what it understands
            if sha in kept_shas:
                self.keep(plan, GLOBAL_STATE, info)
            else:
                # Referenced only by rounds before the window, or by nothing yet (a synchronizer
                # between its payloads and its commit: that one is young, and kept).
                self.unreferenced(plan, prefix + info.name, GLOBAL_STATE, info)

    def checkpoints(self, plan: PrunePlan) -> None:
        """Keep the newest ``keep_checkpoints`` checkpoints that verify (:func:`checked_checkpoint`:
        a config whose seal, and signature where the run has a key, verifies, for this run and
        round, with its model file at the size it names); older ones that verify go, and so do
        ones that do not, once old enough (being written, or abandoned). A folder holding
        something that is not a plain object is skipped: nothing in it is deleted or counted."""
        rounds = self.run.list_checkpoints()
        self.store.list_plain(paths.checkpoints_prefix())  # no link, FIFO or device among the folders
        folders: dict[int, list[ObjectInfo]] = {}
        for r in rounds:
            try:
                folders[r] = self.files(paths.checkpoints_prefix() + f"{r:08d}/")
            except NotPlainObjectError as e:
                plan.skipped.append(Skipped(paths.checkpoints_prefix() + f"{r:08d}/", RejectionKind.CORRUPT,
                                            f"not counted, nothing in it deleted: {e}"[:MAX_WHY_CHARS]))
        rounds = [r for r in rounds if r in folders]
        keep_n = self.policy.keep_checkpoints
        complete: list[int] = []
        if keep_n is not None:  # None keeps every one: nothing to verify
            for r in rounds:
                got = checked_checkpoint(self.run, r, {i.name: i.size for i in folders[r]})
                if isinstance(got, Skipped):
                    plan.skipped.append(got)
                    self.log(f"  checkpoint {r} does not verify, not counted: {got.why}")
                else:
                    complete.append(r)
        keep = set(rounds) if keep_n is None else set(complete[-keep_n:])  # None: every one (counted)
        for r in rounds:
            prefix = paths.checkpoints_prefix() + f"{r:08d}/"
            for info in folders[r]:
                if r in keep:
                    self.keep(plan, CHECKPOINT, info)
                elif r in complete:  # superseded by newer complete ones: delete whatever its age
                    plan.deletes.append(PruneItem(prefix + info.name, CHECKPOINT, info.size))
                else:  # incomplete: being written now, or abandoned by a killed synchronizer
                    self.unreferenced(plan, prefix + info.name, CHECKPOINT, info)

    def learner_or_skip(self, learner_id: str, floors: tuple[int, ...]) -> PrunePlan:
        """One learner's part of the plan, or, where its prefix holds something that is not a
        plain object (a link on the way, a FIFO, a folder where objects belong) or cannot be
        listed, an empty part that names it as skipped: none of that learner's objects is
        deleted, and every other learner's prune carries on (one learner's prefix is its own to
        spoil, never the run's)."""
        try:
            for prefix in (paths.learner_prefix(learner_id), f"{paths.learner_prefix(learner_id)}blobs/",
                           paths.learner_contributions_prefix(learner_id)):
                self.store.list_plain(prefix)
            return self.learner(learner_id, floors)
        except TransientStorageError:
            raise
        except (StorageError, OSError) as e:
            part = PrunePlan(latest=0, through_round=0, floors=floors)
            why = f"{type(e).__name__}: {e}"[:MAX_WHY_CHARS]
            part.skipped.append(Skipped(paths.learner_prefix(learner_id), RejectionKind.CORRUPT,
                                        f"none of this learner's objects is deleted: {why}"))
            self.log(f"  {learner_id}: skipped ({why}); none of its objects is deleted")
            return part

    def learner(self, learner_id: str, floors: tuple[int, ...]) -> PrunePlan:
        part = PrunePlan(latest=0, through_round=0, floors=floors)
        kept16: set[str] = set()
        for p, floor in enumerate(floors):
            fprefix = paths.learner_contributions_prefix(learner_id, p)
            for folder in self.store.list_plain(fprefix):
                base = paths.parse_base_folder(folder.name)
                if base is None or not folder.is_dir:
                    continue
                bprefix = f"{fprefix}{folder.name}/"
                for info in self.files(bprefix):
                    # Below the floor: never listed again by any synchronizer. Only what its name
                    # proves to be this learner's contribution record goes.
                    if base < floor and key_class(bprefix + info.name) == (CONTRIBUTION, learner_id):
                        part.deletes.append(PruneItem(bprefix + info.name, CONTRIBUTION, info.size))
                    else:
                        self.keep(part, CONTRIBUTION, info)
                        sha16 = paths.parse_contribution_sha16(info.name)
                        if sha16 is not None:
                            kept16.add(sha16)
        # The state it rejoins from (read after the listing above and before the blob listing
        # below: a state saved meanwhile points at a blob the listing shows as young).
        state_sha, keep_all = None, False
        try:
            saved = self.run.load_learner_state_record(learner_id)
            state_sha = saved.payload.sha256 if saved is not None else None
        except Exception as e:  # noqa: BLE001 - an unreadable state.json: keep every blob of this learner
            self.log(f"  {learner_id}: state.json unreadable ({e}); none of its payloads is deleted")
            keep_all = True
        bprefix = paths.blobs_prefix(learner_id)
        for info in self.files(bprefix):
            sha = paths.parse_blob_name(info.name)
            if sha is None:
                continue
            if keep_all or sha == state_sha or sha[:16] in kept16:
                self.keep(part, LEARNER_PAYLOAD, info)
            else:
                self.unreferenced(part, bprefix + info.name, LEARNER_PAYLOAD, info)
        return part


def plan_prune(run: RunReader, policy: RetentionPolicy | None = None, *, now: float | None = None,
               log: Callable[[str], None] = lambda s: None) -> PrunePlan:
    """Decide what retention deletes in ``run`` (reads only)."""
    return _Planner(run, policy or RetentionPolicy(), time.time() if now is None else now, log).plan()


def _prove(plan: PrunePlan) -> None:
    """Every key the plan deletes must prove its class and owner by its name alone
    (:func:`key_class`); one that does not stops the prune before anything is written."""
    for item in plan.deletes:
        got = key_class(item.key)
        if got is None or got[0] != item.what:
            raise RetentionRefused(f"retention refuses to delete {item.key!r} as a {item.what}: its name "
                                   f"{'is no class retention deletes' if got is None else 'says ' + got[0]}")


def apply_prune(run: OperatorStore, plan: PrunePlan, *, by: str = "atoll prune",
                log: Callable[[str], None] = lambda s: None, chunk: int = 1000) -> PruneRecord:
    """Carry out ``plan``: prove every key's class and owner from its name (:class:`RetentionRefused`
    otherwise), write the retention record, then delete (checkpoint configs before their model
    files, so no checkpoint ever looks complete without its model). On a local folder nothing is
    deleted through a link or that is not a regular file (:class:`NotPlainObjectError`)."""
    _prove(plan)
    old, _ = run.read_prune_record()
    floors = tuple(max(a, b) for a, b in zip(plan.floors, old.floors, strict=True)) if old else plan.floors
    through = max(plan.through_round, old.through_round) if old else plan.through_round
    prior_n, prior_b = (old.deleted_objects, old.deleted_bytes) if old else (0, 0)
    record = PruneRecord(through_round=through, floors=floors, pruned_at=time.time(), by=by,
                         deleted_objects=prior_n, deleted_bytes=prior_b)
    run.write_prune_record(record)
    configs = [d for d in plan.deletes if d.key.endswith("/config.json") and d.what == CHECKPOINT]
    config_keys = {d.key for d in configs}
    rest = [d for d in plan.deletes if d.key not in config_keys]
    done = 0
    for batch in (configs, rest):
        keys = [d.key for d in batch]
        for i in range(0, len(keys), chunk):
            run.store.delete_many(keys[i:i + chunk], chunk=chunk)
            done += len(keys[i:i + chunk])
            log(f"  deleted {done} of {len(plan.deletes)} objects")
    # A local folder keeps an empty directory per checkpoint and per contribution base version.
    for folder in sorted({d.key.rsplit("/", 1)[0] for d in plan.deletes if d.what in (CHECKPOINT, CONTRIBUTION)}):
        run.store.remove_empty_folder(folder)
    record = PruneRecord(through_round=through, floors=floors, pruned_at=record.pruned_at, by=by,
                         deleted_objects=prior_n + len(plan.deletes), deleted_bytes=prior_b + plan.bytes)
    run.write_prune_record(record)
    return record

