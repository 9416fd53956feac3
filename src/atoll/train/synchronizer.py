"""The synchronizer loop: poll the bucket, close rounds by quorum + grace, merge, outer step, commit.

Round r synchronizes fragment ``(r - 1) mod P``; rounds are strictly sequential, and each one is
a create-once commit in the bucket, so a synchronizer restarted at any point reads the latest
committed round and simply carries on with the next one: a round is never lost or repeated. If
two synchronizers race on a round, exactly one commit wins and the loser adopts the winner's.

Which contributions a round considers: those for its fragment computed against the fragment's
current version or the one before it (a learner may have published just before it saw the new
version; its delta is re-anchored, never applied as if fresh), not already merged or rejected by
an earlier round, and the newest one per learner. Anything older is stale: the learner has
since overwritten that work with a newer global version.

Counters are checked before anything else looks at a contribution (they decide its weight, and
they are the learner's own numbers): more tokens than steps x batch x context from the recipe, or
more steps than are possible since its base version (:func:`atoll.core.weights.max_steps_since`),
is an ``impossible_counters`` rejection, and the record does not count as a sign of life.

Fencing: a contribution whose ``incarnation`` is below its learner's newest lease is a
``fenced`` rejection (a newer copy of that learner has started; the old copy's work is not
merged, and it is no sign of life). The newest lease is read with one LIST per learner and round
(again when a new record of that learner appears); learners that never took a lease (incarnation
0: the virtual driver, simulations) are unaffected.

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
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from atoll.core.compress import encoded_nbytes
from atoll.core.downlink import DownlinkStep, downlink_step
from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.quorum import (
    Arrival,
    QuorumDecision,
    TimingEma,
    bounded_step_sample,
    decide_round,
    publication_steps,
)
from atoll.core.rejection import Rejection, RejectionKind, summarize_rejections
from atoll.core.retry import ROUND_RETRY
from atoll.core.synchronize import FragmentContribution, FragmentRoundResult, MergeWorkspace, synchronize_fragment
from atoll.core.weights import Counters, clip_counters, impossible_counters, max_steps_since, plausible_steps
from atoll.storage import paths
from atoll.storage.bucket import GlobalState, RunStore
from atoll.storage.integrity import IntegrityError
from atoll.storage.liveness import Lease
from atoll.storage.records import AcceptedContribution, CommitRecord, ContributionRecord
from atoll.storage.validation import InvalidInput, RoundOrderError, TransientStorageError
from atoll.storage.wire import WireCounts, meter_from_report, tokens_from_report, wire_from_report, wire_report
from atoll.train.device import fragment_to_device, fragment_to_host, resolve_device
from atoll.train.lease import Fenced, RunStopped
from atoll.train.run import RoundSchedule, TokenBounds, load_recipe

__all__ = ["SynchronizerOptions", "Synchronizer", "RoundPoll", "RoundSummary", "merge_on_device", "run_synchronizer"]

Evaluate = Callable[[Mapping[str, torch.Tensor]], float]


@dataclass(frozen=True, kw_only=True)
class SynchronizerOptions:
    """Process-local knobs of one synchronizer process. Nothing here changes what is trained:
    the algorithm lives in the run's DilocoConfig and the round schedule in its recipe (run.json)."""

    poll_interval_s: float = 0.2
    """Longest sleep between two polls of an open round."""

    live_timeout_s: float | None = None
    """A learner not seen for this long is not 'live' (for early close). None: max(5 s, 3 H step times)."""

    synchronizer_id: str = "synchronizer"
    """Written into every commit record (who won the round)."""

    device: str = "cpu"
    """Where merges and outer steps run: 'cpu' (default), 'auto', 'cuda', 'cuda:N', 'mps'. The
    synchronizer's state stays on the host; each round moves its inputs to this device and the
    new fragment and momentum back (one copy each). Outer-step math is fp32 on any device."""

    heartbeat_interval_s: float = 5.0
    """Once the synchronizer holds a lease: at most this often, a poll heartbeats and checks the
    stop marker and for a newer synchronizer lease."""


