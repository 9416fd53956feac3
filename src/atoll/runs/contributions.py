"""What committed rounds merged, contribution by contribution: the contribution records a round
names (read from the bucket a chunk at a time), a round's contributions table, the effective H
(inner steps per merged contribution), and the work no round merged, by cause (:class:`LostWork`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from atoll.core.rejection import Rejection, RejectionKind
from atoll.storage import paths
from atoll.storage.codec import load_record
from atoll.storage.handle import MAX_CONTRIBUTION_RECORD_BYTES
from atoll.storage.reader import RunReader
from atoll.storage.reading import Skipped, read_parsed
from atoll.storage.records import KIND_CONTRIBUTION, CommitRecord, ContributionRecord
from atoll.storage.store import io_map

__all__ = [
    "LOST_CAUSES",
    "ContributionRow",
    "LostWork",
    "contribution_rows",
    "effective_h",
    "fate_of",
    "learner_of_contribution",
    "prefetch_contributions",
    "read_contribution",
    "steps_since_sync",
]


PREFETCH_CHUNK = 32
"""Contribution records the goodput tracker reads at once, a chunk at a time. The object-store
thread pool (:func:`~atoll.storage.store.io_map`) is shared with the synchronizer's round reads in
the training-run process: between two chunks they get their turn, so a tracker catching up on a
long run delays a round by one chunk at most (~0.1 s on S3)."""


def _load_contribution(store: RunReader, key: str) -> ContributionRecord | None:
    """A contribution record, or None if it is gone or unusable (not a plain object, oversized,
    not a contribution record: the one reader's :class:`~atoll.storage.reading.Skipped`). A
    transient storage error is raised: the store is unwell, not the record."""
    got = read_parsed(store.store, key, MAX_CONTRIBUTION_RECORD_BYTES,
                      lambda data: ContributionRecord.from_body(load_record(data, KIND_CONTRIBUTION), key))
    return None if isinstance(got, Skipped) else got


def read_contribution(store: RunReader, key: str, cache: dict[str, ContributionRecord | None]) -> ContributionRecord | None:
    """The contribution record at ``key`` (see :func:`_load_contribution`), read once into ``cache``."""
    if key not in cache:
        cache[key] = _load_contribution(store, key)
    return cache[key]


def prefetch_contributions(store: RunReader, keys: Iterable[str], cache: dict[str, ContributionRecord | None]) -> None:
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


_RECORD_NAME = re.compile(r"^(?P<lid>.+)\.s\d{10}\.[0-9a-f]{16}\.json$")


def learner_of_contribution(key: str) -> str:
    """The learner a contribution key belongs to: the owner of the prefix it lies under (what the
    bucket policy lets only that learner write), never what its record or file name claims; for
    a key outside every learner's prefix, the learner id its file name spells."""
    owner = paths.learner_of_key(key)
    if owner is not None:
        return owner
    name = key.rsplit("/", 1)[-1]
    m = _RECORD_NAME.match(name)
    return m.group("lid") if m else name


def contribution_rows(store: RunReader, record: CommitRecord,
                      cache: dict[str, ContributionRecord | None] | None = None) -> list[ContributionRow]:
    """The round's contributions: merged ones with their weight, then everything given weight 0."""
    cache = {} if cache is None else cache
    prefetch_contributions(store, record.rejected, cache)
    pools: Mapping[str, Any] = record.stats.get("pools", {}) or {}
    rows = [ContributionRow(a.learner_id, str(pools.get(a.learner_id, "")), a.c_tokens, a.c_steps, a.weight, "accepted")
            for a in sorted(record.accepted, key=lambda a: a.learner_id)]
    for key, why in sorted(record.rejected.items()):
        rec = read_contribution(store, key, cache)
        learner = learner_of_contribution(key)
        if rec is not None:
            pool = rec.info.get("pool") if isinstance(rec.info.get("pool"), str) else ""
            rows.append(ContributionRow(learner, str(pool), rec.c_tokens, rec.c_steps, 0.0, str(why)))
        else:
            rows.append(ContributionRow(learner, "", 0, 0, 0.0, str(why)))
    return rows


def effective_h(records: Iterable[CommitRecord]) -> tuple[float, int] | None:
    """The run's effective H over ``records``: the mean inner steps per merged contribution (each
    accepted contribution's ``c_steps``: its learner's steps since it last adopted the fragment),
    and how many contributions that is; None if none was merged. Below H, fragments are synced
    more often than H says (bytes grow as H / effective H); ``DilocoConfig.round_pacing`` brings
    it to about H."""
    steps = [a.c_steps for r in records for a in r.accepted if 0 < a.c_steps < 2**53]
    return (sum(steps) / len(steps), len(steps)) if steps else None


def steps_since_sync(rows: Iterable[ContributionRow]) -> float | None:
    """Mean steps since the last sync of this fragment over a round's merged contributions (their
    ``c_steps``): the *effective H*. A synchronizer that keeps up merges each learner's fragment
    every H of its steps; one that falls behind lets learners run more steps between syncs."""
    steps = [r.steps for r in rows if r.status == "accepted" and r.steps > 0]
    return sum(steps) / len(steps) if steps else None


LOST_CAUSES = ("overlap", "superseded", "late", "rejected")
"""Why a learner's inner steps did not reach the model (:class:`LostWork`), in ``atoll status``'s order."""

_FATES = ("merged", *LOST_CAUSES)


def fate_of(why: Rejection) -> str:
    """The cause a rejection puts a contribution's work under: late (after the grace window, and
    not merged since), superseded (the same learner's newer contribution replaced it, or a second
    one in the round), or rejected (every other kind: counters, fencing, outliers, bad input)."""
    if why.kind is RejectionKind.LATE:
        return "late"
    if why.kind in (RejectionKind.SUPERSEDED, RejectionKind.DUPLICATE):
        return "superseded"
    return "rejected"


class LostWork:
    """Each learner's inner steps by fate, fed committed rounds in order; steps, per fragment.

    A contribution of learner m on fragment p, published at m's step ``s`` with ``c_steps`` = c,
    carries m's steps ``(s - c, s]`` on p (its work since it last adopted p, plus, with
    ``keep_local_progress``, what it kept through that adoption). Each step of each fragment
    is then, in this order:

    * merged: a merged contribution carries it (counted once, however many do);
    * the fate of the newest contribution that carries it (by base version, then step): late
      (still refused as late), superseded (replaced by the learner's newer contribution, against
      a newer base: the newer one does not hold this work) or rejected (any other reason);
    * overlap: no contribution carries it, but a later one exists: steps run between a publish
      and the next adoption, which the adoption overwrote (``keep_local_progress`` carries them
      into the next contribution instead);
    * not counted: after the newest contribution a committed round lists (not yet published, or
      not yet decided).

    Only contributions a committed round lists (merged or rejected) are known, and only those
    whose record reads (``info["step"]``). A learner restarted from a save runs some steps again:
    they are counted once here (goodput counts them as redone). Memory: one span per such
    contribution."""

    def __init__(self) -> None:
        self._spans: dict[tuple[str, int], dict[str, tuple[int, int, int, str]]] = {}
        """(learner, fragment) -> key -> (base version, first step, last step, fate)."""
        self._counted: dict[tuple[str, int], dict[str, int]] = {}
        """(learner, fragment) -> its steps by fate, as of the last :meth:`steps` (redone when it changed)."""

    def note(self, learner: str, fragment: int, rec: ContributionRecord | None, fate: str) -> None:
        """A committed round merged (``fate="merged"``) or refused ``rec``; a merged one stays merged."""
        step = rec.info.get("step") if rec is not None else None
        if rec is None or not isinstance(step, int) or isinstance(step, bool) or not 0 < rec.c_steps <= step < 2**53:
            return
        spans = self._spans.setdefault((learner, fragment), {})
        old = spans.get(rec.key)
        if old is None or old[3] != "merged":
            spans[rec.key] = (rec.base_version, step - rec.c_steps, step, fate)
            self._counted.pop((learner, fragment), None)

    def round(self, record: CommitRecord, contribution: Mapping[str, ContributionRecord | None]) -> None:
        """Note committed ``record``'s contributions (their records by key, None when unreadable)."""
        for a in record.accepted:
            self.note(a.learner_id, record.fragment, contribution.get(a.key), "merged")
        for key, why in record.rejected.items():
            self.note(learner_of_contribution(key), record.fragment, contribution.get(key), fate_of(why))

    def steps(self) -> dict[str, dict[str, int]]:
        """Per learner, its steps by fate over every fragment ("merged" and :data:`LOST_CAUSES`),
        each fragment's steps counted apart: divide by P for whole inner steps."""
        out: dict[str, dict[str, int]] = {}
        for slot, spans in self._spans.items():
            got = out.setdefault(slot[0], dict.fromkeys(_FATES, 0))
            if slot not in self._counted:
                self._counted[slot] = _fates(list(spans.values()))
            for fate, n in self._counted[slot].items():
                got[fate] += n
        return out


def _fates(spans: list[tuple[int, int, int, str]]) -> dict[str, int]:
    """One (learner, fragment)'s steps from 0 to its newest contribution, by fate (:class:`LostWork`):
    a sweep over the spans' ends, holding only the spans open at each (a few at a time)."""
    out = dict.fromkeys(_FATES, 0)
    spans = sorted(spans, key=lambda s: s[1])
    cuts = sorted({0, *(lo for _, lo, _, _ in spans), *(hi for _, _, hi, _ in spans)})
    open_: list[tuple[int, int, int, str]] = []
    i = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        while i < len(spans) and spans[i][1] <= lo:
            open_.append(spans[i])
            i += 1
        open_ = [s for s in open_ if s[2] > lo]
        if not open_:
            out["overlap"] += hi - lo
        elif any(s[3] == "merged" for s in open_):
            out["merged"] += hi - lo
        else:
            out[max(open_, key=lambda s: (s[0], s[2]))[3]] += hi - lo
    return out
