"""Corpora: a train and a validation split, from your own token shards or from text files as bytes.

:func:`stdlib_corpus` / :func:`text_corpus` build the default corpus with no download: the Python
standard library's own source, as raw bytes (vocabulary 256), split into train and validation
**by file**, written once to a cache folder as token files, then read lazily
(:class:`~atoll.train.tokens.TokenData`).
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atoll.train.tokens import DataError, TokenData, open_tokens

__all__ = [
    "FILE_SEPARATOR",
    "Corpus",
    "token_corpus",
    "text_corpus",
    "stdlib_corpus",
    "stdlib_path",
    "encode_bytes",
    "decode_bytes",
]

FILE_SEPARATOR = 0
"""Byte-level corpora join files with one NUL byte (token 0), which Python source never contains,
so the model sees where one file ends and the next begins."""


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
    _check_text_corpus_args(root, source_dir, max_corpus_mb, val_fraction)
    chosen = _first_mb(_text_files(root, pattern, exclude_dirs), max_corpus_mb)
    key = _cache_key(root, chosen, val_fraction)
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


def _check_text_corpus_args(root: Path, source_dir: str | os.PathLike[str], max_corpus_mb: float | None,
                            val_fraction: float) -> None:
    if not root.is_dir():
        raise FileNotFoundError(f"corpus source_dir={os.fspath(source_dir)!r} is not a directory")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    if max_corpus_mb is not None and not max_corpus_mb > 0:
        raise DataError(f"max_corpus_mb={max_corpus_mb!r} must be > 0 (or None for everything)")


def _text_files(root: Path, pattern: str, exclude_dirs: Sequence[str]) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of the files under ``root`` matching ``pattern``, sorted."""
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
    return files


def _first_mb(files: list[tuple[str, Path]], max_corpus_mb: float | None) -> list[tuple[str, Path, int]]:
    """The files, in order, until ``max_corpus_mb`` (each counted with its separator), with their sizes."""
    cap = None if max_corpus_mb is None else int(max_corpus_mb * 1e6)
    chosen, total = [], 0
    for rel, p in files:
        if cap is not None and total >= cap:
            break
        size = p.stat().st_size
        chosen.append((rel, p, size))
        total += size + 1
    return chosen


def _cache_key(root: Path, chosen: list[tuple[str, Path, int]], val_fraction: float) -> str:
    # The cache key covers everything that changes the bytes: which files, their sizes and
    # mtimes, and the split. Same inputs -> same folder -> no rework.
    return hashlib.sha256(
        json.dumps(
            [os.fspath(root.resolve()), val_fraction, [(r, s, p.stat().st_mtime_ns) for r, p, s in chosen]]
        ).encode()
    ).hexdigest()[:16]


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
    if source_dir is not None:
        return _python_sources(source_dir, max_corpus_mb, val_fraction, cache_dir)
    # The running interpreter's standard library does not change under it: walk and stat its
    # sources (~0.2 s) once per process and cache folder, not once per learner built. A hit still
    # checks that the cached token files are there (a temporary cache folder may be gone).
    key = (max_corpus_mb, val_fraction, None if cache_dir is None else os.fspath(cache_dir))
    corpus = _STDLIB_CORPORA.get(key)
    if corpus is None or not all(os.path.exists(f.path) for f in corpus.train.files + corpus.val.files):
        corpus = _STDLIB_CORPORA[key] = _python_sources(stdlib_path(), max_corpus_mb, val_fraction, cache_dir)
    return replace(corpus, meta=copy.deepcopy(corpus.meta))  # the token files shared, read-only


_STDLIB_CORPORA: dict[tuple[float | None, float, str | None], Corpus] = {}
"""This process's standard-library corpora, by (max_corpus_mb, val_fraction, cache_dir)."""


def _python_sources(source_dir: str | os.PathLike[str], max_corpus_mb: float | None, val_fraction: float,
                    cache_dir: str | os.PathLike[str] | None) -> Corpus:
    return text_corpus(
        source_dir,
        pattern="*.py",
        exclude_dirs=("site-packages", "dist-packages", "__pycache__"),
        max_corpus_mb=max_corpus_mb,
        val_fraction=val_fraction,
        cache_dir=cache_dir,
    )
