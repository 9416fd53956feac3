"""A small, retrying object-store wrapper over fsspec with create-once writes.

:class:`ObjectStore` maps run-relative *keys* (``commits/00000001.json``) to objects under one
root URL and offers exactly the operations the protocol needs:

* ``get`` / ``get_or_none`` (GET, optionally capped), ``put`` (overwrite, atomic per object),
* ``create`` (create-once: True if this call created the object, False if it already existed),
* ``list`` (one LIST of one prefix, after invalidating fsspec's listing cache), ``list_info``
  (the same LIST with each object's size and modification time, for retention),
* ``delete``, ``delete_many`` (batched where the backend has a bulk delete: S3's DeleteObjects).

Create-once per backend: S3 ``If-None-Match: *`` and GCS ``ifGenerationMatch=0`` (through
``pipe_file(mode="create")``), a local folder writes a temporary file then ``os.link``\\ s it to
the final name (fails if the name exists; readers never see a half-written file), and the
in-process memory filesystem is made atomic with a lock. :meth:`ObjectStore.probe_create_once`
proves at start-up that the store really refuses a second create.

Local folders are a trust boundary too: a read (``get`` / ``get_or_none``) refuses anything that
is not a regular file inside the run root before opening it (:class:`NotRegularFileError`): a
symlink that leads outside the root, a FIFO (opening it would block forever), a device, a socket,
a directory.

Transient failures (connection reset, timeouts, HTTP 5xx, 429 / throttling) are retried with
bounded exponential backoff and jitter, then raised as :class:`TransientStorageError` naming the
operation and URL. Storage options are never logged: :func:`redact` masks anything secret.

Every attempt of every operation is counted (:attr:`ObjectStore.wire`, :meth:`ObjectStore.wire_counts`):
requests by kind and body bytes up and down, as :mod:`atoll.storage.wire` models the backend.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import stat
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from atoll.core.retry import STORAGE_RETRY, RetryPolicy
from atoll.storage.paths import join_url, probe_key
from atoll.storage.validation import StorageError, TransientStorageError, UnsafeStoreError
from atoll.storage.wire import WireCounts, WireMeter, requests_sent

__all__ = ["RetryPolicy", "ObjectStore", "ObjectInfo", "NotRegularFileError", "NotPlainObjectError", "is_transient", "redact", "io_map", "IO_THREADS",
           "IO_THREADS_DEFAULT", "WireCounts"]

IO_THREADS_DEFAULT = 16
IO_THREADS = max(1, int(os.environ.get("ATOLL_IO_THREADS") or IO_THREADS_DEFAULT))
"""Object-store calls :func:`io_map` runs at once (``$ATOLL_IO_THREADS``, default 16; 1: one at a time). A call waits on the network (tens of ms on S3 or
GCS), not the CPU: a round that reads M learners' listings and records one after another waits M
times that, so the synchronizer falls behind as the fleet grows."""

_io_pool: ThreadPoolExecutor | None = None
_io_pool_lock = threading.Lock()


def _reset_io_pool() -> None:
    global _io_pool
    _io_pool = None  # a forked child has no threads: it starts its own pool when it needs one


os.register_at_fork(after_in_child=_reset_io_pool)

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def io_map(fn: Callable[[_In], _Out], items: Iterable[_In]) -> list[_Out]:
    """``[fn(x) for x in items]``, with up to :data:`IO_THREADS` calls at once; results in order.

    For object-store calls (each one retries on its own, see :meth:`ObjectStore._call`). The first
    exception is raised once every call has finished. ``fn`` must not call ``io_map`` itself (the
    pool is shared: nested waits could use up its threads)."""
    todo = list(items)
    if len(todo) <= 1 or IO_THREADS <= 1:
        return [fn(x) for x in todo]
    global _io_pool
    with _io_pool_lock:
        if _io_pool is None or _io_pool._max_workers != IO_THREADS:  # first use, or IO_THREADS changed
            if _io_pool is not None:
                _io_pool.shutdown(wait=False)  # what it was given still runs
            _io_pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="atoll-io")
        pool = _io_pool
    futures = [pool.submit(fn, x) for x in todo]
    errors = [f.exception() for f in futures]  # waits for all: nothing keeps running behind the caller
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]

T = TypeVar("T")

_SECRET_MARKERS = ("key", "secret", "token", "password", "passwd", "credential", "session", "auth", "sas")
_TRANSIENT_CODES = frozenset({
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeTooSkewed",  # botocore corrects its clock offset on the next attempt
    "InternalError",
    "ServiceUnavailable",
    "TooManyRequests",
})
"""S3 error codes (botocore ``ClientError.response["Error"]["Code"]``) worth retrying."""

_TRANSIENT_CLASSES = (
    # botocore: no connection, connection dropped or timed out, body cut short.
    ("botocore.exceptions", ("ConnectionError", "HTTPClientError", "IncompleteReadError")),
    # aiohttp (under s3fs and gcsfs): connection refused/reset/closed, server timeout, short body.
    ("aiohttp.client_exceptions", ("ClientConnectionError", "ClientPayloadError")),
    # requests: gcsfs raises requests' ProxyError for an HTTP 502.
    ("requests.exceptions", ("ConnectionError", "Timeout", "ChunkedEncodingError")),
    ("fsspec.exceptions", ("FSTimeoutError",)),
    # gcsfs: the body's md5 did not match (a corrupted transfer; gcsfs itself retries it).
    ("gcsfs.retry", ("ChecksumError",)),
)
"""Exception classes of the storage clients that mean "try again", by module and class name.

