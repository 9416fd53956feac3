"""The tasks of one outer round: await the quorum, merge and commit, record.

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
from uuid import UUID

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from atoll.core.retry import ROUND_RETRY
from atoll.runs.report import contribution_rows, round_markdown, slug
from atoll.storage.records import CommitRecord
from atoll.storage.validation import InvalidInput, RoundOrderError, TransientStorageError
from atoll.tasks.context import RunContext
from atoll.tasks.logs import task_logger
from atoll.train.synchronizer import RoundPoll, RoundSummary

__all__ = [
    "await_quorum",
    "merge_and_commit",
    "record_round",
    "artifact_keys",
    "summary_dict",
]



def artifact_keys(run_id: str) -> dict[str, str]:
    """Artifact keys of a run (lowercase and dashes, as Prefect requires); each round adds a version."""
    s = slug(run_id)
    return {"summary": f"{s}-round-summary", "contributions": f"{s}-contributions", "goodput": f"{s}-goodput",
            "run": f"{s}-run-summary"}


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
    summary = ctx.synchronizer(next_round=poll.round).close(poll)
    task_logger("atoll.rounds").info(summary.line())
    return summary_dict(summary)


@task(name="record-round", cache_policy=NO_CACHE, persist_result=False)
def record_round(ctx: RunContext, round_: int) -> dict[str, Any]:
    """Write the round's artifacts from its commit record: a markdown summary, the contributions
    table (learner, pool, tokens, steps, weight, accepted or why not) and the goodput so far
    (from the bucket); move the run's progress artifact. Returns the goodput numbers."""
    store = ctx.store
    record: CommitRecord | None = store.read_commit(round_)
    if record is None:
        raise RoundOrderError(f"round {round_} is not committed in {store.url}")
    max_rounds, run_id = ctx.info.max_rounds, ctx.run_id
    keys = artifact_keys(run_id)
    tracker = ctx.tracker
    goodput = tracker.update()
    rows = contribution_rows(store, record, tracker.cache)
    create_markdown_artifact(
        markdown=round_markdown(record, rows, run_id=run_id, run_url=store.url, max_rounds=max_rounds, goodput=goodput),
        key=keys["summary"], description=f"round {round_} of run {run_id}",
    )
    create_table_artifact(table=[r.as_dict() for r in rows], key=keys["contributions"],
                          description=f"contributions to round {round_} (fragment {record.fragment}) of run {run_id}")
    gp = goodput.goodput
    create_markdown_artifact(
        markdown=(f"# Goodput of run `{run_id}` after round {round_}\n\n{goodput.line()}\n\n"
                  "| learner | goodput |\n|---|---|\n"
                  + "".join(f"| {lid} | {100 * g:.1f}% |\n" for lid, g in sorted(goodput.per_learner.items()))
                  + "\nLearner time that ended up in committed rounds ÷ learner time spent, from the bucket "
                    "(docs/prefect.md)."),
        key=keys["goodput"], description=f"goodput so far of run {run_id}",
    )
    progress_artifact_id = ctx.progress_artifact_id
    if progress_artifact_id:
        loss = record.stats.get("val_loss")
        update_progress_artifact(
            artifact_id=UUID(str(progress_artifact_id)), progress=min(100.0, 100.0 * round_ / max_rounds),
            description=f"round {round_} of {max_rounds}"
            + (f"; validation loss {loss:.4f}" if isinstance(loss, int | float) else "")
            + (f"; goodput {100 * gp:.1f}%" if gp is not None else ""),
        )
    return {"round": round_, "goodput": gp, "useful_s": goodput.useful_s, "spent_s": goodput.spent_s,
            "rows": len(rows)}
