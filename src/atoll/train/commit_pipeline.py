"""Pipelined commits: round r + 1 polls, decodes and merges while round r is still being written.

A round's commit is mostly encoding and writing: the compressed downlink update against the
learners' view (:class:`PendingDownlink`), finite checks, safetensors serialization, sha256 and
the blob writes of the new fp32 master, its momentum and the update, then the commit record. Rounds of different fragments are independent, so the synchronizer's loop hands each
merged round (a :class:`ClosedRound`) to a :class:`CommitPipeline` and goes on to the next one.
The ordering rules that keep a pipelined run's bucket exactly what a sequential run writes:

1. **Records in round order, one at a time.** One committer thread creates the records in the
   order the rounds were handed over: round r's record names round r - 1's (``prev_sha256``) and
   carries its state table forward, so it is created only once r - 1's has landed. Records stay
   create-once (:meth:`~atoll.storage.synchronizer_side.SynchronizerStore.commit_round`).
2. **Payloads before the record that names them.** A round's payloads
   (its downlink step, then
   :meth:`~atoll.storage.synchronizer_side.SynchronizerStore.write_round_payloads`: checks,
   serialization, sha256 and the blob writes, all blobs at once) start on a writer thread as soon
   as the round is handed over, and may be written while the previous round's record is still
   being created; the committer creates a round's record only after every payload it names is
   written (a store's put returns once the object is stored).
3. **A fragment's base first.** The loop does not open round r' until every handed-over round up
   to r' - P has landed (:meth:`CommitPipeline.wait_landed`): round r' merges fragment
   p = (r' - 1) mod P on its version from round r' - P or before, reads that version and the one
   before it from the bucket, and its payloads are written against that version's entry. With
   P = 1 there is nothing to overlap: every round waits for the one before it.
4. **Bounded.** At most ``depth`` rounds are in flight (their tensors are held until they land).
5. **The first failure stops the line.** If round r's commit fails (storage refused it, or another
   synchronizer won round r), no later round gets a record: those rounds were merged on a state the
   bucket does not hold. Their payloads may be written (blobs no record names; content-addressed,
   so harmless, and :mod:`atoll.storage.retention` removes them). The loop learns of it at its next
   look (:meth:`CommitPipeline.take`) and reloads from the bucket.

Crash safety follows from 1 and 2: whenever the process dies, the bucket holds the records of a
prefix of the handed-over rounds, each naming only durable payloads. A restarted synchronizer
reads the latest committed round and merges the next one again from the same contributions
(nothing that was never recorded consumed them), so it commits what an uninterrupted run commits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from atoll.core.downlink import DownlinkStep
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.quorum import QuorumDecision, TimingEma
from atoll.core.rejection import Rejection
from atoll.core.synchronize import FragmentRoundResult
from atoll.storage.records import AcceptedContribution
from atoll.storage.synchronizer_side import CommitResult, RoundPayloads, SynchronizerStore
from atoll.storage.validation import RoundOrderError

__all__ = ["ClosedRound", "CommitPipeline", "Landed", "PendingDownlink", "PIPELINE_DEPTH"]

PIPELINE_DEPTH = 2
"""Rounds in flight at most: one creating its record while the next one writes its payloads."""


class PendingDownlink:
    """A round's downlink step (the compressed update against the learners' view, and the view it
    leads to), computed once, by the first thread that asks: a pipelined commit's payload writer,
    so the encoding runs beside the next round's merge. Nothing on the loop's path needs it
    sooner: the next round of the same fragment, the first to read its view, opens only once this
    round has landed (rule 3), and this round's record counts its bytes from the shapes."""

    def __init__(self, compute: Callable[[], DownlinkStep]) -> None:
        self._compute: Callable[[], DownlinkStep] | None = compute
        self._step: DownlinkStep | None = None
        self._lock = threading.Lock()

    def result(self) -> DownlinkStep:
        """The step, computed here if no thread has yet."""
        with self._lock:
            if self._step is None:
                assert self._compute is not None
                self._step, self._compute = self._compute(), None
            return self._step

    def done(self) -> bool:
        """Whether the step was computed (then :meth:`result` returns at once)."""
        with self._lock:
            return self._step is not None


@dataclass
class ClosedRound:
    """A merged round, everything its commit record and the synchronizer's next state need."""

    round: int
    fragment: int
    after: int
    """The round whose state table holds the fragment's entry before this round (its version)."""
    result: FragmentRoundResult | None
    """The merge (None: nothing merged, the record carries no new version)."""
    optimizer: NesterovOuterOptimizer
    downlink: PendingDownlink | None
    """The new version's downlink step (None: an fp32 downlink, or nothing merged)."""
    downlink_chained: bool
    accepted: list[AcceptedContribution]
    rejected: dict[str, Rejection]
    """What the record lists of the round's rejections."""
    unlisted: dict[str, Rejection]
    """Rejections only counted in the record's stats (still used up in this process)."""
    timings: TimingEma
    stats: dict[str, Any]
    committed_by: str
    checkpoint: bool
    """Write a consolidated checkpoint once this round has landed."""
    decision: QuorumDecision
    phases: dict[str, float | None] = field(default_factory=dict)
    """The round's phases on the synchronizer's clock (``committed_at_s`` set when it lands)."""
    state_copy: dict[str, Any] | None = None
    """The whole model after this round, copied at its merge, for its checkpoint (None: read
    from the bucket); used only if it hashes to what the record names."""
    replay_masters: bool = True
    """Whether readers may rebuild this version's master by replaying the merge (a CPU merge):
    else it is written whatever ``DilocoConfig.master_snapshot_every`` says."""

    def commit(self, store: SynchronizerStore, payloads: RoundPayloads | None = None) -> CommitResult:
        """Commit this round: with ``payloads`` already written, only the record; else all of it."""
        fields: dict[str, Any] = {"accepted": self.accepted, "rejected": self.rejected,
                                  "timings": self.timings.to_dict(), "stats": self.stats,
                                  "committed_by": self.committed_by}
        if payloads is not None or self.result is None:
            return store.commit_round(self.round, self.fragment, params=None, payloads=payloads, **fields)
        return store.commit_round(self.round, self.fragment, params=self.result.new_params,
                                  momentum=self.optimizer.state_dict(), downlink=self._downlink_step(),
                                  downlink_chained=self.downlink_chained, replay_masters=self.replay_masters,
                                  **fields)

    def write_payloads(self, store: SynchronizerStore) -> RoundPayloads | None:
        """The new version's payloads, written and not yet named (None: no new version)."""
        if self.result is None:
            return None
        return store.write_round_payloads(self.round, self.fragment, params=self.result.new_params,
                                          momentum=self.optimizer.state_dict(), downlink=self._downlink_step(),
                                          downlink_chained=self.downlink_chained, after=self.after,
                                          replay_masters=self.replay_masters)

    def _downlink_step(self) -> DownlinkStep | None:
        return None if self.downlink is None else self.downlink.result()


