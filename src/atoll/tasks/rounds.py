"""The tasks a training run runs: await the quorum, merge and commit one outer round (its artifacts
are written off the critical path by the run's :class:`~atoll.tasks.recorder.RoundRecorder`), and watch the
run's learner flow runs (:class:`~atoll.tasks.fleet.LearnerFleet`).

Each task takes the run's :class:`~atoll.tasks.context.RunContext` (owned by the training-run
process; it holds the synchronizer, reloadable from the bucket, and the goodput tracker) plus a
round number or a small record, and returns small records; tensors never cross a task boundary,
and the context is never hashed or persisted (``cache_policy=NO_CACHE``, no result persistence).
If the context's synchronizer is not at the state right before the round (another synchronizer
committed, a round failed half way), it is rebuilt from the latest commit.

Deadlines are atoll's: :func:`await_quorum` polls the bucket on the synchronizer's own clock and
closes by quorum + grace (``atoll.core.quorum``); Prefect timeouts are not used.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from atoll.core.retry import ROUND_RETRY
from atoll.storage.validation import InvalidInput, RoundOrderError, TransientStorageError
from atoll.tasks.context import RunContext
from atoll.tasks.logs import task_logger
from atoll.tasks.round_artifacts import artifact_keys
from atoll.train.synchronizer import RoundPoll, RoundSummary

__all__ = [
    "watch_learners",
    "await_quorum",
    "merge_and_commit",
    "hand_over",
    "landed_rounds",
    "artifact_keys",
    "summary_dict",
    "round_phases",
]


def round_phases(summary: RoundSummary, clock: Any = time.monotonic) -> list[tuple[str, float, float]]:
    """The round's phases as (task name, start, end) in seconds since the epoch, from the times the
    synchronizer noted on ``clock`` (``summary.info["phases"]``): await-quorum (the round opened
    until quorum), grace (quorum until it closed), merge and commit (validation loss is measured
    after the commit, off the round's path: :mod:`atoll.train.evaluator`). Empty for an adopted round."""
    marks = summary.info.get("phases")
    if not isinstance(marks, dict):
        return []
    offset = time.time() - clock()
    opened, quorum, closed = marks["opened_at_s"], marks.get("quorum_at_s"), marks["closed_at_s"]
    quorum = min(max(quorum, opened), closed) if isinstance(quorum, int | float) else None
    out = [("await-quorum", opened, quorum if quorum is not None else closed)]
    if quorum is not None:
        out.append(("grace", quorum, closed))
    out.append(("merge", closed, marks["merged_at_s"]))
    out.append(("commit", marks["merged_at_s"], marks["committed_at_s"]))
    return [(name, t0 + offset, t1 + offset) for name, t0, t1 in out]


def summary_dict(summary: RoundSummary) -> dict[str, Any]:
    r = summary.record
    return {"round": r.round, "fragment": r.fragment, "won": summary.won, "updated": r.updated,
            "accepted": [a.learner_id for a in r.accepted], "rejected": len(r.rejected),
            "val_loss": summary.val_loss, "quorum_s": r.stats.get("quorum_s"), "grace_s": r.stats.get("grace_s"),
            "line": summary.line()}


@task(name="await-quorum", cache_policy=NO_CACHE, persist_result=False)
def await_quorum(ctx: RunContext, round_: int, *, budget_s: float | None = None) -> RoundPoll | RoundSummary:
    """Poll the bucket until round ``round_`` may close (quorum + grace, or every live learner in).

    Returns the closing :class:`RoundPoll`; a RoundSummary if another synchronizer committed the
    round meanwhile; or, after ``budget_s`` without a close, the last (still open) poll, so the
    caller can look after its learners and call again (the round stays open: the clock keeps
    running from the first poll). A poll that fails (storage said no) is retried under
    :data:`~atoll.core.retry.ROUND_RETRY`; once that is used up the error propagates.
    """
    sync = ctx.synchronizer(next_round=round_)
    if sync.round + 1 != round_:
        raise RoundOrderError(f"round {round_} requested but the bucket's next round is {sync.round + 1}")
    start = sync.clock()
    failures = 0
    while True:
        try:
            polled = sync.poll()
        except (RoundOrderError, TransientStorageError, InvalidInput) as e:
            failures += 1
            if ROUND_RETRY.exhausted(failures):
                raise
            task_logger("atoll.rounds").warning(f"round {round_}: {e} ({failures} in a row); retrying")
            time.sleep(ROUND_RETRY.delay_s(failures - 1))
            continue
        failures = 0
        if isinstance(polled, RoundSummary) or polled.decision.close:
            return polled
        now = sync.clock()
        if budget_s is not None and now - start >= budget_s:
            return polled
        wait = (polled.decision.recheck_at_s or 0) - now
        time.sleep(min(max(wait, 0.005), sync.options.poll_interval_s))


@task(name="merge-and-commit", cache_policy=NO_CACHE, persist_result=False)
def merge_and_commit(ctx: RunContext, poll: RoundPoll) -> dict[str, Any]:
    """Load the accepted deltas, merge (token-weighted RDA), take the outer step and commit the
    round create-once; the commit publishes the fragment's next global version (and a
    consolidated checkpoint on the recipe's cadence). Returns the round's small summary."""
    sync = ctx.synchronizer(next_round=poll.round)
    return _landed(ctx, sync.close(poll), sync.clock)


def hand_over(ctx: RunContext, poll: RoundPoll) -> list[dict[str, Any]]:
    """:func:`merge_and_commit` without waiting for the commit (pipelined rounds): merge, and hand
    the round to the synchronizer's commit pipeline, which writes it while the next round polls
    and merges (:meth:`~atoll.train.synchronizer.Synchronizer.hand_over`). Returns the summaries
    of the rounds that landed meanwhile (usually the round before), each told to the evaluator."""
    sync = ctx.synchronizer(next_round=poll.round)
    sync.hand_over(poll)
    return [_landed(ctx, s, sync.clock) for s in sync.landed()]


def landed_rounds(ctx: RunContext, *, drain: bool = False) -> list[dict[str, Any]]:
    """The summaries of handed-over rounds that landed since the last look (``drain``: after
    waiting for every one in flight), each told to the evaluator. A commit that failed raises
    here, after the rounds before it were reported."""
    sync = ctx.synchronizer()
    landed = sync.landed()
    if drain:
        landed += sync.drain()
    return [_landed(ctx, s, sync.clock) for s in landed]


def _landed(ctx: RunContext, summary: RoundSummary, clock: Any) -> dict[str, Any]:
    """A round that landed: the run's evaluator measures it on its own time (if scheduled), its
    line goes to the log; its small summary, with its phases."""
    ctx.committed(summary.record.round)
    task_logger("atoll.rounds").info(summary.line())
    return {**summary_dict(summary), "phases": round_phases(summary, clock)}


@task(name="watch-learners", cache_policy=NO_CACHE, persist_result=False)
def watch_learners(ctx: RunContext) -> list[dict[str, Any]]:
    """Adopt / launch / relaunch the run's learner flow runs; returns what it did per learner."""
    if ctx.fleet is None:
        return []
    sync = ctx.synchronizer()
    store = ctx.store
    liveness = store.learners_liveness(s["learner_id"] for s in ctx.fleet.learners)
    marker = store.stop_marker()
    return [a.as_dict() for a in ctx.fleet.reconcile(liveness=liveness, finished=sync.finished,
                                                     stopped=marker is not None and marker.stopped)]
