"""Task logic through ``.fn()``: no Prefect server, no flow run; the run's context built by hand."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from atoll.runs.manage import prepare_run
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage.paths import to_url
from atoll.storage.validation import RoundOrderError, TransientStorageError
from atoll.tasks.context import RunContext
from atoll.tasks.rounds import await_quorum, hand_over, landed_rounds, merge_and_commit
from atoll.train.inner import run_learner
from atoll.train.learner import LearnerOptions
from atoll.train.synchronizer import RoundPoll


def _context(url: str, *, evaluate: bool = True) -> RunContext:
    options = TrainingRunOptions(run_url=url, poll_interval_s=0.05, fleet=FleetOptions(manage=False))
    return RunContext(prepare_run(url), options, evaluate=evaluate)


def test_await_quorum_then_merge_and_commit(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    info = prepare_run(url, preset="smoke", rounds=4)
    assert info.action == "created" and [s["pool"] for s in info.learners] == ["cpu-fast"] * 3
    store = LearnerStore.open(url)
    for lid in ("learner-0", "learner-1"):
        run_learner(store, lid, options=LearnerOptions(max_steps=2), log=lambda s: None)
    ctx = _context(url)
    assert ctx.fleet is None and ctx.next_round == 1
    poll = await_quorum.fn(ctx, 1, budget_s=30.0)
    assert isinstance(poll, RoundPoll) and poll.decision.close and poll.round == 1
    assert {r.learner_id for r in poll.accepted.values()} <= {"learner-0", "learner-1"}
    out = merge_and_commit.fn(ctx, poll)
    assert out["round"] == 1 and out["won"] and out["accepted"]
    assert RunReader.open(url).latest_round() == 1 and ctx.next_round == 2
    with pytest.raises(RoundOrderError):
        await_quorum.fn(ctx, 1, budget_s=1.0)
    # Nothing new for round 2's fragment beyond what was published: a budget returns the open poll.
    polled = await_quorum.fn(ctx, 2, budget_s=0.3)
    assert polled.round == 2


def test_context_reloads_a_synchronizer_that_is_behind(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    prepare_run(url, preset="smoke", rounds=4)
    store = LearnerStore.open(url)
    for lid in ("learner-0", "learner-1"):
        run_learner(store, lid, options=LearnerOptions(max_steps=2), log=lambda s: None)
    behind = _context(url, evaluate=False)
    stale = behind.synchronizer()
    # Another synchronizer (another context: another process) commits round 1.
    ahead = _context(url, evaluate=False)
    merge_and_commit.fn(ahead, await_quorum.fn(ahead, 1, budget_s=30.0))
    assert stale.round == 0
    assert behind.synchronizer() is stale  # no round asked for: the held one
    fresh = behind.synchronizer(next_round=2)  # about to work on round 2: reloaded from the bucket
    assert fresh is not stale and fresh.round == 1 and behind.next_round == 2


def test_context_is_never_json_encoded() -> None:
    from prefect.flows import Flow

    from atoll.flows.round import outer_round

    ctx = object.__new__(RunContext)  # no run needed: only its type matters here
    with pytest.raises(TypeError):
        vars(ctx)
    assert isinstance(outer_round, Flow)
    params = outer_round.serialize_parameters({"ctx": ctx, "round_number": 7, "run_id": "run-x"})
    assert params == {"ctx": "<RunContext>", "round_number": 7, "run_id": "run-x"}


def test_await_quorum_gives_up_after_the_round_retry_policy(tmp_path: Path, monkeypatch) -> None:
    from atoll.core.retry import ROUND_RETRY

    url = to_url(str(tmp_path / "run"))
    prepare_run(url, preset="smoke", rounds=4)
    ctx = _context(url, evaluate=False)
    calls = []

    def failing_poll():
        calls.append(1)
        raise TransientStorageError("list", url, 5, OSError("503"))

    monkeypatch.setattr(ctx.synchronizer(), "poll", failing_poll)
    monkeypatch.setattr("atoll.tasks.rounds.time.sleep", lambda s: None)
    with pytest.raises(TransientStorageError):
        await_quorum.fn(ctx, 1, budget_s=60.0)
    assert len(calls) == ROUND_RETRY.attempts


def test_budget_returns_an_open_round(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    prepare_run(url, preset="smoke", rounds=4)
    polled = await_quorum.fn(_context(url, evaluate=False), 1, budget_s=0.3)
    assert isinstance(polled, RoundPoll) and not polled.decision.close and polled.accepted == {}


def test_prepare_run_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        prepare_run(resume_from=to_url(str(tmp_path / "missing")))
    with pytest.raises(ValueError):
        prepare_run(None)
    with pytest.raises(ValueError, match="unknown preset"):
        prepare_run(to_url(str(tmp_path / "x")), preset="nope")


def test_hand_over_merges_the_next_round_while_a_commit_is_written_and_lands_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined rounds through the tasks: round 1's record is held back; round 2 (the other
    fragment) still polls, merges and is handed over. Released, both land in order, and the
    bucket holds what committing each round before the next one opens writes, bit for bit."""
    url = to_url(str(tmp_path / "run"))
    prepare_run(url, preset="smoke", rounds=4)
    store = LearnerStore.open(url)
    for lid in ("learner-0", "learner-1"):
        run_learner(store, lid, options=LearnerOptions(max_steps=4), log=lambda s: None)
    shutil.copytree(tmp_path / "run", tmp_path / "sequential")
    sequential = _context(to_url(str(tmp_path / "sequential")), evaluate=False)
    for r in (1, 2):
        merge_and_commit.fn(sequential, await_quorum.fn(sequential, r, budget_s=30.0))

    release, created = threading.Event(), []
    original = SynchronizerStore._create_commit

    def held(self: SynchronizerStore, record: Any, void: bool) -> Any:
        if record.round == 1:
            assert release.wait(60), "round 1's record was never released"
        created.append(record.round)
        return original(self, record, void)

    monkeypatch.setattr(SynchronizerStore, "_create_commit", held)
    ctx = _context(url, evaluate=False)
    told: list[Any] = []
    ctx.on_landed = told.append  # the recorder's hook: told on the pipeline's thread as each round lands
    assert hand_over(ctx, await_quorum.fn(ctx, 1, budget_s=30.0)) == []
    assert ctx.next_round == 2 and ctx.synchronizer().in_flight()
    assert hand_over(ctx, await_quorum.fn(ctx, 2, budget_s=30.0)) == []  # merged while round 1 is written
    assert RunReader.open(url).latest_round() == 0 and created == [] and told == []
    release.set()
    landed = landed_rounds(ctx, drain=True)
    assert [s.record.round for s in told] == [1, 2]
    assert all(s.won and s.info["phases"]["committed_at_s"] >= s.info["phases"]["merged_at_s"] for s in told)
    assert [s["round"] for s in landed] == [1, 2] and all(s["won"] for s in landed) and created == [1, 2]
    assert [name for name, _, _ in landed[0]["phases"]][-1] == "commit"
    reader, expected = RunReader.open(url), RunReader.open(to_url(str(tmp_path / "sequential")))
    assert reader.verify().ok
    for r in (1, 2):
        assert reader.read_commit(r).accepted == expected.read_commit(r).accepted  # type: ignore[union-attr]
    got, want = reader.read_global_state(2), expected.read_global_state(2)
    assert got.versions == want.versions
    assert all(torch.equal(got.params[n], want.params[n]) for n in want.params)
    ctx.release()
    sequential.release()
