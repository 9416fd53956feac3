"""Registering atoll's deployments, creating work pools, and starting a training run.

Deployments use module entrypoints (``atoll.flows.learner.learner_flow``,
``atoll.flows.training.training_run``): a worker only needs atoll installed (a venv, a docker
image, a kubernetes image); no source checkout is pulled.

* ``atoll-learner/<pool>``: the learner flow, one deployment per work pool (heterogeneous
  hardware = heterogeneous pools), with that pool's job variables (env, image, resources);
* ``atoll-training-run/default``: the training run, on the control pool; its one parameter is a
  :class:`~atoll.runs.options.TrainingRunOptions` (:func:`start_training` sends it);
* ``atoll-supervisor/default``: the supervisor (:mod:`atoll.flows.supervisor`), on the control
  pool, scheduled every ``supervisor_interval_s`` with a lifetime just under it: it relaunches
  crashed and zombie training runs from the bucket, and turns a Cancel of a training run in the
  UI into a clean stop of the run;
* ``atoll-prune/default``: retention (:mod:`atoll.flows.prune`), on the control pool, unscheduled
  (each run needs a schedule of its own, with its ``run_url``).

``infra/prefect.yaml`` declares the same deployments for ``prefect deploy --all``, except the
supervisor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import ObjectAlreadyExists
from prefect.types.entrypoint import EntrypointType

from atoll.flows.learner import learner_flow
from atoll.flows.prune import PRUNE_FLOW_NAME, prune_flow
from atoll.flows.supervisor import DEFAULT_TRAINING_DEPLOYMENT, supervisor
from atoll.flows.training import training_run
from atoll.ops.defaults import DEFAULT_POOLS
from atoll.runs.options import FleetOptions, TrainingRunOptions, default_of
from atoll.runs.supervision import SUPERVISOR_INTERVAL_S, supervisor_lifetime_s
from atoll.tasks.queries import LEARNER_FLOW_NAME, pool_tag

__all__ = [
    "DEFAULT_POOLS",
    "TRAINING_DEPLOYMENT",
    "SUPERVISOR_DEPLOYMENT",
    "ensure_pools",
    "deploy_all",
    "start_training",
    "start_supervisor",
    "learner_job_env",
    "parse_job_variables",
    "plaintext_credentials",
    "pool_variables",
    "set_pool_concurrency",
]

TRAINING_DEPLOYMENT = DEFAULT_TRAINING_DEPLOYMENT
SUPERVISOR_DEPLOYMENT = "atoll-supervisor/default"
PRUNE_DEPLOYMENT = f"{PRUNE_FLOW_NAME}/default"


def learner_job_env(threads: int = default_of(FleetOptions, "threads")) -> dict[str, str]:
    """Environment for learner processes: one BLAS thread each (islands share nothing)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def ensure_pools(pools: Sequence[str] = DEFAULT_POOLS, *, pool_type: str = "process",
                 base_job_template: Mapping[str, Any] | None = None) -> list[str]:
    """Create the work pools that do not exist yet; returns the names created."""
    created = []
    with get_client(sync_client=True) as client:
        for name in pools:
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type=pool_type,
                                                       base_job_template=dict(base_job_template or {})))
                created.append(name)
            except ObjectAlreadyExists:
                pass
    return created


