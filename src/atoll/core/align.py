"""Alignment: a learner adopts a new global version of one fragment.

The learner overwrites its local copy of the fragment in place (so an optimizer that holds the
same ``nn.Parameter`` objects keeps its AdamW moments), remembers the new value as its base for
the next delta, and resets that fragment's counters. Global versions are absolute values, not
increments, so a learner that was away and missed several versions "applies every version it
missed" by adopting the latest one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from atoll.core.weights import Counters

__all__ = ["FragmentCounters", "LearnerCounters", "align_fragment"]


@dataclass
class FragmentCounters:
    """Where a learner stands on one fragment since its last alignment."""

    base_version: int = 0
    """Global version of the fragment the learner last aligned to."""

    c_steps: int = 0
    """Inner steps since that alignment."""

    c_tokens: int = 0
    """Tokens since that alignment."""

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
