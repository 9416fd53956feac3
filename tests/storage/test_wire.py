"""What crosses the wire, counted by hand: every request and body byte an ObjectStore sends.

The hand count runs on a local folder and on moto's S3 server; on S3 a counting reverse proxy sits
between s3fs and moto, so the store's own counts are checked against the HTTP requests that really
reached the server (method, body bytes each way), not only against the model of the backend.
"""

from __future__ import annotations

import errno
import http.client
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from storage_helpers import FsProxy, counters, fragment_delta, init_run

from atoll.storage import LearnerStore, ObjectStore, RetryPolicy, RunReader, paths
from atoll.storage.wire import (
    PART_BYTES,
    REPORT_LIMIT,
    WireCounts,
    WireMeter,
    meter_from_report,
    requests_sent,
    tokens_from_report,
    wire_from_report,
    wire_report,
)

# -- the counts themselves -----------------------------------------------------------------------


def test_counts_add_and_subtract_field_by_field() -> None:
    a = WireCounts(puts=2, gets=3, heads=1, lists=4, deletes=1, bytes_up=100, bytes_down=7)
    b = WireCounts(puts=1, gets=1, lists=1, bytes_up=40, bytes_down=2)
    assert a + b == WireCounts(puts=3, gets=4, heads=1, lists=5, deletes=1, bytes_up=140, bytes_down=9)
    assert (a + b) - b == a
    assert a.requests == 11 and a.bytes_total == 107
    assert a.to_dict() == {"puts": 2, "gets": 3, "heads": 1, "lists": 4, "deletes": 1, "bytes_up": 100, "bytes_down": 7}
    assert a.line() == "11 req (2 PUT 3 GET 1 HEAD 4 LIST 1 DEL), up 100 B, down 7 B"


def test_the_backend_model_counts_what_each_client_sends() -> None:
    # A plain store (local folder, memory): one request per operation.
    assert requests_sent("file", "put", up=10) == WireCounts(puts=1, bytes_up=10)
    assert requests_sent("file", "create", up=3 * PART_BYTES) == WireCounts(puts=1, bytes_up=3 * PART_BYTES)
    assert requests_sent("memory", "get", down=5, whole=True) == WireCounts(gets=1, bytes_down=5)
    assert requests_sent("file", "list", entries=0) == WireCounts(lists=1)
    # S3: multipart from 100 MiB (start + one part per 50 MiB + complete).
    assert requests_sent("s3", "put", up=2 * PART_BYTES - 1) == WireCounts(puts=1, bytes_up=2 * PART_BYTES - 1)
    assert requests_sent("s3", "put", up=2 * PART_BYTES + 1).puts == 2 + 3
    # S3 reads: ranged = one GET; whole = HEAD (size) + GET, or HEAD + one GET per 50 MiB.
    assert requests_sent("s3", "get", down=10) == WireCounts(gets=1, bytes_down=10)
    assert requests_sent("s3", "get", down=10, whole=True) == WireCounts(heads=1, gets=1, bytes_down=10)
    assert requests_sent("s3", "get", down=PART_BYTES + 1, whole=True) == WireCounts(heads=1, gets=2,
                                                                                   bytes_down=PART_BYTES + 1)
    assert requests_sent("s3", "get", down=None, whole=True) == WireCounts(heads=1)  # the HEAD failed
    assert requests_sent("s3", "get", whole=True, missing=True) == WireCounts(heads=1, lists=1)  # a folder?
    assert requests_sent("s3", "get", down=None) == WireCounts(gets=1)
    # Listings: a page per 1,000 entries; nothing found costs S3 a second LIST, GCS a lookup.
    assert requests_sent("s3", "list", entries=2500) == WireCounts(lists=3)
    assert requests_sent("s3", "list", entries=0) == WireCounts(lists=2)
    assert requests_sent("gs", "list", entries=0) == WireCounts(lists=1, heads=1)
    assert requests_sent("s3", "list", entries=None) == WireCounts(lists=1)
    # GCS: resumable upload from 50 MiB (start + one request per 50 MiB).
    assert requests_sent("gcs", "put", up=PART_BYTES).puts == 2
    assert requests_sent("s3", "delete") == WireCounts(deletes=1)
    with pytest.raises(ValueError, match="unknown store operation"):
        requests_sent("s3", "copy")


@pytest.mark.parametrize("junk", [None, 3, "lots", [1, 2], {"nothing": 1}, {"puts": "9"}, {"puts": True},
                                  {"puts": 1.5}, {"puts": float("nan")}])
