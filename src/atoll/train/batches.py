"""Batches with a resumable cursor: learner ``i`` of ``M``, its own shard, in a seeded order.

:class:`BatchStream` gives learner ``i`` of ``M`` its own disjoint shard of the train tokens and
hands out ``(x, y)`` batches in a seeded order. Its whole position is a small JSON-able cursor
(:meth:`BatchStream.state_dict`), saved with the learner's state, so a learner that rejoins
continues with exactly the next window: nothing repeated, nothing skipped.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from atoll.train.tokens import DataError, TokenData

__all__ = ["CURSOR_FORMAT", "BatchStream"]

CURSOR_FORMAT = "atoll.data.cursor/1"
"""Version tag stored in every cursor; a cursor with another tag is refused."""


def _mix(*parts: int) -> int:
    """A 64-bit hash of integers, stable across machines, Python and numpy versions."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


class BatchStream:
    """Learner ``learner_index`` of ``num_learners``: its shard of ``data``, in batches, resumable.

    The tokens are cut into non-overlapping windows of ``context_tokens + 1`` tokens sharing
    their edge token (x is the first T tokens, y the last T). Learner ``i``'s shard is every
    ``num_learners``-th window starting at window ``i`` (``interleave=True``, the default), so each
    learner's shard is a uniform sample of the whole corpus even when the corpus is ordered
    (files in path order, topics in blocks): DiLoCo's learners then see the same distribution
    as one data-parallel batch. ``interleave=False`` gives each learner a contiguous
    ``1/num_learners`` of the tokens instead (the layout of atoll <= 0.1, kept for comparison).
    An epoch visits every window of the shard once, in an order that is a seeded permutation of
    the shard's window indices, different each epoch.

    The permutation is affine, ``w = (a_e * k + b_e) mod num_windows`` with ``a_e`` coprime to
    ``num_windows`` and ``(a_e, b_e)`` hashed from (seed, learner, epoch): O(1) memory for any
    shard size and bit-identical on every machine and library version, which is what makes a
    saved cursor portable. Consecutive draws land far apart in the shard, so batches mix.

    The cursor (:meth:`state_dict`) is a small JSON-able dict; ``position`` counts windows (not
    batches), so a learner may change its batch size between saves and still neither repeat nor
    skip a window. Batches that cross the end of an epoch continue into the next epoch's order.
    """

    def __init__(
        self,
        data: TokenData,
        *,
        context_tokens: int,
        learner_index: int = 0,
        num_learners: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        interleave: bool = True,
    ) -> None:
        if not (isinstance(context_tokens, int) and context_tokens >= 1):
            raise DataError(f"context_tokens={context_tokens!r} must be an integer >= 1")
        self.interleave = bool(interleave)
        # Interleaved: the shard is all of the data and the learner owns windows i, i + M, ...
        self.shard = data if self.interleave else data.shard(learner_index, num_learners)
        if self.interleave:
            data.shard(learner_index, num_learners)  # same argument checks as the contiguous layout
        self.context_tokens = context_tokens
        self.learner_index = learner_index
        self.num_learners = num_learners
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        # Windows of T+1 tokens with stride T: window w is tokens [w*T, w*T + T + 1).
        total_windows = max(0, (len(self.shard) - 1) // context_tokens)
        self._stride, self._phase = (num_learners, learner_index) if self.interleave else (1, 0)
        # This learner's windows: global windows phase, phase + stride, ... below total_windows.
        self.num_windows = max(0, (total_windows - self._phase + self._stride - 1) // self._stride)
        if self.num_windows < 1:
            raise DataError(
                f"learner {learner_index}'s shard has {len(self.shard)} tokens, fewer than "
                f"context_tokens + 1 = {context_tokens + 1}: lower context_tokens or num_learners, "
                "or supply more data"
            )
        self.epoch = 0
        self.position = 0
        self._perm_cache: tuple[int, int, int] | None = None

    # -- the order ---------------------------------------------------------------------------

    def _affine(self, epoch: int) -> tuple[int, int]:
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1], self._perm_cache[2]
        n = self.num_windows
        if not self.shuffle or n == 1:
            a, b = 1, 0
        else:
            a = 1 + _mix(self.seed, self.learner_index, epoch, 1) % (n - 1)
            while math.gcd(a, n) != 1:  # coprime => k -> a*k + b is a bijection mod n
                a = a % (n - 1) + 1
            b = _mix(self.seed, self.learner_index, epoch, 2) % n
        self._perm_cache = (epoch, a, b)
        return a, b

    def window_indices(self, cursor: dict[str, Any], count: int) -> list[tuple[int, int]]:
        """The next ``count`` ``(epoch, window)`` pairs from ``cursor``, without moving it."""
        self._check_cursor(cursor)
        epoch, pos, out = int(cursor["epoch"]), int(cursor["position"]), []
        for _ in range(count):
            a, b = self._affine(epoch)
            out.append((epoch, (a * pos + b) % self.num_windows))
            pos += 1
            if pos == self.num_windows:
                epoch, pos = epoch + 1, 0
        return out

    # -- batches -----------------------------------------------------------------------------

    def batch_at(
        self, cursor: dict[str, Any], batch_size: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
        """Pure form: ``((x, y), next_cursor)`` for the batch starting at ``cursor``."""
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise DataError(f"batch_size={batch_size!r} must be an integer >= 1")
        if batch_size > self.num_windows:
            raise DataError(
                f"batch_size={batch_size} exceeds the {self.num_windows} windows in learner "
                f"{self.learner_index}'s shard (context_tokens={self.context_tokens}, "
                f"num_learners={self.num_learners}): a batch would repeat windows; lower batch_size, "
                "context_tokens or num_learners, or supply more data"
            )
        picks = self.window_indices(cursor, batch_size)
        T = self.context_tokens
        starts = [(w * self._stride + self._phase) * T for _, w in picks]
        windows = torch.from_numpy(self.shard.read_windows(starts, T + 1))
        # y is x shifted by one: position t of x is trained to predict token t + 1.
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        total = int(cursor["epoch"]) * self.num_windows + int(cursor["position"]) + batch_size
        nxt = dict(cursor, epoch=total // self.num_windows, position=total % self.num_windows)
        return (x, y), nxt

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``, int64 tensors of shape ``[batch_size, context_tokens]``."""
        (x, y), nxt = self.batch_at(self.state_dict(), batch_size)
        self.epoch, self.position = nxt["epoch"], nxt["position"]
        return x, y

    @property
    def tokens_served(self) -> int:
        """Input tokens handed out so far (windows served x context_tokens)."""
        return (self.epoch * self.num_windows + self.position) * self.context_tokens

    # -- the cursor ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: everything needed to continue exactly here. JSON-able."""
        return {
            "format": CURSOR_FORMAT,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "interleave": self.interleave,
            "learner_index": self.learner_index,
            "num_learners": self.num_learners,
            "context_tokens": self.context_tokens,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, cursor: dict[str, Any]) -> None:
        """Continue from a saved cursor; refuse one that belongs to a different stream."""
        self._check_cursor(cursor)
        self.epoch, self.position = int(cursor["epoch"]), int(cursor["position"])

    def _check_cursor(self, cursor: dict[str, Any]) -> None:
        if not isinstance(cursor, dict) or cursor.get("format") != CURSOR_FORMAT:
            raise DataError(f"not a data cursor of format {CURSOR_FORMAT!r}: {cursor!r}")
        mine = self.state_dict()
        cursor = {"interleave": False, **cursor}  # cursors saved before interleaving existed
        for knob in ("seed", "shuffle", "interleave", "learner_index", "num_learners", "context_tokens",
                     "num_windows"):
            if cursor.get(knob) != mine[knob]:
                raise DataError(
                    f"data cursor was saved with {knob}={cursor.get(knob)!r} but this stream has "
                    f"{knob}={mine[knob]!r}; resuming would repeat or skip data. Use the same "
                    "data, seed, num_learners and context_tokens, or start a fresh cursor"
                )
        pos = cursor.get("position")
        if not (isinstance(pos, int) and 0 <= pos < self.num_windows and isinstance(cursor.get("epoch"), int)):
            raise DataError(f"data cursor position/epoch out of range: {cursor!r}")
