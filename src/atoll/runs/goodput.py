"""How much learner time went into useful training, and how much of that training the model kept:
computed from the bucket, one committed round at a time.

Pure functions over :class:`~atoll.storage.reader.RunReader` records (no Prefect import), shared by
the Prefect tasks that write artifacts and by ``atoll status``, which must work with no Prefect at
all.

Two figures (docs/prefect.md, "Goodput and merged-work share"), per learner and for the run:

* **goodput**, as the paper defines it: the time learners spent in *useful training steps* over
  the time they were available. A learner is available from the start of its first process to
  its last report; in that time it is training (inner steps), waiting (a process up but not in a
  step: start-up, publishing, adopting) or down (no process up, between a crash and its
  relaunch). Steps it ran again after a restart (its counter went back to its last save) are
  recovery, not useful. Its processes report how long they have been up and in steps
  (``info.up_s``, ``info.train_s``); older records without them count as training all the time.
* **merged-work share**: the part of the training steps run whose work the model kept. Every
  inner step of learner m feeds all P fragments, and a committed round merges, for its
  fragment, a contribution carrying ``c_steps`` steps of m; so m's merged steps are
  ``sum(c_steps over m's merged contributions) / P``. Work that did not reach the model (a
  contribution that was late, superseded, rejected, or the steps between a publish and the next
  alignment, which alignment overwrites) does not count. A learner that publishes a fragment
  again before it adopts the round that merged its previous contribution (same base version)
  carries that merged work again: only the steps beyond it count (:class:`MergedWork`). The
  share is merged steps over steps run (redone ones included), weighted by step time. With
  ``keep_local_progress`` the steps between a publish and the next alignment are carried into
  the next contribution (its ``c_steps`` count them, ``info["kept_steps"]`` says how many) and
  count as merged when it is: ``kept_s`` is that part of the share. What was lost is counted by
  cause (overlap, superseded, late, rejected: :class:`~atoll.runs.contributions.LostWork`).

Only the bucket is read (commit records and the contribution records they name), so goodput is
the same whether or not the Prefect database that ran the run still exists.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from atoll.runs.contributions import LOST_CAUSES, LostWork, prefetch_contributions, read_contribution
from atoll.runs.losses import ValLosses
from atoll.runs.numbers import finite
from atoll.runs.traffic import RoundWire, WireTracker
from atoll.storage.reader import RunReader
from atoll.storage.records import AcceptedContribution, CommitRecord, ContributionRecord
from atoll.storage.wire import meter_from_report

__all__ = ["GoodputReport", "GoodputTracker", "LearnerTime", "MergedWork", "RoundPoint"]


HISTORY_CHUNK = 256
"""Commit records a tracker reads (and whose contributions it prefetches) per step when it catches up."""


@dataclass(frozen=True)
class LearnerTime:
    """Where one learner's time went, from its contribution records (seconds of its own clock).

    ``available_s`` runs from the start of its first process to its last report. In it:
    ``training_s`` (inner steps run, redone ones included), ``waiting_s`` (a process up but not in
    a step: start-up, publishing, adopting, fetching) and ``down_s`` (no process up: between a
    crash and the relaunched process). ``redone_s``: steps run again after a restart (its counter
    went back to its last save). ``merged_s``: the steps whose work reached the global model."""

    available_s: float
    training_s: float
    waiting_s: float
    down_s: float
    redone_s: float
    merged_s: float
    tokens_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation its newest contribution reported (CUDA with a known peak; else None)."""
    peak_mem_gib: float | None = None
    """Peak device memory its newest contribution reported, GiB (CUDA; else None)."""
    kept_s: float = 0.0
    """Of ``merged_s``, steps that adoption would have overwritten and ``keep_local_progress``
    carried into the next contribution (its ``info["kept_steps"]``), merged with it."""
    lost_s: Mapping[str, float] = field(default_factory=dict)
    """Steps whose work reached no committed round, by cause
    (:data:`~atoll.runs.contributions.LOST_CAUSES`, :class:`~atoll.runs.contributions.LostWork`)."""

    @property
    def useful_s(self) -> float:
        """Time in useful training steps: steps run, less those run again after a restart."""
        return max(0.0, self.training_s - self.redone_s)

    @property
    def restarting_s(self) -> float:
        """Time lost to failures: no process up, plus steps redone after a restart."""
        return self.down_s + self.redone_s

    @property
    def goodput(self) -> float:
        return self.useful_s / self.available_s if self.available_s > 0 else 0.0

    @property
    def merged_share(self) -> float:
        return self.merged_s / self.training_s if self.training_s > 0 else 0.0


