"""A process's life in the bucket: hold a lease, heartbeat while making progress, and notice when
to exit (a newer incarnation fenced us, the run was stopped, no commit for too long, SIGTERM).

The storage half (lease, heartbeat and stop records) is :mod:`atoll.storage.liveness`; this
module is what a learner or synchronizer process does with it:

* :class:`LeaseKeeper` is a background thread: every ``interval_s`` it checks for a newer lease
  of its holder (fenced), the run's stop marker (stopped) and the orphan timeout (no new commit
  for ``orphan_timeout_s``), and writes a heartbeat, but only while the owner's loop keeps calling
  :meth:`LeaseKeeper.tick` (a hung loop stops heartbeating, so it looks dead and is replaced).
  It never raises into the loop: the loop polls :attr:`LeaseKeeper.exit_reason`.
* :func:`sigterm_flag` installs a SIGTERM handler that only sets a flag (main thread only; the
  previous handler is restored afterwards), so a terminated learner saves its state and exits.
* :func:`die_with_parent` ties a child process's life to its launcher's (an island's ranks, a
  user's training script under the learner flow).
* :class:`RunStopped` and :class:`Fenced` are what :meth:`Synchronizer.poll
  <atoll.train.synchronizer.Synchronizer.poll>` raises once it holds a lease.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from atoll.storage.lease_holder import LeaseHolder
from atoll.storage.liveness import SYNCHRONIZER_HOLDER, Lease, StopMarker

__all__ = [
    "EXIT_REASONS",
    "LifecycleExit",
    "RunStopped",
    "Fenced",
    "LeaseKeeper",
    "die_with_parent",
    "sigterm_flag",
]

EXIT_REASONS = ("finished", "stopped", "orphaned", "sigterm", "fenced", "max_steps", "should_stop")
"""Why a learner's :func:`~atoll.train.inner.run_learner` returned (``LearnerSummary.exit_reason``)."""


class LifecycleExit(Exception):
    """The process must stop working on the run (base of :class:`RunStopped` and :class:`Fenced`)."""


class RunStopped(LifecycleExit):
    """The run's stop marker (``sync/stop.json``) says stopped: exit cleanly, start nothing new."""

    def __init__(self, marker: StopMarker, url: str = "") -> None:
        self.marker = marker
        where = f" {url}" if url else ""
        super().__init__(f"run{where} was stopped by {marker.by or 'someone'}: {marker.reason or '(no reason given)'}"
                         " (clear the stop marker to continue it)")


class Fenced(LifecycleExit):
    """A newer incarnation of this holder took a lease: this copy must exit without writing
    anything the newer one owns."""

    def __init__(self, holder: str, incarnation: int, newest: int) -> None:
        self.holder, self.incarnation, self.newest = holder, incarnation, newest
        super().__init__(f"{holder}: incarnation {incarnation} fenced by incarnation {newest}")


