"""Creating a run: :class:`RunCreator` writes a new run's version-0 fragments and ``run.json``
(docs/protocol.md section 2). Storage knows no models: :func:`atoll.train.run.create_run` builds
the plan and weights and calls it."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from atoll.core.config import DilocoConfig
from atoll.core.fragments import FragmentPlan
from atoll.storage import paths
from atoll.storage.codec import dump_record, finite_json, sha256_hex
from atoll.storage.handle import RunHandle, Tensors
from atoll.storage.integrity import SYNCHRONIZER_KEY_ID, seal
from atoll.storage.records import KIND_RUN, RunManifest
from atoll.storage.validation import InvalidInput, RunExistsError, check_finite, check_tensor_layout, validate_id

__all__ = ["RunCreator"]


class RunCreator(RunHandle):
    """Whoever creates a run holds the bucket policy's ``atoll-synchronizer`` grant on
    ``run.json`` (create-once) and ``sync/``. Writes ``paths.blob_key(sha)`` (the version-0
    fragments) and then ``paths.RUN_MANIFEST``; nothing else. Its manifest cache is filled by
    the write, so a role handle opened :meth:`beside <RunHandle.beside>` it reads no run.json."""

    def init_run(
        self,
        config: DilocoConfig,
        plan: FragmentPlan,
        initial_params: Tensors,
        *,
        run_id: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> RunManifest:
        """Write the version-0 fragments, then ``run.json`` create-once (RunExistsError if present)."""
        if run_id is None:
            run_id = self.url.rstrip("/").rsplit("/", 1)[-1]
        validate_id(run_id, "run id")
        if plan.num_fragments != config.num_fragments:
            raise ValueError(f"plan has {plan.num_fragments} fragments, config.num_fragments={config.num_fragments}")
        if plan.inner_steps != config.inner_steps:
            raise ValueError(f"plan.inner_steps={plan.inner_steps} != config.inner_steps={config.inner_steps}")
        extra = dict(extra or {})
        if not finite_json(extra):
            raise ValueError("extra must be JSON-able without NaN/Inf")
        self._check_writable()
        if self.exists():
            raise RunExistsError(f"a run already exists at {self.url}")
        shapes = _initial_shapes(plan, initial_params)
        initial = tuple(
            self._write_blob({n: initial_params[n].float() for n in frag}) for frag in plan.fragments
        )
        manifest = RunManifest(run_id=run_id, config=config, plan=plan, shapes=shapes, initial=initial,
                               created_at=time.time(), extra=extra)
        # Sealed, and signed for this run when the keyring holds the synchronizer's key: with a
        # keyring, run.json is checked (checked_manifest) before anything in it is acted on.
        sync_key = self.keyring.for_run(run_id).key(SYNCHRONIZER_KEY_ID) if self.keyring else None
        body = seal(KIND_RUN, manifest.to_dict(), sync_key)
        data = dump_record(KIND_RUN, body)
        if not self.store.create(paths.RUN_MANIFEST, data):
            raise RunExistsError(f"a run already exists at {self.url} (created concurrently)")
        cache = self._cache
        cache.manifest, cache.manifest_sha, cache.manifest_body = manifest, sha256_hex(data), body
        return manifest


def _initial_shapes(plan: FragmentPlan, initial_params: Tensors) -> dict[str, tuple[int, ...]]:
    """Every planned parameter's shape, once its layout and values are checked against the plan."""
    shapes = {n: tuple(int(d) for d in initial_params[n].shape) for n in plan.sizes if n in initial_params}
    check_tensor_layout(
        {n: t for n, t in initial_params.items()},
        {n: shapes.get(n, ()) for n in plan.sizes},
        what="initial parameters",
    )
    for n, s in shapes.items():
        if math.prod(s) != plan.sizes[n]:
            raise InvalidInput("layout", f"initial {n!r} has {math.prod(s)} elements, plan says {plan.sizes[n]}")
    check_finite(initial_params, what="initial parameters")
    return shapes
