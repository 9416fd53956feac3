"""One reader discipline: every bucket object is read through here (docs/protocol.md section 5,
"One path for every reader").

A bucket object is input from whoever could write it. Every reader (the synchronizer, a
learner's fetcher, ``atoll status``, ``verify``, the round recorder, goodput, the fleet watch,
``atoll stop``, retention, resume) reads records through :func:`read_bytes` and
:func:`load_json`, which turn anything malformed, oversized, non-regular (a folder, a FIFO, a
link out of the run) or unparseable into a :class:`Skipped` value naming the key and why, never
an exception. Numbers are parsed with bounds: an integer of more than :data:`MAX_INT_DIGITS`
digits or a float that is not finite (``1e400`` parses as infinity) makes the object unusable,
so no later ``float()`` can overflow and no NaN or infinity reaches a number that must be
finite. Only a transient storage error is raised: the store is unwell, not the object, and the
caller's retry policy decides.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from atoll.core.rejection import Rejection, RejectionKind
from atoll.storage.validation import InvalidInput, StorageError, TransientStorageError

__all__ = ["Skipped", "NumberBoundError", "MAX_INT_DIGITS", "MAX_WHY_CHARS", "loads_bounded", "read_bytes", "read_parsed", "skip_of",
           "get_plain",
           "bounded_int", "finite_float"]

MAX_INT_DIGITS = 40
"""Longest integer a record may spell (far beyond 2**64); a longer one makes the record unusable."""

MAX_WHY_CHARS = 400
"""Longest reason a :class:`Skipped` carries (the object's own text is never repeated in full)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Skipped:
    """An object a reader did not use: ``key`` (run-relative), ``kind`` (a bad-input kind of
    :class:`~atoll.core.rejection.RejectionKind`: ``oversize``, ``corrupt``, ``schema``, ...) and
    ``why`` for people. Readers return it where the protocol says skip or void; never raised."""

    key: str
    kind: RejectionKind
    why: str

    def __str__(self) -> str:
        return f"{self.key}: {self.kind.value}: {self.why}"

    @property
    def rejection(self) -> Rejection:
        return Rejection(self.kind, self.why)


def skip_of(key: str, error: BaseException) -> Skipped:
    """The :class:`Skipped` value of an error raised while reading or parsing ``key``."""
    if isinstance(error, InvalidInput):
        return Skipped(key, error.kind, error.reason[:MAX_WHY_CHARS])
    text = f"{type(error).__name__}: {error}"
    return Skipped(key, RejectionKind.CORRUPT, text[:MAX_WHY_CHARS])


class NumberBoundError(ValueError):
    """A JSON number out of bounds: an integer too long, a float that is not finite."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise NumberBoundError(f"an integer of {len(text.lstrip('-'))} digits (records hold integers up to 2**53 "
                               f"and finite floats)")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NumberBoundError(f"the number {text[:40]} is not finite (records hold integers up to 2**53 and "
                               f"finite floats)")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"non-finite number {text} in a record")


def loads_bounded(data: bytes) -> Any:
    """JSON from bytes with bounded numbers; ValueError (or UnicodeDecodeError, RecursionError)
    for anything else. Integers of more than :data:`MAX_INT_DIGITS` digits, floats that overflow
    to infinity and the constants NaN/Infinity are refused."""
    return json.loads(bytes(data).decode("utf-8"), parse_int=_bounded_int, parse_float=_finite_float,
                      parse_constant=_no_constant)


def read_bytes(store: Any, key: str, cap: int, *, denied_raises: bool = False) -> bytes | Skipped | None:
    """At most ``cap`` bytes of the object at ``key``: its bytes, None if absent, or
    :class:`Skipped` (larger than ``cap``; not a regular object: a folder, a FIFO, a link out of
    the run; any other error reading it). One capped GET. ``store`` is an
    :class:`~atoll.storage.store.ObjectStore`. Raises only :class:`TransientStorageError`, and
    PermissionError with ``denied_raises`` (for objects only the operator writes, such as
    ``run.json``: access denied there is the reader's credentials, which the operator must see; on
    a learner's object it may be the learner's doing, so it is skipped like any other)."""
    try:
        data = get_plain(store, key, cap, denied_raises=denied_raises)
    except InvalidInput as e:
        return skip_of(key, e)
    if data is None:
        return None
    if len(data) > cap:
        return Skipped(key, RejectionKind.OVERSIZE, f"larger than the {cap}-byte cap for its kind")
    return data


def get_plain(store: Any, key: str, cap: int, *, denied_raises: bool = False) -> bytes | None:
    """The object at ``key`` as the store hands it back for a read capped at ``cap`` (the backend
    may return a byte more, so that the caller can tell "longer"), None if absent; anything that
    is not a readable regular object (a folder, a FIFO, a link out of the run, access denied, a
    name the backend refuses) raises InvalidInput('corrupt'), which every payload reader already
    handles. Only :class:`TransientStorageError` (and PermissionError with ``denied_raises``)
    passes through. Payload readers that check sizes and digests themselves call this; record
    readers call :func:`read_bytes`."""
    try:
        data: bytes | None = store.get_or_none(key, max_bytes=cap)
    except TransientStorageError:
        raise  # the store is unwell, not this object
    except PermissionError:
        if denied_raises:
            raise
        raise InvalidInput(RejectionKind.CORRUPT, "cannot be read: access denied") from None
    except InvalidInput:
        raise
    except (StorageError, OSError, ValueError) as e:  # a folder, a FIFO, a link out, a name the backend refuses
        raise InvalidInput(RejectionKind.CORRUPT, f"cannot be read: {type(e).__name__}: {str(e)[:300]}") from None
    return data


def read_parsed(store: Any, key: str, cap: int, parse: Callable[[bytes], T]) -> T | Skipped | None:
    """:func:`read_bytes`, then ``parse(bytes)``; anything ``parse`` raises (but a transient
    storage error) becomes :class:`Skipped`."""
    data = read_bytes(store, key, cap)
    if data is None or isinstance(data, Skipped):
        return data
    try:
        return parse(data)
    except TransientStorageError:
        raise
    except Exception as e:  # noqa: BLE001 - one object never stops a reader: it is skipped, typed
        return skip_of(key, e)


def bounded_int(body: Mapping[str, Any], name: str, *, minimum: int = 0, maximum: int = 2**53,
                optional: bool = False) -> int | None:
    """``body[name]`` as an int in [minimum, maximum]; InvalidInput('schema') otherwise."""
    v = body.get(name)
    if v is None and optional:
        return None
    if not (isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= maximum):
        shown = f"an integer of {v.bit_length()} bits" if isinstance(v, int) and v.bit_length() > 64 else repr(v)
        raise InvalidInput("schema", f"{name} must be an integer in [{minimum}, {maximum}], got {shown[:100]}")
    return int(v)


def finite_float(body: Mapping[str, Any], name: str) -> float:
    """``body[name]`` as a finite float (an integer too large for a float is refused, not raised
    as OverflowError); InvalidInput('schema') otherwise."""
    v = body.get(name)
    ok = isinstance(v, int | float) and not isinstance(v, bool)
    if ok and isinstance(v, int):
        ok = abs(v) <= 2**1000
    if not (ok and math.isfinite(float(v))):  # type: ignore[arg-type]
        shown = f"an integer of {v.bit_length()} bits" if isinstance(v, int) and not isinstance(v, bool) else repr(v)
        raise InvalidInput("schema", f"{name} must be a finite number, got {shown[:100]}")
    return float(v)  # type: ignore[arg-type]
