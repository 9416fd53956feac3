"""How a learner's contributions and saves reach the bucket: now, or on a background thread.

A :class:`~atoll.train.learner.Learner` hands each due fragment to its outbox, and that is the
one place where the ways of writing differ:

* :class:`Outbox` writes in the training thread: the delta is taken, the lease is asked
  (``guard``), and the contribution is written before the step returns;
* :class:`BackgroundOutbox` takes the delta into a reused host buffer in the step and hands the
  write to a :class:`BackgroundWriter` thread, so the next inner steps overlap the bucket I/O;
  its periodic saves go to a :class:`SaveWriter`, one at a time, beside the contributions.

How the delta is taken (the whole model on this rank, or FSDP2 shards gathered on every rank) is
the learner's weights' business (:class:`~atoll.train.learner.Replica`,
:class:`~atoll.train.island.Shards`); an outbox only asks for it, into the buffer it offers.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atoll.core.weights import Counters
from atoll.storage.learner_side import LearnerStore

__all__ = ["BackgroundOutbox", "BackgroundWriter", "BufferPool", "Outbox", "Outgoing", "SaveWriter"]

TakeDelta = Callable[[torch.Tensor | None], dict[str, torch.Tensor] | None]
"""Take the due fragment's delta to the host, into the flat fp32 buffer given (or a new one);
None: another rank of the island writes it (this one only took part in a gather)."""


@dataclass(frozen=True)
class Outgoing:
    """One contribution, all but its delta: what the learner knows when a fragment is due."""

    learner_id: str
    """The learner publishing it."""

    fragment: int
    """The fragment due at this step."""

    base_version: int
    """The global version of the fragment the delta is taken against."""

    counters: Counters
    """Steps and tokens since that version was adopted (a snapshot)."""

    info: dict[str, Any]
    """Step, step time, pool and loss, for reports."""

    incarnation: int
    """The lease incarnation it is tagged with (0: no lease)."""

    numel: int
    """The fragment's size in elements (the delta buffer's size)."""

    def write(self, store: LearnerStore, delta: dict[str, torch.Tensor]) -> None:
        store.publish_contribution(self.learner_id, self.fragment, self.base_version, self.counters, delta,
                                   info=self.info, incarnation=self.incarnation)


class Outbox:
    """Writes each contribution and save in the training thread (the step waits for the bucket)."""

    background = False
    """Whether writes happen after the call returns (periodic saves are then snapshots)."""

    def __init__(self, store: LearnerStore) -> None:
        self.store = store

    def publish(self, outgoing: Outgoing, take_delta: TakeDelta, *, guard: Callable[[], bool] | None) -> bool:
        """Write one contribution; False when nothing was written (another rank writes it, or
        ``guard()`` said the lease is no longer ours)."""
        delta = take_delta(None)
        if delta is None:
            return False
        if guard is not None and not guard():
            return False  # fenced: nothing published
        outgoing.write(self.store, delta)
        return True

    def save(self, write: Callable[[LearnerStore], Any], *, guard: Callable[[], bool] | None) -> bool:
        """Write a save now (the caller has asked the lease); True: it was written."""
        write(self.store)
        return True

    @property
    def saving(self) -> bool:
        """Whether a save handed over earlier is still being written (never, here)."""
        return False

    def check(self) -> None:
        """Raise a failed background write in the training thread (nothing to raise here)."""

    def flush(self) -> None:
        """Wait for writes still in flight (none here)."""


class BackgroundOutbox(Outbox):
    """Takes each delta in the step into a reused host buffer and writes it on a background
    thread, in order; a failed write is raised from the next step (:meth:`check`)."""

    background = True

    def __init__(self, store: LearnerStore) -> None:
        super().__init__(store)
        self.writer = BackgroundWriter(store)
        self.saver = SaveWriter(store, contributions=self.writer)
        self.buffers = BufferPool()
        self.writer.start()

    def publish(self, outgoing: Outgoing, take_delta: TakeDelta, *, guard: Callable[[], bool] | None) -> bool:
        # A reused host buffer: a fresh one each publish costs page faults in the training thread
        # (a third of the publish there).
        buffer = self.buffers.take(outgoing.numel)
        if buffer is None:
            buffer = torch.empty(outgoing.numel, dtype=torch.float32)
        delta = take_delta(buffer)
        if delta is None:
            self.buffers.give(buffer)
            return False
        # Written in the background; the guard is asked right before the write, as in the step.
        self.writer.submit(functools.partial(outgoing.write, delta=delta), guard=guard,
                           done=functools.partial(self.buffers.give, buffer))
        return True

    def save(self, write: Callable[[LearnerStore], Any], *, guard: Callable[[], bool] | None) -> bool:
        """Write a save once the contributions submitted before it are written, guarded by the
        lease like them, on a thread of its own (:class:`SaveWriter`): contributions submitted
        after it are written meanwhile, not held up behind a save of the whole optimizer state.
        At most one save is in flight: False (nothing taken, nothing queued) while the previous
        one is still being written."""
        if self.saver.busy:
            return False
        reached = threading.Event()  # set once the writer has passed every contribution submitted before
        self.writer.submit(_nothing, done=reached.set)
        self.saver.start_save(write, guard=guard, after=reached)
        return True

    @property
    def saving(self) -> bool:
        return self.saver.busy

    def check(self) -> None:
        self.writer.check()
        self.saver.check()

    def flush(self) -> None:
        self.writer.flush()
        self.saver.flush()


class BackgroundWriter(threading.Thread):
    """Background writer of a learner's contributions: one at a time, in the order submitted (a
    save, written by a :class:`SaveWriter`, waits for a marker it submits here, so it never lands
    before the contributions submitted ahead of it).

    The training loop hands over jobs on host tensors and snapshots (nothing it mutates later);
    this thread encodes, hashes and writes them. The queue is bounded (backpressure when the
    bucket is slower than training); the first failure is kept and re-raised in the training
    thread by :meth:`check` (from the next submit or flush), and nothing after it is written.
    """

    def __init__(self, store: LearnerStore, *, depth: int = 2) -> None:
        super().__init__(daemon=True, name="atoll-publisher")
        self.store = store.sibling()  # own caches; the object store itself is shared
        self.jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=depth)
        self.failed: BaseException | None = None

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                # The guard (the lease is still ours) is asked right before the write, as in the step.
                if self.failed is None and (job.guard is None or job.guard()):
                    job.write(self.store)
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by check()
                self.failed = e
            finally:
                if job is not None and job.done is not None:
                    job.done()
                self.jobs.task_done()

    def submit(self, write: Callable[[LearnerStore], Any], *, guard: Callable[[], bool] | None = None,
               done: Callable[[], None] | None = None) -> None:
        """Queue ``write(store)``; ``done()`` runs after it, written or not (returns buffers)."""
        self.check()
        self.jobs.put(_Job(write, guard, done))

    def flush(self) -> None:
        """Wait until everything submitted is written (or failed); raise the failure."""
        self.jobs.join()
        self.check()

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed


def _nothing(store: LearnerStore) -> None:
    """A marker in the writer's queue: its ``done`` tells a save that what came before is written."""


