"""Round pacing on the real Synchronizer and learners (virtual clock): with K = 1 and staggered
learners, rounds without pacing merge a few steps per contribution; with round_pacing = 1 each
merged contribution carries about H steps, in far fewer rounds. The run's manifest keeps the
knob, a manifest without it reads as off, and ``atoll status`` prints the effective H."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.core.config import DilocoConfig
from atoll.runs.contributions import effective_h
from atoll.runs.report import run_status
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.storage.records import RunManifest
from atoll.train.recipe import LearnerSpec, smoke_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual

H = 4
STEPS_PER_LEARNER = 24


def _run(tmp_path: Path, round_pacing: float) -> tuple[RunReader, int]:
    config, recipe = smoke_recipe(4, max_rounds=10_000)
    config = config.replace(num_fragments=H, inner_steps=H, overlap_steps=1, round_pacing=round_pacing)
    learners = tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=2, slowdown=1.5 if i == 3 else 1.0)
                     for i in range(4))
    recipe = recipe.replace(learners=learners)
    store = create_run(to_url(str(tmp_path / f"pacing-{round_pacing:g}")), config, recipe)
    # step noise staggers the learners: contributions for a fragment arrive one by one
    result = run_virtual(store, token_budget=4 * 2 * 64 * STEPS_PER_LEARNER, step_noise=0.5, seed=1)
    return store, result.rounds


def test_round_pacing_brings_the_effective_h_to_h(tmp_path: Path) -> None:
    off, rounds_off = _run(tmp_path, 0.0)
    on, rounds_on = _run(tmp_path, 1.0)
    h_off, h_on = (effective_h(s.history()[H:]) for s in (off, on))  # after the first pass over the fragments
    assert h_off is not None and h_on is not None
    assert h_off[0] < 0.5 * H  # K = 1: an arrival closes the round, a contribution carries a step or two
    assert h_on[0] >= 0.85 * H
    assert rounds_on < 0.5 * rounds_off  # the same work in fewer rounds: fewer bytes
    reasons = [r.stats["reason"] for r in on.history()[H:]]
    assert all("paced: " in x or "pacing bound" in x for x in reasons)
    assert not any("pac" in r.stats["reason"] for r in off.history())
    on_status = "\n".join(run_status(RunReader.open(on.url, read_only=True)))
    assert "inner steps per merged contribution (H = 4, round pacing 1;" in on_status
    assert "round pacing off;" in "\n".join(run_status(RunReader.open(off.url, read_only=True)))


def test_the_manifest_keeps_round_pacing_and_an_old_one_reads_as_off(tmp_path: Path) -> None:
    config, recipe = smoke_recipe(2)
    url = to_url(str(tmp_path / "run"))
    create_run(url, config.replace(round_pacing=0.5), recipe)
    manifest = RunReader.open(url, read_only=True).manifest
    assert manifest.config.round_pacing == 0.5
    body = manifest.to_dict()
    del body["config"]["round_pacing"]  # written before the knob existed
    assert RunManifest.from_body(body).config == config.replace(round_pacing=0.0)
    assert DilocoConfig.from_dict(body["config"]).quorum_policy().pace_steps == 0.0
    with pytest.raises(Exception, match="round_pacing"):
        RunManifest.from_body({**body, "config": {**body["config"], "round_pacing": 2.0}})
