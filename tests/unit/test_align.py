"""Alignment: in-place overwrite keeps AdamW state; counters reset."""

from __future__ import annotations

import pytest
import torch

from atoll.core import LearnerCounters, align_fragment
from atoll.core.align import PublishMarks, carry


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


def _fragment(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_keep_local_progress_carries_the_steps_since_the_last_publish_onto_the_new_version() -> None:
    base, new_version = _fragment(0), _fragment(1)
    params = {n: v.clone() for n, v in base.items()}
    counters = LearnerCounters.fresh(1)
    marks = PublishMarks(1)
    for step in range(3):  # three steps, then a publish, then two more steps
        counters.record_step(10)
        for v in params.values():
            v.add_(0.1 * (step + 1))
    at_publish = {n: v.clone() for n, v in params.items()}
    marks.mark(0, params, counters.fragments[0])
    for v in params.values():
        v.add_(0.5)
    counters.record_step(7)
    counters.record_step(7)
    now = {n: v.clone() for n, v in params.items()}

    kept = marks.unpublished(0, params, base, counters.fragments[0])
    assert kept is not None and (kept.c_steps, kept.c_tokens) == (2, 14)
    align_fragment(params, new_version, counters=counters, fragment=0, version=9)
    marks.clear(0)
    carry(params, counters.fragments[0], kept)
    for n in params:  # the new version plus exactly what no contribution carries yet
        assert torch.equal(params[n], new_version[n] + (now[n] - at_publish[n]))
    fc = counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens) == (9, 2, 14)

    # No publish since that alignment: the unpublished progress runs from the new base.
    counters.record_step(3)
    for v in params.values():
        v.add_(1.0)
    again = marks.unpublished(0, params, new_version, counters.fragments[0])
    assert again is not None and (again.c_steps, again.c_tokens) == (3, 17)
    for n in params:
        assert torch.allclose(again.progress[n], params[n] - new_version[n])


def test_nothing_is_carried_without_a_step_since_the_publish() -> None:
    params, counters, marks = _fragment(2), LearnerCounters.fresh(1), PublishMarks(1)
    counters.record_step(5)
    marks.mark(0, params, counters.fragments[0])
    assert marks.unpublished(0, params, _fragment(3), counters.fragments[0]) is None


def test_keep_local_progress_by_hand() -> None:
    """Two weights, numbers chosen to be exact in fp32. Base (1, 2); three steps of (+0.25, -0.5)
    at 10 tokens each reach (1.75, 0.5), where the learner publishes; two steps of (+0.5, +0.25)
    at 7 tokens each reach (2.75, 1). Adopting version 5 = (4, -1) gives (4, -1) + (2.75 - 1.75,
    1 - 0.5) = (5, -0.5), with counters (base 5, 2 steps, 14 tokens, 2 of them kept)."""
    params, counters, marks = {"w": torch.tensor([1.0, 2.0])}, LearnerCounters.fresh(1, base_version=3), PublishMarks(1)
    base = {"w": params["w"].clone()}
    for _ in range(3):
        counters.record_step(10)
        params["w"] += torch.tensor([0.25, -0.5])
    marks.mark(0, params, counters.fragments[0])  # the publish: (1.75, 0.5), 3 steps, 30 tokens
    for _ in range(2):
        counters.record_step(7)
        params["w"] += torch.tensor([0.5, 0.25])
    assert params["w"].tolist() == [2.75, 1.0]

    kept = marks.unpublished(0, params, base, counters.fragments[0])
    assert kept is not None and kept.progress["w"].tolist() == [1.0, 0.5] and (kept.c_steps, kept.c_tokens) == (2, 14)
    align_fragment(params, {"w": torch.tensor([4.0, -1.0])}, counters=counters, fragment=0, version=5)
    marks.clear(0)
    carry(params, counters.fragments[0], kept)
    assert params["w"].tolist() == [5.0, -0.5]
    fc = counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens, fc.kept_steps) == (5, 2, 14, 2)
    assert fc.frozen().c_steps == 2  # the next contribution carries the kept steps

    # One more step, then the next adoption with no publish between: everything since the
    # last adoption (kept steps included) is unpublished, and all of it is kept again.
    counters.record_step(9)
    params["w"] += torch.tensor([0.25, 0.25])
    again = marks.unpublished(0, params, {"w": torch.tensor([4.0, -1.0])}, counters.fragments[0])
    assert again is not None and again.progress["w"].tolist() == [1.25, 0.75] and (again.c_steps, again.c_tokens) == (3, 23)
    align_fragment(params, {"w": torch.tensor([0.0, 0.0])}, counters=counters, fragment=0, version=7)
    carry(params, counters.fragments[0], again)
    assert params["w"].tolist() == [1.25, 0.75] and counters.fragments[0].kept_steps == 3
    # Without keep_local_progress an alignment resets everything, kept steps included.
    align_fragment(params, {"w": torch.tensor([0.0, 0.0])}, counters=counters, fragment=0, version=9)
    assert counters.fragments[0] == type(counters.fragments[0])(base_version=9)


def test_keeping_half_of_the_local_progress_by_hand() -> None:
    """kept_progress_share 0.5: base (1, 2), three steps of 10 tokens to (2, 1), no publish;
    adopting (4, -1) gives (4, -1) + 0.5 x (1, -1) = (4.5, -1.5), and the counters carry 1 of
    the 3 steps (rounded down) with its 10 tokens."""
    params, counters, marks = {"w": torch.tensor([1.0, 2.0])}, LearnerCounters.fresh(1, base_version=3), PublishMarks(1)
    base = {"w": params["w"].clone()}
    for _ in range(3):
        counters.record_step(10)
        params["w"] += torch.tensor([1.0, -1.0]) / 3
    kept = marks.unpublished(0, params, base, counters.fragments[0])
    assert kept is not None and (kept.c_steps, kept.c_tokens) == (3, 30)
    align_fragment(params, {"w": torch.tensor([4.0, -1.0])}, counters=counters, fragment=0, version=5)
    carry(params, counters.fragments[0], kept, share=0.5)
    assert torch.allclose(params["w"], torch.tensor([4.5, -1.5]))
    fc = counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens, fc.kept_steps) == (5, 1, 10, 1)
