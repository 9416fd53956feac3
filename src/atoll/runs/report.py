"""What a round looked like, and how much learner work ended up in the model: computed from the bucket.

Pure functions over :class:`~atoll.storage.bucket.RunStore` records (no Prefect import), shared by
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
  share is merged steps over steps run (redone ones included), weighted by step time.

Only the bucket is read (commit records and the contribution records they name), so goodput is
the same whether or not the Prefect database that ran the run still exists.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from atoll.storage import paths
from atoll.storage.bucket import RunStore
from atoll.storage.codec import load_record
from atoll.storage.records import KIND_CONTRIBUTION, AcceptedContribution, CommitRecord, ContributionRecord
from atoll.storage.store import io_map
from atoll.storage.validation import InvalidInput
from atoll.storage.wire import WIRE_FIELDS, WireCounts, meter_from_report, tokens_from_report, wire_from_report

__all__ = [
    "MergedWork",
    "ContributionRow",
    "GoodputReport",
    "GoodputTracker",
    "LearnerTime",
    "RoundPoint",
    "RoundWire",
    "WireTracker",
    "contribution_rows",
    "effective_h",
    "contributions_from_markdown",
    "round_markdown",
    "steps_since_sync",
    "history_table",
    "run_status",
    "check_run",
    "checkpoint_rounds",
    "figure_lines",
    "learner_time_table",
    "plural",
    "round_flow_name",
    "slug",
]


def slug(text: str) -> str:
    """Lowercase letters, digits and dashes only (what Prefect artifact keys accept)."""
    out = "".join(c if c.isalnum() and c.isascii() else "-" for c in text.lower())
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "run"


def plural(n: int, noun: str) -> str:
    """``1 learner``, ``2 learners``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def round_flow_name(round_: int) -> str:
    """The name of round ``round_``'s flow run, e.g. ``round-000017``."""
    return f"round-{round_:06d}"


PREFETCH_CHUNK = 32
"""Contribution records the goodput tracker reads at once, a chunk at a time. The object-store
thread pool (:func:`~atoll.storage.store.io_map`) is shared with the synchronizer's round reads in
the training-run process: between two chunks they get their turn, so a tracker catching up on a
long run delays a round by one chunk at most (~0.1 s on S3)."""

HISTORY_CHUNK = 256
"""Commit records a tracker reads (and whose contributions it prefetches) per step when it catches up."""


def _load_contribution(store: RunStore, key: str) -> ContributionRecord | None:
    """A contribution record, or None if it is gone or not a contribution record (a transient
    storage error is raised: the store is unwell, not the record)."""
    try:
        data = store.store.get_or_none(key, max_bytes=1 << 20)
        return ContributionRecord.from_body(load_record(data, KIND_CONTRIBUTION), key) if data is not None else None
    except (InvalidInput, ValueError, TypeError):
        return None


def _read_contribution(store: RunStore, key: str, cache: dict[str, ContributionRecord | None]) -> ContributionRecord | None:
    if key not in cache:
        cache[key] = _load_contribution(store, key)
    return cache[key]


def prefetch_contributions(store: RunStore, keys: Iterable[str], cache: dict[str, ContributionRecord | None]) -> None:
    """Read every contribution record in ``keys`` that ``cache`` lacks, :data:`PREFETCH_CHUNK` at a
    time, concurrently: a relaunched training run's recorder rebuilds goodput from every round of
    the run, ~40 records a round in the chaos soak, and one at a time that took minutes."""
    todo = [k for k in dict.fromkeys(keys) if k not in cache]
    for i in range(0, len(todo), PREFETCH_CHUNK):
        chunk = todo[i:i + PREFETCH_CHUNK]
        for key, rec in zip(chunk, io_map(lambda k: _load_contribution(store, k), chunk), strict=True):
            cache[key] = rec


@dataclass(frozen=True)
class ContributionRow:
    """One line of a round's contributions table."""

    learner: str
    pool: str
    tokens: int
    steps: int
    weight: float
    status: str
    """'accepted', or the reason it got weight 0 / was refused."""

    def as_dict(self) -> dict[str, Any]:
        return {"learner": self.learner, "pool": self.pool, "tokens": self.tokens, "steps": self.steps,
                "weight": round(self.weight, 6), "status": self.status}