@dataclass(frozen=True)
class Landed:
    """A handed-over round that is done: committed (``result.won``), lost to another synchronizer
    (``not result.won``: ``result.record`` is the winner's), or failed (``error``)."""

    closed: ClosedRound
    result: CommitResult | None
    error: BaseException | None
    at_s: float


@dataclass
class _Job:
    closed: ClosedRound
    payloads: Future[RoundPayloads | None]


class CommitPipeline:
    """A writer pool for payloads and one committer thread for records (the module's rules)."""

    def __init__(self, store: SynchronizerStore, *, depth: int = PIPELINE_DEPTH,
                 clock: Callable[[], float] = time.monotonic,
                 on_landed: Callable[[Landed], None] | None = None,
                 before_commit: Callable[[int, Callable[[], bool]], bool] | None = None) -> None:
        self.store, self.depth, self.clock = store, max(1, depth), clock
        self.on_landed = on_landed
        """Called on the committer thread as each round lands (before :meth:`take` returns it)."""
        self.before_commit = before_commit
        """Called on the committer thread with a round (and whether the pipeline was reset or
        closed since) before its record is created: a split synchronizer's merger waits there for
        the other groups' rounds before it (rule 1). False: cancelled, the round is dropped."""
        self._writer = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="atoll-payloads")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._in_flight: list[int] = []
        self._done: deque[Landed] = deque()
        self._broken = False
        """A round failed or was lost: rounds after it are dropped until :meth:`reset`."""
        self._committer = threading.Thread(target=self._run, name="atoll-committer", daemon=True)
        self._committer.start()

    def submit(self, closed: ClosedRound) -> None:
        """Hand over a merged round (after every round before it); waits while ``depth`` are in
        flight. Dropped if an earlier round failed and the loop has not :meth:`reset` yet."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._in_flight) < self.depth or self._broken)
            if self._broken:
                return
            self._in_flight.append(closed.round)
        self._jobs.put(_Job(closed, self._writer.submit(self._write, closed)))

    def _write(self, closed: ClosedRound) -> RoundPayloads | None:
        return None if self._broken else closed.write_payloads(self.store)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            landed = None if self._broken else self._commit(job)
            if landed is not None and self.on_landed is not None:
                try:
                    self.on_landed(landed)
                except Exception:  # noqa: BLE001 - a listener's failure must not stop the commits
                    pass
            with self._cond:
                self._in_flight.remove(job.closed.round)
                if landed is not None:
                    self._done.append(landed)
                    self._broken = landed.error is not None or not (landed.result and landed.result.won)
                self._cond.notify_all()

    def _commit(self, job: _Job) -> Landed:
        closed = job.closed
        try:
            payloads = job.payloads.result()
            if self.before_commit is not None and not self.before_commit(closed.round, lambda: self._broken):
                raise RoundOrderError(f"round {closed.round} dropped: the commit pipeline stopped while it waited")
            result = closed.commit(self.store, payloads)
            if result.won and closed.checkpoint:
                self.store.write_checkpoint(closed.round, params=closed.state_copy)
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which decides
            return Landed(closed, None, e, self.clock())
        landed = Landed(closed, result, None, self.clock())
        closed.phases["committed_at_s"] = landed.at_s
        return landed

    def in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def take(self) -> list[Landed]:
        """The rounds done since the last call, in round order (a failure or loss comes last)."""
        with self._cond:
            out = list(self._done)
            self._done.clear()
            return out

    def wait_landed(self, through: int) -> None:
        """Wait until no round up to ``through`` is in flight (or one failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._broken or not any(r <= through for r in self._in_flight))

    def drain(self) -> None:
        """Wait until nothing is in flight (or a round failed: the rest are dropped)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight)

    def reset(self) -> None:
        """Drop every round not yet committed and what is done but not taken; accept rounds again
        (the loop reloads its state from the bucket first)."""
        with self._cond:
            self._broken = True
            self._cond.wait_for(lambda: not self._in_flight)
            self._done.clear()
            self._broken = False

    def close(self) -> None:
        """Stop the threads: rounds not yet committed are dropped, as if the process ended here."""
        with self._cond:
            self._broken = True
        self._jobs.put(None)
        self._committer.join()
        self._writer.shutdown(wait=True)
