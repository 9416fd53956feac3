"""The training run: the synchronizer side of Decoupled DiLoCo as Prefect flows.

``training_run`` (flow ``atoll-training-run``) prepares the run in the bucket (new, continued or
forked), launches or adopts one learner flow run per learner on the learner's work pool, then
runs one **outer round** flow run per round, named ``round-000017`` and tagged with the run id:

1. ``await-quorum``: poll the bucket until quorum + grace (atoll's clock, not Prefect timeouts);
   while it waits it hands back every ``watch_every_s`` so ``watch-learners`` can relaunch crashed
   learners (a round whose learners all died would otherwise never close);
2. ``merge-and-commit``: token-weighted RDA merge, outer Nesterov step, create-once commit, which
   publishes the fragment's next global version (and a checkpoint on the recipe's cadence);
3. ``record-round``: markdown summary, contributions table, goodput, run progress artifacts.

Everything a round needs is in the bucket, so a training run that is restarted (or a fresh one
given ``resume_from``) continues from the last committed round, with or without the Prefect
database that ran it.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_progress_artifact
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from atoll.tasks.learners import run_tag, watch_learners
from atoll.tasks.report import last_val_loss
from atoll.tasks.rounds import (
    artifact_keys,
    await_quorum,
    merge_and_commit,
    record_round,
    summary_dict,
    synchronizer_for,
)
from atoll.tasks.runs import RunInfo, open_run, prepare_run
from atoll.train.synchronizer import RoundSummary

__all__ = ["training_run", "outer_round"]


@flow(name="atoll-round", flow_run_name="round-{round_number:06d}", persist_result=False, log_prints=False)
def outer_round(
    run_url: str,
    round_number: int,
    run_id: str,
    learners: list[dict[str, str]],
    storage_options: dict[str, Any] | None = None,
    progress_artifact_id: str | None = None,
    manage_learners: bool = True,
    watch_every_s: float = 10.0,
    stale_after_s: float = 300.0,
    learner_deployments: dict[str, str] | None = None,
    learner_parameters: dict[str, Any] | None = None,
    poll_interval_s: float = 0.2,
) -> dict[str, Any]:
    """One outer round: await quorum (healing learners while waiting), merge + commit, record."""
    while True:
        polled = await_quorum(run_url, round_number, storage_options=storage_options, budget_s=watch_every_s,
                              poll_interval_s=poll_interval_s)
        if isinstance(polled, RoundSummary):  # another synchronizer committed it: adopt
            summary = summary_dict(polled)
            get_run_logger().info(f"round {round_number} was committed by {polled.record.committed_by}; adopted")
            break
        if polled.decision.close:
            summary = merge_and_commit(run_url, polled, storage_options=storage_options)
            break
        get_run_logger().info(f"round {round_number} still open after {watch_every_s:.0f}s more: "
                              f"{polled.decision.reason}")
        if manage_learners:
            sync = synchronizer_for(run_url, storage_options)
            now = sync.clock()
            watch_learners(run_url, run_id, learners, storage_options=storage_options,
                           last_seen_age_s={k: now - t for k, t in sync.last_seen.items()},
                           deployments=learner_deployments, learner_parameters=learner_parameters,
                           stale_after_s=stale_after_s)
    recorded = record_round(run_url, round_number, storage_options=storage_options,
                            progress_artifact_id=progress_artifact_id)
    return {**summary, "goodput": recorded["goodput"]}


@flow(name="atoll-training-run", persist_result=False, log_prints=False)
def training_run(
    run_url: str | None = None,
    preset: str = "demo",
    learners: int = 0,
    rounds: int = 0,
    config_path: str | None = None,
    resume_from: str | None = None,
    fork_round: int | None = None,
    storage_options: dict[str, Any] | None = None,
    manage_learners: bool = True,
    learner_deployments: dict[str, str] | None = None,
    learner_threads: int = 1,
    learner_poll_interval_s: float = 0.2,
    watch_every_s: float = 10.0,
    stale_after_s: float = 300.0,
    poll_interval_s: float = 0.2,
) -> dict[str, Any]:
    """Train a run to its last round.

    ``run_url`` + ``preset``/``config_path`` creates a run (or continues the one already there);
    ``resume_from`` continues that run from its last committed round; ``resume_from`` +
    ``fork_round`` forks it into a new run at ``run_url`` from that round (0 = its latest).
    ``manage_learners=False`` starts no learner flow runs (learners are started by hand).
    """
    log = get_run_logger()
    info: RunInfo = prepare_run(run_url, preset=preset, learners=learners, rounds=rounds, config_path=config_path,
                                resume_from=resume_from, fork_round=fork_round, storage_options=storage_options)
    run_url = info.run_url
    keys = artifact_keys(info.run_id)
    log.info(f"run {info.run_id} at {run_url}: {info.action}; round {info.latest_round} of {info.max_rounds}; "
             "learners " + ", ".join(f"{s['learner_id']}@{s['pool']}" for s in info.learners))
    progress_id = create_progress_artifact(
        progress=100.0 * info.latest_round / info.max_rounds, key=f"{keys['run']}-progress",
        description=f"run {info.run_id}: round {info.latest_round} of {info.max_rounds}",
    )
    learner_parameters = {"threads": learner_threads, "poll_interval_s": learner_poll_interval_s}
    watch_kwargs: dict[str, Any] = {
        "storage_options": storage_options, "deployments": learner_deployments,
        "learner_parameters": learner_parameters, "stale_after_s": stale_after_s,
    }
    sync = synchronizer_for(run_url, storage_options, poll_interval_s=poll_interval_s)
    if manage_learners and not sync.finished:
        watch_learners(run_url, info.run_id, info.learners, **watch_kwargs)

    failures = 0
    summaries: list[dict[str, Any]] = []
    t0 = time.monotonic()
    while not sync.finished:
        r = sync.round + 1
        try:
            # Round flow runs are short and many: no heartbeat thread (a sync flow waits ~1 s for it).
            with tags(run_tag(info.run_id), "atoll-round"), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                out = outer_round(run_url, r, info.run_id, info.learners, storage_options=storage_options,
                                  progress_artifact_id=str(progress_id) if progress_id else None,
                                  manage_learners=manage_learners, watch_every_s=watch_every_s,
                                  stale_after_s=stale_after_s, learner_deployments=learner_deployments,
                                  learner_parameters=learner_parameters, poll_interval_s=poll_interval_s)
            failures = 0
        except Exception as e:  # noqa: BLE001 - a failed round is retried from the bucket's state
            failures += 1
            log.warning(f"round {r} failed ({failures} in a row): {e!r}; retrying from the bucket")
            if failures >= 3:
                raise
            time.sleep(1.0)
            sync = synchronizer_for(run_url, storage_options, next_round=open_run(run_url, storage_options).latest_round() + 1,
                                    poll_interval_s=poll_interval_s)
            continue
        summaries.append(out)
        sync = synchronizer_for(run_url, storage_options, poll_interval_s=poll_interval_s)
        if manage_learners and not sync.finished and (r % 5 == 0):
            now = sync.clock()
            watch_learners(run_url, info.run_id, info.learners,
                           last_seen_age_s={k: now - t for k, t in sync.last_seen.items()}, **watch_kwargs)

    store = open_run(run_url, storage_options)
    latest = store.latest_round()
    records = store.history(max(1, latest - 64), latest) if latest else []
    loss = last_val_loss(records)
    goodput = summaries[-1]["goodput"] if summaries else None
    create_markdown_artifact(
        key=keys["run"], description=f"run {info.run_id}",
        markdown=(f"# Run `{info.run_id}` finished\n\n| | |\n|---|---|\n| bucket | `{run_url}` |\n"
                  f"| rounds committed | {latest} of {info.max_rounds} |\n"
                  f"| rounds in this flow run | {len(summaries)} in {time.monotonic() - t0:.0f} s |\n"
                  f"| final validation loss | {f'{loss:.4f}' if loss is not None else '-'} |\n"
                  f"| goodput | {f'{100 * goodput:.1f}%' if goodput is not None else '-'} |\n"
                  f"| checkpoints | {', '.join(map(str, store.list_checkpoints())) or '-'} |\n"),
    )
    log.info(f"run {info.run_id} finished at round {latest}; validation loss {loss}; bucket {run_url}")
    return {"run_url": run_url, "run_id": info.run_id, "rounds": latest, "val_loss": loss, "goodput": goodput,
            "action": info.action}