def _learner_of_key(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    return name.split(".s", 1)[0] if ".s" in name else name


def contribution_rows(store: RunStore, record: CommitRecord,
                      cache: dict[str, ContributionRecord | None] | None = None) -> list[ContributionRow]:
    """The round's contributions: merged ones with their weight, then everything given weight 0."""
    cache = {} if cache is None else cache
    prefetch_contributions(store, record.rejected, cache)
    pools: Mapping[str, Any] = record.stats.get("pools", {}) or {}
    rows = [ContributionRow(a.learner_id, str(pools.get(a.learner_id, "")), a.c_tokens, a.c_steps, a.weight, "accepted")
            for a in sorted(record.accepted, key=lambda a: a.learner_id)]
    for key, why in sorted(record.rejected.items()):
        rec = _read_contribution(store, key, cache)
        if rec is not None:
            pool = rec.info.get("pool") if isinstance(rec.info.get("pool"), str) else ""
            rows.append(ContributionRow(rec.learner_id, str(pool), rec.c_tokens, rec.c_steps, 0.0, str(why)))
        else:
            rows.append(ContributionRow(_learner_of_key(key), "", 0, 0, 0.0, str(why)))
    return rows


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


@dataclass(frozen=True)
class RoundWire:
    """One committed round's traffic, as the bucket's records tell it."""

    synchronizer: WireCounts
    """What the synchronizer's store sent since its previous commit (``stats.wire``)."""
    learners: WireCounts
    """What the round's contributors' stores sent since their previous report (summed)."""
    learner_tokens: int
    """Tokens those learners trained over the same spans."""
    tokens_merged: float
    """Tokens of training the round brought into the model (each trained token feeds all P
    fragments: a round's merged counters divided by P)."""


def _larger(a: WireCounts, b: WireCounts) -> WireCounts:
    return WireCounts(**{f: max(getattr(a, f), getattr(b, f)) for f in WIRE_FIELDS})


METERS_PER_LEARNER = 4
"""A learner's meters (processes) a :class:`WireTracker` remembers: a late contribution of an
earlier process still finds its predecessor's numbers."""


class WireTracker:
    """Learners' and the synchronizer's traffic, fed committed rounds in order.

    A learner reports its store's counts since it started with each contribution (and its meter's
    id: a new process, a new meter), and a commit carries its contributors' reports
    (``stats.learner_wire``). Counts under one meter only grow, but contributions are not merged in
    the order they were published, so a learner's traffic in a round is what its report adds to
    the largest counts seen under that meter (nothing, for an older report); a new meter's report
    counts in full. What a learner sends after its last merged contribution shows up with its next
    one. Memory: a few meters per learner, and the last ``keep`` rounds."""

    def __init__(self, *, keep: int = 4096) -> None:
        self.keep = keep
        self._last: dict[str, dict[str, tuple[WireCounts, int]]] = {}
        self.rounds: dict[int, RoundWire] = {}
        """Round -> its traffic, for the last ``keep`` rounds fed."""
        self.synchronizer = WireCounts()
        self.learners = WireCounts()
        self.learner_tokens = 0
        self.tokens_merged = 0.0
        self.count = 0
        """Rounds fed."""

    def add(self, record: CommitRecord, *, tokens_merged: float | None = None) -> RoundWire:
        """Feed the next committed round. ``tokens_merged``: the tokens of training it brought into
        the model (its contributors' new tokens / P, as :class:`GoodputTracker` counts them);
        default its ``stats.tokens``."""
        stats = record.stats
        sync = wire_from_report(stats.get("wire")) or WireCounts()
        reports = stats.get("learner_wire")
        learners, tokens = WireCounts(), 0
        for lid, reported in sorted(reports.items(), key=lambda kv: str(kv[0])) if isinstance(reports, Mapping) else ():
            counts = wire_from_report(reported)
            if counts is None or not isinstance(lid, str):
                continue
            added, more_tokens = self._note(lid, meter_from_report(reported), counts, tokens_from_report(reported))
            learners, tokens = learners + added, tokens + more_tokens
        merged: float = tokens_merged if tokens_merged is not None else _finite(stats.get("tokens")) or 0.0
        out = RoundWire(synchronizer=sync, learners=learners, learner_tokens=tokens, tokens_merged=merged)
        self.synchronizer += sync
        self.learners += learners
        self.learner_tokens += tokens
        self.tokens_merged += merged
        self.count += 1
        self.rounds[record.round] = out
        while len(self.rounds) > self.keep:
            del self.rounds[next(iter(self.rounds))]
        return out

    def _note(self, learner: str, meter: str, counts: WireCounts, tokens: int) -> tuple[WireCounts, int]:
        """What this report adds to the largest counts seen under its meter."""
        meters = self._last.setdefault(learner, {})
        seen, seen_tokens = meters.pop(meter, (WireCounts(), 0))
        top = _larger(seen, counts)
        meters[meter] = (top, max(seen_tokens, tokens))  # most recently used last
        while len(meters) > METERS_PER_LEARNER:
            del meters[next(iter(meters))]
        return top - seen, max(0, tokens - seen_tokens)

    @property
    def reporting(self) -> int:
        """Learners that have reported their traffic."""
        return len(self._last)

    def lines(self) -> list[str]:
        """The run's traffic per round and per token (what ``atoll status`` prints)."""
        n = self.count
        if not n or not (self.synchronizer.requests or self.learners.requests):
            return []  # no round of this run carries counts
        head = (f"{'wire':<16} {'req/round':>9} {'up/round':>10} {'down/round':>10} {'B/token trained':>15} "
                f"{'B/token merged':>14}")
        out = [head]
        for who, c in ((f"learners ({self.reporting})", self.learners), ("synchronizer", self.synchronizer)):
            out.append(f"{who:<16} {c.requests / n:>9.1f} {_bytes(c.bytes_up / n):>10} {_bytes(c.bytes_down / n):>10} "
                       f"{_per(c.bytes_total, self.learner_tokens):>15} {_per(c.bytes_total, self.tokens_merged):>14}")
        out.append(f"  over {n} rounds; up and down, all requests; a learner's traffic as it reports it")
        return out


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _per(n: int, tokens: float) -> str:
    return f"{n / tokens:,.1f}" if tokens > 0 else "-"


MAX_REPORTED_S = 1e8
"""A learner's reported ``up_s`` / ``train_s`` count only within [0, this] (they are its own numbers)."""


@dataclass
class _LearnerWork:
    merged_steps: int = 0
    events: list[tuple[float, int]] = field(default_factory=list)  # (created_at, local step)
    step_times: list[float] = field(default_factory=list)
    procs: dict[str, list[float]] = field(default_factory=dict)
    """Process (meter or incarnation) -> [came up at, last report at, up_s, train_s], its own clock."""
    tokens_per_step: float | None = None


@dataclass(frozen=True)
class RoundPoint:
    """One committed round, for the run's plots (:mod:`atoll.runs.plots`)."""

    round: int
    at: float
    """When it was committed (the synchronizer's clock, seconds since the epoch)."""
    tokens: float
    """Tokens of training merged into the model so far."""
    val_loss: float | None
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

    def __init__(self, store: RunStore, *, sample_every: int = 1, keep: int = 100_000) -> None:
        """``sample_every``: the run's figures go into ``series`` every that many rounds (and at
        the end of each :meth:`add`); ``keep``: rounds of ``series`` kept (the oldest go first)."""
        self.store = store
        self.cache: dict[str, ContributionRecord | None] = {}
        self.after = 0
        self.learners: dict[str, _LearnerWork] = {}
        self._seen: set[str] = set()
        self.merged = MergedWork()
        self.wire = WireTracker()
        """The run's traffic, from the same commit records (they carry it: nothing more is read)."""
        self.sample_every = sample_every
        self.keep = keep
        self.series: list[RoundPoint] = []
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
        st = _finite(rec.info.get("step_time_s"))
        if st is not None and 0 < st <= 86_400.0:
            work.step_times.append(st)
        if 0 < rec.c_steps < 2**53 and 0 <= rec.c_tokens < 2**53:
            work.tokens_per_step = rec.c_tokens / rec.c_steps
        up, train = _finite(rec.info.get("up_s")), _finite(rec.info.get("train_s"))
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
                rec = _read_contribution(self.store, a.key, self.cache)
                work = self._note(rec) if rec is not None else self.learners.setdefault(a.learner_id, _LearnerWork())
                steps, tokens = self.merged.add(record.fragment, a)
                work.merged_steps += steps
                new_tokens += tokens
            for key in record.rejected:
                rec = _read_contribution(self.store, key, self.cache)
                if rec is not None:
                    self._note(rec)
            merged = new_tokens / self.store.plan.num_fragments
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
            round=record.round, at=record.created_at, tokens=self._tokens, val_loss=_finite(record.stats.get("val_loss")),
            bytes_=wire.synchronizer.bytes_total + wire.learners.bytes_total, pools=pools,
            goodput=report.goodput if report else None, merged_share=report.merged_share if report else None))
        if len(self.series) > self.keep:
            del self.series[: len(self.series) - self.keep]

    def update(self) -> GoodputReport:
        """Read the rounds committed since the last call, then report."""
        latest = self.store.latest_round()
        while latest > self.after:  # a chunk at a time: a long run's history is not held at once
            self.add(self.store.history(self.after + 1, min(latest, self.after + HISTORY_CHUNK)))
        return self.report()

    def report(self) -> GoodputReport:
        p = self.store.plan.num_fragments
        times = {lid: _learner_time(work, p) for lid, work in self.learners.items()}
        available = sum(t.available_s for t in times.values())
        training = sum(t.training_s for t in times.values())
        useful = sum(t.useful_s for t in times.values())
        merged = sum(t.merged_s for t in times.values())
        return GoodputReport(goodput=useful / available if available > 0 else None,
                             merged_share=merged / training if training > 0 else None,
                             useful_s=useful, available_s=available, merged_s=merged, training_s=training,
                             per_learner={lid: t.goodput for lid, t in times.items()}, learners=times)


