"""Training data: token files read lazily, a per-learner shard, and a resumable batch cursor.

Three layers, each small:

* :class:`TokenData` is a read-only sequence of token ids: one or more flat token files
  (nanoGPT's ``.bin``: raw little-endian uint8/uint16/uint32, no header) on any fsspec URL,
  joined end to end. Nothing is loaded up front: local files are ``np.memmap``-ed, remote ones
  are read by byte range (``fs.cat_ranges``), only the windows a batch needs.
* :func:`stdlib_corpus` / :func:`text_corpus` build the default corpus with no download: the
  Python standard library's own source, as raw bytes (vocabulary 256), split into train and
  validation **by file**, written once to a cache folder as token files, then read as above.
* :class:`BatchStream` gives learner ``i`` of ``M`` its own disjoint shard of the train tokens
  and hands out ``(x, y)`` batches in a seeded order. Its whole position is a small JSON-able
  cursor (:meth:`BatchStream.state_dict`), saved with the learner's state, so a learner that
  rejoins continues with exactly the next window: nothing repeated, nothing skipped.

:func:`evaluate` gives a deterministic validation loss for any model meeting the model contract.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

from atoll.train.model import loss_fn

__all__ = [
    "DataError",
    "TOKEN_DTYPES",
    "TokenData",
    "Corpus",
    "open_tokens",
    "token_corpus",
    "text_corpus",
    "stdlib_corpus",
    "write_tokens",
    "BatchStream",
    "CURSOR_FORMAT",
    "evaluate",
    "encode_bytes",
    "decode_bytes",
]

TOKEN_DTYPES = ("uint8", "uint16", "uint32")
"""Token file element types atoll reads (little-endian, no header)."""

CURSOR_FORMAT = "atoll.data.cursor/1"
"""Version tag stored in every cursor; a cursor with another tag is refused."""

FILE_SEPARATOR = 0
"""Byte-level corpora join files with one NUL byte (token 0), which Python source never contains,
so the model sees where one file ends and the next begins."""


class DataError(ValueError):
    """Data is missing, malformed or too small; the message names the knob to change."""


# ----------------------------------------------------------------------------------------------
# Token files


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


# ----------------------------------------------------------------------------------------------
# Corpora


@dataclass(frozen=True)
class Corpus:
    """A train and a validation split of one tokenization."""

    train: TokenData
    val: TokenData
    vocab_size: int
    meta: dict[str, Any] = field(default_factory=dict)
    """Where it came from (source folder, file counts, bytes); informational."""


def token_corpus(
    train_url: str | Sequence[str],
    val_url: str | Sequence[str],
    *,
    dtype: str | None = None,
    vocab_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Corpus:
    """A corpus of your own pre-tokenized shards (nanoGPT style ``train.bin`` / ``val.bin``)."""
    train = open_tokens(train_url, dtype=dtype, vocab_size=vocab_size, storage_options=storage_options)
    val = open_tokens(
        val_url, dtype=dtype, vocab_size=vocab_size or train.vocab_size, storage_options=storage_options
    )
    vocab = vocab_size or train.vocab_size or val.vocab_size
    if vocab is None:
        raise DataError("token_corpus: vocab_size unknown; pass vocab_size= or put it in the sidecar JSON")
    train.vocab_size = val.vocab_size = vocab
    return Corpus(train=train, val=val, vocab_size=vocab, meta={"train_url": train_url, "val_url": val_url})


def encode_bytes(text: str | bytes) -> np.ndarray:
    """Byte-level tokenization: UTF-8 bytes are the token ids (vocabulary 256)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)


