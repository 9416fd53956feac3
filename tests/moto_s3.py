"""moto's S3 server with create-once made atomic, for the tests, the benchmarks and the WAN lab.

moto answers ``PutObject`` with ``If-None-Match: *`` by checking that the key is absent and then
storing the object, two steps with no lock between them. Two racing creates of one key can then
both succeed when the server's threads interleave (seen on a loaded 2-core machine: two lease
takers both got incarnation 3). Real S3 lets exactly one of them win, and atoll's create-once
commits and leases are built on that, so the server the suite tests against must too: this module
serialises moto's PutObject handling behind one lock.

In a process of its own::

    python tests/moto_s3.py -H 127.0.0.1 -p 5000   # prints "ready" once it listens; stops on SIGTERM

In this process: ``start(port)`` returns a started ``ThreadedMotoServer``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

_PUT_LOCK = threading.Lock()


def make_creates_atomic() -> None:
    """Serialise moto's PutObject handler (idempotent): its If-None-Match check and its write then
    happen as one step, as in S3."""
    from moto.s3.responses import S3Response

    original = S3Response.put_object
    if getattr(original, "atomic_create", False):
        return

    def put_object(self: Any) -> Any:
        with _PUT_LOCK:
            return original(self)

    put_object.atomic_create = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


def start(port: int, host: str = "127.0.0.1") -> Any:
    """A started ThreadedMotoServer on ``host:port`` whose creates are atomic (call ``.stop()``)."""
    from moto.server import ThreadedMotoServer

    make_creates_atomic()
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    return server


@contextlib.contextmanager
def serving(bucket: str) -> Iterator[str]:
    """A started server on a free loopback port with ``bucket`` created; yields its endpoint URL."""
    import boto3

    from atoll.ops.procs import free_port

    server = start(free_port())
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-H", "--host", default="127.0.0.1")
    p.add_argument("-p", "--port", type=int, required=True)
    args = p.parse_args(argv)
    for name in ("werkzeug", "moto"):
        logging.getLogger(name).setLevel(logging.ERROR)
    server = start(args.port, args.host)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    print("ready", flush=True)
    while not stopped.wait(1.0):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
