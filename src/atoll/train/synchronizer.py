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
:mod:`atoll.train.merge_device`; the round's stats and timings,
:mod:`atoll.train.round_stats`; commit; advance or adopt the winner's commit).

Compressed downlink (``DilocoConfig.downlink_compression`` bf16 or int4): the synchronizer keeps
its fp32 master (what it merges into, resumes from and checkpoints) and also tracks the learners'
*view* of every fragment; each new version is published with its update against that view and
the view it leads to (:mod:`atoll.core.downlink`: error feedback, so the learners' copy stays
within one quantization error of the master). The views are read back from the bucket on resume.

Pipelined commits (``SynchronizerOptions.pipeline_commits``, on by default): the loop of
:func:`run_synchronizer` calls :meth:`Synchronizer.step`, which hands each merged round to a
:class:`~atoll.train.commit_pipeline.CommitPipeline` (:meth:`Synchronizer.hand_over`) and goes on
to the next round (another fragment) while the round's downlink update is encoded and its
payloads and record are written; records
stay strictly ordered and create-once, and a crash at any point resumes as an uninterrupted run
would (the rules are in that module). The training run's recorded rounds hand over the same way
(``TrainingRunOptions.pipeline_commits``) and report rounds as they land (:meth:`Synchronizer.landed`).
:meth:`Synchronizer.tick` and :meth:`Synchronizer.close` commit before they return, for drivers
that read the bucket between rounds (round flow runs of their own, the virtual run, tests).

Once it holds a lease (:meth:`Synchronizer.hold_lease`, which :func:`run_synchronizer` does),
every :meth:`Synchronizer.poll` also heartbeats (at most every ``heartbeat_interval_s``) and
raises :class:`~atoll.train.lease.RunStopped` if the run's stop marker says stopped, or
:class:`~atoll.train.lease.Fenced` if a newer synchronizer took a lease.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import torch

from atoll.core.compress import encoded_size
from atoll.core.downlink import downlink_step
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.quorum import Arrival, QuorumDecision, TimingEma, decide_round
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.synchronize import FragmentRoundResult, MergePolicy
from atoll.core.weights import Counters
from atoll.storage.integrity import IntegrityError
from atoll.storage.reader import GlobalState
from atoll.storage.records import AcceptedContribution, CommitRecord, ContributionRecord
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.storage.wire import WireCounts
from atoll.train.commit_pipeline import ClosedRound, CommitPipeline, Landed, PendingDownlink
from atoll.train.device import resolve_device
from atoll.train.merge_device import FragmentMerger, fragment_bases
from atoll.train.peer_rounds import PeerRounds
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
from atoll.train.sync_lifecycle import SynchronizerLifecycle, SynchronizerOptions
from atoll.train.trust import ContributionScreen, token_bounds_of

__all__ = ["SynchronizerOptions", "Synchronizer", "RoundPoll", "RoundSummary"]


