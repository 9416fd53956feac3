"""The supervisor: restarts crashed or zombie training runs from the bucket, without a person.

One flow (``atoll-supervisor``) that, every ``check_every_s`` for ``lifetime_s``, looks at every
run with a training-run flow run in the last ``window_s``: the newest training-run flow run per
run (Prefect) and the run's bucket (finished? stopped? the synchronizer's lease and heartbeat).
The pure policy :func:`atoll.runs.supervision.decide_training_run` says what to do; this flow
does it:

* a training run that crashed or failed short of the last round, or a zombie (Running in Prefect,
  no heartbeat in the bucket: marked Crashed first), is relaunched on the deployment it came from,
  with its own options but ``resume_from`` its run: it continues from the last committed round and
  adopts the learners that are alive (a new lease fences the old synchronizer if it ever wakes);
* a training run a person cancelled in the UI means "stop the run": the supervisor marks it
  stopped in the bucket and cancels its learner flow runs (after they had a chance to save).

``atoll deploy`` registers it as ``atoll-supervisor/default`` on the control pool with an interval
schedule and a lifetime just under that interval, so there is (almost) always one supervisor and a
crashed one is replaced at the next tick; it keeps no state (relaunch counts come from Prefect's tags), so overlapping or
missing ticks are harmless, and relaunches use an idempotency key per crashed flow run, so two
supervisors never launch two training runs for one crash. ``atoll supervise`` runs the same loop
(:func:`supervise`) in a terminal; both take their knobs from
:class:`~atoll.runs.supervision.SupervisorOptions`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.states import Crashed

from atoll.runs.healing import ATOLL_CANCEL_PREFIX
from atoll.runs.options import TrainingRunOptions, option_parameters
from atoll.runs.supervision import (
    SupervisionAction,
    SupervisionPolicy,
    SupervisorOptions,
    TrainingRunObservation,
    decide_training_run,
)
from atoll.storage.reader import RunReader
from atoll.storage.synchronizer_side import SynchronizerStore
from atoll.tasks.fleet import liveness_age_s
from atoll.tasks.queries import (
    DEFAULT_TRAINING_DEPLOYMENT,
    HANDED_OVER_TAG,
    TRAINING_FLOW_NAME,
    read_flow_runs_paged,
    run_id_of,
    run_tag,
)
from atoll.tasks.stop import cancel_flow_runs_of_run, mark_stopped_and_wait
from atoll.train.run import load_recipe

__all__ = ["supervisor", "supervise", "supervise_once", "RELAUNCH_TAG", "DEFAULT_TRAINING_DEPLOYMENT", "RunVerdict",
           "Supervision"]

RELAUNCH_TAG = "atoll-relaunch"
"""Tag of training-run flow runs the supervisor launched (counted against ``max_relaunches``)."""

_DEFAULTS = SupervisorOptions()


@dataclass
class RunVerdict:
    run_id: str
    action: SupervisionAction
    reason: str
    flow_run: str
    launched: str | None = None


def _age_s(t: datetime | None, now: datetime) -> float | None:
    return None if t is None else (now - t).total_seconds()


def _options(fr: FlowRun) -> TrainingRunOptions | None:
    raw = (fr.parameters or {}).get("options")
    try:
        return TrainingRunOptions.model_validate(raw) if raw is not None else None
    except Exception:  # noqa: BLE001 - parameters from someone else's flow run: not ours to fix
        return None


def observe(fr: FlowRun, group: list[FlowRun], options: TrainingRunOptions, policy: SupervisionPolicy,
            now: datetime) -> TrainingRunObservation:
    """Prefect's view of the newest training-run flow run ``fr`` joined with the run's bucket."""
    state = fr.state.type.value if fr.state is not None else None
    message = (fr.state.message or "") if fr.state is not None else ""
    store = RunReader.open(options.target_url or "", options.storage_options)
    latest = store.latest_round()
    finished = latest >= load_recipe(store).max_rounds
    marker = store.stop_marker()
    live = store.synchronizer_liveness()
    lease = live.lease
    recent = [g for g in group if RELAUNCH_TAG in g.tags and g.created is not None
              and (now - g.created).total_seconds() < policy.window_s]
    return TrainingRunObservation(
        state=state,
        running_for_s=_age_s(fr.start_time, now) if state == "RUNNING" else None,
        since_created_s=_age_s(fr.created, now),
        cancelled_by_atoll=message.startswith(ATOLL_CANCEL_PREFIX),
        finished=finished, stopped=marker is not None and marker.stopped,
        heartbeat_age_s=liveness_age_s(live, now.timestamp()), exited=live.exited_reason,
        holds_lease=lease is not None and lease.flow_run_id is not None and str(lease.flow_run_id) == str(fr.id),
        recent_relaunches=len(recent),
    )


def relaunch(client: Any, fr: FlowRun, options: TrainingRunOptions, run_id: str, n: int) -> FlowRun:
    """A new training-run flow run on ``fr``'s deployment, with its options, resuming its run."""
    target = options.target_url
    resumed = options.model_copy(update={"resume_from": target, "fork_round": None, "run_url": None})
    deployment: Any = fr.deployment_id or DEFAULT_TRAINING_DEPLOYMENT
    new = run_deployment(deployment, parameters={"options": resumed.model_dump(mode="json")}, timeout=0,
                         as_subflow=False, tags=[run_tag(run_id), RELAUNCH_TAG], flow_run_name=f"{run_id}-relaunch-{n}",
                         idempotency_key=f"atoll:relaunch:{fr.id}")
    return new  # type: ignore[return-value]  # sync call: a FlowRun, not a coroutine


