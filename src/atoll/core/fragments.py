"""Fragments: which parameters travel together, and when each is published.

Balanced tensor packing (paper): sort tensors by size, largest first, and put each into the
currently lightest fragment (LPT greedy; the heaviest fragment is at most the mean plus the
largest tensor). Ties break by name and then fragment index so the plan is deterministic for a
given model.

Schedule: fragment p has offset ``t_p = floor(p * H / P)`` in [0, H); after finishing local step
``t`` (counted from 1) a learner publishes fragment p when ``t mod H == t_p``. Spreading the
offsets evenly over H keeps one round every ``H / P`` steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FragmentPlan",
    "pack_fragments",
    "fragment_offsets",
    "plan_fragments",
    "embedding_parameter_names",
    "FragmentGroup",
]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def pack_fragments(sizes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Greedy balanced packing of named tensors (name -> element count) into P fragments.

    Returns P lists of names; within a fragment names keep the packing order (largest first).
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if len(sizes) < num_fragments:
        raise ValueError(
            f"num_fragments={num_fragments} exceeds the model's {len(sizes)} parameter tensors; "
            "lower num_fragments so that no fragment is empty"
        )
    loads = [0] * num_fragments
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        lightest = min(range(num_fragments), key=lambda p: (loads[p], p))
        fragments[lightest].append(name)
        loads[lightest] += size
    return fragments


@dataclass(frozen=True)
class FragmentGroup:
    """Group ``index`` of ``count``: the fragments p with ``p mod count == index``, the share of
    the rounds one merger of a split synchronizer merges (round r merges fragment (r - 1) mod P).
    ``FragmentGroup(0, 1)`` is every fragment: one synchronizer for the whole run."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and isinstance(self.index, int) and 0 <= self.index < self.count):
            raise ValueError(f"a fragment group is INDEX/COUNT with 0 <= INDEX < COUNT, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> FragmentGroup:
        """``"1/2"``: group 1 of 2 (the second of two mergers)."""
        index, sep, count = str(text).partition("/")
        try:
            if not sep:
                raise ValueError(text)
            return cls(int(index), int(count))
        except ValueError:
            raise ValueError(f"a fragment group is INDEX/COUNT (e.g. 0/2), got {text!r}") from None

    @property
    def whole(self) -> bool:
        """Every fragment (the synchronizer is not split)."""
        return self.count == 1

    def owns(self, fragment: int) -> bool:
        return fragment % self.count == self.index

    def fragments_of(self, num_fragments: int) -> frozenset[int]:
        """This group's fragments out of ``num_fragments`` (every one when not split)."""
        return frozenset(p for p in range(num_fragments) if self.owns(p))

    def owner_of(self, fragment: int) -> FragmentGroup:
        """The group of the same split that owns ``fragment``."""
        return FragmentGroup(fragment % self.count, self.count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def fragment_offsets(num_fragments: int, inner_steps: int) -> tuple[int, ...]:
    """Offsets t_p = floor(p * H / P), evenly spread over [0, H); distinct because H >= P."""
    if inner_steps < num_fragments:
        raise ValueError(f"inner_steps (H={inner_steps}) must be >= num_fragments (P={num_fragments})")
    return tuple((p * inner_steps) // num_fragments for p in range(num_fragments))


@dataclass(frozen=True)
class FragmentPlan:
    """The frozen partition of a model into fragments plus their publication offsets."""

    fragments: tuple[tuple[str, ...], ...]
    """Parameter names in each fragment."""

    sizes: Mapping[str, int]
    """Element count of every parameter."""

    inner_steps: int
    """H: period of the publication schedule."""

    embedding_names: frozenset[str] = frozenset()
    """Parameters that are embeddings (merged by the plain weighted mean)."""

    # Derived in __post_init__ (not constructor arguments, not part of equality).
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _by_offset: dict[int, int] = field(init=False, repr=False, compare=False)
    _owner: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [n for frag in self.fragments for n in frag]
        if len(names) != len(set(names)):
            raise ValueError("a parameter appears in more than one fragment")
        if set(names) != set(self.sizes):
            raise ValueError("fragments must cover exactly the parameters in sizes")
        # Validates H >= P.
        object.__setattr__(self, "_offsets", fragment_offsets(len(self.fragments), self.inner_steps))
        object.__setattr__(self, "_by_offset", {t: p for p, t in enumerate(self._offsets)})
        object.__setattr__(self, "_owner", {n: p for p, frag in enumerate(self.fragments) for n in frag})

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def offsets(self) -> tuple[int, ...]:
        """t_p for every fragment."""
        return self._offsets

    def fragment_at(self, step: int) -> int | None:
        """Fragment to publish after finishing local step ``step`` (>= 1), or None."""
        if step < 1:
            return None
        return self._by_offset.get(step % self.inner_steps)

    def fragment_of(self, name: str) -> int:
        """Index of the fragment that owns parameter ``name``."""
        return self._owner[name]

    def fragment_numel(self, p: int) -> int:
        return sum(self.sizes[n] for n in self.fragments[p])

    def select(self, tensors: Mapping[str, torch.Tensor], p: int) -> dict[str, torch.Tensor]:
        """The subset of ``tensors`` that belongs to fragment p (KeyError if one is missing)."""
        return {n: tensors[n] for n in self.fragments[p]}

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (stored with the run)."""
        return {
            "fragments": [list(f) for f in self.fragments],
            "sizes": dict(self.sizes),
            "inner_steps": self.inner_steps,
            "embedding_names": sorted(self.embedding_names),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FragmentPlan:
        """Inverse of :meth:`to_dict`; a malformed plan raises KeyError, TypeError or ValueError
        (the storage layer turns those into a schema rejection)."""
        return cls(
            fragments=tuple(tuple(str(n) for n in f) for f in data["fragments"]),
            sizes={str(k): int(v) for k, v in dict(data["sizes"]).items()},
            inner_steps=int(data["inner_steps"]),
            embedding_names=frozenset(str(n) for n in data.get("embedding_names", ())),
        )


def embedding_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """Names (as in ``model.named_parameters()``) of parameters owned by ``nn.Embedding`` modules."""
    owned: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag):
            owned.update(id(p) for p in module.parameters(recurse=False))
    return frozenset(n for n, p in model.named_parameters() if id(p) in owned)


def plan_fragments(
    named_shapes: Mapping[str, Sequence[int]] | torch.nn.Module,
    *,
    num_fragments: int,
    inner_steps: int,
    embedding_names: Iterable[str] = (),
) -> FragmentPlan:
    """Build a :class:`FragmentPlan` from a module or a ``name -> shape`` mapping."""
    if isinstance(named_shapes, torch.nn.Module):
        module = named_shapes
        embedding_names = set(embedding_names) | embedding_parameter_names(module)
        named_shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    sizes = {n: _numel(s) for n, s in named_shapes.items()}
    fragments = pack_fragments(sizes, num_fragments)
    return FragmentPlan(
        fragments=tuple(tuple(f) for f in fragments),
        sizes=sizes,
        inner_steps=inner_steps,
        embedding_names=frozenset(embedding_names),
    )
