"""``atoll status`` shows each learner's speed: tokens/s in its steps, and the MFU and peak device
memory its newest contribution reported (measured on CUDA; '-' on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.runs.goodput import reported_speed
from atoll.runs.report import run_status
from atoll.storage import RunReader, SynchronizerStore
from atoll.storage.paths import to_url
from atoll.train.recipe import smoke_recipe
from atoll.train.run import create_run
from atoll.train.speed import RateMeter
from atoll.train.virtual import run_virtual

pytestmark = pytest.mark.fast


def _status(root: Path) -> list[str]:
    config, recipe = smoke_recipe(2, max_rounds=50)
    url = to_url(str(root / "run"))
    create_run(url, config, recipe.replace(eval_every_rounds=0))
    run_virtual(SynchronizerStore.open(url), token_budget=12 * 2 * 4 * 64)
    lines = run_status(RunReader.open(url, read_only=True))
    head = next(i for i, line in enumerate(lines) if line.startswith("learner "))
    return lines[head:head + 3]


def test_status_shows_tokens_per_s_and_a_dash_for_mfu_and_memory_on_a_cpu(tmp_path: Path) -> None:
    header, *rows = _status(tmp_path)
    assert header.split()[-4:] == ["tokens/s", "MFU", "peak", "mem"]
    for row in rows:
        cells = row.split()
        assert cells[0].startswith("learner-") and cells[-2:] == ["-", "-"]
        assert float(cells[-3].replace(",", "")) > 0  # tokens/s


def test_status_shows_the_mfu_and_peak_memory_a_learner_on_cuda_reports(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RateMeter, "reading", lambda self: (41_230.0, 0.382, 11.4))  # what CUDA measures
    _, *rows = _status(tmp_path)
    assert rows and all(row.split()[-3:] == ["38.2%", "11.4", "GiB"] for row in rows)


def test_reported_speed_keeps_only_plausible_numbers() -> None:
    assert reported_speed({"speed": {"tok_s": 1.0, "mfu": 0.4, "peak_mem_gib": 70.5}}) == (0.4, 70.5)
    assert reported_speed({"speed": {"mfu": 7.0, "peak_mem_gib": -1}}) == (None, None)
    assert reported_speed({"speed": {"mfu": True, "peak_mem_gib": "9"}}) == (None, None)
    assert reported_speed({"speed": [0.4]}) == (None, None) and reported_speed({}) == (None, None)


def test_status_writes_the_same_figures_as_tensorboard_events_that_read_back(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra (atoll[tensorboard]; in atoll[test])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from atoll.cli import main

    monkeypatch.setattr(RateMeter, "reading", lambda self: (41_230.0, 0.382, 11.4))
    _status(tmp_path)
    url, out = to_url(str(tmp_path / "run")), tmp_path / "tb"
    rounds = RunReader.open(url, read_only=True).latest_round()
    for _ in range(2):  # a second export replaces the first: every point once
        assert main(["status", url, "--tensorboard", str(out)]) == 0
    assert "tensorboard:" in capsys.readouterr().out
    events = EventAccumulator(str(out))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"run/tokens_merged", "run/bytes", "run/goodput", "learner/learner-0/tokens_per_s",
            "learner/learner-0/mfu", "learner/learner-0/peak_mem_gib"} <= tags
    merged = events.Scalars("run/tokens_merged")
    assert [e.step for e in merged] == list(range(1, rounds + 1))
    assert all(b.value >= a.value for a, b in zip(merged, merged[1:], strict=False)) and merged[-1].value > 0
    (mfu,) = events.Scalars("learner/learner-0/mfu")
    assert mfu.step == rounds and mfu.value == pytest.approx(0.382)
