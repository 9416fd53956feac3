"""Recorded rounds' flow runs: created Running as a round opens, set Completed as it commits.

A round that ran inline (recorded rounds, docs/prefect.md) gets its flow run from the run's
recorder. A state's time is the server's clock (a client cannot set a flow run's start or end),
so the two calls that open and complete it are what make its duration the round's: they go from
a thread of their own (:class:`StateThread`), as the round opens and commits, not behind the
slower artifacts, goodput reads and plots of earlier rounds, and they skip the retry loop of
Prefect's client (:func:`~atoll.tasks.prefect_private.post_once`), trying again within tens of
milliseconds instead (:func:`soon`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from uuid import UUID

from atoll.runs.names import plural
from atoll.storage.reader import RunReader
from atoll.tasks.prefect_private import post_once, set_state_body
from atoll.tasks.round_phases import Phase

__all__ = ["OPEN_AFTER_COMMIT_S", "STOP", "CommittedRound", "OpenedRound", "RoundFlowRuns", "StateThread", "soon"]

log = logging.getLogger("atoll.recorder")

T = TypeVar("T")

OPEN_AFTER_COMMIT_S = 0.05
"""Recorded rounds: how long the state thread waits, after a round commits, for the next round to
open, so that the two calls go out together (a few ms apart on the server's clock, not a call's
latency)."""


@dataclass(frozen=True)
class CommittedRound:
    """A committed round to record, on flow run ``flow_run_id`` (None: a recorded round, whose
    flow run the recorder completes or creates)."""

    round: int
    flow_run_id: str | None
    seconds: float | None = None
    """Recorded rounds: how long the round took (its flow run is created afterwards)."""
    phases: tuple[Phase, ...] = ()
    """Recorded rounds: await-quorum, grace, merge, evaluate, commit, as they happened."""


@dataclass(frozen=True)
class OpenedRound:
    """A recorded round opened: its flow run is created Running now, so that the server's clock
    gives it its real start (a state's time is the server's, never the client's)."""

    round: int


STOP = object()
"""Queued last: the thread that takes it passes it on and ends."""


def soon(call: Callable[[], T], *, tries: int = 8, first_wait_s: float = 0.02) -> T:
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


class RoundFlowRuns:
    """The flow runs of one run's recorded rounds: named and tagged like round flow runs, one per
    round of the run whoever records it (the idempotency key ``atoll-round:<run>:<round>``)."""

    def __init__(self, store: RunReader, *, run_id: str, tags: list[str]) -> None:
        self.store = store
        self.run_id = run_id
        self.tags = tags
        self.running: dict[int, UUID] = {}
        """Recorded rounds whose flow run was created Running when they opened."""
        self._flow_id: Any = None

    def open(self, client: Any, round_: int) -> None:
        """Create round ``round_``'s flow run Running, now: the server's clock times its start."""
        from prefect.states import Running

        try:
            self.running[round_] = soon(lambda: self.create(client, round_, Running()))
        except Exception as e:  # noqa: BLE001 - its commit creates it instead
            log.warning(f"run {self.run_id}: could not open round {round_}'s flow run: {e!r}")

    def create(self, client: Any, round_: int, state: Any) -> UUID:
        """Create round ``round_``'s flow run in ``state`` with one API call, named and tagged like
        a round flow run; the idempotency key makes it one flow run per round of a run, whoever
        records it (a restarted or racing training run that adopted the round gets the same one)."""
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.states import to_state_create

        from atoll.runs.names import round_flow_name
        from atoll.tasks.queries import ROUND_FLOW_NAME, flow_id

        if self._flow_id is None:
            self._flow_id = flow_id(client, ROUND_FLOW_NAME)
        create = FlowRunCreate(flow_id=self._flow_id, name=round_flow_name(round_),
                               parameters={"round_number": round_, "run_id": self.run_id},
                               tags=list(self.tags), state=to_state_create(state),
                               idempotency_key=f"atoll-round:{self.run_id}:{round_}")
        response = post_once(client, "/flow_runs/", create.model_dump(mode="json"))
        body = response.json()
        fr = UUID(body["id"])
        given = (body.get("state") or {}).get("type")
        if response.status_code != 201 and state.is_final() and given != state.type.value:
            # The key gave back a flow run another training run opened (Running, or Cancelled when
            # it closed): the round is committed now, so it ends in this state.
            self.set_state(client, fr, state)
        return fr

    @staticmethod
    def set_state(client: Any, flow_run_id: UUID, state: Any) -> None:
        """Force ``state`` on a round's flow run, with one API call."""
        post_once(client, f"/flow_runs/{flow_run_id}/set_state", set_state_body(flow_run_id, state, force=True))

    def complete(self, client: Any, item: CommittedRound, record: Any) -> UUID:
        """The recorded round's flow run, Completed: the one created Running when it opened (one
        ``set_state`` call: the server's clock ends it now), or else created Completed (or set
        Completed, where another training run left it open: :meth:`create`). Its state
        message says what the round did and how long it took."""
        from prefect.states import Completed

        took = f" in {item.seconds:.2f} s" if item.seconds is not None else ""
        merged = plural(len(record.accepted), "learner")
        state: Any = Completed(message=f"round {item.round} (fragment {record.fragment}) committed{took}: "
                                  f"{merged} merged, {len(record.rejected)} not")
        running = self.running.get(item.round)
        if running is None:
            return self.create(client, item.round, state)
        self.set_state(client, running, state)
        del self.running[item.round]  # only once it is set: a call tried again sets it again
        return running

    def cancel_open(self) -> None:
        """Cancel the flow runs of rounds opened but never committed (the next training run that
        commits the round completes it: the idempotency key gives it back)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        try:
            with get_client(sync_client=True) as client:
                for r, fr in sorted(self.running.items()):
                    client.set_flow_run_state(fr, Cancelled(message=f"round {r} was not committed by this "
                                                                   "training run; the next one redoes it"), force=True)
        except Exception as e:  # noqa: BLE001 - for people only
            log.warning(f"run {self.run_id}: could not cancel the flow runs of open rounds: {e!r}")
        self.running.clear()

    def unrecorded(self, latest_round: int, *, window: int) -> list[int]:
        """The committed rounds up to ``latest_round`` with no Completed round flow run, oldest first:
        the round flow runs of the last ``window`` rounds (one paged query by the run's tag and the
        rounds' names), then a window further back while a whole window is unrecorded (see
        :meth:`~atoll.tasks.recorder.RoundRecorder.backfill`). If the server fails on the way, those
        found before."""
        from prefect.client.orchestration import get_client

        from atoll.runs.names import round_flow_name
        from atoll.tasks.queries import ROUND_FLOW_NAME, read_flow_runs_paged, run_tag

        missing: list[int] = []
        hi = latest_round
        try:
            with get_client(sync_client=True) as client:
                while hi >= 1:
                    names = {round_flow_name(r): r for r in range(max(1, hi - window + 1), hi + 1)}
                    # Only a Completed one records a round: a flow run left Running (its training
                    # run died between the commit and the state) or Cancelled is completed again.
                    have = {fr.name for fr in read_flow_runs_paged(client, flow_names=[ROUND_FLOW_NAME],
                                                                    tags=[run_tag(self.run_id)], names=list(names))
                            if fr.state is not None and fr.state.is_completed()}
                    missing[:0] = [r for name, r in names.items() if name not in have]
                    if have:
                        break
                    hi -= window
        except Exception as e:  # noqa: BLE001 - artifacts are for people; the bucket holds the truth
            log.warning(f"run {self.run_id}: could not look for unrecorded rounds: {e!r}")
        return missing


class StateThread:
    """Recorded rounds' flow runs, as they open and commit, on a thread of their own; each
    committed round then goes on, with its flow run, to ``out`` (the writer thread's queue; so
    does everything else queued here, in order)."""

    def __init__(self, runs: RoundFlowRuns, out: queue.Queue[Any]) -> None:
        self.runs = runs
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.busy = threading.Event()
        """Set while this thread has calls in flight (the writer thread lets them go first)."""
        self._out = out
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, in a copy of the caller's context (Prefect's settings live in context
        variables)."""
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._work,),
                                        name=f"atoll-recorder-states-{self.runs.run_id}", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def pending(self) -> bool:
        """Whether rounds are queued here or calls are in flight."""
        return not self.inbox.empty() or self.busy.is_set()

    def _take(self) -> list[Any]:
        """The next item and everything queued meanwhile; after a commit, the next round's
        opening too if it comes within ``OPEN_AFTER_COMMIT_S``."""
        items = [self.inbox.get()]
        if isinstance(items[0], CommittedRound):  # a commit: the next round opens a few ms later
            try:
                items.append(self.inbox.get(timeout=OPEN_AFTER_COMMIT_S))
            except queue.Empty:
                pass
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def _work(self) -> None:
        from prefect.client.orchestration import get_client

        # Everything queued goes out at once, a round's calls in order, rounds side by side: one
        # round commits as the next opens, and the server stamps each state when the call reaches
        # it, so one call after the other would start the next round late by the first's latency.
        with get_client(sync_client=True) as client, \
                ThreadPoolExecutor(max_workers=2,
                                   thread_name_prefix=f"atoll-recorder-states-{self.runs.run_id}") as pool:
            while True:
                items = self._take()
                by_round: dict[int, list[Any]] = {}
                for item in items:
                    if isinstance(item, OpenedRound) or (isinstance(item, CommittedRound) and not item.flow_run_id):
                        by_round.setdefault(item.round, []).append(item)
                self.busy.set()
                # each in a copy of this thread's context (Prefect's settings live in context variables)
                futures = {r: pool.submit(contextvars.copy_context().run, self._calls, client, calls)
                           for r, calls in by_round.items()}
                done = {r: f.result() for r, f in futures.items()}
                self.busy.clear()
                for item in items:
                    if isinstance(item, OpenedRound):
                        continue
                    if isinstance(item, CommittedRound) and done.get(item.round) is not None:
                        item = dataclasses.replace(item, flow_run_id=str(done[item.round]))
                    self._out.put(item)
                    if item is STOP:
                        return

    def _calls(self, client: Any, calls: list[Any]) -> UUID | None:
        """One round's state calls, in order: open (Running), complete (Completed). The flow run
        it completed, if it did (else the writer thread creates it with the round's artifacts)."""
        completed = None
        for item in calls:
            if isinstance(item, OpenedRound):
                self.runs.open(client, item.round)
                continue
            try:
                record = self.runs.store.readable_commit(item.round)
                if record is not None:
                    completed = soon(functools.partial(self.runs.complete, client, item, record))
            except Exception as e:  # noqa: BLE001 - the writer thread tries again
                log.warning(f"run {self.runs.run_id}: could not complete round {item.round}'s flow run: {e!r}")
        return completed
