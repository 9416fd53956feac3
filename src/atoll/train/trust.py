"""What the synchronizer believes of a learner's record: the trust checks on contributions.

Every number in a contribution record is the learner's own. Before a round looks at a record,
this module checks it against what the synchronizer observes itself, on its own clock:

Fencing: a contribution whose ``incarnation`` is below its learner's newest lease is a
``fenced`` rejection (a newer copy of that learner has started; the old copy's work is not
merged, and it is no sign of life). The newest lease is read with one LIST per learner and round
(again when a new record of that learner appears); learners that never took a lease (incarnation
0: the virtual driver, simulations) are unaffected.

Counters (they decide a contribution's weight): more tokens than steps x batch x context from the
recipe, or more steps than are possible since its base version
(:func:`atoll.core.weights.max_steps_since`), is an ``impossible_counters`` rejection, and the
record does not count as a sign of life. What passes is weighed with at most the steps its
observed time could produce (:meth:`ContributionScreen.weighed_counters`): before anything has
been observed, a prior of ``UNOBSERVED_INTERVALS x H`` steps; with two or more contributors, no
one of them carries more than ``max_step_share`` of the round's steps
(:meth:`ContributionScreen.weighed`).

Read back: every commit record names the fastest step times this synchronizer had observed
(``stats["observed_step_s"]``, :meth:`LearnerObservations.observed_stats`); a restarted
synchronizer reads them back from the records it loads (:meth:`LearnerObservations.recall`), so
its bound holds from its first round. Only the synchronizer writes under ``sync/``, and a value
that is not a positive finite number is ignored.

Reported times: a learner's step time counts only inside its observed cadence
(:class:`LearnerObservations`), and every reported duration is clipped to [0, one day].
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from atoll.core.quorum import bounded_step_sample, publication_steps
from atoll.core.rejection import Rejection, RejectionKind
from atoll.core.weights import (
    UNOBSERVED_INTERVALS,
    Counters,
    cap_step_share,
    clip_counters,
    impossible_counters,
    max_steps_since,
    plausible_steps,
)
from atoll.storage.reader import RunReader
from atoll.storage.records import ContributionRecord
from atoll.train.run import TokenBounds, load_recipe

__all__ = ["ContributionScreen", "LearnerObservations", "MAX_TIMING_S", "OBSERVED_IN_STATS", "Screened",
           "reported_seconds", "token_bounds_of"]

MAX_TIMING_S = 86_400.0
"""Timings reported by learners are clipped to [0, one day]: a bogus report cannot set a
grace window of centuries (the report is the learner's own number, not a measurement of ours)."""


def reported_seconds(value: Any) -> float | None:
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


def token_bounds_of(store: RunReader) -> TokenBounds | None:
    """Tokens per step from the run's recipe; None for a run without one (built by hand)."""
    if "recipe" not in store.manifest.extra:
        return None
    try:
        return TokenBounds.of_recipe(load_recipe(store))
    except (ImportError, ValueError, TypeError, KeyError):  # ConfigError is a ValueError
        return None  # a model this process cannot build: the step bound still holds


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


OBSERVED_IN_STATS = 4
"""Learners whose observed step time a commit record names (the fastest): two would do (the
fastest other learner of any learner is one of the two fastest), four ride out a departure."""


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
        self._recalled: dict[str, float] = {}
        """Learner -> a step time an earlier synchronizer observed (read back from commit records)."""

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
        if not steps:  # nothing seen yet by this process: what an earlier one observed
            steps = [t for lid, t in self._recalled.items() if lid != learner_id]
        return min(steps) if steps else None

    def observed_stats(self) -> dict[str, float]:
        """The fastest :data:`OBSERVED_IN_STATS` observed step times (learner -> seconds), for
        a commit record's ``stats["observed_step_s"]``: what a restarted synchronizer reads back."""
        steps = {lid: s.step_s for lid, s in self._by.items() if s.step_s is not None and s.step_s > 0
                 and math.isfinite(s.step_s)}
        if not steps:
            steps = dict(self._recalled)
        fastest = sorted(steps, key=lambda lid: (steps[lid], lid))[:OBSERVED_IN_STATS]
        return {lid: float(f"{steps[lid]:.6g}") for lid in sorted(fastest)}

    def recall(self, observed: Any) -> None:
        """Read back a commit record's ``stats["observed_step_s"]`` (newer records after older
        ones: the newest wins). Anything but learner -> positive finite seconds is ignored."""
        if not isinstance(observed, dict):
            return
        for lid, value in list(observed.items())[:OBSERVED_IN_STATS]:
            if (isinstance(lid, str) and isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0):
                self._recalled.pop(lid, None)
                self._recalled[lid] = float(value)
        while len(self._recalled) > 4 * OBSERVED_IN_STATS:
            self._recalled.pop(next(iter(self._recalled)))


@dataclass
class Screened:
    """What the trust checks leave of one poll's fresh records."""

    candidates: dict[str, ContributionRecord]
    """Learner -> its newest record that passed (in listing order)."""

    rejected: dict[str, Rejection]
    """Contribution key -> why: fenced, impossible counters, or superseded by a newer record."""


class ContributionScreen:
    """One synchronizer's trust checks on contribution records, and what it observed of each
    learner to judge them: when it first listed each record, each learner's cadence, when it saw
    each round committed, each learner's newest lease and when it was last seen alive."""

    MAX_INCARNATIONS = 65_536
    """Learners whose newest lease is cached (bounded, like every other cache)."""

    def __init__(self, store: RunReader, *, offsets: tuple[int, ...], inner_steps: int, num_fragments: int,
                 max_learner_speedup: float | None, token_bounds: TokenBounds | None, started_at_s: float,
                 max_step_share: float | None = None, unobserved_intervals: int | None = UNOBSERVED_INTERVALS,
                 ) -> None:
        self.store = store
        self.inner_steps = inner_steps
        self.num_fragments = num_fragments
        self.max_learner_speedup = max_learner_speedup
        self.max_step_share = max_step_share
        self.unobserved_steps = None if unobserved_intervals is None else unobserved_intervals * inner_steps
        """The prior bound on a contribution's weighed steps before any step time is observed
        (None: none, as before the prior existed; benchmarks/trust_guards.py compares the two)."""
        self.token_bounds = token_bounds
        self.observed = LearnerObservations(offsets, inner_steps)
        self.last_seen: dict[str, float] = {}
        """Learner -> when one of its records that passed was first listed (its last sign of life)."""
        self._started_at = started_at_s
        self._seen_at: dict[int, float] = {}  # round -> when this synchronizer saw it committed
        self._first_seen: dict[str, float] = {}  # this round's contribution keys -> first listed at
        self._listed: set[str] = set()  # contribution keys this round's polls have listed
        self._incarnations: dict[str, tuple[int, int]] = {}  # learner -> (newest lease, round read)

    def open_round(self) -> None:
        """A new round opens: nothing of it has been listed yet."""
        self._first_seen = {}
        self._listed = set()

    def first_seen(self, key: str) -> float:
        """When this round's polls first listed contribution ``key`` (one that passed the screen)."""
        return self._first_seen[key]

    def saw_commit(self, round_: int, at_s: float) -> None:
        """Remember when this synchronizer saw ``round_`` committed (bounded: older rounds fall back
        to the synchronizer's start, which only makes the step bound more generous)."""
        self._seen_at[round_] = at_s
        horizon = round_ - 2 * self.num_fragments - 2
        for old in [k for k in self._seen_at if k < horizon]:
            del self._seen_at[old]

    def base_seen_at_s(self, version: int) -> float:
        """When this synchronizer saw the round that made ``version`` committed (or its own start)."""
        return self._seen_at.get(version, self._started_at)

    def live_learners(self, now: float, timeout_s: float) -> set[str]:
        """Learners with a record that passed first listed within ``timeout_s`` of ``now``."""
        return {lid for lid, t in self.last_seen.items() if now - t <= timeout_s}

    def screen(self, records: list[ContributionRecord], round_: int, now: float) -> Screened:
        """Fencing, then counters, then the newest record per learner, for ``records`` (fresh
        records of the round's fragment, sorted by (base, steps)) polled at ``now``."""
        candidates: dict[str, ContributionRecord] = {}
        rejected: dict[str, Rejection] = {}
        newest = self._newest_incarnations(records, round_)
        for rec in records:  # sorted by (base, steps): later ones supersede earlier ones
            if rec.incarnation < newest.get(rec.learner_id, 0):
                rejected[rec.key] = Rejection(
                    RejectionKind.FENCED,
                    f"incarnation {rec.incarnation} fenced by incarnation {newest[rec.learner_id]}")
                continue
            why = self.check_counters(rec, round_, now)
            if why is not None:
                rejected[rec.key] = why
                continue
            self._sighted(rec, round_, now)
            self.last_seen[rec.learner_id] = max(self.last_seen.get(rec.learner_id, 0.0), self._first_seen[rec.key])
            older = candidates.get(rec.learner_id)
            if older is not None:
                rejected[older.key] = Rejection(RejectionKind.SUPERSEDED,
                                                f"a newer contribution from {rec.learner_id} replaces it")
            candidates[rec.learner_id] = rec
        return Screened(candidates=candidates, rejected=rejected)

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
        if len(self._incarnations) > self.MAX_INCARNATIONS:
            self._incarnations = dict(list(self._incarnations.items())[-(self.MAX_INCARNATIONS // 2):])
        return out

    def check_counters(self, rec: ContributionRecord, round_: int, now: float) -> Rejection | None:
        """IMPOSSIBLE_COUNTERS if ``rec`` claims more steps or tokens than a learner can have done."""
        elapsed = now - self.base_seen_at_s(rec.base_version)
        max_steps = max_steps_since(rec.base_version, round_, self.inner_steps, elapsed_s=elapsed)
        per_step = self.token_bounds.of(rec.learner_id) if self.token_bounds is not None else None
        return impossible_counters(rec.c_steps, rec.c_tokens, max_steps=max_steps, max_tokens_per_step=per_step)

    def _sighted(self, rec: ContributionRecord, round_: int, now: float) -> None:
        """First listing of ``rec`` this round: when, and what that says about its learner's cadence."""
        if rec.key in self._first_seen:
            return
        self._first_seen[rec.key] = now
        self.observed.saw(rec.learner_id, round_, rec.fragment, now, reported_seconds(rec.info.get("step_time_s")))

    def weighed(self, records: Iterable[ContributionRecord]) -> dict[str, Counters]:
        """A round's candidates' counters as their weights may count them (key -> counters): each
        bounded by observed time (:meth:`weighed_counters`), then none carrying more than
        ``max_step_share`` of the round's steps (:func:`~atoll.core.weights.cap_step_share`)."""
        return cap_step_share({rec.key: self.weighed_counters(rec) for rec in records}, self.max_step_share)

    def weighed_counters(self, rec: ContributionRecord) -> Counters:
        """``rec``'s counters as its weight may count them: at most the steps its observed time
        could have produced (:func:`~atoll.core.weights.plausible_steps`: the time from its base
        version's commit to its first listing, both on this synchronizer's clock, at up to
        ``max_learner_speedup`` times the fastest other learner's observed step time); while no
        other learner's step time has been observed (or read back), at most the prior
        ``UNOBSERVED_INTERVALS x H`` steps."""
        claimed = Counters(c_steps=rec.c_steps, c_tokens=rec.c_tokens)
        seen = self._first_seen.get(rec.key)
        if seen is None:
            return claimed
        elapsed = seen - self.base_seen_at_s(rec.base_version)
        bound = plausible_steps(elapsed, min_step_s=self.observed.fastest_other(rec.learner_id),
                                inner_steps=self.inner_steps, speedup=self.max_learner_speedup,
                                unobserved_steps=self.unobserved_steps)
        return clip_counters(claimed, bound)