@dataclass
class RoundSummary:
    """One committed round, as the loop reports it (what a log line or a Prefect artifact shows)."""

    record: CommitRecord
    won: bool
    decision: QuorumDecision | None = None
    val_loss: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        r = self.record
        who = ",".join(a.learner_id for a in r.accepted) or "-"
        loss = f" val_loss={self.val_loss:.4f}" if self.val_loss is not None else ""
        return (
            f"round {r.round:5d} frag {r.fragment:2d} in={len(r.accepted)} out={len(r.rejected)} "
            f"quorum={r.stats.get('quorum_s', 0):.2f}s grace={r.stats.get('grace_s', 0):.2f}s "
            f"[{who}]{loss}" + ("" if self.won else " (adopted another synchronizer's commit)")
        )


@dataclass
class RoundPoll:
    """What one poll of the open round found (small: records and reasons, no tensors)."""

    round: int
    fragment: int
    decision: QuorumDecision
    opened_at_s: float
    polled_at_s: float
    accepted: dict[str, ContributionRecord]
    """Contribution key -> record, for the contributions the decision accepted."""
    rejected: dict[str, Rejection]
    """Contribution key -> why, for everything that will not be merged."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Learner -> records its listed prefixes held beyond the per-prefix cap (never read)."""


@dataclass
class _Sighting:
    """A learner's newest record as this synchronizer first listed it."""

    round: int
    fragment: int
    at_s: float
    cadence_s: float | None = None
    """Observed seconds per inner step: time between two of its records first being listed,
    over the steps the schedule puts between them (an upper bound on its step time)."""
    step_s: float | None = None
    """Its reported step time inside that bound (:func:`~atoll.core.quorum.bounded_step_sample`)."""


class LearnerObservations:
    """What the synchronizer has seen of each learner itself, on its own clock: when each record
    was first listed and, from two in a row, its cadence (seconds per inner step). A learner's
    reported step time counts only inside its cadence; a learner seen once has no cadence yet.
    Bounded: the newest 65,536 learners are kept."""

    MAX_LEARNERS = 65_536

    def __init__(self, offsets: tuple[int, ...], inner_steps: int) -> None:
        self.offsets = offsets
        self.inner_steps = inner_steps
        self._by: dict[str, _Sighting] = {}

    def saw(self, learner_id: str, round_: int, fragment: int, at_s: float, reported_s: float | None) -> None:
        """A record of ``learner_id`` for ``fragment`` first listed at ``at_s`` in ``round_``."""
        prev = self._by.pop(learner_id, None)
        now = _Sighting(round=round_, fragment=fragment, at_s=at_s)
        if prev is not None:
            now.cadence_s, now.step_s = prev.cadence_s, prev.step_s
            if round_ > prev.round and at_s > prev.at_s:
                steps = publication_steps(self.offsets, prev.fragment, fragment, self.inner_steps)
                now.cadence_s = (at_s - prev.at_s) / steps
            if round_ > prev.round or now.step_s is None:
                now.step_s = bounded_step_sample(reported_s, now.cadence_s)
        self._by[learner_id] = now
        while len(self._by) > self.MAX_LEARNERS:
            self._by.pop(next(iter(self._by)))

    def cadence(self, learner_id: str) -> float | None:
        seen = self._by.get(learner_id)
        return None if seen is None else seen.cadence_s

    def cadences(self) -> dict[str, float]:
        return {lid: s.cadence_s for lid, s in self._by.items() if s.cadence_s is not None}

    def fastest_other(self, learner_id: str) -> float | None:
        """The fleet's minimum plausible step time for judging ``learner_id``: the smallest
        observed step time of the *other* learners seen (its own reports never loosen its bound;
        not only live ones: after a stall of the synchronizer nobody has been seen lately)."""
        steps = [s.step_s for lid, s in self._by.items() if lid != learner_id
                 and s.step_s is not None and s.step_s > 0]
        return min(steps) if steps else None