class Synchronizer(SynchronizerLifecycle):
    """The synchronizer's state machine; :meth:`tick` does one poll and maybe one commit."""

    def __init__(
        self,
        store: SynchronizerStore,
        *,
        options: SynchronizerOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.options = options or SynchronizerOptions()
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
            token_bounds=self.token_bounds, started_at_s=clock(), max_step_share=self.config.max_step_share)
        """The trust checks on contribution records, and what this synchronizer observed of learners."""
        self._weighed: dict[str, Counters] = {}  # this round's counters as weighed (clipped)
        self._hold_nothing()
        self.group = self.options.fragment_group
        """The fragments this process merges (all of them unless the synchronizer is split)."""
        self.peers = None if self.group.whole else PeerRounds(
            store, self.group, num_fragments=self.plan.num_fragments, timeout_s=self.options.peer_timeout_s,
            poll_s=min(self.options.poll_interval_s, 0.05), committed_by=self.options.synchronizer_id,
            keep_alive=self.keep_alive)
        """A merger of a split synchronizer: its wait for the other groups' rounds (None: not split)."""
        self._load(store.latest_round())
        self._opened: tuple[int, float] | None = None  # (round, opened_at_s)
        self._rounds_closed = 0
        self._wire_mark = store.store.wire_counts()
        self._commits: CommitPipeline | None = None
        """The committer of :meth:`step` (started by its first hand-over)."""
        self.on_landed: Callable[[RoundSummary], None] | None = None
        """Told of each handed-over round this synchronizer won, on the commit pipeline's thread as
        it lands (:meth:`landed` reports it later, on the loop's): for a recorder that stamps the
        round's end as it happens. It must not block or raise."""
        self.on_state: Callable[[int, Callable[[], dict[str, torch.Tensor]]], None] | None = None
        """Told of each round as this synchronizer's state becomes that round's (at its merge; the
        commit may still be in flight), with a function that copies the whole model as of then:
        for an evaluator in this process (:meth:`~atoll.train.evaluator.Evaluator.offer`). Called on
        the loop's thread; it must not block."""
        self._failed: BaseException | None = None
        """A pipelined commit's error, raised at the next :meth:`step` or :meth:`landed` (after the rounds before it were reported)."""

    # -- state -------------------------------------------------------------------------------
    def _load(self, round_: int) -> None:
        """(Re)load everything from the bucket as of committed round ``round_``."""
        mine = self.group.fragments_of(self.plan.num_fragments)  # the state this process holds
        state = self.store.read_global_state(round_, fragments=mine)
        self.round = state.round
        self.versions = list(state.versions)
        self.fragments = [self.plan.select(state.params, p) if p in mine else {} for p in range(self.plan.num_fragments)]
        """Each fragment's master: this process's own (all unless split); another group's is empty."""
        sizes = [self.plan.fragment_numel(p) for p in range(self.plan.num_fragments)]
        self.merger = FragmentMerger(self.device, self.merge_policy, fragment_numel=sizes,
                                     keep_previous=self.config.master_snapshot_every > 2)
        """Merges on this synchronizer's device, with the buffers they recycle and the norm history."""
        for p, (version, values) in state.previous.items():  # rebuilt on the way: no second replay
            self.merger.hold_previous(p, version, values)
        self.optimizers = []
        for p in range(self.plan.num_fragments):
            opt = NesterovOuterOptimizer(lr=self.config.outer_lr, momentum=self.config.outer_momentum)
            opt.load_state_dict(state.momentum.get(p, {}))
            self.optimizers.append(opt)
        timings = dict(state.timings or {})
        self.ema = TimingEma.from_dict(timings) if timings else TimingEma(decay=self.config.ema_decay)
        self._load_views(state)
        if self.peers is not None:  # a merger of a split synchronizer: the other groups' rounds are theirs
            self.round = self.peers.past_theirs(self.round, self.schedule)
        # Keys consumed by recent rounds (older contributions are never listed again).
        self.consumed: set[str] = set()
        self._consumed_by_round: deque[tuple[int, set[str]]] = deque()
        for r in range(max(1, round_ - 2 * self.plan.num_fragments + 1), round_ + 1) if round_ else []:
            try:
                rec = self.store.read_commit(r)
            except IntegrityError:
                continue  # a void slot consumed nothing we can know of
            if rec is not None:
                self._consume(rec.round, rec.accepted, rec.rejected)
                self.merger.remember_norm(rec.fragment, rec.stats.get("update_norm") if rec.updated else None)
                self.screen.observed.recall(rec.stats.get("observed_step_s"))  # what was observed before

    def _load_views(self, state: GlobalState) -> None:
        """The learners' view of every fragment as of ``state`` (a compressed downlink only: the
        published views; a fragment that never published one is held as its master). A view
        that does not read is replaced by the master, and that fragment's next version is
        published without an update (learners read its view in full): nobody holds our stand-in."""
        self.views: list[dict[str, torch.Tensor]] | None = None
        self._pending_views: dict[int, PendingDownlink] = {}
        """Fragments whose newest view is a handed-over round's downlink step, not yet read back."""
        self._unchained: set[int] = set()
        if self.config.downlink_compression == "fp32":
            return
        mine = self.group.fragments_of(self.plan.num_fragments)  # the state this process holds
        held = self.store.read_global_state(state.round, momentum=False, view=True, fragments=mine)
        self.views = [self.plan.select(held.params, p) if p in mine else {} for p in range(self.plan.num_fragments)]
        self._unchained = set(held.restored)

    def _downlink(self, p: int, result: FragmentRoundResult | None) -> PendingDownlink | None:
        """The new version's compressed update against the learners' view, and the view it leads
        to: computed off the loop's path, by the commit's payload writer (PendingDownlink)."""
        if self.views is None or result is None:
            return None
        if p in self._pending_views:  # the previous version's step: its round has landed (rule 3)
            self.views[p] = self._pending_views.pop(p).result().view
        view, new, codec = self.views[p], result.new_params, self.config.downlink_compression
        block_size = self.config.compression_block_size
        return PendingDownlink(lambda: downlink_step(new, view, codec, block_size=block_size))

    def _consume(self, round_: int, accepted: Iterable[AcceptedContribution], rejected: Mapping[str, Rejection]) -> None:
        """Mark round ``round_``'s merged and finally rejected keys used up (``rejected``: those
        its record lists, and those this synchronizer decided but only counted there)."""
        keys = {a.key for a in accepted}
        # A contribution that was merely late for a round is not used up: the next round of its
        # fragment considers it again (re-anchored). Every other rejection is final.
        keys.update(k for k, why in rejected.items() if why.final)
        self.consumed.update(keys)
        # Bounded: a round lists only the current and previous version of its fragment, so keys
        # consumed more than 2P rounds ago can never be listed again (100,000 rounds stay small).
        self._consumed_by_round.append((round_, keys))
        horizon = round_ - 2 * self.plan.num_fragments - 1
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
        """The schedule's last round is committed (and no handed-over round is still in flight)."""
        return (self.schedule.is_last(self.round) and not self.in_flight()
                and (self.peers is None or self.store.latest_round() >= self.round))

    def _await_chain(self, round_: int, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Before round ``round_``'s record: every round before it is in the bucket (a split
        synchronizer's other groups commit theirs; :class:`~atoll.train.peer_rounds.PeerRounds`).
        False if ``cancelled()`` first."""
        return self.peers is None or self.peers.await_through(round_ - 1, cancelled)

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
        if self._commits is not None:  # the fragment's version must be committed before it is listed against
            self._commits.wait_landed(r - self.plan.num_fragments)
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
        self._weighed = self.screen.weighed(candidates.values())
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
        """Merge the accepted contributions of a closing poll, take the outer step and commit
        (before returning; rounds handed to the pipeline are drained first).

        Reads top to bottom: merge and account (:meth:`_closing`), commit; then either advance to
        the committed state or adopt the winner's. Validation loss is measured off this path, by
        :mod:`atoll.train.evaluator`.
        """
        if self._commits is not None:
            self.drain()
        closed = self._closing(poll)
        self._await_chain(closed.round)
        commit = closed.commit(self.store)
        if not commit.won:
            return self._adopt(commit.record)
        self._advance(closed)
        self.screen.saw_commit(closed.round, self.clock())
        if closed.checkpoint:
            self.store.write_checkpoint(closed.round, params=closed.state_copy)
        closed.phases["committed_at_s"] = self.clock()
        return _summary(closed, commit.record)

    def _closing(self, poll: RoundPoll) -> ClosedRound:
        """Merge (on a copy of the outer optimizer), account and time a closing poll: everything
        its commit and this synchronizer's next state need, nothing written yet."""
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
        downlink = self._downlink(p, result)
        sent = self.store.store.wire_counts()  # this round's traffic ends here: its commit counts in the next
        stats = round_stats(poll, accepted, result,
                            fragment_numel=self.plan.fragment_numel(p), wire=sent - self._wire_mark,
                            downlink_bytes=None if downlink is None or result is None else
                            sum(encoded_size(t.numel(), self.config.downlink_compression,
                                             block_size=self.config.compression_block_size)
                                for t in result.new_params.values()))
        self._wire_mark = sent
        stats["merge_s"] = round(merged_at - poll.polled_at_s, 4)
        stats["observed_step_s"] = self.screen.observed.observed_stats()  # read back by a restart
        timings = next_timings(self.ema, poll, sync_s=self.clock() - poll.polled_at_s,
                               steady=self._rounds_closed > 0, observed=self.screen.observed.cadences())
        listed, unlisted = recorded_rejections(poll, rejected, stats, self._weighed)
        # The round's phases on this synchronizer's clock, for the round's flow run in the UI.
        phases = {"opened_at_s": poll.opened_at_s, "quorum_at_s": poll.decision.quorum_at_s,
                  "closed_at_s": poll.polled_at_s, "merged_at_s": merged_at}
        return ClosedRound(
            round=r, fragment=p, after=self.versions[p], result=result, optimizer=opt, downlink=downlink,
            downlink_chained=p not in self._unchained, accepted=accepted, rejected=listed, unlisted=unlisted,
            timings=timings, stats=stats, committed_by=self.options.synchronizer_id,
            checkpoint=self.schedule.checkpoints(r), decision=poll.decision, phases=phases,
            state_copy=self._copy_after(p, result) if self.schedule.checkpoints(r) and self.peers is None else None,
            replay_masters=self.device.type == "cpu")

    def _copy_after(self, p: int, result: FragmentRoundResult | None) -> dict[str, torch.Tensor]:
        """A copy of the whole model as a round that merged ``result`` into fragment ``p`` leaves it."""
        return {n: t.clone() for q, f in enumerate(self.fragments)
                for n, t in (result.new_params if q == p and result is not None else f).items()}

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

    # -- pipelined rounds ----------------------------------------------------------------------
    def step(self) -> tuple[list[RoundSummary], QuorumDecision | None]:
        """The pipelined loop's step: report the rounds that landed, wait until the next round's
        fragment has no round in flight, poll once, and if the round closes, merge it and hand
        its commit to the pipeline (:meth:`hand_over`) without waiting for it.

        This synchronizer's state moves on at the hand-over (the next round merges on it); if
        the commit then fails or loses a race, the loop learns it here and the state is reloaded
        from the bucket (a loss is reported as an adopted round; an error is raised, after the
        rounds that landed before it). Returns the landed rounds, in order, and the open round's
        decision (None once it closed). Once the schedule's last round is handed over, it waits
        for everything in flight."""
        landed = self.landed()
        if self.schedule.is_last(self.round):
            landed += self.drain()
            self._await_chain(self.round + 1)  # a split synchronizer's last round may be another group's
            return landed, None
        landed += self._wait_for_base()
        if self._failed is not None:
            return landed, None
        polled = self.poll()
        if isinstance(polled, RoundSummary):
            return landed + [polled], None
        if not polled.decision.close:
            return landed, polled.decision
        self.hand_over(polled)
        return landed, None

    def hand_over(self, poll: RoundPoll) -> None:
        """:meth:`close` without waiting for the commit: merge a closing poll, make its state this
        synchronizer's and hand the commit to the pipeline (:mod:`atoll.train.commit_pipeline`),
        whose threads write it while the next round polls and merges. :meth:`landed` reports it
        once its record is created; a failed or lost commit reloads the state there."""
        closed = self._closing(poll)
        self._advance(closed)
        if self._commits is None:
            self._commits = CommitPipeline(self.store, clock=self.clock, on_landed=self._tell_landed,
                                           before_commit=self._await_chain if self.peers is not None else None)
        self._commits.submit(closed)

    def _tell_landed(self, landed: Landed) -> None:
        """The commit pipeline's hook: a won round, as :meth:`landed` will report it, to ``on_landed``."""
        if self.on_landed is not None and landed.result is not None and landed.result.won:
            self.on_landed(_summary(landed.closed, landed.result.record))

    def landed(self) -> list[RoundSummary]:
        """The handed-over rounds whose commits landed since the last look, in order. A commit that
        failed after them is raised on the next call (after they were reported)."""
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        return self._collect()

    def in_flight(self) -> bool:
        """Whether a handed-over round has not landed yet."""
        return self._commits is not None and self._commits.in_flight() > 0

    def _wait_for_base(self) -> list[RoundSummary]:
        """Wait until every handed-over round up to the next round's fragment's previous round has
        landed (the pipeline's rule 3: a round merges on its fragment's committed version); the
        rounds that landed meanwhile."""
        if self._commits is None:
            return []
        self._commits.wait_landed(self.round + 1 - self.plan.num_fragments)
        return self._collect()

    def drain(self) -> list[RoundSummary]:
        """Wait for every round handed over by :meth:`step`; the ones that landed, in order (a
        failed commit is raised, a lost one adopted)."""
        if self._commits is not None:
            self._commits.drain()
        landed = self._collect()
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        return landed

    def shutdown(self) -> None:
        """Stop the commit pipeline's threads: rounds handed over and not yet committed are dropped
        (the bucket stays as a crash here would leave it; a restart merges them again)."""
        if self._commits is not None:
            self._commits.close()
            self._commits = None

    def _collect(self) -> list[RoundSummary]:
        """The pipeline's landed rounds as summaries. A round another synchronizer won is adopted
        (state reloaded from the bucket); a failed one is kept in ``_failed`` for the caller."""
        out: list[RoundSummary] = []
        for landed in self._commits.take() if self._commits is not None else []:
            if landed.result is not None and landed.result.won:
                self.screen.saw_commit(landed.closed.round, landed.at_s)
                out.append(_summary(landed.closed, landed.result.record))
            elif landed.result is not None:
                out.append(self._adopt(landed.result.record))
            else:
                assert landed.error is not None
                self._failed = landed.error
        return out

    def _merge(
        self, p: int, accepted: Mapping[str, ContributionRecord], rejected: dict[str, Rejection]
    ) -> tuple[FragmentRoundResult | None, NesterovOuterOptimizer]:
        """Load the accepted deltas (bad payloads join ``rejected``) and merge them into fragment
        ``p`` with one outer step, on a copy of the optimizer: if another synchronizer wins the
        commit, ours is discarded."""
        # Decoded on the merge device: the encoded bytes travel there, not the fp32 deltas.
        contributions, bad = self.store.load_contributions(accepted.values(), device=self.device,
                                                           into=self.merger.decoded)
        rejected.update(bad)
        contributions = [dataclasses.replace(c, counters=self._weighed[c.key]) if c.key in self._weighed else c
                         for c in contributions]
        # A fixed merge order makes a round's result independent of arrival order (bit for bit).
        contributions.sort(key=lambda c: (c.learner_id, c.key))
        opt = self.merger.optimizer_copy(p, self.optimizers[p])
        if not contributions:
            return None, opt
        bases = fragment_bases(self.store, p, version=self.versions[p], current=self.fragments[p],
                               contributions=contributions, previous=self.merger.previous(p))
        result = self.merger.merge(p, current=self.fragments[p], bases=bases, contributions=contributions,
                                   optimizer=opt, reasons=rejected)
        # Merged: nothing reads the decoded deltas again (the result holds tensors of its own).
        self.merger.decoded.give_back(t for c in contributions for t in c.delta.values())
        if result is not None:
            rejected.update(result.rejected)
        return result, opt

    def _advance(self, closed: ClosedRound) -> None:
        """Make a closed round's state ours: once its commit won (:meth:`close`), or at its
        hand-over to the pipeline (:meth:`hand_over`: undone by a reload if the commit does not land)."""
        self.round = closed.round
        self._rounds_closed += 1
        result, p = closed.result, closed.fragment
        if result is not None:
            # The retired version is p's previous one, whose round has landed (the pipeline's rule 3);
            # the new optimizer's momentum is its own before the old buffers are given back.
            closed.optimizer.buffers  # noqa: B018 - makes a fork's copies
            self.merger.retire(p, self.fragments[p], self.optimizers[p], version=self.versions[p])
            self.versions[p] = closed.round
            self.fragments[p] = {n: t.float() for n, t in result.new_params.items()}
            self.optimizers[p] = closed.optimizer
            if self.views is not None and closed.downlink is not None:
                self._pending_views.pop(p, None)
                if closed.downlink.done():  # a sequential close: its commit computed the step
                    self.views[p] = closed.downlink.result().view  # new tensors, never recycled buffers
                else:  # a hand-over: the payload writer computes it; p's next round reads it
                    self._pending_views[p] = closed.downlink
                self._unchained.discard(p)
        self.ema = closed.timings
        self._consume(closed.round, closed.accepted, {**closed.rejected, **closed.unlisted})
        if result is not None:
            self.merger.remember_norm(p, result.update_norm)
        if self.on_state is not None and self.peers is None:  # a merger holds only its own fragments' state
            self.on_state(closed.round, lambda: self._copy_after(p, None))
        if self.peers is not None:  # a merger of a split synchronizer: the other groups' rounds are theirs
            self.round = self.peers.past_theirs(self.round, self.schedule)

    def _adopt(self, record: CommitRecord) -> RoundSummary:
        """Another synchronizer committed this round first: take its state, not ours.

        With a lease, first make sure that other synchronizer is not a newer incarnation: a
        synchronizer that wakes up (a frozen process thawed) to find its round committed by its
        replacement is fenced (raises Fenced), and does not report the round as its own. Rounds
        still in the commit pipeline are dropped: they were merged on a state that is not the
        bucket's."""
        self.check_lifecycle(force=True)
        if self._commits is not None:
            self._commits.reset()
        self._failed = None
        self._load(record.round)
        self._consume(record.round, record.accepted, record.rejected)
        self.screen.saw_commit(record.round, self.clock())
        val = record.stats.get("val_loss")
        return RoundSummary(record=record, won=False, val_loss=float(val) if isinstance(val, int | float) else None)


def _summary(closed: ClosedRound, record: CommitRecord) -> RoundSummary:
    """A round this synchronizer committed, as the loop reports it."""
    return RoundSummary(record=record, won=True, decision=closed.decision, info={"phases": dict(closed.phases)})
