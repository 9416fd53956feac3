"""The synchronizer loop: poll the bucket, close rounds by quorum + grace, merge, outer step, commit.

Round r synchronizes fragment ``(r - 1) mod P``; rounds are strictly sequential, and each one is
a create-once commit in the bucket, so a synchronizer restarted at any point reads the latest
committed round and simply carries on with the next one: a round is never lost or repeated. If
two synchronizers race on a round, exactly one commit wins and the loser adopts the winner's.

Which contributions a round considers: those for its fragment computed against the fragment's
current version or the one before it (a learner may have published just before it saw the new
version; its delta is re-anchored, never applied as if fresh), not already merged or rejected by
an earlier round, and the newest one per learner. Anything older is stale: the learner has
since overwritten that work with a newer global version. Before that, the trust checks of
:mod:`atoll.train.trust` judge each record (fenced incarnations, impossible counters, counters
clipped to what the learner was observed to do).

Each round reads as its algorithm: :meth:`Synchronizer.poll` (list, screen, decide by quorum +
grace), then :meth:`Synchronizer.close` (merge on the synchronizer's device,
:mod:`atoll.train.merge_device`; evaluate; the round's stats and timings,
:mod:`atoll.train.round_stats`; commit; advance or adopt the winner's commit).

Compressed downlink (``DilocoConfig.downlink_compression`` bf16 or int4): the synchronizer keeps
its fp32 master (what it merges into, resumes from and checkpoints) and also tracks the learners'
*view* of every fragment; each new version is published with its update against that view and
the view it leads to (:mod:`atoll.core.downlink`: error feedback, so the learners' copy stays
within one quantization error of the master). The views are read back from the bucket on resume.

Once it holds a lease (:meth:`Synchronizer.hold_lease`, which :func:`run_synchronizer` does),
every :meth:`Synchronizer.poll` also heartbeats (at most every ``heartbeat_interval_s``) and
raises :class:`~atoll.train.lease.RunStopped` if the run's stop marker says stopped, or
:class:`~atoll.train.lease.Fenced` if a newer synchronizer took a lease.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from atoll.core.compress import encoded_nbytes
from atoll.core.downlink import DownlinkStep, downlink_step
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.quorum import Arrival, QuorumDecision, TimingEma, decide_round
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.retry import ROUND_RETRY
from atoll.core.synchronize import FragmentRoundResult, MergePolicy
from atoll.core.weights import Counters
from atoll.storage.integrity import IntegrityError
from atoll.storage.liveness import Lease
from atoll.storage.reader import GlobalState
from atoll.storage.records import CommitRecord, ContributionRecord
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.storage.validation import InvalidInput, RoundOrderError, TransientStorageError
from atoll.storage.wire import WireCounts
from atoll.train.device import resolve_device
from atoll.train.lease import Fenced, RunStopped
from atoll.train.merge_device import FragmentMerger, fragment_bases
from atoll.train.round_stats import (
    RoundPoll,
    RoundSummary,
    accepted_contributions,
    next_timings,
    recorded_rejections,
    round_stats,
    skipped_by_learner,
)
from atoll.train.run import RoundSchedule
from atoll.train.trust import ContributionScreen, token_bounds_of

__all__ = ["SynchronizerOptions", "Synchronizer", "RoundPoll", "RoundSummary", "run_synchronizer"]

Evaluate = Callable[[Mapping[str, torch.Tensor]], float]


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


class Synchronizer:
    """The synchronizer's state machine; :meth:`tick` does one poll and maybe one commit."""

    def __init__(
        self,
        store: SynchronizerStore,
        *,
        options: SynchronizerOptions | None = None,
        evaluate: Evaluate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.options = options or SynchronizerOptions()
        self.evaluate = evaluate
        self.clock = clock
        self.config = store.config
        self.plan = store.plan
        self.schedule = RoundSchedule.of(store)
        self.policy = self.config.quorum_policy(poll_interval_s=self.options.poll_interval_s)
        self.merge_policy = MergePolicy.from_config(self.config, embedding_names=self.plan.embedding_names)
        self.token_bounds = token_bounds_of(store)
        self.device = resolve_device(self.options.device, knob="SynchronizerOptions.device")
        self.screen = ContributionScreen(
            store, offsets=self.plan.offsets, inner_steps=self.config.inner_steps,
            num_fragments=self.plan.num_fragments, max_learner_speedup=self.config.max_learner_speedup,
            token_bounds=self.token_bounds, started_at_s=clock())
        """The trust checks on contribution records, and what this synchronizer observed of learners."""
        self._weighed: dict[str, Counters] = {}  # this round's counters as weighed (clipped)
        self._load(store.latest_round())
        self._opened: tuple[int, float] | None = None  # (round, opened_at_s)
        self._rounds_closed = 0
        self.lease: Lease | None = None
        """The synchronizer lease this object holds (None: none; nothing lifecycle-related happens)."""
        self._life_checked_at: float | None = None
        self.heartbeat_errors = 0
        self._wire_mark = store.store.wire_counts()

    # -- lease, heartbeat, stop ----------------------------------------------------------------
    def hold_lease(self, flow_run_id: str | None = None, *, lease: Lease | None = None) -> Lease:
        """Take the synchronizer's next lease (fencing older synchronizers), or keep holding
        ``lease`` (one this process took before, e.g. when the synchronizer object is rebuilt
        after a failed round). Writes a first heartbeat. From now on :meth:`poll` heartbeats and
        raises RunStopped / Fenced."""
        if lease is None:
            lease = self.store.take_synchronizer_lease(flow_run_id=flow_run_id)
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
        newest = self.store.current_synchronizer_incarnation()
        if newest > lease.incarnation:
            raise Fenced(lease.holder, lease.incarnation, newest)
        try:
            self.store.write_heartbeat(lease, round=self.round)
        except (TransientStorageError, OSError):  # a missed heartbeat is not a failed round
            self.heartbeat_errors += 1

    def exit_heartbeat(self, reason: str) -> None:
        """Final ``status="exited"`` heartbeat (best effort; not after being fenced)."""
        if self.lease is None:
            return
        try:
            self.store.write_heartbeat(self.lease, status="exited", reason=reason, round=self.round)
        except Exception:  # noqa: BLE001 - the process is exiting anyway
            self.heartbeat_errors += 1

    # -- state -------------------------------------------------------------------------------
    def _load(self, round_: int) -> None:
        """(Re)load everything from the bucket as of committed round ``round_``."""
        state = self.store.read_global_state(round_)
        self.round = state.round
        self.versions = list(state.versions)
        self.fragments = [self.plan.select(state.params, p) for p in range(self.plan.num_fragments)]
        self.merger = FragmentMerger(self.device, self.merge_policy, num_fragments=self.plan.num_fragments,
                                     outer_lr=self.config.outer_lr, outer_momentum=self.config.outer_momentum)
        """Merges on this synchronizer's device, with the buffers they recycle and the norm history."""
        self.optimizers = []
        for p in range(self.plan.num_fragments):
            opt = NesterovOuterOptimizer(lr=self.config.outer_lr, momentum=self.config.outer_momentum)
            opt.load_state_dict(state.momentum.get(p, {}))
            self.optimizers.append(opt)
        timings = dict(state.timings or {})
        self.ema = TimingEma.from_dict(timings) if timings else TimingEma(decay=self.config.ema_decay)
        self._load_views(state)
        # Keys consumed by recent rounds (older contributions are never listed again).
        self.consumed: set[str] = set()
        self._consumed_by_round: deque[tuple[int, set[str]]] = deque()
        for r in range(max(1, round_ - 2 * self.plan.num_fragments + 1), round_ + 1) if round_ else []:
            try:
                rec = self.store.read_commit(r)
            except IntegrityError:
                continue  # a void slot consumed nothing we can know of
            if rec is not None:
                self._consume(rec)
                self.merger.remember_norm(rec.fragment, rec.stats.get("update_norm") if rec.updated else None)

    def _load_views(self, state: GlobalState) -> None:
        """The learners' view of every fragment as of ``state`` (a compressed downlink only: the
        published views; a fragment that never published one is held as its master). A view
        that does not read is replaced by the master, and that fragment's next version is
        published without an update (learners read its view in full): nobody holds our stand-in."""
        self.views: list[dict[str, torch.Tensor]] | None = None
        self._unchained: set[int] = set()
        if self.config.downlink_compression == "fp32":
            return
        held = self.store.read_global_state(state.round, momentum=False, view=True)
        self.views = [self.plan.select(held.params, p) for p in range(self.plan.num_fragments)]
        self._unchained = set(held.restored)

    def _downlink(self, p: int, result: FragmentRoundResult | None) -> DownlinkStep | None:
        """The new version's compressed update against the learners' view, and the view it leads to."""
        if self.views is None or result is None:
            return None
        return downlink_step(result.new_params, self.views[p], self.config.downlink_compression,
                             block_size=self.config.compression_block_size)

    def _consume(self, rec: CommitRecord, unlisted: Mapping[str, Rejection] | None = None) -> None:
        """Mark the round's merged and finally rejected keys used up; ``unlisted``: rejections
        this synchronizer decided but left out of the record (counted there instead)."""
        keys = {a.key for a in rec.accepted}
        # A contribution that was merely late for a round is not used up: the next round of its
        # fragment considers it again (re-anchored). Every other rejection is final.
        keys.update(k for k, why in rec.rejected.items() if why.final)
        keys.update(k for k, why in (unlisted or {}).items() if why.final)
        self.consumed.update(keys)
        # Bounded: a round lists only the current and previous version of its fragment, so keys
        # consumed more than 2P rounds ago can never be listed again (100,000 rounds stay small).
        self._consumed_by_round.append((rec.round, keys))
        horizon = rec.round - 2 * self.plan.num_fragments - 1
        while self._consumed_by_round and self._consumed_by_round[0][0] < horizon:
            self.consumed.difference_update(self._consumed_by_round.popleft()[1])

    def _listed_versions(self, p: int) -> set[int]:
        """The versions of fragment ``p`` a round lists contributions against: the current one and
        the one before it (when what came before can be told)."""
        c = self.versions[p]
        if c == 0:
            return {c}
        try:
            before = self.store.read_commit(c - 1) if c > 1 else None
        except IntegrityError:
            return {c}  # cannot tell what came before: only the current version is a valid base
        return {c, before.versions[p] if before is not None else 0}

    @property
    def finished(self) -> bool:
        return self.schedule.is_last(self.round)

    def fragment_of_round(self, round_: int) -> int:
        return (round_ - 1) % self.plan.num_fragments

    def _live_learners(self, now: float) -> set[str]:
        timeout = self.options.live_timeout_s
        if timeout is None:
            step = self.ema.get("step_s")
            timeout = max(5.0, 3 * self.config.inner_steps * step) if step else 30.0
        return self.screen.live_learners(now, timeout)

    # -- one poll ----------------------------------------------------------------------------
    def poll(self) -> RoundPoll | RoundSummary:
        """Look at the open round once: list its contributions and ask core's quorum/grace policy.

        Returns a :class:`RoundPoll` (``poll.decision.close`` says whether to :meth:`close` it now)
        or, if another synchronizer already committed this round, the adopted RoundSummary.
        Reads top to bottom: open, adopt a commit already made, list, screen, weigh, decide.
        """
        self.check_lifecycle()
        r = self.round + 1
        p = self.fragment_of_round(r)
        now = self.clock()
        opened_at = self._open_round(r, now)
        existing = self._committed(r)
        if existing is not None:
            return self._adopt(existing)
        listing = self.store.list_contributions(p, self._listed_versions(p))
        screened = self.screen.screen([rec for rec in listing.records if rec.key not in self.consumed], r, now)
        rejected = {**{k: v for k, v in listing.rejected.items() if k not in self.consumed}, **screened.rejected}
        live = self._live_learners(now)
        candidates = screened.candidates
        self._weighed = {rec.key: self.screen.weighed_counters(rec) for rec in candidates.values()}
        arrivals = [
            Arrival(learner_id=rec.learner_id, arrived_at_s=self.screen.first_seen(rec.key),
                    c_steps=self._weighed[rec.key].c_steps, c_tokens=self._weighed[rec.key].c_tokens, key=rec.key)
            for rec in candidates.values()
        ]
        decision = decide_round(
            now_s=now, opened_at_s=opened_at, arrivals=arrivals, live_learners=live,
            policy=self.policy, timings=self.ema.estimates(),
        )
        return RoundPoll(
            round=r, fragment=p, decision=decision, opened_at_s=opened_at, polled_at_s=now,
            accepted={a.key: candidates[a.learner_id] for a in decision.accepted},
            rejected={**rejected, **{a.key: why for a, why in decision.rejected}},
            skipped=skipped_by_learner(listing.skipped),
        )

    def _open_round(self, round_: int, now: float) -> float:
        """When round ``round_`` opened: ``now`` on its first poll, which starts its listings afresh."""
        if self._opened is None or self._opened[0] != round_:
            self._opened = (round_, now)
            self.screen.open_round()
        return self._opened[1]

    def _committed(self, round_: int) -> CommitRecord | None:
        """Round ``round_``'s commit, if someone else (a racing or previous incarnation) made it
        already. A slot holding something that does not verify is void: we close the round
        ourselves and commit_round writes the repair record (the forged or corrupt object is
        never used)."""
        try:
            return self.store.read_commit(round_)
        except IntegrityError:
            return None

    # -- one close ---------------------------------------------------------------------------
    def close(self, poll: RoundPoll) -> RoundSummary:
        """Merge the accepted contributions of a closing poll, take the outer step and commit.

        Reads top to bottom: merge (on a copy of the outer optimizer), account, evaluate, time,
        commit; then either advance to the committed state or adopt the winner's.
        """
        if not poll.decision.close:
            raise ValueError(f"round {poll.round} is still open: {poll.decision.reason}")
        if poll.round != self.round + 1:
            raise ValueError(f"poll is for round {poll.round} but the next round is {self.round + 1}")
        self.check_lifecycle()
        r, p = poll.round, poll.fragment
        rejected = dict(poll.rejected)
        result, opt = self._merge(p, poll.accepted, rejected)
        merged_at = self.clock()
        accepted = accepted_contributions(poll.accepted, result, weighed=self._weighed)
        for key in poll.accepted:  # accepted by the quorum rule but not by the merge: say so
            if result is None or key not in result.weights:
                rejected.setdefault(key, Rejection(RejectionKind.NOT_MERGED, "left out of the merge"))
        val_loss = self._evaluate(r, p, result)
        evaluated_at = self.clock()
        downlink = self._downlink(p, result)
        sent = self.store.store.wire_counts()  # this round's traffic ends here: its commit counts in the next
        stats = round_stats(poll, accepted, result, val_loss=val_loss,
                            fragment_numel=self.plan.fragment_numel(p), wire=sent - self._wire_mark,
                            downlink_bytes=None if downlink is None else
                            sum(encoded_nbytes(e) for e in downlink.update.values()))
        self._wire_mark = sent
        stats["merge_s"], stats["eval_s"] = round(merged_at - poll.polled_at_s, 4), round(evaluated_at - merged_at, 4)
        timings = next_timings(self.ema, poll, sync_s=self.clock() - poll.polled_at_s,
                               steady=self._rounds_closed > 0, observed=self.screen.observed.cadences())
        listed, unlisted = recorded_rejections(poll, rejected, stats, self._weighed)
        commit = self.store.commit_round(
            r, p, params=result.new_params if result is not None else None,
            momentum=opt.state_dict() if result is not None else None,
            accepted=accepted, rejected=listed, timings=timings.to_dict(), stats=stats,
            committed_by=self.options.synchronizer_id, downlink=downlink, downlink_chained=p not in self._unchained,
        )
        if not commit.won:
            return self._adopt(commit.record)
        self._advance(commit.record, result, opt, timings, downlink, unlisted)
        if self.schedule.checkpoints(r):
            self.store.write_checkpoint(r)
        # The round's phases on this synchronizer's clock, for the round's flow run in the UI.
        phases = {"opened_at_s": poll.opened_at_s, "quorum_at_s": poll.decision.quorum_at_s,
                  "closed_at_s": poll.polled_at_s, "merged_at_s": merged_at, "evaluated_at_s": evaluated_at,
                  "committed_at_s": self.clock()}
        return RoundSummary(record=commit.record, won=True, decision=poll.decision, val_loss=val_loss,
                            info={"phases": phases})

    def round_wire(self) -> WireCounts:
        """What this synchronizer's store sent since its previous commit (or since it started):
        the open round's polls, reads, merge inputs, new fragment and heartbeats, and the previous
        commit's record and head (a commit record cannot count its own bytes)."""
        return self.store.store.wire_counts() - self._wire_mark

    def tick(self) -> RoundSummary | QuorumDecision:
        """Poll once and close if the policy says so. Returns a RoundSummary if a round committed."""
        polled = self.poll()
        if isinstance(polled, RoundSummary):
            return polled
        if not polled.decision.close:
            return polled.decision
        return self.close(polled)

    def _merge(
        self, p: int, accepted: Mapping[str, ContributionRecord], rejected: dict[str, Rejection]
    ) -> tuple[FragmentRoundResult | None, NesterovOuterOptimizer]:
        """Load the accepted deltas (bad payloads join ``rejected``) and merge them into fragment
        ``p`` with one outer step, on a copy of the optimizer: if another synchronizer wins the
        commit, ours is discarded."""
        contributions, bad = self.store.load_contributions(accepted.values())
        rejected.update(bad)
        contributions = [dataclasses.replace(c, counters=self._weighed[c.key]) if c.key in self._weighed else c
                         for c in contributions]
        # A fixed merge order makes a round's result independent of arrival order (bit for bit).
        contributions.sort(key=lambda c: (c.learner_id, c.key))
        opt = self.merger.optimizer_copy(p, self.optimizers[p])
        if not contributions:
            return None, opt
        bases = fragment_bases(self.store, p, version=self.versions[p], current=self.fragments[p],
                               contributions=contributions)
        result = self.merger.merge(p, current=self.fragments[p], bases=bases, contributions=contributions,
                                   optimizer=opt, reasons=rejected)
        if result is not None:
            rejected.update(result.rejected)
        return result, opt

    def _evaluate(self, r: int, p: int, result: FragmentRoundResult | None) -> float | None:
        """Validation loss of the global model after round ``r``, when the schedule asks for it."""
        if self.evaluate is None or not self.schedule.evaluates(r):
            return None
        params = {n: t for frag in self.fragments for n, t in frag.items()}
        if result is not None:
            params.update(result.new_params)
        return float(self.evaluate(params))

    def _advance(self, record: CommitRecord, result: FragmentRoundResult | None,
                 opt: NesterovOuterOptimizer, timings: TimingEma, downlink: DownlinkStep | None = None,
                 unlisted: Mapping[str, Rejection] | None = None) -> None:
        """Our commit won: make its state ours."""
        self.round = record.round
        self._rounds_closed += 1
        self.screen.saw_commit(record.round, self.clock())
        if result is not None:
            p = record.fragment
            self.merger.retire(p, self.fragments[p], self.optimizers[p])
            self.versions[p] = record.round
            self.fragments[p] = {n: t.float() for n, t in result.new_params.items()}
            self.optimizers[p] = opt
            if self.views is not None and downlink is not None:
                self.views[p] = downlink.view  # new tensors: never one of the recycled master buffers
                self._unchained.discard(p)
        self.ema = timings
        self._consume(record, unlisted)
        if result is not None:
            self.merger.remember_norm(record.fragment, result.update_norm)

    def _adopt(self, record: CommitRecord) -> RoundSummary:
        """Another synchronizer committed this round first: take its state, not ours.

        With a lease, first make sure that other synchronizer is not a newer incarnation: a
        synchronizer that wakes up (a frozen process thawed) to find its round committed by its
        replacement is fenced (raises Fenced), and does not report the round as its own."""
        self.check_lifecycle(force=True)
        self._load(record.round)
        self._consume(record)
        self.screen.saw_commit(record.round, self.clock())
        val = record.stats.get("val_loss")
        return RoundSummary(record=record, won=False, val_loss=float(val) if isinstance(val, int | float) else None)


def run_synchronizer(
    store: SynchronizerStore,
    *,
    options: SynchronizerOptions | None = None,
    evaluate: Evaluate | None = None,
    on_round: Callable[[RoundSummary], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    hold_lease: bool = True,
    flow_run_id: str | None = None,
) -> int:
    """Run rounds until the schedule's ``max_rounds`` is committed, ``should_stop()``, the run's
    stop marker says stopped, or a newer synchronizer fenced this one; returns the last round.

    ``hold_lease``: take the synchronizer's next lease first and heartbeat (see
    :meth:`Synchronizer.hold_lease`). Sleeps on atoll's own clock between polls (never longer
    than the decision's recheck time).
    """
    sync = Synchronizer(store, options=options, evaluate=evaluate)
    log(f"synchronizer: {store.url} at round {sync.round}; P={sync.plan.num_fragments} K={sync.config.min_quorum}")
    lease: Lease | None = None
    reason = "finished"
    try:
        if hold_lease:
            lease = sync.hold_lease(flow_run_id)
            log(f"synchronizer: took lease incarnation {lease.incarnation}")
        failures = 0
        while not sync.finished:
            if should_stop():
                reason = "should_stop"
                break
            try:
                out = sync.tick()
                failures = 0
            except (RoundOrderError, InvalidInput, TransientStorageError) as e:
                # Storage said no (bad data never raises here: it becomes a recorded rejection).
                # Bounded (core.retry.ROUND_RETRY): after the last attempt the process fails loudly
                # and whoever runs it restarts it from the bucket.
                failures += 1
                if ROUND_RETRY.exhausted(failures):
                    raise
                sync = _after_failed_round(sync, e, failures, lease=lease, log=log)
                continue
            _report_or_wait(sync, out, on_round=on_round, log=log)
    except RunStopped as e:
        log(f"synchronizer: {e}")
        reason = f"stopped: {e.marker.reason}"
    except Fenced as e:
        log(f"synchronizer: {e}; exiting")
        return sync.round  # the newer synchronizer owns sync/ now: write nothing more
    except BaseException as e:
        sync.exit_heartbeat(f"error: {type(e).__name__}: {e}")
        raise
    sync.exit_heartbeat(reason)
    return sync.round


def _after_failed_round(sync: Synchronizer, error: Exception, failures: int, *, lease: Lease | None,
                        log: Callable[[str], None]) -> Synchronizer:
    """Retry ``failures`` of a round storage refused: say so, back off, and rebuild the
    synchronizer from the bucket (still holding this process's ``lease``)."""
    log(f"synchronizer: round {sync.round + 1}: {error}; retry {failures} of {ROUND_RETRY.attempts - 1}")
    time.sleep(ROUND_RETRY.delay_s(failures - 1))
    rebuilt = Synchronizer(sync.store, options=sync.options, evaluate=sync.evaluate, clock=sync.clock)
    if lease is not None:
        rebuilt.hold_lease(lease=lease)
    return rebuilt


def _report_or_wait(sync: Synchronizer, out: RoundSummary | QuorumDecision, *,
                    on_round: Callable[[RoundSummary], None] | None, log: Callable[[str], None]) -> None:
    """A committed round is logged and handed to ``on_round``; an open one is polled again after
    the decision's recheck time (at least 5 ms, at most one poll interval)."""
    if isinstance(out, RoundSummary):
        log(out.line())
        if on_round is not None:
            on_round(out)
        return
    wait = (out.recheck_at_s or 0) - sync.clock()
    time.sleep(min(max(wait, 0.005), sync.options.poll_interval_s))
