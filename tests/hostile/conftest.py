"""Backends of the hostile-bucket suite: a local folder and moto's S3 server (a real HTTP server
on a free loopback port, started once per session), the same pattern as tests/storage/conftest.py."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest  # noqa: E402
from hostile_helpers import PRE_ROUNDS, Backend, HostileRun  # noqa: E402

for _name in ("werkzeug", "moto", "botocore", "s3fs"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def hostile_moto_endpoint() -> Iterator[str]:
    """moto's S3 server (tests/moto_s3.py: create-once made atomic) in a child process: on the
    suite's 2 cores it then runs beside the test process instead of competing with it for one
    interpreter lock."""
    port = _free_port()
    script = Path(__file__).resolve().parents[1] / "moto_s3.py"
    proc = subprocess.Popen([sys.executable, str(script), "-p", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """A fresh run root on a local folder or on moto's S3 server."""
    if request.param == "local":
        return Backend("local", str(request.getfixturevalue("tmp_path") / "run"), {})
    endpoint = request.getfixturevalue("hostile_moto_endpoint")
    # A bucket per test: moto lists a prefix by scanning the whole bucket, so one shared bucket
    # makes every later test slower.
    bucket = f"atoll-hostile-{uuid.uuid4().hex[:12]}"
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    return Backend(
        "s3",
        f"s3://{bucket}/run",
        {"key": "testing", "secret": "testing",
         "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}},
    )


@pytest.fixture
def run(backend: Backend) -> HostileRun:
    """A run with PRE_ROUNDS committed rounds; ``run.before`` holds them as a fresh reader sees them."""
    r = HostileRun(backend)
    r.rounds(PRE_ROUNDS)
    r.before = r.committed()
    return r
