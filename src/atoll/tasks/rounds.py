"""The tasks of one outer round: await the quorum, merge and commit, record.

Tasks take the run URL, a round number and small records (contribution records, reasons,
timings) and return small records; tensors never cross a task boundary. The synchronizer's
in-memory state (current fragments, outer-optimizer buffers) is held per process in
:func:`synchronizer_for` and is always reloadable from the bucket: if the process held nothing,
or holds a state that is not the one before this round (another synchronizer committed, the
flow was restarted elsewhere), it is rebuilt from the latest commit.

Deadlines are atoll's: :func:`await_quorum` polls the bucket on the synchronizer's own clock and
closes by quorum + grace (``atoll.core.quorum``); Prefect timeouts are not used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from atoll.storage.records import CommitRecord
from atoll.storage.validation import InvalidInput, RoundOrderError
from atoll.tasks.report import GoodputTracker, contribution_rows, round_markdown, slug
from atoll.tasks.runs import open_run
from atoll.train.run import load_recipe, make_evaluator
from atoll.train.synchronizer import SynchronizerOptions
from atoll.train.synchronizer import RoundPoll, RoundSummary, Synchronizer

__all__ = [
    "synchronizer_for",
    "tracker_for",
    "await_quorum",
    "merge_and_commit",
    "record_round",
    "artifact_keys",
    "summary_dict",
    "forget_run",
]

_SYNCS: dict[str, Synchronizer] = {}
_TRACKERS: dict[str, GoodputTracker] = {}


def _log() -> Any:
    try:
        return get_run_logger()
    except MissingContextError:  # called through .fn() outside a flow: plain logging
        return logging.getLogger("atoll.rounds")


def synchronizer_for(run_url: str, storage_options: Mapping[str, Any] | None = None, *,
                     next_round: int | None = None, evaluate: bool = True, **overrides: Any) -> Synchronizer:
    """This process's synchronizer of the run, (re)built from the bucket when needed."""
    sync = _SYNCS.get(run_url)
    if sync is not None and next_round is not None and sync.round != next_round - 1:
        sync = None  # someone else moved the run on (or we are behind): reload from the bucket
    if sync is None:
        store = open_run(run_url, storage_options)
        opts = SynchronizerOptions(**overrides)
        sync = Synchronizer(store, options=opts, evaluate=make_evaluator(store) if evaluate else None)
        _SYNCS[run_url] = sync
    return sync


def tracker_for(run_url: str, storage_options: Mapping[str, Any] | None = None) -> GoodputTracker:
    tracker = _TRACKERS.get(run_url)
    if tracker is None:
        tracker = _TRACKERS[run_url] = GoodputTracker(open_run(run_url, storage_options))
    return tracker


def forget_run(run_url: str) -> None:
    """Drop this process's cached state of a run (tests, benchmarks)."""
    _SYNCS.pop(run_url, None)
    _TRACKERS.pop(run_url, None)


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
def await_quorum(run_url: str, round_: int, *, storage_options: dict[str, Any] | None = None,
                 budget_s: float | None = None, poll_interval_s: float = 0.2) -> RoundPoll | RoundSummary:
    """Poll the bucket until round ``round_`` may close (quorum + grace, or every live learner in).

    Returns the closing :class:`RoundPoll`; a RoundSummary if another synchronizer committed the
    round meanwhile; or, after ``budget_s`` without a close, the last (still open) poll, so the
    caller can look after its learners and call again (the round stays open: the clock keeps
    running from the first poll).
    """
    sync = synchronizer_for(run_url, storage_options, next_round=round_, poll_interval_s=poll_interval_s)
    if sync.round + 1 != round_:
        raise RoundOrderError(f"round {round_} requested but the bucket's next round is {sync.round + 1}")
    start = sync.clock()
    while True:
        try:
            polled = sync.poll()
        except (RoundOrderError, InvalidInput) as e:  # storage said no; try again on the next poll
            _log().warning(f"round {round_}: {e}; retrying")
            time.sleep(sync.options.poll_interval_s)
            continue
        if isinstance(polled, RoundSummary) or polled.decision.close:
            return polled
        now = sync.clock()
        if budget_s is not None and now - start >= budget_s:
            return polled
        wait = (polled.decision.recheck_at_s or 0) - now
        time.sleep(min(max(wait, 0.005), sync.options.poll_interval_s))


@task(name="merge-and-commit", cache_policy=NO_CACHE, persist_result=False)
def merge_and_commit(run_url: str, poll: RoundPoll, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the accepted deltas, merge (token-weighted RDA), take the outer step and commit the
    round create-once; the commit publishes the fragment's next global version (and a
    consolidated checkpoint on the recipe's cadence). Returns the round's small summary."""
    sync = synchronizer_for(run_url, storage_options, next_round=poll.round)
    summary = sync.close(poll)
    _log().info(summary.line())
    return summary_dict(summary)


@task(name="record-round", cache_policy=NO_CACHE, persist_result=False)
def record_round(run_url: str, round_: int, *, storage_options: dict[str, Any] | None = None,
                 progress_artifact_id: str | None = None) -> dict[str, Any]:
    """Write the round's artifacts from its commit record: a markdown summary, the contributions
    table (learner, pool, tokens, steps, weight, accepted or why not) and the goodput so far
    (from the bucket); move the run's progress artifact. Returns the goodput numbers."""
    store = open_run(run_url, storage_options)
    record: CommitRecord | None = store.read_commit(round_)
    if record is None:
        raise RoundOrderError(f"round {round_} is not committed in {store.url}")
    max_rounds = load_recipe(store).max_rounds
    run_id = store.manifest.run_id
    keys = artifact_keys(run_id)
    tracker = tracker_for(run_url, storage_options)
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