class SaveWriter:
    """Writes a learner's periodic saves, one at a time, each on a thread of its own.

    A save waits until the :class:`BackgroundWriter` has passed every contribution submitted before
    it (a saved step never runs ahead of what the bucket holds from this learner), then writes
    while later contributions go on being written beside it. It is never queued: while one is in
    flight :attr:`busy` is true and the learner skips the save that falls due (its pacing, in
    :mod:`atoll.train.save_pacing`, takes the next one). The first failure is kept and re-raised in
    the training thread by :meth:`check`; nothing is written after a failed contribution."""

    def __init__(self, store: LearnerStore, *, contributions: BackgroundWriter) -> None:
        self.store = store.sibling()  # own caches; the object store itself is shared
        self.contributions = contributions
        self.failed: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A save is still being written (or waiting for the contributions ahead of it)."""
        return self._thread is not None and self._thread.is_alive()

    def start_save(self, write: Callable[[LearnerStore], Any], *, guard: Callable[[], bool] | None,
                   after: threading.Event) -> None:
        self.check()
        self._thread = threading.Thread(target=self._run, args=(write, guard, after), daemon=True, name="atoll-saver")
        self._thread.start()

    def _run(self, write: Callable[[LearnerStore], Any], guard: Callable[[], bool] | None,
             after: threading.Event) -> None:
        try:
            after.wait()
            # The guard (the lease is still ours) is asked right before the write, as for contributions.
            if self.contributions.failed is None and (guard is None or guard()):
                write(self.store)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by check()
            self.failed = e

    def flush(self) -> None:
        """Wait for the save in flight, if any; raise its failure."""
        if self._thread is not None:
            self._thread.join()
        self.check()

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed


@dataclass(frozen=True)
class _Job:
    write: Callable[[LearnerStore], Any]
    guard: Callable[[], bool] | None
    done: Callable[[], None] | None


class BufferPool:
    """Host buffers for deltas being written in the background, by size: taken in the training
    thread, given back by the writer once the delta is written (thread-safe: deque ops)."""

    def __init__(self) -> None:
        self._free: dict[int, collections.deque[torch.Tensor]] = collections.defaultdict(collections.deque)

    def take(self, numel: int) -> torch.Tensor | None:
        try:
            return self._free[numel].popleft()
        except IndexError:
            return None  # the caller allocates a new one, which comes back here after its write

    def give(self, buffer: torch.Tensor) -> None:
        self._free[buffer.numel()].append(buffer)
