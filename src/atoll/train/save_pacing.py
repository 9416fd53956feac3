"""When a learner saves its inner state for rejoin: every N steps, or when a budget allows.

A save holds the whole AdamW state (two moments per parameter: 8 bytes each in fp32, 4 in bf16),
about 50 to 100 times what one contribution of an int4 fragment carries, and it travels on the
same uplink. A fixed step count sized for a toy on a CPU would, at GPU step times, send a
gigabyte every few seconds; so by default saves are paced by a budget
(:class:`~atoll.train.recipe.Recipe`'s save fields):

* ``save_every_steps`` set: exactly every that many steps (0: only on exit); the budget is ignored;
* otherwise a save is due once both budgets allow it: the bytes of this process' saves, the next
  one included, stay within ``save_uplink_share`` of the bytes it sent up otherwise (contributions,
  records, heartbeats; counted by its object store, :mod:`atoll.storage.wire`), and at least
  ``save_every_s`` seconds have passed since the previous save (or the start).

Saves are written in the background (:class:`~atoll.train.publisher.SaveWriter`) and never queue:
a save that falls due while the previous one is still being written is skipped, not queued (it
is counted in :attr:`SavePacer.skipped`). Under the budget that skip is a coalescing: the budget
still allows the save, so it is taken at the first step after the write in flight is done, with
that step's state. Under ``save_every_steps`` the next multiple takes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["SavePacer"]


class SavePacer:
    """Decides, after each step, whether the learner saves now (see the module docstring).

    ``uplink_bytes()``: the bytes this process has sent up so far, its saves included (its object
    store's count); ``save_bytes``: what one save is expected to send before the first one has
    (then the last one's size is used)."""

    def __init__(self, *, every_steps: int | None, uplink_share: float | None, every_s: float,
                 uplink_bytes: Callable[[], int], save_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps, self.uplink_share, self.every_s = every_steps, uplink_share, every_s
        self.uplink_bytes, self.clock = uplink_bytes, clock
        self.next_save_bytes = max(0, int(save_bytes))
        self.saves = 0
        """Periodic saves handed to the writer."""
        self.saved_bytes = 0
        """Bytes of those saves (their tensors)."""
        self.skipped = 0
        """Times a save fell due while the previous one was still being written (once per write in flight)."""
        self._last_at = clock()
        self._waiting = False

    @classmethod
    def for_recipe(cls, recipe: Any, *, uplink_bytes: Callable[[], int], save_bytes: int,
                   clock: Callable[[], float] = time.monotonic) -> SavePacer:
        """The pacing a run's :class:`~atoll.train.recipe.Recipe` asks for."""
        return cls(every_steps=recipe.save_every_steps, uplink_share=recipe.save_uplink_share,
                   every_s=recipe.save_every_s, uplink_bytes=uplink_bytes, save_bytes=save_bytes, clock=clock)

    def due(self, step: int, *, in_flight: bool) -> bool:
        """Whether to save after local step ``step``; ``in_flight``: a save is still being written
        (then nothing is due: the save is skipped, or under the budget taken once it is done)."""
        want = self._steps_due(step) if self.every_steps is not None else self._budget_allows()
        if want and in_flight:
            if not self._waiting:
                self.skipped += 1
                self._waiting = True
            return False
        return want

    def _steps_due(self, step: int) -> bool:
        assert self.every_steps is not None
        return self.every_steps > 0 and step % self.every_steps == 0

    def _budget_allows(self) -> bool:
        if self.every_s and self.clock() - self._last_at < self.every_s:
            return False
        if self.uplink_share is None:
            return True
        other = max(0, self.uplink_bytes() - self.saved_bytes)
        return self.saved_bytes + self.next_save_bytes <= self.uplink_share * other

    def started(self, nbytes: int) -> None:
        """A periodic save of ``nbytes`` was handed to the writer (0: it was not: one is in flight)."""
        if nbytes <= 0:
            return
        self.saves += 1
        self.saved_bytes += nbytes
        self.next_save_bytes = nbytes
        self._last_at = self.clock()
        self._waiting = False

    def describe(self) -> str:
        """The pacing in words, for the learner's log."""
        if self.every_steps is not None:
            return f"saves every {self.every_steps} steps" if self.every_steps else "saves only on exit"
        parts = [f"within {100 * self.uplink_share:g}% of its uplink bytes"] if self.uplink_share is not None else []
        if self.every_s:
            parts.append(f"at least {self.every_s:g} s apart")
        return "saves " + " and ".join(parts) + f" (one save ~{self.next_save_bytes / 2**20:,.1f} MiB)"