@dataclass
class GoodputReport:
    """The run's two figures (docs/prefect.md, "Goodput and merged-work share").

    * ``goodput`` (the paper's): time learners spent in useful training steps over the time they
      were available (not waiting, not down or redoing steps after a restart);
    * ``merged_share``: the part of the training steps run whose work the model kept (merged in a
      committed round)."""

    goodput: float | None
    merged_share: float | None = None
    useful_s: float = 0.0
    available_s: float = 0.0
    merged_s: float = 0.0
    training_s: float = 0.0
    per_learner: dict[str, float] = field(default_factory=dict)
    """Goodput per learner."""
    learners: dict[str, LearnerTime] = field(default_factory=dict)
    kept_s: float = 0.0
    """Of ``merged_s``, the learners' steps kept through an adoption (``keep_local_progress``)."""
    lost_s: dict[str, float] = field(default_factory=dict)
    """Of ``training_s``, the steps whose work no committed round merged, by cause."""

    @property
    def merged_per_learner(self) -> dict[str, float]:
        return {lid: t.merged_share for lid, t in self.learners.items()}

    def line(self) -> str:
        if self.goodput is None:
            return "goodput: n/a (no learner work recorded yet)"
        share = f"{100 * self.merged_share:.1f}%" if self.merged_share is not None else "-"
        return (f"goodput {100 * self.goodput:.1f}% ({self.useful_s:.1f} s in useful training steps of "
                f"{self.available_s:.1f} s learner time); merged-work share {share} ({self.merged_s:.1f} s "
                f"of {self.training_s:.1f} s of training merged)")


class MergedWork:
    """The new work in each merged contribution, fed committed rounds in order.

    A contribution carries all of its learner's work on the fragment since the version it is
    against. When a learner publishes a fragment again before adopting the round that merged its
    previous contribution, both are against the same base version, and the second one holds the
    first one's work again. The synchronizer may merge it: the outer gradient is the distance
    from the *current* global fragment to the learner's fragment (``atoll.core.pseudograd``), and
    the merged part is already in the current fragment, so the parameters never take that work
    twice. Counting merged work must not take it twice either: this counts only the steps and
    tokens beyond the learner's last merged contribution on the fragment against the same base.
    Memory: one entry per (fragment, learner)."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str], AcceptedContribution] = {}

    def add(self, fragment: int, accepted: AcceptedContribution) -> tuple[int, int]:
        """(new steps, new tokens) of ``accepted``, merged in a round of ``fragment``."""
        slot = (fragment, accepted.learner_id)
        prev = self._last.get(slot)
        self._last[slot] = accepted
        if prev is not None and prev.base_version == accepted.base_version:
            return max(0, accepted.c_steps - prev.c_steps), max(0, accepted.c_tokens - prev.c_tokens)
        return accepted.c_steps, accepted.c_tokens

    def round(self, record: CommitRecord) -> dict[str, tuple[int, int]]:
        """Per learner, (new steps, new tokens) merged by committed ``record``."""
        return {a.learner_id: self.add(record.fragment, a) for a in record.accepted}


MAX_REPORTED_S = 1e8
"""A learner's reported ``up_s`` / ``train_s`` count only within [0, this] (they are its own numbers)."""


@dataclass
class _LearnerWork:
    merged_steps: int = 0
    kept_steps: int = 0
    """Of ``merged_steps``, those its contributions carried through an adoption (``info["kept_steps"]``)."""
    events: list[tuple[float, int]] = field(default_factory=list)  # (created_at, local step)
    step_times: list[float] = field(default_factory=list)
    procs: dict[str, list[float]] = field(default_factory=dict)
    """Process (meter or incarnation) -> [came up at, last report at, up_s, train_s], its own clock."""
    tokens_per_step: float | None = None
    speed: tuple[float, float | None, float | None] | None = None
    """(reported at, MFU, peak memory GiB) of its newest contribution that reported them."""


def reported_speed(info: Mapping[str, object]) -> tuple[float | None, float | None]:
    """(MFU, peak memory in GiB) from a contribution's ``info["speed"]``: the learner's own numbers,
    shown only, each kept only where plausible (MFU in [0, 1], memory in [0, 2^20] GiB)."""
    speed = info.get("speed")
    if not isinstance(speed, Mapping):
        return None, None
    mfu, memory = finite(speed.get("mfu")), finite(speed.get("peak_mem_gib"))
    return (mfu if mfu is not None and 0 <= mfu <= 1 else None,
            memory if memory is not None and 0 <= memory <= 2**20 else None)


