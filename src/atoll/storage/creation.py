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
from atoll.storage.signing import Ed25519Signer, HmacKey, PinnedKeys, Signer, run_context
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
        body, signer = self._signed_body(manifest)
        body = seal(KIND_RUN, body, signer)
        data = dump_record(KIND_RUN, body)
        if not self.store.create(paths.RUN_MANIFEST, data):
            raise RunExistsError(f"a run already exists at {self.url} (created concurrently)")
        cache = self._cache
        cache.manifest, cache.manifest_sha, cache.manifest_body = manifest, sha256_hex(data), body
        cache.pinned = self._checked_pins(manifest, body, self.store.key_url(paths.RUN_MANIFEST))
        return manifest

    def _signed_body(self, manifest: RunManifest) -> tuple[dict[str, Any], Signer | None]:
        """run.json's body and what signs it. With the synchronizer's Ed25519 private key, the
        body pins its public key and every learner public key this keyring holds (``signing``):
        every later object of the run is checked against them, by public keys only. With its HMAC
        key, an HMAC signature for the run. Otherwise unsigned (the bucket policy is the defence)."""
        body = manifest.to_dict()
        private = self.keyring.private(SYNCHRONIZER_KEY_ID)
        if private is not None:
            learners = {w: k for w, k in self.keyring.publics().items() if w != SYNCHRONIZER_KEY_ID}
            body["signing"] = PinnedKeys(private.public_key(), learners).to_dict()
            return body, Ed25519Signer(private, run_context(manifest.run_id))
        if self.keyring.public(SYNCHRONIZER_KEY_ID) is not None:
            raise PermissionError("this keyring holds only the synchronizer's public key: creating a signed "
                                  "run needs its private key (ATOLL_KEYRING)")
        key = self.keyring.for_run(manifest.run_id).key(SYNCHRONIZER_KEY_ID) if self.keyring else None
        return body, None if key is None else HmacKey(key)


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
