"""Writing each round's artifacts and events off the synchronizer's critical path.

A round's commit is what makes the learners' work count; its artifacts are for people. So the
round flow (:mod:`atoll.flows.round`) only hands the committed round and its flow run id to the
run's :class:`RoundRecorder`, and goes on with the next round. A background thread of the
training-run process then, for every round, reads the commit record (and the contribution
records of what got weight 0) from the bucket and writes, **attached to that round's flow run**
(so the UI shows them on it, whenever they land), the round's markdown artifact
(:mod:`atoll.tasks.round_artifacts`), and emits the ``atoll.round.committed`` event
(:mod:`atoll.tasks.events`).

**Recorded rounds** (the round ran inline, with no flow run of its own): a second thread creates
the round's flow run Running when the round opens and sets it Completed when it commits
(:mod:`atoll.tasks.round_runs`), and the writer adds a task run per phase at its real times and
the round's log lines (:mod:`atoll.tasks.round_phases`), one ``POST /logs/`` a batch. The run's
``<run>-plots`` artifact is drawn every ``plots_every`` rounds and at the end.

When it falls behind
(rounds queue up), it takes them as one batch: first every round's flow run (recorded rounds),
which needs only the commit record, then the goodput so far (every contribution record of the run
since the last batch, read concurrently: a relaunched training run reads the whole run's), then
the artifacts and events. A batch that fails (the server or the bucket unwell) is tried again
after ``retry_s``, or with the next round, never dropped. The run's progress artifact and
the ``<run>-goodput`` markdown (the whole run's goodput, per learner) are updated at most every
``progress_every_s`` and after the last round, not every round: one API call per round in all
(three with recorded rounds, whose flow run the recorder opens and completes, plus the batch's
logs).

Nothing here is the truth (the bucket is), so nothing waits for it: the training run only waits
for the queue to drain (``flush``, bounded) before it reports its end, and rounds a killed training
run never recorded are recorded by the next one (:meth:`RoundRecorder.backfill`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any
from uuid import UUID

from atoll.runs.contributions import ContributionRow, contribution_rows
from atoll.runs.goodput import GoodputReport, GoodputTracker
from atoll.storage.reader import RunReader
from atoll.tasks.events import emit_round_committed
from atoll.tasks.round_artifacts import RunArtifacts
from atoll.tasks.round_phases import Phase, emit_phase_task_runs, round_log_lines
from atoll.tasks.round_runs import STOP, CommittedRound, OpenedRound, RoundFlowRuns, StateThread

__all__ = ["BACKFILL_ROUNDS", "CACHE_LIMIT", "RoundRecorder"]

log = logging.getLogger("atoll.recorder")

BACKFILL_ROUNDS = 100
"""Rounds per query when a recorded run looks, at its start, for committed rounds that have no
flow run (:meth:`RoundRecorder.backfill`)."""


STATES_FIRST_S = 5.0
"""Recorded rounds: how long the writer thread waits, at most, for the state thread to open and
complete the rounds queued for it before it writes its next batch (:meth:`RoundRecorder._yield_to_states`)."""

CACHE_LIMIT = 20_000
"""Contribution records the recorder's goodput tracker keeps in memory between batches (a chaos-soak
round names ~40, so a run of 10^5 rounds would otherwise hold millions)."""


class RoundRecorder:
    """A background writer of round artifacts and events for one run (see the module docstring)."""

    def __init__(self, store: RunReader, *, run_id: str, max_rounds: int, inner_steps: int,
                 progress_artifact_id: str | None = None, progress_every_s: float = 10.0,
                 tracker: GoodputTracker | None = None, run_flow_run_id: Any = None,
                 round_run_tags: list[str] | None = None, retry_s: float = 5.0, plots_every: int = 50) -> None:
        """``run_flow_run_id``: the training-run flow run, which the run-level goodput artifact is attached to.
        ``round_run_tags``: the tags of round flow runs this recorder creates itself (recorded
        rounds: a round submitted without a flow run id gets one, Completed, before its artifacts)."""
        self.store = store
        self.run_id = run_id
        self.tracker = tracker if tracker is not None else GoodputTracker(store)
        self.round_run_tags = list(round_run_tags) if round_run_tags is not None else None
        self.retry_s = retry_s
        """A failed write (server or bucket unwell) is tried again after this, or with the next round."""
        self.artifacts = RunArtifacts(store, self.tracker, run_id=run_id, max_rounds=max_rounds,
                                      inner_steps=inner_steps, progress_artifact_id=progress_artifact_id,
                                      progress_every_s=progress_every_s,
                                      run_flow_run_id=UUID(str(run_flow_run_id)) if run_flow_run_id else None,
                                      plots_every=plots_every)
        self.runs = RoundFlowRuns(store, run_id=run_id, tags=list(self.round_run_tags or []))
        self.last_goodput: GoodputReport | None = None
        self.recorded: list[int] = []
        """Rounds written, in order (tests)."""
        self.errors = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._states: StateThread | None = None

    # -- the training run's side ---------------------------------------------------------------
    def start(self) -> RoundRecorder:
        """Start the writer thread; it runs in a copy of the caller's context (Prefect's settings,
        e.g. the API URL of a test harness, live in context variables)."""
        if self._thread is None:
            ctx = contextvars.copy_context()
            self._thread = threading.Thread(target=ctx.run, args=(self._work,), name=f"atoll-recorder-{self.run_id}",
                                            daemon=True)
            self._thread.start()
            if self.round_run_tags is not None:
                # Recorded rounds: their flow runs' states on a thread of their own, so that a round
                # opens and completes on the server's clock when it happens, not behind the slower
                # artifacts, goodput reads and plots of earlier rounds.
                self._states = StateThread(self.runs, self._queue)
                self._states.start()
        return self

    def _inbox(self) -> queue.Queue[Any]:
        states = self._states
        return states.inbox if states is not None else self._queue

    def open(self, round_: int) -> None:
        """Recorded round ``round_`` has opened: create its flow run, Running, now (never blocks)."""
        if self.round_run_tags is not None:
            self._inbox().put(OpenedRound(round_))

    def submit(self, round_: int, flow_run_id: Any = None, *, seconds: float | None = None,
               phases: Iterable[Phase] = ()) -> None:
        """Record committed round ``round_`` on flow run ``flow_run_id``, later (never blocks).
        Without a flow run id (recorded rounds) the round's flow run is completed (or created,
        if it was not opened); ``seconds`` is the round's duration for its state message,
        ``phases`` become its task runs."""
        self._inbox().put(CommittedRound(round_, str(flow_run_id) if flow_run_id else None, seconds, tuple(phases)))

    def backfill(self, latest_round: int, *, window: int = BACKFILL_ROUNDS) -> list[int]:
        """Queue every committed round up to ``latest_round`` with no Completed round flow run, and
        return them (oldest first).

        A recorded round gets its flow run after its commit, from this thread: a training run
        killed in between leaves committed rounds without one (the whole tail its recorder was
        behind, which on a loaded server can be hundreds of rounds), and a person looking for
        ``round-000123`` in the UI would not find it. The next training run calls this when it
        starts. It reads the round flow runs of the last ``window`` rounds (one paged query by the
        run's tag and the rounds' names) and walks back a window at a time while a whole window
        is unrecorded: a recorder records in order, so the first window that holds a recorded
        round is where the gap began (it also stops the walk where the database's retention
        deleted old flow runs). The idempotency key keeps a round recorded twice (a racing old
        copy) one flow run."""
        if self.round_run_tags is None or latest_round < 1:
            return []
        missing = self.runs.unrecorded(latest_round, window=window)
        for r in missing:
            self.submit(r)
        return missing

    def flush(self, timeout_s: float = 60.0) -> GoodputReport | None:
        """Wait until every submitted round is written (at most ``timeout_s``); the goodput so far."""
        if self._thread is None:
            self._drain_inline(timeout_s)
        else:
            done = threading.Event()
            self._inbox().put(done)
            done.wait(timeout_s)
        return self.last_goodput

    def close(self, timeout_s: float = 60.0) -> GoodputReport | None:
        """Flush, then end the thread. A round opened but never committed by this training run
        (stopped, or it failed for good) has its flow run cancelled: the next training run that
        commits the round completes it (the idempotency key gives it back)."""
        out = self.flush(timeout_s)
        if self._thread is not None:
            self._inbox().put(STOP)  # the state thread passes it on
            if self._states is not None:
                self._states.join(timeout_s)
                self._states = None
            self._thread.join(timeout_s)
            self._thread = None
        if self.runs.running and timeout_s > 0:
            self.runs.cancel_open()
        return out

    def write_plots(self, client: Any, goodput: GoodputReport | None = None) -> None:
        """Draw the run's plots and write them as ``<run>-plots`` on the training-run flow run."""
        self.artifacts.write_plots(client, goodput)

    # -- the writer ---------------------------------------------------------------------------
    def _drain_inline(self, timeout_s: float) -> None:
        """Write what is queued on the caller's thread, trying a failed batch again every
        ``retry_s`` until ``timeout_s`` has passed."""
        batch: list[CommittedRound | OpenedRound] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, CommittedRound | OpenedRound):
                batch.append(item)
        if batch:
            from prefect.client.orchestration import get_client

            deadline = time.monotonic() + timeout_s
            with get_client(sync_client=True) as client:
                batch = self._write(client, batch, final=True)
                while batch and time.monotonic() + self.retry_s < deadline:
                    time.sleep(self.retry_s)
                    batch = self._write(client, batch, final=True)

    def _work(self) -> None:
        from prefect.client.orchestration import get_client

        retry: list[CommittedRound | OpenedRound] = []
        waiters: list[threading.Event] = []  # flushes waiting for everything queued before them
        with get_client(sync_client=True) as client:  # one client (one connection) for the thread's life
            while True:
                pending: list[Any] = []
                try:  # rounds left by a failed write are tried again after retry_s, or with the next round
                    pending.append(self._queue.get(timeout=self.retry_s if retry else None))
                except queue.Empty:
                    pass
                self._yield_to_states()
                while True:  # everything queued meanwhile goes in one batch
                    try:
                        pending.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                batch = retry + [i for i in pending if isinstance(i, CommittedRound | OpenedRound)]
                waiters += [i for i in pending if isinstance(i, threading.Event)]
                retry = self._write(client, batch, final=bool(waiters)) if batch or waiters else []
                stop = any(i is STOP for i in pending)
                if not retry or stop:  # a flush returns once its rounds are written, not after a failed try
                    for w in waiters:
                        w.set()
                    waiters = []
                if stop:
                    return

    def _yield_to_states(self) -> None:
        """While the state thread has rounds to open or complete, wait (at most ``STATES_FIRST_S``):
        the server stamps those states with its own clock and, on SQLite, serves one write at a
        time, so they go first; artifacts, task runs and logs carry their own times and land
        later in bigger batches."""
        states = self._states
        if states is None:
            return
        deadline = time.monotonic() + STATES_FIRST_S
        while states.pending() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _write(self, client: Any, batch: list[CommittedRound | OpenedRound], *,
               final: bool) -> list[CommittedRound | OpenedRound]:
        """Write ``batch``; the rounds it could not finish (to be tried again), each with the flow run
        it got if it got one (so a retry never creates a second: the idempotency key would return
        the same one anyway). An opened round whose flow run could not be created is not retried:
        its commit creates it."""
        done: set[int] = set()
        created: dict[int, CommittedRound] = {}
        try:
            self._write_with(client, batch, final=final, done=done, created=created)
            return []
        except Exception as e:  # noqa: BLE001 - artifacts are for people; the bucket holds the truth
            self.errors += 1
            left: list[CommittedRound | OpenedRound] = [created.get(i.round, i) for i in batch
                                                        if isinstance(i, CommittedRound) and i.round not in done]
            log.warning(f"run {self.run_id}: could not record rounds {[i.round for i in left]} ({e!r}); "
                        f"trying again in {self.retry_s:g} s")
            return left

    def _write_with(self, client: Any, batch: list[CommittedRound | OpenedRound], *, final: bool, done: set[int],
                    created: dict[int, CommittedRound]) -> None:
        """Write ``batch``, noting in ``done`` each round finished (or gone) and in ``created`` each
        one whose flow run it created or completed."""
        # First the flow runs' states, in the order they happened (a round opens, the previous one
        # completes), so that the server's clock, which times them, is as near the round as it can
        # be; each needs only its commit record. Goodput needs every contribution of the run so
        # far, which a relaunched training run must first read back (thousands on a long run).
        todo = []
        for item in batch:
            if isinstance(item, OpenedRound):
                self.runs.open(client, item.round)
                continue
            record = self.store.readable_commit(item.round)
            if record is None:
                done.add(item.round)
                continue
            if not item.flow_run_id and self.round_run_tags is not None:
                item = dataclasses.replace(item, flow_run_id=str(self.runs.complete(client, item, record)))
                created[item.round] = item
            todo.append((item, record))
        goodput = self.tracker.update() if todo or self.last_goodput is None else self.last_goodput
        self.last_goodput = goodput
        logs: list[dict[str, Any]] = []
        for item, record in todo:
            self._write_round(client, item, record, goodput, logs)
            done.add(item.round)
        if logs:  # every line of the batch in one call
            client.create_logs(logs)
        if len(self.tracker.cache) > CACHE_LIMIT:  # the tracker has counted them: later rounds re-read what they need
            self.tracker.cache.clear()
        self.artifacts.write_run_level(client, goodput, final=final)

    def _write_round(self, client: Any, item: CommittedRound, record: Any, goodput: GoodputReport,
                     logs: list[dict[str, Any]]) -> None:
        """The round's artifact, task runs (its phases, as events: no API call) and log lines (added
        to ``logs``), and ``atoll.round.committed``."""
        rows: list[ContributionRow] = contribution_rows(self.store, record, self.tracker.cache)
        fr = UUID(item.flow_run_id) if item.flow_run_id else None
        self.artifacts.write_round(client, item.round, record, rows, goodput, fr)
        if fr is not None and item.phases:
            tasks = emit_phase_task_runs(fr, item.round, item.phases)
            logs += round_log_lines(fr, record, rows, item.phases, tasks)
        emit_round_committed(self.run_id, self.store.url, record, rows, goodput=goodput,
                             flow_run_id=item.flow_run_id)
        self.recorded.append(item.round)
        self.artifacts.note_recorded(item.round)
