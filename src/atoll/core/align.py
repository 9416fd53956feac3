"""Alignment: a learner adopts a new global version of one fragment.

The learner overwrites its local copy of the fragment in place (so an optimizer that holds the
same ``nn.Parameter`` objects keeps its AdamW moments), remembers the new value as its base for
the next delta, and resets that fragment's counters. Global versions are absolute values, not
increments, so a learner that was away and missed several versions "applies every version it
missed" by adopting the latest one.

With ``DilocoConfig.keep_local_progress`` the learner keeps what no contribution carries yet: its
progress on the fragment since it last published it (or, with no publish since it last aligned,
since its base). The fragment becomes the new version plus that progress, and the counters carry
its steps and tokens, so the next contribution (against the new version) delivers that work
instead of dropping it (:class:`PublishMarks`, :func:`carry`). With ``kept_progress_into='delta'``
the learner leaves the fragment at the new version and holds that progress instead, taking it off
its next contribution's delta (``atoll.train.learner``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from atoll.core.weights import Counters

__all__ = ["FragmentCounters", "LearnerCounters", "PublishMarks", "Unpublished", "align_fragment", "carry",
           "carry_counters"]


@dataclass
class FragmentCounters:
    """Where a learner stands on one fragment since its last alignment."""

    base_version: int = 0
    """Global version of the fragment the learner last aligned to."""

    c_steps: int = 0
    """Inner steps since that alignment."""

    c_tokens: int = 0
    """Tokens since that alignment."""

    kept_steps: int = 0
    """Of ``c_steps``, those run before that alignment and carried through it
    (``keep_local_progress``, :func:`carry`): work the next contribution delivers that adoption
    would otherwise have overwritten. Contributions report it (``info["kept_steps"]``) so the
    merged-work share can say how much of what it counts was kept this way."""

    def frozen(self) -> Counters:
        return Counters(c_steps=self.c_steps, c_tokens=self.c_tokens)


@dataclass
class LearnerCounters:
    """Per-fragment counters of one learner."""

    fragments: list[FragmentCounters] = field(default_factory=list)

    @classmethod
    def fresh(cls, num_fragments: int, base_version: int = 0) -> LearnerCounters:
        return cls([FragmentCounters(base_version=base_version) for _ in range(num_fragments)])

    def record_step(self, tokens: int) -> None:
        """One inner step touched every fragment: count it everywhere."""
        for c in self.fragments:
            c.c_steps += 1
            c.c_tokens += tokens

    def reset(self, p: int, base_version: int) -> None:
        self.fragments[p] = FragmentCounters(base_version=base_version)

    def to_dict(self) -> list[dict[str, int]]:
        return [vars(c).copy() for c in self.fragments]

    @classmethod
    def from_dict(cls, data: list[Mapping[str, int]]) -> LearnerCounters:
        return cls([FragmentCounters(**{k: int(v) for k, v in d.items()}) for d in data])


@torch.no_grad()
def align_fragment(
    params: Mapping[str, torch.Tensor],
    global_fragment: Mapping[str, torch.Tensor],
    *,
    counters: LearnerCounters | None = None,
    fragment: int | None = None,
    version: int | None = None,
) -> dict[str, torch.Tensor]:
    """Copy ``global_fragment`` into the matching ``params`` in place; returns the new base copy.

    If ``counters`` is given, fragment ``fragment``'s counters are reset to ``version``.
    """
    for name, value in global_fragment.items():
        if name not in params:
            raise KeyError(f"global fragment carries {name!r}, which the learner's model lacks")
        target = params[name]
        if target.shape != value.shape:
            raise ValueError(f"global {name!r} has shape {tuple(value.shape)}, local {tuple(target.shape)}")
        target.copy_(value.to(dtype=target.dtype, device=target.device))
    if counters is not None:
        if fragment is None or version is None:
            raise ValueError("resetting counters needs fragment= and version=")
        counters.reset(fragment, version)
    return {n: v.detach().float().clone() for n, v in global_fragment.items()}


@dataclass(frozen=True)
class Unpublished:
    """A learner's progress on one fragment that no contribution of it carries yet."""

    progress: dict[str, torch.Tensor]
    """Fragment values now minus at the mark, fp32, by parameter name."""

    c_steps: int
    """Inner steps since the mark."""

    c_tokens: int
    """Tokens since the mark."""


class PublishMarks:
    """Where each fragment's unpublished progress starts: its values and counters when the
    learner last published it, or its base and zero counters when it has not published it since
    it last aligned (:meth:`clear`). One copy of the fragment per mark: a model's worth at most."""

    def __init__(self, num_fragments: int) -> None:
        self._marks: list[tuple[dict[str, torch.Tensor], int, int] | None] = [None] * num_fragments

    @torch.no_grad()
    def mark(self, fragment: int, values: Mapping[str, torch.Tensor], counters: FragmentCounters) -> None:
        """The learner publishes ``fragment`` now, at ``values`` and ``counters``."""
        self._marks[fragment] = ({n: v.detach().float().clone() for n, v in values.items()},
                                 counters.c_steps, counters.c_tokens)

    def clear(self, fragment: int) -> None:
        """The learner aligned ``fragment``: its unpublished progress starts at the new base."""
        self._marks[fragment] = None

    @torch.no_grad()
    def unpublished(self, fragment: int, params: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                    counters: FragmentCounters) -> Unpublished | None:
        """The progress since the mark (None when no step was taken since it)."""
        mark = self._marks[fragment]
        ref, steps, tokens = mark if mark is not None else (base, 0, 0)
        if counters.c_steps <= steps:
            return None
        return Unpublished({n: params[n].detach().float() - ref[n] for n in ref},
                           counters.c_steps - steps, counters.c_tokens - tokens)


@torch.no_grad()
def carry(params: Mapping[str, torch.Tensor], counters: FragmentCounters, unpublished: Unpublished, *,
          share: float = 1.0) -> None:
    """Right after an alignment: add the progress to the new values and carry its counters (the
    next delta, against the new version, holds that work, and its counters say so).

    ``share`` < 1 (``DilocoConfig.kept_progress_share``) adds that share of the progress and
    carries that share of its steps (rounded down) and of its tokens (tokens per step kept)."""
    for name, d in unpublished.progress.items():
        d = d.to(dtype=params[name].dtype, device=params[name].device)
        if share == 1.0:
            params[name].add_(d)
        else:
            params[name].add_(d, alpha=share)
    carry_counters(counters, unpublished, share=share)


def carry_counters(counters: FragmentCounters, unpublished: Unpublished, *, share: float = 1.0) -> None:
    """Right after an alignment: the counters carry ``share`` of the progress's steps (rounded
    down) and of its tokens (tokens per step kept), all of them counted as kept. :func:`carry`
    does this; a learner that keeps the progress in its next delta rather than its values
    (``kept_progress_into='delta'``) does only this."""
    steps = unpublished.c_steps if share == 1.0 else int(unpublished.c_steps * share)
    counters.c_steps, counters.c_tokens = steps, unpublished.c_tokens * steps // unpublished.c_steps
    counters.kept_steps = steps
