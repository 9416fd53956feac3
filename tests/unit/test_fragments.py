"""Fragments: balanced packing, exact cover, determinism, and the publication schedule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.core import FragmentPlan, embedding_parameter_names, fragment_offsets, pack_fragments, plan_fragments


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(64, 16)
        self.wpe = torch.nn.Embedding(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.ln = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, owned by the embedding


@given(
    sizes=st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=6), st.integers(1, 10_000), min_size=1, max_size=40),
    p=st.integers(1, 12),
)
@settings(max_examples=150, deadline=None)
def test_packing_is_an_exact_cover_within_the_greedy_bound(sizes: dict[str, int], p: int) -> None:
    if p > len(sizes):
        with pytest.raises(ValueError, match="num_fragments"):
            pack_fragments(sizes, p)
        return
    frags = pack_fragments(sizes, p)
    names = [n for f in frags for n in f]
    assert sorted(names) == sorted(sizes) and len(names) == len(set(names))
    loads = [sum(sizes[n] for n in f) for f in frags]
    # LPT greedy: every fragment ends within one largest tensor of the lightest.
    assert max(loads) - min(loads) <= max(sizes.values())
    assert max(loads) <= sum(sizes.values()) / p + max(sizes.values())
    assert all(f for f in frags)
    assert pack_fragments(dict(reversed(list(sizes.items()))), p) == frags  # order-independent


def test_largest_first_into_lightest() -> None:
    assert pack_fragments({"a": 10, "b": 7, "c": 5, "d": 4, "e": 1}, 2) == [["a", "d"], ["b", "c", "e"]]  # loads 14 and 13


@pytest.mark.parametrize(("p", "h"), [(1, 1), (1, 5), (4, 4), (3, 10), (24, 24), (5, 37)])
def test_schedule_publishes_each_fragment_once_per_h_steps(p: int, h: int) -> None:
    plan = plan_fragments({f"t{i}": (i + 1,) for i in range(p)}, num_fragments=p, inner_steps=h)
    for start in (1, 7, 3 * h + 2):
        window = [plan.fragment_at(t) for t in range(start, start + h)]
        assert sorted(f for f in window if f is not None) == list(range(p))
    assert plan.fragment_at(0) is None


def test_offsets_spread_evenly() -> None:
    assert fragment_offsets(4, 4) == (0, 1, 2, 3)
    assert fragment_offsets(4, 12) == (0, 3, 6, 9)
    assert fragment_offsets(3, 10) == (0, 3, 6)
    with pytest.raises(ValueError, match="inner_steps"):
        fragment_offsets(5, 4)


def test_plan_from_module_is_deterministic_and_finds_embeddings() -> None:
    torch.manual_seed(0)
    a = plan_fragments(TinyLM(), num_fragments=3, inner_steps=6)
    b = plan_fragments(TinyLM(), num_fragments=3, inner_steps=6)
    assert a == b
    assert a.embedding_names == {"wte.weight", "wpe.weight"} == embedding_parameter_names(TinyLM())
    names = {n for n, _ in TinyLM().named_parameters()}
    assert {n for f in a.fragments for n in f} == names
    assert FragmentPlan.from_dict(a.to_dict()) == a
    for n in names:
        assert n in a.fragments[a.fragment_of(n)]


def test_plan_rejects_bad_cover() -> None:
    with pytest.raises(ValueError, match="more than one fragment"):
        FragmentPlan(fragments=(("a",), ("a",)), sizes={"a": 1}, inner_steps=2)
    with pytest.raises(ValueError, match="cover exactly"):
        FragmentPlan(fragments=(("a",),), sizes={"a": 1, "b": 2}, inner_steps=2)


def test_fragment_groups_cover_every_fragment_once() -> None:
    from atoll.core.fragments import FragmentGroup

    for count in (1, 2, 3, 5):
        groups = [FragmentGroup(g, count) for g in range(count)]
        for p in range(24):
            owners = [g for g in groups if g.owns(p)]
            assert owners == [groups[0].owner_of(p)]
        held = [g.fragments_of(24) for g in groups]
        assert sorted(p for h in held for p in h) == list(range(24))  # disjoint and complete
        assert all(g.owns(p) for g, h in zip(groups, held, strict=True) for p in h)
    assert FragmentGroup.parse("1/2") == FragmentGroup(1, 2) and str(FragmentGroup(1, 2)) == "1/2"
    assert FragmentGroup().whole and not FragmentGroup(0, 2).whole
    for bad in ("2/2", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="INDEX/COUNT"):
            FragmentGroup.parse(bad)