def decode_bytes(tokens: Iterable[int] | torch.Tensor | np.ndarray) -> str:
    """Inverse of :func:`encode_bytes`; invalid UTF-8 (a sample cut mid-character) is replaced."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # A hash of the relative path, not a random draw: the same file lands in the same split on
    # every machine and every run, and adding a file never moves another one between splits.
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < val_fraction


def _default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "atoll-data"


def text_corpus(
    source_dir: str | os.PathLike[str],
    *,
    pattern: str = "*.py",
    exclude_dirs: Sequence[str] = (),
    max_corpus_mb: float | None = 8.0,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Corpus:
    """A byte-level corpus of the text files under ``source_dir``, split by file, cached.

    Files matching ``pattern`` (recursively; folders named in ``exclude_dirs`` skipped) are taken
    in sorted relative-path order until ``max_corpus_mb`` megabytes (10^6 bytes; None = all),
    each assigned to validation when a hash of its relative path falls below ``val_fraction``.
    The splits are written once to ``cache_dir`` (default: ``$TMPDIR/atoll-data``) as uint8
    token files keyed by a digest of the inputs, then memory-mapped: later calls are instant.
    """
    root = Path(source_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus source_dir={os.fspath(source_dir)!r} is not a directory")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    if max_corpus_mb is not None and not max_corpus_mb > 0:
        raise DataError(f"max_corpus_mb={max_corpus_mb!r} must be > 0 (or None for everything)")
    excluded = set(exclude_dirs)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune excluded folders instead of filtering afterwards: site-packages can be far
        # larger than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in excluded]
        for name in filenames:
            if fnmatch.fnmatch(name, pattern):
                p = Path(dirpath) / name
                files.append((p.relative_to(root).as_posix(), p))
    files.sort()
    if not files:
        raise DataError(f"corpus source_dir={os.fspath(root)!r} has no files matching pattern={pattern!r}")
    cap = None if max_corpus_mb is None else int(max_corpus_mb * 1e6)
    chosen, total = [], 0
    for rel, p in files:
        if cap is not None and total >= cap:
            break
        size = p.stat().st_size
        chosen.append((rel, p, size))
        total += size + 1
    # The cache key covers everything that changes the bytes: which files, their sizes and
    # mtimes, and the split. Same inputs -> same folder -> no rework.
    key = hashlib.sha256(
        json.dumps(
            [os.fspath(root.resolve()), val_fraction, [(r, s, p.stat().st_mtime_ns) for r, p, s in chosen]]
        ).encode()
    ).hexdigest()[:16]
    folder = Path(cache_dir if cache_dir is not None else _default_cache_dir()) / f"bytes-{key}"
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        _materialize(folder, chosen, val_fraction, source=os.fspath(root))
    meta = json.loads(meta_path.read_text())
    for split in ("train", "val"):
        if meta[f"{split}_files"] == 0:
            raise DataError(
                f"the {split} split is empty ({len(chosen)} files under max_corpus_mb={max_corpus_mb}); "
                "raise max_corpus_mb or adjust val_fraction"
            )
    train = open_tokens(os.fspath(folder / "train.bin"))
    val = open_tokens(os.fspath(folder / "val.bin"))
    return Corpus(train=train, val=val, vocab_size=256, meta=meta)


def _materialize(folder: Path, chosen: list[tuple[str, Path, int]], val_fraction: float, *, source: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # Write under unique temporary names, then rename: learner processes racing to build the
    # same cache each produce identical files and the last rename wins harmlessly.
    suffix = f".tmp{os.getpid()}"
    counts = {"train": [0, 0], "val": [0, 0]}
    paths: dict[str, list[str]] = {"train": [], "val": []}
    sep = bytes([FILE_SEPARATOR])
    with open(folder / f"train.bin{suffix}", "wb") as ftrain, open(folder / f"val.bin{suffix}", "wb") as fval:
        for rel, p, _ in chosen:
            split = "val" if _is_val(rel, val_fraction) else "train"
            data = p.read_bytes() + sep
            (fval if split == "val" else ftrain).write(data)
            paths[split].append(rel)
            counts[split][0] += 1
            counts[split][1] += len(data)
    meta = {
        "dtype": "uint8",
        "vocab_size": 256,
        "tokenization": "bytes",
        "source": source,
        "val_fraction": val_fraction,
        "train_files": counts["train"][0],
        "train_tokens": counts["train"][1],
        "val_files": counts["val"][0],
        "val_tokens": counts["val"][1],
        # Which file went where (relative paths, in corpus order): the split is auditable.
        "files": paths,
    }
    (folder / f"meta.json{suffix}").write_text(json.dumps(meta, indent=1))
    os.replace(folder / f"train.bin{suffix}", folder / "train.bin")
    os.replace(folder / f"val.bin{suffix}", folder / "val.bin")
    os.replace(folder / f"meta.json{suffix}", folder / "meta.json")  # last: marks the cache complete


def stdlib_path() -> Path:
    """Folder of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(
    *,
    max_corpus_mb: float | None = 8.0,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
    source_dir: str | os.PathLike[str] | None = None,
) -> Corpus:
    """atoll's default corpus: the Python standard library's ``*.py`` sources as bytes.

    Real human-written text present on every machine, no download. The stdlib is ~30 MB; the
    default ``max_corpus_mb=8`` keeps the first 8 MB in sorted path order. Installed packages
    (``site-packages``) are not stdlib and are skipped. ``source_dir`` overrides the folder.
    """
    return text_corpus(
        source_dir if source_dir is not None else stdlib_path(),
        pattern="*.py",
        exclude_dirs=("site-packages", "dist-packages", "__pycache__"),
        max_corpus_mb=max_corpus_mb,
        val_fraction=val_fraction,
        cache_dir=cache_dir,
    )


