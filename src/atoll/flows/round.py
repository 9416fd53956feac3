"""The outer-round flow: one flow run per round of a training run, named ``round-000017``.

By default a round runs inline and its flow run is recorded (below). With ``record_rounds`` false
the training run (:mod:`atoll.flows.training`) runs :func:`outer_round` as a flow run of its own
(with ``nest_rounds``: as a subflow), with the run's :class:`~atoll.tasks.context.RunContext` and
the round number; it composes two tasks:

1. ``await-quorum``: poll the bucket until quorum + grace (atoll's clock, not Prefect timeouts);
   while it waits it hands back every ``fleet.watch_every_s`` so ``watch-learners`` can relaunch
   crashed learners (a round whose learners all died would otherwise never close), and emits
   ``atoll.round.stalled``;
2. ``merge-and-commit``: token-weighted RDA merge, outer Nesterov step, create-once commit, which
   publishes the fragment's next global version (and a checkpoint on the recipe's cadence).

Then it hands the committed round to the run's recorder (:mod:`atoll.tasks.recorder`), which
writes the round's summary and contributions table **on this flow run** from a background thread,
while the next round already runs: artifacts are off the critical path.

The tasks carry no tags (the flow run does): a tagged task run asks the API for a tag-concurrency
slot before it starts, one more call per task that atoll never needs.

If another synchronizer committed the round first, its commit is adopted and only recorded.

**Recorded rounds** (``TrainingRunOptions.record_rounds``, the default): :class:`RecordedRounds` runs the same
loop inline in the training-run process, calling the tasks' functions directly (no task runs), so
a round never waits for the Prefect API; the recorder's thread creates the round's flow run
Running when the round opens and completes it once it commits (its duration is the round's, from
opening to the commit's end), with a task run per phase (await-quorum, grace, merge, commit) at
its real times, its log lines and its artifact. With ``pipeline_commits`` (the default) a round's
commit is written while the next round polls and merges.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import Flow, flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from atoll.tasks.context import RunContext
from atoll.tasks.events import ROUND_STALLED, emit, run_resource
from atoll.tasks.prefect_private import without_tags
from atoll.tasks.rounds import (
    await_quorum,
    hand_over,
    landed_rounds,
    merge_and_commit,
    round_phases,
    summary_dict,
    watch_learners,
)
from atoll.train.synchronizer import RoundSummary

__all__ = ["outer_round", "RecordedRounds", "ROUND_FLOW"]


@flow(name="atoll-round", flow_run_name="round-{round_number:06d}", persist_result=False, log_prints=False)
def outer_round(ctx: RunContext, round_number: int, run_id: str | None = None) -> dict[str, Any]:
    """One outer round: await quorum (healing learners while waiting), merge + commit; its
    artifacts follow from the run's recorder.

    ``ctx`` is the run's context in this process (shown as ``<RunContext>`` in the UI: it is never
    serialized); ``run_id`` only labels the flow run's parameters in the UI and must be the context's.
    """
    if run_id is not None and run_id != ctx.run_id:
        raise ValueError(f"run_id {run_id!r} is not the context's run {ctx.run_id!r}")
    flow_run_id = prefect_flow_run.id
    with without_tags():  # the flow run is tagged; its task runs need not be
        summary = _round(ctx, round_number, get_run_logger(), await_quorum, merge_and_commit, flow_run_id)
    ctx.round_recorder().submit(round_number, flow_run_id)
    return summary


class RecordedRounds:
    """Rounds run inline in the training-run process with no Prefect call on their path; the run's
    recorder records each one's flow run as it opens and commits (``record_rounds``: named
    ``round-000017``, tagged like a round flow run, with the same artifacts and event).

    ``pipelined`` (``TrainingRunOptions.pipeline_commits``): a closed round is merged and handed to
    the synchronizer's commit pipeline, and the next round opens while its payloads and record are
    written (:meth:`~atoll.train.synchronizer.Synchronizer.hand_over`). Each round is recorded
    from the pipeline's thread as it lands (:attr:`RunContext.on_landed`), so its flow run ends
    when its commit does; the loop learns of it at its next call."""

    def __init__(self, ctx: RunContext, log: Any, *, pipelined: bool) -> None:
        self.ctx, self.log, self.pipelined = ctx, log, pipelined
        self._opened: dict[int, float] = {}
        if pipelined:
            # The context's synchronizer notes its phases on time.monotonic, round_phases' default.
            ctx.on_landed = lambda summary: self._record(summary_dict(summary), round_phases(summary))

    def run(self, round_number: int) -> list[dict[str, Any]]:
        """Run round ``round_number`` until it closes (sequential: until it commits); the summaries
        of the rounds that landed meanwhile, in order."""
        landed = landed_rounds(self.ctx) if self.pipelined else []  # an earlier failure raises here
        if self.ctx.next_round != round_number:  # a commit in flight lost its race: the state is the winner's now
            return self._recorded(landed)
        self._opened[round_number] = time.time()
        self.ctx.round_recorder().open(round_number)  # its flow run is Running from now on, on the server's clock
        commit_fn = hand_over if self.pipelined else merge_and_commit.fn
        with without_tags():  # the recorder tags the round's flow run itself
            out = _round(self.ctx, round_number, self.log, await_quorum.fn, commit_fn, None)
        return self._recorded(landed + (out if isinstance(out, list) else [out]))

    def drain(self) -> list[dict[str, Any]]:
        """Wait for the rounds still in flight (the segment ends, or the run stops)."""
        return self._recorded(landed_rounds(self.ctx, drain=True)) if self.pipelined else []

    def _recorded(self, summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``summaries``, each recorded unless the pipeline's hook already did (a round it won)."""
        for s in summaries:
            if not (self.pipelined and s["won"]):
                self._record(s, s.get("phases", ()))
        return summaries

    def _record(self, summary: dict[str, Any], phases: Any) -> None:
        opened = self._opened.pop(summary["round"], None)
        ended = phases[-1][2] if phases else time.time()  # the commit's end
        self.ctx.round_recorder().submit(summary["round"], None, phases=phases,
                                         seconds=None if opened is None else max(0.0, ended - opened))


def _round(ctx: RunContext, round_number: int, log: Any, await_fn: Any, commit_fn: Any,
           flow_run_id: Any) -> Any:
    """Await the quorum (looking after the learners while the round stays open), then
    ``commit_fn``'s answer; an adopted round's summary if another synchronizer committed it."""
    watch_every_s = ctx.options.fleet.watch_every_s
    while True:
        polled = await_fn(ctx, round_number, budget_s=watch_every_s)
        if isinstance(polled, RoundSummary):  # another synchronizer committed it: adopt
            log.info(f"round {round_number} was committed by {polled.record.committed_by}; adopted")
            return summary_dict(polled)
        if polled.decision.close:
            out: dict[str, Any] = commit_fn(ctx, polled)
            return out
        waited = polled.polled_at_s - polled.opened_at_s
        log.info(f"round {round_number} still open after {waited:.0f}s: {polled.decision.reason}")
        emit(ROUND_STALLED, run_resource(ctx.run_id, ctx.run_url),
             {"round": round_number, "fragment": polled.fragment, "open_for_s": round(waited, 3),
              "reason": polled.decision.reason, "arrived": len(polled.accepted)},
             flow_runs={"flow-run": flow_run_id} if flow_run_id else None)
        if ctx.fleet is not None:
            watch_learners(ctx)


ROUND_FLOW = Flow(fn=outer_round.fn, name=outer_round.name, persist_result=False, log_prints=False)
"""The same flow for round flow runs created beforehand with their name (no name template: the
engine would rename the run, one more API call)."""
