"""The training run: the synchronizer side of Decoupled DiLoCo as a Prefect flow.

``training_run`` (flow ``atoll-training-run``) takes one :class:`~atoll.runs.options.TrainingRunOptions`
(a form in the Prefect UI). It prepares the run in the bucket (new, continued or forked), creates
the run's :class:`~atoll.tasks.context.RunContext` (synchronizer, goodput tracker, learner fleet),
launches or adopts one learner flow run per learner on the learner's work pool, then runs one
**outer round** flow run per round (:mod:`atoll.flows.round`), tagged with the run id. A round
that fails is retried from the bucket's state under :data:`~atoll.core.retry.ROUND_RETRY`.

Everything a round needs is in the bucket, so a training run that is restarted (or a fresh one
given ``resume_from``) continues from the last committed round, with or without the Prefect
database that ran it.

Lifecycle: the training run tags its own flow run with the run, takes the synchronizer's lease
(a newer training run of the same run fences it: it stops with :class:`~atoll.train.lifecycle.Fenced`)
and heartbeats in ``sync/`` while it polls; the supervisor (:mod:`atoll.flows.supervisor`) reads
that heartbeat to relaunch a crashed or zombie training run. A run marked stopped in the bucket
(``atoll stop``) makes it end at once, Completed, with ``stopped: True``.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_progress_artifact
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run as prefect_flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from atoll.core.retry import ROUND_RETRY
from atoll.flows.credentials import export_secret_env
from atoll.flows.round import outer_round
from atoll.runs.manage import RunInfo, prepare_run
from atoll.runs.options import TrainingRunOptions
from atoll.runs.report import last_val_loss
from atoll.tasks.context import RunContext
from atoll.tasks.learners import run_tag, watch_learners
from atoll.tasks.rounds import artifact_keys
from atoll.train.lifecycle import Fenced, RunStopped

__all__ = ["training_run", "WATCH_EVERY_ROUNDS"]

WATCH_EVERY_ROUNDS = 5
"""Between rounds, the learners are looked after every this many rounds."""


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
    try:
        return _train(ctx, info, keys, log)
    finally:
        ctx.release()


def _train(ctx: RunContext, info: RunInfo, keys: dict[str, str], log: Any) -> dict[str, Any]:
    log.info(f"run {info.run_id} at {info.run_url}: {info.action}; round {info.latest_round} of {info.max_rounds}; "
             "learners " + ", ".join(f"{s['learner_id']}@{s['pool']}" for s in info.learners))
    progress_id = create_progress_artifact(
        progress=100.0 * info.latest_round / info.max_rounds, key=f"{keys['run']}-progress",
        description=f"run {info.run_id}: round {info.latest_round} of {info.max_rounds}",
    )
    ctx.progress_artifact_id = str(progress_id) if progress_id else None
    if ctx.fleet is not None and not ctx.finished:
        watch_learners(ctx)

    failures = 0
    stopped = False
    summaries: list[dict[str, Any]] = []
    t0 = time.monotonic()
    # Round flow runs are short and many: no heartbeat thread (a sync flow waits ~1 s for it).
    no_heartbeat = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    while not ctx.finished:
        r = ctx.next_round
        try:
            with tags(run_tag(info.run_id), "atoll-round"), temporary_settings(no_heartbeat):
                out = outer_round(ctx, r, run_id=info.run_id)
            failures = 0
        except Fenced:  # a newer training run of this run holds the lease: this one is superseded
            raise
        except RunStopped as e:  # atoll stop: end now, Completed; learners exit by themselves
            log.warning(f"run {info.run_id} stopped at round {r - 1}: {e}")
            stopped = True
            break
        except Exception as e:  # noqa: BLE001 - a failed round is retried from the bucket's state
            failures += 1
            log.warning(f"round {r} failed ({failures} in a row): {e!r}; retrying from the bucket")
            if ROUND_RETRY.exhausted(failures):
                raise
            time.sleep(ROUND_RETRY.delay_s(failures - 1))
            ctx.reload()
            continue
        summaries.append(out)
        if ctx.fleet is not None and not ctx.finished and r % WATCH_EVERY_ROUNDS == 0:
            watch_learners(ctx)

    store = ctx.store
    latest = store.latest_round()
    records = store.history(max(1, latest - 64), latest) if latest else []
    loss = last_val_loss(records)
    goodput = summaries[-1]["goodput"] if summaries else None
    create_markdown_artifact(
        key=keys["run"], description=f"run {info.run_id}",
        markdown=(f"# Run `{info.run_id}` {'stopped' if stopped else 'finished'}\n\n| | |\n|---|---|\n| bucket | `{info.run_url}` |\n"
                  f"| rounds committed | {latest} of {info.max_rounds} |\n"
                  f"| rounds in this flow run | {len(summaries)} in {time.monotonic() - t0:.0f} s |\n"
                  f"| final validation loss | {f'{loss:.4f}' if loss is not None else '-'} |\n"
                  f"| goodput | {f'{100 * goodput:.1f}%' if goodput is not None else '-'} |\n"
                  f"| checkpoints | {', '.join(map(str, store.list_checkpoints())) or '-'} |\n"),
    )
    log.info(f"run {info.run_id} {'stopped' if stopped else 'finished'} at round {latest}; validation loss {loss}; "
             f"bucket {info.run_url}")
    return {"run_url": info.run_url, "run_id": info.run_id, "rounds": latest, "val_loss": loss, "goodput": goodput,
            "action": info.action, "stopped": stopped}


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
