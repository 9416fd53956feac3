"""A run's validation losses by round, from the bucket: the evaluator's records
(``sync/evals/<round>.json``, :mod:`atoll.train.evaluator`) and, for runs from before evaluation
left the round's path, the ``val_loss`` in a commit record's stats. Every reader that shows the
loss (``atoll status``, goodput's series and the plots, the round artifacts, a run's summary)
reads it through here."""

from __future__ import annotations

from collections.abc import Iterable

from atoll.runs.numbers import finite
from atoll.storage.reader import RunReader
from atoll.storage.records import CommitRecord

__all__ = ["ValLosses", "last_val_loss"]


class ValLosses:
    """Validation loss by the round it measured; :meth:`refresh` reads the evaluation records
    written since the last call (one LIST, one GET per new record)."""

    def __init__(self) -> None:
        self.by_round: dict[int, float] = {}
        self._read: set[int] = set()  # evaluation records read (or found unusable): never read again

    def note_commits(self, records: Iterable[CommitRecord]) -> None:
        """The losses older runs kept in their commits' stats (an evaluation record wins over them)."""
        for r in records:
            v = finite(r.stats.get("val_loss"))
            if v is not None and r.round not in self._read:
                self.by_round[r.round] = v

    def refresh(self, store: RunReader) -> dict[int, float]:
        """Read the evaluation records not read yet; returns the losses they added."""
        new = [r for r in store.eval_rounds() if r not in self._read]
        got = store.read_evals(new)
        self._read.update(new)
        added = {r: rec.val_loss for r, rec in got.items()}
        self.by_round.update(added)
        return added

    def get(self, round_: int) -> float | None:
        return self.by_round.get(round_)

    def latest(self) -> tuple[int, float] | None:
        """(round, loss) of the newest round measured, or None."""
        if not self.by_round:
            return None
        r = max(self.by_round)
        return r, self.by_round[r]


def last_val_loss(store: RunReader, records: Iterable[CommitRecord] = ()) -> float | None:
    """The validation loss of the newest round measured: its evaluation record, or the stats of
    ``records`` (a run from before evaluation records); None if none was measured."""
    losses = ValLosses()
    losses.note_commits(records)
    losses.refresh(store)
    latest = losses.latest()
    return latest[1] if latest is not None else None
