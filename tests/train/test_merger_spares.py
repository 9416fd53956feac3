"""The synchronizer's merger recycles retired versions and momentum through one pool shared by
all fragments: a run holds its live state and about a fragment's worth of spares, not a spare
copy of every fragment, and recycled outputs give the same values as fresh ones."""

from __future__ import annotations

import torch

from atoll.core.outer import NesterovOuterOptimizer
from atoll.core.synchronize import FragmentContribution, MergePolicy
from atoll.core.weights import Counters
from atoll.train.merge_device import FragmentMerger

SHAPES = {"w": (64, 8), "b": (64,)}
"""Every fragment's tensors (a model's layers share their shapes)."""

P = 6


def drive(merger: FragmentMerger, rounds: int) -> tuple[dict[int, dict[str, torch.Tensor]], set[int]]:
    """``rounds`` rounds over the P fragments in turn, each retiring its fragment's last version
    and momentum as the synchronizer does; (the final fragments, every tensor the rounds wrote)."""
    g = torch.Generator().manual_seed(0)
    fragments = {p: {n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for p in range(P)}
    optimizers = {p: NesterovOuterOptimizer(lr=0.7, momentum=0.9) for p in range(P)}
    versions = dict.fromkeys(range(P), 0)
    written: set[int] = set()
    for r in range(1, rounds + 1):
        p = (r - 1) % P
        contributions = [FragmentContribution(key=f"{r}-{i}", learner_id=f"l{i}", base_version=versions[p],
                                              counters=Counters(c_steps=4, c_tokens=400),
                                              delta={n: 0.01 * torch.randn(s, generator=g) for n, s in SHAPES.items()})
                         for i in range(3)]
        opt = merger.optimizer_copy(p, optimizers[p])
        result = merger.merge(p, current=fragments[p], bases={versions[p]: fragments[p]},
                              contributions=contributions, optimizer=opt, reasons={})
        assert result is not None
        opt.buffers  # noqa: B018 - the new optimizer's momentum is its own before the old is retired
        merger.retire(p, fragments[p], optimizers[p], version=versions[p])
        fragments[p], optimizers[p], versions[p] = dict(result.new_params), opt, r
        written |= {t.data_ptr() for t in (*result.new_params.values(), *opt.buffers.values())}
    return fragments, written


def test_retired_tensors_serve_whichever_fragment_comes_next() -> None:
    merger = FragmentMerger(torch.device("cpu"), MergePolicy(), fragment_numel=[520] * P)
    fragments, written = drive(merger, 4 * P)
    # Live: P versions and P momentum sets. One spare set per fragment would double that; the
    # shared pool adds the first pass's retired versions' worth at most, and one set in flight.
    live = 2 * P * len(SHAPES)
    assert len(written) <= live + 2 * len(SHAPES), (len(written), live)
    # The same values as a merger that never recycles (every output fresh).
    fresh = FragmentMerger(torch.device("cpu"), MergePolicy(), fragment_numel=[520] * P)
    fresh.spares.give_back = lambda tensors: None  # type: ignore[method-assign]
    want, written_fresh = drive(fresh, 4 * P)
    assert len(written_fresh) > len(written)
    for p in range(P):
        for n in SHAPES:
            assert torch.equal(fragments[p][n], want[p][n]), (p, n)