def _learner_time(work: _LearnerWork, p: int) -> LearnerTime:
    """Where a learner's time went (:class:`LearnerTime`). Steps are timed by the learner's median
    step time; with its processes' own clocks (``up_s``, ``train_s``) the time available and in
    steps come from them, otherwise (older records) it is taken to have trained all the time."""
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
                       tokens_per_s=tps)


# Stats in a commit record are free-form JSON for people: any of them may be a string, a list, a
# bool, an integer far beyond float range. Everything that prints them goes through these.

def _finite(x: Any) -> float | None:
    """``x`` as a finite float, or None if it is not a number (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        v = float(x)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def _fmt_num(x: Any, spec: str, missing: str = "-") -> str:
    v = _finite(x)
    return missing if v is None else format(v, spec)


def _fmt_int(x: Any, spec: str = "", missing: str = "-") -> str:
    if isinstance(x, bool) or not isinstance(x, int) or abs(x) >= 10**18:
        return missing
    return format(x, spec)


def _fmt_s(x: Any) -> str:
    v = _finite(x)
    return f"{v:.2f} s" if v is not None else "-"


def effective_h(records: Iterable[CommitRecord]) -> tuple[float, int] | None:
    """The run's effective H over ``records``: the mean inner steps per merged contribution (each
    accepted contribution's ``c_steps``: its learner's steps since it last adopted the fragment),
    and how many contributions that is; None if none was merged. Below H, fragments are synced
    more often than H says (bytes grow as H / effective H); ``DilocoConfig.round_pacing`` brings
    it to about H."""
    steps = [a.c_steps for r in records for a in r.accepted if 0 < a.c_steps < 2**53]
    return (sum(steps) / len(steps), len(steps)) if steps else None


def effective_h_line(records: Iterable[CommitRecord], inner_steps: int, round_pacing: float) -> str:
    """``atoll status``'s effective H line, next to H and the round pacing that aims at it."""
    got = effective_h(records)
    pacing = f"round pacing {round_pacing:g}" if round_pacing > 0 else "round pacing off"
    if got is None:
        return f"effective H: - (nothing merged yet; H = {inner_steps}, {pacing})"
    return (f"effective H: {got[0]:.1f} inner steps per merged contribution (H = {inner_steps}, {pacing}; "
            f"{got[1]} contributions)")