@dataclass(frozen=True)
class RoundPoint:
    """One committed round, for the run's plots (:mod:`atoll.runs.plots`)."""

    round: int
    at: float
    """When it was committed (the synchronizer's clock, seconds since the epoch)."""
    tokens: float
    """Tokens of training merged into the model so far."""
    val_loss: float | None
    """Validation loss of the model as of this round, where it was measured (:mod:`atoll.runs.losses`)."""
    bytes_: int
    """Bytes the synchronizer and the round's learners moved for it."""
    pools: dict[str, int]
    """Contributors merged, by pool."""
    goodput: float | None = None
    merged_share: float | None = None
    """The run's figures so far, where sampled (:attr:`GoodputTracker.sample_every`)."""


class GoodputTracker:
    """Goodput and merged-work share so far, updated one committed round at a time (each contribution
    record read once); ``series`` keeps one :class:`RoundPoint` per round for the plots."""

    def __init__(self, store: RunReader, *, sample_every: int = 1, keep: int = 100_000) -> None:
        """``sample_every``: the run's figures go into ``series`` every that many rounds (and at
        the end of each :meth:`add`); ``keep``: rounds of ``series`` kept (the oldest go first)."""
        self.store = store
        self.cache: dict[str, ContributionRecord | None] = {}
        self.after = 0
        self.learners: dict[str, _LearnerWork] = {}
        self._seen: set[str] = set()
        self.merged = MergedWork()
        self.lost = LostWork()
        """Every learner's steps by fate: merged, or lost by cause."""
        self.wire = WireTracker()
        """The run's traffic, from the same commit records (they carry it: nothing more is read)."""
        self.sample_every = sample_every
        self.keep = keep
        self.series: list[RoundPoint] = []
        self.losses = ValLosses()
        """Validation loss by round: :meth:`refresh_losses` reads the evaluations written since."""
        self._tokens = 0.0

    def _note(self, rec: ContributionRecord) -> _LearnerWork:
        work = self.learners.setdefault(rec.learner_id, _LearnerWork())
        if rec.key in self._seen:
            return work
        self._seen.add(rec.key)
        # The learner's own numbers: only plausible ones count (an absurd step counter or step
        # time would overflow the arithmetic below or turn goodput into nan).
        step = rec.info.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**53:
            work.events.append((rec.created_at, step))
        st = finite(rec.info.get("step_time_s"))
        if st is not None and 0 < st <= 86_400.0:
            work.step_times.append(st)
        if 0 < rec.c_steps < 2**53 and 0 <= rec.c_tokens < 2**53:
            work.tokens_per_step = rec.c_tokens / rec.c_steps
        mfu, memory = reported_speed(rec.info)
        if (mfu is not None or memory is not None) and math.isfinite(rec.created_at) and (
                work.speed is None or rec.created_at >= work.speed[0]):
            work.speed = (rec.created_at, mfu, memory)
        up, train = finite(rec.info.get("up_s")), finite(rec.info.get("train_s"))
        if up is not None and train is not None and 0 <= train <= up <= MAX_REPORTED_S and math.isfinite(rec.created_at):
            proc = meter_from_report(rec.info.get("wire")) or f"incarnation-{rec.incarnation}"
            seen = work.procs.setdefault(proc, [rec.created_at - up, rec.created_at, up, train])
            seen[:] = [min(seen[0], rec.created_at - up), max(seen[1], rec.created_at), max(seen[2], up),
                       max(seen[3], train)]
        return work

    def add(self, records: Iterable[CommitRecord]) -> None:
        records = [r for r in records if r.round > self.after]
        prefetch_contributions(self.store, (k for r in records for k in (*(a.key for a in r.accepted), *r.rejected)),
                               self.cache)
        for i, record in enumerate(records):
            if record.round <= self.after:
                continue
            new_tokens = 0
            for a in record.accepted:
                rec = read_contribution(self.store, a.key, self.cache)
                work = self._note(rec) if rec is not None else self.learners.setdefault(a.learner_id, _LearnerWork())
                steps, tokens = self.merged.add(record.fragment, a)
                work.merged_steps += steps
                work.kept_steps += _kept(rec, a.c_steps, steps)
                new_tokens += tokens
            for key in record.rejected:
                rec = read_contribution(self.store, key, self.cache)
                if rec is not None:
                    self._note(rec)
            self.lost.round(record, self.cache)
            merged = new_tokens / self.store.plan.num_fragments
            self.losses.note_commits([record])
            wire = self.wire.add(record, tokens_merged=merged)
            self.after = record.round
            self._point(record, merged, wire, sample=i == len(records) - 1 or record.round % self.sample_every == 0)

    def _point(self, record: CommitRecord, merged: float, wire: RoundWire, *, sample: bool) -> None:
        self._tokens += merged
        pools: dict[str, int] = {}
        named = record.stats.get("pools")
        for a in record.accepted:
            pool = named.get(a.learner_id) if isinstance(named, Mapping) else None
            pools[str(pool) if isinstance(pool, str) else "?"] = pools.get(str(pool) if isinstance(pool, str) else "?", 0) + 1
        report = self.report() if sample else None
        self.series.append(RoundPoint(
            round=record.round, at=record.created_at, tokens=self._tokens, val_loss=self.losses.get(record.round),
            bytes_=wire.synchronizer.bytes_total + wire.learners.bytes_total, pools=pools,
            goodput=report.goodput if report else None, merged_share=report.merged_share if report else None))
        if len(self.series) > self.keep:
            del self.series[: len(self.series) - self.keep]

    def refresh_losses(self) -> None:
        """Read the evaluation records written since the last call (evaluation runs after a round
        commits, so its loss may arrive after the round was added) into ``losses`` and ``series``."""
        added = self.losses.refresh(self.store)
        rounds = [p.round for p in self.series]
        for r, loss in added.items():
            i = bisect.bisect_left(rounds, r)
            if i < len(rounds) and rounds[i] == r:
                self.series[i] = dataclasses.replace(self.series[i], val_loss=loss)

    def update(self) -> GoodputReport:
        """Read the rounds committed since the last call, then report."""
        latest = self.store.latest_round()
        while latest > self.after:  # a chunk at a time: a long run's history is not held at once
            self.add(self.store.history(self.after + 1, min(latest, self.after + HISTORY_CHUNK)))
        return self.report()

    def report(self) -> GoodputReport:
        p = self.store.plan.num_fragments
        lost = self.lost.steps()
        times = {lid: _learner_time(work, p, lost.get(lid, {})) for lid, work in self.learners.items()}
        available = sum(t.available_s for t in times.values())
        training = sum(t.training_s for t in times.values())
        useful = sum(t.useful_s for t in times.values())
        merged = sum(t.merged_s for t in times.values())
        return GoodputReport(goodput=useful / available if available > 0 else None,
                             merged_share=merged / training if training > 0 else None,
                             useful_s=useful, available_s=available, merged_s=merged, training_s=training,
                             per_learner={lid: t.goodput for lid, t in times.items()}, learners=times,
                             kept_s=sum(t.kept_s for t in times.values()),
                             lost_s={c: sum(t.lost_s.get(c, 0.0) for t in times.values()) for c in LOST_CAUSES})