class Synchronizer:
    """The synchronizer's state machine; :meth:`tick` does one poll and maybe one commit."""

    def __init__(
        self,
        store: RunStore,
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
        self.token_bounds = _token_bounds(store)
        self.device = resolve_device(self.options.device, knob="SynchronizerOptions.device")
        self._started_at = clock()
        self._seen_at: dict[int, float] = {}  # round -> when this synchronizer saw it committed
        self.observed = LearnerObservations(self.plan.offsets, self.config.inner_steps)
        self._weighed: dict[str, Counters] = {}  # this round's counters as weighed (clipped)
        self._load(store.latest_round())
        self._opened: tuple[int, float] | None = None  # (round, opened_at_s)
        self._first_seen: dict[str, float] = {}
        self._listed: set[str] = set()  # contribution keys this round's polls have listed
        self.last_seen: dict[str, float] = {}
        self._rounds_closed = 0
        self._incarnations: dict[str, tuple[int, int]] = {}  # learner -> (newest lease, round read)
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
        # Buffers reused from round to round (no fresh fragment-sized, page-faulting buffers):
        # the merge's scratch, and per fragment the version and momentum a won round retired.
        # Only tensors this process allocated are recycled (not ones decoded from the bucket).
        self._workspace = MergeWorkspace()
        self._spare_params: dict[int, dict[str, torch.Tensor]] = {}
        self._spare_momentum: dict[int, dict[str, torch.Tensor]] = {}
        self._merged_here: set[int] = set()
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
        self._norms: dict[int, deque[float]] = {p: deque(maxlen=NORM_HISTORY) for p in range(self.plan.num_fragments)}
        for r in range(max(1, round_ - 2 * self.plan.num_fragments + 1), round_ + 1) if round_ else []:
            try:
                rec = self.store.read_commit(r)
            except IntegrityError:
                continue  # a void slot consumed nothing we can know of
            if rec is not None:
                self._consume(rec)
                self._remember_norm(rec.fragment, rec.stats.get("update_norm") if rec.updated else None)

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

    def _remember_norm(self, fragment: int, norm: Any) -> None:
        """The fragment's recent merged update norms: the outlier guard's reference with K = 1."""
        if isinstance(norm, int | float) and not isinstance(norm, bool) and math.isfinite(norm) and norm > 0:
            self._norms[fragment].append(float(norm))

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

    def _previous_version(self, p: int) -> int | None:
        c = self.versions[p]
        if c == 0:
            return None
        try:
            before = self.store.read_commit(c - 1) if c > 1 else None
        except IntegrityError:
            return None  # cannot tell what came before: only the current version is a valid base
        return before.versions[p] if before is not None else 0

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
        return {lid for lid, t in self.last_seen.items() if now - t <= timeout}

    # -- one poll ----------------------------------------------------------------------------
    def poll(self) -> RoundPoll | RoundSummary:
        """Look at the open round once: list its contributions and ask core's quorum/grace policy.

        Returns a :class:`RoundPoll` (``poll.decision.close`` says whether to :meth:`close` it now)
        or, if another synchronizer already committed this round, the adopted RoundSummary.
        """
        self.check_lifecycle()
        r = self.round + 1
        p = self.fragment_of_round(r)
        now = self.clock()
        if self._opened is None or self._opened[0] != r:
            self._opened = (r, now)
            self._first_seen = {}
            self._listed = set()
        opened_at = self._opened[1]

        # Someone else (a racing or previous incarnation) may have committed this round already.
        # A slot holding something that does not verify is void: we close the round ourselves and
        # commit_round writes the repair record (the forged or corrupt object is never used).
        try:
            existing = self.store.read_commit(r)
        except IntegrityError:
            existing = None
        if existing is not None:
            return self._adopt(existing)

        bases = {self.versions[p]}
        prev = self._previous_version(p)
        if prev is not None:
            bases.add(prev)
        listing = self.store.list_contributions(p, bases)
        candidates: dict[str, ContributionRecord] = {}
        rejected: dict[str, Rejection] = {k: v for k, v in listing.rejected.items() if k not in self.consumed}
        fresh = [rec for rec in listing.records if rec.key not in self.consumed]
        newest = self._newest_incarnations(fresh, r)
        for rec in fresh:  # sorted by (base, steps): later ones supersede earlier ones
            if rec.incarnation < newest.get(rec.learner_id, 0):
                rejected[rec.key] = Rejection(
                    RejectionKind.FENCED,
                    f"incarnation {rec.incarnation} fenced by incarnation {newest[rec.learner_id]}")
                continue
            why = self.check_counters(rec, r, now)
            if why is not None:
                rejected[rec.key] = why
                continue
            self._sighted(rec, r, now)
            self.last_seen[rec.learner_id] = max(self.last_seen.get(rec.learner_id, 0.0), self._first_seen[rec.key])
            older = candidates.get(rec.learner_id)
            if older is not None:
                rejected[older.key] = Rejection(RejectionKind.SUPERSEDED,
                                                f"a newer contribution from {rec.learner_id} replaces it")
            candidates[rec.learner_id] = rec
        live = self._live_learners(now)
        self._weighed = {rec.key: self.weighed_counters(rec) for rec in candidates.values()}
        arrivals = [
            Arrival(learner_id=rec.learner_id, arrived_at_s=self._first_seen[rec.key],
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
            skipped=_skipped_by_learner(listing.skipped),
        )

    def _newest_incarnations(self, records: list[ContributionRecord], round_: int) -> dict[str, int]:
        """Each listed learner's newest lease number: read (one LIST) at most once per learner and
        poll, when not yet read this round or when one of its records is new; a record carrying a
        higher incarnation raises it (only that learner's own records can, so a forged number
        fences only the forger)."""
        new = {rec.learner_id for rec in records if rec.key not in self._listed}
        self._listed.update(rec.key for rec in records)
        out: dict[str, int] = {}
        for lid in sorted({rec.learner_id for rec in records}):
            cached = self._incarnations.get(lid)
            if cached is None or cached[1] != round_ or lid in new:
                value = max(self.store.current_incarnation(lid), cached[0] if cached else 0)
            else:
                value = cached[0]
            out[lid] = value
        for rec in records:
            out[rec.learner_id] = max(out[rec.learner_id], rec.incarnation)
        for lid, value in out.items():
            self._incarnations[lid] = (value, round_)
        if len(self._incarnations) > 65536:  # bounded, like every other cache
            self._incarnations = dict(list(self._incarnations.items())[-32768:])
        return out

    def check_counters(self, rec: ContributionRecord, round_: int, now: float) -> Rejection | None:
        """IMPOSSIBLE_COUNTERS if ``rec`` claims more steps or tokens than a learner can have done."""
        elapsed = now - self._seen_at.get(rec.base_version, self._started_at)
        max_steps = max_steps_since(rec.base_version, round_, self.config.inner_steps, elapsed_s=elapsed)
        per_step = self.token_bounds.of(rec.learner_id) if self.token_bounds is not None else None
        return impossible_counters(rec.c_steps, rec.c_tokens, max_steps=max_steps, max_tokens_per_step=per_step)

    def _sighted(self, rec: ContributionRecord, round_: int, now: float) -> None:
        """First listing of ``rec`` this round: when, and what that says about its learner's cadence."""
        if rec.key in self._first_seen:
            return
        self._first_seen[rec.key] = now
        self.observed.saw(rec.learner_id, round_, rec.fragment, now, _seconds(rec.info.get("step_time_s")))

    def weighed_counters(self, rec: ContributionRecord) -> Counters:
        """``rec``'s counters as its weight may count them: at most the steps its observed time
        could have produced (:func:`~atoll.core.weights.plausible_steps`: the time from its base
        version's commit to its first listing, both on this synchronizer's clock, at up to
        ``max_learner_speedup`` times the fastest other learner's observed step time)."""
        claimed = Counters(c_steps=rec.c_steps, c_tokens=rec.c_tokens)
        seen = self._first_seen.get(rec.key)
        if seen is None:
            return claimed
        elapsed = seen - self._seen_at.get(rec.base_version, self._started_at)
        bound = plausible_steps(elapsed, min_step_s=self.observed.fastest_other(rec.learner_id),
                                inner_steps=self.config.inner_steps, speedup=self.config.max_learner_speedup)
        return clip_counters(claimed, bound)

    def _saw(self, round_: int) -> None:
        """Remember when this synchronizer saw ``round_`` committed (bounded: older rounds fall back
        to the synchronizer's start, which only makes the step bound more generous)."""
        self._seen_at[round_] = self.clock()
        horizon = round_ - 2 * self.plan.num_fragments - 2
        for old in [k for k in self._seen_at if k < horizon]:
            del self._seen_at[old]

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
                               steady=self._rounds_closed > 0, observed=self.observed.cadences())
        listed, unlisted = self._recorded(poll, rejected, stats)
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

    def _recorded(self, poll: RoundPoll, rejected: Mapping[str, Rejection],
                  stats: dict[str, Any]) -> tuple[dict[str, Rejection], dict[str, Rejection]]:
        """What the commit record lists of the round's rejections, and what it only counts.

        Everything here comes from what learners wrote, so it is capped
        (:func:`~atoll.core.rejection.summarize_rejections`): a few per learner, the rest counted
        in ``stats["rejected_unlisted"]``; records a listing left unread (over the per-prefix cap)
        are counted in ``stats["listing_skipped"]``. Adds those to ``stats``; returns the listed
        rejections and the unlisted ones (still used up in this process)."""
        listed, summary = summarize_rejections(rejected, lambda k: paths.learner_of_key(k) or "?")
        if summary:
            stats["rejected_unlisted"] = summary
        if poll.skipped:
            stats["listing_skipped"] = _capped_counts(poll.skipped)
        clipped = {rec.learner_id: {"claimed": rec.c_steps, "weighed": self._weighed[k].c_steps}
                   for k, rec in poll.accepted.items()
                   if k in self._weighed and self._weighed[k].c_steps != rec.c_steps}
        if clipped:
            stats["steps_clipped"] = clipped
        return listed, {k: why for k, why in rejected.items() if k not in listed}

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
        opt = NesterovOuterOptimizer(lr=self.config.outer_lr, momentum=self.config.outer_momentum)
        opt.load_state_dict(self.optimizers[p].state_dict(), reuse=self._spare_momentum.pop(p, None))
        if not contributions:
            return None, opt
        result = merge_on_device(
            self.device, current=self.fragments[p], bases=self._bases(p, contributions), contributions=contributions,
            optimizer=opt, merge=self.config.merge, weighting=self.config.weighting,
            embedding_names=self.plan.embedding_names, rda_embeddings=self.config.rda_embeddings,
            outlier_norm_ratio=self.config.outlier_norm_ratio, workspace=self._workspace,
            out=self._spare_params.pop(p, None), norm_history=tuple(self._norms[p]),
            max_weight_share=self.config.max_weight_share, reasons=rejected,
        )
        if result is not None:
            rejected.update(result.rejected)
        return result, opt

    def _bases(self, p: int, contributions: list[FragmentContribution]) -> dict[int, dict[str, torch.Tensor]]:
        """Fragment ``p`` at every base version the contributions name (the current one is in memory)."""
        bases: dict[int, dict[str, torch.Tensor]] = {}
        missing: set[int] = set()
        for c in contributions:
            if c.base_version in bases or c.base_version in missing:
                continue
            if c.base_version == self.versions[p]:
                bases[c.base_version] = self.fragments[p]
                continue
            try:
                bases[c.base_version] = self.store.read_global_fragment(p, c.base_version)
            except InvalidInput:  # that version's object is gone: its contributions get UNKNOWN_BASE
                missing.add(c.base_version)
        return bases

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
        self._saw(record.round)
        if result is not None:
            p = record.fragment
            retired, retired_opt = self.fragments[p], self.optimizers[p]
            self.versions[p] = record.round
            self.fragments[p] = {n: t.float() for n, t in result.new_params.items()}
            self.optimizers[p] = opt
            # The retired version is nobody's base in memory (older bases are read from the bucket):
            # the next round of this fragment writes into it, if this process allocated it.
            if p in self._merged_here:
                self._spare_params[p] = retired
            self._merged_here.add(p)
            self._spare_momentum[p] = retired_opt.buffers
            if self.views is not None and downlink is not None:
                self.views[p] = downlink.view  # new tensors: never one of the recycled master buffers
                self._unchained.discard(p)
        self.ema = timings
        self._consume(record, unlisted)
        if result is not None:
            self._remember_norm(record.fragment, result.update_norm)

    def _adopt(self, record: CommitRecord) -> RoundSummary:
        """Another synchronizer committed this round first: take its state, not ours.

        With a lease, first make sure that other synchronizer is not a newer incarnation: a
        synchronizer that wakes up (a frozen process thawed) to find its round committed by its
        replacement is fenced (raises Fenced), and does not report the round as its own."""
        self.check_lifecycle(force=True)
        self._load(record.round)
        self._consume(record)
        self._saw(record.round)
        val = record.stats.get("val_loss")
        return RoundSummary(record=record, won=False, val_loss=float(val) if isinstance(val, int | float) else None)


def merge_on_device(device: torch.device, *, current: Mapping[str, torch.Tensor],
                    bases: Mapping[int, Mapping[str, torch.Tensor]], contributions: list[FragmentContribution],
                    optimizer: NesterovOuterOptimizer, **kwargs: Any) -> FragmentRoundResult | None:
    """:func:`~atoll.core.synchronize.synchronize_fragment` on ``device``, inputs and outputs on the host.

    On the CPU this is exactly ``synchronize_fragment``. Elsewhere the inputs go to the device,
    the merge and outer step run there (fp32), and the new fragment, the merged update and the
    optimizer's momentum come back with one device-to-host copy each (``out``, host tensors for
    the new fragment, is then not used; a ``workspace`` holds device buffers).
    """
    if device.type == "cpu":
        return synchronize_fragment(current=current, bases=bases, contributions=contributions,
                                    optimizer=optimizer, **kwargs)
    kwargs.pop("out", None)
    optimizer.buffers = fragment_to_device(optimizer.buffers, device)
    current_on = fragment_to_device(current, device)
    result = synchronize_fragment(
        current=current_on,  # the current version as a base is the same mapping (no re-anchoring needed)
        bases={v: current_on if b is current else fragment_to_device(b, device) for v, b in bases.items()},
        contributions=[dataclasses.replace(c, delta=fragment_to_device(c.delta, device)) for c in contributions],
        optimizer=optimizer, **kwargs,
    )
    optimizer.buffers = fragment_to_host(optimizer.buffers)
    if result is not None:
        result.new_params = fragment_to_host(result.new_params)
        result.update = fragment_to_host(result.update)
    return result


def _token_bounds(store: RunStore) -> TokenBounds | None:
    """Tokens per step from the run's recipe; None for a run without one (built by hand)."""
    if "recipe" not in store.manifest.extra:
        return None
    try:
        return TokenBounds.of_recipe(load_recipe(store))
    except (ImportError, ValueError, TypeError, KeyError):  # ConfigError is a ValueError
        return None  # a model this process cannot build: the step bound still holds


def accepted_contributions(accepted: Mapping[str, ContributionRecord], result: FragmentRoundResult | None, *,
                           weighed: Mapping[str, Counters] | None = None) -> list[AcceptedContribution]:
    """The commit record's ``accepted`` table: every contribution the merge weighed, with the
    counters as weighed (``weighed``: clipped to what its observed time could produce; the
    claim is in ``stats["steps_clipped"]``)."""
    if result is None:
        return []
    out = []
    for k, rec in accepted.items():
        if k in result.weights:
            c = (weighed or {}).get(k) or Counters(c_steps=rec.c_steps, c_tokens=rec.c_tokens)
            out.append(AcceptedContribution(key=k, learner_id=rec.learner_id, weight=result.weights[k],
                                            base_version=rec.base_version, c_steps=c.c_steps, c_tokens=c.c_tokens))
    return out


def _skipped_by_learner(skipped: Mapping[str, int]) -> dict[str, int]:
    """Per learner, the records its listed prefixes held beyond the listing's per-prefix cap."""
    out: dict[str, int] = {}
    for prefix, n in skipped.items():
        who = paths.learner_of_key(prefix) or "?"
        out[who] = out.get(who, 0) + int(n)
    return out


MAX_STATS_LEARNERS = 64
"""Learners a per-learner count in a commit's stats names; the rest are added up under ``"*"``."""


def _capped_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """A per-learner count small enough for a commit record, whatever the number of learners."""
    named = sorted(counts, key=lambda k: (-counts[k], k))
    out = {k: int(counts[k]) for k in named[:MAX_STATS_LEARNERS]}
    rest = sum(int(counts[k]) for k in named[MAX_STATS_LEARNERS:])
    if rest:
        out["*"] = rest
    return out


def _quorum_s(poll: RoundPoll) -> float:
    """Time to quorum, counted from the round's first contribution (not from the previous close:
    with H > P nobody publishes this fragment for a while after the previous round closed)."""
    d = poll.decision
    first = min((a.arrived_at_s for a in d.accepted), default=poll.opened_at_s)
    return max(0.0, (d.quorum_at_s if d.quorum_at_s is not None else poll.polled_at_s) - first)


STEP_GROWTH_LIMIT = 4.0
"""A round's reported step time counts for at most this multiple of the current estimate."""

NORM_HISTORY = 8
"""Merged update norms kept per fragment: the outlier guard compares each contribution with
their median (:func:`~atoll.core.synchronize.synchronize_fragment`'s ``norm_history``)."""

MAX_POOL_CHARS = 64
"""A learner's reported pool name is kept to this many characters in a commit's stats."""

MAX_TIMING_S = 86_400.0
"""Timings reported by learners are clipped to [0, one day]: a bogus report cannot set a
grace window of centuries (the report is the learner's own number, not a measurement of ours)."""


def _seconds(value: Any) -> float | None:
    """A learner-reported duration as a clipped float, or None if it is not a usable number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int beyond float range
        return MAX_TIMING_S
    if not math.isfinite(x):
        return None
    return min(max(x, 0.0), MAX_TIMING_S)


def learner_wire(recs: Mapping[str, ContributionRecord]) -> dict[str, dict[str, Any]]:
    """Each contributor's reported traffic (``info["wire"]`` of its accepted record): the
    learner's own numbers, so each field is an integer clipped to [0, 2^50] and a report that is
    not one is left out (:func:`~atoll.storage.wire.wire_from_report`); the meter id is kept only
    if it is a short plain name."""
    out: dict[str, dict[str, Any]] = {}
    for rec in sorted(recs.values(), key=lambda r: (r.learner_id, r.key)):
        reported = rec.info.get("wire")
        counts = wire_from_report(reported)
        if counts is not None:
            out[rec.learner_id] = wire_report(counts, tokens=tokens_from_report(reported),
                                              meter=meter_from_report(reported))
    return out


def round_stats(poll: RoundPoll, accepted: list[AcceptedContribution], result: FragmentRoundResult | None, *,
                val_loss: float | None, fragment_numel: int, wire: WireCounts | None = None,
                downlink_bytes: int | None = None) -> dict[str, Any]:
    """The commit record's ``stats``: round facts for people (pure; JSON-able). ``wire``: what the
    synchronizer's store sent since its previous commit (``stats["wire"]``); each contributor's
    own report goes to ``stats["learner_wire"]``. ``downlink_bytes``: the tensor bytes of a
    compressed downlink update (default: the fp32 fragment, ``4 x fragment_numel``)."""
    merged = {a.key for a in accepted}
    recs = poll.accepted
    d = poll.decision
    stats: dict[str, Any] = {
        "quorum_s": round(_quorum_s(poll), 4),
        "grace_s": round(d.grace_s, 4),
        "wait_s": round(poll.polled_at_s - poll.opened_at_s, 4),
        "reason": d.reason,
        "waiting_for": list(d.waiting_for),
        "tokens": sum(a.c_tokens for a in accepted),
        "steps": sum(a.c_steps for a in accepted),
        "bytes_in": sum(rec.payload.nbytes for k, rec in recs.items() if k in merged),
        "bytes_out_per_learner": (4 * fragment_numel if downlink_bytes is None else downlink_bytes)
        if result is not None else 0,
        "update_norm": round(result.update_norm, 6) if result is not None else 0.0,
        "pools": {rec.learner_id: rec.info["pool"][:MAX_POOL_CHARS] for rec in recs.values()
                  if isinstance(rec.info.get("pool"), str)},
        "learner_loss": {rec.learner_id: rec.info.get("loss") for rec in recs.values()
                         if isinstance(rec.info.get("loss"), float) and math.isfinite(rec.info["loss"])},
    }
    if val_loss is not None and math.isfinite(val_loss):
        stats["val_loss"] = round(val_loss, 6)
    if wire is not None:
        stats["wire"] = wire.to_dict()
    reported = learner_wire(recs)
    if reported:
        stats["learner_wire"] = reported
    return stats


def next_timings(ema: TimingEma, poll: RoundPoll, *, sync_s: float, steady: bool,
                 observed: Mapping[str, float] | None = None) -> TimingEma:
    """The grace window's EMAs after this round (pure: returns a new TimingEma).

    Learners report their step time with each contribution; a report counts only inside what
    the synchronizer observed of that learner, ``observed[learner_id]`` (its cadence: seconds
    per inner step between two of its records, :class:`LearnerObservations`), and a learner with
    no observation yet gives no sample: the first sample is bounded like every other. The median
    of the round's samples is folded in. Time to quorum is folded in only in ``steady`` state: the
    first round after a (re)start also measures learner start-up.
    """
    out = TimingEma.from_dict(ema.to_dict())
    seen = observed or {}
    step_times = [t for rec in poll.accepted.values()
                  if (t := bounded_step_sample(_seconds(rec.info.get("step_time_s")), seen.get(rec.learner_id)))
                  is not None]
    if step_times:
        sample = statistics.median(step_times)
        prev = ema.get("step_s")
        if prev is not None and prev > 0:
            # Step times are the learners' own numbers: one round may move the estimate only by a
            # bounded factor, so a lone liar cannot open a grace window of hours (a real slowdown
            # is still followed, within a few rounds).
            sample = min(sample, STEP_GROWTH_LIMIT * prev)
        out.update("step_s", sample)
    if poll.decision.quorum_at_s is not None and steady:
        out.update("quorum_s", _quorum_s(poll))
    out.update("sync_s", max(0.0, sync_s))
    return out


def run_synchronizer(
    store: RunStore,
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
                log(f"synchronizer: round {sync.round + 1}: {e}; retry {failures} of {ROUND_RETRY.attempts - 1}")
                time.sleep(ROUND_RETRY.delay_s(failures - 1))
                sync = Synchronizer(store, options=sync.options, evaluate=evaluate, clock=sync.clock)
                if lease is not None:
                    sync.hold_lease(lease=lease)
                continue
            if isinstance(out, RoundSummary):
                log(out.line())
                if on_round is not None:
                    on_round(out)
                continue
            wait = (out.recheck_at_s or 0) - sync.clock()
            time.sleep(min(max(wait, 0.005), sync.options.poll_interval_s))
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
