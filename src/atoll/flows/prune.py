"""The retention flow (``atoll-prune``): ``atoll prune`` as a Prefect flow run, for a schedule.

A run that trains for days grows its bucket without end (docs/protocol.md, section 10). This flow
plans retention (reads only), applies it unless ``dry_run``, and leaves a markdown artifact with
the per-class table on the flow run. ``atoll deploy`` registers it as ``atoll-prune/default`` on
the control pool without a schedule: give it one per run in the UI (or ``prefect deployment
schedule create``) with that run's ``run_url`` as a parameter. Run it with the operator's
credentials (its own Secret block in ``$ATOLL_SECRET_BLOCK``): learners and the synchronizer are
not allowed to delete (the bucket policy, docs/protocol.md section 8).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run as prefect_flow_run

from atoll.flows.credentials import SECRET_BLOCK_ENV, export_secret_env
from atoll.runs.names import slug
from atoll.storage.operator_side import OperatorStore
from atoll.storage.retention import RetentionPolicy
from atoll.tasks.prune import apply_retention, plan_retention, retention_markdown

__all__ = ["prune_flow", "PRUNE_FLOW_NAME"]

PRUNE_FLOW_NAME = "atoll-prune"


@flow(name=PRUNE_FLOW_NAME, persist_result=False, log_prints=False)
def prune_flow(
    run_url: str,
    keep_rounds: int = RetentionPolicy.keep_rounds,
    keep_checkpoints: int | None = RetentionPolicy.keep_checkpoints,
    min_age_s: float = RetentionPolicy.min_age_s,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Delete what the run at ``run_url`` no longer needs (docs/protocol.md, section 10).

    ``keep_rounds``: rounds at the head whose global state stays readable (at least 2 x P).
    ``keep_checkpoints``: newest complete checkpoints to keep (None: all). ``min_age_s``: delete an
    unreferenced object only once it is this old. ``dry_run``: plan and report, delete nothing.
    The defaults are :class:`~atoll.storage.retention.RetentionPolicy`'s."""
    logger = get_run_logger()
    if exported := export_secret_env():
        logger.info(f"bucket credentials from Secret block {os.environ[SECRET_BLOCK_ENV]!r}: {', '.join(exported)}")
    policy = RetentionPolicy(keep_rounds=keep_rounds, keep_checkpoints=keep_checkpoints, min_age_s=min_age_s)
    store = OperatorStore.open(run_url, storage_options, read_only=dry_run)
    policy.check(store.plan.num_fragments)  # a clear error naming the parameter, before any task runs
    plan = plan_retention(store, policy)
    record = None
    if not dry_run and plan.deletes:
        by = f"atoll-prune flow run {prefect_flow_run.name or prefect_flow_run.id} on {socket.gethostname()}"
        record = apply_retention(store, plan, by)
    run_id = store.manifest.run_id
    create_markdown_artifact(
        key=f"{slug(run_id)}-retention",
        description=f"retention of run {run_id}",
        markdown=retention_markdown(plan, record, run_id=run_id, run_url=store.url, policy=policy, dry_run=dry_run),
    )
    logger.info("\n".join(plan.table()))
    return {"run_id": run_id, "latest": plan.latest, "through_round": plan.through_round, "floors": list(plan.floors),
            "deleted": 0 if dry_run else len(plan.deletes), "deleted_bytes": 0 if dry_run else plan.bytes,
            "would_delete": len(plan.deletes) if dry_run else 0, "young": plan.young}
