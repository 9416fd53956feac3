"""The plain synchronizer loop's round retry (core.retry.ROUND_RETRY): storage trouble in a round is
retried from the bucket's state, a fixed number of times in a row, then raised; a bug is raised at
once. (The Prefect training run has its own copy of this loop, tested with the flows.)"""

from __future__ import annotations

import types
import uuid

import pytest

from atoll.core.retry import ROUND_RETRY
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage.validation import TransientStorageError
from atoll.train import sync_loop as sync_module
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.sync_loop import run_synchronizer
from atoll.train.synchronizer import Synchronizer


@pytest.fixture
def run():
    config, recipe = smoke_recipe(2, max_rounds=2)
    store = create_run(f"memory://atoll-retry-{uuid.uuid4().hex[:8]}/run", config.replace(initial_grace_s=0.0), recipe)
    for i in range(2):
        learner = RecipeLearner(LearnerStore.beside(store), f"learner-{i}", log=lambda _: None)
        learner.step()  # fragment 1
        learner.step()  # fragment 0: both rounds have everything they need
    return store


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The loop's sleeps, recorded instead of slept."""
    out: list[float] = []
    monkeypatch.setattr(sync_module, "time", types.SimpleNamespace(sleep=out.append, monotonic=sync_module.time.monotonic))
    return out


def failing_ticks(monkeypatch: pytest.MonkeyPatch, failures: int, exc: Exception) -> dict[str, int]:
    """Synchronizer.poll (what every step of the loop does first) raises ``exc`` on its first
    ``failures`` calls; counts polls (as "tick") and synchronizers."""
    calls = {"tick": 0, "new": 0}
    real_poll = Synchronizer.poll

    class Counted(Synchronizer):
        def __init__(self, *args, **kwargs) -> None:  # every one loads its state from the bucket
            calls["new"] += 1
            super().__init__(*args, **kwargs)

        def poll(self):
            calls["tick"] += 1
            if calls["tick"] <= failures:
                raise exc
            return real_poll(self)

    monkeypatch.setattr(sync_module, "Synchronizer", Counted)
    return calls


def storage_trouble() -> TransientStorageError:
    return TransientStorageError("get", "memory://x/commits/00000001.json", 5, ConnectionResetError("reset"))


def test_rounds_that_fail_fewer_times_than_the_limit_are_retried_from_the_bucket(run, sleeps, monkeypatch) -> None:
    assert ROUND_RETRY.attempts == 3
    calls = failing_ticks(monkeypatch, ROUND_RETRY.attempts - 1, storage_trouble())
    lines: list[str] = []
    assert run_synchronizer(SynchronizerStore.open(run.url), log=lines.append) == 2
    retries = [line for line in lines if "; retry " in line]
    assert [line.split(": ", 1)[0] for line in retries] == ["synchronizer", "synchronizer"]
    assert retries[0].endswith("retry 1 of 2") and retries[1].endswith("retry 2 of 2")
    assert "get memory://x/commits/00000001.json failed after 5 attempt(s)" in retries[0]
    assert calls["new"] == 1 + 2  # a fresh synchronizer, loaded from the bucket, after each failure
    # Backed off per ROUND_RETRY: retry k waits between half and all of min(max, base * 2**k).
    backoff = [s for s in sleeps if s >= 0.5]
    assert len(backoff) == 2 and 0.5 <= backoff[0] <= 1.0 and 1.0 <= backoff[1] <= 2.0
    assert [r.round for r in RunReader.open(run.url).history()] == [1, 2]


def test_a_round_that_fails_every_attempt_is_raised(run, sleeps, monkeypatch) -> None:
    calls = failing_ticks(monkeypatch, 10**6, storage_trouble())
    with pytest.raises(TransientStorageError, match=r"^get memory://x/commits/00000001\.json failed after 5"):
        run_synchronizer(SynchronizerStore.open(run.url), log=lambda _: None)
    assert calls["tick"] == ROUND_RETRY.attempts
    assert RunReader.open(run.url).latest_round() == 0


def test_a_bug_is_raised_at_once(run, sleeps, monkeypatch) -> None:
    calls = failing_ticks(monkeypatch, 10**6, KeyError("a bug"))
    with pytest.raises(KeyError, match="a bug"):
        run_synchronizer(SynchronizerStore.open(run.url), log=lambda _: None)
    assert calls["tick"] == 1 and sleeps == []
