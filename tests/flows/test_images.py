"""Image-based deployments, offline: the rendered kubernetes Job and docker container, `atoll deploy
--image/--job-variable/--concurrency/--secret-block`, and bucket credentials from a Secret block."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from atoll.flows.credentials import SECRET_BLOCK_ENV, export_secret_env, secret_env_values
from atoll.ops.deploy import parse_job_variables, plaintext_credentials

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
POOLS = ROOT / "infra" / "work-pools"


def _template(name: str) -> dict[str, Any]:
    return json.loads((POOLS / f"{name}.json").read_text())


def _render(template: dict[str, Any], job_variables: dict[str, Any]) -> dict[str, Any]:
    """The job configuration a worker builds: Prefect's own templating (defaults, then the
    deployment's job variables, env deep-merged), as BaseJobConfiguration does it."""
    import anyio
    from prefect.utilities.schema_tools.validation import validate
    from prefect.workers.base import BaseJobConfiguration

    class Rendered(BaseJobConfiguration):
        model_config = {"extra": "allow"}

    validate(job_variables, template["variables"], raise_on_error=True, ignore_required=True)
    config = anyio.run(lambda: Rendered.from_template_and_values(copy.deepcopy(template), job_variables))
    return config.model_dump()


def _k8s_container_env(rendered: dict[str, Any]) -> list[dict[str, Any]]:
    """What prefect-kubernetes (0.8) does with a literal env list in the template: the job's own env
    (a dict: PREFECT_API_URL, the deployment's env ...) is prepended as name/value pairs and the
    template's entries (our secretKeyRef references) are kept."""
    container = rendered["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    job_env = [{"name": k, "value": v} for k, v in (rendered.get("env") or {}).items()]
    names = {e["name"] for e in job_env}
    return [*job_env, *[e for e in container["env"] if e.get("name") not in names]]


def test_rendered_kubernetes_job(prefect_harness: None) -> None:
    jv = parse_job_variables(["image=registry.test/atoll:1.2", "gpu_count=2", "credentials_secret=bucket-s3",
                              'node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}',
                              "env.ATOLL_SECRET_BLOCK=unused-here", "env.OMP_NUM_THREADS=1"])
    rendered = _render(_template("kubernetes-gpu"), jv)
    job = rendered["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert container["image"] == "registry.test/atoll:1.2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2  # an int, as kubernetes wants
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    # Credentials: references to the pool's Secret, never values.
    env = _k8s_container_env(rendered)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert set(refs) >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "ATOLL_KEYRING"}
    assert {r["name"] for r in refs.values()} == {"bucket-s3"} and all(r["optional"] for r in refs.values())
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    assert plain["OMP_NUM_THREADS"] == "1" and not plaintext_credentials({"env": plain})
    assert all(set(e) == {"name", "value"} or set(e) == {"name", "valueFrom"} for e in env)
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"] == {"secretName": "bucket-s3", "optional": True}
    assert container["securityContext"]["runAsNonRoot"] is True and container["securityContext"]["runAsUser"] != 0
    assert "{{" not in json.dumps(job)  # every placeholder was filled


def test_rendered_docker_container_gets_gpus(prefect_harness: None) -> None:
    from docker.types import HostConfig

    jv = parse_job_variables(["image=atoll:latest", 'device_requests=[{"count": 1, "capabilities": [["gpu"]]}]',
                              f"env.{SECRET_BLOCK_ENV}=atoll-bucket"])
    rendered = _render(_template("docker"), jv)
    assert rendered["image"] == "atoll:latest"
    kwargs = rendered["container_create_kwargs"]
    host = HostConfig(version="1.44", device_requests=kwargs["device_requests"], shm_size=kwargs["shm_size"])
    assert host["DeviceRequests"] == [{"Driver": "", "Count": 1, "DeviceIDs": [], "Capabilities": [["gpu"]],
                                       "Options": {}}]
    assert rendered["env"][SECRET_BLOCK_ENV] == "atoll-bucket"
    # The pool's default: no GPU request (a CPU docker host still works).
    assert _render(_template("docker"), {})["container_create_kwargs"]["device_requests"] == []


def test_job_variables_and_credential_guard() -> None:
    assert parse_job_variables(["gpu_count=2", "image=a/b:1", "flag=true", 'env={"A": 1}', "env.B=x"]) == {
        "gpu_count": 2, "image": "a/b:1", "flag": True, "env": {"A": "1", "B": "x"}}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_job_variables(["gpu_count"])
    assert plaintext_credentials({"env": {"AWS_SECRET_ACCESS_KEY": "x", "AWS_ENDPOINT_URL": "u",
                                          "PREFECT_API_KEY": "k", "HF_TOKEN": "t"}, "image": "i"}) == [
        "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"]
    assert plaintext_credentials({"credentials_secret": "name-only", "gpu_count": 1}) == []


def test_secret_env_values() -> None:
    assert secret_env_values('{"AWS_ACCESS_KEY_ID": "a", "PORT": 9}', block="b") == {"AWS_ACCESS_KEY_ID": "a",
                                                                                    "PORT": "9"}
    for bad in ("not json", "[1]", '{"bad name": "x"}', '{"A": {"nested": 1}}'):
        with pytest.raises(ValueError, match="Secret block 'b'"):
            secret_env_values(bad, block="b")


def test_credentials_come_from_a_secret_block(prefect_harness: None) -> None:
    from prefect.blocks.system import Secret

    Secret(value={"AWS_ACCESS_KEY_ID": "AKIA-test", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}).save(
        "atoll-test-bucket", overwrite=True)
    env = {SECRET_BLOCK_ENV: "atoll-test-bucket", "AWS_ACCESS_KEY_ID": "from-the-pool-secret"}
    assert export_secret_env(environ=env) == ["AWS_SECRET_ACCESS_KEY"]
    assert env["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"
    assert env["AWS_ACCESS_KEY_ID"] == "from-the-pool-secret"  # already set (e.g. secretKeyRef) wins
    assert export_secret_env(environ={}) == []  # no block named: nothing happens


def test_atoll_deploy_with_image_job_variables_and_concurrency(prefect_harness: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from prefect.client.orchestration import get_client

    from atoll import cli
    from atoll.ops.deploy import ensure_pools

    ensure_pools(("img-gpu",), pool_type="kubernetes", base_job_template=_template("kubernetes-gpu"))
    ensure_pools(("img-control",))
    rc = cli.main(["deploy", "--pools", "img-gpu", "--control-pool", "img-control", "--image", "reg.test/atoll:2",
                   "--job-variable", "gpu_count=2", "--job-variable", "credentials_secret=s3-creds",
                   "--concurrency", "4", "--secret-block", "atoll-bucket"])
    assert rc == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "work pool img-gpu: concurrency limit 4" in out
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("atoll-learner/img-gpu")
        assert dep.job_variables["image"] == "reg.test/atoll:2" and dep.job_variables["gpu_count"] == 2
        assert dep.job_variables["credentials_secret"] == "s3-creds"
        assert dep.job_variables["env"][SECRET_BLOCK_ENV] == "atoll-bucket"
        assert client.read_work_pool("img-gpu").concurrency_limit == 4  # one learner per GPU slot
        assert client.read_work_pool("img-control").concurrency_limit is None
        train = client.read_deployment_by_name("atoll-training-run/default")
        assert train.work_pool_name == "img-control" and "image" not in train.job_variables  # a process pool
    # Credentials as plaintext job variables are refused.
    rc = cli.main(["deploy", "--pools", "img-gpu", "--control-pool", "img-control", "--image", "x",
                   "--env", "AWS_SECRET_ACCESS_KEY=oops"])
    assert rc == 2 and "refusing to put AWS_SECRET_ACCESS_KEY" in capsys.readouterr().err
