"""The training run: the synchronizer side of Decoupled DiLoCo as a Prefect flow.

``training_run`` (flow ``atoll-training-run``) takes one :class:`~atoll.runs.options.TrainingRunOptions`
(a form in the Prefect UI). It prepares the run in the bucket (new, continued or forked), creates
the run's :class:`~atoll.tasks.context.RunContext` (synchronizer, goodput tracker, learner fleet),
launches or adopts one learner flow run per learner on the learner's work pool, then runs the
**outer rounds** (:mod:`atoll.flows.round`), one flow run per round, tagged with the run id. By
default (``record_rounds``) the rounds run inline and each one's flow run is recorded as it opens
and commits, by the recorder's threads, so no round waits for the Prefect API; with ``record_rounds``
false each round is a flow run executed by Prefect's engine. A round that fails is retried from
the bucket's state under :data:`~atoll.core.retry.ROUND_RETRY`.

Everything a round needs is in the bucket, so a training run that is restarted (or a fresh one
given ``resume_from``) continues from the last committed round, with or without the Prefect
database that ran it.

**Segments.** One flow run runs at most ``options.segment_rounds`` rounds (so its graph stays far
under the UI's limit), then launches the next segment: a flow run of the same deployment with the
same options resuming the run, tagged with the run and ``atoll-segment-of:<this flow run>``; this
one ends Completed, tagged ``atoll-handed-over``, with a link artifact to the next one and the
event ``atoll.run.handed-over``. A run that commits its last round (or is stopped) emits
``atoll.run.finished``.

Lifecycle: the training run tags its own flow run with the run, takes the synchronizer's lease
(a newer training run of the same run fences it: it stops with :class:`~atoll.train.lease.Fenced`)
and heartbeats in ``sync/`` while it polls; the supervisor (:mod:`atoll.flows.supervisor`) reads
that heartbeat to relaunch a crashed or zombie training run. A run marked stopped in the bucket
(``atoll stop``) makes it end at once, Completed, with ``stopped: True``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_progress_artifact
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run as prefect_flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_UI_URL, temporary_settings

from atoll.core.retry import ROUND_RETRY
from atoll.flows.credentials import export_secret_env
from atoll.flows.round import ROUND_FLOW, RecordedRounds, outer_round
from atoll.runs.manage import RunInfo, prepare_run
from atoll.runs.names import round_flow_name
from atoll.runs.options import WATCH_EVERY_ROUNDS, TrainingRunOptions
from atoll.runs.report import last_val_loss
from atoll.tasks.context import RunContext
from atoll.tasks.events import RUN_FINISHED, RUN_HANDED_OVER, emit, run_resource
from atoll.tasks.prefect_private import run_flow_run, without_tags
from atoll.tasks.queries import (
    DEFAULT_TRAINING_DEPLOYMENT,
    HANDED_OVER_TAG,
    ROUND_TAG,
    SEGMENT_OF_TAG,
    SEGMENT_RUN_TAG,
    SEGMENT_TAG,
    flow_id,
    run_tag,
)
from atoll.tasks.recorder import RoundRecorder
from atoll.tasks.round_artifacts import artifact_keys
from atoll.tasks.rounds import watch_learners
from atoll.train.lease import Fenced, RunStopped

__all__ = ["training_run", "WATCH_EVERY_ROUNDS"]


def _prepare(options: TrainingRunOptions) -> RunInfo:
    return prepare_run(options.run_url, preset=options.preset, learners=options.learners, rounds=options.rounds,
                       config_path=options.config_path, resume_from=options.resume_from,
                       fork_round=options.fork_round, storage_options=options.storage_options)


@flow(name="atoll-training-run", persist_result=False, log_prints=False)
def training_run(options: TrainingRunOptions) -> dict[str, Any]:
    """Train a run to its last round.

    ``run_url`` + ``preset``/``config_path`` creates a run (or continues the one already there);
    ``resume_from`` continues that run from its last committed round; ``resume_from`` +
    ``fork_round`` forks it into a new run at ``run_url`` from that round (0 = its latest).
    ``fleet.manage=False`` starts no learner flow runs (learners are started by hand).
    """
    log = get_run_logger()
    export_secret_env()  # bucket credentials from the Secret block named in $ATOLL_SECRET_BLOCK, if any
    info = _prepare(options)
    _tag_self(run_tag(info.run_id))
    ctx = RunContext(info, options)
    keys = artifact_keys(info.run_id)
    marker = ctx.store.stop_marker()
    if marker is not None and marker.stopped:
        log.warning(f"run {info.run_id} is stopped ({marker.reason}, by {marker.by}); nothing to do. "
                    "`atoll resume` clears the stop and continues it.")
        return {"run_url": info.run_url, "run_id": info.run_id, "rounds": info.latest_round, "stopped": True,
                "action": info.action}
    flow_run_id = prefect_flow_run.id
    ctx.hold_lease(str(flow_run_id) if flow_run_id else None)
    fenced = False
    try:
        return _train(ctx, info, keys, log)
    except Fenced:
        fenced = True
        raise
    finally:
        # A fenced training run (a thawed zombie: its successor already runs) leaves at once, with
        # whatever its recorder still holds: the successor records those rounds (backfill), and
        # the old copy's Prefect client may be minutes into retries against a flow run the
        # supervisor has marked Crashed.
        ctx.release(drain=not fenced)


class RoundRunner(Protocol):
    """How a segment runs its rounds."""

    def run(self, round_number: int) -> list[dict[str, Any]]:
        """Run round ``round_number`` until it closes; the summaries of the rounds that landed."""

    def drain(self) -> list[dict[str, Any]]:
        """Wait for rounds still being committed; their summaries."""


@dataclass
class _RoundFlowRuns:
    """Each round a flow run of its own (a subflow, or launched): it commits before the next opens."""

    run_one: Callable[[int], dict[str, Any]]

    def run(self, round_number: int) -> list[dict[str, Any]]:
        return [self.run_one(round_number)]

    def drain(self) -> list[dict[str, Any]]:
        return []


@dataclass
class _Segment:
    """What one training-run flow run (a segment of the run) runs, and what it ran."""

    start_round: int
    deployment: Any
    """This flow run's deployment (the next segment is launched on it); None: no segments."""
    limit: int
    """Most rounds this flow run runs before it hands the run over."""
    recorded: bool
    """Rounds run inline; the recorder creates each one's flow run after its commit."""
    round_tags: list[str]
    recorder: RoundRecorder
    summaries: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False
    started_at: float = 0.0