# ----------------------------------------------------------------------------------------------
# Batches with a resumable cursor


def _mix(*parts: int) -> int:
    """A 64-bit hash of integers, stable across machines, Python and numpy versions."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


class BatchStream:
    """Learner ``learner_index`` of ``num_learners``: its shard of ``data``, in batches, resumable.

    The tokens are cut into non-overlapping windows of ``context_tokens + 1`` tokens sharing
    their edge token (x is the first T tokens, y the last T). Learner ``i``'s shard is every
    ``num_learners``-th window starting at window ``i`` (``interleave=True``, the default), so each
    learner's shard is a uniform sample of the whole corpus even when the corpus is ordered
    (files in path order, topics in blocks): DiLoCo's learners then see the same distribution
    as one data-parallel batch. ``interleave=False`` gives each learner a contiguous
    ``1/num_learners`` of the tokens instead (the layout of atoll <= 0.1, kept for comparison).
    An epoch visits every window of the shard once, in an order that is a seeded permutation of
    the shard's window indices, different each epoch.

    The permutation is affine, ``w = (a_e * k + b_e) mod num_windows`` with ``a_e`` coprime to
    ``num_windows`` and ``(a_e, b_e)`` hashed from (seed, learner, epoch): O(1) memory for any
    shard size and bit-identical on every machine and library version, which is what makes a
    saved cursor portable. Consecutive draws land far apart in the shard, so batches mix.

    The cursor (:meth:`state_dict`) is a small JSON-able dict; ``position`` counts windows (not
    batches), so a learner may change its batch size between saves and still neither repeat nor
    skip a window. Batches that cross the end of an epoch continue into the next epoch's order.
    """

    def __init__(
        self,
        data: TokenData,
        *,
        context_tokens: int,
        learner_index: int = 0,
        num_learners: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        interleave: bool = True,
    ) -> None:
        if not (isinstance(context_tokens, int) and context_tokens >= 1):
            raise DataError(f"context_tokens={context_tokens!r} must be an integer >= 1")
        self.interleave = bool(interleave)
        # Interleaved: the shard is all of the data and the learner owns windows i, i + M, ...
        self.shard = data if self.interleave else data.shard(learner_index, num_learners)
        if self.interleave:
            data.shard(learner_index, num_learners)  # same argument checks as the contiguous layout
        self.context_tokens = context_tokens
        self.learner_index = learner_index
        self.num_learners = num_learners
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        # Windows of T+1 tokens with stride T: window w is tokens [w*T, w*T + T + 1).
        total_windows = max(0, (len(self.shard) - 1) // context_tokens)
        self._stride, self._phase = (num_learners, learner_index) if self.interleave else (1, 0)
        # This learner's windows: global windows phase, phase + stride, ... below total_windows.
        self.num_windows = max(0, (total_windows - self._phase + self._stride - 1) // self._stride)
        if self.num_windows < 1:
            raise DataError(
                f"learner {learner_index}'s shard has {len(self.shard)} tokens, fewer than "
                f"context_tokens + 1 = {context_tokens + 1}: lower context_tokens or num_learners, "
                "or supply more data"
            )
        self.epoch = 0
        self.position = 0
        self._perm_cache: tuple[int, int, int] | None = None

    # -- the order ---------------------------------------------------------------------------

    def _affine(self, epoch: int) -> tuple[int, int]:
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1], self._perm_cache[2]
        n = self.num_windows
        if not self.shuffle or n == 1:
            a, b = 1, 0
        else:
            a = 1 + _mix(self.seed, self.learner_index, epoch, 1) % (n - 1)
            while math.gcd(a, n) != 1:  # coprime => k -> a*k + b is a bijection mod n
                a = a % (n - 1) + 1
            b = _mix(self.seed, self.learner_index, epoch, 2) % n
        self._perm_cache = (epoch, a, b)
        return a, b

    def window_indices(self, cursor: dict[str, Any], count: int) -> list[tuple[int, int]]:
        """The next ``count`` ``(epoch, window)`` pairs from ``cursor``, without moving it."""
        self._check_cursor(cursor)
        epoch, pos, out = int(cursor["epoch"]), int(cursor["position"]), []
        for _ in range(count):
            a, b = self._affine(epoch)
            out.append((epoch, (a * pos + b) % self.num_windows))
            pos += 1
            if pos == self.num_windows:
                epoch, pos = epoch + 1, 0
        return out

    # -- batches -----------------------------------------------------------------------------

    def batch_at(
        self, cursor: dict[str, Any], batch_size: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
        """Pure form: ``((x, y), next_cursor)`` for the batch starting at ``cursor``."""
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise DataError(f"batch_size={batch_size!r} must be an integer >= 1")
        if batch_size > self.num_windows:
            raise DataError(
                f"batch_size={batch_size} exceeds the {self.num_windows} windows in learner "
                f"{self.learner_index}'s shard (context_tokens={self.context_tokens}, "
                f"num_learners={self.num_learners}): a batch would repeat windows; lower batch_size, "
                "context_tokens or num_learners, or supply more data"
            )
        picks = self.window_indices(cursor, batch_size)
        T = self.context_tokens
        starts = [(w * self._stride + self._phase) * T for _, w in picks]
        windows = torch.from_numpy(self.shard.read_windows(starts, T + 1))
        # y is x shifted by one: position t of x is trained to predict token t + 1.
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        total = int(cursor["epoch"]) * self.num_windows + int(cursor["position"]) + batch_size
        nxt = dict(cursor, epoch=total // self.num_windows, position=total % self.num_windows)
        return (x, y), nxt

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``, int64 tensors of shape ``[batch_size, context_tokens]``."""
        (x, y), nxt = self.batch_at(self.state_dict(), batch_size)
        self.epoch, self.position = nxt["epoch"], nxt["position"]
        return x, y

    @property
    def tokens_served(self) -> int:
        """Input tokens handed out so far (windows served x context_tokens)."""
        return (self.epoch * self.num_windows + self.position) * self.context_tokens

    # -- the cursor ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: everything needed to continue exactly here. JSON-able."""
        return {
            "format": CURSOR_FORMAT,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "interleave": self.interleave,
            "learner_index": self.learner_index,
            "num_learners": self.num_learners,
            "context_tokens": self.context_tokens,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, cursor: dict[str, Any]) -> None:
        """Continue from a saved cursor; refuse one that belongs to a different stream."""
        self._check_cursor(cursor)
        self.epoch, self.position = int(cursor["epoch"]), int(cursor["position"])

    def _check_cursor(self, cursor: dict[str, Any]) -> None:
        if not isinstance(cursor, dict) or cursor.get("format") != CURSOR_FORMAT:
            raise DataError(f"not a data cursor of format {CURSOR_FORMAT!r}: {cursor!r}")
        mine = self.state_dict()
        cursor = {"interleave": False, **cursor}  # cursors saved before interleaving existed
        for knob in ("seed", "shuffle", "interleave", "learner_index", "num_learners", "context_tokens",
                     "num_windows"):
            if cursor.get(knob) != mine[knob]:
                raise DataError(
                    f"data cursor was saved with {knob}={cursor.get(knob)!r} but this stream has "
                    f"{knob}={mine[knob]!r}; resuming would repeat or skip data. Use the same "
                    "data, seed, num_learners and context_tokens, or start a fresh cursor"
                )
        pos = cursor.get("position")
        if not (isinstance(pos, int) and 0 <= pos < self.num_windows and isinstance(cursor.get("epoch"), int)):
            raise DataError(f"data cursor position/epoch out of range: {cursor!r}")


