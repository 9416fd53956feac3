"""What committed rounds merged, contribution by contribution: the contribution records a round
names (read from the bucket a chunk at a time), a round's contributions table, and the effective H
(inner steps per merged contribution)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from atoll.storage.codec import load_record
from atoll.storage.reader import RunReader
from atoll.storage.records import KIND_CONTRIBUTION, CommitRecord, ContributionRecord
from atoll.storage.store import io_map
from atoll.storage.validation import InvalidInput

__all__ = [
    "ContributionRow",
    "contribution_rows",
    "effective_h",
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
    """A contribution record, or None if it is gone or not a contribution record (a transient
    storage error is raised: the store is unwell, not the record)."""
    try:
        data = store.store.get_or_none(key, max_bytes=1 << 20)
        return ContributionRecord.from_body(load_record(data, KIND_CONTRIBUTION), key) if data is not None else None
    except (InvalidInput, ValueError, TypeError):
        return None


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


def _learner_of_key(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    return name.split(".s", 1)[0] if ".s" in name else name


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
        if rec is not None:
            pool = rec.info.get("pool") if isinstance(rec.info.get("pool"), str) else ""
            rows.append(ContributionRow(rec.learner_id, str(pool), rec.c_tokens, rec.c_steps, 0.0, str(why)))
        else:
            rows.append(ContributionRow(_learner_of_key(key), "", 0, 0, 0.0, str(why)))
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