def _train(ctx: RunContext, info: RunInfo, keys: dict[str, str], log: Any) -> dict[str, Any]:
    """Open the segment, run its rounds one of three ways, then finish the run or hand it over."""
    seg = _open_segment(ctx, info, keys, log)
    launcher: RoundLauncher | None = None
    if seg.recorded:  # rounds inline, in this process: no round waits for the Prefect API
        run_round: RoundRunner = RecordedRounds(ctx, log, pipelined=ctx.options.pipeline_commits)
    elif ctx.options.nest_rounds or not prefect_flow_run.id:
        run_round = _subflow_rounds(ctx, info.run_id)
    else:
        launcher = RoundLauncher(info.run_id, tags=seg.round_tags)
        run_round = launcher.bind(ctx)
    try:
        _run_rounds(ctx, info, seg, run_round, log)
    finally:
        if launcher is not None:
            launcher.close()
    return _close_segment(ctx, info, keys, seg, log)


def _subflow_rounds(ctx: RunContext, run_id: str) -> RoundRunner:
    """Each round a subflow of the training run (``nest_rounds``, or a flow called outside a flow run)."""
    return _RoundFlowRuns(lambda r: outer_round(ctx, r, run_id=run_id))


def _open_segment(ctx: RunContext, info: RunInfo, keys: dict[str, str], log: Any) -> _Segment:
    """Say what this flow run will run, link the segment it continues, start the progress artifact
    and the recorder (recording committed rounds that have no flow run yet), look after the learners."""
    options = ctx.options
    start_round = info.latest_round
    deployment = _own_deployment()
    limit = options.segment_rounds if deployment is not None else info.max_rounds
    log.info(f"run {info.run_id} at {info.run_url}: {info.action}; round {start_round} of {info.max_rounds}; "
             "learners " + ", ".join(f"{s['learner_id']}@{s['pool']}" for s in info.learners)
             + (f"; this segment runs up to {limit} rounds" if deployment is not None else
                f"; no training-run deployment ({DEFAULT_TRAINING_DEPLOYMENT}) to continue on, so this flow run "
                "runs every round (no segments)"))
    previous = _previous_segment(info.run_id)
    if previous is not None:
        create_markdown_artifact(
            key=keys["segment"], description=f"run {info.run_id}: this segment continues {previous.name}",
            markdown=(f"# Run `{info.run_id}`: segment from round {start_round + 1}\n\n"
                      f"Continues segment [{previous.name}]({_ui_url(previous.id)}) (flow run `{previous.id}`).\n"))
    progress_id = create_progress_artifact(
        progress=100.0 * start_round / info.max_rounds, key=keys["progress"],
        description=f"run {info.run_id}: round {start_round} of {info.max_rounds}",
    )
    round_tags = [run_tag(info.run_id), ROUND_TAG, f"{SEGMENT_RUN_TAG}{prefect_flow_run.id}"]
    recorded = options.record_rounds and not options.nest_rounds
    recorder = ctx.round_recorder(progress_artifact_id=str(progress_id) if progress_id else None,
                                  run_flow_run_id=prefect_flow_run.id, round_run_tags=round_tags if recorded else None)
    if recorded and start_round > 0:
        backfilled = recorder.backfill(start_round)
        if backfilled:
            log.info(f"recording {len(backfilled)} committed round(s) that have no flow run yet (the training "
                     f"run before this one ended before it recorded them): {backfilled[0]}..{backfilled[-1]}")
    if ctx.fleet is not None and not ctx.finished:
        watch_learners(ctx)
    return _Segment(start_round=start_round, deployment=deployment, limit=limit, recorded=recorded,
                    round_tags=round_tags, recorder=recorder)