def deploy_all(
    pools: Sequence[str] = DEFAULT_POOLS,
    *,
    control_pool: str | None = None,
    env: Mapping[str, str] | None = None,
    pool_job_variables: Mapping[str, Mapping[str, Any]] | None = None,
    learner_concurrency: int | None = None,
    control_job_variables: Mapping[str, Any] | None = None,
    supervisor_interval_s: float | None = SUPERVISOR_INTERVAL_S,
    supervisor_parameters: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Register the learner deployment of every pool, the training-run deployment, the supervisor
    and retention (``atoll-prune/default``, unscheduled).

    ``env`` is added to every deployment's job environment (e.g. object-store endpoint and
    credentials for workers); ``pool_job_variables[pool]`` adds job variables per pool (image,
    resources ...), ``control_job_variables`` to the training run's and the supervisor's (e.g. their
    image). ``supervisor_interval_s``: schedule of the supervisor (None: deploy it without a
    schedule; start it by hand). Returns ``{deployment name: id}``.
    """
    out: dict[str, str] = {}
    base_env = {**learner_job_env(), **dict(env or {})}
    for pool in pools:
        jv = dict((pool_job_variables or {}).get(pool, {}))
        jv["env"] = {**base_env, **dict(jv.get("env", {}))}
        out[f"{LEARNER_FLOW_NAME}/{pool}"] = _apply(
            learner_flow, name=pool, work_pool_name=pool, job_variables=jv,
            tags=["atoll", "atoll-learner", pool_tag(pool)], concurrency_limit=learner_concurrency,
            description=f"atoll learner on work pool {pool}: one long-lived flow run per learner (island)",
        )
    control = control_pool or pools[0]
    # The control plane (training run, supervisor, retention): one CPU thread, the same job variables.
    control_jv = {**dict(control_job_variables or {}), "env": {**dict(env or {}), "OMP_NUM_THREADS": "1"}}
    out[TRAINING_DEPLOYMENT] = _apply(
        training_run, name="default", work_pool_name=control, job_variables=control_jv,
        tags=["atoll", "atoll-training-run"],
        description="atoll training run: the synchronizer; one outer-round flow run per round",
    )
    out[SUPERVISOR_DEPLOYMENT] = _apply(
        supervisor, name="default", work_pool_name=control, job_variables=control_jv,
        tags=["atoll", "atoll-supervisor"],
        parameters=_supervisor_parameters(supervisor_interval_s, supervisor_parameters), interval=supervisor_interval_s,
        description="atoll supervisor: relaunches crashed or zombie training runs from the bucket",
    )
    # Retention, without a schedule: each run needs its own (with its run_url), and the operator's
    # credentials (docs/protocol.md, section 10).
    out[PRUNE_DEPLOYMENT] = _apply(
        prune_flow, name="default", work_pool_name=control, job_variables=control_jv,
        tags=["atoll", "atoll-prune"],
        description="atoll retention: delete what a long run no longer needs; schedule it per run with its run_url",
    )
    return out


def _apply(flow: Flow[..., Any], **deployment: Any) -> str:
    """Register one deployment of ``flow`` by module entrypoint; its id."""
    dep = cast(RunnerDeployment, flow.to_deployment(  # sync call: not a coroutine
        entrypoint_type=EntrypointType.MODULE_PATH, **deployment,
    ))
    return str(dep.apply())


def _supervisor_parameters(interval_s: float | None, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    # Each supervisor flow run lives just under the interval, so one is (almost) always watching and
    # a crashed one is replaced at the next tick.
    params: dict[str, Any] = {}
    if interval_s is not None:
        params["lifetime_s"] = supervisor_lifetime_s(interval_s)
    params.update(dict(extra or {}))
    return params


def start_training(options: TrainingRunOptions, *, deployment: str = TRAINING_DEPLOYMENT,
                   flow_run_name: str | None = None, tags: Sequence[str] = (),
                   job_variables: Mapping[str, Any] | None = None) -> FlowRun:
    """Launch a training-run flow run on its deployment without waiting for it."""
    return run_deployment(deployment, parameters={"options": options.model_dump(mode="json")}, timeout=0,
                          as_subflow=False, flow_run_name=flow_run_name, tags=list(tags),
                          job_variables=dict(job_variables) if job_variables else None,
                          )  # type: ignore[return-value]  # sync call: a FlowRun, not a coroutine


def start_supervisor(*, parameters: Mapping[str, Any] | None = None,
                     deployment: str = SUPERVISOR_DEPLOYMENT) -> FlowRun:
    """Launch a supervisor flow run now (besides its schedule), without waiting for it."""
    return run_deployment(deployment, parameters=dict(parameters or {}), timeout=0,
                          as_subflow=False)  # type: ignore[return-value]  # sync call: a FlowRun


# -- image-based deployments: `atoll deploy --image ... --job-variable k=v --concurrency N` -------------

_CREDENTIAL_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "ATOLL_KEYRING",
                     "GOOGLE_APPLICATION_CREDENTIALS_JSON", "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING")
_NOT_CREDENTIALS = ("ENV", "PREFECT_API_KEY", "ATOLL_SECRET_BLOCK", "CREDENTIALS_SECRET")
"""Names that only *name* where a secret lives (or Prefect's own key, which workers inject)."""
_CREDENTIAL_WORDS = ("SECRET", "PASSWORD", "TOKEN", "PRIVATE_KEY", "API_KEY", "ACCESS_KEY")


def plaintext_credentials(job_variables: Mapping[str, Any]) -> list[str]:
    """Names in ``job_variables`` (and its ``env``) that look like credentials.

    Job variables are stored in the Prefect database in plaintext and shown in the UI; bucket
    credentials belong in a Prefect Secret block (``ATOLL_SECRET_BLOCK``) or the pool's secret
    mounts (kubernetes ``credentials_secret``). ``PREFECT_API_KEY`` is Prefect's own and allowed, and
    ``ATOLL_SECRET_BLOCK`` / ``credentials_secret`` hold only names.
    """
    found = []
    raw_env = job_variables.get("env")
    env: Mapping[str, Any] = raw_env if isinstance(raw_env, Mapping) else {}
    for name in [*job_variables, *env]:
        upper = str(name).upper()
        if upper in _NOT_CREDENTIALS:
            continue
        if upper in _CREDENTIAL_NAMES or any(w in upper for w in _CREDENTIAL_WORDS):
            found.append(str(name))
    return found


def parse_job_variables(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as job variables; a VALUE that parses as JSON is used as JSON.

    ``gpu_count=2`` -> 2, ``node_selector={"gpu": "h100"}`` -> a dict, ``image=repo/atoll:1`` -> a string.
    ``env.NAME=VALUE`` adds one environment variable (always a string).
    """
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--job-variable: expected KEY=VALUE, got {item!r}")
        if key.startswith("env."):
            out.setdefault("env", {})[key[4:]] = raw
            continue
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key == "env" and isinstance(value, Mapping):
            out["env"] = {**out.get("env", {}), **{str(k): str(v) for k, v in value.items()}}
        else:
            out[key] = value
    return out


def set_pool_concurrency(pools: Sequence[str], limit: int | None) -> dict[str, int | None]:
    """Set each work pool's concurrency limit (None clears it); returns ``{pool: limit}``.

    This is how atoll keeps one learner per GPU slot: a learner pool's limit is the number of
    learner-sized slots it has (``gpu_count`` GPUs each). The server then hands a worker no more
    than that many flow runs of the pool at once; extra learner runs wait in Scheduled/Late until
    a slot frees, instead of starting and fighting over a GPU (or, on kubernetes, sitting in
    Pending until the pod watch times out). A pool limit, unlike a deployment's, also covers runs
    of other deployments on the same pool (a second run's learners, a learner started by hand).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"concurrency must be >= 1, got {limit}")
    with get_client(sync_client=True) as client:
        for name in pools:
            client.update_work_pool(name, WorkPoolUpdate(concurrency_limit=limit))
    return {name: limit for name in pools}


def pool_variables(pools: Sequence[str]) -> dict[str, set[str]]:
    """The job variables each work pool's base job template declares (``image``, ``gpu_count`` ...)."""
    out: dict[str, set[str]] = {}
    with get_client(sync_client=True) as client:
        for name in pools:
            template = client.read_work_pool(name).base_job_template or {}
            out[name] = set(template.get("variables", {}).get("properties", {}))
    return out
