"""Exact rejoin: a restarted learner continues from its saved inner state, bit for bit.

What a learner saves for rejoin (AdamW moments and step counts, its own step counter, its data
cursor) must come back exactly, and its data must continue at the saved cursor: no window
skipped, none repeated beyond the steps it ran after its last save. One test restores in the same
process (so the live state can be compared with the restored one directly); the other SIGKILLs a
real learner process and restarts it from what the bucket holds.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from atoll.storage import LearnerStore
from atoll.storage.paths import to_url
from atoll.train.data import BatchStream
from atoll.train.inner import RecipeLearner
from atoll.train.local import LocalRun
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run

LID = "learner-1"


def quiet(_: str) -> None:
    pass


def adamw_state(learner: RecipeLearner) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: torch.as_tensor(v).clone() for k, v in learner.opt.state[p].items()}
            for name, p in learner.params.items() if learner.opt.state.get(p)}


def assert_equal_states(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


def record_batches(learner: RecipeLearner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches ``learner`` trains on from now on (its stream's public next_batch, observed)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = learner.stream.next_batch

    def next_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(real(batch_size))
        return seen[-1]

    learner.stream.next_batch = next_batch  # type: ignore[method-assign]
    return seen


def windows_served(cursor: dict) -> int:
    return cursor["epoch"] * cursor["num_windows"] + cursor["position"]


def test_restored_inner_state_equals_the_saved_one_and_data_continues_at_the_cursor() -> None:
    config, recipe = smoke_recipe(2, max_rounds=1000)
    store = create_run(f"memory://atoll-rejoin-{uuid.uuid4().hex[:8]}/run", config, recipe)
    first = RecipeLearner(LearnerStore.beside(store), LID, log=quiet)
    batch = first.spec.batch_size
    fresh = first.stream.state_dict()
    for _ in range(7):
        first.step()
    first.save()
    saved_adamw, saved_cursor = adamw_state(first), first.stream.state_dict()
    assert windows_served(saved_cursor) == 7 * batch  # the cursor counts exactly the windows trained on

    again = RecipeLearner(LearnerStore.open(store.url), LID, log=quiet)  # the restart
    assert again.summary.resumed_inner_state
    assert again.step_count == 7 and again.tokens_total == first.tokens_total
    assert again.stream.state_dict() == saved_cursor
    assert_equal_states(adamw_state(again), saved_adamw)
    assert all(float(s["step"]) == 7 for s in saved_adamw.values())

    # Both go on: the restarted learner trains on exactly the batches the first one would have.
    ahead, behind = record_batches(first), record_batches(again)
    for _ in range(3):
        first.step()
        again.step()
    for (xa, ya), (xb, yb) in zip(ahead, behind, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert again.stream.state_dict() == first.stream.state_dict()
    assert all(float(s["step"]) == 10 for s in adamw_state(again).values())
    # ... which are the next windows of the learner's order after the saved ones: none skipped.
    reference = BatchStream(recipe.data.corpus().train, context_tokens=again.stream.context_tokens,
                            learner_index=again.index, num_learners=config.num_learners, seed=recipe.data.seed)
    order = reference.window_indices(fresh, 10 * batch)
    assert reference.window_indices(saved_cursor, 3 * batch) == order[7 * batch:]


def test_sigkilled_learner_process_restarts_from_exactly_what_it_saved(tmp_path: Path) -> None:
    config, recipe = smoke_recipe(2, max_rounds=100_000)
    url = to_url(str(tmp_path / "run"))
    store = create_run(url, config, recipe)
    every = recipe.save_every_steps
    with LocalRun(url, log_dir=tmp_path / "logs") as run:
        proc = run.start_learner(LID)
        deadline = time.monotonic() + 120
        while (saved := store.load_learner_state(LID)) is None or saved.meta["step"] < 2 * every:
            assert proc.poll() is None, (tmp_path / "logs" / f"{LID}.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the learner never saved twice"
            time.sleep(0.05)
        run.kill(proc)  # SIGKILL: no cleanup, no final save
        assert proc.returncode == -9
    saved = store.load_learner_state(LID)
    assert saved is not None
    step, cursor, tokens = saved.meta["step"], saved.meta["cursor"], saved.meta["tokens"]
    batch = recipe.learners[1].batch_size
    assert step % every == 0 and step >= 2 * every  # periodic saves only: the kill left no torn state
    assert windows_served(cursor) == step * batch  # nothing skipped or repeated up to the save
    assert tokens == step * batch * cursor["context_tokens"]

    again = RecipeLearner(LearnerStore.open(url), LID, log=quiet)
    assert again.summary.resumed_inner_state
    assert again.step_count == step and again.tokens_total == tokens
    assert again.stream.state_dict() == cursor
    restored = adamw_state(again)
    assert restored and all(float(s["step"]) == step for s in restored.values())
    # Restored then saved again unchanged: every saved tensor came back exactly.
    again.save()
    resaved = store.load_learner_state(LID)
    assert resaved is not None and resaved.meta == saved.meta
    assert resaved.tensors.keys() == saved.tensors.keys()
    for k, t in saved.tensors.items():
        assert torch.equal(resaved.tensors[k], t), k
    # Its next batch is the one at the saved cursor.
    (x, y), after = again.stream.batch_at(cursor, batch)
    seen = record_batches(again)
    again.step()
    assert torch.equal(seen[0][0], x) and torch.equal(seen[0][1], y)
    assert again.stream.state_dict() == after and again.step_count == step + 1
