"""The synchronizer's own numbers (docs/threat-model.md): step samples bounded by observation,
weights bounded by observed time and by a share cap, the outlier guard with K = 1, and commit
records whose rejection lists are capped. Pure (core, and the merger's norm reference), with
hand-computed expectations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from atoll.core import Counters, FragmentContribution, MergePolicy, NesterovOuterOptimizer, synchronize_fragment
from atoll.core.config import ConfigError, DilocoConfig
from atoll.core.fragments import fragment_offsets
from atoll.core.quorum import bounded_step_sample, publication_steps
from atoll.core.rejection import (
    MAX_DETAIL_CHARS,
    MAX_RECORDED_PER_LEARNER,
    MAX_RECORDED_REJECTIONS,
    Rejection,
    RejectionKind,
    summarize_rejections,
)
from atoll.core.weights import cap_weight_share, clip_counters, contribution_weights, plausible_steps
from atoll.train.merge_device import FragmentMerger


# -- step time: a report counts only inside what was observed ------------------------------------
def test_a_first_report_gives_no_sample_whatever_it_says() -> None:
    assert bounded_step_sample(1e300, None) is None
    assert bounded_step_sample(86_400.0, None) is None
    assert bounded_step_sample(None, 0.5) is None  # no report: the observation alone overstates


def test_a_report_counts_only_up_to_the_observed_cadence() -> None:
    assert bounded_step_sample(86_400.0, 0.25) == 0.25
    assert bounded_step_sample(0.1, 0.25) == 0.1
    assert bounded_step_sample(0.1, math.inf) is None


def test_steps_between_two_publishes_follow_the_schedule() -> None:
    offsets = fragment_offsets(4, 8)  # t_p = 0, 2, 4, 6
    assert publication_steps(offsets, 0, 1, 8) == 2
    assert publication_steps(offsets, 3, 0, 8) == 2  # wraps around H
    assert publication_steps(offsets, 1, 1, 8) == 8  # the same slot again: a whole H
    assert publication_steps((0,), 0, 0, 24) == 24  # P = 1


# -- weights: no more than observed time could produce ------------------------------------------
def test_plausible_steps_by_hand() -> None:
    # H + speedup * elapsed / min_step = 24 + 4 * 10 / 0.5
    assert plausible_steps(10.0, min_step_s=0.5, inner_steps=24, speedup=4.0) == 104
    assert plausible_steps(-3.0, min_step_s=0.5, inner_steps=24, speedup=4.0) == 24
    assert plausible_steps(10.0, min_step_s=None, inner_steps=24, speedup=4.0) is None
    assert plausible_steps(10.0, min_step_s=0.0, inner_steps=24, speedup=4.0) is None
    assert plausible_steps(10.0, min_step_s=0.5, inner_steps=24, speedup=None) is None


def test_clipped_counters_keep_tokens_per_step_and_weight_is_what_the_bound_earns() -> None:
    c = Counters(c_steps=10_024, c_tokens=10_024 * 512)
    assert clip_counters(c, 104) == Counters(c_steps=104, c_tokens=104 * 512)
    assert clip_counters(c, None) is c and clip_counters(c, 20_000) is c
    honest = Counters(c_steps=24, c_tokens=24 * 512)
    w = contribution_weights({"forger": clip_counters(c, 104), "honest": honest}).weights
    assert w["forger"] == pytest.approx(104 / (104 + 24))  # linear in the steps the bound allows


def test_weight_share_cap_by_hand() -> None:
    w = {"a": 0.99, "b": 0.005, "c": 0.005}
    got = cap_weight_share(w, 0.9)
    # a capped at 0.9; b and c share the remaining 0.1 in proportion (equal)
    assert got == pytest.approx({"a": 0.9, "b": 0.05, "c": 0.05})
    assert math.fsum(got.values()) == pytest.approx(1.0)
    two = cap_weight_share({"a": 0.99, "b": 0.01}, 0.25)  # the cap is at least 1/n
    assert two == pytest.approx({"a": 0.5, "b": 0.5})
    cascade = cap_weight_share({"a": 0.6, "b": 0.3, "c": 0.06, "d": 0.04}, 0.35)
    assert cascade == pytest.approx({"a": 0.35, "b": 0.35, "c": 0.18, "d": 0.12})


def test_weight_share_cap_leaves_honest_weights_bit_for_bit() -> None:
    w = {"a": 0.7, "b": 0.2, "c": 0.1}
    out = cap_weight_share(w, 0.9)
    assert out == w and all(out[k] is w[k] for k in w)
    assert cap_weight_share({"only": 1.0}, 0.5) == {"only": 1.0}
    assert cap_weight_share(w, None) == w


def test_config_knobs_validate() -> None:
    cfg = DilocoConfig()
    assert cfg.max_weight_share is None and cfg.max_learner_speedup == 4.0
    assert DilocoConfig.from_dict({k: v for k, v in cfg.to_dict().items()
                                   if k not in ("max_weight_share", "max_learner_speedup")}) == cfg
    for bad in ({"max_weight_share": 0.0}, {"max_weight_share": 1.5}, {"max_learner_speedup": 0.5},
                {"max_learner_speedup": math.inf}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            DilocoConfig(**bad)


# -- the outlier guard with K = 1 -----------------------------------------------------------------
def _one(key: str, delta: torch.Tensor, steps: int = 4) -> FragmentContribution:
    return FragmentContribution(key=key, learner_id=key, base_version=0,
                                counters=Counters(c_steps=steps, c_tokens=steps * 8), delta={"w": delta})


def test_a_lone_contribution_far_above_the_fragments_history_is_an_outlier() -> None:
    cur = {"w": torch.zeros(4)}
    forged = _one("forger", torch.full((4,), -500.0))  # sets the fragment to +350 with eta = 0.7
    res = synchronize_fragment(current=cur, bases={0: cur}, contributions=[forged],
                               optimizer=NesterovOuterOptimizer(), policy=MergePolicy(outlier_norm_ratio=100.0),
                               norm_history=(0.02, 0.03, 0.025))
    assert res is None  # nothing left to merge: the fragment keeps its value
    reasons: dict[str, Rejection] = {}
    synchronize_fragment(current=cur, bases={0: cur}, contributions=[forged], optimizer=NesterovOuterOptimizer(),
                         policy=MergePolicy(outlier_norm_ratio=100.0), norm_history=(0.02, 0.03, 0.025),
                         reasons=reasons)
    assert reasons["forger"].kind is RejectionKind.OUTLIER
    again = synchronize_fragment(current=cur, bases={0: cur}, contributions=[forged],
                                 optimizer=NesterovOuterOptimizer(),
                                 policy=MergePolicy(outlier_norm_ratio=100.0, max_weight_share=0.9),
                                 norm_history=(0.02, 0.03, 0.025))
    assert again is None
    opt = NesterovOuterOptimizer()
    honest = synchronize_fragment(current=cur, bases={0: cur}, contributions=[_one("h", torch.full((4,), 0.01))],
                                  optimizer=opt, policy=MergePolicy(outlier_norm_ratio=100.0),
                                  norm_history=(0.02, 0.03, 0.025))
    assert honest is not None and set(honest.weights) == {"h"}


def test_the_history_guard_names_its_reference_and_needs_enough_history() -> None:
    cur = {"w": torch.zeros(4)}
    big = _one("forger", torch.full((4,), -500.0))
    small = _one("honest", torch.full((4,), 0.01))
    res = synchronize_fragment(current=cur, bases={0: cur}, contributions=[big, small],
                               optimizer=NesterovOuterOptimizer(), policy=MergePolicy(outlier_norm_ratio=100.0),
                               norm_history=(0.02, 0.02, 0.02))
    assert res is not None and set(res.weights) == {"honest"}
    why = res.rejected["forger"]
    assert why.kind is RejectionKind.OUTLIER and "recent median update norm" in why.detail
    short = synchronize_fragment(current=cur, bases={0: cur}, contributions=[big], optimizer=NesterovOuterOptimizer(),
                                 policy=MergePolicy(outlier_norm_ratio=100.0), norm_history=(0.02, 0.02))
    assert short is not None  # two past norms are not a history yet


def test_a_fragment_without_history_is_compared_with_the_runs_norms_scaled_to_its_size() -> None:
    """Fragment 1 (400 parameters) has merged once; fragments 0 (100) and 2 (1,600) have merged
    twice. Fragment 1's reference is the run's last norms, each times sqrt(400 / its fragment's
    size); a fragment with its own 3 norms keeps them; nothing before the run's third merge."""
    merger = FragmentMerger(torch.device("cpu"), MergePolicy(outlier_norm_ratio=100.0),
                            fragment_numel=[100, 400, 1600])
    merger.remember_norm(0, 1.0)
    merger.remember_norm(1, 3.0)
    assert merger.norm_reference(2) == ()  # two merged rounds in the whole run: no reference yet
    for p, norm in ((2, 8.0), (0, 1.5), (2, 6.0)):
        merger.remember_norm(p, norm)
    assert merger.norm_reference(1) == pytest.approx((2.0, 3.0, 4.0, 3.0, 3.0))
    merger.remember_norm(1, 2.5)
    merger.remember_norm(1, 3.5)
    assert merger.norm_reference(1) == (3.0, 2.5, 3.5)  # its own history once it has one
    merger.remember_norm(0, float("nan"))  # not a norm: not remembered
    assert merger.norm_reference(0) == pytest.approx((1.0, 1.5, 2.0, 1.5, 1.5, 1.25, 1.75))


