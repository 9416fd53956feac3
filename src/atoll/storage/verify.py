"""``atoll verify``: what a walk of a run's whole commit chain found (:class:`VerifyReport`), and the
checks of each round's state objects and of the listed commit slots (docs/protocol.md section 8).
The walk itself is :meth:`RunReader.verify <atoll.storage.reader.RunReader.verify>`. Reads only."""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.storage import paths
from atoll.storage.handle import RunHandle
from atoll.storage.records import BlobRef, CommitRecord, FragmentState, PruneRecord
from atoll.storage.validation import InvalidInput, StorageError, TransientStorageError
from atoll.storage.views import view_chain

__all__ = ["VerifyReport", "verify_state", "verify_slots"]


@dataclass
class VerifyReport:
    """What :meth:`RunReader.verify <atoll.storage.reader.RunReader.verify>` found."""

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

    def check_blob(self, store: RunHandle, ref: BlobRef, what: str) -> None:
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


def verify_state(run: RunHandle, report: VerifyReport, r: int, rec: CommitRecord, seen: set[str],
                 entries: dict[tuple[int, int], FragmentState] | None = None) -> None:
    """Check every state object round ``r`` publishes (once per sha256; ``seen`` holds the
    checked ones, and ``pruned:<sha256>`` for those counted as pruned), except those retention
    may have deleted. ``entries``: the entry of every version walked so far, by
    (fragment, version); with it, a version that publishes no view of its own is checked to
    chain down to a snapshot (:func:`~atoll.storage.views.view_chain`), and the objects of that
    chain are checked too."""
    if entries is not None and rec.updated:
        entries[(rec.fragment, r)] = rec.state[rec.fragment]
    for p, st in enumerate(rec.state):
        refs = st.refs()
        if report.prune is not None and report.prune.may_be_pruned(p, st.version):
            # Counted once, and still checked where a kept version's view chain needs it.
            uncounted = [b for b in refs if b.sha256 not in seen and f"pruned:{b.sha256}" not in seen]
            report.pruned += len(uncounted)
            seen.update(f"pruned:{b.sha256}" for b in uncounted)
            continue  # deleted on purpose by retention, not lost
        for blob in refs:
            if blob.sha256 not in seen:
                seen.add(blob.sha256)
                report.check_blob(run, blob, f"round {r} state")
        if entries is not None and st.version == r and st.downlink is not None and st.downlink.view is None:
            _check_view_chain(run, report, p, st, entries, seen)


def _check_view_chain(run: RunHandle, report: VerifyReport, p: int, st: FragmentState,
                      entries: dict[tuple[int, int], FragmentState], seen: set[str]) -> None:
    """Version ``st.version`` of fragment ``p`` publishes only its update: its chain must reach a
    snapshot through versions the walk has seen, and every object on it must read."""
    def state_of(v: int) -> FragmentState:
        if v == 0:
            return FragmentState(version=0, params=run.manifest.initial[p])
        found = entries.get((p, v))
        if found is None:
            raise InvalidInput("missing_payload", f"v{v} was not published by a verified round")
        return found
    what = f"fragment {p} v{st.version}'s view"
    try:
        chain = view_chain(p, st.version, state_of)
    except InvalidInput as e:
        report.problems.append(f"round {st.version} state: {what} cannot be rebuilt: {e}")
        return
    for blob in chain.refs:
        if blob.sha256 not in seen:
            seen.add(blob.sha256)
            report.check_blob(run, blob, f"round {st.version} state: {what} (from v{chain.snapshot})")


def verify_slots(run: RunHandle, report: VerifyReport) -> None:
    """List ``sync/commits/`` and ``sync/repairs/``: every slot past the walk's end is a gap
    (its round cannot be reached from run.json), and every entry that is not a slot is named."""
    commits: set[int] = set()
    for name in run.store.list(paths.commits_prefix()):
        n = paths.parse_commit_key(name)
        if n is None or n < 1:
            report.problems.append(f"{paths.commits_prefix()}{name}: not a commit slot")
        else:
            commits.add(n)
    slots = set(commits)
    for name in run.store.list(f"{paths.SYNC_PREFIX}repairs/"):
        if name.isascii() and name.isdigit() and len(name) == 8 and int(name) >= 1:
            slots.add(int(name))
    beyond = sorted(n for n in slots if n > report.latest)
    if beyond:  # the walk ended at a round with no commit object, and later rounds are stored
        report.gaps = [n for n in range(report.latest + 1, beyond[-1] + 1) if n not in commits]
        report.problems.append(f"gap in the chain: round(s) {_ranges(report.gaps)} missing, yet "
                               f"round(s) {_ranges(beyond)} are stored after them (not reachable from run.json)")
    report.slots = len(slots)
