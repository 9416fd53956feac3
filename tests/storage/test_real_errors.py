"""Transient or not, classified on the exceptions s3fs and gcsfs really raise.

test_faults.py injects hand-made exceptions through a wrapper; here the storage clients raise
their own: a moto S3 server that was stopped (connection refused), and a small HTTP server that
answers every request with one status and an S3 (XML) or GCS (JSON) error body, the way those
services do. ``is_transient`` keys on exception types, HTTP statuses and S3 error codes, so each
case below is decided by what the client raised, not by its message text.
"""

from __future__ import annotations

import errno
import json
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from atoll.ops.procs import free_port
from atoll.storage import ObjectStore, RetryPolicy, TransientStorageError, is_transient

ATTEMPTS = 3


class ErrorServer:
    """An HTTP server that answers every request with ``status`` and ``body``; counts requests."""

    def __init__(self) -> None:
        self.status = 503
        self.body = b""
        self.content_type = "application/xml"
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                server.requests.append((self.command, self.path))
                self.send_response(server.status)
                self.send_header("Content-Type", server.content_type)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(server.body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer_s3(self, status: int, code: str) -> None:
        self.status, self.content_type, self.requests = status, "application/xml", []
        self.body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                     f"<Message>the test server says {code}</Message></Error>").encode()

    def answer_gcs(self, status: int, message: str = "test") -> None:
        self.status, self.content_type, self.requests = status, "application/json", []
        self.body = json.dumps({"error": {"code": status, "message": message}}).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def error_server() -> Iterator[ErrorServer]:
    server = ErrorServer()
    try:
        yield server
    finally:
        server.close()


def s3_fs(endpoint: str):
    import s3fs

    fs = s3fs.S3FileSystem(
        key="testing", secret="testing", skip_instance_cache=True,
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
        # One HTTP request per call: botocore's and s3fs's own retries off, so ours are counted.
        config_kwargs={"retries": {"total_max_attempts": 1}},
    )
    fs.retries = 1
    return fs


