"""Learners' inner-state saves: paced by a byte and time budget (or an explicit step count), in the
background, never queued behind one another, and optionally with bf16 moments."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from atoll.core.config import ConfigError
from atoll.storage import LearnerStore
from atoll.storage.paths import to_url
from atoll.train.inner import RecipeLearner, run_learner
from atoll.train.learner import LearnerOptions
from atoll.train.publisher import BackgroundOutbox
from atoll.train.recipe import Recipe, smoke_recipe
from atoll.train.run import create_run
from atoll.train.save_pacing import SavePacer

pytestmark = pytest.mark.fast


def _store(root: Path, **recipe_changes: object) -> LearnerStore:
    config, recipe = smoke_recipe(2, max_rounds=20)
    return LearnerStore.beside(create_run(to_url(str(root / "run")), config, recipe.replace(**recipe_changes)))


# -- the recipe's save fields ---------------------------------------------------------------------

def test_saves_are_paced_by_the_byte_budget_by_default_and_the_fields_name_themselves_when_wrong() -> None:
    recipe = Recipe()
    assert recipe.save_every_steps is None and recipe.save_uplink_share == 0.1 and recipe.save_moments_dtype == "fp32"
    assert Recipe.from_dict(recipe.to_dict()) == recipe  # None survives run.json
    assert Recipe.from_dict({**recipe.to_dict(), "save_every_steps": 50}).save_every_steps == 50  # older runs
    for changes, knob in [({"save_every_steps": -1}, "save_every_steps"), ({"save_every_steps": 2.5}, "save_every_steps"),
                          ({"save_uplink_share": 0}, "save_uplink_share"),
                          ({"save_uplink_share": float("inf")}, "save_uplink_share"),
                          ({"save_every_s": -1.0}, "save_every_s"), ({"save_moments_dtype": "fp16"}, "save_moments_dtype")]:
        with pytest.raises(ConfigError, match=knob):
            Recipe(**changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="nothing paces the learners' saves"):
        Recipe(save_uplink_share=None)
    Recipe(save_uplink_share=None, save_every_s=60.0)  # time alone
    Recipe(save_uplink_share=None, save_every_steps=0)  # only on exit


# -- the pacing -----------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_explicit_step_count_wins_over_the_budget() -> None:
    pacer = SavePacer(every_steps=5, uplink_share=0.1, every_s=60.0, uplink_bytes=lambda: 0, save_bytes=10**9)
    assert [s for s in range(1, 21) if pacer.due(s, in_flight=False)] == [5, 10, 15, 20]
    never = SavePacer(every_steps=0, uplink_share=None, every_s=0.0, uplink_bytes=lambda: 0, save_bytes=1)
    assert not any(never.due(s, in_flight=False) for s in range(1, 100))
    assert never.describe() == "saves only on exit"


def test_the_byte_budget_keeps_saves_within_their_share_of_the_uplink() -> None:
    """Saves are taken once they fit: their bytes never pass ``share`` x the other bytes sent up."""
    sent = {"other": 0, "saves": 0}
    pacer = SavePacer(every_steps=None, uplink_share=0.1, every_s=0.0,
                      uplink_bytes=lambda: sent["other"] + sent["saves"], save_bytes=1000)
    saved_at = []
    for step in range(1, 1001):
        sent["other"] += 70  # a contribution's share of each step
        if pacer.due(step, in_flight=False):
            pacer.started(1000)
            sent["saves"] += 1000
            saved_at.append(step)
            assert sent["saves"] <= 0.1 * sent["other"]
    assert saved_at[0] == 143  # 1000 B fit once 10,000 B went up otherwise (143 x 70)
    assert len(saved_at) == 7 and sent["saves"] / sent["other"] > 0.09  # and the budget is used
    assert pacer.saves == 7 and pacer.saved_bytes == 7000


def test_the_time_floor_spaces_saves_and_both_budgets_must_allow_one() -> None:
    clock = Clock()
    pacer = SavePacer(every_steps=None, uplink_share=None, every_s=60.0, uplink_bytes=lambda: 0, save_bytes=1,
                      clock=clock)
    assert not pacer.due(1, in_flight=False)  # 60 s from the start to the first
    clock.now = 60.0
    assert pacer.due(2, in_flight=False)
    pacer.started(1)
    clock.now = 100.0
    assert not pacer.due(3, in_flight=False)
    clock.now = 120.0
    assert pacer.due(4, in_flight=False)
    both = SavePacer(every_steps=None, uplink_share=0.1, every_s=60.0, uplink_bytes=lambda: 5, save_bytes=1,
                     clock=clock)
    clock.now = 1000.0
    assert not both.due(1, in_flight=False)  # time allows, bytes do not (1 B > 0.1 x 5 B)
    assert "within 10% of its uplink bytes and at least 60 s apart" in both.describe()


def test_a_save_due_while_one_is_in_flight_is_skipped_not_queued() -> None:
    steps = SavePacer(every_steps=2, uplink_share=None, every_s=0.0, uplink_bytes=lambda: 0, save_bytes=1)
    assert not steps.due(2, in_flight=True) and not steps.due(4, in_flight=True)  # skipped: the next multiple
    assert steps.skipped == 1  # counted once per save in flight
    assert steps.due(6, in_flight=False)
    budget = SavePacer(every_steps=None, uplink_share=1.0, every_s=0.0, uplink_bytes=lambda: 100, save_bytes=1)
    assert not budget.due(1, in_flight=True) and not budget.due(2, in_flight=True)
    assert budget.due(3, in_flight=False)  # coalesced: taken at the first step after the write is done
    assert budget.skipped == 1


# -- in the background, one at a time ---------------------------------------------------------------

def test_a_background_save_never_queues_and_never_holds_up_the_contributions_after_it(tmp_path: Path) -> None:
    """While a save is being written (held here on an event), the next save is refused (nothing is
    taken or queued) and the contributions published after it are written meanwhile; the save
    itself lands after the contributions submitted before it."""
    store = _store(tmp_path)
    learner = RecipeLearner(store, "learner-0", log=lambda _: None, publish_in_background=True)
    assert isinstance(learner.outbox, BackgroundOutbox)
    for _ in range(2):
        learner.step()
    release, writing = threading.Event(), threading.Event()
    real = learner.outbox.saver.store.save_learner_state

    def slow_save(*args: object, **kwargs: object) -> None:
        writing.set()
        assert release.wait(30)
        real(*args, **kwargs)  # type: ignore[arg-type]

    learner.outbox.saver.store.save_learner_state = slow_save  # type: ignore[method-assign]
    assert learner.save(background=True) > 0
    assert writing.wait(30) and learner.saving
    # The contributions of steps 1 and 2, submitted before the save, are in the bucket.
    published = {r.info["step"] for p in (0, 1) for r in store.list_contributions(p, {0}).records}
    assert published >= {1, 2}
    for _ in range(4):
        learner.step()
        assert learner.save(background=True) == 0  # one in flight: not taken, not queued
    learner.outbox.writer.flush()  # the contributions after the save are written while it is held
    published = {r.info["step"] for p in (0, 1) for r in store.list_contributions(p, {0}).records}
    assert published >= {3, 4, 5, 6}
    assert store.load_learner_state("learner-0") is None
    release.set()
    learner.flush()
    saved = store.load_learner_state("learner-0")
    assert saved is not None and saved.meta["step"] == 2 and not learner.saving
    assert learner.save(background=True) > 0  # the next one is taken again
    learner.flush()
    saved = store.load_learner_state("learner-0")
    assert saved is not None and saved.meta["step"] == 6


# -- bf16 moments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_a_resume_restores_counters_and_cursor_exactly_and_moments_to_the_saved_dtype(tmp_path: Path,
                                                                                       moments: str) -> None:
    store = _store(tmp_path, save_moments_dtype=moments)
    first = RecipeLearner(store, "learner-0", log=lambda _: None)
    for _ in range(5):
        first.step()
    first.user_state["epoch"] = 3
    live = {n: {k: v.clone() for k, v in first.opt.state[p].items()} for n, p in first.params.items()}
    nbytes = first.save()
    cursor = first.stream.state_dict()
    width = 4 if moments == "fp32" else 2
    assert nbytes == sum(2 * p.numel() * width + 4 for p in first.params.values())  # two moments, one step count
    assert nbytes == first.save_bytes_estimate() + 4 * len(first.params)
    saved = store.load_learner_state("learner-0")
    assert saved is not None
    dtype = torch.float32 if moments == "fp32" else torch.bfloat16
    assert {t.dtype for k, t in saved.tensors.items() if not k.endswith(".step")} == {dtype}

    again = RecipeLearner(store, "learner-0", log=lambda _: None)
    assert (again.step_count, again.tokens_total, again.user_state) == (5, first.tokens_total, {"epoch": 3})
    assert again.stream.state_dict() == cursor
    for name, p in again.params.items():
        state = again.opt.state[p]
        assert torch.equal(state["step"], live[name]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32  # the optimizer's own dtype again
            # fp32: bit for bit; bf16: the nearest bf16 of each moment, exactly.
            assert torch.equal(state[key], live[name][key].to(dtype).float())


# -- a learner process ------------------------------------------------------------------------------

def test_a_learner_paced_by_the_budget_saves_within_it_and_says_so(tmp_path: Path) -> None:
    """A learner on its own (no synchronizer): with a share of 1 (saves as many bytes as the rest
    of its uplink) its periodic saves stay within that share of its object store's uplink."""
    store = _store(tmp_path, save_every_steps=None, save_uplink_share=1.0)
    lines: list[str] = []
    summary = run_learner(store, "learner-0", log=lines.append,
                          options=LearnerOptions(max_steps=60, take_lease=False, poll_interval_s=0.05,
                                                 orphan_timeout_s=None))
    assert summary.exit_reason == "max_steps"
    assert any("saves within 100% of its uplink bytes" in line for line in lines)
    done = [line for line in lines if "exited" in line][-1]
    found = re.search(r"(\d+) periodic saves of ([\d.,]+) MiB", done)
    assert found is not None and int(found[1]) >= 1, done
    saved = store.load_learner_state("learner-0")
    assert saved is not None and saved.meta["step"] == 60  # the last save, on exit
    periodic = float(found[2].replace(",", "")) * 2**20
    one_save = periodic / int(found[1])
    other = store.store.wire_counts().bytes_up - periodic - one_save  # less the periodic saves and the exit's
    assert periodic <= 1.0 * other * 1.01  # tensors counted, headers and records on the other side: 1% slack


