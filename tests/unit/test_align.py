"""Alignment: in-place overwrite keeps AdamW state; counters reset."""

from __future__ import annotations

import pytest
import torch

from atoll.core import LearnerCounters, align_fragment


def test_overwrite_in_place_keeps_adamw_moments() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    exp_avg = opt.state[model.weight]["exp_avg"].clone()
    weight_obj = model.weight
    counters = LearnerCounters.fresh(2)
    counters.record_step(100)
    counters.record_step(50)
    assert counters.fragments[0].c_steps == 2 and counters.fragments[1].c_tokens == 150

    new_w = torch.full((3, 4), 0.25)
    base = align_fragment(dict(model.named_parameters()), {"weight": new_w}, counters=counters, fragment=0, version=7)
    assert model.weight is weight_obj and torch.equal(model.weight.detach(), new_w)
    assert torch.equal(opt.state[model.weight]["exp_avg"], exp_avg)  # moments survive
    assert torch.equal(base["weight"], new_w) and base["weight"].data_ptr() != model.weight.data_ptr()
    assert (counters.fragments[0].base_version, counters.fragments[0].c_steps, counters.fragments[0].c_tokens) == (7, 0, 0)
    assert counters.fragments[1].c_steps == 2  # other fragment untouched
    # training continues from the new value with the old moments
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    assert LearnerCounters.from_dict(counters.to_dict()) == counters


def test_alignment_errors() -> None:
    params = {"w": torch.zeros(2)}
    with pytest.raises(KeyError, match="lacks"):
        align_fragment(params, {"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        align_fragment(params, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="fragment="):
        align_fragment(params, {"w": torch.ones(2)}, counters=LearnerCounters.fresh(1))
