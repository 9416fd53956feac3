"""What a round reports: what its poll found, the commit record's tables and stats, the timings after it.

All pure (records in, JSON-able facts out): the synchronizer loop calls these at each close, and
a test can check them by hand. Everything learner-written that lands in a commit record is
bounded here (a few names per learner, short pool names, finite losses, clipped wire reports).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atoll.core.quorum import QuorumDecision, TimingEma, bounded_step_sample
from atoll.core.rejection import Rejection, summarize_rejections
from atoll.core.synchronize import FragmentRoundResult
from atoll.core.weights import Counters
from atoll.storage import paths
from atoll.storage.records import AcceptedContribution, CommitRecord, ContributionRecord
from atoll.storage.wire import WireCounts, meter_from_report, tokens_from_report, wire_from_report, wire_report
from atoll.train.trust import reported_seconds

__all__ = ["RoundPoll", "RoundSummary", "accepted_contributions", "learner_wire", "next_timings",
           "recorded_rejections", "round_stats", "skipped_by_learner", "MAX_POOL_CHARS", "MAX_STATS_LEARNERS",
           "STEP_GROWTH_LIMIT"]

MAX_STATS_LEARNERS = 64
"""Learners a per-learner count in a commit's stats names; the rest are added up under ``"*"``."""

STEP_GROWTH_LIMIT = 4.0
"""A round's reported step time counts for at most this multiple of the current estimate."""

MAX_POOL_CHARS = 64
"""A learner's reported pool name is kept to this many characters in a commit's stats."""


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


def skipped_by_learner(skipped: Mapping[str, int]) -> dict[str, int]:
    """Per learner, the records its listed prefixes held beyond the listing's per-prefix cap."""
    out: dict[str, int] = {}
    for prefix, n in skipped.items():
        who = paths.learner_of_key(prefix) or "?"
        out[who] = out.get(who, 0) + int(n)
    return out


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


def recorded_rejections(poll: RoundPoll, rejected: Mapping[str, Rejection], stats: dict[str, Any],
                        weighed: Mapping[str, Counters]) -> tuple[dict[str, Rejection], dict[str, Rejection]]:
    """What the commit record lists of the round's rejections, and what it only counts.

    Everything here comes from what learners wrote, so it is capped
    (:func:`~atoll.core.rejection.summarize_rejections`): a few per learner, the rest counted
    in ``stats["rejected_unlisted"]``; records a listing left unread (over the per-prefix cap)
    are counted in ``stats["listing_skipped"]``; counters ``weighed`` below their claim are named
    in ``stats["steps_clipped"]``. Adds those to ``stats``; returns the listed rejections and the
    unlisted ones (still used up in this process)."""
    listed, summary = summarize_rejections(rejected, lambda k: paths.learner_of_key(k) or "?")
    if summary:
        stats["rejected_unlisted"] = summary
    if poll.skipped:
        stats["listing_skipped"] = _capped_counts(poll.skipped)
    clipped = {rec.learner_id: {"claimed": rec.c_steps, "weighed": weighed[k].c_steps}
               for k, rec in poll.accepted.items()
               if k in weighed and weighed[k].c_steps != rec.c_steps}
    if clipped:
        stats["steps_clipped"] = clipped
    return listed, {k: why for k, why in rejected.items() if k not in listed}


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
                fragment_numel: int, wire: WireCounts | None = None,
                downlink_bytes: int | None = None) -> dict[str, Any]:
    """The commit record's ``stats``: round facts for people (pure; JSON-able). ``wire``: what the
    synchronizer's store sent since its previous commit (``stats["wire"]``); each contributor's
    own report goes to ``stats["learner_wire"]``. ``downlink_bytes``: the tensor bytes of a
    compressed downlink update (default: the fp32 fragment, ``4 x fragment_numel``). The validation
    loss is not a round fact: the evaluator writes it beside the chain (``sync/evals/<round>.json``)."""
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
    per inner step between two of its records,
    :class:`~atoll.train.trust.LearnerObservations`), and a learner with no observation yet gives
    no sample: the first sample is bounded like every other. The median of the round's samples is
    folded in. Time to quorum is folded in only in ``steady`` state: the first round after a
    (re)start also measures learner start-up.
    """
    out = TimingEma.from_dict(ema.to_dict())
    seen = observed or {}
    step_times = [t for rec in poll.accepted.values()
                  if (t := bounded_step_sample(reported_seconds(rec.info.get("step_time_s")),
                                               seen.get(rec.learner_id)))
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
