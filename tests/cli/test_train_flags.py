"""`atoll train` and `atoll resume` reach every TrainingRunOptions field: each field that is not
"which run" has a flag generated from the model, whose default is the field's default, and a
given flag lands on its field (nested fleet options included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atoll.cli import build_parser, main
from atoll.cli.training import WHICH_RUN_FLAGS, training_flags, training_options
from atoll.runs.options import FleetOptions, TrainingRunOptions
from atoll.storage.paths import to_url


def _fields(model: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for name, info in model.model_fields.items():
        if info.annotation is FleetOptions:
            out |= _fields(FleetOptions, (*prefix, name))
        else:
            out.add((*prefix, name))
    return out


def _subparser(command: str) -> Any:
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    return sub.choices[command]


def _flags_of(command: str) -> set[str]:
    return {s for a in _subparser(command)._actions for s in (*a.option_strings, a.dest)}


def test_every_field_has_a_flag() -> None:
    generated = {f.path for f in training_flags()}
    written = {(name,) for flags in WHICH_RUN_FLAGS.values() for name in flags}
    assert generated | written == _fields(TrainingRunOptions)
    assert not generated & written
    for f in training_flags():  # on `train`: every generated flag; on `resume`: all but the new run's recipe
        assert f.flag in _flags_of("train"), f.flag
        assert f.flag in _flags_of("resume") or f.path[0] in ("preset", "learners", "config_path"), f.flag
    for command, fields in WHICH_RUN_FLAGS.items():
        for flags in fields.values():
            assert set(flags) <= _flags_of(command), (command, flags)
    for flag in ("--segment-rounds", "--merge-device", "--fleet-threads", "--fleet-heartbeat-timeout-s",
                 "--no-fleet-manage", "--fleet-deployments", "--record-rounds", "--no-record-rounds", "--config"):
        assert flag in _flags_of("train")


def test_every_flag_defaults_to_its_field() -> None:
    defaults = TrainingRunOptions().model_dump()
    train = _subparser("train")
    for f in training_flags():
        expected: Any = defaults
        for part in f.path:
            expected = expected[part]
        assert f.value(train.get_default(f.dest)) == expected, f.flag
        assert f.default == expected, f.flag


def test_no_flag_given_is_the_models_defaults(tmp_path: Path) -> None:
    bucket = str(tmp_path / "b")
    args = build_parser().parse_args(["train", "--bucket", bucket])
    options = training_options(args, run_url="file:///x/run")
    assert options == TrainingRunOptions(run_url="file:///x/run")
    args = build_parser().parse_args(["resume", "file:///x/run"])
    options = training_options(args, resume_from="file:///x/run")
    assert options == TrainingRunOptions(resume_from="file:///x/run")


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> int:
        self.calls.append((args, kwargs))
        return 0


def test_generated_flags_reach_their_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Recorder()
    monkeypatch.setattr("atoll.ops.client.launch_training", launch)
    assert main(["train", "--bucket", str(tmp_path / "bucket"), "--name", "r2", "--no-wait",
                 "--segment-rounds", "7", "--merge-device", "auto", "--poll-interval-s", "0.05", "--nest-rounds",
                 "--no-fleet-manage", "--fleet-threads", "3", "--fleet-heartbeat-timeout-s", "45",
                 "--fleet-deployments", "cpu-fast=atoll-learner/a", "--fleet-deployments", "gpu=my-flow/b",
                 "--fleet-orphan-timeout-s", "120", "--fleet-max-launches", "9"]) == 0
    [(args, _)] = launch.calls
    options: TrainingRunOptions = args[0]
    assert options.run_url == to_url(str(tmp_path / "bucket" / "r2"))
    assert (options.segment_rounds, options.merge_device, options.poll_interval_s) == (7, "auto", 0.05)
    assert options.nest_rounds and options.record_rounds
    assert options.fleet == FleetOptions(manage=False, threads=3, heartbeat_timeout_s=45.0, orphan_timeout_s=120.0,
                                         max_launches=9,
                                         deployments={"cpu-fast": "atoll-learner/a", "gpu": "my-flow/b"})


def test_an_out_of_range_value_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("atoll.ops.client.launch_training", Recorder())
    assert main(["train", "--bucket", str(tmp_path), "--fleet-threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("atoll: error: ") and err.count("\n") == 1 and "threads" in err
