"""A split synchronizer's turn on the commit chain: the rounds of the other fragment groups.

A synchronizer can be split into G merger processes (``SynchronizerOptions.fragment_group``):
merger g merges and commits the rounds of the fragments p with p mod G = g, so rounds of
different groups merge at the same time in different processes (or machines). The chain stays
one chain: round r's record names round r - 1's and carries its state table forward, so a
merger creates round r's record only once round r - 1's is in the bucket, whoever committed it,
and create-once writes keep every slot to one winner. No sequencer process: the chain passes
from one merger to the next in round order, and the merger that is due always can commit (its
predecessor's record exists by definition).

:class:`PeerRounds` is that wait. If the round it waits for belongs to a merger that is gone
(for ``peer_timeout_s`` neither the chain grew nor that group's merger heartbeated, on this
process's clock), it commits that round as one that merged nothing, carrying the state table
and timings forward: the chain moves on, the round's contributions stay unconsumed (the
fragment's next round lists them again), and a merger that was only slow loses the create-once
race and adopts the record, as a racing synchronizer does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from atoll.core.fragments import FragmentGroup
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.storage.validation import RoundOrderError
from atoll.train.run import RoundSchedule

__all__ = ["PeerRounds"]

LIVENESS_CHECK_S = 1.0
"""How often, at most, a waiting merger reads the awaited group's lease and heartbeat."""


class PeerRounds:
    """Waits for the rounds other fragment groups commit; fills one whose merger is gone."""

    def __init__(self, store: SynchronizerStore, group: FragmentGroup, *, num_fragments: int, timeout_s: float,
                 poll_s: float, committed_by: str, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 keep_alive: Callable[[], None] = lambda: None) -> None:
        self.store, self.group, self.num_fragments = store, group, num_fragments
        self.keep_alive = keep_alive
        """Called on every pass of a wait: the waiting merger's own heartbeat (rate-limited by it),
        so that its peers, waiting on it in turn, do not take it for gone."""
        self.timeout_s, self.poll_s, self.committed_by = timeout_s, poll_s, committed_by
        self.clock, self.sleep = clock, sleep
        self.filled: list[int] = []
        """Rounds this merger committed for a gone peer (merged nothing), in order."""

    def owner(self, round_: int) -> FragmentGroup:
        return self.group.owner_of((round_ - 1) % self.num_fragments)

    def past_theirs(self, round_: int, schedule: RoundSchedule) -> int:
        """Where a merger at ``round_`` stands once it moves past the next rounds of other groups:
        theirs to merge and commit (never past the schedule's last round). Its next round is then
        its own, whose record waits for theirs (:meth:`await_through`)."""
        while self.owner(round_ + 1) != self.group and not schedule.is_last(round_):
            round_ += 1
        return round_

    def await_through(self, through: int, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Wait until round ``through`` is committed in the bucket: True then, False if
        ``cancelled()`` first (the caller is shutting down) or the run's stop marker says stopped
        (the other mergers exit too): nothing is filled then. Only other groups' rounds may be
        missing: one of this merger's own is a broken order (RoundOrderError)."""
        seen: tuple[object, ...] | None = None
        quiet_since = checked_at = self.clock()
        while (latest := self.store.latest_round()) < through:
            if cancelled():
                return False
            due = latest + 1
            owner = self.owner(due)
            if owner == self.group:
                raise RoundOrderError(f"round {due} is this merger's ({self.group}) and not committed: "
                                      f"cannot chain round {through + 1}")
            now = self.clock()
            if seen is None or seen[0] != latest or now - checked_at >= LIVENESS_CHECK_S:
                if self._stopped():
                    return False  # a stopped run's mergers exit; nothing is filled
                sign = (latest, *self._sign_of_life(owner))
                checked_at = now
                if sign != seen:
                    seen, quiet_since = sign, now
            self.keep_alive()
            if now - quiet_since >= self.timeout_s:
                self._fill(due, owner, quiet_s=now - quiet_since)
                seen = None
                continue
            self.sleep(self.poll_s)
        return True

    def _stopped(self) -> bool:
        marker = self.store.stop_marker()
        return marker is not None and marker.stopped

    def _sign_of_life(self, owner: FragmentGroup) -> tuple[object, ...]:
        """What changes while ``owner``'s merger lives: its newest lease and that lease's heartbeat."""
        life = self.store.synchronizer_liveness((owner.index, owner.count))
        hb = life.heartbeat
        alive = hb is not None and hb.status == "alive"
        return (life.newest, life.heartbeat_stored_at if alive else None, hb.time if alive and hb else None)

    def _fill(self, round_: int, owner: FragmentGroup, *, quiet_s: float) -> None:
        """Commit ``round_`` (``owner``'s) as a round that merged nothing (a racing commit may win)."""
        before = self.store.read_commit(round_ - 1) if round_ > 1 else None
        fragment = (round_ - 1) % self.num_fragments
        result = self.store.commit_round(
            round_, fragment, params=None, timings=before.timings if before is not None else None,
            stats={"filled_for_group": str(owner), "filled_after_s": round(quiet_s, 3)},
            committed_by=self.committed_by)
        if result.won:
            self.filled.append(round_)