@pytest.fixture
def gcs_no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs retries 6 times with 1, 2, 4, 8, 16 s sleeps before it raises; skip the sleeping."""
    import gcsfs.retry

    async def no_sleep(_seconds: float) -> None:
        return None

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_sleep))


def gcs_fs(endpoint: str):
    import gcsfs

    return gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", project="atoll-test", skip_instance_cache=True)


def store_on(fs, root: str) -> ObjectStore:
    return ObjectStore(fs, root, retry=RetryPolicy(attempts=ATTEMPTS, base_delay_s=0.0, max_delay_s=0.0),
                       sleep=lambda s: None)


def raised_by(fn) -> BaseException:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the point is to look at it
        return e
    raise AssertionError("expected the call to raise")


# -- S3 (s3fs over aiobotocore) ----------------------------------------------------------------


def test_s3_server_gone_is_transient_and_retried() -> None:
    import boto3
    import botocore.exceptions

    import moto_s3

    server = moto_s3.start(free_port())
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="gone")
        fs = s3_fs(endpoint)
        store = store_on(fs, "gone/run")
        store.put("x", b"payload")
        assert store.get("x") == b"payload"
    finally:
        server.stop()
    for op in (lambda: fs.cat_file("gone/run/x"), lambda: fs.pipe_file("gone/run/y", b"1"),
               lambda: fs.ls("gone/run", refresh=True)):
        e = raised_by(op)
        assert isinstance(e, botocore.exceptions.EndpointConnectionError), repr(e)
        assert is_transient(e)
    before = store.op_counts["retry"]
    with pytest.raises(TransientStorageError, match=r"^get s3://gone/run/x failed after 3 attempt") as ei:
        store.get("x")
    assert isinstance(ei.value.__cause__, botocore.exceptions.EndpointConnectionError)
    assert store.op_counts["retry"] - before == ATTEMPTS - 1


@pytest.mark.parametrize("status,code,err", [(503, "SlowDown", errno.EBUSY), (500, "InternalError", None),
                                             (429, "TooManyRequests", errno.EIO)],
                         ids=["503-slowdown", "500-internal", "429-too-many"])
def test_s3_throttling_and_server_errors_are_transient(error_server: ErrorServer, status, code, err) -> None:
    import botocore.exceptions

    error_server.answer_s3(status, code)
    fs = s3_fs(error_server.endpoint)
    e = raised_by(lambda: fs.cat_file("bkt/run/x"))
    # s3fs translates botocore's ClientError into an OSError and keeps it as the cause.
    assert type(e) is OSError and e.errno == (err or getattr(errno, "EREMOTEIO", errno.EIO)), repr(e)
    assert isinstance(e.__cause__, botocore.exceptions.ClientError)
    assert e.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert is_transient(e)
    store = store_on(fs, "bkt/run")
    error_server.requests.clear()
    with pytest.raises(TransientStorageError, match=r"after 3 attempt"):
        store.get("x")
    assert len(error_server.requests) == ATTEMPTS  # every attempt reached the server


@pytest.mark.parametrize("status,code,exc", [(404, "NoSuchKey", FileNotFoundError),
                                             (403, "AccessDenied", PermissionError)], ids=["404", "403"])
def test_s3_missing_and_forbidden_are_not_retried(error_server: ErrorServer, status, code, exc) -> None:
    error_server.answer_s3(status, code)
    fs = s3_fs(error_server.endpoint)
    e = raised_by(lambda: fs.cat_file("bkt/run/x"))
    assert isinstance(e, exc) and not is_transient(e)
    store = store_on(fs, "bkt/run")
    with pytest.raises(exc, match="Forbidden" if status == 403 else f"the test server says {code}"):
        store.get("x")
    assert store.op_counts["retry"] == 0


# -- GCS (gcsfs over aiohttp) ------------------------------------------------------------------


def test_gcs_server_gone_is_transient(gcs_no_backoff: None) -> None:
    import aiohttp
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="gone")
    server.start()
    try:
        fs = gcs_fs(f"http://127.0.0.1:{port}")
        fs.pipe_file("gone/run/x", b"payload")
        assert fs.cat_file("gone/run/x") == b"payload"
    finally:
        server.stop()
    e = raised_by(lambda: fs.cat_file("gone/run/x"))
    assert isinstance(e, aiohttp.ClientConnectorError), repr(e)
    assert is_transient(e)
    with pytest.raises(TransientStorageError, match=r"after 3 attempt") as ei:
        store_on(fs, "gone/run").get("x")
    assert isinstance(ei.value.__cause__, aiohttp.ClientConnectionError)


@pytest.mark.parametrize("status", [503, 500, 429, 408])
def test_gcs_http_errors_with_a_retryable_status_are_transient(error_server: ErrorServer, gcs_no_backoff: None,
                                                               status: int) -> None:
    from gcsfs.retry import HttpError

    error_server.answer_gcs(status)
    fs = gcs_fs(error_server.endpoint)
    e = raised_by(lambda: fs.cat_file("bkt/run/x"))
    assert isinstance(e, HttpError) and e.code == status
    assert is_transient(e)
    # The same, constructed as gcsfs constructs it, with a message that names no status at all.
    assert is_transient(HttpError({"code": status, "message": "backend said no"}))
    with pytest.raises(TransientStorageError, match=r"after 3 attempt"):
        store_on(fs, "bkt/run").get("x")


def test_gcs_bad_gateway_is_transient(error_server: ErrorServer, gcs_no_backoff: None) -> None:
    """gcsfs turns a 502 into requests' ProxyError (a requests ConnectionError, not a builtin one)."""
    import requests

    error_server.answer_gcs(502)
    e = raised_by(lambda: gcs_fs(error_server.endpoint).cat_file("bkt/run/x"))
    assert isinstance(e, requests.exceptions.ProxyError)
    assert is_transient(e)


@pytest.mark.parametrize("status,exc", [(404, FileNotFoundError), (403, OSError), (400, ValueError)],
                         ids=["404", "403", "400"])
def test_gcs_missing_forbidden_and_bad_request_are_not_retried(error_server: ErrorServer, gcs_no_backoff: None,
                                                               status, exc) -> None:
    from gcsfs.retry import HttpError

    error_server.answer_gcs(status, "the name is invalid" if status == 400 else "test")
    fs = gcs_fs(error_server.endpoint)
    e = raised_by(lambda: fs.cat_file("bkt/run/x"))
    assert type(e) is exc and not is_transient(e)
    assert not is_transient(HttpError({"code": status, "message": "x"}))
    store = store_on(fs, "bkt/run")
    error_server.requests.clear()
    with pytest.raises(exc, match={404: "b/bkt/o/run%2Fx", 403: "Forbidden", 400: "Bad Request"}[status]):
        store.get("x")
    assert store.op_counts["retry"] == 0 and len(error_server.requests) == 1


def test_message_text_alone_decides_nothing() -> None:
    """No status, no type, no errno: words like '503' or 'SlowDown' in a message are not evidence."""
    assert not is_transient(OSError("An error occurred (SlowDown): Please reduce your request rate. 503"))
    assert not is_transient(RuntimeError("connection reset by peer"))
    assert not is_transient(Exception("Service Unavailable"))