def supervise_once(client: Any, policy: SupervisionPolicy, *, window_s: float = _DEFAULTS.window_s,
                   stop_grace_s: float = _DEFAULTS.stop_grace_s, log: Any = print) -> list[RunVerdict]:
    """One pass over every run with a training-run flow run in the last ``window_s``."""
    now = datetime.now(timezone.utc)
    runs = read_flow_runs_paged(client, flow_names=[TRAINING_FLOW_NAME], since=now - timedelta(seconds=window_s))
    groups: dict[str, list[FlowRun]] = {}
    for fr in runs:  # newest first
        rid = run_id_of(fr)
        if rid is not None:  # untagged: it died before it prepared its run; nothing to resume
            groups.setdefault(rid, []).append(fr)
    verdicts = []
    for rid, group in groups.items():
        newest = group[0]
        if (newest.state is not None and newest.state.type.value == "COMPLETED"
                and HANDED_OVER_TAG not in newest.tags):
            continue  # finished or stopped by itself
        # A segment that handed over is Completed, but its run is not finished: its successor is
        # normally the newest flow run; if none is, the policy sees "completed short of the last
        # round" and relaunches from the bucket.
        options = _options(newest)
        if options is None or not options.target_url:
            continue
        try:
            obs = observe(newest, group, options, policy, now)
        except Exception as e:  # noqa: BLE001 - one unreadable bucket must not stop the others' supervision
            log(f"{rid}: cannot observe its bucket: {e!r}")
            continue
        decision = decide_training_run(obs, policy)
        verdict = RunVerdict(rid, decision.action, decision.reason, newest.name)
        if decision.crash:
            client.set_flow_run_state(newest.id, Crashed(message=f"{ATOLL_CANCEL_PREFIX} zombie: {decision.reason}"),
                                      force=True)
        if decision.launch:
            new = relaunch(client, newest, options, rid, len(group))
            verdict.launched = new.name
        if decision.stop:
            store = SynchronizerStore.open(options.target_url, options.storage_options)
            report = mark_stopped_and_wait(store, reason="training run cancelled in the Prefect UI",
                                           by="atoll-supervisor", grace_s=stop_grace_s, log=log)
            cancelled = cancel_flow_runs_of_run(client, run_tag(rid), reason="run stopped")
            verdict.reason += f" ({len(report.exited)} learners exited by themselves, {len(cancelled)} flow runs cancelled)"
        if decision.action not in (SupervisionAction.HEALTHY, SupervisionAction.FINISHED,
                                   SupervisionAction.STOPPED, SupervisionAction.STARTING):
            log(f"{rid}: {decision.action}: {verdict.reason}" + (f" -> {verdict.launched}" if verdict.launched else ""))
        verdicts.append(verdict)
    return verdicts


@dataclass
class Supervision:
    """What one supervisor did over its lifetime."""

    passes: int = 0
    acted: list[RunVerdict] = field(default_factory=list)
    """Its relaunches and the stops it finished."""


def supervise(options: SupervisorOptions, *, log: Callable[[str], None] = print,
              warn: Callable[[str], None] | None = None,
              on_verdict: Callable[[RunVerdict], None] | None = None) -> Supervision:
    """The supervisor's loop, for ``options.lifetime_s``: a pass (:func:`supervise_once`) every
    ``options.check_every_s``. A failed pass is reported through ``warn`` (default: ``log``) and the
    next one retries: the API may blip. ``on_verdict`` sees every run's verdict of every pass."""
    policy = options.policy()
    done = Supervision()
    deadline = time.monotonic() + options.lifetime_s
    with get_client(sync_client=True) as client:
        while True:
            done.passes += 1
            try:
                verdicts = supervise_once(client, policy, window_s=options.window_s,
                                          stop_grace_s=options.stop_grace_s, log=log)
            except Exception as e:  # noqa: BLE001 - the API may blip; the next pass retries
                (warn or log)(f"supervision pass {done.passes} failed: {e!r}")
                verdicts = []
            for v in verdicts:
                if on_verdict is not None:
                    on_verdict(v)
            done.acted += [v for v in verdicts if v.launched or v.action == SupervisionAction.STOP_REQUESTED]
            if time.monotonic() + options.check_every_s > deadline:
                break
            time.sleep(options.check_every_s)
    return done


@flow(name="atoll-supervisor", persist_result=False, log_prints=False)
@option_parameters(SupervisorOptions)
def supervisor(**options: Any) -> dict[str, Any]:
    """Watch every recent training run for ``lifetime_s``, every ``check_every_s``: relaunch the
    crashed and the zombies, finish stops requested in the UI (see the module docstring). The
    parameters are :class:`~atoll.runs.supervision.SupervisorOptions`' fields."""
    logger = get_run_logger()
    done = supervise(SupervisorOptions(**options), log=logger.info, warn=logger.warning)
    if done.acted:
        rows = "\n".join(f"| {v.run_id} | {v.action} | {v.flow_run} | {v.launched or '-'} | {v.reason} |"
                         for v in done.acted)
        create_markdown_artifact(
            key="atoll-supervisor", description="what the supervisor did",
            markdown=f"# Supervisor: {len(done.acted)} actions in {done.passes} passes\n\n| run | action | flow run | "
                     f"launched | why |\n|---|---|---|---|---|\n{rows}\n")
    return {"passes": done.passes, "actions": [vars(v) | {"action": str(v.action)} for v in done.acted]}