def _run_rounds(ctx: RunContext, info: RunInfo, seg: _Segment, run_round: RoundRunner, log: Any) -> None:
    """Run rounds until the run's last round is closed, the run is stopped, or this segment's
    limit; then wait for the rounds still being committed. A failed round is retried from the
    bucket's state under ROUND_RETRY; a fenced training run leaves at once."""
    failures = 0
    seg.started_at = time.monotonic()
    # Round flow runs are short and many: no heartbeat thread (a sync flow waits ~1 s for it). The
    # settings are entered once for the loop: building a Settings object costs ~0.1-0.6 s.
    no_heartbeat = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    with temporary_settings(no_heartbeat), tags(run_tag(info.run_id), ROUND_TAG):
        while True:
            r = ctx.next_round
            try:
                if seg.stopped or ctx.last_round_closed or r - 1 - seg.start_round >= seg.limit:
                    seg.summaries += run_round.drain()
                    return
                seg.summaries += run_round.run(r)
            except Fenced:  # a newer training run of this run holds the lease: this one is superseded
                raise
            except RunStopped as e:  # atoll stop: end now, Completed; learners exit by themselves
                log.warning(f"run {info.run_id} stopped at round {r - 1}: {e}")
                seg.stopped = True  # the rounds already merged are still committed: drained next turn
                continue
            except Exception as e:  # noqa: BLE001 - a failed round is retried from the bucket's state
                failures += 1
                log.warning(f"round {r} failed ({failures} in a row): {e!r}; retrying from the bucket")
                if ROUND_RETRY.exhausted(failures):
                    raise
                time.sleep(ROUND_RETRY.delay_s(failures - 1))
                ctx.reload()
                continue
            failures = 0
            if ctx.fleet is not None and not ctx.finished and r % WATCH_EVERY_ROUNDS == 0:
                with without_tags():  # the loop's tags are for round flow runs only
                    watch_learners(ctx)


