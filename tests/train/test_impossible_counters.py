"""Counters the synchronizer can check: a contribution claiming more tokens than
its steps could consume (steps x batch x context from the recipe) or more steps than are possible
since its base version is an ``impossible_counters`` rejection with no weight, while honest
learners keep being merged and the real synchronizer loop goes on.

Same in-process pattern as test_hostile_records.py: real Learner objects, the real Synchronizer,
a local run folder, a fake clock, records planted behind the protocol's back.
"""

from __future__ import annotations

from pathlib import Path

from atoll.core.rejection import RejectionKind
from atoll.core.weights import MIN_STEP_S, impossible_counters, max_steps_since
from atoll.storage import RunReader, SynchronizerStore
from atoll.train.inner import RecipeLearner
from atoll.train.run import TokenBounds, load_recipe, recipe_context_tokens
from atoll.train.synchronizer import RoundSummary, Synchronizer

from .test_hostile_records import Clock, _learner_has_published, _rejections, _rounds, _run
from .test_hostile_records import _plant as _plant_with_two_steps

TOKENS_PER_STEP = 4 * 64  # smoke recipe: batch 4, micro GPT context 64


def _plant(store: RunReader, fragment: int, name: str, body_changes: dict) -> str:
    """_plant of test_hostile_records, with the record's c_steps in its key (a well-formed key)."""
    steps = body_changes.get("c_steps", 2)
    key = _plant_with_two_steps(store, fragment, name, body_changes)
    if steps == 2:
        return key
    data = store.store.get(key)
    store.store.delete(key)
    moved = key.replace(f".s{2:010d}.", f".s{steps:010d}.")
    store.store.put(moved, data)
    return moved


def _accepted_keys(store: RunReader) -> set[str]:
    return {a.key for r in store.history() for a in r.accepted}


def _honest_merged(store: RunReader, since_round: int) -> set[str]:
    return {a.learner_id for r in store.history() if r.round > since_round for a in r.accepted}


def test_token_bound_comes_from_the_recipe(tmp_path: Path) -> None:
    store, _, sync, _ = _run(tmp_path)
    recipe = load_recipe(store)
    assert recipe_context_tokens(recipe) == 64
    bounds = TokenBounds.of_recipe(recipe)
    assert bounds is not None and sync.token_bounds == bounds
    assert bounds.of("learner-0") == TOKENS_PER_STEP
    assert bounds.of("not-in-the-recipe") == TOKENS_PER_STEP  # the largest batch in the recipe


