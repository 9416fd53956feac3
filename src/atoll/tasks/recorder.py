"""Writing each round's artifacts and events off the synchronizer's critical path.

A round's commit is what makes the learners' work count; its artifacts are for people. So the
round flow (:mod:`atoll.flows.round`) only hands the committed round and its flow run id to the
run's :class:`RoundRecorder`, and goes on with the next round. A background thread of the
training-run process then, for every round, reads the commit record (and the contribution
records of what got weight 0) from the bucket and writes, **attached to that round's flow run**
(so the UI shows them on it, whenever they land):

* one markdown artifact with no key: the round's summary with the goodput so far, overall and
  per learner, the mean *steps since last sync* of the merged contributions (the effective H), the
  round's traffic (synchronizer and learners: requests, bytes up and down, per token merged), and
  the contributions table (learner, pool, tokens, steps, weight, accepted or why not);

and emits the ``atoll.round.committed`` event (:mod:`atoll.tasks.events`).

**Recorded rounds** (the round ran inline, with no flow run of its own): a second thread creates
the round's flow run Running when the round opens and sets it Completed when it commits (a
state's time is the server's clock: these two calls are what make its duration the round's), and
the writer adds a task run per phase at its real times (await-quorum, grace, merge, evaluate,
commit: ``prefect.task-run.Completed`` events, as Prefect's task engine sends them) and the
round's log lines (what it merged, what not and why), one ``POST /logs/`` a batch. The run's
``<run>-plots`` artifact (:mod:`atoll.runs.plots`) is drawn every ``plots_every`` rounds and at
the end.

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
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from uuid import UUID, uuid4

from atoll.runs.report import (
    ContributionRow,
    GoodputReport,
    GoodputTracker,
    contribution_rows,
    figure_lines,
    learner_time_table,
    plural,
    round_markdown,
    slug,
)
from atoll.storage.bucket import RunStore
from atoll.tasks.events import emit_round_committed

__all__ = ["BACKFILL_ROUNDS", "CACHE_LIMIT", "RoundRecorder", "artifact_keys", "goodput_markdown"]

log = logging.getLogger("atoll.recorder")

T = TypeVar("T")

BACKFILL_ROUNDS = 100
"""Rounds per query when a recorded run looks, at its start, for committed rounds that have no
flow run (:meth:`RoundRecorder.backfill`)."""


STATES_FIRST_S = 5.0
"""Recorded rounds: how long the writer thread waits, at most, for the state thread to open and
complete the rounds queued for it before it writes its next batch (:meth:`RoundRecorder._yield_to_states`)."""

OPEN_AFTER_COMMIT_S = 0.05
"""Recorded rounds: how long the state thread waits, after a round commits, for the next round to
open, so that the two calls go out together (a few ms apart on the server's clock, not a call's
latency)."""

CACHE_LIMIT = 20_000
"""Contribution records the recorder's goodput tracker keeps in memory between batches (a chaos-soak
round names ~40, so a run of 10^5 rounds would otherwise hold millions)."""


def artifact_keys(run_id: str) -> dict[str, str]:
    """Artifact keys of a run (lowercase and dashes, as Prefect requires). A round's own artifact has
    no key (see :meth:`RoundRecorder._write_with`)."""
    s = slug(run_id)
    return {"goodput": f"{s}-goodput", "plots": f"{s}-plots",
            "run": f"{s}-run-summary", "progress": f"{s}-run-summary-progress", "segment": f"{s}-segment"}


def goodput_markdown(run_id: str, round_: int, goodput: GoodputReport) -> str:
    return (f"# Goodput and merged-work share of run `{run_id}` after round {round_}\n\n"
            + "".join(f"* {line}\n" for line in figure_lines(goodput)) + "\n"
            + "\n".join(learner_time_table(goodput)) + "\n\n"
            "Goodput is the paper's figure: time in useful training steps over the time learners were "
            "available. The merged-work share is the part of that training that reached the model. "
            "From the bucket (docs/prefect.md).")


Phase = tuple[str, float, float]
"""A round's phase: (task name, start, end), seconds since the epoch."""


