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

Beside it: :mod:`~atoll.storage.transient` (which errors are retried), :mod:`~atoll.storage.local_folder`
(the local trust boundary, atomic local writes), :mod:`~atoll.storage.listing` (what a LIST returns),
:mod:`~atoll.storage.io_pool` (calls at once), :mod:`~atoll.storage.faults` (chaos injection).
"""

from __future__ import annotations

import copy
import os
import random
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from atoll.core.retry import STORAGE_RETRY, RetryPolicy
from atoll.storage.faults import StorageFaults
from atoll.storage.io_pool import io_map
from atoll.storage.listing import ObjectInfo, entry_info, entry_name, list_some
from atoll.storage.local_folder import (
    NotPlainObjectError,
    NotRegularFileError,
    file_kind,
    first_not_plain,
    inside_root,
    link_on_path,
    not_regular_file,
    temp_path,
    unlink_quietly,
    write_new_file,
)
from atoll.storage.paths import join_url, probe_key
from atoll.storage.transient import is_transient
from atoll.storage.validation import TransientStorageError, UnsafeStoreError
from atoll.storage.wire import WireCounts, WireMeter, requests_sent

__all__ = ["RetryPolicy", "ObjectStore", "ObjectInfo", "NotRegularFileError", "NotPlainObjectError", "StorageFaults",
           "is_transient", "redact", "io_map", "WireCounts"]

T = TypeVar("T")

_SECRET_MARKERS = ("key", "secret", "token", "password", "passwd", "credential", "session", "auth", "sas")


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


DELETE_CHUNK = 1000
"""Keys per bulk delete request (S3's DeleteObjects limit)."""

_MEMORY_LOCK = threading.Lock()
_FAILED = object()
"""What an attempt returned when it was cut short before its call (a fault, an interrupt)."""

_FAULTS = StorageFaults.from_env()
"""Chaos only (``$ATOLL_FAULT_STORAGE``): faults injected before and after every attempt."""

ObjectInfos = list[ObjectInfo]
"""(An alias: inside ObjectStore, ``list`` names its method.)"""


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
            if self.is_local and (what := not_regular_file(self.root, path)) is not None:
                raise NotRegularFileError(self.key_url(key), what)
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
                tmp = temp_path(path, self._made_dirs)
                try:
                    write_new_file(self.fs, tmp, data)
                    os.replace(tmp, path)
                finally:
                    unlink_quietly(tmp)
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
                tmp = temp_path(path, self._made_dirs)
                try:
                    write_new_file(self.fs, tmp, data)
                    os.link(tmp, path)
                finally:
                    unlink_quietly(tmp)
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
                entries = self.fs.ls(path, detail=False) if limit is None else list_some(self.fs, path, limit)
            except FileNotFoundError:
                return []
            finally:
                if limit is not None:
                    self._invalidate(path)  # a partial listing must never answer a later lookup
            return [entry_name(e) for e in entries]

        names = self._call("list", prefix, ls, one_request=limit is not None)
        return sorted(n for n in names if n and not n.startswith(".tmp-"))

    def list_info(self, prefix: str) -> ObjectInfos:
        """Like :meth:`list` (one LIST, names sorted, no ``.tmp-*``), with each entry's size and
        modification time as the backend reports it (``None`` where it reports none)."""
        path = self.path(prefix)
        if self.is_local and not inside_root(self.root, path):
            return []  # a folder that is (or sits under) a link out of the run: never listed, never pruned

        def ls() -> list[dict[str, Any]]:
            self._invalidate(path)
            try:
                return list(self.fs.ls(path, detail=True))
            except FileNotFoundError:
                return []

        infos = (entry_info(entry) for entry in self._call("list", prefix, ls))
        return sorted((i for i in infos if i is not None), key=lambda o: o.name)

    def list_plain(self, prefix: str) -> ObjectInfos:
        """:meth:`list_info` for a deleter (retention): on a local folder, no folder on the way
        from the run root to ``prefix`` may be a link (to anywhere, inside the run or not), and
        every entry must be a plain file or a plain folder (not a link, a FIFO, a device, a
        socket); otherwise :class:`NotPlainObjectError` names it. Object stores have no links."""
        if self.is_local:
            link = link_on_path(self.root, self.path(prefix))
            if link is not None:
                raise NotPlainObjectError(self.key_url(prefix), f"reached through the link {link}")
            found = first_not_plain(self.path(prefix))
            if found is not None:
                name, what = found
                raise NotPlainObjectError(self.key_url(prefix + name), what)
        return self.list_info(prefix)

    def _invalidate(self, path: str) -> None:
        """Drop fsspec's cached listing of ``path``. fsspec's DirCache pops with a check, then a
        delete: two threads invalidating one path at once (io_map) make the second raise KeyError;
        the entry is gone either way."""
        try:
            self.fs.invalidate_cache(path)
        except KeyError:
            pass

    def delete(self, key: str) -> None:
        """Delete one object (absent is fine). Local: never through a link, wherever it leads
        (a folder on the way or the object itself), and never anything but a regular file
        (:class:`NotPlainObjectError`)."""
        path = self.path(key)
        if self.is_local:
            link = link_on_path(self.root, path)
            if link is not None:
                raise NotPlainObjectError(self.key_url(key), f"reached through the link {link}: not deleted")
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return
            if not stat.S_ISREG(mode):
                raise NotPlainObjectError(self.key_url(key), file_kind(mode) + ": not deleted")

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
