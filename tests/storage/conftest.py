"""Backends for the storage contract suite: memory, a local folder, S3 (moto server), GCS (emulator).

Servers are real HTTP servers on free loopback ports, started once per session by the fixtures
below and stopped at the end. The same test functions run against every backend through the
parametrized ``backend`` fixture; a remote server starts only if a test asks for that backend.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

# gcsfs 2026.x hangs ~60 s per call against the emulator unless this is set before it is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest  # noqa: E402
from fsspec.core import url_to_fs  # noqa: E402

from atoll.storage import ObjectStore, RetryPolicy, RunHandle, RunReader  # noqa: E402
from atoll.storage.paths import join_url  # noqa: E402

BACKENDS = ("memory", "local", "s3", "gcs")
H = TypeVar("H", bound=RunHandle)
S3_BUCKET = "atoll-test"
GCS_BUCKET = "atoll-test"

GCS_NO_CREATE_ONCE = (
    "gcp-storage-emulator ignores ifGenerationMatch=0 (a second create overwrites), so GCS "
    "create-once cannot be proven locally; real GCS honours it"
)

for _name in ("werkzeug", "gcp_storage_emulator", "moto"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Backend:
    name: str
    base_url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    open_kwargs: dict[str, Any] = field(default_factory=dict)

    def new_url(self) -> str:
        return join_url(self.base_url, f"run-{uuid.uuid4().hex[:10]}")

    def fs_and_root(self, url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
        opts = dict(self.storage_options if options is None else options)
        if self.name == "local":
            opts.setdefault("auto_mkdir", True)
        return url_to_fs(url, **opts)

    def open(
        self,
        url: str,
        *,
        wrap: Callable[[Any], Any] | None = None,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] | None = None,
        fresh: bool = False,
        role: type[H] = RunReader,
        **kwargs: Any,
    ) -> H:
        """Open the run as ``role`` (a bucket-policy role's class: the reader's by default);
        ``fresh=True`` gives it its own filesystem instance (own listing cache, own connections),
        like a separate process would have."""
        kw = {**self.open_kwargs, **kwargs}
        options = dict(self.storage_options)
        if fresh and self.name in ("s3", "gcs"):
            options["skip_instance_cache"] = True
        if wrap is None and retry is None and sleep is None:
            return role.open(url, options, **kw)
        fs, root = self.fs_and_root(url, options)
        store = ObjectStore(
            wrap(fs) if wrap else fs,
            root,
            url=url,
            storage_options=self.storage_options,
            retry=retry or RetryPolicy(attempts=4, base_delay_s=0.0, max_delay_s=0.0),
            sleep=sleep or (lambda s: None),
        )
        return role.open(url, store=store, **kw)

    def raw_put(self, url: str, key: str, data: bytes) -> None:
        """Write bytes behind the protocol's back (to plant bad input)."""
        fs, root = self.fs_and_root(url)
        fs.pipe_file(join_url(root, key), data)
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache()

    def raw_get(self, url: str, key: str) -> bytes:
        fs, root = self.fs_and_root(url)
        return bytes(fs.cat_file(join_url(root, key)))


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    import moto_s3

    with moto_s3.serving(S3_BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=GCS_BUCKET)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.05)
        yield endpoint
    finally:
        server.stop()


def make_backend(name: str, request: pytest.FixtureRequest) -> Backend:
    if name == "memory":
        return Backend(name, f"memory://atoll-tests/{uuid.uuid4().hex[:8]}")
    if name == "local":
        return Backend(name, str(request.getfixturevalue("tmp_path")))
    if name == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        return Backend(
            name,
            f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:8]}",
            {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            },
        )
    if name == "gcs":
        endpoint = request.getfixturevalue("gcs_endpoint")
        return Backend(
            name,
            f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:8]}",
            {"endpoint_url": endpoint, "token": "anon", "project": "atoll-test"},
            # The emulator ignores ifGenerationMatch=0: the capability probe would (rightly) refuse it.
            {"unsafe_allow_overwrite": True},
        )
    raise ValueError(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    return make_backend(request.param, request)


@pytest.fixture(params=["local", "s3"])
def hostile_backend(request: pytest.FixtureRequest) -> Backend:
    """A local folder and moto's S3 server: where the integrity and hostile-bucket suites run."""
    return make_backend(request.param, request)
