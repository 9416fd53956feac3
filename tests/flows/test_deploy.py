"""Deployments, work-pool templates, prefect.yaml, and the learner fleet's self-healing policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from atoll.runs.healing import HealingPolicy
from atoll.storage.paths import learner_heartbeat_key
from atoll.tasks.fleet import LearnerFleet, learner_tag, pool_tag, run_tag

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


@pytest.fixture
def deployed(prefect_harness: None) -> dict[str, str]:
    """Deployed afresh for each test (deploying is idempotent): another test, e.g.
    test_prefect_deploy_accepts_prefect_yaml, may have moved ``atoll-training-run/default``."""
    from atoll.ops.deploy import deploy_all, ensure_pools

    pools = ("pool-a", "pool-b")
    ensure_pools(pools)  # creates them on first use
    assert ensure_pools(pools) == []  # idempotent
    with _client() as client:
        assert {client.read_work_pool(p).type for p in pools} == {"process"}
    return deploy_all(pools, env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})


def test_deploy_all_registers_one_learner_deployment_per_pool(deployed: dict[str, str]) -> None:
    assert set(deployed) == {"atoll-learner/pool-a", "atoll-learner/pool-b", "atoll-training-run/default",
                             "atoll-supervisor/default", "atoll-prune/default"}
    with _client() as client:
        for pool in ("pool-a", "pool-b"):
            dep = client.read_deployment_by_name(f"atoll-learner/{pool}")
            assert dep.work_pool_name == pool
            assert dep.entrypoint == "atoll.flows.learner.learner_flow"
            assert dep.job_variables["env"]["OMP_NUM_THREADS"] == "1"
            assert dep.job_variables["env"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
            assert pool_tag(pool) in dep.tags
            assert {"run_url", "learner_id"} <= set(dep.parameter_openapi_schema["required"])
            assert {"device", "autocast"} <= set(dep.parameter_openapi_schema["properties"])
        train = client.read_deployment_by_name("atoll-training-run/default")
        assert train.work_pool_name == "pool-a" and train.entrypoint == "atoll.flows.training.training_run"
        # One typed options model, rendered by the UI as a form: every field says what it does.
        schema = train.parameter_openapi_schema
        assert schema["required"] == ["options"] and set(schema["properties"]) == {"options"}
        opts = schema["definitions"]["TrainingRunOptions"]["properties"]
        assert {"run_url", "resume_from", "fork_round", "preset", "fleet"} <= set(opts)
        for model in ("TrainingRunOptions", "FleetOptions"):
            fields = schema["definitions"][model]["properties"]
            assert all(f.get("description") for f in fields.values()), model
        # The supervisor: on the control pool, on a schedule, each flow run living just under the interval.
        sup = client.read_deployment_by_name("atoll-supervisor/default")
        assert sup.work_pool_name == "pool-a" and sup.entrypoint == "atoll.flows.supervisor.supervisor"
        [schedule] = sup.schedules
        assert schedule.schedule.interval.total_seconds() == 600 and schedule.active
        assert sup.parameters["lifetime_s"] == 570
        # Retention: on the control pool, unscheduled (each run gets its own schedule with its run_url).
        prune = client.read_deployment_by_name("atoll-prune/default")
        assert prune.entrypoint == "atoll.flows.prune.prune_flow" and not prune.schedules
        assert prune.parameter_openapi_schema["required"] == ["run_url"]


def test_entrypoints_load() -> None:
    from prefect.flows import load_flow_from_entrypoint

    assert load_flow_from_entrypoint("atoll.flows.learner.learner_flow").name == "atoll-learner"
    assert load_flow_from_entrypoint(str(ROOT / "src/atoll/flows/training.py:training_run")).name == "atoll-training-run"


def test_fleet_launches_adopts_and_relaunches(deployed: dict[str, str], tmp_path: Path) -> None:
    """Liveness comes from a real bucket's leases and heartbeats; flow runs from the Prefect API."""
    from prefect.states import Cancelled, Crashed, Running

    from atoll.runs.manage import prepare_run
    from atoll.storage import RunReader
    from atoll.storage.liveness import take_lease, write_heartbeat
    from atoll.storage.paths import to_url

    url = to_url(str(tmp_path / "run-f"))
    prepare_run(url, preset="smoke", learners=3, rounds=6)
    store = RunReader.open(url)
    learners = [{"learner_id": "learner-0", "pool": "pool-a"}, {"learner_id": "learner-1", "pool": "pool-b"},
                {"learner_id": "learner-2", "pool": "pool-b"}]

    # learner-2 runs by hand (no flow run): a lease with no flow run id, heartbeating. A live
    # process heartbeats all along, so it does so before every look: written once, it would go
    # stale past heartbeat_timeout_s on a slow machine (this test takes ~40 s on CI's 2 cores).
    by_hand = take_lease(store.store, "learner-2")

    def live() -> dict[str, Any]:
        write_heartbeat(store.store, by_hand)
        return {s["learner_id"]: store.learner_liveness(s["learner_id"]) for s in learners}

    fleet = LearnerFleet(run_url=url, run_id=store.manifest.run_id, learners=learners,
                         policy=HealingPolicy(relaunch_backoff_s=0.0, heartbeat_timeout_s=30.0))
    tag = run_tag(store.manifest.run_id)
    first = {a.learner_id: a for a in fleet.reconcile(liveness=live())}
    assert first["learner-0"].action == "launched" and first["learner-1"].action == "launched"
    assert first["learner-2"].action == "external"  # alive outside Prefect: adopted, not duplicated
    with _client() as client:
        runs = fleet.flow_runs(client)
        assert len(runs["learner-0"]) == 1 and len(runs["learner-1"]) == 1
        fr0 = runs["learner-0"][0]
        assert {tag, learner_tag("learner-0"), pool_tag("pool-a")} <= set(fr0.tags)
        assert fr0.work_pool_name == "pool-a" and fr0.parameters["learner_id"] == "learner-0"
        assert fr0.parent_task_run_id is None  # top level, not a subflow of whatever launched it
        # Scheduled runs are adopted; the same decision twice launches nothing new.
        again = {a.learner_id: a.action for a in fleet.reconcile(liveness=live())}
        assert again == {"learner-0": "adopted", "learner-1": "adopted", "learner-2": "external"}
        # A crashed learner is relaunched on its own pool; one a person cancelled stays cancelled.
        client.set_flow_run_state(fr0.id, Crashed(message="process exited -9"), force=True)
        client.set_flow_run_state(runs["learner-1"][0].id, Cancelled(), force=True)
        healed = {a.learner_id: a for a in fleet.reconcile(liveness=live())}
        assert healed["learner-0"].action == "relaunched" and healed["learner-1"].action == "cancelled-by-user"
        runs = fleet.flow_runs(client)
        assert len(runs["learner-0"]) == 2 and runs["learner-0"][0].work_pool_name == "pool-a"
        assert runs["learner-0"][0].state.is_scheduled()
        # A zombie: Prefect says Running, but the lease it holds has a heartbeat 100 s old.
        newest = runs["learner-0"][0]
        client.set_flow_run_state(newest.id, Running(), force=True)
        lease = take_lease(store.store, "learner-0", flow_run_id=str(newest.id))
        write_heartbeat(store.store, lease, clock=lambda: time.time() - 100.0)
        # Ages are on the store's clock: the heartbeat object itself is 100 s old (a local mtime).
        old = time.time() - 100.0
        os.utime(store.store.path(learner_heartbeat_key("learner-0", lease.incarnation)), (old, old))
        zombie = {a.learner_id: a for a in fleet.reconcile(liveness=live())}
        assert zombie["learner-0"].action == "zombie-relaunched", zombie["learner-0"].reason
        state = client.read_flow_run(newest.id).state
        assert state.type.value in ("CANCELLING", "CANCELLED") and state.message.startswith("atoll:")
        assert len(fleet.flow_runs(client)["learner-0"]) == 3
        # Each relaunch emitted atoll.learner.relaunched about the learner, naming both flow runs.
        from atoll.tasks.events import LEARNER_RELAUNCHED

        from .events_helpers import read_events

        relaunched = read_events(client, LEARNER_RELAUNCHED, at_least=2,
                                 resource_id=f"atoll.learner.{store.manifest.run_id}.learner-0")
        assert [e.payload["action"] for e in relaunched] == ["relaunched", "zombie-relaunched"]
        assert relaunched[0].payload["previous_state"] == "Crashed" and relaunched[0].payload["pool"] == "pool-a"
        assert {r.role for r in relaunched[1].related} == {"flow-run", "previous-flow-run"}
        # More than one page of the run's flow runs (round flow runs carry the run tag too): the
        # learners are still found, and nothing is launched twice.
        from prefect import flow as prefect_flow

        @prefect_flow(name="atoll-round")
        def _round() -> None: ...

        for i in range(230):
            client.create_flow_run(_round, name=f"round-{i:06d}", tags=[tag, "atoll-round"])
        before = {lid: len(v) for lid, v in fleet.flow_runs(client).items()}
        after = {a.learner_id: a.action for a in fleet.reconcile(liveness=live())}
        assert after["learner-0"] in ("adopted", "waiting") and after["learner-2"] == "external"
        assert {lid: len(v) for lid, v in fleet.flow_runs(client).items()} == before
        # Once the run is finished nothing is launched.
        assert {a.action for a in fleet.reconcile(finished=True)} == {"finished"}