def test_a_report_that_carries_no_counts_is_none(junk) -> None:
    assert wire_from_report(junk) is None


def test_a_report_names_its_meter_and_only_a_plain_name_is_kept() -> None:
    report = wire_report(WireCounts(puts=1), tokens=64, meter=WireMeter().id)
    assert report["tokens"] == 64 and meter_from_report(report) == report["meter"] != WireMeter().id
    for junk in ("", "x" * 33, "../x", "a b", 5, None):
        assert meter_from_report({"meter": junk}) == ""
    assert tokens_from_report({"tokens": -1}) == 0 and tokens_from_report({"tokens": 2.0}) == 0
    assert tokens_from_report("x") == 0


def test_reported_counts_are_clipped_and_junk_fields_count_zero() -> None:
    got = wire_from_report({"puts": -4, "gets": 10**30, "heads": True, "lists": 2.0, "deletes": 3,
                            "bytes_up": 2**60, "bytes_down": "x", "extra": 7})
    assert got == WireCounts(puts=0, gets=REPORT_LIMIT, deletes=3, bytes_up=REPORT_LIMIT)
    assert wire_from_report({"bytes_up": 5}, limit=4) == WireCounts(bytes_up=4)


# -- counting in the store -----------------------------------------------------------------------


class _Flaky:
    """Fail the next ``n`` writes and reads with a connection reset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, name, args, kwargs, fs):
        if name in ("pipe_file", "cat_file") and self.n > 0:
            self.n -= 1
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        return None


def test_every_attempt_of_a_retried_request_is_counted(tmp_path) -> None:
    fs = FsProxy(ObjectStore.open(f"memory://wire-{tmp_path.name}").fs, flaky := _Flaky(2))
    store = ObjectStore(fs, f"/wire-{tmp_path.name}", retry=RetryPolicy(attempts=4, base_delay_s=0.0, max_delay_s=0.0),
                        sleep=lambda s: None)
    store.put("a", b"12345")  # two resets, then it lands: three PUTs carried the body
    assert store.wire_counts() == WireCounts(puts=3, bytes_up=15)
    flaky.n = 1
    assert store.get("a") == b"12345"  # one reset (nothing came down), then the read
    assert store.wire_counts() - WireCounts(puts=3, bytes_up=15) == WireCounts(gets=2, bytes_down=5)


def test_threads_sharing_a_store_and_its_siblings_add_up_exactly(tmp_path) -> None:
    rs = RunReader.open(str(tmp_path), check_create_once=False)
    handles = [rs, rs.sibling(), rs.sibling().sibling()]
    body = b"x" * 100

    def work(i: int) -> None:
        store = handles[i % 3].store
        for j in range(40):
            store.put(f"t{i}/{j}", body)
            assert store.get(f"t{i}/{j}", max_bytes=1000) == body
        store.list(f"t{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(h.store is rs.store for h in handles)
    assert rs.store.wire_counts() == WireCounts(puts=240, gets=240, lists=6, bytes_up=24_000, bytes_down=24_000)


# -- the hand count, on a local folder and on S3 behind a counting proxy ---------------------------


@dataclass(frozen=True)
class Seen:
    """One HTTP request that reached the S3 server."""

    method: str
    target: str
    up: int
    """Object bytes in the request body (the decoded length of an aws-chunked body)."""
    down: int
    """Bytes in the response body of a GET."""


class CountingProxy:
    """A reverse proxy that forwards every request to ``upstream`` and logs it as a :class:`Seen`."""

    def __init__(self, upstream: str) -> None:
        self.seen: list[Seen] = []
        host, port = urlsplit(upstream).hostname, urlsplit(upstream).port
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "content-length")}
                conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request(self.command, self.path, body=body, headers={**headers, "Content-Length": str(len(body))})
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                decoded = self.headers.get("x-amz-decoded-content-length")
                up = int(decoded) if decoded is not None else (len(body) if self.command == "PUT" else 0)
                down = len(data) if self.command == "GET" and "list-type=" not in self.path and resp.status < 300 else 0
                proxy.seen.append(Seen(self.command, self.path, up, down))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                        self.send_header(k, v)
                length_out = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length_out or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def counts(self) -> WireCounts:
        """What the server saw, in the store's terms."""
        kinds = {"PUT": "puts", "HEAD": "heads", "DELETE": "deletes"}
        out: dict[str, int] = {"bytes_up": sum(s.up for s in self.seen), "bytes_down": sum(s.down for s in self.seen)}
        for s in self.seen:
            if s.method == "GET":
                kind = "lists" if "list-type=" in s.target else "gets"
            elif s.method == "POST":
                kind = "deletes" if "delete" in s.target else "puts"
            else:
                kind = kinds[s.method]
            out[kind] = out.get(kind, 0) + 1
        return WireCounts(**out)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def s3_proxy(hostile_backend) -> Iterator[CountingProxy | None]:
    if hostile_backend.name != "s3":
        yield None
        return
    proxy = CountingProxy(hostile_backend.storage_options["client_kwargs"]["endpoint_url"])
    try:
        yield proxy
    finally:
        proxy.close()


