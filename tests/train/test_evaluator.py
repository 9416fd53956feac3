"""Evaluation off the round's critical path: rounds commit while the evaluator is busy, an
evaluator that fell behind skips to the newest round, the run's end waits for its last round, and
the loss lands in ``sync/evals/<round>.json`` where ``atoll status`` and the plots read it."""

from __future__ import annotations

import math
import threading
import uuid

import pytest

from atoll.runs.goodput import GoodputTracker
from atoll.runs.losses import last_val_loss
from atoll.runs.report import run_status
from atoll.storage import LearnerStore, RunReader, SynchronizerStore
from atoll.storage import paths as P
from atoll.storage.codec import dump_record
from atoll.storage.records import KIND_EVAL, EvalRecord
from atoll.train.evaluator import Evaluator, EvaluatorOptions
from atoll.train.inner import RecipeLearner
from atoll.train.recipe import smoke_recipe
from atoll.train.run import EVAL_BATCH_SIZE, RoundSchedule, create_run
from atoll.train.sync_loop import run_synchronizer
from atoll.train.synchronizer import RoundSummary, SynchronizerOptions


def new_run(*, max_rounds: int, eval_every_rounds: int) -> tuple[str, list[RecipeLearner]]:
    url = f"memory://atoll-eval-{uuid.uuid4().hex[:8]}/run"
    config, recipe = smoke_recipe(2, max_rounds=max_rounds)
    recipe = recipe.replace(eval_every_rounds=eval_every_rounds)
    store = LearnerStore.beside(create_run(url, config.replace(initial_grace_s=0.0), recipe))
    return url, [RecipeLearner(store, s.learner_id, log=lambda _: None) for s in recipe.learners]


def feeder(url: str, learners: list[RecipeLearner]):
    """A ``should_stop`` that steps every learner once per poll (it publishes on its schedule) and
    adopts what was committed, as its fetcher would: the learners live in the test's thread."""
    reader = RunReader.open(url)

    def step() -> bool:
        for lr in learners:
            for rec in reader.history(max(lr.versions) + 1, reader.latest_round()):
                lr.adopt(rec.round, rec.fragment, reader.read_global_fragment(rec.fragment, rec.round))
            lr.step()
        return False
    return step


def test_newest_evaluated_is_the_newest_scheduled_round_and_counts_the_skipped() -> None:
    every4 = RoundSchedule(max_rounds=10, eval_every_rounds=4)
    assert every4.newest_evaluated(0, 3) == (None, 0)
    assert every4.newest_evaluated(0, 4) == (4, 0)
    assert every4.newest_evaluated(0, 9) == (8, 1)  # round 4 skipped
    assert every4.newest_evaluated(8, 10) == (10, 0)  # the last round is always evaluated
    assert every4.newest_evaluated(0, 10) == (10, 2)
    assert every4.newest_evaluated(10, 10) == (None, 0)
    assert RoundSchedule(max_rounds=8, eval_every_rounds=4).newest_evaluated(0, 8) == (8, 1)
    assert RoundSchedule(max_rounds=5).newest_evaluated(0, 5) == (5, 0)
    assert RoundSchedule(max_rounds=5, evaluate=False).newest_evaluated(0, 5) == (None, 0)
    assert RoundSchedule(eval_every_rounds=1).newest_evaluated(3, 7) == (7, 3)


def test_rounds_commit_while_the_evaluator_is_busy_and_the_end_waits_for_the_last_round() -> None:
    url, learners = new_run(max_rounds=6, eval_every_rounds=1)
    busy, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow(params) -> float:  # an evaluation that lasts until the test says so
        calls.append(len(params))
        busy.set()
        assert release.wait(120)
        return 2.5

    lines: list[str] = []
    sync_store = SynchronizerStore.open(url)
    evaluator = Evaluator(sync_store, evaluate=slow, tokens=1024, log=lines.append,
                          options=EvaluatorOptions(poll_interval_s=0.05))
    reader = RunReader.open(url)
    while_busy: list[int] = []

    def on_round(summary: RoundSummary) -> None:
        r = summary.record.round
        if r == 1:
            assert busy.wait(60)  # from here on the evaluator is inside round 1's evaluation
        elif not release.is_set():
            assert reader.read_eval(1) is None  # round 1's evaluation has not ended
            while_busy.append(r)
        if r == 5:
            release.set()

    last = run_synchronizer(sync_store, evaluator=evaluator, on_round=on_round, should_stop=feeder(url, learners),
                            log=lambda _: None, options=SynchronizerOptions(poll_interval_s=0.01))
    assert last == 6
    assert while_busy == [2, 3, 4, 5]  # four rounds committed while one evaluation ran
    evals = reader.read_evals(reader.eval_rounds())
    # Round 1, then straight to the newest committed round (5 or 6), and the run's end waited for 6.
    assert 1 in evals and 6 in evals and set(evals) <= {1, 5, 6}, (sorted(evals), lines)
    assert evaluator.skipped >= 3 and any("skipped to catch up" in line for line in lines), lines
    rec = evals[6]
    assert (rec.round, rec.val_loss, rec.tokens, rec.by) == (6, 2.5, 1024, "synchronizer")
    assert len(calls) == len(evals) and calls[0] == len(reader.read_global_state(0).params)
    assert not evaluator.busy and "val_loss" not in reader.read_commit(6).stats  # commits never wait for it


