"""The commit chain as every role reads it: :class:`CommitChain` (verified commit records, void
slots and their repairs, the latest round, the state table; docs/protocol.md section 8).

A commit record is trusted only once it verifies: it parses, matches its digest, links to the
previous round's bytes (round 1: to ``run.json``'s) and, where the handle holds the
synchronizer's key, carries its signature. A slot whose object fails that is *void*: readers
skip it, and the synchronizer's repair record for the round stands in for it.
"""

from __future__ import annotations

from atoll.core.rejection import RejectionKind
from atoll.storage import paths
from atoll.storage.codec import load_record, sha256_hex
from atoll.storage.handle import MAX_COMMIT_BYTES, MAX_HEAD_BYTES, RunHandle
from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, IntegrityError, check_seal
from atoll.storage.reading import Skipped, skip_of
from atoll.storage.records import KIND_COMMIT, KIND_HEAD, KIND_RUN, CommitRecord, FragmentState, RunManifest
from atoll.storage.validation import InvalidInput, RoundOrderError, TransientStorageError

__all__ = ["CommitChain"]

CHAIN_CACHE_ENTRIES = 4096
"""Verified commit records (and their sha256) one handle keeps."""


class CommitChain(RunHandle):
    """A run handle that reads the commit chain: ``sync/commits/<round>.json``, verified and linked
    round by round, and ``sync/repairs/<round>/`` for a void slot. Writes nothing; the records
    and links it has verified are cached (they are immutable)."""

    @property
    def skipped(self) -> list[Skipped]:
        """Void slots readers stepped over (the newest 100; :meth:`readable_commit`), for logs and tests."""
        return self._cache.skipped

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
        key = self._verifier(SYNCHRONIZER_KEY_ID)  # an Ed25519 run.json was checked when it was read
        problem: IntegrityError | None = None
        if key is not None:
            try:
                check_seal(KIND_RUN, self._cache.manifest_body or {}, url=url, key=key)
                return manifest
            except IntegrityError as e:
                problem = e
        try:
            first = self.read_commit(1)  # verifies prev_sha256 against run.json's bytes
        except IntegrityError as e:
            if problem is not None or self._names_other_manifest():
                # A sealed round 1 that names other bytes: run.json was rewritten (or round 1 forged).
                raise IntegrityError(f"run.json does not match the chain (round 1 does not link to it): {e.what}",
                                     url) from None
            # Round 1's slot is void (damaged, destroyed): it proves nothing either way, exactly
            # as before round 1 was committed. The run goes on; the void slot is reported.
            self._note_void(1, f"round 1 is void ({e.what}); run.json was checked against no commit")
            return manifest
        if first is None and problem is not None:
            raise problem
        return manifest

    # -- one slot ----------------------------------------------------------------------------
    def read_commit(self, round_: int) -> CommitRecord | None:
        """The verified committed record of ``round_`` (one GET; cached), or None if not committed.

        The record must parse, match its digest, link to the previous commit this handle holds
        (``prev_sha256``; round 1 links to ``run.json``) and, when the keyring has the
        synchronizer's key, carry its signature. If the record at ``sync/commits/<round>.json``
        fails any of that, the slot is void: the synchronizer's repair record for the round
        (``sync/repairs/<round>/``) is used if one verifies, else :class:`IntegrityError` is
        raised naming the object. A void slot is never used.
        """
        cached = self._cache.commits.get(round_)
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
        sync_key = self._verifier(SYNCHRONIZER_KEY_ID)
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
        self._remember(record, data)
        return record

    def _links_to_stored(self, round_: int, sha: str) -> bool:
        """Whether a record naming ``sha`` as its predecessor may follow round ``round_``: True if
        the bytes stored for ``round_`` (its slot or a repair) hash to ``sha``, or if its slot holds
        only objects that are not sealed commit records (destroyed: the link cannot be checked,
        and that slot is reported void on its own). False if nothing is stored for ``round_`` or
        a sealed record is stored there with other bytes."""
        found, shas, sealed_prevs = self._stored_slot(round_)
        return sha in shas or (found and not sealed_prevs)

    def _names_other_manifest(self) -> bool:
        """Whether round 1's slot or a repair holds a sealed commit record (its digest matches)
        that links to other bytes than run.json's: evidence that run.json was rewritten, where a
        damaged or destroyed round 1 is evidence of nothing."""
        _ = self.manifest
        return any(prev != self._cache.manifest_sha for prev in self._stored_slot(1)[2])

    def _stored_slot(self, round_: int) -> tuple[bool, set[str], list[object]]:
        """What is stored for round ``round_`` (its slot and repairs), read through the capped
        reader: (anything there, the sha256 of each readable object, the ``prev_sha256`` of each
        one that is a sealed commit record)."""
        keys = [paths.commit_key(round_)]
        keys += [paths.repairs_prefix(round_) + n for n in self.store.list(paths.repairs_prefix(round_))]
        found = False
        shas: set[str] = set()
        sealed: list[object] = []
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
            shas.add(sha256_hex(data))
            try:
                body = load_record(data, KIND_COMMIT)
                check_seal(KIND_COMMIT, body, url=key)
                sealed.append(body.get("prev_sha256"))
            except Exception:  # noqa: BLE001 - not a sealed commit record
                continue
        return found, shas, sealed

    def _note_void(self, round_: int, why: str) -> None:
        """Note a void slot a reader stepped over in :attr:`skipped` (the newest 100)."""
        self._cache.skipped.append(Skipped(paths.commit_key(round_), RejectionKind.CORRUPT, why[:400]))
        del self._cache.skipped[:-100]

    def _expected_prev(self, round_: int) -> str | None:
        """The sha256 round ``round_``'s commit must name as ``prev_sha256``, if this handle knows
        it: ``run.json``'s for round 1, else the verified commit of round ``round_ - 1`` it holds."""
        if round_ == 1:
            _ = self.manifest  # reads run.json (and its sha) once
            return self._cache.manifest_sha
        return self._cache.commit_sha.get(round_ - 1)

    def _remember(self, record: CommitRecord, data: bytes) -> None:
        """Hold a verified (or just written) commit record and the sha256 of its bytes."""
        cache = self._cache
        cache.commit_sha[record.round] = sha256_hex(data)
        cache.commits[record.round] = record
        for held in (cache.commits, cache.commit_sha):
            while len(held) > CHAIN_CACHE_ENTRIES:
                held.popitem(last=False)

    def _free_repair_key(self, round_: int) -> str:
        """The next unused repair slot of a void round (``sync/repairs/<round>/r<n>.json``)."""
        taken = set(self.store.list(paths.repairs_prefix(round_)))
        n = 1
        while paths.repair_key(round_, n).rsplit("/", 1)[-1] in taken:
            n += 1
        return paths.repair_key(round_, n)

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
            self._note_void(round_, e.what)
            return None

    _readable = readable_commit

    # -- the chain ---------------------------------------------------------------------------
    def latest_round(self) -> int:
        """Latest committed round (0 if none).

        The first call reads the ``head.json`` hint (or LISTs ``commits/`` if the hint is absent
        or wrong); every call then probes forward with GETs of the next commit keys, so a steady
        poll costs one GET and no LIST.
        """
        if self._cache.latest is None:
            self._cache.latest = self._first_latest()
        r = self._cache.latest
        while self._readable(r + 1) is not None:
            r += 1
        self._cache.latest = r
        return r

    def _first_latest(self) -> int:
        """Where :meth:`latest_round` starts probing: the ``head.json`` hint if its round verifies,
        else the newest listed commit slot that does (0 if none)."""
        try:
            hint = self._get_capped(paths.HEAD, MAX_HEAD_BYTES)
        except InvalidInput:
            hint = None  # a hint only
        if hint is not None:
            try:
                r = int(load_record(hint, KIND_HEAD).get("round", 0))
                if r >= 1 and self._readable(r) is not None:
                    return r
            except (InvalidInput, ValueError, TypeError):
                pass
        rounds = sorted(parsed for n in self.store.list(paths.commits_prefix())
                        if (parsed := paths.parse_commit_key(n)) is not None)
        # Walk down past anything that does not verify (a forged far-future round, say).
        while rounds and self._readable(rounds[-1]) is None:
            rounds.pop()
        return rounds[-1] if rounds else 0

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
        if out and (self._cache.latest is None or out[-1].round > self._cache.latest):
            self._cache.latest = out[-1].round
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
