"""atoll.storage.io_pool.io_map: object-store calls at once, results in order, errors after all ended;
and a round's reads (list_contributions, load_contributions) give the same answer either way."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from atoll.core.weights import Counters
from atoll.storage import LearnerStore, RunReader
from atoll.storage.io_pool import io_map
from atoll.storage.paths import to_url
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run


def test_calls_run_at_once_and_results_keep_their_order() -> None:
    gate = threading.Barrier(4, timeout=30)  # passes only if 4 calls wait at the same time

    def call(x: int) -> int:
        if x < 4:
            gate.wait()
        return x * x

    assert io_map(call, range(10)) == [x * x for x in range(10)]


def test_the_first_error_is_raised_once_every_call_has_ended() -> None:
    ended: list[int] = []
    lock = threading.Lock()

    def call(x: int) -> int:
        if x == 2:
            raise KeyError("two")
        with lock:
            ended.append(x)
        return x

    with pytest.raises(KeyError, match="two"):
        io_map(call, range(8))
    assert sorted(ended) == [0, 1, 3, 4, 5, 6, 7]


def test_one_thread_means_one_call_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("atoll.storage.io_pool.IO_THREADS", 1)
    seen = []
    assert io_map(lambda x: seen.append(threading.current_thread().name) or x, [1, 2, 3]) == [1, 2, 3]
    assert set(seen) == {threading.current_thread().name}


def test_a_round_s_reads_are_the_same_concurrent_or_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, recipe = smoke_recipe(6, max_rounds=4)
    store = create_run(to_url(str(tmp_path / "run")), config, recipe)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        for steps in (1, 2):
            delta = {n: torch.randn(*s, generator=g) for n, s in store.manifest.fragment_shapes(0).items()}
            LearnerStore.beside(store).publish_contribution(f"learner-{i}", 0, 0, Counters(c_steps=steps, c_tokens=4 * steps), delta)

    def reads(threads: int) -> tuple[list[str], list[tuple[str, list[float]]]]:
        monkeypatch.setattr("atoll.storage.io_pool.IO_THREADS", threads)
        fresh = RunReader.open(store.url)
        listing = fresh.list_contributions(0, [0, 1])
        loaded, rejected = fresh.load_contributions(listing.records)
        assert not listing.rejected and not rejected
        return ([r.key for r in listing.records],
                [(c.key, [float(t.sum()) for t in c.delta.values()]) for c in loaded])

    assert reads(1) == reads(16)
    assert len(reads(16)[0]) == 12


def test_every_learner_s_liveness_in_one_call(tmp_path: Path) -> None:
    config, recipe = smoke_recipe(3, max_rounds=4)
    store = create_run(to_url(str(tmp_path / "run")), config, recipe)
    LearnerStore.beside(store).take_learner_lease("learner-1")
    live = store.learners_liveness(["learner-0", "learner-1", "learner-2", "learner-1"])
    assert list(live) == ["learner-0", "learner-1", "learner-2"]
    assert [v.incarnation for v in live.values()] == [0, 1, 0]
    assert live["learner-1"] == store.learner_liveness("learner-1")