def test_the_eval_record_is_create_once_tagged_and_read_by_status_with_the_commit_stats_as_fallback() -> None:
    url, _ = new_run(max_rounds=4, eval_every_rounds=2)
    sync = SynchronizerStore.open(url)
    for r in (1, 2, 3):  # rounds with nothing to merge; round 1 carries a loss in its stats, as older runs did
        sync.commit_round(r, (r - 1) % 2, params=None, stats={"val_loss": 4.0} if r == 1 else {})
    with pytest.raises(Exception, match="not committed"):
        sync.write_eval(EvalRecord(round=4, val_loss=1.0, tokens=1, eval_s=0.1, device="cpu", evaluated_at=0.0))
    record = EvalRecord(round=2, val_loss=3.25, tokens=2048, eval_s=0.5, device="cpu", evaluated_at=1.0, by="ev")
    assert sync.write_eval(record) and not sync.write_eval(record)  # create-once
    # A record under another round's key, and a name that is no round, are skipped, never raised.
    sync.store.put(P.eval_key(3), dump_record(KIND_EVAL, {**record.to_dict(), "round": 2}))
    sync.store.put(P.evals_prefix() + "notes.json", b"{}")
    reader = RunReader.open(url)
    assert reader.eval_rounds() == [2, 3] and reader.read_eval(2) == record and reader.read_eval(3) is None
    assert last_val_loss(reader, reader.history()) == 3.25
    tracker = GoodputTracker(reader)
    lines = run_status(reader, tracker=tracker)
    assert "latest validation loss: 3.2500 (round 2)" in lines
    rows = {int(line.split()[0]): line for line in lines if line.strip()[:1].isdigit()}
    assert "3.2500" in rows[2] and "4.0000" in rows[1] and "3.2500" not in rows[3]
    assert [(p.round, p.val_loss) for p in tracker.series] == [(1, 4.0), (2, 3.25), (3, None)]


def test_the_recipe_evaluator_measures_the_last_round_with_a_stated_cost() -> None:
    url, _ = new_run(max_rounds=1, eval_every_rounds=0)
    sync = SynchronizerStore.open(url)
    sync.commit_round(1, 0, params=None)
    lines: list[str] = []
    evaluator = Evaluator(sync, options=EvaluatorOptions(device="cpu"), log=lines.append).start()
    evaluator.close(final_round=1)
    rec = RunReader.open(url).read_eval(1)
    assert rec is not None and rec.device == "cpu", lines
    _, recipe = smoke_recipe(2)
    context = 64  # the micro model's
    assert rec.tokens == recipe.eval_batches * EVAL_BATCH_SIZE * context
    assert abs(rec.val_loss - math.log(256)) < 0.5  # untrained: about uniform over 256 bytes
    assert any(f"{rec.tokens:,} tokens per evaluation" in line for line in lines)
    assert any(line.startswith("evaluator: round 1 val_loss=") and "tokens on cpu" in line for line in lines)


def test_the_synchronizer_offers_its_state_and_the_evaluator_reads_no_master_from_the_bucket() -> None:
    # Masters by replay (M = 4): read from the bucket, an evaluated round's masters would be
    # rebuilt; offered by the synchronizer of the process, they are only hashed against the record.
    url = f"memory://atoll-eval-{uuid.uuid4().hex[:8]}/run"
    config, recipe = smoke_recipe(2, max_rounds=10)
    config = config.replace(initial_grace_s=0.0, downlink_compression="int4", master_snapshot_every=4)
    store = LearnerStore.beside(create_run(url, config, recipe.replace(eval_every_rounds=2)))
    learners = [RecipeLearner(store, s.learner_id, log=lambda _: None) for s in recipe.learners]
    evaluated: list[dict] = []
    sync_store = SynchronizerStore.open(url)
    evaluator = Evaluator(sync_store, evaluate=lambda params: evaluated.append(dict(params)) or 2.0, tokens=1,
                          options=EvaluatorOptions(poll_interval_s=0.05))
    from_bucket: list[int] = []
    read = evaluator.store.read_global_state
    evaluator.store.read_global_state = lambda r, **kw: from_bucket.append(r) or read(r, **kw)  # type: ignore[method-assign]
    assert run_synchronizer(sync_store, evaluator=evaluator, should_stop=feeder(url, learners), log=lambda _: None,
                            options=SynchronizerOptions(poll_interval_s=0.01)) == 10
    reader = RunReader.open(url)
    rounds = sorted(reader.read_evals(reader.eval_rounds()))
    assert 10 in rounds and len(evaluated) == len(rounds)
    assert any(st.master_depth > 1 for r in rounds for st in reader.read_commit(r).state)  # masters not held
    for r, params in zip(rounds, evaluated, strict=True):  # each one the round's committed state, bit for bit
        expected = reader.read_global_state(r, momentum=False).params
        assert params.keys() == expected.keys() and all(params[n].equal(expected[n]) for n in params)
    assert from_bucket == [], from_bucket
    # A copy that is not what the record names (another synchronizer won the round) is not used.
    evaluator.offer(10, lambda: {n: t + 1 for n, t in reader.read_global_state(10).params.items()})
    assert evaluator._offered_state(10) is None
    evaluator.offer(9, lambda: reader.read_global_state(9).params)  # not a scheduled round: not kept
    assert evaluator._offered is None
