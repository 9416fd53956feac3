"""Object-store calls at once: one thread pool shared by the process, results in order."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["IO_THREADS", "IO_THREADS_DEFAULT", "io_map"]

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

    For object-store calls (each one retries on its own: :class:`~atoll.storage.store.ObjectStore`).
    The first exception is raised once every call has finished. ``fn`` must not call ``io_map`` itself (the
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
