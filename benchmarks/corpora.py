"""Corpora for the quality benchmark, built from what every Python install ships (no download).

* ``code``: the standard library's ``*.py`` sources as bytes (atoll's default corpus), split into
  train and validation by file (``atoll.train.data.stdlib_corpus``).
* ``prose``: English prose from the same install: the docstrings of the standard library
  (``ast.get_docstring`` of every module, class and function, doctest lines removed), one
  document per source file, split by file, the train split capped small (~420 KB) so that a 2 M
  token budget repeats it ~5 epochs. It is written as flat uint8 token files with a sidecar, the
  same format as a user's own pre-tokenized shards, and read back through ``DataSpec(kind="tokens")``.
* ``tokens:TRAIN_URL,VAL_URL``: your own pre-tokenized shards (any fsspec URL; dtype and
  vocab_size from their sidecar JSON).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from atoll.train.corpus import _default_cache_dir, _is_val, stdlib_path
from atoll.train.data import write_tokens
from atoll.train.recipe import DataSpec

__all__ = ["corpus_spec", "build_prose"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3"}


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 80:
                continue
            lines = [ln for ln in doc.splitlines() if not ln.lstrip().startswith((">>>", "..."))]
            parts.append("\n".join(lines).strip())
    return "\n\n".join(p for p in parts if p)


def build_prose(*, train_kb: float = 420, val_fraction: float = 0.1, cache_dir: str | os.PathLike[str] | None = None,
                source_dir: str | os.PathLike[str] | None = None) -> tuple[str, str, dict]:
    """Write (once) the prose corpus as token files; returns (train_url, val_url, meta)."""
    root = Path(source_dir) if source_dir is not None else stdlib_path()
    files = sorted(
        (p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
        if not _SKIP_DIRS & set(p.relative_to(root).parts)
    )
    key = hashlib.sha256(json.dumps([os.fspath(root), train_kb, val_fraction, len(files)]).encode()).hexdigest()[:16]
    folder = Path(cache_dir if cache_dir is not None else _default_cache_dir()) / f"prose-{key}"
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        splits: dict[str, list[bytes]] = {"train": [], "val": []}
        counts = {"train": 0, "val": 0}
        cap = int(train_kb * 1000)
        for rel, p in files:
            text = _docstrings(p)
            if not text:
                continue
            split = "val" if _is_val(rel, val_fraction) else "train"
            if counts["train"] >= cap and counts["val"] >= cap * val_fraction / (1 - val_fraction):
                break
            if counts[split] >= (cap if split == "train" else cap * val_fraction / (1 - val_fraction)):
                continue
            doc = text.encode("utf-8") + b"\x00"  # the same file separator as the code corpus
            splits[split].append(doc)
            counts[split] += len(doc)
        for split in ("train", "val"):
            write_tokens(os.fspath(folder / f"{split}.bin"), np.frombuffer(b"".join(splits[split]), dtype=np.uint8),
                         dtype="uint8", vocab_size=256)
        meta_path.write_text(json.dumps({"source": os.fspath(root), "kind": "stdlib docstrings",
                                         "train_bytes": counts["train"], "val_bytes": counts["val"],
                                         "train_docs": len(splits["train"]), "val_docs": len(splits["val"])}))
    meta = json.loads(meta_path.read_text())
    return "file://" + os.fspath(folder / "train.bin"), "file://" + os.fspath(folder / "val.bin"), meta


def corpus_spec(name: str, *, seed: int = 0, code_mb: float = 8.0, shard: str = "interleaved") -> tuple[DataSpec, str]:
    """A DataSpec for corpus ``name`` ('code', 'prose' or 'tokens:TRAIN,VAL') and a one-line description."""
    if name == "code":
        return (DataSpec(kind="stdlib", max_corpus_mb=code_mb, seed=seed, shard=shard),
                f"code: stdlib *.py sources, first {code_mb:g} MB, split by file")
    if name == "prose":
        train, val, meta = build_prose()
        return (DataSpec(kind="tokens", train_url=train, val_url=val, seed=seed, shard=shard),
                f"prose: stdlib docstrings, {meta['train_bytes'] / 1e3:.0f} KB train / {meta['val_bytes'] / 1e3:.0f} KB val, "
                f"split by file ({meta['train_docs']}/{meta['val_docs']} modules)")
    if name.startswith("tokens:"):
        train, _, val = name[len("tokens:"):].partition(",")
        if not val:
            raise SystemExit("--corpora tokens:TRAIN_URL,VAL_URL needs both URLs")
        return (DataSpec(kind="tokens", train_url=train, val_url=val, seed=seed, shard=shard),
                f"your shards: {train} / {val}")
    raise SystemExit(f"unknown corpus {name!r}: use code, prose or tokens:TRAIN_URL,VAL_URL")
