"""Real parts for the integration tests: a moto S3 server on a free loopback port (same pattern as
tests/storage/conftest.py) and an isolated PREFECT_HOME for this process."""

from __future__ import annotations

import logging
import os
import tempfile

os.environ["PREFECT_HOME"] = os.environ.get("ATOLL_IT_PREFECT_HOME") or tempfile.mkdtemp(prefix="atoll-it-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

S3_BUCKET = "atoll-it"

for _name in ("werkzeug", "moto"):
    logging.getLogger(_name).setLevel(logging.ERROR)


@dataclass
class S3:
    endpoint: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    @property
    def env(self) -> dict[str, str]:
        """What a worker's flow processes need to reach the bucket (no secrets in flow parameters)."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    import moto_s3

    with moto_s3.serving(S3_BUCKET) as endpoint:
        yield S3(endpoint, S3_BUCKET)