def _kept(rec: ContributionRecord | None, c_steps: int, new_steps: int) -> int:
    """Of a merged contribution's ``new_steps`` (beyond what the learner's earlier contribution
    against the same base merged), those it carried through an adoption: its first
    ``info["kept_steps"]`` steps, less any the earlier one already held."""
    kept = rec.info.get("kept_steps") if rec is not None else None
    if not isinstance(kept, int) or isinstance(kept, bool) or kept <= 0:
        return 0
    return max(0, min(kept, c_steps) - (c_steps - new_steps))


def _learner_time(work: _LearnerWork, p: int, fates: Mapping[str, int]) -> LearnerTime:
    """Where a learner's time went (:class:`LearnerTime`). Steps are timed by the learner's median
    step time; with its processes' own clocks (``up_s``, ``train_s``) the time available and in
    steps come from them, otherwise (older records) it is taken to have trained all the time.
    ``fates``: its steps by fate over all fragments (:meth:`LostWork.steps`)."""
    t = statistics.median(work.step_times) if work.step_times else 1.0
    steps = [step for _, step in sorted(work.events)]
    # The highest counter reached, plus every step run twice after a restart (the counter went
    # back to the learner's last saved state).
    redone = sum(max(0, a - b) for a, b in zip(steps, steps[1:], strict=False))
    ran = (max(steps) if steps else 0) + redone
    merged_steps = work.merged_steps / p
    ran = max(ran, math.ceil(merged_steps))
    training = ran * t
    available, up = training, training
    if work.procs:
        procs = work.procs.values()
        available = max(v[1] for v in procs) - min(v[0] for v in procs)
        up = min(available, sum(v[2] for v in procs))
        measured = min(up, sum(v[3] for v in procs))
        if measured > 0:
            training = measured
    share = min(1.0, merged_steps / ran) if ran else 0.0
    redone_s = min(training, redone * t)
    tps = work.tokens_per_step / t if work.tokens_per_step is not None and work.step_times else None
    return LearnerTime(available_s=max(available, training), training_s=training, waiting_s=max(0.0, up - training),
                       down_s=max(0.0, available - up), redone_s=redone_s, merged_s=share * training,
                       tokens_per_s=tps, mfu=work.speed[1] if work.speed else None,
                       peak_mem_gib=work.speed[2] if work.speed else None,
                       kept_s=min(1.0, work.kept_steps / p / ran) * training if ran else 0.0,
                       lost_s={c: min(1.0, fates.get(c, 0) / p / ran) * training if ran else 0.0 for c in LOST_CAUSES})
