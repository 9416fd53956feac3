"""Fixtures for the command-line tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from atoll.storage.paths import to_url
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run


@pytest.fixture
def committed_run(tmp_path: Path) -> Callable[[], str]:
    """A maker of a smoke run at ``tmp_path / "run"`` with rounds 1 and 2 committed, signed with
    whatever keys the environment holds when it is called; returns the run's url."""
    def make() -> str:
        config, recipe = smoke_recipe(2, max_rounds=4)
        url = to_url(str(tmp_path / "run"))
        store = create_run(url, config, recipe)
        for r in (1, 2):
            p = (r - 1) % store.plan.num_fragments
            assert store.commit_round(r, p, params=store.read_global_fragment(p)).won
        return url
    return make