def test_a_trillion_tokens_is_rejected_and_carries_no_weight(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    start = sync.round
    p = sync.fragment_of_round(sync.round + 1)
    key = _plant(store, p, "evil-tokens", {"c_tokens": 10**12})  # within 2**53: passes the schema
    done = _rounds(learners, sync, clock, 6)
    assert len(done) >= 6
    why = _rejections(store)[key]
    assert why.kind is RejectionKind.IMPOSSIBLE_COUNTERS and why.final
    assert "c_tokens=1000000000000" in why.detail and str(TOKENS_PER_STEP) in why.detail
    assert key not in _accepted_keys(store)
    assert all(a.c_tokens <= a.c_steps * TOKENS_PER_STEP for r in store.history() for a in r.accepted)
    assert _honest_merged(store, start) == {lr.learner_id for lr in learners}


def test_forged_counters_under_a_real_learner_id_do_not_displace_its_real_contribution(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    start = sync.round
    p = sync.fragment_of_round(sync.round + 1)
    # A forged record for learner-0, newest by its own clock: it must not supersede the real one.
    key = _plant(store, p, "learner-0", {"c_tokens": 10**12, "created_at": 4e9})
    done = _rounds(learners, sync, clock, 4)
    assert len(done) >= 4
    assert _rejections(store)[key].kind is RejectionKind.IMPOSSIBLE_COUNTERS
    assert key not in _accepted_keys(store)
    assert "learner-0" in _honest_merged(store, start)


def test_absurd_step_count_is_rejected(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    start = sync.round
    p = sync.fragment_of_round(sync.round + 1)
    steps = 10**12  # tokens consistent with the steps, so only the step bound can catch it
    key = _plant(store, p, "evil-steps", {"c_steps": steps, "c_tokens": steps * TOKENS_PER_STEP})
    done = _rounds(learners, sync, clock, 6)
    assert len(done) >= 6
    why = _rejections(store)[key]
    assert why.kind is RejectionKind.IMPOSSIBLE_COUNTERS and "steps possible since its base version" in why.detail
    assert key not in _accepted_keys(store)
    assert _honest_merged(store, start) == {lr.learner_id for lr in learners}
    # A restarted synchronizer (fresh clock origin) refuses it too and keeps committing.
    again = Synchronizer(SynchronizerStore.open(store.url), clock=clock)
    assert len(_rounds(learners, again, clock, 2)) >= 2


def test_stranger_is_bound_by_the_largest_batch(tmp_path: Path) -> None:
    store, learners, sync, clock = _run(tmp_path)
    _learner_has_published(store, learners, sync, clock)
    p = sync.fragment_of_round(sync.round + 1)
    over = _plant(store, p, "stranger", {"c_steps": 2, "c_tokens": 2 * TOKENS_PER_STEP + 1})
    done = _rounds(learners, sync, clock, 4)
    assert len(done) >= 4
    assert _rejections(store)[over].kind is RejectionKind.IMPOSSIBLE_COUNTERS
    # Exactly at the bound is possible, so not an impossible_counters rejection.
    p = sync.fragment_of_round(sync.round + 1)
    at = _plant(store, p, "stranger2", {"c_steps": 2, "c_tokens": 2 * TOKENS_PER_STEP})
    _rounds(learners, sync, clock, 4)
    why = _rejections(store).get(at)
    assert why is None or why.kind is not RejectionKind.IMPOSSIBLE_COUNTERS


def _steady_rounds(learners: list[RecipeLearner], sync: Synchronizer, clock: Clock, n: int, dt: float) -> list[RoundSummary]:
    """Like _rounds, with a chosen clock advance per learner step."""
    out: list[RoundSummary] = []
    seen = {id(lr): sync.round for lr in learners}
    while len(out) < n:
        for lr in learners:
            lr.step()
        clock.t += dt
        while isinstance(s := sync.tick(), RoundSummary):
            out.append(s)
            for lr in learners:
                for rec in lr.store.poll_commits(seen[id(lr)]):
                    seen[id(lr)] = rec.round
                    if rec.updated:
                        lr.adopt(rec.round, rec.fragment, lr.store.read_global_fragment(rec.fragment, rec.round))
    return out


def test_honest_learners_pass_on_the_round_term_alone(tmp_path: Path) -> None:
    """With (almost) no time passing, only H * (rounds since base + 2) allows steps: honest
    learners in steady state are still never refused, over many rounds."""
    store, learners, sync, clock = _run(tmp_path)
    dt = MIN_STEP_S / 1000  # the time term adds nothing
    done = _steady_rounds(learners, sync, clock, 12, dt)
    assert len(done) >= 12
    assert not [k for k, why in _rejections(store).items() if why.kind is RejectionKind.IMPOSSIBLE_COUNTERS]
    assert _honest_merged(store, 0) == {lr.learner_id for lr in learners}


def test_a_stalled_round_does_not_refuse_a_learner_that_kept_training(tmp_path: Path) -> None:
    """The synchronizer does not get to a round (a slow merge, a stalled loop) while a learner keeps
    stepping: its counters grow far past the round term, and the time term covers them."""
    store, learners, sync, clock = _run(tmp_path)
    _steady_rounds(learners, sync, clock, 2, 1.0)
    busy = learners[0]
    h = store.config.inner_steps
    for _ in range(h * (store.config.num_fragments * 2 + 4)):  # far beyond the round term
        busy.step()
        clock.t += 0.01  # 10 ms steps
    done = _steady_rounds(learners, sync, clock, 4, 0.01)
    assert len(done) >= 4
    assert not [k for k, why in _rejections(store).items() if why.kind is RejectionKind.IMPOSSIBLE_COUNTERS]


def test_bounds_are_pure_integers() -> None:
    assert max_steps_since(10, 12, 24) == 24 * 4
    assert max_steps_since(12, 12, 24, elapsed_s=1.0) == 24 * 2 + 1000
    assert max_steps_since(12, 10, 24, elapsed_s=float("nan")) == 48
    assert impossible_counters(2**53, 2**53, max_steps=None, max_tokens_per_step=None) is None
    assert impossible_counters(0, 10**15, max_steps=1, max_tokens_per_step=1) is None  # left to unweighable
    why = impossible_counters(3, 3 * 256 + 1, max_steps=3, max_tokens_per_step=256)
    assert why is not None and why.kind is RejectionKind.IMPOSSIBLE_COUNTERS
    assert impossible_counters(3, 3 * 256, max_steps=3, max_tokens_per_step=256) is None
