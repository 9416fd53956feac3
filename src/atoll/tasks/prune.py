"""Retention as Prefect tasks: plan (reads only), then apply (the retention record, then deletes).

The decisions are :mod:`atoll.storage.retention`'s; these tasks only log its progress to the flow
run and render what it did for the UI.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from atoll.storage.operator_side import OperatorStore
from atoll.storage.reader import RunReader
from atoll.storage.records import PruneRecord
from atoll.storage.retention import CLASSES, PrunePlan, RetentionPolicy, apply_prune, plan_prune

__all__ = ["plan_retention", "apply_retention", "retention_markdown"]


@task(name="plan-retention", cache_policy=NO_CACHE, persist_result=False)
def plan_retention(store: RunReader, policy: RetentionPolicy) -> PrunePlan:
    """What retention would delete in ``store``'s run under ``policy`` (reads only)."""
    return plan_prune(store, policy, log=get_run_logger().info)


@task(name="apply-retention", cache_policy=NO_CACHE, persist_result=False)
def apply_retention(store: OperatorStore, plan: PrunePlan, by: str) -> PruneRecord:
    """Write the retention record, then delete what ``plan`` names."""
    return apply_prune(store, plan, by=by, log=get_run_logger().info)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def retention_markdown(plan: PrunePlan, record: PruneRecord | None, *, run_id: str, run_url: str,
                       policy: RetentionPolicy, dry_run: bool) -> str:
    """The flow run's artifact: per class, what was (or would be) deleted and what is kept."""
    verb = "would delete" if dry_run else "deleted"
    lines = [
        f"# Retention of run `{run_id}`{' (dry run)' if dry_run else ''}",
        "",
        f"`{run_url}`: latest round {plan.latest}; kept the last {policy.keep_rounds} rounds' global state, "
        f"{'every' if policy.keep_checkpoints is None else policy.keep_checkpoints} checkpoint(s), and every "
        f"unreferenced object younger than {policy.min_age_s:.0f} s ({plan.young} of them).",
        "",
        f"| what | {verb} | bytes | kept | bytes |",
        "|---|---|---|---|---|",
    ]
    for what in CLASSES:
        n, b = plan.deleted(what)
        if n or plan.kept[what]:
            lines.append(f"| {what} | {n} | {_mib(b)} | {plan.kept[what]} | {_mib(plan.kept_bytes[what])} |")
    lines.append(f"| **total** | {len(plan.deletes)} | {_mib(plan.bytes)} | {sum(plan.kept.values())} | "
                 f"{_mib(sum(plan.kept_bytes.values()))} |")
    if plan.through_round:
        lines += ["", f"Rounds 1..{plan.through_round} keep their commit records (the chain verifies); their "
                      f"global state {'would be' if dry_run else 'is'} gone. Per fragment, the oldest version kept: "
                      f"{', '.join(f'v{v}' for v in plan.floors)}."]
    if record is not None:
        lines += ["", f"This run's retention so far: {record.deleted_objects} objects, {_mib(record.deleted_bytes)} "
                      f"(`sync/prune.json`)."]
    return "\n".join(lines)