They are looked up in ``sys.modules`` only: an exception of a class whose module was never
imported cannot exist, so the storage layer needs none of these clients installed."""

_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EBUSY,  # s3fs's translation of 503 / SlowDown / ServiceUnavailable / 409
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs's translation of 500 / InternalError
})

_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                  StorageError, ValueError, KeyError, TypeError)


def _transient_status(status: object) -> bool:
    """HTTP status codes worth retrying: 408 request timeout, 429 too many requests, any 5xx."""
    return isinstance(status, int) and not isinstance(status, bool) and (status >= 500 or status in (408, 429))


def _loaded_classes(module: str, names: tuple[str, ...]) -> tuple[type, ...]:
    mod = sys.modules.get(module)
    if mod is None:
        return ()
    return tuple(c for n in names if isinstance(c := getattr(mod, n, None), type))


def _client_class(module: str, name: str) -> type | None:
    found = _loaded_classes(module, (name,))
    return found[0] if found else None


def _http_status_transient(e: BaseException) -> bool:
    """The HTTP status (or S3 error code) that a storage client's exception carries."""
    http_error = _client_class("gcsfs.retry", "HttpError")  # gcsfs: HttpError({"code": status, ...})
    if http_error is not None and isinstance(e, http_error):
        return _transient_status(getattr(e, "code", None))
    client_error = _client_class("botocore.exceptions", "ClientError")  # botocore: parsed S3 response
    if client_error is not None and isinstance(e, client_error):
        response = getattr(e, "response", None) or {}
        err = response.get("Error", {}) or {}
        status = (response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
        return err.get("Code") in _TRANSIENT_CODES or _transient_status(status)
    response_error = _client_class("aiohttp.client_exceptions", "ClientResponseError")
    if response_error is not None and isinstance(e, response_error):
        return _transient_status(getattr(e, "status", None))
    return False


_MEMORY_LOCK = threading.Lock()
_FAILED = object()
"""What an attempt returned when it was cut short before its call (a fault, an interrupt)."""


class NotRegularFileError(StorageError):
    """A local object that is not a regular file inside the run root (a FIFO, a device, a socket,
    a directory, or a symlink leading outside the root). Never opened, never retried."""

    def __init__(self, url: str, what: str) -> None:
        self.url, self.what = url, what
        super().__init__(f"{url} is {what}, not a regular file inside the run folder; refusing to touch it")


class NotPlainObjectError(NotRegularFileError):
    """Retention found an entry that is not a plain object (a link anywhere on its path, a FIFO,
    a device, a socket, or a folder where objects belong): it refuses to run rather than delete
    through it."""


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def redact(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of storage options safe to print: secret-looking values become ``'***'``."""
    out: dict[str, Any] = {}
    for k, v in (options or {}).items():
        if isinstance(v, Mapping):
            out[k] = redact(v)
        elif any(m in str(k).lower() for m in _SECRET_MARKERS) and v is not None:
            out[k] = "***"
        else:
            out[k] = v
    return out


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception in its cause/context chain) is worth retrying.

    Keyed on exception types, HTTP status codes and S3 error codes, never on message text:
    builtin ``ConnectionError`` / ``TimeoutError``; the connection and timeout classes of botocore,
    aiohttp, requests and fsspec; gcsfs ``HttpError`` and botocore ``ClientError`` with status 408,
    429 or 5xx (or a throttling S3 code); and the errnos s3fs translates those into (EBUSY for
    503/SlowDown, EREMOTEIO for 500). Missing, existing, forbidden and malformed are never
    transient. s3fs keeps the botocore error as ``__cause__`` of its OSError, so the chain is walked.
    """
    transient_classes = tuple(c for module, names in _TRANSIENT_CLASSES for c in _loaded_classes(module, names))
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _NOT_TRANSIENT):
            return False
        if isinstance(e, ConnectionError | TimeoutError) or isinstance(e, transient_classes):
            return True
        if _http_status_transient(e):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


DELETE_CHUNK = 1000
"""Keys per bulk delete request (S3's DeleteObjects limit)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One entry of :meth:`ObjectStore.list_info`."""

    name: str
    """Last path component."""
    is_dir: bool
    """A prefix ("folder"), not an object."""
    size: int
    """Bytes (0 for a prefix)."""
    modified_s: float | None
    """Last modification, Unix seconds by the store's clock; None if the backend gives none."""


ObjectInfos = list[ObjectInfo]
"""(An alias: inside ObjectStore, ``list`` names its method.)"""


def _modified_s(entry: Mapping[str, Any]) -> float | None:
    """Modification time from an fsspec ``ls(detail=True)`` entry, whichever backend wrote it:
    local ``mtime`` (float), S3 ``LastModified`` (datetime), GCS ``updated`` (ISO text), memory
    ``created``."""
    for name in ("mtime", "LastModified", "updated", "last_modified", "created", "timeCreated"):
        value = entry.get(name)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(value, str):
            try:
                when = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    return None


class ObjectStore:
    """Objects under one root URL of any fsspec filesystem. Keys are ``/``-separated and relative."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        seed: int | None = None,
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self.protocol = str(protocols[0])
        self.is_local = bool({"file", "local"} & set(protocols))
        self.is_memory = "memory" in protocols
        self.url = url or (self.root if self.is_local else f"{self.protocol}://{self.root.lstrip('/')}")
        self._options = redact(storage_options)
        self.retry = retry or STORAGE_RETRY
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._made_dirs: set[str] = set()
        self.op_counts: Counter[str] = Counter()
        """Operations issued (after retries count separately as 'retry')."""
        self.wire = WireMeter()
        """Requests and bytes sent to the backend, every attempt, all threads (:mod:`atoll.storage.wire`)."""

    @classmethod
    def open(cls, url: str, storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> ObjectStore:
        """Open ``url`` (``file://``, plain path, ``memory://``, ``s3://``, ``gs://`` ...)."""
        options = dict(storage_options or {})
        if url.startswith("file://") or "://" not in url:
            options.setdefault("auto_mkdir", True)
        fs, root = url_to_fs(url, **options)
        return cls(fs, root, url=url.rstrip("/"), storage_options=storage_options, **kwargs)

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, storage_options={self._options!r})"

    # -- paths -------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return join_url(self.root, key) if self.root != "/" else "/" + key.strip("/")

    def key_url(self, key: str) -> str:
        return join_url(self.url, key)

    # -- retries -----------------------------------------------------------------------------
    def _call(self, op: str, key: str, fn: Callable[[], T], *, up: int = 0, whole: bool = False,
              one_request: bool = False) -> T:
        """``fn()``, retried on transient errors; every attempt is counted on :attr:`wire`
        (``up``: the body a write sends; ``whole``: a read without a byte range; ``one_request``:
        a LIST whose every attempt is one request whatever it returns, as a capped one is)."""
        self.op_counts[op] += 1
        last: BaseException | None = None
        for attempt in range(max(1, self.retry.attempts)):
            if attempt:
                self.op_counts["retry"] += 1
                self._sleep(self.retry.delay_s(attempt - 1, self._rng))
            result: object = _FAILED
            try:
                if _FAULTS is not None:  # chaos only (ATOLL_FAULT_STORAGE)
                    _FAULTS.before(op)
                value = fn()
                result = value
                if _FAULTS is not None:
                    _FAULTS.after(op)
                return value
            except Exception as e:  # noqa: BLE001 - classified below
                result = e
                if not is_transient(e):
                    raise
                last = e
            finally:
                if one_request:
                    self.wire.add(WireCounts(lists=1))
                else:
                    self._count(op, result, up=up, whole=whole)
        assert last is not None
        raise TransientStorageError(op, self.key_url(key), max(1, self.retry.attempts), last) from last

    def _count(self, op: str, result: object, *, up: int, whole: bool) -> None:
        """Add what one attempt of ``op`` sent to the backend (:func:`~atoll.storage.wire.requests_sent`);
        ``result``: what the attempt returned, or the exception it raised."""
        down = len(result) if isinstance(result, bytes) else None
        entries = len(result) if isinstance(result, list) else None
        self.wire.add(requests_sent(self.protocol, op, up=up, down=down, entries=entries, whole=whole,
                                    missing=isinstance(result, FileNotFoundError)))

    def wire_counts(self) -> WireCounts:
        """Requests and bytes this store has sent so far, all threads together (a snapshot)."""
        return self.wire.snapshot()

    def metered_apart(self) -> ObjectStore:
        """This store (same filesystem, root, retries) with counts of its own: for a second
        party in one process whose traffic is not this one's (a round recorder beside the
        synchronizer, a learner of a virtual run)."""
        other = copy.copy(self)
        other.wire = WireMeter()
        other.op_counts = Counter()
        return other

    # -- operations --------------------------------------------------------------------------
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The object's bytes (FileNotFoundError if absent); at most ``max_bytes + 1`` if capped.

        Local: :class:`NotRegularFileError` for anything but a regular file inside the root.
        """
        path = self.path(key)

        def cat() -> bytes:
            # A LIST may have filled fsspec's listing cache, and s3fs answers the size lookup of a
            # plain cat from it: an object created since would read as missing, forever.
            self._invalidate(path)
            if self.is_local:
                self._check_local_file(key, path)
            if max_bytes is None:
                return bytes(self.fs.cat_file(path))
            return bytes(self.fs.cat_file(path, start=0, end=max_bytes + 1))

        return self._call("get", key, cat, whole=max_bytes is None)

    def get_or_none(self, key: str, **kwargs: Any) -> bytes | None:
        try:
            return self.get(key, **kwargs)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object; readers see the old or the new bytes, never a mix."""
        path = self.path(key)
        if self.is_local:
            def local_put() -> None:
                tmp = self._local_tmp(path)
                try:
                    self._write_local(tmp, data)
                    os.replace(tmp, path)
                finally:
                    _unlink_quietly(tmp)
            self._call("put", key, local_put, up=len(data))
        else:
            self._call("put", key, lambda: self.fs.pipe_file(path, data), up=len(data))

    def create(self, key: str, data: bytes) -> bool:
        """Create-once: True if this call created the object, False if it already existed.

        If a retried attempt finds the object present, its bytes are compared with ``data``: equal
        bytes mean an earlier attempt of *this* call succeeded before the connection dropped.
        """
        path = self.path(key)
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            if self.is_local:
                tmp = self._local_tmp(path)
                try:
                    self._write_local(tmp, data)
                    os.link(tmp, path)
                finally:
                    _unlink_quietly(tmp)
            elif self.is_memory:
                with _MEMORY_LOCK:
                    self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data, mode="create")

        try:
            self._call("create", key, attempt, up=len(data))
            return True
        except FileExistsError:
            if tries > 1 and self.get_or_none(key) == data:
                return True  # an earlier attempt of this call landed before its reply was lost
            return False

    def _list_some(self, path: str, limit: int) -> list[str]:
        """Up to ``limit`` entries of ``path`` (paths or names), one request where the backend allows."""
        protocols = set(self.fs.protocol if isinstance(self.fs.protocol, tuple | list) else (self.fs.protocol,))
        if protocols & {"s3", "s3a"}:
            entries = fsspec.asyn.sync(self.fs.loop, self.fs._lsdir, path.rstrip("/"), refresh=True, max_items=limit)
        elif protocols & {"gs", "gcs"}:
            entries = fsspec.asyn.sync(self.fs.loop, self.fs._list_objects, path.rstrip("/"), max_results=limit)
        else:
            return sorted(self.fs.ls(path, detail=False))[:limit]
        return [str(e["name"]) for e in entries][:limit]

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """Names (last path component) directly under ``prefix``; one LIST, cache invalidated first.

        Temporary files (``.tmp-*``) are never returned. A missing prefix lists as empty.
        ``limit``: at most that many names, with one request on S3 and GCS (the first in key
        order), so a prefix holding millions of objects costs what one holding ``limit`` does;
        without it every page is read (one request per 1,000 names). A local folder is read
        whole (no requests; names in key order) and cut.
        """
        path = self.path(prefix)

        def ls() -> list[str]:
            self._invalidate(path)
            try:
                entries = self.fs.ls(path, detail=False) if limit is None else self._list_some(path, limit)
            except FileNotFoundError:
                return []
            finally:
                if limit is not None:
                    self._invalidate(path)  # a partial listing must never answer a later lookup
            return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

        names = self._call("list", prefix, ls, one_request=limit is not None)
        return sorted(n for n in names if n and not n.startswith(".tmp-"))

    def list_info(self, prefix: str) -> ObjectInfos:
        """Like :meth:`list` (one LIST, names sorted, no ``.tmp-*``), with each entry's size and
        modification time as the backend reports it (``None`` where it reports none)."""
        path = self.path(prefix)
        if self.is_local and not self._inside_root(path):
            return []  # a folder that is (or sits under) a link out of the run: never listed, never pruned

        def ls() -> list[dict[str, Any]]:
            self._invalidate(path)
            try:
                return list(self.fs.ls(path, detail=True))
            except FileNotFoundError:
                return []

        out = []
        for entry in self._call("list", prefix, ls):
            name = str(entry.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            if not name or name.startswith(".tmp-"):
                continue
            is_dir = entry.get("type") == "directory"
            size = entry.get("size", entry.get("Size"))
            out.append(ObjectInfo(name=name, is_dir=is_dir, size=int(size) if isinstance(size, int) and not is_dir else 0,
                                  modified_s=None if is_dir else _modified_s(entry)))
        return sorted(out, key=lambda o: o.name)

    def list_plain(self, prefix: str) -> ObjectInfos:
        """:meth:`list_info` for a deleter (retention): on a local folder, no folder on the way
        from the run root to ``prefix`` may be a link (to anywhere, inside the run or not), and
        every entry must be a plain file or a plain folder (not a link, a FIFO, a device, a
        socket); otherwise :class:`NotPlainObjectError` names it. Object stores have no links."""
        if self.is_local:
            link = self._link_on_path(self.path(prefix))
            if link is not None:
                raise NotPlainObjectError(self.key_url(prefix), f"reached through the link {link}")
            folder = self.path(prefix)
            try:
                with os.scandir(folder) as it:
                    entries = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
            except (FileNotFoundError, NotADirectoryError):
                entries = []
            for name, mode in entries:
                if name.startswith(".tmp-"):
                    continue
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    what = "a symlink" if stat.S_ISLNK(mode) else _file_kind(mode)
                    raise NotPlainObjectError(self.key_url(prefix + name), what)
        return self.list_info(prefix)

    def _link_on_path(self, path: str) -> str | None:
        """Local: the first folder or object below the run root on ``path`` that is a symlink, or
        None. The root itself is the user's choice and may be one."""
        root = self.root.rstrip("/")
        if not path.startswith(root + "/"):
            return path
        cur = root
        for part in path[len(root) + 1:].strip("/").split("/"):
            cur = f"{cur}/{part}"
            try:
                st = os.lstat(cur)
            except (FileNotFoundError, NotADirectoryError):
                return None
            if stat.S_ISLNK(st.st_mode):
                return cur
        return None

    def _invalidate(self, path: str) -> None:
        """Drop fsspec's cached listing of ``path``. fsspec's DirCache pops with a check, then a
        delete: two threads invalidating one path at once (io_map) make the second raise KeyError;
        the entry is gone either way."""
        try:
            self.fs.invalidate_cache(path)
        except KeyError:
            pass

    def _inside_root(self, path: str) -> bool:
        """Local: whether ``path``, with every link on the way resolved, stays inside the run folder."""
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        return os.path.commonpath([real, root]) == root

    def delete(self, key: str) -> None:
        """Delete one object (absent is fine). Local: never through a link, wherever it leads
        (a folder on the way or the object itself), and never anything but a regular file
        (:class:`NotPlainObjectError`)."""
        path = self.path(key)
        if self.is_local:
            link = self._link_on_path(path)
            if link is not None:
                raise NotPlainObjectError(self.key_url(key), f"reached through the link {link}: not deleted")
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return
            if not stat.S_ISREG(mode):
                raise NotPlainObjectError(self.key_url(key), _file_kind(mode) + ": not deleted")

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", key, rm)

    def remove_empty_folder(self, prefix: str) -> bool:
        """Remove the folder ``prefix`` if it is empty (a local folder keeps one after its last
        object is deleted; object stores have no folders: nothing to do). True if removed."""
        if not self.is_local:
            return False
        try:
            os.rmdir(self.path(prefix.rstrip("/")))
        except OSError:  # not empty, already gone, or not a folder
            return False
        return True

    def delete_many(self, keys: Iterable[str], *, chunk: int = DELETE_CHUNK) -> int:
        """Delete objects (absent ones are fine), ``chunk`` keys per call: one bulk request each
        on S3 (DeleteObjects takes up to 1,000) and GCS (a batch), one unlink each elsewhere.
        Returns how many keys were asked for."""
        todo = list(dict.fromkeys(keys))
        for i in range(0, len(todo), chunk):
            part = todo[i:i + chunk]
            if self.is_local or self.is_memory:
                io_map(self.delete, part)
                continue
            paths_ = [self.path(k) for k in part]

            def rm(paths_: list[str] = paths_) -> None:
                try:
                    self.fs.rm(paths_)
                except FileNotFoundError:  # one of them vanished meanwhile: the rest one by one
                    for p in paths_:
                        try:
                            self.fs.rm_file(p)
                        except FileNotFoundError:
                            pass

            self._call("delete", part[0], rm)
        return len(todo)

    # -- capability probe --------------------------------------------------------------------
    def probe_create_once(self) -> None:
        """Prove that a second create of one object is refused; raise UnsafeStoreError if not."""
        key = probe_key(uuid.uuid4().hex)
        try:
            if not self.create(key, b"first"):
                raise UnsafeStoreError(f"{self.url}: create-once probe object {key} already existed")
            second = self.create(key, b"second")
        finally:
            try:
                self.delete(key)
            except Exception:  # noqa: BLE001 - a leftover probe object is harmless
                pass
        if second:
            raise UnsafeStoreError(
                f"the store at {self.url} (fsspec protocol {self.protocol!r}, {type(self.fs).__name__}) accepted "
                "a second create of the same object: it does not honour create-once writes "
                "(S3 If-None-Match, GCS ifGenerationMatch=0), so two synchronizers racing on one round "
                "could both 'win'. Use a store that does, or pass unsafe_allow_overwrite=True if exactly "
                "one synchronizer will ever write to this run (e.g. tests on the GCS emulator)."
            )

    # -- helpers -----------------------------------------------------------------------------
    def _check_local_file(self, key: str, path: str) -> None:
        """Refuse to open a local object that is not a regular file inside the root (checked
        before opening: opening a FIFO blocks until a writer comes, i.e. forever). A missing
        object is left to the read itself (FileNotFoundError)."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if os.path.commonpath([real, root]) != root:  # the object or a folder above it is a link out
            raise NotRegularFileError(self.key_url(key), f"a symlink to {real}, outside the run folder {root}")
        if stat.S_ISLNK(st.st_mode):
            try:
                st = os.stat(real)
            except FileNotFoundError:
                return  # a dangling link reads as a missing object
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(self.key_url(key), _file_kind(st.st_mode))

    def _local_tmp(self, path: str) -> str:
        parent, _, name = path.rpartition("/")
        parent = parent or "/"
        if parent not in self._made_dirs:  # one makedirs per folder and process, not per write
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        return f"{parent}/.tmp-{uuid.uuid4().hex[:12]}-{name}"

    def _write_local(self, tmp: str, data: bytes) -> None:
        """Write a new temporary file. With fsspec's own LocalFileSystem, straight through the OS
        (a learner writes two files per publish, and fsspec's Python layers around them cost
        more than the write itself while holding the GIL the training thread needs); any other
        local filesystem object (a wrapper, e.g. the fault-injecting one of the tests) gets
        ``pipe_file``."""
        if type(self.fs) is not LocalFileSystem:
            self.fs.pipe_file(tmp, data)
            return
        parent = tmp.rpartition("/")[0] or "/"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # the folder was removed since it was made: make it again
            os.makedirs(parent, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


class StorageFaults:
    """Chaos only (never set in production): every storage operation of the process first sleeps
    a random latency and, with some probability, fails with a transient error, so the retry
    policy and everything above it run as against an unwell bucket.

    Read once from ``$ATOLL_FAULT_STORAGE``, e.g. ``error=0.01,latency_s=0.05,seed=3``: ``error``
    is the probability of a ``ConnectionResetError`` before an operation (each retry draws again),
    ``latency_s`` the upper end of a uniform extra latency per operation, ``lost`` the probability
    that a write (put, create) lands and its reply is lost (the retry finds it there).
    """

    ENV = "ATOLL_FAULT_STORAGE"

    def __init__(self, error: float, latency_s: float, seed: int | None, lost: float = 0.0) -> None:
        self.error, self.latency_s, self.lost = error, latency_s, lost
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    @classmethod
    def from_env(cls) -> StorageFaults | None:
        spec = os.environ.get(cls.ENV, "").strip()
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
        try:
            error = float(fields.get("error", 0.0))
            latency_s = float(fields.get("latency_s", 0.0))
            lost = float(fields.get("lost", 0.0))
            seed = int(fields["seed"]) if "seed" in fields else None
        except ValueError as e:
            raise ValueError(f"${cls.ENV}={spec!r}: {e} (expected e.g. error=0.01,latency_s=0.05,seed=3)") from None
        if not (0.0 <= error < 1.0 and 0.0 <= lost < 1.0 and 0.0 <= latency_s <= 60.0):
            raise ValueError(f"${cls.ENV}={spec!r}: error and lost must be in [0, 1) and latency_s in [0, 60]")
        return cls(error, latency_s, seed, lost)

    def before(self, op: str) -> None:
        with self._lock:
            delay = self._rng.uniform(0.0, self.latency_s) if self.latency_s else 0.0
            fail = self.error > 0 and self._rng.random() < self.error
        if delay:
            self.injected["latency"] += 1
            time.sleep(delay)
        if fail:
            self.injected[f"error:{op}"] += 1
            raise ConnectionResetError(errno.ECONNRESET, f"injected fault ({self.ENV}) before {op}")

    def after(self, op: str) -> None:
        if op in ("put", "create") and self.lost > 0:
            with self._lock:
                fail = self._rng.random() < self.lost
            if fail:
                self.injected[f"lost:{op}"] += 1
                raise ConnectionResetError(errno.ECONNRESET, f"injected lost reply ({self.ENV}) after {op}")


_FAULTS = StorageFaults.from_env()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