def test_two_learners_over_the_history_are_a_change_of_scale_not_an_attack() -> None:
    cur = {"w": torch.zeros(4)}
    res = synchronize_fragment(current=cur, bases={0: cur},
                               contributions=[_one("a", torch.full((4,), 5.0)), _one("b", torch.full((4,), 6.0))],
                               optimizer=NesterovOuterOptimizer(), policy=MergePolicy(outlier_norm_ratio=100.0),
                               norm_history=(0.02, 0.02, 0.02))
    assert res is not None and set(res.weights) == {"a", "b"}


def test_guards_that_do_not_trigger_change_nothing_bit_for_bit() -> None:
    cur = {"w": torch.arange(6, dtype=torch.float32)}
    cs = [_one("a", torch.full((6,), 0.01), steps=3), _one("b", torch.full((6,), -0.02), steps=5)]
    plain = synchronize_fragment(current=cur, bases={0: cur}, contributions=cs, optimizer=NesterovOuterOptimizer())
    guarded = synchronize_fragment(current=cur, bases={0: cur}, contributions=cs, optimizer=NesterovOuterOptimizer(),
                                   policy=MergePolicy(outlier_norm_ratio=100.0, max_weight_share=0.9),
                                   norm_history=(0.05, 0.05, 0.05))
    assert plain is not None and guarded is not None
    assert plain.weights == guarded.weights
    assert torch.equal(plain.new_params["w"], guarded.new_params["w"])