class LeaseKeeper(threading.Thread):
    """Background heartbeat and exit checks of one learner process (see the module docstring).

    ``lease=None`` (no lease taken): no heartbeats and no fencing; the stop marker and the orphan
    timeout are still checked. ``latest_round`` reports the newest committed round the owner has
    seen (None until it knows); the orphan clock starts when the keeper starts and restarts at
    every new round.
    """

    def __init__(
        self,
        store: LeaseHolder,
        holder: str,
        lease: Lease | None,
        *,
        interval_s: float = 5.0,
        stall_timeout_s: float = 120.0,
        orphan_timeout_s: float | None = None,
        latest_round: Callable[[], int | None] = lambda: None,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(daemon=True, name=f"atoll-lease-{holder}")
        self.store, self.holder, self.lease = store, holder, lease
        self.interval_s = interval_s
        self.stall_timeout_s = stall_timeout_s
        self.orphan_timeout_s = orphan_timeout_s
        self.latest_round = latest_round
        self.log = log
        self.clock = clock
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._detail = ""
        self.fenced_by = 0
        """The newer incarnation that fenced this one (0: not fenced)."""
        self._progress_at = clock()
        self._step: int | None = None
        self._round_seen: int | None = None
        self._round_at = clock()
        self.heartbeats = 0
        self.errors = 0

    # -- called by the owner's loop ----------------------------------------------------------
    def tick(self, step: int | None = None) -> None:
        """The loop made progress (a step, or a wait that is still going as planned)."""
        self._progress_at = self.clock()
        if step is not None:
            self._step = step

    def request_exit(self, reason: str, detail: str = "") -> None:
        """Ask the loop to exit for ``reason`` (the first request wins, except that a fence
        always overrides: a fenced copy must not save)."""
        with self._lock:
            if self._reason is None or (reason == "fenced" and self._reason != "fenced"):
                self._reason, self._detail = reason, detail or reason

    @property
    def exit_reason(self) -> str | None:
        """One of :data:`EXIT_REASONS` once the loop should exit, else None."""
        return self._reason

    @property
    def exit_detail(self) -> str:
        """A sentence for the final heartbeat and the log ("fenced by incarnation 4", ...)."""
        return self._detail

    @property
    def fenced(self) -> bool:
        return self.fenced_by > 0

    def still_current(self) -> bool:
        """Check now (one LIST) that no newer lease exists; False (and fenced) if one does.
        True without a lease. A storage error counts as current (the periodic check retries)."""
        if self.lease is None:
            return True
        if self.fenced:
            return False
        try:
            newest = self._newest_incarnation()
        except Exception as e:  # noqa: BLE001 - an unreadable bucket is not a fence
            self._error(f"lease check failed: {e!r}")
            return True
        if newest > self.lease.incarnation:
            self._fence(newest)
            return False
        return True

    def _newest_incarnation(self) -> int:
        # The synchronizer's id is reserved (no learner may take it), so it has a reader of its own.
        if self.holder == SYNCHRONIZER_HOLDER:
            return self.store.current_synchronizer_incarnation()
        return self.store.current_incarnation(self.holder)

    def final_heartbeat(self, reason: str) -> None:
        """Write ``status="exited"`` with ``reason`` (best effort; after :meth:`close`)."""
        if self.lease is None:
            return
        try:
            self.store.write_heartbeat(self.lease, status="exited", reason=reason, step=self._step,
                                       round=self._round_seen)
        except Exception as e:  # noqa: BLE001 - the process is exiting anyway
            self.log(f"{self.holder}: final heartbeat failed: {e!r}")

    def close(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout=timeout_s)

    # -- the thread --------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stop_event.is_set():
            self.check_once()
            self.stop_event.wait(self.interval_s)

    def check_once(self) -> None:
        """One round of checks and (if the loop is making progress) one heartbeat."""
        now = self.clock()
        try:
            latest = self.latest_round()
        except Exception:  # noqa: BLE001 - the owner's callback must not stop the keeper
            latest = None
        if latest is not None and latest != self._round_seen:
            self._round_seen, self._round_at = latest, now
        elif self.orphan_timeout_s is not None and now - self._round_at > self.orphan_timeout_s:
            self.request_exit("orphaned", f"orphaned: no new commit for {now - self._round_at:.0f} s "
                                          f"(orphan timeout {self.orphan_timeout_s:g} s)")
        try:
            marker, why = self.store.read_stop_marker()
            if why:
                self._error(f"stop marker ignored: {why}")
            if marker is not None and marker.stopped:
                self.request_exit("stopped", f"stopped by {marker.by or 'someone'}: {marker.reason}")
        except Exception as e:  # noqa: BLE001 - logged; the next check retries
            self._error(f"stop marker check failed: {e!r}")
        if self.lease is None or not self.still_current():
            return
        if now - self._progress_at > self.stall_timeout_s:
            return  # the loop is hung: no heartbeat, so the process looks dead and gets replaced
        if self.clock() - now > self.interval_s and not self.still_current():
            # Paused since the lease check above (SIGSTOP, a suspended VM): a newer copy may have
            # taken over meanwhile, and an "alive" heartbeat on the stale answer would revive us.
            return
        try:
            self.store.write_heartbeat(self.lease, step=self._step, round=self._round_seen)
            self.heartbeats += 1
        except Exception as e:  # noqa: BLE001 - logged; the next interval retries
            self._error(f"heartbeat failed: {e!r}")

    def _fence(self, newest: int) -> None:
        assert self.lease is not None
        if not self.fenced:
            self.log(f"{self.holder}: incarnation {self.lease.incarnation} fenced by incarnation {newest}; exiting "
                     "without saving (the newer copy owns its work now)")
        self.fenced_by = max(self.fenced_by, newest)
        self.request_exit("fenced", f"fenced by incarnation {newest}")

    def _error(self, text: str) -> None:
        self.errors += 1
        if self.errors <= 5 or self.errors % 100 == 0:
            self.log(f"{self.holder}: {text} ({self.errors} lifecycle errors so far)")


@contextlib.contextmanager
def sigterm_flag(on_sigterm: Callable[[], None], *, enabled: bool = True) -> Iterator[bool]:
    """Within the block, SIGTERM calls ``on_sigterm()`` (and nothing else: no exception is raised
    in the middle of a step). Installed only in the main thread (signals cannot be handled
    elsewhere) and when ``enabled``; the previous handler is restored on exit. Yields whether
    the handler was installed.

    Under a Prefect flow run this replaces Prefect's own SIGTERM bridge (which would raise
    ``TerminationSignal`` wherever the main thread happens to be) for the duration of the block:
    see docs/prefect.md for what a Cancel then does.
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield False
        return

    def handler(signum: int, frame: Any) -> None:
        on_sigterm()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread of the main interpreter after all
        yield False
        return
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the launching process ``parent_pid`` dies (an island's
    ranks fail as a unit; a user's script dies with its learner flow)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: rank 0 also watches its parent pid in the loop
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
