"""The inner lr schedule follows the run's progress, so fast and slow learners anneal together."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import atoll.train.virtual as virtual
from atoll.core.config import ConfigError
from atoll.storage import LearnerStore
from atoll.storage.paths import to_url
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import InnerOptimConfig, LearnerSpec, Recipe, lr_at_step, smoke_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual


def test_lr_at_step_by_hand() -> None:
    cfg = InnerOptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, total_steps=110, schedule="steps")
    # Linear warmup on the caller's own steps, whatever the progress.
    assert lr_at_step(cfg, 1) == pytest.approx(0.1)
    assert lr_at_step(cfg, 5, progress=0.9) == pytest.approx(0.5)
    assert lr_at_step(cfg, 10) == pytest.approx(1.0)
    # Own-step cosine: (60 - 10) / (110 - 10) = 1/2 of the way: 0.1 + 0.45 * (1 + cos(pi/2)) = 0.55.
    assert lr_at_step(cfg, 60) == pytest.approx(0.55)
    assert lr_at_step(cfg, 110) == pytest.approx(0.1)
    assert lr_at_step(cfg, 500) == pytest.approx(0.1)  # stays at the floor
    # Run progress replaces the step counter: the same lr at any step count.
    assert lr_at_step(cfg, 11, progress=0.0) == pytest.approx(1.0)
    assert lr_at_step(cfg, 11, progress=0.5) == pytest.approx(0.55)
    assert lr_at_step(cfg, 999, progress=0.5) == pytest.approx(0.55)
    assert lr_at_step(cfg, 50, progress=0.25) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at_step(cfg, 50, progress=1.0) == pytest.approx(0.1)
    assert lr_at_step(cfg, 50, progress=3.0) == pytest.approx(0.1)  # clamped


def test_schedule_knob_is_validated_and_round_trips() -> None:
    with pytest.raises(ConfigError, match="schedule"):
        InnerOptimConfig(schedule="tokens")
    assert InnerOptimConfig().schedule == "run"
    _, recipe = smoke_recipe(3)
    again = Recipe.from_dict(recipe.to_dict())
    assert again.inner.schedule == "run" and again.data.shard == "interleaved"


def test_learner_lr_follows_committed_rounds(tmp_path: Path) -> None:
    config, recipe = smoke_recipe(3, max_rounds=40)
    store = create_run(to_url(str(tmp_path / "run")), config, recipe)
    learner = RecipeLearner(LearnerStore.beside(store), "learner-0", log=lambda s: None)
    assert learner.run_progress() == 0.0
    learner.versions = [10, 7]  # newest round adopted: 10 of 40
    assert learner.run_progress() == pytest.approx(0.25)
    learner.step_count = recipe.inner.warmup_steps + 100
    learner.step()
    want = lr_at_step(recipe.inner, learner.step_count, progress=0.25)
    assert want < recipe.inner.lr and learner.opt.param_groups[0]["lr"] == pytest.approx(want)


@pytest.mark.parametrize("schedule", ["run", "steps"])
def test_fast_and_slow_learners_anneal_together_only_on_the_run_schedule(tmp_path: Path, schedule: str,
                                                                        monkeypatch) -> None:
    config, recipe = smoke_recipe(3, max_rounds=10_000)
    learners = tuple(LearnerSpec(learner_id=s.learner_id, batch_size=2, slowdown=2.0 if i == 2 else 1.0)
                     for i, s in enumerate(recipe.learners))
    steps = 40  # a fast learner's steps; the slow one does half
    # The run is as long as this budget: H = P = 2, so a round per fast step.
    recipe = recipe.replace(learners=learners, max_rounds=steps,
                            inner=InnerOptimConfig(lr=1e-3, warmup_steps=2, schedule=schedule,
                                                   total_steps=int(steps * 5 / 6)))
    store = create_run(to_url(str(tmp_path / "run")), config, recipe)
    made: list[RecipeLearner] = []

    class Spy(RecipeLearner):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(virtual, "RecipeLearner", Spy)
    run_virtual(store, token_budget=int(steps * 2.5) * 2 * 64)
    got = {lr.learner_id: lr.opt.param_groups[0]["lr"] for lr in made}
    floor = 1e-4
    if schedule == "run":
        # Everyone ends near the floor, fast or slow.
        assert all(v < 1.5 * floor for v in got.values()), got
    else:
        # Own-step schedules: the fast learners sit at the floor, the slow one stops far above it.
        assert got["learner-0"] == pytest.approx(floor) and got["learner-2"] > 3 * floor, got


def test_eval_batches_zero_never_evaluates_not_even_the_last_round() -> None:
    from atoll.train.run import RoundSchedule

    on = RoundSchedule(max_rounds=8, eval_every_rounds=2)
    off = RoundSchedule(max_rounds=8, eval_every_rounds=2, evaluate=False)
    assert [r for r in range(1, 9) if on.evaluates(r)] == [2, 4, 6, 8]
    assert not any(off.evaluates(r) for r in range(1, 9))