# -- what saves cost, before launch ----------------------------------------------------------------

def test_the_planner_counts_budget_paced_saves_and_atoll_plan_prints_them_at_the_presets(
        capsys: pytest.CaptureFixture[str]) -> None:
    from atoll.cli import main
    from atoll.sim.planner import plan_wire
    from atoll.train.save_costs import preset_save_costs

    config = smoke_recipe(2)[0]
    fixed = plan_wire(config, params=1_000_000, tokens_per_step=1024, save_every_steps=50)
    budget = plan_wire(config, params=1_000_000, tokens_per_step=1024, save_every_steps=None, save_uplink_share=0.1)
    assert budget.save_bytes == fixed.save_bytes
    assert budget.save_bytes_per_token == pytest.approx(0.1 * budget.up_bytes_per_token)
    assert budget.steps_per_save == pytest.approx(budget.save_bytes / (budget.save_bytes_per_token * 1024))
    half = plan_wire(config, params=1_000_000, tokens_per_step=1024, save_every_steps=None, save_uplink_share=0.1,
                     save_moments="bf16")
    assert half.steps_per_save is not None and budget.steps_per_save is not None
    assert half.save_bytes < 0.51 * fixed.save_bytes and half.steps_per_save < 0.51 * budget.steps_per_save
    # A time floor at a step time slows the budget down, never speeds it up.
    floor = plan_wire(config, params=1_000_000, tokens_per_step=1024, save_every_steps=None, save_uplink_share=0.1,
                      save_every_s=1e6, step_s=1.0)
    assert floor.save_bytes_per_token < budget.save_bytes_per_token
    assert plan_wire(config, params=1_000_000, tokens_per_step=1024, save_every_steps=0).save_lines() == []

    costs = {(c.name, c.moments): c for c in preset_save_costs()}
    assert set(costs) == {(n, m) for n in ("demo", "paper", "gpu 86M", "gpu 1B") for m in ("fp32", "bf16")}
    for c in costs.values():
        assert c.share <= 0.1 + 1e-9  # the target: saves within 10% of a learner's uplink bytes per token
    assert 80e6 < costs["gpu 86M", "fp32"].params < 90e6 and 0.95e9 < costs["gpu 1B", "fp32"].params < 1.1e9
    assert costs["demo", "fp32"].old_share > 1  # every 50 steps sent more in saves than in contributions

    assert main(["plan", "--params", "86e6", "--step-s", "0.03", "--wan-gbps", "1", "--precision", "int4", "-P", "8",
                 "-H", "64", "--tokens-per-step", "16384", "--saves"]) == 0
    text = capsys.readouterr().out
    assert "saves (inner state):" in text and "10.0% of its contributions' bytes" in text
    assert all(name in text for name in ("demo", "paper", "gpu 86M", "gpu 1B"))


