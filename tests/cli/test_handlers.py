"""The orchestration subcommands (train, resume, deploy, up, learner, demo) pass their flags through
to the library call they wrap, and return its status. Each test replaces that call where the
handler looks it up (the handlers import it at call time), so nothing is launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atoll.cli import main
from atoll.runs.options import TrainingRunOptions
from atoll.storage.paths import to_url
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run


class Recorder:
    """A stand-in for the wrapped call: records each call and returns ``rc``."""

    def __init__(self, rc: Any = 0) -> None:
        self.rc = rc
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.rc


def _must_not_launch(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("launch_training was called")


@pytest.fixture
def source_run(tmp_path: Path) -> str:
    url = to_url(str(tmp_path / "src-run"))
    create_run(url, *smoke_recipe(2, max_rounds=4))
    return url


def test_resume_fork_round_0_forks_the_latest_round(source_run: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Recorder(rc=0)
    monkeypatch.setattr("atoll.ops.client.launch_training", launch)
    dst = to_url(str(tmp_path / "forked"))
    assert main(["resume", source_run, "--fork-round", "0", "--to", dst]) == 0
    [(args, kwargs)] = launch.calls
    options = args[0]
    assert isinstance(options, TrainingRunOptions)
    assert options.fork_round == 0  # 0 is "the latest round", not "no fork"
    assert options.resume_from == source_run
    assert options.run_url == dst and options.target_url == dst
    assert kwargs == {"in_process": False, "wait": True}


def test_resume_without_fork_continues_the_run(source_run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Recorder(rc=1)
    monkeypatch.setattr("atoll.ops.client.launch_training", launch)
    assert main(["resume", source_run, "--rounds", "6", "--in-process", "--no-wait"]) == 1
    [(args, kwargs)] = launch.calls
    options = args[0]
    assert options.resume_from == source_run and options.fork_round is None and options.run_url is None
    assert options.target_url == source_run and options.rounds == 6
    assert kwargs == {"in_process": True, "wait": False}


@pytest.mark.parametrize("fork_round", ["0", "3"])
def test_resume_fork_round_without_to_is_a_one_line_error(source_run: str, fork_round: str,
                                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr("atoll.ops.client.launch_training", _must_not_launch)
    assert main(["resume", source_run, "--fork-round", fork_round]) == 2
    err = capsys.readouterr().err
    assert err.startswith("atoll: error: ") and err.count("\n") == 1
    assert "--to" in err and "--fork-round" in err


def test_resume_of_a_missing_run_launches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr("atoll.ops.client.launch_training", _must_not_launch)
    missing = to_url(str(tmp_path / "nothing-here"))
    assert main(["resume", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("atoll: error: no run at") and err.count("\n") == 1


def test_train_passes_its_flags_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Recorder(rc=0)
    monkeypatch.setattr("atoll.ops.client.launch_training", launch)
    rc = main(["train", "--preset", "smoke", "--bucket", str(tmp_path / "bucket"), "--name", "r1",
               "--learners", "3", "--rounds", "7", "--config", "cfg.yaml", "--storage-option", "anon=true",
               "--no-wait"])
    assert rc == 0
    [(args, kwargs)] = launch.calls
    options = args[0]
    assert options.record_rounds  # the default: rounds keep up with the learners
    assert options.run_url == to_url(str(tmp_path / "bucket" / "r1"))
    assert (options.preset, options.learners, options.rounds, options.config_path) == ("smoke", 3, 7, "cfg.yaml")
    assert options.storage_options == {"anon": "true"} and options.resume_from is None
    assert kwargs == {"in_process": False, "wait": False}


def test_train_no_record_rounds_executes_each_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Recorder(rc=0)
    monkeypatch.setattr("atoll.ops.client.launch_training", launch)
    assert main(["train", "--bucket", str(tmp_path / "bucket"), "--no-wait", "--no-record-rounds"]) == 0
    [(args, _)] = launch.calls
    assert args[0].record_rounds is False


def test_train_returns_the_launch_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("atoll.ops.client.launch_training", Recorder(rc=1))
    assert main(["train", "--bucket", str(tmp_path)]) == 1


def test_train_rejects_a_storage_option_without_equals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys) -> None:
    monkeypatch.setattr("atoll.ops.client.launch_training", _must_not_launch)
    assert main(["train", "--bucket", str(tmp_path), "--storage-option", "anon"]) == 2
    assert "expected KEY=VALUE, got 'anon'" in capsys.readouterr().err


def test_deploy_passes_pools_control_pool_and_env(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    ensure = Recorder(rc=["p1"])
    deploy = Recorder(rc={"atoll-learner/p1": "id-1", "atoll-training-run/default": "id-2"})
    monkeypatch.setattr("atoll.ops.deploy.ensure_pools", ensure)
    monkeypatch.setattr("atoll.ops.deploy.deploy_all", deploy)
    rc = main(["deploy", "--pools", "p1", "p2", "--control-pool", "p2", "--create-pools",
               "--env", "A=1", "--env", "B=x=y"])
    assert rc == 0
    assert ensure.calls == [((["p1", "p2"],), {})]
    assert deploy.calls == [((["p1", "p2"],), {"control_pool": "p2", "env": {"A": "1", "B": "x=y"}})]
    out = capsys.readouterr().out
    assert "deployed atoll-learner/p1 (id-1)" in out and "deployed atoll-training-run/default (id-2)" in out


def test_deploy_creates_no_pools_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("atoll.ops.deploy.ensure_pools", _must_not_launch)
    deploy = Recorder(rc={})
    monkeypatch.setattr("atoll.ops.deploy.deploy_all", deploy)
    assert main(["deploy"]) == 0
    assert deploy.calls == [((["cpu-fast", "cpu-slow"],), {"control_pool": None, "env": {}})]


def test_up_passes_its_flags_and_returns_the_stack_status(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = Recorder(rc=130)
    monkeypatch.setattr("atoll.ops.stack.run_stack_forever", stack)
    assert main(["up", "--port", "4300", "--pools", "a", "b", "c", "--home", "/tmp/h", "--no-deploy"]) == 130
    assert stack.calls == [((), {"port": 4300, "pools": ["a", "b", "c"], "home": "/tmp/h", "deploy": False,
                                 "database": "sqlite", "database_url": None})]


def test_up_passes_the_database_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = Recorder(rc=0)
    monkeypatch.setattr("atoll.ops.stack.run_stack_forever", stack)
    assert main(["up", "--database", "postgres"]) == 0
    assert main(["up", "--database-url", "postgresql+asyncpg://u:p@db:5432/prefect"]) == 0
    assert [c[1]["database"] for c in stack.calls] == ["postgres", "sqlite"]
    assert [c[1]["database_url"] for c in stack.calls] == [None, "postgresql+asyncpg://u:p@db:5432/prefect"]


def test_learner_runs_the_learner_flow_here(monkeypatch: pytest.MonkeyPatch) -> None:
    flow = Recorder(rc=None)
    monkeypatch.setattr("atoll.flows.learner.learner_flow", flow)
    assert main(["learner", "file:///b/run-1", "--learner-id", "l3", "--threads", "2",
                 "--storage-option", "k=v"]) == 0
    assert flow.calls == [(("file:///b/run-1", "l3"), {"storage_options": {"k": "v"}, "threads": 2,
                                                      "device": None, "autocast": None})]
    assert main(["learner", "file:///b/run-1", "--learner-id", "l3", "--device", "cuda:1", "--autocast", "bf16"]) == 0
    assert flow.calls[-1][1]["device"] == "cuda:1" and flow.calls[-1][1]["autocast"] == "bf16"


def test_demo_passes_its_flags_and_returns_the_demo_status(monkeypatch: pytest.MonkeyPatch) -> None:
    demo = Recorder(rc=1)
    monkeypatch.setattr("atoll.ops.client.run_demo", demo)
    assert main(["demo", "--dir", "d", "--learners", "2", "--rounds", "5", "--port", "4400", "--keep-up"]) == 1
    assert demo.calls == [(("d",), {"learners": 2, "rounds": 5, "port": 4400, "keep_up": True})]
