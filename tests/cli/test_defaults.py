"""Each knob's default is written once, where it is owned (a policy or options class, or
``atoll.ops.defaults``); the CLI's flags, the flows' parameters, the stack and the deployments
read theirs from it. Where a copy cannot import its owner (``runs`` stays torch-free, so
``FleetOptions`` cannot read ``LearnerOptions``; a YAML file imports nothing) this test pins it."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import yaml

from atoll.cli import build_parser
from atoll.ops.defaults import DEFAULT_POOLS, DEFAULT_PORT, DEMO_DIR
from atoll.runs.healing import STOP_GRACE_S, HealingPolicy
from atoll.runs.options import FleetOptions, TrainingRunOptions, default_of
from atoll.runs.supervision import SUPERVISOR_INTERVAL_S, SupervisionPolicy, SupervisorOptions, supervisor_lifetime_s

INFRA = Path(__file__).resolve().parents[2] / "infra"


def _defaults(command: str, argv: tuple[str, ...] = ()) -> dict[str, Any]:
    from atoll.cli import _resolve_defaults

    args = build_parser().parse_args([command, *argv])
    _resolve_defaults(args)
    return vars(args)


def _params(fn: Any) -> dict[str, Any]:
    fn = getattr(fn, "fn", fn)  # a Prefect flow: its function
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}


def test_liveness_defaults_have_one_owner() -> None:
    from atoll.tasks.stop import mark_stopped_and_wait

    healing = HealingPolicy()
    fleet = FleetOptions()
    assert (fleet.heartbeat_timeout_s, fleet.startup_grace_s, fleet.relaunch_backoff_s, fleet.max_launches) == (
        healing.heartbeat_timeout_s, healing.startup_grace_s, healing.relaunch_backoff_s, healing.max_launches)
    assert fleet.policy() == healing
    assert SupervisionPolicy().heartbeat_timeout_s == healing.heartbeat_timeout_s
    assert SupervisionPolicy().startup_grace_s == healing.startup_grace_s
    stop = _params(mark_stopped_and_wait)
    assert (stop["grace_s"], stop["heartbeat_timeout_s"]) == (STOP_GRACE_S, healing.heartbeat_timeout_s)


def test_supervisor_flow_and_cli_read_the_supervision_defaults() -> None:
    from atoll.flows.supervisor import supervise_once, supervisor

    loop, policy = SupervisorOptions(), SupervisionPolicy()
    params = _params(supervisor)
    for name in ("check_every_s", "lifetime_s", "window_s", "stop_grace_s"):
        assert params[name] == getattr(loop, name), name
    for name in ("heartbeat_timeout_s", "startup_grace_s", "relaunch_backoff_s", "max_relaunches"):
        assert params[name] == getattr(policy, name), name
    once = _params(supervise_once)
    assert (once["window_s"], once["stop_grace_s"]) == (loop.window_s, loop.stop_grace_s)
    assert loop.lifetime_s == supervisor_lifetime_s(SUPERVISOR_INTERVAL_S) < SUPERVISOR_INTERVAL_S
    cli = _defaults("supervise")
    for name in ("check_every_s", "window_s", "stop_grace_s"):
        assert cli[name] == getattr(loop, name), name
    for name in ("heartbeat_timeout_s", "startup_grace_s", "relaunch_backoff_s", "max_relaunches"):
        assert cli[name] == getattr(policy, name), name
    assert _defaults("stop", ("file:///r",))["grace_s"] == STOP_GRACE_S


def test_learner_defaults_come_from_the_fleet_options_and_the_learner() -> None:
    from atoll.flows.learner import learner_flow
    from atoll.ops.deploy import learner_job_env
    from atoll.train.learner import LearnerOptions
    from atoll.train.synchronizer import SynchronizerOptions

    fleet = FleetOptions()
    params = _params(learner_flow)
    assert {k: params[k] for k in fleet.learner_parameters()} == fleet.learner_parameters()
    assert params["heartbeat_interval_s"] == LearnerOptions().heartbeat_interval_s
    assert _defaults("learner", ("file:///r", "--learner-id", "l"))["threads"] == fleet.threads
    assert learner_job_env()["OMP_NUM_THREADS"] == str(fleet.threads)
    # runs/options.py stays torch-free for the CLI, so it cannot read these two owners: pinned.
    assert (fleet.poll_interval_s, fleet.orphan_timeout_s) == (LearnerOptions().poll_interval_s,
                                                               LearnerOptions().orphan_timeout_s)
    training = TrainingRunOptions()
    assert (training.poll_interval_s, training.merge_device) == (SynchronizerOptions().poll_interval_s,
                                                                 SynchronizerOptions().device)


def test_pools_and_ports_have_one_owner() -> None:
    from atoll.ops.client import run_demo
    from atoll.ops.deploy import deploy_all, ensure_pools
    from atoll.ops.stack import LocalStack, run_stack_forever
    from atoll.train.recipe import demo_recipe, smoke_recipe

    assert _defaults("up")["pools"] == list(DEFAULT_POOLS) == _defaults("deploy")["pools"]
    assert _params(deploy_all)["pools"] == DEFAULT_POOLS == _params(ensure_pools)["pools"]
    assert _params(LocalStack.__init__)["pools"] == DEFAULT_POOLS == _params(run_stack_forever)["pools"]
    assert _defaults("up")["port"] == DEFAULT_PORT == _defaults("demo")["port"] == _params(run_stack_forever)["port"]
    demo = _params(run_demo)
    assert (demo["port"], demo["directory"], _defaults("demo")["dir"]) == (DEFAULT_PORT, DEMO_DIR, DEMO_DIR)
    assert (demo["learners"], demo["rounds"]) == (default_of(TrainingRunOptions, "learners"),
                                                  default_of(TrainingRunOptions, "rounds"))
    # The presets put their learners on the local pools (train/recipe.py cannot import ops).
    for _, recipe in (demo_recipe(), smoke_recipe()):
        assert {s.pool for s in recipe.learners} <= set(DEFAULT_POOLS)
    body = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    process_learners = {d["work_pool"]["name"] for d in body["deployments"]
                        if d["entrypoint"].endswith("learner_flow") and d["work_pool"]["name"].startswith("cpu-")}
    assert process_learners == set(DEFAULT_POOLS)
    assert body["definitions"]["learner_env"]["OMP_NUM_THREADS"] == str(FleetOptions().threads)


def test_retention_and_planner_flags_read_their_library_defaults() -> None:
    from atoll.flows.prune import prune_flow
    from atoll.sim.planner import plan
    from atoll.storage.retention import RetentionPolicy

    policy = RetentionPolicy()
    cli = _defaults("prune", ("file:///r",))
    flow = _params(prune_flow)
    for name in ("keep_rounds", "keep_checkpoints", "min_age_s"):
        assert cli[name] == flow[name] == getattr(policy, name), name
    cli = _defaults("plan", ("--params", "1e9", "--step-s", "1", "--wan-gbps", "1"))
    planner = _params(plan)
    for flag, name in (("fragments", "num_fragments"), ("inner_steps", "inner_steps"), ("tau", "overlap_steps"),
                       ("precision", "precision"), ("download_precision", "download_precision"),
                       ("learners", "learners"), ("dp_precision", "dp_precision"), ("grace_factor", "grace_factor")):
        assert cli[flag] == planner[name], flag