def test_saves_due_at_every_step_of_a_learner_are_skipped_while_one_is_written(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner asked to save every step, whose first save is held until its 10th step: the steps
    go on, the saves due meanwhile are skipped (never queued), and the learner says how many."""
    store = _store(tmp_path, save_every_steps=1)
    real = LearnerStore.save_learner_state
    writes: list[int] = []
    release, steps = threading.Event(), [0]

    def slow(self: LearnerStore, learner_id: str, tensors: object, meta: object = None) -> None:
        assert release.wait(60)
        writes.append(1)
        real(self, learner_id, tensors, meta)  # type: ignore[arg-type]

    def count_steps() -> bool:  # asked before every step
        steps[0] += 1
        if steps[0] >= 10:
            release.set()
        return False

    monkeypatch.setattr(LearnerStore, "save_learner_state", slow)
    lines: list[str] = []
    summary = run_learner(store, "learner-0", log=lines.append, should_stop=count_steps,
                          options=LearnerOptions(max_steps=30, take_lease=False, poll_interval_s=0.05,
                                                 orphan_timeout_s=None))
    assert summary.steps == 30
    done = [line for line in lines if "exited" in line][-1]
    found = re.search(r"(\d+) periodic saves of [\d.,]+ MiB, (\d+) skipped while one was being written", done)
    assert found is not None, done
    saves, skipped = int(found[1]), int(found[2])
    assert 1 <= saves <= 30 - 8 and skipped >= 1  # steps 2..9 fell due while the first was held
    assert len(writes) == saves + 1  # the periodic ones and the one on exit: nothing queued was written later
