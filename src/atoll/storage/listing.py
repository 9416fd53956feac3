"""What one LIST of a prefix returns, whichever backend answered: names, sizes, modification times.

fsspec's ``ls`` entries differ per backend (local ``mtime``, S3 ``LastModified``, GCS ``updated``);
a capped listing is one request on S3 and GCS only through their own listing calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import fsspec
import fsspec.asyn

__all__ = ["ObjectInfo", "entry_info", "entry_name", "list_some", "modified_s"]


@dataclass(frozen=True)
class ObjectInfo:
    """One entry of :meth:`~atoll.storage.store.ObjectStore.list_info`."""

    name: str
    """Last path component."""
    is_dir: bool
    """A prefix ("folder"), not an object."""
    size: int
    """Bytes (0 for a prefix)."""
    modified_s: float | None
    """Last modification, Unix seconds by the store's clock; None if the backend gives none."""


def entry_name(entry: object) -> str:
    """Last path component of a listed path (a prefix's trailing ``/`` dropped)."""
    return str(entry).rstrip("/").rsplit("/", 1)[-1]


def modified_s(entry: Mapping[str, Any]) -> float | None:
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


def entry_info(entry: Mapping[str, Any]) -> ObjectInfo | None:
    """An ``ls(detail=True)`` entry as an :class:`ObjectInfo`; None for a temporary file."""
    name = entry_name(entry.get("name", ""))
    if not name or name.startswith(".tmp-"):
        return None
    is_dir = entry.get("type") == "directory"
    size = entry.get("size", entry.get("Size"))
    return ObjectInfo(name=name, is_dir=is_dir, size=int(size) if isinstance(size, int) and not is_dir else 0,
                      modified_s=None if is_dir else modified_s(entry))


def list_some(fs: fsspec.AbstractFileSystem, path: str, limit: int) -> list[str]:
    """Up to ``limit`` entries of ``path`` (paths or names), one request where the backend allows."""
    protocols = set(fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,))
    if protocols & {"s3", "s3a"}:
        entries = fsspec.asyn.sync(fs.loop, fs._lsdir, path.rstrip("/"), refresh=True, max_items=limit)
    elif protocols & {"gs", "gcs"}:
        entries = fsspec.asyn.sync(fs.loop, fs._list_objects, path.rstrip("/"), max_results=limit)
    else:
        return sorted(fs.ls(path, detail=False))[:limit]
    return [str(e["name"]) for e in entries][:limit]
