"""What crosses the wire: the requests and body bytes an object store sends to its backend.

Every :class:`~atoll.storage.store.ObjectStore` keeps a :class:`WireMeter`; each attempt of each
operation adds what it sent, as :func:`requests_sent` models it for the backend:

* **PUT**: ``put`` and ``create`` (a create-once write is a conditional PUT). S3 uploads of
  100 MiB or more go as a multipart upload (start, one part per 50 MiB, complete), GCS uploads of
  50 MiB or more as a resumable upload (start, one request per 50 MiB): each request counts.
* **GET**: ``get``. A capped read is one ranged GET; an uncapped one on S3 is a HEAD (s3fs sizes
  the object first) then one GET, or one GET per 50 MiB above that (a missing object: the HEAD,
  then a LIST of the name).
* **HEAD**: existence and size lookups, and the object lookup GCS does after a LIST that found
  nothing.
* **LIST**: one per 1,000 entries (S3 and GCS pages); on S3 a LIST that finds nothing is followed
  by a LIST of the parent folder (s3fs checks whether the name is a file).
* **DELETE**: ``delete``, and each bulk delete of up to 1,000 keys.

Bytes are object bodies: ``bytes_up`` what PUTs carried (every attempt: a retried upload is sent
again), ``bytes_down`` what GETs returned. Headers and listing responses are not counted. A
request that failed counts as sent (it was, or its connection was); retries inside the storage
client (botocore, s3fs and gcsfs retry some errors themselves) are not seen. A local folder or the
memory filesystem counts one request per operation, as if it were a bucket.

Snapshots are :class:`WireCounts`, frozen, with ``+`` and ``-``: take one before, one after, and
the difference is what happened in between. :func:`wire_from_report` reads counts someone else
reported (a learner's contribution ``info``) as untrusted input.
"""

from __future__ import annotations

import math
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["PAGE_ENTRIES", "PART_BYTES", "REPORT_LIMIT", "WIRE_FIELDS", "WireCounts", "WireMeter", "requests_sent",
           "meter_from_report", "tokens_from_report", "wire_from_report", "wire_report"]

PAGE_ENTRIES = 1000
"""Entries per LIST response (S3 ListObjectsV2 and GCS objects.list pages)."""

PART_BYTES = 50 * 2**20
"""s3fs's and gcsfs's chunk size: multipart/resumable upload parts, chunked S3 reads."""

REPORT_LIMIT = 2**50
"""Largest count (requests or bytes, about 10^15) a reported number is clipped to."""


@dataclass(frozen=True)
class WireCounts:
    """Requests by kind and body bytes, as sent to an object store's backend."""

    puts: int = 0
    """PUT requests (writes, create-once writes, upload parts)."""
    gets: int = 0
    """GET requests (object reads)."""
    heads: int = 0
    """HEAD requests (existence and size lookups)."""
    lists: int = 0
    """LIST requests (one per page)."""
    deletes: int = 0
    """DELETE requests (single or bulk)."""
    bytes_up: int = 0
    """Object bytes uploaded (every attempt)."""
    bytes_down: int = 0
    """Object bytes downloaded."""

    def __add__(self, other: WireCounts) -> WireCounts:
        return WireCounts(**{f: getattr(self, f) + getattr(other, f) for f in WIRE_FIELDS})

    def __sub__(self, other: WireCounts) -> WireCounts:
        return WireCounts(**{f: getattr(self, f) - getattr(other, f) for f in WIRE_FIELDS})

    @property
    def requests(self) -> int:
        """Requests of every kind."""
        return self.puts + self.gets + self.heads + self.lists + self.deletes

    @property
    def bytes_total(self) -> int:
        return self.bytes_up + self.bytes_down

    def to_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in WIRE_FIELDS}

    def line(self) -> str:
        """``12 req (3 PUT 8 GET 0 HEAD 1 LIST 0 DEL), up 1.2 MB, down 4.0 MB``."""
        return (f"{self.requests} req ({self.puts} PUT {self.gets} GET {self.heads} HEAD {self.lists} LIST "
                f"{self.deletes} DEL), up {_mb(self.bytes_up)}, down {_mb(self.bytes_down)}")


WIRE_FIELDS = tuple(f.name for f in fields(WireCounts))
"""The fields of :class:`WireCounts` (also the keys of its JSON form)."""


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e5 else f"{n:,} B"


