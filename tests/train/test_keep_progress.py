"""keep_local_progress on the real Learner and Synchronizer (virtual clock): synchronous DiLoCo
is unchanged to the last bit (a lock-step learner takes no step between its publish and its
adoption), and in a decoupled run the work a learner did after publishing a fragment reaches the
model instead of being overwritten, which the merged-work share counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from atoll.core.config import ConfigError, DilocoConfig, synchronous_diloco
from atoll.runs.goodput import MergedWork
from atoll.storage import LearnerStore, RunReader
from atoll.storage.paths import to_url
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import LearnerSpec, smoke_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual

from .test_loops import reference_synchronous_diloco


def test_synchronous_diloco_is_unchanged_to_the_last_bit(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same kernels as the reference
    try:
        config = synchronous_diloco(3, inner_steps=3).replace(keep_local_progress=True)
        _, recipe = smoke_recipe(3, max_rounds=3)
        store = create_run(to_url(str(tmp_path / "run")), config, recipe)
        tokens_per_round = sum(s.batch_size for s in recipe.learners) * 64 * config.inner_steps
        assert run_virtual(store, token_budget=3 * tokens_per_round).rounds == 3
        got = store.read_global_state(3).params
        want = reference_synchronous_diloco(recipe, config.replace(keep_local_progress=False), 3)
        for n in want:
            assert torch.equal(got[n], want[n]), n
    finally:
        torch.set_num_threads(threads)


def _merged_share(tmp_path: Path, keep: bool) -> float:
    config, recipe = smoke_recipe(4, max_rounds=100_000)
    config = config.replace(num_fragments=4, inner_steps=4, overlap_steps=2, keep_local_progress=keep)
    recipe = recipe.replace(learners=tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=2,
                                                       slowdown=1.5 if i == 3 else 1.0) for i in range(4)))
    store = create_run(to_url(str(tmp_path / f"keep-{keep}")), config, recipe)
    result = run_virtual(store, token_budget=4 * 2 * 64 * 24, step_noise=0.5, seed=1)
    ledger, merged = MergedWork(), 0
    for rec in store.history():
        merged += sum(t for _, t in ledger.round(rec).values()) * store.plan.fragment_numel(rec.fragment)
    assert RunReader.open(store.url, read_only=True).manifest.config.keep_local_progress is keep
    return merged / (result.tokens * sum(store.plan.sizes.values()))


def test_work_after_a_publish_is_merged_instead_of_overwritten(tmp_path: Path) -> None:
    dropped, kept = _merged_share(tmp_path, False), _merged_share(tmp_path, True)
    # Overwriting drops at least the tau = 2 steps after each publish of H = 4: about half.
    assert dropped < 0.7 and kept > 0.8 and kept > dropped + 0.2, (dropped, kept)


def _published_then_stepped(tmp_path: Path, **changes: Any) -> tuple[Any, RecipeLearner, list[str], Any, Any]:
    """A real Learner on a new run (``changes`` to the smoke config), fragment 0 at numbers exact
    in fp32: aligned to version 1 (1 everywhere), three steps of 10 tokens to 1.75 and a publish,
    two more of 7 tokens to 2.75. Returns (store, learner, fragment 0's names, fill(value),
    version(value): a fragment of that value)."""
    config, recipe = smoke_recipe(2, max_rounds=10)
    store = create_run(to_url(str(tmp_path / "run")), config.replace(**changes), recipe)
    learner = RecipeLearner(LearnerStore.beside(store), "learner-0", log=lambda s: None)
    names = learner.plan.fragments[0]

    def fill(value: float) -> None:
        with torch.no_grad():
            for n in names:
                learner.params[n].fill_(value)

    def version(value: float) -> dict[str, torch.Tensor]:
        return {n: torch.full_like(learner.params[n], value) for n in names}

    assert learner.adopt(1, 0, version(1.0))
    for _ in range(3):
        learner.counters.record_step(10)
    fill(1.75)
    learner.publish(0)
    for _ in range(2):
        learner.counters.record_step(7)
    fill(2.75)
    return store, learner, names, fill, version


def _published_against(store: Any, learner: RecipeLearner, base: int, *, step: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The learner publishes fragment 0 at ``step``: its one contribution against ``base`` as the
    bucket holds it (record, decoded delta)."""
    learner.step_count = step
    learner.publish(0)
    learner.flush()
    reader = RunReader.open(store.url, read_only=True)
    (rec,) = reader.list_contributions(0, base, ["learner-0"]).records
    return rec, reader.load_contribution(rec).delta


