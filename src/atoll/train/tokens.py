"""Token files read lazily: flat token files on any fsspec URL, joined end to end, sliced and sharded.

:class:`TokenData` is a read-only sequence of token ids: one or more flat token files (nanoGPT's
``.bin``: raw little-endian uint8/uint16/uint32, no header) joined end to end. Nothing is loaded
up front: local files are ``np.memmap``-ed, remote ones are read by byte range
(``fs.cat_ranges``), only the windows a batch needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

__all__ = ["DataError", "TOKEN_DTYPES", "TokenData", "open_tokens", "write_tokens"]

TOKEN_DTYPES = ("uint8", "uint16", "uint32")
"""Token file element types atoll reads (little-endian, no header)."""


class DataError(ValueError):
    """Data is missing, malformed or too small; the message names the knob to change."""


@dataclass
class _TokenFile:
    """One flat token file. Picklable: the memmap is reopened lazily in each process."""

    url: str
    dtype: str
    num_tokens: int
    fs: Any = field(repr=False)
    path: str = field(repr=False)
    _memmap: np.memmap | None = field(default=None, repr=False, compare=False)

    @property
    def is_local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple | list) else (protocol,))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_memmap"] = None  # an mmap does not travel between processes; reopen on demand
        return state

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Tokens ``[start, start + count)`` for each ``(start, count)``, as int64 arrays."""
        if self.is_local:
            if self._memmap is None:
                size = os.path.getsize(self.path)
                if size < self.num_tokens * np.dtype(self.dtype).itemsize:
                    raise DataError(f"{self.url}: the file shrank to {size} bytes after it was opened with "
                                    f"{self.num_tokens} tokens; is it being rewritten?")
                # The OS pages in only what we touch; a 100 GB shard costs no RAM up front.
                self._memmap = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
            return [np.asarray(self._memmap[s : s + n], dtype=np.int64) for s, n in ranges]
        item = np.dtype(self.dtype).itemsize
        # One ranged read per window; async filesystems (s3, gcs, http) run them concurrently.
        blobs = self.fs.cat_ranges(
            [self.path] * len(ranges), [s * item for s, _ in ranges], [(s + n) * item for s, n in ranges]
        )
        out = []
        for blob, (_, n) in zip(blobs, ranges, strict=True):
            if isinstance(blob, Exception):
                raise blob
            if len(blob) != n * item:
                raise DataError(
                    f"{self.url}: short read ({len(blob)} of {n * item} bytes); is the file truncated?"
                )
            out.append(np.frombuffer(blob, dtype=np.dtype(self.dtype).newbyteorder("<")).astype(np.int64))
        return out


def _read_sidecar(fs: Any, path: str) -> dict[str, Any] | None:
    """The JSON sidecar for a token file: ``<file>.json``, else ``meta.json`` beside it."""
    for candidate in (path + ".json", path.rsplit("/", 1)[0] + "/meta.json" if "/" in path else "meta.json"):
        if fs.exists(candidate):
            try:
                with fs.open(candidate, "rb") as f:
                    meta = json.loads(f.read())
            except (OSError, ValueError) as e:
                raise DataError(f"token sidecar {candidate}: not valid JSON ({e})") from e
            if not isinstance(meta, dict):
                raise DataError(f"token sidecar {candidate}: expected a JSON object")
            return meta
    return None


def _check_dtype(dtype: Any, where: str) -> str:
    name = np.dtype(dtype).name if isinstance(dtype, type | np.dtype) else str(dtype)
    if name not in TOKEN_DTYPES:
        raise DataError(f"{where}: dtype={dtype!r} is not a token dtype; use one of {TOKEN_DTYPES}")
    return name


def _open_token_file(
    url: str, *, dtype: str | None, storage_options: dict[str, Any] | None
) -> tuple[_TokenFile, int | None]:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not fs.exists(path) or fs.isdir(path):
        raise FileNotFoundError(f"token file {url!r} not found (check the data url / train_url / val_url)")
    meta = _read_sidecar(fs, path) or {}
    declared = meta.get("dtype")
    if dtype is None and declared is None:
        raise DataError(
            f"{url}: token dtype unknown; pass dtype= (one of {TOKEN_DTYPES}) or write a sidecar "
            f"{url}.json like {{\"dtype\": \"uint16\"}}"
        )
    if dtype is not None and declared is not None and _check_dtype(dtype, url) != _check_dtype(declared, url):
        raise DataError(f"{url}: dtype={dtype!r} contradicts the sidecar's dtype {declared!r}")
    name = _check_dtype(dtype if dtype is not None else declared, url)
    size = fs.size(path)
    item = np.dtype(name).itemsize
    if size % item:
        raise DataError(
            f"{url}: {size} bytes is not a whole number of {name} tokens ({item} bytes each); "
            "is dtype= right, or the file truncated?"
        )
    vocab = meta.get("vocab_size")
    return _TokenFile(url=url, dtype=name, num_tokens=size // item, fs=fs, path=path), (
        int(vocab) if vocab is not None else None
    )