def steps_since_sync(rows: Iterable[ContributionRow]) -> float | None:
    """Mean steps since the last sync of this fragment over a round's merged contributions (their
    ``c_steps``): the *effective H*. A synchronizer that keeps up merges each learner's fragment
    every H of its steps; one that falls behind lets learners run more steps between syncs."""
    steps = [r.steps for r in rows if r.status == "accepted" and r.steps > 0]
    return sum(steps) / len(steps) if steps else None


CONTRIBUTIONS_HEADING = "## Contributions"
CONTRIBUTION_COLUMNS = ("learner", "pool", "tokens", "steps", "weight", "status")


def round_markdown(record: CommitRecord, rows: list[ContributionRow], *, run_id: str, run_url: str,
                   max_rounds: int | None, goodput: GoodputReport | None = None, inner_steps: int | None = None,
                   wire: WireTracker | None = None) -> str:
    """The round's summary as markdown (the round flow run's one artifact): the round, its
    contributions table (``rows``: learner, pool, tokens, steps, weight, accepted or why not); with
    ``goodput``, the goodput so far overall and per learner; with ``inner_steps`` (H), the effective
    H next to it; the synchronizer's traffic for the round and, with ``wire`` (fed this round), the
    learners'."""
    s = record.stats
    accepted = [r for r in rows if r.status == "accepted"]
    eff_h = steps_since_sync(rows)
    contributors = ", ".join(f"`{r.learner}` ({r.pool or '?'})" for r in accepted) or "none"
    lines = [
        f"# Round {record.round}" + (f" of {max_rounds}" if max_rounds else "") + f" — fragment {record.fragment}",
        "",
        f"Run `{run_id}` at `{run_url}`",
        "",
        "| | |",
        "|---|---|",
        f"| quorum reached after | {_fmt_s(s.get('quorum_s'))} |",
        f"| grace window used | {_fmt_s(s.get('grace_s'))} |",
        f"| round open for | {_fmt_s(s.get('wait_s'))} |",
        f"| closed because | {_short(s.get('reason', '-'))} |",
        f"| contributors ({len(accepted)}) | {contributors} |",
        f"| weight 0 | {len(rows) - len(accepted)} |",
        f"| tokens merged | {_fmt_int(s.get('tokens', 0), ',')} |",
        f"| bytes in (deltas) | {_fmt_int(s.get('bytes_in', 0), ',')} |",
        f"| bytes out per learner (new fragment) | {_fmt_int(s.get('bytes_out_per_learner', 0), ',')} |",
        *_wire_rows(record, wire),
        f"| validation loss | {_fmt_num(s.get('val_loss'), '.4f', 'not measured this round')} |",
        f"| updated | {'yes' if record.updated else 'no (nothing mergeable)'} |",
        f"| effective H: steps since last sync (mean of merged) | {_fmt_num(eff_h, '.1f')}"
        + (f" (H = {inner_steps})" if inner_steps else "") + " |",
    ]
    if goodput is not None and goodput.goodput is not None:
        lines.append(f"| goodput so far (time in useful training steps / time available) | "
                     f"{100 * goodput.goodput:.1f}% |")
        lines.append(f"| merged-work share so far (training the model kept) | {_pct(goodput.merged_share)} |")
    if rows:
        lines += ["", CONTRIBUTIONS_HEADING, "", "| " + " | ".join(CONTRIBUTION_COLUMNS) + " |",
                  "|---" * len(CONTRIBUTION_COLUMNS) + "|"]
        lines += [f"| {r.learner} | {r.pool or '-'} | {r.tokens:,} | {r.steps} | {round(r.weight, 6)} | "
                  f"{_short(r.status).replace('|', '/')} |" for r in rows]
    if goodput is not None and goodput.learners:
        lines += ["", *learner_time_table(goodput)]
    return "\n".join(lines) + "\n"


