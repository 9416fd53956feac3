"""Task logic through ``.fn()``: no Prefect server, no flow run."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.storage.validation import RoundOrderError
from atoll.tasks.rounds import await_quorum, forget_run, merge_and_commit
from atoll.tasks.runs import open_run, prepare_run
from atoll.train.learner import LearnerOptions, run_learner
from atoll.storage.paths import to_url
from atoll.train.synchronizer import RoundPoll

pytestmark = pytest.mark.timeout(180)


def test_await_quorum_then_merge_and_commit(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    info = prepare_run(url, preset="smoke", rounds=4)
    assert info.action == "created" and [s["pool"] for s in info.learners] == ["cpu-fast"] * 3
    store = open_run(url)
    for lid in ("learner-0", "learner-1"):
        run_learner(store, lid, options=LearnerOptions(max_steps=2), log=lambda s: None)
    forget_run(url)
    poll = await_quorum.fn(url, 1, budget_s=30.0, poll_interval_s=0.05)
    assert isinstance(poll, RoundPoll) and poll.decision.close and poll.round == 1
    assert {r.learner_id for r in poll.accepted.values()} <= {"learner-0", "learner-1"}
    out = merge_and_commit.fn(url, poll)
    assert out["round"] == 1 and out["won"] and out["accepted"]
    assert open_run(url).latest_round() == 1
    with pytest.raises(RoundOrderError):
        await_quorum.fn(url, 1, budget_s=1.0)
    # Nothing new for round 2's fragment beyond what was published: a budget returns the open poll.
    forget_run(url)
    polled = await_quorum.fn(url, 2, budget_s=0.3, poll_interval_s=0.05)
    assert polled.round == 2


def test_budget_returns_an_open_round(tmp_path: Path) -> None:
    url = to_url(str(tmp_path / "run"))
    prepare_run(url, preset="smoke", rounds=4)
    forget_run(url)
    polled = await_quorum.fn(url, 1, budget_s=0.3, poll_interval_s=0.05)
    assert isinstance(polled, RoundPoll) and not polled.decision.close and polled.accepted == {}


def test_prepare_run_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        prepare_run(resume_from=to_url(str(tmp_path / "missing")))
    with pytest.raises(ValueError):
        prepare_run(None)
    with pytest.raises(ValueError, match="unknown preset"):
        prepare_run(to_url(str(tmp_path / "x")), preset="nope")