class TokenData:
    """Token files joined end to end, read lazily; optionally a ``[start, stop)`` view of them.

    Picklable (so it can be handed to learner processes) and cheap to slice.
    """

    def __init__(
        self,
        files: Sequence[_TokenFile],
        *,
        vocab_size: int | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self.files = list(files)
        self.vocab_size = vocab_size
        # Cumulative token offsets of each file: global index -> (file, local index) by bisection.
        self._offsets = np.cumsum([0] + [f.num_tokens for f in self.files]).tolist()
        total = self._offsets[-1]
        self.start = start
        self.stop = total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"TokenData view [{start}, {stop}) outside [0, {total})")

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        urls = [f.url for f in self.files]
        shown = urls if len(urls) <= 3 else [*urls[:2], f"... {len(urls) - 2} more"]
        return f"TokenData({shown}, tokens=[{self.start}, {self.stop}), vocab_size={self.vocab_size})"

    def view(self, start: int, stop: int) -> TokenData:
        """Tokens ``[start, stop)`` of this data (relative indices), without reading anything."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"view [{start}, {stop}) outside [0, {len(self)})")
        return TokenData(self.files, vocab_size=self.vocab_size, start=self.start + start, stop=self.start + stop)

    def shard(self, index: int, count: int) -> TokenData:
        """Contiguous, disjoint part ``index`` of ``count`` equal parts (the last may be 1 longer)."""
        if not (isinstance(index, int) and isinstance(count, int) and count >= 1 and 0 <= index < count):
            raise DataError(f"learner_index={index!r} must be in [0, num_learners={count!r})")
        n = len(self)
        return self.view(index * n // count, (index + 1) * n // count)

    def read_windows(self, starts: Sequence[int], length: int) -> np.ndarray:
        """``[len(starts), length]`` int64 array: tokens ``[s, s + length)`` for each start ``s``."""
        out = np.empty((len(starts), length), dtype=np.int64)
        # Group the (possibly file-straddling) pieces per file so each file gets one batched read.
        per_file: dict[int, list[tuple[int, int, int, int]]] = {}
        for row, s in enumerate(starts):
            if s < 0 or s + length > len(self):
                raise IndexError(f"window [{s}, {s + length}) outside [0, {len(self)})")
            g, col = self.start + s, 0
            while col < length:
                k = int(np.searchsorted(self._offsets, g, side="right")) - 1
                local = g - self._offsets[k]
                n = min(length - col, self.files[k].num_tokens - local)
                per_file.setdefault(k, []).append((row, col, local, n))
                g, col = g + n, col + n
        for k, pieces in per_file.items():
            arrays = self.files[k].read_ranges([(local, n) for _, _, local, n in pieces])
            for (row, col, _, n), arr in zip(pieces, arrays, strict=True):
                out[row, col : col + n] = arr
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            raise DataError(
                f"token id {int(out.max())} >= vocab_size={self.vocab_size} in {self!r}; "
                "wrong dtype= or vocab_size= for these files?"
            )
        return out

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` as a 1-D int64 array."""
        return self.read_windows([start], count)[0]


def open_tokens(
    urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    dtype: str | None = None,
    vocab_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> TokenData:
    """Open flat token files (one URL, a glob like ``s3://b/train_*.bin``, or a list), lazily.

    ``dtype`` (uint8/uint16/uint32) may instead come from a JSON sidecar ``<file>.json`` or a
    ``meta.json`` in the same folder, which may also give ``vocab_size``. Files are joined in
    the order given (a glob is sorted).
    """
    items = [urls] if isinstance(urls, str | os.PathLike) else list(urls)
    if not items:
        raise DataError("open_tokens: no token files given (urls= is empty)")
    expanded: list[str] = []
    for u in items:
        u = os.fspath(u)
        if any(c in u for c in "*?["):
            fs, _ = fsspec.core.url_to_fs(u, **(storage_options or {}))
            matches = sorted(fs.glob(u))
            if not matches:
                raise FileNotFoundError(f"token file pattern {u!r} matched nothing")
            proto = u.split("://", 1)[0] + "://" if "://" in u else ""
            expanded += [m if "://" in m or not proto else proto + m for m in matches]
        else:
            expanded.append(u)
    files, vocabs = [], set()
    for u in expanded:
        f, v = _open_token_file(u, dtype=dtype, storage_options=storage_options)
        files.append(f)
        if v is not None:
            vocabs.add(v)
    if vocab_size is None and len(vocabs) == 1:
        vocab_size = vocabs.pop()
    elif vocab_size is None and len(vocabs) > 1:
        raise DataError(f"token files declare different vocab sizes {sorted(vocabs)}; pass vocab_size=")
    return TokenData(files, vocab_size=vocab_size)


def write_tokens(
    url: str,
    tokens: np.ndarray | Sequence[int],
    *,
    dtype: str = "uint16",
    vocab_size: int | None = None,
    sidecar: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write a flat token file (and its ``<url>.json`` sidecar). For tests, demos, small data."""
    name = _check_dtype(dtype, url)
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(name).max):
        raise DataError(f"{url}: token ids out of range for dtype={name!r}")
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    with fs.open(path, "wb") as f:
        f.write(arr.astype(np.dtype(name).newbyteorder("<")).tobytes())
    if sidecar:
        meta: dict[str, Any] = {"dtype": name}
        if vocab_size is not None:
            meta["vocab_size"] = int(vocab_size)
        with fs.open(path + ".json", "w") as f:
            json.dump(meta, f)