def figure_lines(report: GoodputReport) -> list[str]:
    """The run's two figures, each with what it means (``atoll status``)."""
    if report.goodput is None:
        return [report.line()]
    return [f"goodput {100 * report.goodput:.1f}%: time in useful training steps over time available "
            f"({report.useful_s:.1f} s of {report.available_s:.1f} learner-s; not waiting, not restarting)",
            f"merged-work share {_pct(report.merged_share)}: the part of that training the model kept "
            f"({report.merged_s:.1f} s of {report.training_s:.1f} s merged in committed rounds)"]


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def learner_time_table(goodput: GoodputReport) -> list[str]:
    """Per learner, as markdown: goodput, merged-work share and where its time went."""
    out = ["| learner | goodput so far | merged-work share | training s | waiting s | restarting s | tokens/s |",
           "|---|---|---|---|---|---|---|"]
    for lid, t in sorted(goodput.learners.items()):
        tps = f"{t.tokens_per_s:,.0f}" if t.tokens_per_s is not None else "-"
        out.append(f"| {lid} | {100 * t.goodput:.1f}% | {100 * t.merged_share:.1f}% | {t.training_s:.1f} | "
                   f"{t.waiting_s:.1f} | {t.restarting_s:.1f} | {tps} |")
    return out


def _wire_rows(record: CommitRecord, wire: WireTracker | None) -> list[str]:
    """The round's traffic: synchronizer and learners, requests, bytes, bytes per token merged."""
    got = wire.rounds.get(record.round) if wire is not None else None
    sync = got.synchronizer if got is not None else wire_from_report(record.stats.get("wire"))
    merged = got.tokens_merged if got is not None else 0
    rows = []
    if sync is not None and sync.requests:
        rows.append(f"| wire, synchronizer (since its previous commit) | {_wire_cell(sync, merged)} |")
    if got is not None and got.learners.requests:
        rows.append(f"| wire, learners (since their previous report) | {_wire_cell(got.learners, merged)} |")
    return rows