@pytest.mark.parametrize("name,pool_type", [("process", "process"), ("docker", "docker"),
                                            ("kubernetes-gpu", "kubernetes")])
def test_work_pool_templates_validate(prefect_harness: None, name: str, pool_type: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.schema_tools.validation import is_valid_schema, validate

    template = json.loads((INFRA / "work-pools" / f"{name}.json").read_text())
    validate_base_job_template(template)
    is_valid_schema(template["variables"])
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    validate(defaults, template["variables"], raise_on_error=True)
    with _client() as client:
        pool = client.create_work_pool(WorkPoolCreate(name=f"tmpl-{name}", type=pool_type, base_job_template=template))
        assert pool.base_job_template["job_configuration"] == template["job_configuration"]
    if name == "kubernetes-gpu":
        container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
        assert container["image"] == "{{ image }}"
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
        assert refs["AWS_SECRET_ACCESS_KEY"] == {"name": "{{ credentials_secret }}", "key": "AWS_SECRET_ACCESS_KEY",
                                                 "optional": True}


def test_prefect_yaml_declares_the_deployments() -> None:
    body = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    # A deployment is named per flow: "default" is the training run's and retention's.
    deps = {(d["entrypoint"].rsplit(".", 1)[1], d["name"]): d for d in body["deployments"]}
    assert len(deps) == len(body["deployments"])
    assert set(deps) == {("training_run", "default"), ("prune_flow", "default"),
                         *(("learner_flow", pool) for pool in ("cpu-fast", "cpu-slow", "gpu-docker", "gpu-k8s"))}
    deps.update({name: d for (fn, name), d in list(deps.items()) if fn == "learner_flow"})
    for pool in ("cpu-fast", "cpu-slow", "gpu-docker", "gpu-k8s"):
        assert deps[pool]["work_pool"]["name"] == pool
        assert deps[pool]["entrypoint"] == "atoll.flows.learner.learner_flow"
    # Nothing is pulled from a host path: module entrypoints run from the installed atoll.
    assert body["pull"] == [] and not any("pull" in d for d in body["deployments"])


def test_prefect_deploy_accepts_prefect_yaml(prefect_harness: None) -> None:
    from prefect.settings import PREFECT_API_URL

    from atoll.ops.deploy import ensure_pools

    ensure_pools(("cpu-fast", "cpu-slow"))
    for pool, kind, template in (("gpu-docker", "docker", "docker"), ("gpu-k8s", "kubernetes", "kubernetes-gpu")):
        ensure_pools((pool,), pool_type=kind,
                     base_job_template=json.loads((INFRA / "work-pools" / f"{template}.json").read_text()))
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "ATOLL_IMAGE": "registry.test/atoll:9"}
    env.pop("ATOLL_PROJECT_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                           str(INFRA / "prefect.yaml")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with _client() as client:
        dep = client.read_deployment_by_name("atoll-learner/cpu-slow")
        assert dep.work_pool_name == "cpu-slow" and dep.entrypoint == "atoll.flows.learner.learner_flow"
        assert not dep.pull_steps  # no host path baked in
        k8s = client.read_deployment_by_name("atoll-learner/gpu-k8s")
        assert k8s.job_variables["image"] == "registry.test/atoll:9" and k8s.job_variables["gpu_count"] == 1
        assert not k8s.pull_steps and "AWS_SECRET_ACCESS_KEY" not in str(k8s.job_variables)
        docker = client.read_deployment_by_name("atoll-learner/gpu-docker")
        assert docker.job_variables["device_requests"] == [{"count": 1, "capabilities": [["gpu"]]}]
        assert docker.job_variables["env"]["ATOLL_SECRET_BLOCK"] == "atoll-bucket"
        assert client.read_deployment_by_name("atoll-prune/default").entrypoint == "atoll.flows.prune.prune_flow"
        train = client.read_deployment_by_name("atoll-training-run/default")
        assert train.parameter_openapi_schema["required"] == ["options"]
        assert "fleet" in train.parameter_openapi_schema["definitions"]["TrainingRunOptions"]["properties"]


def test_status_needs_no_prefect(smoke_run) -> None:
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    code = ("import sys, atoll.cli; rc = atoll.cli.main(['status', sys.argv[1]]); "
            "assert 'prefect' not in sys.modules, 'status imported prefect'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, smoke_run.url], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "6 of 6 rounds committed" in proc.stdout and "goodput" in proc.stdout
