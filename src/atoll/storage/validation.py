"""Errors of the storage layer and the checks that turn bad input into a specific reason.

Every rejection is an :class:`InvalidInput` with a machine-readable ``kind`` (one of
:data:`REJECTION_KINDS`) and a human-readable ``reason``. Nothing here touches storage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch

from atoll.core.compress import all_finite
from atoll.core.rejection import STORAGE_KINDS, Rejection, RejectionKind

__all__ = [
    "REJECTION_KINDS",
    "SAFE_ID_PATTERN",
    "StorageError",
    "InvalidInput",
    "TransientStorageError",
    "UnsafeStoreError",
    "RunNotFoundError",
    "RunExistsError",
    "RoundOrderError",
    "PrunedError",
    "ReadOnlyError",
    "LayoutError",
    "validate_id",
    "validate_learner_id",
    "RESERVED_IDS",
    "check_shapes",
    "check_tensor_layout",
    "check_finite",
]

REJECTION_KINDS = tuple(sorted(k.value for k in STORAGE_KINDS))
"""The kinds of bad input (a subset of core's closed set :class:`RejectionKind`)."""

SAFE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""Learner ids and run ids: 1-128 chars of ``[A-Za-z0-9_.-]``, starting alphanumeric, no ``..``."""


class StorageError(Exception):
    """Base class of everything atoll.storage raises on purpose."""


class InvalidInput(StorageError, ValueError):
    """Bad input, rejected and never trusted. ``kind`` is a :class:`RejectionKind` of bad input
    (one of :data:`REJECTION_KINDS`); code keys on it, never on the message."""

    def __init__(self, kind: str | RejectionKind, reason: str, *, url: str | None = None) -> None:
        if kind not in REJECTION_KINDS:
            raise ValueError(f"unknown bad-input kind {kind!r}; known: {REJECTION_KINDS}")
        self.kind = RejectionKind(kind)
        self.reason = reason
        self.url = url
        super().__init__(f"[{self.kind.value}] {reason}" + (f" ({url})" if url else ""))

    @property
    def rejection(self) -> Rejection:
        """The typed rejection a round records for this bad input."""
        return Rejection(self.kind, self.reason + (f" ({self.url})" if self.url else ""))


class TransientStorageError(StorageError):
    """A storage operation kept failing with transient errors after every retry."""

    def __init__(self, op: str, url: str, attempts: int, cause: BaseException) -> None:
        self.op, self.url, self.attempts = op, url, attempts
        super().__init__(f"{op} {url} failed after {attempts} attempt(s): {type(cause).__name__}: {cause}")


class UnsafeStoreError(StorageError):
    """The store does not refuse a second create of the same object (no create-once)."""


class RunNotFoundError(StorageError, FileNotFoundError):
    """No run manifest at the run root."""


class RunExistsError(StorageError, FileExistsError):
    """A run was already initialised at this root."""


class ReadOnlyError(StorageError):
    """A write through a run handle opened read-only (``RunReader.open(..., read_only=True)``, or any role's ``open``)."""


class LayoutError(StorageError):
    """The run was written with a bucket layout this atoll does not read."""


class RoundOrderError(StorageError):
    """A round was committed out of order (its predecessor is not committed)."""


class PrunedError(StorageError):
    """What was asked for was deleted on purpose by retention (``atoll prune``): an old round's
    global state. Not bad input and not a storage fault, so it is not InvalidInput."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        self.url = url
        super().__init__(message + (f" ({url})" if url else ""))


def validate_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it is a safe id; raise InvalidInput(kind='bad_id') otherwise."""
    if not isinstance(value, str):
        raise InvalidInput("bad_id", f"{what} must be a string, got {type(value).__name__}")
    if "/" in value or "\\" in value:
        raise InvalidInput("bad_id", f"{what} {value!r} contains a path separator")
    if ".." in value:
        raise InvalidInput("bad_id", f"{what} {value!r} contains '..'")
    if not SAFE_ID_PATTERN.fullmatch(value):  # fullmatch: '$' alone would accept a trailing newline
        raise InvalidInput(
            "bad_id",
            f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9_.-] starting with a letter or digit",
        )
    return value


RESERVED_IDS = frozenset({"synchronizer", "operator", "atoll-operator", "atoll-synchronizer", "sync", "learners",
                          "_probe", "all", "root", "admin"})
"""Names no learner may take (compared case-insensitively): the synchronizer's key and lease
holder, the operator principals of the bucket policy, the run's top-level prefixes. A learner
named ``synchronizer`` would hold the synchronizer's keyring entry (its signing key) and, on a
local folder, a lease that fences the real synchronizer."""


def validate_learner_id(value: object) -> str:
    """:func:`validate_id` for a learner id, which also may not be one of :data:`RESERVED_IDS`
    (InvalidInput(kind='bad_id'))."""
    lid = validate_id(value, "learner id")
    if lid.lower() in RESERVED_IDS:
        raise InvalidInput("bad_id", f"learner id {lid!r} is reserved (reserved: {', '.join(sorted(RESERVED_IDS))})")
    return lid


def check_shapes(
    shapes: Mapping[str, Sequence[int]],
    expected: Mapping[str, Sequence[int]],
    *,
    what: str,
    allow_missing: bool = False,
) -> None:
    """Names must equal ``expected``'s keys (a subset if ``allow_missing``); shapes must match."""
    missing = [] if allow_missing else sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        raise InvalidInput(
            "layout", f"{what}: tensor names differ from the fragment (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for name, shape in shapes.items():
        got = tuple(int(d) for d in shape)
        want = tuple(int(d) for d in expected[name])
        if got != want:
            raise InvalidInput("layout", f"{what}: {name!r} has shape {got}, expected {want}")


def check_tensor_layout(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, Sequence[int]],
    *,
    what: str,
    dtype: torch.dtype | None = None,
    allow_missing: bool = False,
) -> None:
    """Names must equal ``expected``'s keys; shapes must match; dtype too if given."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidInput("layout", f"{what}: {name!r} is a {type(t).__name__}, not a tensor")
    check_shapes({n: tuple(t.shape) for n, t in tensors.items()}, expected, what=what, allow_missing=allow_missing)
    for name, t in tensors.items():
        if dtype is not None and t.dtype != dtype:
            raise InvalidInput("layout", f"{what}: {name!r} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not t.is_floating_point():
            raise InvalidInput("layout", f"{what}: {name!r} has dtype {t.dtype}, expected a floating dtype")


def check_finite(tensors: Mapping[str, torch.Tensor], *, what: str) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and not all_finite(t):
            raise InvalidInput("non_finite", f"{what}: {name!r} has NaN or Inf values")


def check_finite_number(value: object, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(float(value)):
        raise InvalidInput("schema", f"{what} must be a finite number, got {value!r}")
    return float(value)
