"""A run's traffic from its commit records: what the synchronizer and the learners sent, per round
and per token (trained and merged).

Each commit record carries the synchronizer's counts since its previous commit (``stats.wire``)
and its contributors' own reports (``stats.learner_wire``): nothing more is read from the bucket."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from atoll.runs.numbers import finite, fmt_bytes, per_token
from atoll.storage.records import CommitRecord
from atoll.storage.wire import WIRE_FIELDS, WireCounts, meter_from_report, tokens_from_report, wire_from_report

__all__ = ["METERS_PER_LEARNER", "RoundWire", "WireTracker"]


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
        the model (its contributors' new tokens / P, as :class:`~atoll.runs.goodput.GoodputTracker`
        counts them); default its ``stats.tokens``."""
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
        merged: float = tokens_merged if tokens_merged is not None else finite(stats.get("tokens")) or 0.0
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
            out.append(f"{who:<16} {c.requests / n:>9.1f} {fmt_bytes(c.bytes_up / n):>10} "
                       f"{fmt_bytes(c.bytes_down / n):>10} {per_token(c.bytes_total, self.learner_tokens):>15} "
                       f"{per_token(c.bytes_total, self.tokens_merged):>14}")
        out.append(f"  over {n} rounds; up and down, all requests; a learner's traffic as it reports it")
        return out
