"""A learner as a torch.distributed group (gloo on CPU): an island of ranks doing DDP or FSDP2 inner steps."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import pytest
import torch

from atoll.core.config import DilocoConfig
from atoll.storage import LearnerStore, RunReader
from atoll.storage.paths import to_url
from atoll.train.inner import RecipeLearner
from atoll.train.island import island_device, run_island
from atoll.train.learner import LearnerOptions
from atoll.train.local import LocalRun
from atoll.train.recipe import DataSpec, InnerOptimConfig, LearnerSpec, Recipe
from atoll.train.run import TokenBounds, create_run

pytestmark = pytest.mark.timeout(240)

STEPS = 6
REL_L2 = 1e-3
MAX_ABS = 1e-4
"""The stated tolerance of a 2-rank island against one rank on the doubled batch, on the deltas
published over 6 AdamW steps (entries of about 1e-2): per tensor, ||island - single|| <= 1e-3 x
||single||, and no entry differs by more than 1e-4. DDP averages the two ranks' mean gradients
where one rank takes the mean over the whole batch: the same sum in another order. AdamW's
normalised update amplifies that rounding where a gradient entry is near zero, so single entries
differ by up to ~1e-5 (measured), while the relative L2 error stays around 1e-5. FSDP2
(``shard="fsdp2"``) reduce-scatters the same averaged gradients into shards: the same tolerance
holds, for the deltas and for the saved AdamW moments."""


def _run(root: Path, learners: tuple[LearnerSpec, ...], *, rounds: int = 100) -> LearnerStore:
    config = DilocoConfig(num_learners=len(learners), num_fragments=2, inner_steps=2, overlap_steps=1,
                          min_quorum=1, initial_grace_s=0.5)
    recipe = Recipe(model="micro", data=DataSpec(max_corpus_mb=2.0), learners=learners,
                    inner=InnerOptimConfig(lr=3e-3, warmup_steps=2, total_steps=200), max_rounds=rounds,
                    eval_every_rounds=0, save_every_steps=1000)
    return LearnerStore.beside(create_run(to_url(str(root / "run")), config, recipe))


def _published(store: RunReader, learner_id: str) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    out = {}
    for p in range(store.plan.num_fragments):
        records = [r for r in store.list_contributions(p, {0}).records if r.learner_id == learner_id]
        contributions, bad = store.load_contributions(records)
        assert not bad
        for r, c in zip(records, contributions, strict=True):
            assert (r.c_steps, r.c_tokens) == (c.counters.c_steps, c.counters.c_tokens)
            out[(p, int(r.info["step"]))] = {"tokens": torch.tensor(r.c_tokens), **c.delta}
    return out


@pytest.mark.parametrize("shard", ["ddp", "fsdp2"])
def test_two_rank_island_matches_one_rank_with_the_doubled_batch(tmp_path: Path, shard: str) -> None:
    island = _run(tmp_path / "island", (LearnerSpec(learner_id="l0", batch_size=2, ranks=2, shard=shard),))
    single = _run(tmp_path / "single", (LearnerSpec(learner_id="l0", batch_size=4),))
    options = LearnerOptions(max_steps=STEPS, threads=1, lockstep=False)  # K = M = 1: lock-step otherwise
    summary = run_island(island, "l0", options=options, log=lambda _: None)
    assert summary.steps == STEPS and summary.tokens == STEPS * 4 * 64  # the island's tokens
    one = RecipeLearner(single, "l0", log=lambda _: None, lockstep=False)
    for _ in range(STEPS):
        one.step()
    got, want = _published(island, "l0"), _published(single, "l0")
    assert set(got) == set(want) and len(got) == STEPS
    for key in want:
        assert int(got[key]["tokens"]) == int(want[key]["tokens"])  # counters count the whole island
        for name in want[key]:
            a, b = got[key][name].float(), want[key][name].float()
            assert float((a - b).norm()) <= REL_L2 * float(b.norm()) + 1e-12, (key, name)
            assert float((a - b).abs().max()) <= MAX_ABS, (key, name)
    # Rank 0 saved the island's inner state: step counter and tokens of the whole island.
    saved = island.load_learner_state("l0")
    assert saved is not None and saved.meta["step"] == STEPS and saved.meta["tokens"] == STEPS * 4 * 64
    # ... in the one-rank layout (FSDP2: gathered from the shards), with the reference's moments.
    one.save()
    ref = single.load_learner_state("l0")
    assert ref is not None and set(saved.tensors) == set(ref.tensors)
    for name, b in ref.tensors.items():
        a = saved.tensors[name]
        assert a.shape == b.shape, name
        assert float((a - b).norm()) <= REL_L2 * float(b.norm()) + 1e-12, name
        assert float((a - b).abs().max()) <= MAX_ABS * max(1.0, float(b.abs().max())), name


def test_an_fsdp2_island_rejoins_from_its_saved_state(tmp_path: Path) -> None:
    store = _run(tmp_path, (LearnerSpec(learner_id="l0", batch_size=2, ranks=2, shard="fsdp2"),))
    options = LearnerOptions(max_steps=3, threads=1, lockstep=False)
    first = run_island(store, "l0", options=options, log=lambda _: None)
    assert not first.resumed_inner_state
    before = store.load_learner_state("l0")
    assert before is not None and before.meta["step"] == 3
    again = run_island(store, "l0", options=options, log=lambda _: None)  # loads it, shards it, trains on
    assert again.resumed_inner_state and again.steps == 3
    after = store.load_learner_state("l0")
    assert after is not None and after.meta["step"] == 6
    assert float(after.tensors["adamw.tok_emb.weight.step"][0]) == 6.0  # AdamW's step went on from 3

def test_token_bounds_count_every_rank() -> None:
    recipe = Recipe(model="micro", learners=(LearnerSpec(learner_id="a", batch_size=3, ranks=4),
                                             LearnerSpec(learner_id="b", batch_size=5)))
    bounds = TokenBounds.of_recipe(recipe)
    assert bounds is not None and bounds.of("a") == 12 * 64 and bounds.of("b") == 5 * 64
    assert island_device("cpu", 1) == "cpu"


@pytest.mark.slow  # ~20 s: one more island start
def test_an_fsdp2_island_trains_under_bf16_autocast(tmp_path: Path) -> None:
    store = _run(tmp_path, (LearnerSpec(learner_id="l0", batch_size=2, ranks=2, shard="fsdp2", autocast="bf16"),))
    summary = run_island(store, "l0", options=LearnerOptions(max_steps=3, threads=1, lockstep=False),
                         log=lambda _: None)
    assert summary.steps == 3 and summary.published == 3 and all(map(math.isfinite, summary.losses))
    for key, delta in _published(store, "l0").items():
        for name, t in delta.items():
            if name != "tokens":
                assert t.dtype == torch.float32 and bool(torch.isfinite(t).all()), (key, name)


@pytest.mark.parametrize("shard", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_a_run_mixing_a_one_rank_and_a_two_rank_island_weighs_them_by_tokens(tmp_path: Path, shard: str) -> None:
    store = _run(tmp_path, (LearnerSpec(learner_id="solo", batch_size=2),
                            LearnerSpec(learner_id="pair", batch_size=2, ranks=2, shard=shard)), rounds=16)
    with LocalRun(store.url, log_dir=tmp_path / "logs") as run:
        run.start_learner("solo")
        run.start_learner("pair")
        # The island takes longer to start (two processes importing torch): begin the rounds once
        # both have published, so that rounds can merge both.
        deadline = time.monotonic() + 120
        while not {"solo", "pair"} <= {r.learner_id for r in store.list_contributions(0, {0}).records}:
            assert time.monotonic() < deadline, (tmp_path / "logs" / "pair.log").read_text()[-3000:]
            for lid, proc in run.learners.items():
                assert proc.poll() is None, (tmp_path / "logs" / f"{lid}.log").read_text()[-3000:]
            time.sleep(0.2)
        sync = run.start_synchronizer()
        assert sync.wait(timeout=200) == 0, (tmp_path / "logs" / "synchronizer.log").read_text()[-3000:]
        for lid in ("solo", "pair"):
            assert run.learners[lid].wait(timeout=60) == 0, (tmp_path / "logs" / f"{lid}.log").read_text()[-3000:]
    history = RunReader.open(store.url).history()
    assert len(history) == 16
    both = 0
    for rec in history:
        per_step = {a.learner_id: a.c_tokens / a.c_steps for a in rec.accepted}
        if "pair" in per_step:
            assert per_step["pair"] == 2 * 2 * 64  # two ranks x batch 2 x context 64
        if {"solo", "pair"} <= set(per_step):
            both += 1
            w = {a.learner_id: a.weight for a in rec.accepted}
            raw = {a.learner_id: a.c_tokens**2 / a.c_steps for a in rec.accepted}
            assert w["pair"] / w["solo"] == pytest.approx(raw["pair"] / raw["solo"])
    assert both >= 1, [[(a.learner_id, a.c_tokens) for a in r.accepted] for r in history]
    assert any(a.learner_id == "pair" for r in history for a in r.accepted)
    # The island adopted new global versions (and kept publishing against them).
    log = (tmp_path / "logs" / "pair.log").read_text()
    aligned = re.search(r"exited \(.*\) at step \d+ \((\d+) published, (\d+) aligned\)", log)
    assert aligned is not None and int(aligned.group(2)) >= 1, log[-3000:]
    # The island published against a version it adopted. (Whether such a contribution is also
    # merged depends on timing: the solo learner is faster and K = 1 may close rounds without it.)
    final = RunReader.open(store.url)
    bases = {rec.base_version for p in range(final.config.num_fragments)
             for rec in final.list_contributions(p, range(1, len(history) + 1), ["pair"]).records}
    assert bases and max(bases) >= 1, bases


def _children(pid: int) -> list[int]:
    """Spawned rank processes of ``pid`` (from /proc; Linux)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
            out.append(int(d.name))
    return sorted(out)