class WireMeter:
    """A running total of :class:`WireCounts`; thread-safe (a learner's publisher and fetcher
    threads, and the synchronizer's concurrent reads, share one object store)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = WireCounts()
        self.id = uuid.uuid4().hex[:12]
        """Names this meter in reports: counts under one id only grow (a new process, a new id)."""

    def add(self, counts: WireCounts) -> None:
        with self._lock:
            self._total = self._total + counts

    def snapshot(self) -> WireCounts:
        with self._lock:
            return self._total


def _family(protocol: str) -> str:
    if protocol in ("s3", "s3a"):
        return "s3"
    if protocol in ("gs", "gcs"):
        return "gcs"
    return "plain"


def _parts(nbytes: int) -> int:
    return max(1, math.ceil(nbytes / PART_BYTES))


def requests_sent(protocol: str, op: str, *, up: int = 0, down: int | None = None, entries: int | None = None,
                  whole: bool = False, missing: bool = False) -> WireCounts:
    """What one attempt of a store operation sent to a backend of fsspec ``protocol``.

    ``op``: put, create, get, head, list or delete. ``up``: the body a write sent. ``down``: the
    bytes a read returned (None: the attempt failed). ``entries``: what a LIST returned (None:
    it failed). ``whole``: a read without a byte range. ``missing``: the attempt found no object.
    """
    family = _family(protocol)
    if op in ("put", "create"):
        if family == "s3" and up >= min(5 * 2**30, 2 * PART_BYTES):
            n = 2 + _parts(up)  # start, parts, complete
        elif family == "gcs" and up >= PART_BYTES:
            n = 1 + _parts(up)  # start, chunks
        else:
            n = 1
        return WireCounts(puts=n, bytes_up=up)
    if op == "get":
        got = down or 0
        if family == "s3" and whole:  # s3fs asks the size first, then reads (in chunks if large)
            if missing:  # no object: s3fs then LISTs the name, in case it is a folder
                return WireCounts(heads=1, lists=1)
            gets = 0 if down is None else (_parts(got) if got > PART_BYTES else 1)
            return WireCounts(heads=1, gets=gets, bytes_down=got)
        return WireCounts(gets=1, bytes_down=got)
    if op == "list":
        if entries is None:
            return WireCounts(lists=1)
        pages = max(1, math.ceil(entries / PAGE_ENTRIES))
        if entries == 0 and family == "s3":
            return WireCounts(lists=pages + 1)
        if entries == 0 and family == "gcs":
            return WireCounts(lists=pages, heads=1)
        return WireCounts(lists=pages)
    if op == "delete":
        return WireCounts(deletes=1)
    if op == "head":
        return WireCounts(heads=1)
    raise ValueError(f"unknown store operation {op!r}")


def wire_report(counts: WireCounts, *, tokens: int, meter: str) -> dict[str, Any]:
    """What a learner reports with each contribution (its ``info["wire"]``): its store's counts
    since it started, the tokens it trained in the same span, and the meter's id (reports of one
    meter only grow; a reader takes differences between them, whatever order they arrive in)."""
    return {**counts.to_dict(), "tokens": int(tokens), "meter": meter}


_METER = re.compile(r"[0-9A-Za-z_-]{1,32}")


def meter_from_report(value: Any) -> str:
    """The ``meter`` of a reported :func:`wire_report` (untrusted): "" unless 1-32 letters, digits, - or _."""
    meter = value.get("meter") if isinstance(value, Mapping) else None
    return meter if isinstance(meter, str) and _METER.fullmatch(meter) else ""


def _count(v: Any, limit: int) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return min(max(v, 0), limit)
    return None


def tokens_from_report(value: Any, *, limit: int = REPORT_LIMIT) -> int:
    """The ``tokens`` of a reported :func:`wire_report` (untrusted): clipped, 0 if not an integer."""
    return (_count(value.get("tokens"), limit) or 0) if isinstance(value, Mapping) else 0


def wire_from_report(value: Any, *, limit: int = REPORT_LIMIT) -> WireCounts | None:
    """Counts someone else reported (JSON, untrusted): each known field a non-negative integer,
    clipped to ``limit``; a field that is missing or not an integer counts 0 (a bool, a float, a
    string are not counts). None if ``value`` is not a mapping or carries no count at all."""
    if not isinstance(value, Mapping):
        return None
    out = {f: n for f in WIRE_FIELDS if (n := _count(value.get(f), limit)) is not None}
    return WireCounts(**out) if out else None
