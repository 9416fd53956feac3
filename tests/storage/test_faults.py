"""Transient errors, half-failed writes and secrets, on every backend (fault-injecting fs wrapper)."""

from __future__ import annotations

import errno

import pytest
import torch
from storage_helpers import FsProxy, counters, fragment_delta, init_run

from atoll.storage import (
    LearnerStore,
    ObjectStore,
    RetryPolicy,
    RunReader,
    SynchronizerStore,
    TransientStorageError,
    is_transient,
    paths,
    redact,
)
from atoll.storage.validation import InvalidInput


class Faults:
    """Fail the next ``n`` calls of ``methods`` (optionally only for paths containing ``where``)."""

    def __init__(self, methods: tuple[str, ...], n: int, exc: BaseException, where: str = "",
                 write_first: bool = False, truncate: bool = False) -> None:
        self.methods, self.n, self.exc, self.where = methods, n, exc, where
        self.write_first, self.truncate = write_first, truncate
        self.hits = 0

    def __call__(self, name, args, kwargs, fs):
        if name not in self.methods or self.n <= 0 or (args and self.where not in str(args[0])):
            return None
        self.n -= 1
        self.hits += 1
        if self.write_first and name == "pipe_file":
            data = args[1]
            fs.pipe_file(args[0], data[: len(data) // 2] if self.truncate else data)  # then the reply is lost
        raise self.exc


def _open(backend, url, faults, sleeps=None, attempts=4, role=RunReader):
    proxies = []
    rs = backend.open(
        url,
        role=role,
        wrap=lambda fs: proxies.append(FsProxy(fs, faults)) or proxies[-1],
        retry=RetryPolicy(attempts=attempts, base_delay_s=0.01, max_delay_s=0.04),
        sleep=(sleeps.append if sleeps is not None else (lambda s: None)),
    )
    return rs, proxies[0]


def s3_slowdown() -> OSError:
    """What s3fs raises for a 503 SlowDown: botocore's ClientError translated, kept as the cause."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    return translate_boto_error(ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
         "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject"))


TRANSIENTS = [
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    TimeoutError("read timed out"),
    s3_slowdown(),
]


@pytest.mark.parametrize("exc", TRANSIENTS, ids=["reset", "timeout", "throttle-503"])
def test_transient_errors_are_retried_with_bounded_backoff(backend, exc):
    url = backend.new_url()
    init_run(backend.open(url))
    sleeps: list[float] = []
    faults = Faults(("cat_file", "pipe_file", "ls"), n=0, exc=exc)
    rs, px = _open(backend, url, faults, sleeps, role=LearnerStore)
    faults.n = 3  # three failures, four attempts: the operation still succeeds
    rec = rs.publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0))
    assert faults.hits == 3 and rs.store.op_counts["retry"] == 3
    assert len(sleeps) == 3 and all(0 < s <= 0.04 for s in sleeps)
    assert sleeps[1] >= 0.01 and sleeps[2] >= 0.02  # exponential: each lower bound doubles (with jitter on top)
    faults.n = 2
    listing = rs.list_contributions(0, 0)
    assert [r.key for r in listing.records] == [rec.key]


def test_persistent_transient_error_names_operation_and_url(backend):
    url = backend.new_url()
    init_run(backend.open(url))
    faults = Faults(("cat_file",), n=10**6, exc=ConnectionResetError(errno.ECONNRESET, "reset"))
    rs, _ = _open(backend, url, faults, attempts=3)
    with pytest.raises(TransientStorageError, match=r"^get .* failed after 3 attempt\(s\): ConnectionResetError") as ei:
        rs.read_global_fragment(0, 0)
    msg = str(ei.value)
    assert msg.startswith("get ") and "after 3 attempt(s)" in msg
    assert "run.json" in msg or "blobs/sha256" in msg
    assert ei.value.op == "get" and ei.value.url.startswith(url)
    assert faults.hits == 3


def test_non_transient_errors_are_not_retried(backend):
    url = backend.new_url()
    init_run(backend.open(url))
    faults = Faults(("cat_file",), n=10**6, exc=PermissionError("AccessDenied"))
    rs, _ = _open(backend, url, faults)
    with pytest.raises(PermissionError, match="AccessDenied"):
        _ = rs.manifest
    assert faults.hits == 1


def test_half_failed_contribution_leaves_nothing_trusted(backend):
    url = backend.new_url()
    init_run(backend.open(url))
    # The record write fails for good after the payload landed: no record, nothing listed.
    faults = Faults(("pipe_file",), n=10**6, exc=ConnectionResetError("reset"), where="contributions/")
    rs, _ = _open(backend, url, faults, attempts=2, role=LearnerStore)
    with pytest.raises(TransientStorageError, match=r"^create .*/contributions/f0000/b00000000/l1\.s.* failed after 2"):
        rs.publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0))
    assert backend.open(url).list_contributions(0, 0).records == []
    # A payload write that stored half the bytes and then failed for good: no record points at it.
    faults = Faults(("pipe_file",), n=10**6, exc=ConnectionResetError("reset"), where="blobs/",
                    write_first=True, truncate=True)
    rs, _ = _open(backend, url, faults, attempts=2, role=LearnerStore)
    with pytest.raises(TransientStorageError, match=r"^put .*/blobs/sha256/[0-9a-f]{64}\.safetensors failed after 2"):
        rs.publish_contribution("l1", 0, 0, counters(), fragment_delta(rs, 0, seed=5))
    reader = backend.open(url, role=LearnerStore)
    assert reader.list_contributions(0, 0).records == []
    # ... and if a record did point at such a blob, the reader would refuse it (size/sha checks).
    good = reader.publish_contribution("l2", 0, 0, counters(), fragment_delta(rs, 0, seed=6))
    blob = paths.blob_key(good.payload.sha256, good.learner_id)
    backend.raw_put(url, blob, backend.raw_get(url, blob)[:20])
    with pytest.raises(InvalidInput, match=r"^\[truncated\] payload has 20 bytes, record says \d+") as ei:
        backend.open(url).load_contribution(backend.open(url).list_contributions(0, 0).records[0])
    assert ei.value.kind == "truncated"


def test_half_failed_commit_leaves_the_round_open(backend):
    url = backend.new_url()
    init_run(backend.open(url))
    faults = Faults(("pipe_file",), n=10**6, exc=ConnectionResetError("reset"), where="commits/")
    rs, _ = _open(backend, url, faults, attempts=2, role=SynchronizerStore)
    cur = rs.read_global_fragment(0, 0)
    with pytest.raises(TransientStorageError, match=r"^create .*/commits/00000001\.json failed after 2"):
        rs.commit_round(1, 0, params={n: t + 1 for n, t in cur.items()})
    reader = backend.open(url, role=SynchronizerStore)
    assert reader.latest_round() == 0
    assert reader.read_global_state().versions == (0, 0)
    # Another synchronizer can still commit the round.
    assert reader.commit_round(1, 0, params={n: t + 2 for n, t in cur.items()}).won
    torch.testing.assert_close(backend.open(url).read_global_fragment(0), {n: t + 2 for n, t in cur.items()})


def test_commit_whose_reply_was_lost_is_still_won(backend):
    """The create landed but the connection dropped before the reply; the retry sees our own bytes."""
    url = backend.new_url()
    init_run(backend.open(url))
    faults = Faults(("pipe_file",), n=1, exc=ConnectionResetError("reset"), where="commits/", write_first=True)
    rs, _ = _open(backend, url, faults, role=SynchronizerStore)
    cur = rs.read_global_fragment(0, 0)
    res = rs.commit_round(1, 0, params={n: t + 1 for n, t in cur.items()}, committed_by="me")
    assert faults.hits == 1 and res.won and res.record.committed_by == "me"
    assert backend.open(url).read_commit(1).nonce == res.record.nonce


def test_secrets_are_never_printed(backend):
    options = {**backend.storage_options, "secret": "hunter2-secret", "token": "tok-123", "key": "AKIAEXAMPLE",
               "client_kwargs": {"aws_session_token": "sess-999", "region_name": "us-east-1"}}
    red = redact(options)
    text = repr(red)
    for s in ("hunter2-secret", "tok-123", "AKIAEXAMPLE", "sess-999"):
        assert s not in text
    assert red["client_kwargs"]["region_name"] == "us-east-1"
    fs, root = backend.fs_and_root(backend.new_url())
    store = ObjectStore(FsProxy(fs, Faults(("cat_file",), 99, ConnectionResetError("reset"))), root,
                        url=backend.new_url(), storage_options=options,
                        retry=RetryPolicy(attempts=2, base_delay_s=0), sleep=lambda s: None)
    with pytest.raises(TransientStorageError, match=r"^get .*/x failed after 2 attempt") as ei:
        store.get("x")
    for s in ("hunter2-secret", "tok-123", "AKIAEXAMPLE", "sess-999"):
        assert s not in repr(store) and s not in str(ei.value)


def test_is_transient_classification():
    """The exception classes themselves (test_real_errors.py has them raised by the real clients)."""
    from botocore.exceptions import ClientError
    from gcsfs.retry import HttpError

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(errno.ECONNRESET, "x"))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(FileExistsError("x"))
    assert not is_transient(PermissionError("x"))

    def http_error(code):  # as gcsfs.retry.validate_response builds it
        return HttpError({"code": code, "message": "backend error"})

    assert is_transient(http_error(503)) and is_transient(http_error(429)) and is_transient(http_error(408))
    assert not is_transient(http_error(404)) and not is_transient(http_error(412))

    def client_error(code, status):
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")

    assert is_transient(client_error("SlowDown", 503)) and is_transient(client_error("InternalError", 500))
    assert is_transient(client_error("Throttling", 400))  # the code alone says throttled
    assert not is_transient(client_error("NoSuchKey", 404))
    assert is_transient(s3_slowdown()) and s3_slowdown().errno == errno.EBUSY
    wrapped = OSError("translated")
    wrapped.__cause__ = ConnectionResetError()
    assert is_transient(wrapped)

    class LookAlike(Exception):  # a class that merely shares a name or an attribute decides nothing
        code = 503

    assert not is_transient(LookAlike())


# -- injected faults for the chaos soak (benchmarks/chaos.py): $ATOLL_FAULT_STORAGE ------------------

def test_injected_storage_faults_are_absorbed_by_the_retry_policy(tmp_path, monkeypatch) -> None:
    import atoll.storage.store as store_mod

    monkeypatch.setenv(store_mod.StorageFaults.ENV, "error=0.3,lost=0.3,latency_s=0.001,seed=5")
    faults = store_mod.StorageFaults.from_env()
    assert faults is not None and (faults.error, faults.lost, faults.latency_s) == (0.3, 0.3, 0.001)
    monkeypatch.setattr(store_mod, "_FAULTS", faults)
    store = ObjectStore.open(str(tmp_path / "b"), retry=RetryPolicy(attempts=30, base_delay_s=0.0, max_delay_s=0.0))
    for i in range(20):
        assert store.create(f"k/{i}", b"first")  # a lost reply is retried: the bytes are ours
        assert not store.create(f"k/{i}", b"second")
        store.put(f"p/{i}", b"x" * i)
        assert store.get(f"k/{i}") == b"first" and store.get(f"p/{i}") == b"x" * i
    assert faults.injected["latency"] > 0 and faults.injected["lost:create"] > 0
    assert sum(n for k, n in faults.injected.items() if k.startswith("error:")) > 0
    assert store.op_counts["retry"] > 0


@pytest.mark.parametrize("spec", ["error=2", "lost=-1", "latency_s=x", "latency_s=100"])
def test_a_bad_storage_fault_spec_names_the_variable(monkeypatch, spec: str) -> None:
    import atoll.storage.store as store_mod

    monkeypatch.setenv(store_mod.StorageFaults.ENV, spec)
    with pytest.raises(ValueError, match="ATOLL_FAULT_STORAGE"):
        store_mod.StorageFaults.from_env()