@pytest.mark.slow  # ~45 s on 2 quiet cores: two island starts
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the rank processes through /proc")
def test_sigkill_one_rank_fails_the_island_which_is_relaunched_and_merged_again(tmp_path: Path) -> None:
    import signal

    from atoll.train.local import LearnerRestarts

    store = _run(tmp_path, (LearnerSpec(learner_id="solo", batch_size=2),
                            LearnerSpec(learner_id="pair", batch_size=2, ranks=2)), rounds=100_000)
    logs = tmp_path / "logs"
    with LocalRun(store.url, log_dir=logs) as run:
        run.start_learner("solo")
        pair = run.start_learner("pair")
        run.start_synchronizer()
        deadline = time.monotonic() + 120
        while len(ranks := _children(pair.pid)) < 2 or not any(
                a.learner_id == "pair" for r in store.history(max(1, store.latest_round() - 8)) for a in r.accepted):
            assert time.monotonic() < deadline, (logs / "pair.log").read_text()[-3000:]
            time.sleep(0.2)
        merged_before = store.latest_round()
        os.kill(ranks[-1], signal.SIGKILL)  # one rank dies like a lost GPU node
        assert pair.wait(timeout=90) != 0  # ... and the whole island fails with it
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{r}").exists() and "Z" not in Path(f"/proc/{r}/stat").read_text().split()[2]
                  for r in ranks):
            assert time.monotonic() < deadline, "a rank of the failed island is still running"
            time.sleep(0.2)
        restarts = LearnerRestarts(run, log=lambda _: None)
        assert restarts.dead_learners() == ["pair"]  # relaunched as a unit; it rejoins from the bucket
        deadline = time.monotonic() + 150
        while not any(a.learner_id == "pair" for r in store.history(max(merged_before + 1, store.latest_round() - 8))
                      for a in r.accepted):
            assert time.monotonic() < deadline, (logs / "pair.log").read_text()[-3000:]
            assert run.learners["pair"].poll() is None, (logs / "pair.log").read_text()[-3000:]
            time.sleep(0.5)
