"""Lost work by cause on a small real run (real Learners and Synchronizer on a local bucket folder,
virtual clock): ``atoll status`` counts every step as merged or lost by cause, and
``keep_local_progress`` turns the overlap (steps overwritten at adoption) into merged work, which
the status says it kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from atoll.runs.contributions import LOST_CAUSES
from atoll.runs.goodput import GoodputTracker
from atoll.runs.report import run_status
from atoll.storage import RunReader
from atoll.storage.paths import to_url
from atoll.train.recipe import LearnerSpec, smoke_recipe
from atoll.train.run import create_run
from atoll.train.virtual import run_virtual


def _run(tmp_path: Path, keep: bool) -> tuple[list[str], GoodputTracker]:
    config, recipe = smoke_recipe(4, max_rounds=100_000)
    config = config.replace(num_fragments=4, inner_steps=4, overlap_steps=2, keep_local_progress=keep)
    recipe = recipe.replace(learners=tuple(LearnerSpec(learner_id=f"learner-{i}", batch_size=2,
                                                       slowdown=1.5 if i == 3 else 1.0) for i in range(4)))
    store = create_run(to_url(str(tmp_path / f"keep-{keep}")), config, recipe)
    run_virtual(store, token_budget=4 * 2 * 64 * 24, step_noise=0.5, seed=1)
    tracker = GoodputTracker(RunReader.open(store.url, read_only=True))
    return run_status(RunReader.open(store.url, read_only=True), tracker=tracker), tracker


def _shares(lines: list[str]) -> dict[str, float]:
    (line,) = [x for x in lines if x.startswith("lost work: ")]
    got = {c: float(v) / 100 for c, v in re.findall(r"(\w+) (\d+\.\d)%", line.split(";")[0])}
    got["kept"] = float(re.search(r"kept through adoption: (\d+\.\d)%", line).group(1)) / 100  # type: ignore[union-attr]
    return got


def test_status_counts_lost_work_by_cause_and_what_keeping_local_progress_kept(tmp_path: Path) -> None:
    lines, tracker = _run(tmp_path, keep=False)
    report = tracker.report()
    shares = _shares(lines)
    assert set(shares) == {*LOST_CAUSES, "kept"}
    assert report.merged_share is not None and report.kept_s == 0 and shares["kept"] == 0
    # Overwriting drops the tau = 2 steps after each publish of H = 4: overlap is the main loss.
    assert shares["overlap"] > 0.2 and shares["overlap"] == max(shares[c] for c in LOST_CAUSES)
    # Every step run is merged, lost by one cause, or after the newest contribution a round listed.
    accounted = report.merged_share + sum(shares[c] for c in LOST_CAUSES)
    assert 0.9 <= accounted <= 1.0 + 1e-3, (report.merged_share, shares)
    assert any(x.startswith("effective H: ") and "(H = 4," in x for x in lines)

    lines, tracker = _run(tmp_path, keep=True)
    kept_report, kept = tracker.report(), _shares(lines)
    assert kept["overlap"] < 0.05 and kept_report.merged_share is not None
    assert kept_report.merged_share > report.merged_share + 0.2
    # What keeping carried is part of the merged share: about what overwriting lost as overlap.
    assert kept["kept"] == pytest.approx(kept_report.kept_s / kept_report.training_s, abs=1e-3)
    assert 0.1 < kept["kept"] <= kept_report.merged_share
    accounted = kept_report.merged_share + sum(kept[c] for c in LOST_CAUSES)
    assert 0.9 <= accounted <= 1.0 + 1e-3, (kept_report.merged_share, kept)