def _wire_cell(c: WireCounts, merged: float) -> str:
    per = f"; {c.bytes_total / merged:,.1f} B per token merged" if merged > 0 else ""
    return f"{c.requests:,} requests, up {_bytes(c.bytes_up)}, down {_bytes(c.bytes_down)}{per}"


def contributions_from_markdown(md: str) -> list[dict[str, str]]:
    """The contributions table of a round's markdown (:func:`round_markdown`) read back as one dict
    of strings per row, keyed by :data:`CONTRIBUTION_COLUMNS`: what a script that reads a round's
    artifact from the Prefect API gets. Empty if the round had no contributions."""
    if CONTRIBUTIONS_HEADING not in md:
        return []
    block = md[md.index(CONTRIBUTIONS_HEADING):].split("\n\n")[1].splitlines()[2:]  # past header + rule
    return [dict(zip(CONTRIBUTION_COLUMNS, (c.strip() for c in line.strip().strip("|").split("|")), strict=True))
            for line in block if line.startswith("|")]


def history_table(records: Iterable[CommitRecord]) -> list[str]:
    """Plain-text round history (what ``atoll status`` prints)."""
    out = [f"{'round':>6} {'frag':>4} {'in':>3} {'out':>3} {'quorum_s':>8} {'grace_s':>7} {'tokens':>8} "
           f"{'val_loss':>8}  learners"]
    for r in records:
        s = r.stats
        who = ",".join(a.learner_id for a in r.accepted) or "-"
        out.append(f"{r.round:>6} {r.fragment:>4} {len(r.accepted):>3} {len(r.rejected):>3} "
                   f"{_fmt_num(s.get('quorum_s', 0), '.2f'):>8} {_fmt_num(s.get('grace_s', 0), '.2f'):>7} "
                   f"{_fmt_int(s.get('tokens', 0)):>8} {_fmt_num(s.get('val_loss'), '.4f'):>8}  {who}")
    return out