# ----------------------------------------------------------------------------------------------
# Validation


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val_data: TokenData,
    *,
    batches: int = 8,
    batch_size: int = 16,
    context_tokens: int | None = None,
) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` on ``val_data``. Deterministic.

    Uses ``batches * batch_size`` windows of ``context_tokens + 1`` tokens spread evenly over the
    whole validation set (all windows if there are fewer), the same ones on every call, so losses
    from different rounds, learners and runs compare directly. ``context_tokens`` defaults to
    ``model.config.context_tokens`` for atoll's GPT; pass it for your own model.
    """
    if context_tokens is None:
        context_tokens = getattr(getattr(model, "config", None), "context_tokens", None)
        if context_tokens is None:
            raise DataError("evaluate: pass context_tokens= (the model has no config.context_tokens)")
    T = int(context_tokens)
    available = (len(val_data) - 1) // T
    if available < 1:
        raise DataError(
            f"validation data has {len(val_data)} tokens, fewer than context_tokens + 1 = {T + 1}; "
            "lower context_tokens or supply more validation data"
        )
    wanted = min(batches * batch_size, available)
    # Evenly spaced window starts: a fixed, representative sample of the whole set.
    starts = [(k * available // wanted) * T for k in range(wanted)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for i in range(0, wanted, batch_size):
            w = torch.from_numpy(val_data.read_windows(starts[i : i + batch_size], T + 1)).to(device)
            n = w.shape[0]
            total += float(loss_fn(model, w[:, :-1], w[:, 1:])) * n
            count += n
    finally:
        model.train(was_training)
    return total / count
