"""A tiny model, config and plan shared by the storage tests."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from atoll.core import DilocoConfig, FragmentPlan, plan_fragments
from atoll.core.compress import encode
from atoll.core.weights import Counters
from atoll.storage import RunCreator, RunHandle, paths
from atoll.storage.codec import SCHEMA_VERSION, dump_record, encoded_to_bytes, sha256_hex
from atoll.storage.integrity import seal

SHAPES = {"blk.0.w": (4, 3), "blk.0.b": (3,), "blk.1.w": (3, 3), "emb.weight": (5, 2)}


def tiny_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def tiny_config(**kw: Any) -> DilocoConfig:
    base = dict(num_learners=2, num_fragments=2, inner_steps=2, overlap_steps=1, min_quorum=1)
    base.update(kw)
    return DilocoConfig(**base)


def tiny_plan() -> FragmentPlan:
    return plan_fragments(SHAPES, num_fragments=2, inner_steps=2, embedding_names=["emb.weight"])


def init_run(rs: RunHandle, **cfg: Any) -> dict[str, torch.Tensor]:
    """Create the tiny run through a creator beside ``rs`` (``rs`` then holds its manifest)."""
    params = tiny_params()
    RunCreator.beside(rs).init_run(tiny_config(**cfg), tiny_plan(), params, run_id="test-run")
    return params


def fragment_delta(rs: RunHandle, p: int, scale: float = 0.01, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(*SHAPES[n], generator=g) for n in rs.plan.fragments[p]}


def counters(steps: int = 2, tokens: int = 64) -> Counters:
    return Counters(c_steps=steps, c_tokens=tokens)


def plant_contribution(
    backend: Any,
    url: str,
    *,
    fragment: int,
    tensors: dict[str, torch.Tensor] | None = None,
    payload: bytes | None = None,
    meta: dict[str, Any] | None = None,
    learner_id: str = "evil",
    base_version: int = 0,
    sha: str | None = None,
    nbytes: int | None = None,
    schema_version: int | None = None,
    write_payload: bool = True,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write a contribution (payload + record) behind the protocol's back; returns its key."""
    if payload is None:
        enc = {n: encode(t, "fp32") for n, t in (tensors or {}).items()}
        payload, auto_meta = encoded_to_bytes(enc)
        meta = meta or auto_meta
    sha = sha or sha256_hex(payload)
    if write_payload:
        backend.raw_put(url, paths.blob_key(sha, learner_id), payload)
    key = paths.contribution_key(fragment, base_version, learner_id, 2, sha)
    body = {
        "learner_id": learner_id, "fragment": fragment, "base_version": base_version, "c_steps": 2,
        "c_tokens": 64, "payload": {"sha256": sha, "nbytes": len(payload) if nbytes is None else nbytes},
        "tensors": meta, "created_at": time.time(), "info": {}, **(extra or {}),
    }
    # A rogue writer can compute a record's digest: planted records are sealed like real ones, so
    # that the checks behind the digest (payload, layout, ids ...) are what the tests exercise.
    data = dump_record("atoll/contribution", seal("atoll/contribution", body))
    if schema_version is not None:
        data = data.replace(f'"schema_version":{SCHEMA_VERSION}'.encode(), f'"schema_version":{schema_version}'.encode())
    backend.raw_put(url, key, data)
    return key



class FsProxy:
    """Wraps an fsspec filesystem: counts method calls and can inject faults.

    ``fault(method_name, args, kwargs, real_fs)`` is called before every call and may raise, or
    return a value to short-circuit the call (anything but None).
    """

    def __init__(self, fs: Any, fault: Callable[..., Any] | None = None) -> None:
        self._fs = fs
        self.calls: Counter[str] = Counter()
        self.fault = fault

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.fault is not None:
                out = self.fault(name, args, kwargs, self._fs)
                if out is not None:
                    return out
            return attr(*args, **kwargs)

        return wrapped

    @property
    def lists(self) -> int:
        return sum(self.calls[m] for m in ("ls", "find", "glob", "walk", "listdir", "du", "_lsdir", "_list_objects"))