def _short(x: Any, limit: int = 200) -> str:
    text = " ".join(str(x).split()) if isinstance(x, str | int | float) and not isinstance(x, bool) else "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checkpoint_rounds(store: RunStore) -> list[int]:
    """Rounds with a checkpoint folder; any other name in the folder (``abc``, ``²``, a 40-digit
    number) is ignored, never an error."""
    names = store.store.list(paths.checkpoints_prefix())
    return sorted(int(n) for n in names if n.isascii() and n.isdigit() and len(n) <= 12)


def check_run(store: RunStore) -> None:
    """Read what resuming the run needs (manifest, recipe, latest commit); raise atoll's own
    errors (StorageError, ValueError) on a broken run, never write."""
    from atoll.train.run import load_recipe

    _ = store.manifest
    load_recipe(store)
    latest = store.latest_round()
    if latest:
        store.read_global_state(latest)


def last_val_loss(records: Iterable[CommitRecord]) -> float | None:
    loss = None
    for r in records:
        v = _finite(r.stats.get("val_loss"))
        if v is not None:
            loss = v
    return loss


def run_status(store: RunStore, *, last: int | None = None, tracker: GoodputTracker | None = None) -> list[str]:
    """Everything ``atoll status`` prints: the run, its round history, loss, goodput and merged-work
    share. Bucket only. ``tracker``: a fresh tracker to fill (its ``series`` and report then make
    the run's plots, :mod:`atoll.runs.plots`)."""
    m = store.manifest
    latest = store.latest_round()
    recipe = m.extra.get("recipe", {}) if isinstance(m.extra, Mapping) else {}
    max_rounds = recipe.get("max_rounds") if isinstance(recipe, Mapping) else None
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        max_rounds = None
    records = store.history(1, latest) if latest else []
    c = m.config
    lines = [
        f"run {m.run_id} at {store.url}",
        f"  M={c.num_learners} P={c.num_fragments} H={c.inner_steps} tau={c.overlap_steps} K={c.min_quorum}; "
        f"{latest} of {max_rounds if max_rounds else '?'} rounds committed"
        + ("" if not max_rounds or latest < max_rounds else " (finished)"),
    ]
    fork = m.extra.get("forked_from") if isinstance(m.extra, Mapping) else None
    if isinstance(fork, Mapping):
        lines.append(f"  forked from {_short(fork.get('url'))} at round {_fmt_int(fork.get('round'), '', '?')}")
    shown = records[-last:] if last else records
    if records:
        lines += ["", *history_table(shown)]
        tracker = tracker if tracker is not None else GoodputTracker(store)
        tracker.sample_every = max(1, len(records) // 200)
        tracker.add(records)
        loss = last_val_loss(records)
        report = tracker.report()
        lines += ["", f"latest validation loss: {loss:.4f}" if loss is not None else "latest validation loss: -",
                  *figure_lines(report), effective_h_line(records, c.inner_steps, c.round_pacing)]
        if report.learners:
            lines += ["", f"{'learner':<16} {'goodput':>8} {'merged':>7} {'training s':>10} {'waiting s':>9} "
                          f"{'restarting s':>12} {'tokens/s':>9}"]
            lines += [f"{lid:<16} {100 * t.goodput:>7.1f}% {100 * t.merged_share:>6.1f}% {t.training_s:>10.1f} "
                      f"{t.waiting_s:>9.1f} {t.restarting_s:>12.1f} "
                      f"{(f'{t.tokens_per_s:,.0f}' if t.tokens_per_s is not None else '-'):>9}"
                      for lid, t in sorted(report.learners.items())]
        wire = tracker.wire.lines()
        lines += ["", *wire] if wire else []
    ckpts = checkpoint_rounds(store)
    if ckpts:
        lines.append(f"checkpoints at rounds: {', '.join(map(str, ckpts))}")
    pruned, why = store.read_prune_record()
    if pruned is not None:
        lines.append(f"retention: the global state of rounds 1..{pruned.through_round} is deleted ({pruned.by}, "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(pruned.pruned_at))}; "
                     f"{pruned.deleted_objects} objects, {pruned.deleted_bytes / 2**20:.1f} MiB so far)")
    elif why is not None:
        lines.append(why)
    return lines