def test_the_learner_adopts_the_new_version_plus_its_steps_since_the_publish_by_hand(tmp_path: Path) -> None:
    """The real Learner on a real bucket, fragment 0 set to numbers exact in fp32: aligned to 1
    everywhere, three steps (30 tokens) to 1.75 and a publish, two more (14 tokens) to 2.75;
    adopting a version of 4 everywhere leaves 4 + (2.75 - 1.75) = 5, with 2 steps and 14 tokens
    carried; one more step (9 tokens) to 5.25 and the next contribution is against the new
    version, with delta 4 - 5.25 = -1.25, 3 steps, 23 tokens, 2 of them kept through the adoption."""
    store, learner, names, fill, version = _published_then_stepped(tmp_path, keep_local_progress=True)
    assert learner.adopt(5, 0, version(4.0))
    for n in names:
        assert torch.equal(learner.params[n].detach(), torch.full_like(learner.params[n], 5.0)), n
    fc = learner.counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens, fc.kept_steps) == (5, 2, 14, 2)
    assert not learner.adopt(5, 0, version(9.0))  # not newer: nothing changes

    learner.counters.record_step(9)
    fill(5.25)
    rec, delta = _published_against(store, learner, 5, step=6)
    assert (rec.c_steps, rec.c_tokens, rec.info["kept_steps"], rec.info["step"]) == (3, 23, 2, 6)
    for n in names:
        assert torch.equal(delta[n], torch.full_like(delta[n], -1.25)), n


def test_a_kept_share_of_one_half_moves_the_fragment_half_way_and_counts_half_the_steps(tmp_path: Path) -> None:
    """kept_progress_share 0.5 on the real Learner: aligned to 1, three steps to 1.75 and a
    publish, two more (7 tokens each) to 2.75; adopting 4 leaves 4 + 0.5 x (2.75 - 1.75) = 4.5
    and carries 1 of the 2 steps, with its 7 tokens."""
    store, learner, names, _, version = _published_then_stepped(tmp_path, keep_local_progress=True,
                                                                kept_progress_share=0.5)
    assert RunReader.open(store.url, read_only=True).manifest.config.kept_progress_share == 0.5
    assert learner.adopt(5, 0, version(4.0))
    for n in names:
        assert torch.equal(learner.params[n].detach(), torch.full_like(learner.params[n], 4.5)), n
    fc = learner.counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens, fc.kept_steps) == (5, 1, 7, 1)
    learner.flush()


def test_progress_kept_into_the_delta_leaves_the_fragment_at_the_version_and_reaches_the_next_contribution(
        tmp_path: Path) -> None:
    """kept_progress_into='delta' on the real Learner: aligned to 1, three steps to 1.75 and a
    publish, two more (7 tokens each) to 2.75; adopting 4 leaves the fragment at 4 exactly and
    holds the 1.0 gained since the publish. One step (9 tokens) to 4.5 and adopting 6 leaves 6 and
    holds 1.0 + 0.5. One more step (5 tokens) to 6.25: the contribution against version 6 is
    6 - 6.25 - 1.5 = -1.75 (base - local, with everything kept since the publish), 4 steps and
    28 tokens, 3 of them kept through adoptions; the next one carries nothing more."""
    store, learner, names, fill, version = _published_then_stepped(tmp_path, keep_local_progress=True,
                                                                kept_progress_into="delta")
    assert RunReader.open(store.url, read_only=True).manifest.config.kept_progress_into == "delta"
    assert learner.adopt(5, 0, version(4.0))
    for n in names:
        assert torch.equal(learner.params[n].detach(), torch.full_like(learner.params[n], 4.0)), n
    fc = learner.counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens, fc.kept_steps) == (5, 2, 14, 2)
    learner.counters.record_step(9)
    fill(4.5)
    assert learner.adopt(6, 0, version(6.0))
    fc = learner.counters.fragments[0]
    assert (fc.base_version, fc.c_steps, fc.c_tokens, fc.kept_steps) == (6, 3, 23, 3)
    learner.counters.record_step(5)
    fill(6.25)
    rec, delta = _published_against(store, learner, 6, step=7)
    assert (rec.c_steps, rec.c_tokens, rec.info["kept_steps"]) == (4, 28, 3)
    for n in names:
        assert torch.equal(delta[n], torch.full_like(delta[n], -1.75)), n
    assert not learner.carried  # delivered: the next contribution starts afresh


def test_kept_progress_into_is_validated_and_reads_as_params_in_older_manifests() -> None:
    assert DilocoConfig().kept_progress_into == "params"
    for bad in ("both", "", None, 1):
        with pytest.raises(ConfigError, match="kept_progress_into"):
            DilocoConfig(kept_progress_into=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kept_progress_share"):
        DilocoConfig(kept_progress_into="delta", kept_progress_share=0.5)
    old = DilocoConfig(kept_progress_into="delta").to_dict()
    assert DilocoConfig.from_dict(old).kept_progress_into == "delta"
    del old["kept_progress_into"]  # a run created before the field existed
    assert DilocoConfig.from_dict(old).kept_progress_into == "params"