def _open_counted(backend, url: str, proxy: CountingProxy | None) -> LearnerStore:
    """A fresh handle on the run (its own client and counts), through the proxy on S3."""
    if proxy is None:
        return LearnerStore.open(url, backend.storage_options, check_create_once=False)
    options = {**backend.storage_options, "skip_instance_cache": True,
               "client_kwargs": {**backend.storage_options["client_kwargs"], "endpoint_url": proxy.endpoint}}
    return LearnerStore.open(url, options, check_create_once=False)


def test_hand_count_publish_read_back_and_list(hostile_backend, s3_proxy: CountingProxy | None) -> None:
    """Open a run, publish one contribution, list it, read it back, look at an empty folder,
    delete the record: each request and byte counted by hand."""
    backend = hostile_backend
    url = backend.new_url()
    init_run(backend.open(url))
    manifest = len(backend.raw_get(url, paths.RUN_MANIFEST))
    rs = _open_counted(backend, url, s3_proxy)
    s3 = backend.name == "s3"

    rs.manifest  # noqa: B018 - one ranged GET of run.json
    rec = rs.publish_contribution("l0", 0, 0, counters(), fragment_delta(rs, 0))  # PUT payload, PUT record
    payload, record = rec.payload.nbytes, len(backend.raw_get(url, rec.key))
    after_publish = WireCounts(gets=1, puts=2, bytes_up=payload + record, bytes_down=manifest)
    assert rs.store.wire_counts() == after_publish

    listing = rs.list_contributions(0, 0, learner_ids=["l0"])  # one LIST (one entry), one GET (the record)
    assert [r.key for r in listing.records] == [rec.key]
    rs.load_contribution(listing.records[0])  # one ranged GET of the payload
    empty = rs.list_contributions(1, 0, learner_ids=["l0"])  # nothing there: still one LIST (a capped one)
    assert not empty.records
    assert rs.store.list("learners/l0/nothing/") == []  # an uncapped LIST of nothing: S3 lists the parent too
    rs.store.delete(rec.key)
    expected = after_publish + WireCounts(lists=2 + (2 if s3 else 1), gets=2, deletes=1,
                                          bytes_down=record + payload)
    assert rs.store.wire_counts() == expected
    assert rs.store.wire_counts().line() == (
        f"{expected.requests} req (2 PUT 3 GET 0 HEAD {expected.lists} LIST 1 DEL), "
        f"up {payload + record:,} B, down {manifest + record + payload:,} B")
    if s3_proxy is not None:
        assert s3_proxy.counts() == expected  # the server saw exactly what the store counted


def test_hand_count_an_unranged_read_and_a_refused_create(hostile_backend, s3_proxy: CountingProxy | None) -> None:
    """An unranged read (S3 sizes the object with a HEAD first), a create that finds the object
    there (the body still went up), and an unranged read of nothing (on S3: a HEAD, then a LIST of
    the name in case it is a folder)."""
    backend = hostile_backend
    url = backend.new_url()
    init_run(backend.open(url))
    rs = _open_counted(backend, url, s3_proxy)
    s3 = backend.name == "s3"
    manifest = len(backend.raw_get(url, paths.RUN_MANIFEST))
    assert rs.exists()  # an unranged GET of run.json
    assert not rs.store.create(paths.RUN_MANIFEST, b"{}")
    assert rs.store.get_or_none("nothing-here") is None  # unranged, missing: on S3 a HEAD, then a LIST
    expected = WireCounts(heads=2 if s3 else 0, gets=2 if not s3 else 1, lists=1 if s3 else 0, puts=1, bytes_up=2,
                          bytes_down=manifest)
    assert rs.store.wire_counts() == expected
    if s3_proxy is not None:
        assert s3_proxy.counts() == expected, s3_proxy.seen
