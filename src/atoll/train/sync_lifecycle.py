"""A synchronizer process's knobs (:class:`SynchronizerOptions`) and its life in the bucket
(:class:`SynchronizerLifecycle`: the lease it holds, its heartbeats, the stop marker)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from atoll.core.fragments import FragmentGroup
from atoll.storage.liveness import Lease
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.storage.validation import TransientStorageError
from atoll.train.lease import Fenced, RunStopped

__all__ = ["SynchronizerLifecycle", "SynchronizerOptions"]


@dataclass(frozen=True, kw_only=True)
class SynchronizerOptions:
    """Process-local knobs of one synchronizer process. Nothing here changes what is trained:
    the algorithm lives in the run's DilocoConfig and the round schedule in its recipe (run.json)."""

    poll_interval_s: float = 0.2
    """Longest sleep between two polls of an open round."""

    live_timeout_s: float | None = None
    """A learner not seen for this long is not 'live' (for early close). None: max(5 s, 3 H step
    times), 30 s before a step time is measured."""

    synchronizer_id: str = "synchronizer"
    """Written into every commit record (who won the round)."""

    device: str = "cpu"
    """Where merges and outer steps run: 'cpu' (default), 'auto', 'cuda', 'cuda:N', 'mps'. The
    synchronizer's state stays on the host; each round moves its inputs to this device and the
    new fragment and momentum back (one copy each). Outer-step math is fp32 on any device."""

    heartbeat_interval_s: float = 5.0
    """Once the synchronizer holds a lease: at most this often, a poll heartbeats and checks the
    stop marker and for a newer synchronizer lease."""

    fragment_group: FragmentGroup = FragmentGroup()
    """Which fragments this process merges. The default, 0/1, is all of them: one synchronizer
    for the run. ``FragmentGroup(g, G)`` makes it merger g of a split synchronizer of G
    processes: it merges and commits only the rounds of fragments p with p mod G = g, and takes
    its turn on the commit chain (round r's record after round r - 1's, whoever committed that);
    each merger holds a lease of its own group (docs/training.md, "A split synchronizer")."""

    peer_timeout_s: float = 30.0
    """A split synchronizer's merger whose next record waits on another group's round commits
    that round as one that merged nothing once, for this long, neither the chain grew nor that
    group's merger heartbeated (on this process's clock: its lease is gone or frozen). The
    round's contributions stay unconsumed: that fragment's next round lists them again."""

    pipeline_commits: bool = True
    """:func:`run_synchronizer` overlaps rounds: it polls and merges the next round (another
    fragment) while a committer thread writes the previous one's payloads and record
    (:mod:`atoll.train.commit_pipeline`). False: each round is committed before the next one
    opens. Either way the bucket ends up with the same commits, and a restart resumes the same."""


class SynchronizerLifecycle:
    """What :class:`~atoll.train.synchronizer.Synchronizer` does for its lease: take or keep
    one, heartbeat, and stop when the stop marker or a newer synchronizer says so."""

    store: SynchronizerStore
    options: SynchronizerOptions
    round: int
    """The latest round this synchronizer holds (each heartbeat names it)."""

    def _hold_nothing(self) -> None:
        self.lease: Lease | None = None
        """The synchronizer lease this object holds (None: none; nothing lifecycle-related happens)."""
        self._life_checked_at: float | None = None
        self._kept_alive_at: float | None = None
        self.heartbeat_errors = 0

    def hold_lease(self, flow_run_id: str | None = None, *, lease: Lease | None = None) -> Lease:
        """Take the synchronizer's next lease (fencing older synchronizers), or keep holding
        ``lease`` (one this process took before, e.g. when the synchronizer object is rebuilt
        after a failed round). Writes a first heartbeat. From now on :meth:`poll` heartbeats and
        raises RunStopped / Fenced."""
        if lease is None:
            lease = self.store.take_synchronizer_lease(flow_run_id=flow_run_id, group=self._lease_group())
        self.lease = lease
        self._life_checked_at = None
        self.check_lifecycle(force=True)
        return lease

    def check_lifecycle(self, *, force: bool = False) -> None:
        """With a lease, at most every ``heartbeat_interval_s`` (always when ``force``): raise
        RunStopped if the stop marker says stopped, Fenced if a newer synchronizer lease exists,
        else heartbeat. Without a lease: nothing."""
        lease = self.lease
        if lease is None:
            return
        now = time.monotonic()
        if (not force and self._life_checked_at is not None
                and now - self._life_checked_at < self.options.heartbeat_interval_s):
            return
        self._life_checked_at = now
        marker = self.store.stop_marker()
        if marker is not None and marker.stopped:
            raise RunStopped(marker, self.store.url)
        newest = self.store.current_synchronizer_incarnation(self._lease_group())
        if newest > lease.incarnation:
            raise Fenced(lease.holder, lease.incarnation, newest)
        try:
            self.store.write_heartbeat(lease, round=self.round)
        except (TransientStorageError, OSError):  # a missed heartbeat is not a failed round
            self.heartbeat_errors += 1

    def keep_alive(self) -> None:
        """With a lease, at most every ``heartbeat_interval_s``: heartbeat, nothing else. For a
        split synchronizer's merger waiting for its turn on the commit chain (maybe on the commit
        pipeline's thread): its peers must see it alive, or they fill its rounds; the checks that
        stop it (stop marker, fencing) come at its next poll."""
        lease = self.lease
        now = time.monotonic()
        if lease is None or (self._kept_alive_at is not None
                             and now - self._kept_alive_at < self.options.heartbeat_interval_s):
            return
        self._kept_alive_at = now
        try:
            self.store.write_heartbeat(lease, round=self.round)
        except (TransientStorageError, OSError):
            self.heartbeat_errors += 1

    def _lease_group(self) -> tuple[int, int] | None:
        """The fragment group whose leases this synchronizer holds (None: the whole run's)."""
        group = self.options.fragment_group
        return None if group.whole else (group.index, group.count)

    def exit_heartbeat(self, reason: str) -> None:
        """Final ``status="exited"`` heartbeat (best effort; not after being fenced)."""
        if self.lease is None:
            return
        try:
            self.store.write_heartbeat(self.lease, status="exited", reason=reason, round=self.round)
        except Exception:  # noqa: BLE001 - the process is exiting anyway
            self.heartbeat_errors += 1