def _close_segment(ctx: RunContext, info: RunInfo, keys: dict[str, str], seg: _Segment,
                   log: Any) -> dict[str, Any]:
    """Write the run's summary artifact, then hand the run over to the next segment, or emit
    ``atoll.run.finished`` (its last round is committed, or it was stopped)."""
    ctx.finish_evaluation()  # a finished run waits (bounded) for its last round's validation loss
    report = seg.recorder.flush()
    store = ctx.store
    latest = store.latest_round()
    finished = latest >= info.max_rounds
    records = store.history(max(1, latest - 64), latest) if latest else []
    loss = last_val_loss(store, records)
    goodput = report.goodput if report is not None and seg.recorder.recorded else (
        seg.summaries[-1].get("goodput") if seg.summaries else None)
    merged = report.merged_share if report is not None and seg.recorder.recorded else None
    status = "stopped" if seg.stopped else "finished" if finished else f"continues from round {latest + 1}"
    create_markdown_artifact(
        key=keys["run"], description=f"run {info.run_id}",
        markdown=(f"# Run `{info.run_id}` {status}\n\n| | |\n|---|---|\n| bucket | `{info.run_url}` |\n"
                  f"| rounds committed | {latest} of {info.max_rounds} |\n"
                  f"| rounds in this flow run | {len(seg.summaries)} in {time.monotonic() - seg.started_at:.0f} s |\n"
                  f"| final validation loss | {f'{loss:.4f}' if loss is not None else '-'} |\n"
                  f"| goodput (time in useful training steps / time available) | "
                  f"{f'{100 * goodput:.1f}%' if goodput is not None else '-'} |\n"
                  f"| merged-work share (training the model kept) | "
                  f"{f'{100 * merged:.1f}%' if merged is not None else '-'} |\n"
                  f"| plots | artifact `{keys['plots']}` |\n"
                  f"| checkpoints | {', '.join(map(str, store.list_checkpoints())) or '-'} |\n"),
    )
    out: dict[str, Any] = {"run_url": info.run_url, "run_id": info.run_id, "rounds": latest, "val_loss": loss,
                           "goodput": goodput, "merged_share": merged, "action": info.action,
                           "stopped": seg.stopped}
    if not seg.stopped and not finished:
        ctx.release()  # stop heartbeating and drain the recorder before the next segment takes the lease
        nxt = _hand_over(ctx, info, keys, latest, seg.deployment, log)
        out["next_segment"] = str(nxt.id) if nxt is not None else None
        return out
    emit(RUN_FINISHED, run_resource(info.run_id, info.run_url),
         {"rounds": latest, "max_rounds": info.max_rounds, "stopped": seg.stopped, "val_loss": loss,
          "goodput": goodput, "merged_share": merged}, flow_runs={"training-run": prefect_flow_run.id})
    log.info(f"run {info.run_id} {status} at round {latest}; validation loss {loss}; bucket {info.run_url}")
    return out


class RoundLauncher:
    """Round flow runs of their own: each round's flow run is created with one API call (no parent
    task run, no look-up of an existing subflow run, no rename) and run here, in this process, by
    Prefect's engine. It is tagged with the run, ``atoll-round`` and ``atoll-segment-run:<training
    flow run id>`` (the segment that ran it). Exceptions propagate as from a subflow."""

    def __init__(self, run_id: str, *, tags: list[str]) -> None:
        self.run_id = run_id
        self.tags = tags
        self._flow_id: Any = None
        self._client: Any = None

    def close(self) -> None:
        if self._client is not None:
            self._client.__exit__(None, None, None)
            self._client = None

    def bind(self, ctx: RunContext) -> RoundRunner:
        """This launcher as the way the segment runs its rounds."""
        return _RoundFlowRuns(lambda r: self.run(ctx, r))

    def run(self, ctx: RunContext, round_: int) -> dict[str, Any]:
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.client.schemas.objects import FlowRun
        from prefect.states import Pending, to_state_create

        params = {"ctx": ctx, "round_number": round_, "run_id": self.run_id}
        if self._client is None:  # one client (one connection) for every round of the segment
            self._client = get_client(sync_client=True)
            self._client.__enter__()
        client = self._client
        if self._flow_id is None:
            self._flow_id = flow_id(client, ROUND_FLOW.name)
        create = FlowRunCreate(flow_id=self._flow_id, name=round_flow_name(round_),
                               parameters=ROUND_FLOW.serialize_parameters(params), tags=list(self.tags),
                               state=to_state_create(Pending()))
        resp = client.request("POST", "/flow_runs/", json=create.model_dump(mode="json"))
        flow_run = FlowRun.model_validate(resp.json())
        out: dict[str, Any] = run_flow_run(ROUND_FLOW, flow_run, params)
        return out


