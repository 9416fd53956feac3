"""The virtual-clock driver runs the real Learner and Synchronizer objects deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atoll.core.config import ConfigError, synchronous_diloco
from atoll.storage import LearnerStore, RunReader
from atoll.storage.paths import to_url
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import LearnerSpec, smoke_recipe
from atoll.train.run import create_run, make_evaluator
from atoll.train.virtual import run_virtual

from .test_loops import reference_synchronous_diloco


def test_virtual_lockstep_equals_synchronous_diloco(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same kernels as the reference: bit-for-bit comparable
    try:
        _lockstep(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _lockstep(tmp_path: Path) -> None:
    config = synchronous_diloco(3, inner_steps=3)
    _, recipe = smoke_recipe(3, max_rounds=3)
    url = to_url(str(tmp_path / "run"))
    store = create_run(url, config, recipe)
    tokens_per_round = sum(s.batch_size for s in recipe.learners) * 64 * config.inner_steps
    result = run_virtual(store, token_budget=3 * tokens_per_round)
    assert result.rounds == 3 and result.merged_per_round == 3
    got = RunReader.open(url).read_global_state(3).params
    want = reference_synchronous_diloco(recipe, config, 3)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_virtual_decoupled_run_with_slow_learners_is_deterministic(tmp_path: Path) -> None:
    config, recipe = smoke_recipe(3, max_rounds=10_000)
    learners = tuple(LearnerSpec(learner_id=s.learner_id, batch_size=4, slowdown=1.5 if i == 2 else 1.0)
                     for i, s in enumerate(recipe.learners))
    recipe = recipe.replace(learners=learners)
    results = []
    for k in range(2):
        url = to_url(str(tmp_path / f"run{k}"))
        store = create_run(url, config, recipe)
        results.append(run_virtual(store, token_budget=60 * 4 * 64, evaluate=make_evaluator(store),
                                   eval_every_tokens=20 * 4 * 64))
    a, b = results
    assert a.curve == b.curve and a.rounds == b.rounds and a.steps == b.steps
    # The slow learner did 1/1.5 of the steps of a fast one, and it still got merged.
    assert a.steps["learner-2"] < a.steps["learner-0"]
    history = RunReader.open(to_url(str(tmp_path / "run0"))).history()
    assert any(x.learner_id == "learner-2" for r in history for x in r.accepted)
    assert a.curve[-1][1] < a.curve[0][1]


USER_MODEL = '''
import torch


class Bigram(torch.nn.Module):
    """Not atoll's GPT: no .config, one embedding table and one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(256, 32)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, idx):
        return self.head(self.table(idx))


def make():
    return Bigram()
'''


def test_a_users_own_module_trains_through_the_same_loops(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "my_models.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    config, recipe = smoke_recipe(2, max_rounds=10_000)
    recipe = recipe.replace(model="my_models:make", context_tokens=32)
    store = create_run(to_url(str(tmp_path / "run")), config, recipe)
    assert store.plan.embedding_names == {"table.weight"}
    result = run_virtual(store, token_budget=40 * 4 * 32 * 2, evaluate=make_evaluator(store),
                         eval_every_tokens=20 * 4 * 32 * 2)
    assert result.rounds > 0 and result.curve[-1][1] < result.curve[0][1]
    # Without a context length the error names the knob.
    bad = recipe.replace(context_tokens=0)
    store2 = create_run(to_url(str(tmp_path / "run2")), config, bad)
    with pytest.raises(ConfigError, match="context_tokens"):
        RecipeLearner(LearnerStore.beside(store2), "learner-0", log=lambda _: None)