@dataclass(frozen=True)
class _Item:
    round: int
    flow_run_id: str | None
    seconds: float | None = None
    """Recorded rounds: how long the round took (its flow run is created afterwards)."""
    phases: tuple[Phase, ...] = ()
    """Recorded rounds: await-quorum, grace, merge, evaluate, commit, as they happened."""


@dataclass(frozen=True)
class _Open:
    """A recorded round opened: its flow run is created Running now, so that the server's clock
    gives it its real start (a state's time is the server's, never the client's)."""

    round: int


_STOP = object()


class RoundRecorder:
    """A background writer of round artifacts and events for one run (see the module docstring)."""

    def __init__(self, store: RunStore, *, run_id: str, max_rounds: int, inner_steps: int,
                 progress_artifact_id: str | None = None, progress_every_s: float = 10.0,
                 tracker: GoodputTracker | None = None, run_flow_run_id: Any = None,
                 round_run_tags: list[str] | None = None, retry_s: float = 5.0, plots_every: int = 50) -> None:
        """``run_flow_run_id``: the training-run flow run, which the run-level goodput artifact is attached to.
        ``round_run_tags``: the tags of round flow runs this recorder creates itself (recorded
        rounds: a round submitted without a flow run id gets one, Completed, before its artifacts)."""
        self.store = store
        self.run_id = run_id
        self.max_rounds = max_rounds
        self.inner_steps = inner_steps
        self.progress_artifact_id = progress_artifact_id
        self.progress_every_s = progress_every_s
        self.run_flow_run_id = UUID(str(run_flow_run_id)) if run_flow_run_id else None
        self.tracker = tracker if tracker is not None else GoodputTracker(store)
        self.keys = artifact_keys(run_id)
        self.round_run_tags = list(round_run_tags) if round_run_tags is not None else None
        self.retry_s = retry_s
        """A failed write (server or bucket unwell) is tried again after this, or with the next round."""
        self.plots_every = plots_every
        """The run's ``<run>-plots`` artifact is drawn again every this many rounds (and at the end)."""
        self._plotted = 0
        self._round_flow_id: Any = None
        self._running: dict[int, UUID] = {}
        """Recorded rounds whose flow run was created Running when they opened."""
        self.last_goodput: GoodputReport | None = None
        self.recorded: list[int] = []
        """Rounds written, in order (tests)."""
        self.errors = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._states: queue.Queue[Any] = queue.Queue()
        self._state_thread: threading.Thread | None = None
        self._states_busy = threading.Event()
        """Set while the state thread has calls in flight (the writer thread lets them go first)."""
        self._last_progress = 0.0
        self._progress_round = 0
        self._progress_written = 0

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
                self._state_thread = threading.Thread(target=contextvars.copy_context().run, args=(self._state_work,),
                                                      name=f"atoll-recorder-states-{self.run_id}", daemon=True)
                self._state_thread.start()
        return self

    def _inbox(self) -> queue.Queue[Any]:
        return self._states if self._state_thread is not None else self._queue

    def open(self, round_: int) -> None:
        """Recorded round ``round_`` has opened: create its flow run, Running, now (never blocks)."""
        if self.round_run_tags is not None:
            self._inbox().put(_Open(round_))

    def submit(self, round_: int, flow_run_id: Any = None, *, seconds: float | None = None,
               phases: Iterable[Phase] = ()) -> None:
        """Record committed round ``round_`` on flow run ``flow_run_id``, later (never blocks).
        Without a flow run id (recorded rounds) the round's flow run is completed (or created,
        if it was not opened); ``seconds`` is the round's duration for its state message,
        ``phases`` become its task runs."""
        self._inbox().put(_Item(round_, str(flow_run_id) if flow_run_id else None, seconds, tuple(phases)))

    def backfill(self, latest_round: int, *, window: int = BACKFILL_ROUNDS) -> list[int]:
        """Queue every committed round up to ``latest_round`` that has no round flow run yet, and
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
        from prefect.client.orchestration import get_client

        from atoll.runs.report import round_flow_name
        from atoll.tasks.queries import ROUND_FLOW_NAME, read_flow_runs_paged, run_tag

        missing: list[int] = []
        hi = latest_round
        try:
            with get_client(sync_client=True) as client:
                while hi >= 1:
                    names = {round_flow_name(r): r for r in range(max(1, hi - window + 1), hi + 1)}
                    have = {fr.name for fr in read_flow_runs_paged(client, flow_names=[ROUND_FLOW_NAME],
                                                                    tags=[run_tag(self.run_id)], names=list(names))}
                    missing[:0] = [r for name, r in names.items() if name not in have]
                    if have:
                        break
                    hi -= window
        except Exception as e:  # noqa: BLE001 - artifacts are for people; the bucket holds the truth
            log.warning(f"run {self.run_id}: could not look for unrecorded rounds: {e!r}")
        for r in missing:
            self.submit(r)
        return missing

    def flush(self, timeout_s: float = 60.0) -> GoodputReport | None:
        """Wait until every submitted round is written (at most ``timeout_s``); the goodput so far."""
        if self._thread is None:
            self._drain_inline()
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
            self._inbox().put(_STOP)  # the state thread passes it on
            if self._state_thread is not None:
                self._state_thread.join(timeout_s)
                self._state_thread = None
            self._thread.join(timeout_s)
            self._thread = None
        if self._running and timeout_s > 0:
            self._cancel_open()
        return out

    def _cancel_open(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        try:
            with get_client(sync_client=True) as client:
                for r, fr in sorted(self._running.items()):
                    client.set_flow_run_state(fr, Cancelled(message=f"round {r} was not committed by this "
                                                                   "training run; the next one redoes it"), force=True)
        except Exception as e:  # noqa: BLE001 - for people only
            log.warning(f"run {self.run_id}: could not cancel the flow runs of open rounds: {e!r}")
        self._running.clear()

    # -- the writers --------------------------------------------------------------------------
    def _state_work(self) -> None:
        """Recorded rounds' flow runs, as they open and commit; each committed round then goes on,
        with its flow run, to the writer thread (so does everything else, in order)."""
        from prefect.client.orchestration import get_client

        # Everything queued goes out at once, a round's calls in order, rounds side by side: one
        # round commits as the next opens, and the server stamps each state when the call reaches
        # it, so one call after the other would start the next round late by the first's latency.
        with get_client(sync_client=True) as client, \
                ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"atoll-recorder-states-{self.run_id}") as pool:
            while True:
                items = [self._states.get()]
                if isinstance(items[0], _Item):  # a commit: the next round opens a few ms later
                    try:
                        items.append(self._states.get(timeout=OPEN_AFTER_COMMIT_S))
                    except queue.Empty:
                        pass
                while True:
                    try:
                        items.append(self._states.get_nowait())
                    except queue.Empty:
                        break
                by_round: dict[int, list[Any]] = {}
                for item in items:
                    if isinstance(item, _Open) or (isinstance(item, _Item) and not item.flow_run_id):
                        by_round.setdefault(item.round, []).append(item)
                self._states_busy.set()
                # each in a copy of this thread's context (Prefect's settings live in context variables)
                futures = {r: pool.submit(contextvars.copy_context().run, self._state_calls, client, calls)
                           for r, calls in by_round.items()}
                done = {r: f.result() for r, f in futures.items()}
                self._states_busy.clear()
                for item in items:
                    if isinstance(item, _Open):
                        continue
                    if isinstance(item, _Item) and done.get(item.round) is not None:
                        item = dataclasses.replace(item, flow_run_id=str(done[item.round]))
                    self._queue.put(item)
                    if item is _STOP:
                        return

    def _state_calls(self, client: Any, calls: list[Any]) -> UUID | None:
        """One round's state calls, in order: open (Running), complete (Completed). The flow run
        it completed, if it did (else the writer thread creates it with the round's artifacts)."""
        from prefect.states import Running

        completed = None
        for item in calls:
            if isinstance(item, _Open):
                self._open_round_run(client, item.round, Running)
                continue
            try:
                record = self.store.readable_commit(item.round)
                if record is not None:
                    completed = _soon(functools.partial(self._complete_round_run, client, item, record))
            except Exception as e:  # noqa: BLE001 - the writer thread tries again
                log.warning(f"run {self.run_id}: could not complete round {item.round}'s flow run: {e!r}")
        return completed

    def _drain_inline(self) -> None:
        batch = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Item | _Open):
                batch.append(item)
        if batch:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                self._write(client, batch, final=True)

    def _work(self) -> None:
        from prefect.client.orchestration import get_client

        retry: list[_Item | _Open] = []
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
                batch = retry + [i for i in pending if isinstance(i, _Item | _Open)]
                waiters = [i for i in pending if isinstance(i, threading.Event)]
                retry = self._write(client, batch, final=bool(waiters)) if batch or waiters else []
                for w in waiters:
                    w.set()
                if any(i is _STOP for i in pending):
                    return

    def _yield_to_states(self) -> None:
        """While the state thread has rounds to open or complete, wait (at most ``STATES_FIRST_S``):
        the server stamps those states with its own clock and, on SQLite, serves one write at a
        time, so they go first; artifacts, task runs and logs carry their own times and land
        later in bigger batches."""
        if self._state_thread is None:
            return
        deadline = time.monotonic() + STATES_FIRST_S
        while (not self._states.empty() or self._states_busy.is_set()) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _write(self, client: Any, batch: list[_Item | _Open], *, final: bool) -> list[_Item | _Open]:
        """Write ``batch``; the rounds it could not finish (to be tried again), each with the flow run
        it got if it got one (so a retry never creates a second: the idempotency key would return
        the same one anyway). An opened round whose flow run could not be created is not retried:
        its commit creates it."""
        done: set[int] = set()
        created: dict[int, _Item] = {}
        try:
            self._write_with(client, batch, final=final, done=done, created=created)
            return []
        except Exception as e:  # noqa: BLE001 - artifacts are for people; the bucket holds the truth
            self.errors += 1
            left: list[_Item | _Open] = [created.get(i.round, i) for i in batch
                                         if isinstance(i, _Item) and i.round not in done]
            log.warning(f"run {self.run_id}: could not record rounds {[i.round for i in left]} ({e!r}); "
                        f"trying again in {self.retry_s:g} s")
            return left

    def _open_round_run(self, client: Any, round_: int, running: Callable[[], Any]) -> None:
        """Create round ``round_``'s flow run Running, now: the server's clock times its start."""
        try:
            self._running[round_] = _soon(lambda: self._round_run(client, round_, running()))
        except Exception as e:  # noqa: BLE001 - its commit creates it instead
            log.warning(f"run {self.run_id}: could not open round {round_}'s flow run: {e!r}")

    def _round_run(self, client: Any, round_: int, state: Any) -> UUID:
        """Create round ``round_``'s flow run in ``state`` with one API call, named and tagged like
        a round flow run; the idempotency key makes it one flow run per round of a run, whoever
        records it (a restarted or racing training run that adopted the round gets the same one)."""
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.states import to_state_create

        from atoll.runs.report import round_flow_name
        from atoll.tasks.queries import ROUND_FLOW_NAME, flow_id

        if self._round_flow_id is None:
            self._round_flow_id = flow_id(client, ROUND_FLOW_NAME)
        create = FlowRunCreate(flow_id=self._round_flow_id, name=round_flow_name(round_),
                               parameters={"round_number": round_, "run_id": self.run_id},
                               tags=list(self.round_run_tags or []), state=to_state_create(state),
                               idempotency_key=f"atoll-round:{self.run_id}:{round_}")
        return UUID(_post_now(client, "/flow_runs/", create.model_dump(mode="json")).json()["id"])

    def _complete_round_run(self, client: Any, item: _Item, record: Any) -> UUID:
        """The recorded round's flow run, Completed: the one created Running when it opened (one
        ``set_state`` call: the server's clock ends it now), or else created Completed. Its state
        message says what the round did and how long it took."""
        from prefect.states import Completed

        took = f" in {item.seconds:.2f} s" if item.seconds is not None else ""
        merged = plural(len(record.accepted), "learner")
        state: Any = Completed(message=f"round {item.round} (fragment {record.fragment}) committed{took}: "
                                  f"{merged} merged, {len(record.rejected)} not")
        running = self._running.get(item.round)
        if running is None:
            return self._round_run(client, item.round, state)
        from prefect.states import to_state_create

        create = to_state_create(state)
        create.state_details.flow_run_id = running
        create.state_details.transition_id = uuid4()
        _post_now(client, f"/flow_runs/{running}/set_state",
                  {"state": create.model_dump(mode="json", serialize_as_any=True), "force": True})
        del self._running[item.round]  # only once it is set: a call tried again sets it again
        return running

    def _write_with(self, client: Any, batch: list[_Item | _Open], *, final: bool, done: set[int],
                    created: dict[int, _Item]) -> None:
        """Write ``batch``, noting in ``done`` each round finished (or gone) and in ``created`` each
        one whose flow run it created or completed."""
        from prefect.states import Running

        # First the flow runs' states, in the order they happened (a round opens, the previous one
        # completes), so that the server's clock, which times them, is as near the round as it can
        # be; each needs only its commit record. Goodput needs every contribution of the run so
        # far, which a relaunched training run must first read back (thousands on a long run).
        todo = []
        for item in batch:
            if isinstance(item, _Open):
                self._open_round_run(client, item.round, Running)
                continue
            record = self.store.readable_commit(item.round)
            if record is None:
                done.add(item.round)
                continue
            if not item.flow_run_id and self.round_run_tags is not None:
                item = dataclasses.replace(item, flow_run_id=str(self._complete_round_run(client, item, record)))
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
        self._write_run_level(client, goodput, final=final)

    def _write_round(self, client: Any, item: _Item, record: Any, goodput: GoodputReport,
                     logs: list[dict[str, Any]]) -> None:
        """The round's artifact, task runs (its phases, as events: no API call) and log lines (added
        to ``logs``), and ``atoll.round.committed``."""
        from prefect.client.schemas.actions import ArtifactCreate

        rows: list[ContributionRow] = contribution_rows(self.store, record, self.tracker.cache)
        fr = UUID(item.flow_run_id) if item.flow_run_id else None
        md = round_markdown(record, rows, run_id=self.run_id, run_url=self.store.url, max_rounds=self.max_rounds,
                            goodput=goodput, inner_steps=self.inner_steps, wire=self.tracker.wire)
        # One artifact per round, with no key: a keyed artifact costs the server ~65% more per
        # write (it moves the key's latest version) and a key would gather one version per
        # round, 10^5 on a long run. The round's flow run is where a person looks for it.
        client.create_artifact(ArtifactCreate(
            type="markdown", data=md, flow_run_id=fr,
            description=f"round {item.round} (fragment {record.fragment}) of run {self.run_id}: "
                        "summary and contributions"))
        if fr is not None and item.phases:
            tasks = emit_phase_task_runs(fr, item.round, item.phases)
            logs += round_log_lines(fr, record, rows, item.phases, tasks)
        emit_round_committed(self.run_id, self.store.url, record, rows, goodput=goodput,
                             flow_run_id=item.flow_run_id)
        self.recorded.append(item.round)
        self._progress_round = max(self._progress_round, item.round)

    def _write_run_level(self, client: Any, goodput: GoodputReport, *, final: bool) -> None:
        """The run's progress, ``<run>-goodput`` (at most every ``progress_every_s``) and
        ``<run>-plots`` (every ``plots_every`` rounds), and all three when ``final``."""
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        now = time.monotonic()
        due = final or now - self._last_progress >= self.progress_every_s
        r = self._progress_round
        if r and r != self._progress_written and due:
            self._progress_written = r
            self._last_progress = now
            record = self.store.readable_commit(r)
            loss = record.stats.get("val_loss") if record is not None else None
            if self.progress_artifact_id:
                client.update_artifact(UUID(str(self.progress_artifact_id)), ArtifactUpdate(
                    data=min(100.0, 100.0 * r / self.max_rounds),
                    description=f"round {r} of {self.max_rounds}"
                    + (f"; validation loss {loss:.4f}" if isinstance(loss, int | float) else "")
                    + (f"; goodput {100 * goodput.goodput:.1f}%" if goodput.goodput is not None else "")
                    + (f"; merged-work share {100 * goodput.merged_share:.1f}%"
                       if goodput.merged_share is not None else "")))
            client.create_artifact(ArtifactCreate(key=self.keys["goodput"], type="markdown",
                                                  data=goodput_markdown(self.run_id, r, goodput),
                                                  flow_run_id=self.run_flow_run_id,
                                                  description=f"goodput and merged-work share so far of run {self.run_id}"))
        if r and r != self._plotted and (final or r - self._plotted >= self.plots_every):
            self._plotted = r
            self.write_plots(client, goodput)

    def write_plots(self, client: Any, goodput: GoodputReport | None = None) -> None:
        """Draw the run's plots and write them as ``<run>-plots`` on the training-run flow run."""
        from prefect.client.schemas.actions import ArtifactCreate

        from atoll.runs.plots import plots_markdown, render_plots

        report = goodput if goodput is not None else self.tracker.report()
        pngs = render_plots(self.tracker, report)
        if pngs:
            client.create_artifact(ArtifactCreate(
                key=self.keys["plots"], type="markdown", flow_run_id=self.run_flow_run_id,
                data=plots_markdown(self.run_id, self.tracker, pngs, report),
                description=f"plots of run {self.run_id}: loss, goodput, contributors, bytes, learners"))