def _ui_url(flow_run_id: Any) -> str:
    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}" if base else f"/runs/flow-run/{flow_run_id}"


def _own_deployment() -> Any:
    """This flow run's deployment id, or the default training-run deployment's, or None (not in a
    flow run, or a flow called from Python on a server without atoll's deployments)."""
    run_ctx = FlowRunContext.get()
    if run_ctx is None or run_ctx.flow_run is None:
        return None
    if run_ctx.flow_run.deployment_id:
        return run_ctx.flow_run.deployment_id
    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(DEFAULT_TRAINING_DEPLOYMENT).id
        except ObjectNotFound:
            return None


def _previous_segment(run_id: str) -> Any:
    """The segment this flow run continues (it handed the run over to this one), if any."""
    flow_run_id = prefect_flow_run.id
    if not flow_run_id:
        return None
    with get_client(sync_client=True) as client:
        me = client.read_flow_run(flow_run_id)
        prev = next((t.removeprefix(SEGMENT_OF_TAG) for t in me.tags if t.startswith(SEGMENT_OF_TAG)), None)
        if prev is None:
            return None
        try:
            return client.read_flow_run(UUID(prev))
        except (ObjectNotFound, ValueError):
            return None


def _hand_over(ctx: RunContext, info: RunInfo, keys: dict[str, str], latest: int, deployment: Any, log: Any) -> Any:
    """Continue the run in a new training-run flow run (the next segment) on this flow run's
    deployment: same options, resuming the run; same run tag; linked both ways. Raises if it cannot
    be launched (the flow run fails and the supervisor relaunches the run from the bucket)."""
    me = prefect_flow_run.id
    resumed = ctx.options.model_copy(update={"resume_from": info.run_url, "fork_round": None, "run_url": None})
    nxt = run_deployment(deployment, parameters={"options": resumed.model_dump(mode="json")}, timeout=0,
                         as_subflow=False, flow_run_name=f"{info.run_id}-from-{latest + 1:06d}",
                         tags=[run_tag(info.run_id), SEGMENT_TAG, f"{SEGMENT_OF_TAG}{me}"],
                         idempotency_key=f"atoll:segment:{info.run_id}:{latest}")
    nxt_id = getattr(nxt, "id", None)
    create_link_artifact(link=_ui_url(nxt_id), link_text=f"next segment: {getattr(nxt, 'name', nxt_id)}",
                         key=keys["segment"], description=f"run {info.run_id} continues from round {latest + 1} "
                                                         f"in flow run {nxt_id}")
    _tag_self(HANDED_OVER_TAG)
    emit(RUN_HANDED_OVER, run_resource(info.run_id, info.run_url),
         {"round": latest, "max_rounds": info.max_rounds, "next_flow_run": str(nxt_id)},
         flow_runs={"training-run": me, "next-segment": nxt_id})
    log.info(f"run {info.run_id}: segment done at round {latest}; continues in flow run "
             f"{getattr(nxt, 'name', nxt_id)} ({_ui_url(nxt_id)})")
    return nxt


def _tag_self(tag: str) -> None:
    """Add the run's tag to this flow run (a new run's id is known only once it is prepared), so
    `atoll stop` and the supervisor find every training-run flow run of a run by tag."""
    flow_run_id = prefect_flow_run.id
    if not flow_run_id:
        return
    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(flow_run_id)
        if tag not in fr.tags:
            client.update_flow_run(fr.id, tags=[*fr.tags, tag])
