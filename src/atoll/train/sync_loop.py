"""The synchronizer's own loop, for a process that only synchronizes (``python -m atoll.train.local
synchronizer``, the virtual run's and the benchmarks' synchronizers): take the lease, run rounds
until the schedule ends, the run is stopped or a newer synchronizer fences this one.

Each step is :meth:`Synchronizer.step <atoll.train.synchronizer.Synchronizer.step>` (pipelined
commits, the default) or :meth:`~atoll.train.synchronizer.Synchronizer.tick`; a round storage
refused is retried from the bucket's state under :data:`~atoll.core.retry.ROUND_RETRY`. The
training run's flow runs the same rounds through :mod:`atoll.flows.training`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from atoll.core.quorum import QuorumDecision
from atoll.core.retry import ROUND_RETRY
from atoll.storage.liveness import Lease
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.storage.validation import InvalidInput, RoundOrderError, TransientStorageError
from atoll.train.evaluator import Evaluator
from atoll.train.lease import Fenced, RunStopped
from atoll.train.synchronizer import RoundSummary, Synchronizer, SynchronizerOptions

__all__ = ["run_synchronizer"]


def run_synchronizer(
    store: SynchronizerStore,
    *,
    options: SynchronizerOptions | None = None,
    evaluator: Evaluator | None = None,
    on_round: Callable[[RoundSummary], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    hold_lease: bool = True,
    flow_run_id: str | None = None,
) -> int:
    """Run rounds until the schedule's ``max_rounds`` is committed, ``should_stop()``, the run's
    stop marker says stopped, or a newer synchronizer fenced this one; returns the last round.

    ``hold_lease``: take the synchronizer's next lease first and heartbeat (see
    :meth:`Synchronizer.hold_lease`). Sleeps on atoll's own clock between polls (never longer
    than the decision's recheck time). With ``options.pipeline_commits`` each round's commit
    overlaps the next round (:meth:`Synchronizer.step`); a stop first commits the rounds already
    merged, a fenced or failing synchronizer drops them (a restart merges them again).

    ``evaluator`` (:mod:`atoll.train.evaluator`): started here, told of every committed round and offered
    this synchronizer's copy of each evaluated round; no round waits for it. When the run's last round is
    committed, the return waits for its evaluation (bounded by ``final_wait_s``); any other exit leaves at once.
    """
    sync = Synchronizer(store, options=options)
    if evaluator is not None:
        on_round = evaluator.start().after(on_round)
        sync.on_state = evaluator.offer
    log(f"synchronizer: {store.url} at round {sync.round}; P={sync.plan.num_fragments} K={sync.config.min_quorum}")
    lease: Lease | None = None
    reason = "finished"
    try:
        if hold_lease:
            lease = sync.hold_lease(flow_run_id)
            log(f"synchronizer: took lease incarnation {lease.incarnation}")
        failures = 0
        while not sync.finished:
            if should_stop():
                reason = "should_stop"
                _report_or_wait(sync, (sync.drain(), None), on_round=on_round, log=log)
                break
            sync, out, failures = _step_or_retry(sync, failures, lease=lease, log=log)
            if out is not None:
                _report_or_wait(sync, out, on_round=on_round, log=log)
    except RunStopped as e:
        log(f"synchronizer: {e}")
        reason = f"stopped: {e.marker.reason}"
        _report_or_wait(sync, (sync.drain(), None), on_round=on_round, log=log)
    except Fenced as e:
        log(f"synchronizer: {e}; exiting")
        return sync.round  # the newer synchronizer owns sync/ now: write nothing more
    except BaseException as e:
        sync.exit_heartbeat(f"error: {type(e).__name__}: {e}")
        raise
    finally:
        sync.shutdown()
        if evaluator is not None:
            evaluator.close(final_round=sync.round if sync.finished else None)
    sync.exit_heartbeat(reason)
    return sync.round


def _step_or_retry(sync: Synchronizer, failures: int, *, lease: Lease | None, log: Callable[[str], None]
                   ) -> tuple[Synchronizer, tuple[list[RoundSummary], QuorumDecision | None] | None, int]:
    """One step of the loop: (the synchronizer, what the step found, failures in a row). A round
    storage refused is retried on a synchronizer rebuilt from the bucket (then nothing is found)."""
    try:
        return sync, (sync.step() if sync.options.pipeline_commits else _ticked(sync.tick())), 0
    except (RoundOrderError, InvalidInput, TransientStorageError) as e:
        # Storage said no (bad data never raises here: it becomes a recorded rejection).
        # Bounded (core.retry.ROUND_RETRY): after the last attempt the process fails loudly
        # and whoever runs it restarts it from the bucket.
        failures += 1
        if ROUND_RETRY.exhausted(failures):
            raise
        return _after_failed_round(sync, e, failures, lease=lease, log=log), None, failures


def _after_failed_round(sync: Synchronizer, error: Exception, failures: int, *, lease: Lease | None,
                        log: Callable[[str], None]) -> Synchronizer:
    """Retry ``failures`` of a round storage refused: say so, back off, and rebuild the
    synchronizer from the bucket (still holding this process's ``lease``)."""
    log(f"synchronizer: round {sync.round + 1}: {error}; retry {failures} of {ROUND_RETRY.attempts - 1}")
    sync.shutdown()
    time.sleep(ROUND_RETRY.delay_s(failures - 1))
    rebuilt = Synchronizer(sync.store, options=sync.options, clock=sync.clock)
    rebuilt.on_state = sync.on_state
    if lease is not None:
        rebuilt.hold_lease(lease=lease)
    return rebuilt


def _ticked(out: RoundSummary | QuorumDecision) -> tuple[list[RoundSummary], QuorumDecision | None]:
    """:meth:`Synchronizer.tick`'s answer as :meth:`Synchronizer.step`'s."""
    return ([out], None) if isinstance(out, RoundSummary) else ([], out)


def _report_or_wait(sync: Synchronizer, out: tuple[list[RoundSummary], QuorumDecision | None], *,
                    on_round: Callable[[RoundSummary], None] | None, log: Callable[[str], None]) -> None:
    """Committed rounds are logged and handed to ``on_round``; an open one is polled again after
    the decision's recheck time (at least 5 ms, at most one poll interval)."""
    landed, decision = out
    for summary in landed:
        log(summary.line())
        if on_round is not None:
            on_round(summary)
    if decision is None:
        return
    wait = (decision.recheck_at_s or 0) - sync.clock()
    time.sleep(min(max(wait, 0.005), sync.options.poll_interval_s))