# -- bounded writes ---------------------------------------------------------------------------------
def _owner(key: str) -> str:
    return key.split("/")[1]


def test_a_learners_junk_is_listed_a_few_times_and_counted() -> None:
    junk = {f"learners/evil/contributions/f0000/b00000001/junk-{i:06d}.json":
            Rejection(RejectionKind.CORRUPT, "x" * 2000) for i in range(30_000)}
    late = {"learners/learner-0/contributions/f0000/b00000001/a.json": Rejection(RejectionKind.LATE, "0.5s late")}
    listed, summary = summarize_rejections({**junk, **late}, _owner)
    assert len(listed) == MAX_RECORDED_PER_LEARNER + 1 and set(late) <= set(listed)
    assert summary == {"count": 30_000 - MAX_RECORDED_PER_LEARNER, "by_learner": {"evil": {"corrupt": 30_000 - 8}}}
    size = len(json.dumps({k: v.to_dict() for k, v in listed.items()})) + len(json.dumps(summary))
    assert size < 9 * (MAX_DETAIL_CHARS + 200)


def test_round_policy_reasons_are_listed_before_storage_ones() -> None:
    rej = {f"learners/x/k{i}": Rejection(RejectionKind.CORRUPT, "junk") for i in range(20)}
    rej["learners/x/zz"] = Rejection(RejectionKind.SUPERSEDED, "a newer one replaces it")
    listed, summary = summarize_rejections(rej, _owner)
    assert "learners/x/zz" in listed and summary["count"] == 21 - MAX_RECORDED_PER_LEARNER


def test_many_learners_are_capped_in_total_and_in_the_summary() -> None:
    rej = {f"learners/l{i:05d}/k{j}": Rejection(RejectionKind.SCHEMA, "bad") for i in range(2000) for j in range(3)}
    listed, summary = summarize_rejections(rej, _owner)
    assert len(listed) == MAX_RECORDED_REJECTIONS
    assert summary["count"] == 6000 - MAX_RECORDED_REJECTIONS
    assert len(summary["by_learner"]) == 65 and "*" in summary["by_learner"]
    assert sum(sum(c.values()) for c in summary["by_learner"].values()) == summary["count"]


def test_a_few_rejections_are_listed_exactly() -> None:
    rej = {"learners/a/k": Rejection(RejectionKind.LATE, "late"), "learners/b/k": Rejection(RejectionKind.FENCED, "f")}
    assert summarize_rejections(rej, _owner) == (rej, {})
