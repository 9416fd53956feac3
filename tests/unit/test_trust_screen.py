"""A confined liar's weight from the first round (docs/threat-model.md, weight rows): the prior
before anything is observed, the step-share cap, and what a restarted synchronizer reads back.
The real :class:`~atoll.train.trust.ContributionScreen` with records in memory (no bucket);
hypothesis draws forged counters, stalls of the synchronizer, fleets and restarts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.core.config import ConfigError, DilocoConfig
from atoll.core.fragments import fragment_offsets
from atoll.core.weights import (
    UNOBSERVED_INTERVALS,
    Counters,
    cap_step_share,
    contribution_weights,
    max_steps_since,
    plausible_steps,
)
from atoll.storage.records import BlobRef, ContributionRecord
from atoll.train.trust import OBSERVED_IN_STATS, ContributionScreen

TPP = 512
"""Tokens per step of every learner: the liar's weight per step is an honest learner's."""


class _NoLeases:
    def current_incarnation(self, learner_id: str) -> int:
        return 0


def _record(lid: str, fragment: int, base: int, c_steps: int, c_tokens: int, r: int) -> ContributionRecord:
    return ContributionRecord(
        key=f"learners/{lid}/contributions/f{fragment:04d}/b{base:08d}/{lid}.r{r:08d}.s{c_steps}.json",
        learner_id=lid, fragment=fragment, base_version=base, c_steps=c_steps, c_tokens=c_tokens,
        payload=BlobRef(sha256="0" * 64, nbytes=1), tensors={}, created_at=0.0,
        info={"step_time_s": 1e-9 if lid == "liar" else 1.0})


def _screen(h: int, p: int, at_s: float) -> ContributionScreen:
    cfg = DilocoConfig()
    return ContributionScreen(_NoLeases(), offsets=fragment_offsets(p, h), inner_steps=h, num_fragments=p,
                              max_learner_speedup=cfg.max_learner_speedup, token_bounds=None, started_at_s=at_s,
                              max_step_share=cfg.max_step_share)


class _Run:
    """M - 1 honest learners stepping 1 s a step and one liar, round after round on one screen."""

    def __init__(self, m: int, h: int, p: int) -> None:
        self.m, self.h, self.p = m, h, p
        self.t = 0.0
        self.round = 0
        self.versions = [0] * p
        self.previous = [0] * p
        self.screen = _screen(h, p, 0.0)

    def play(self, *, stall_s: float, honest_steps: int, claim: float, tokens: float, old_base: bool
             ) -> tuple[Counters, float, int]:
        """One round: the liar claims ``claim`` of the steps the step bound admits (and ``tokens``
        of a full batch). Returns its weighed counters, its weight share and the contributions."""
        self.t += self.h / self.p + stall_s
        r = self.round + 1
        p = (r - 1) % self.p
        base = self.previous[p] if old_base else self.versions[p]
        most = max_steps_since(base, r, self.h, elapsed_s=self.t - self.screen.base_seen_at_s(base))
        steps = max(1, int(most * claim))
        recs = [_record(f"honest-{i}", p, self.versions[p], honest_steps, honest_steps * TPP, r)
                for i in range(self.m - 1)]
        recs.append(_record("liar", p, base, steps, max(1, int(steps * TPP * tokens)), r))
        recs.sort(key=lambda x: (x.base_version, x.c_steps))
        screened = self.screen.screen(recs, r, self.t)
        assert not screened.rejected, screened.rejected  # inside the step bound: weighed, not refused
        weighed = self.screen.weighed(screened.candidates.values())
        liar = next(k for k in weighed if k.startswith("learners/liar/"))
        share = contribution_weights(weighed).weights[liar]
        self.previous[p], self.versions[p] = self.versions[p], r
        self.round = r
        self.screen.saw_commit(r, self.t)
        self.screen.open_round()
        return weighed[liar], share, len(weighed)


fleets = st.tuples(st.integers(2, 8), st.integers(1, 6), st.integers(1, 4)).map(
    lambda t: (t[0], t[1] * t[2], t[1]))  # (M, H, P) with H >= P
forgeries = st.fixed_dictionaries({
    "stall_s": st.sampled_from([0.0, 0.5, 30.0, 600.0, 86_400.0]) | st.floats(0.0, 1e6),
    "claim": st.floats(0.001, 1.0), "tokens": st.floats(0.01, 1.0), "old_base": st.booleans()})


@given(fleet=fleets, forged=forgeries, honest=st.integers(1, 3))
@settings(max_examples=80, deadline=None)
def test_before_anything_is_observed_a_claim_counts_at_most_the_prior(
        fleet: tuple[int, int, int], forged: dict, honest: int) -> None:
    """A new run's first round: whatever the liar claims inside the step bound, after whatever
    stall, it is weighed at most UNOBSERVED_INTERVALS x H steps and at most 0.9 of the round's
    steps; beside honest learners at H steps its share is at most U / (U + M - 1) with U =
    UNOBSERVED_INTERVALS (the rules before: up to 0.999)."""
    m, h, p = fleet
    run = _Run(m, h, p)
    weighed, share, n = run.play(honest_steps=honest * h, **forged)
    assert weighed.c_steps <= UNOBSERVED_INTERVALS * h
    assert n == m and share <= 0.9 + 1e-12
    if honest == 1:
        assert share <= UNOBSERVED_INTERVALS / (UNOBSERVED_INTERVALS + m - 1) + 1e-12


@given(fleet=fleets, forged=st.lists(forgeries, min_size=1, max_size=6), read_back=st.booleans(),
       honest=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_over_rounds_stalls_and_a_restart_one_liar_never_carries_more_than_the_cap(
        fleet: tuple[int, int, int], forged: list[dict], read_back: bool, honest: int) -> None:
    """Any sequence of forged rounds and stalls, then a restarted synchronizer (reading back what
    the first one observed, or nothing): in every round with honest learners the liar carries at
    most 0.9 of the weight, and a restarted synchronizer that read nothing back holds it to the
    prior; one that read back bounds it by the honest pace from its first round."""
    m, h, p = fleet
    run = _Run(m, h, p)
    for f in forged:
        _, share, _ = run.play(honest_steps=honest * h, **f)
        assert share <= 0.9 + 1e-12
    observed = run.screen.observed.observed_stats()
    run.screen = _screen(h, p, run.t)
    if read_back:
        run.screen.observed.recall(observed)
    weighed, share, _ = run.play(honest_steps=honest * h, **forged[0])
    assert share <= 0.9 + 1e-12
    honest_seen = [t for lid, t in observed.items() if lid != "liar"]
    if not (read_back and honest_seen):  # nothing (of another learner) to read back: the prior
        assert weighed.c_steps <= UNOBSERVED_INTERVALS * h
    else:  # the honest learners' observed 1 s a step, at 4x, for the time since the restart
        assert min(honest_seen) == pytest.approx(1.0)
        assert weighed.c_steps <= h + int(4.0 * (h / p + forged[0]["stall_s"]) / 1.0) + 1


def test_the_prior_and_the_step_share_cap_by_hand() -> None:
    assert plausible_steps(10.0, min_step_s=None, inner_steps=24, speedup=4.0, unobserved_steps=48) == 48
    assert plausible_steps(10.0, min_step_s=None, inner_steps=24, speedup=None, unobserved_steps=48) is None
    assert plausible_steps(10.0, min_step_s=0.5, inner_steps=24, speedup=4.0, unobserved_steps=48) == 104
    liar, honest = Counters(c_steps=1000, c_tokens=1000 * TPP), Counters(c_steps=24, c_tokens=24 * TPP)
    out = cap_step_share({"liar": liar, "honest": honest}, 0.9)
    assert out["honest"] is honest and out["liar"] == Counters(c_steps=216, c_tokens=216 * TPP)  # 9 x 24
    assert contribution_weights(out).weights["liar"] == pytest.approx(0.9)
    # an island with 4x the tokens per step at equal steps is nowhere near the cap: steps, not weights
    island = Counters(c_steps=24, c_tokens=24 * 4 * TPP)
    same = {"island": island, "one": honest}
    assert cap_step_share(same, 0.9) == same and contribution_weights(same).weights["island"] > 0.94
    assert cap_step_share({"liar": liar}, 0.9) == {"liar": liar}  # alone: nothing to share
    assert cap_step_share({"liar": liar, "honest": honest}, None)["liar"] is liar


def test_read_back_keeps_the_fastest_and_ignores_what_is_not_a_step_time() -> None:
    screen = _screen(24, 24, 0.0)
    assert screen.observed.fastest_other("liar") is None and screen.observed.observed_stats() == {}
    screen.observed.recall({"a": 0.5, "b": math.nan, "c": -1.0, "d": True, "e": "1", 7: 1.0})
    screen.observed.recall(["not", "a", "dict"])
    screen.observed.recall({"f": 1e-300 * 1e-300})  # 0.0: not a step time
    assert screen.observed.fastest_other("liar") == 0.5
    assert screen.observed.fastest_other("a") is None  # its own read-back never loosens its bound
    many = {f"l{i}": 1.0 + i for i in range(100)}
    screen.observed.recall(many)
    assert len(screen.observed.observed_stats()) <= OBSERVED_IN_STATS


def test_step_share_is_on_by_default_and_validated() -> None:
    assert DilocoConfig().max_step_share == 0.9
    assert DilocoConfig(max_step_share=None).max_step_share is None
    for bad in (0.4, 1.0, 1.5, math.nan, True):
        with pytest.raises(ConfigError, match="max_step_share"):
            DilocoConfig(max_step_share=bad)