def _post_now(client: Any, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` to the API with Prefect's client, but not through its retry loop: the server
    stamps a state with its own clock, so a state call that waits is a round timed wrong, and that
    loop sleeps 2 s, 4 s, ... after a 503 (SQLite's write lock, taken by the event and log writes
    of earlier rounds), even after its last try. :func:`_soon` tries again within tens of ms.
    Raises ``httpx.HTTPStatusError`` for an error status."""
    http = client._client  # Prefect's httpx client: its base URL, auth and CSRF token
    request = http.build_request("POST", path, json=body)
    send_once = getattr(http, "_send_with_retry", None)
    if send_once is None:  # another Prefect: its own loop, then
        return http.send(request).raise_for_status()
    response = send_once(request=request, send=super(type(http), http).send, send_args=(), send_kwargs={})
    return response.raise_for_status()


def _soon(call: Callable[[], T], *, tries: int = 8, first_wait_s: float = 0.02) -> T:
    """``call()``, tried again after 20 ms, 40 ms, ... (2.5 s in all) while the server answers 503
    or 429 (busy) or cannot be reached; any other error, or the last, is raised."""
    import httpx

    for attempt in range(tries):
        try:
            return call()
        except (httpx.HTTPStatusError, httpx.TransportError) as e:
            busy = isinstance(e, httpx.TransportError) or e.response.status_code in (429, 503)
            if not busy or attempt == tries - 1:
                raise
            time.sleep(first_wait_s * 2**attempt)
    raise AssertionError("unreachable")


def _when(t: float) -> Any:
    import datetime

    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)


def emit_phase_task_runs(flow_run_id: UUID, round_: int, phases: Iterable[Phase]) -> dict[str, UUID]:
    """A task run per phase of a recorded round, with its real start and end, as Prefect's own
    task engine records them: one ``prefect.task-run.Completed`` event each (over the events
    websocket, no HTTP call), which the server's task-run recorder turns into a task run of
    ``flow_run_id``. Returns phase name -> task run id."""
    import uuid

    from prefect.events import emit_event

    ids: dict[str, UUID] = {}
    for name, t0, t1 in phases:
        tid = uuid.uuid4()
        ids[name] = tid
        end = max(t0, t1)
        state: dict[str, Any] = {"type": "COMPLETED", "name": "Completed", "message": None, "state_details": {}, "data": None}
        emit_event(
            event="prefect.task-run.Completed", occurred=_when(end), id=uuid.uuid4(),
            resource={"prefect.resource.id": f"prefect.task-run.{tid}", "prefect.resource.name": f"{name}-{round_}",
                      "prefect.state-name": "Completed", "prefect.state-type": "COMPLETED",
                      "prefect.state-timestamp": _when(end).isoformat(), "prefect.orchestration": "client",
                      "prefect.run-count": "1"},
            related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}],
            payload={"intended": {"from": "RUNNING", "to": "COMPLETED"},
                     "initial_state": {"type": "RUNNING", "name": "Running", "message": "", "state_details": {}},
                     "validated_state": state,
                     "task_run": {"name": f"{name}-{round_}", "task_key": f"atoll-round-{name}",
                                  "dynamic_key": str(round_), "run_count": 1, "flow_run_run_count": 1,
                                  "expected_start_time": _when(t0).isoformat(), "start_time": _when(t0).isoformat(),
                                  "end_time": _when(end).isoformat(), "total_run_time": end - t0,
                                  "tags": [], "labels": {}, "task_inputs": {}, "empirical_policy": {}}})
    return ids


def round_log_lines(flow_run_id: UUID, record: Any, rows: list[ContributionRow], phases: Iterable[Phase],
                    tasks: dict[str, UUID]) -> list[dict[str, Any]]:
    """The round's log lines, timed when they happened: each phase's, what was merged (learner,
    pool, tokens, steps, weight) and what was not and why. For ``POST /logs/`` (one call a batch)."""
    phases = list(phases)
    end = {name: t1 for name, _, t1 in phases}
    last = max(end.values(), default=time.time())

    def line(message: str, at: float, task: str | None = None, level: int = logging.INFO) -> dict[str, Any]:
        return {"name": "atoll.round", "level": level, "message": message, "timestamp": _when(at).isoformat(),
                "flow_run_id": str(flow_run_id), "task_run_id": str(tasks[task]) if task in tasks else None}

    s = record.stats
    out = [line(f"{name}: {t1 - t0:.3f} s", t1, name) for name, t0, t1 in phases]
    when = end.get("merge", last)
    for r in rows:
        if r.status == "accepted":
            out.append(line(f"merged {r.learner} ({r.pool or '?'}): {r.tokens:,} tokens, {r.steps} steps, "
                            f"weight {r.weight:.3f}", when, "merge"))
        else:
            out.append(line(f"not merged: {r.learner} ({r.pool or '?'}): {r.status}", when, "merge",
                            logging.WARNING))
    loss = s.get("val_loss")
    out.append(line(f"round {record.round} (fragment {record.fragment}) committed: "
                    f"{plural(len(record.accepted), 'learner')} merged, {len(record.rejected)} not; closed because "
                    f"{s.get('reason', '-')}" + (f"; validation loss {loss:.4f}" if isinstance(loss, float) else ""),
                    last, "commit"))
    return out
