"""Consolidated checkpoints as every reader sees them (``sync/checkpoints/<round>/``): a checkpoint
is used or counted only once it verifies (docs/protocol.md, "One path for every reader").

A checkpoint is ``config.json`` (sealed by the synchronizer: its digest, and its signature where
the run pins the synchronizer's key or the handle holds its HMAC key) naming ``model.safetensors``
by size and sha256. :func:`checkpoint_config` reads the config through the one reader
(:mod:`atoll.storage.reading`) and checks its seal and its fields; :func:`checked_checkpoint` adds
that the model file is there at the size the config names (what retention counts before it
deletes an older checkpoint); :func:`load_checkpoint` reads the model and checks its sha256.
Nothing here raises anything but atoll's typed errors: :class:`IntegrityError` (a seal that does
not verify), :class:`InvalidInput` (malformed, oversized, not a plain object, another run's or
round's, a model missing or of another size or digest) and FileNotFoundError (no config).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from atoll.core.rejection import RejectionKind
from atoll.storage import paths
from atoll.storage.codec import bytes_to_tensors, load_record, sha256_hex
from atoll.storage.handle import MAX_CHECKPOINT_CONFIG_BYTES
from atoll.storage.integrity import IntegrityError
from atoll.storage.reading import Skipped, bounded_int, get_plain, read_bytes, skip_of
from atoll.storage.records import KIND_CHECKPOINT
from atoll.storage.validation import InvalidInput, TransientStorageError

if TYPE_CHECKING:
    from atoll.storage.handle import RunHandle

__all__ = ["CheckpointConfig", "checkpoint_config", "checked_checkpoint", "load_checkpoint", "model_cap"]

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CheckpointConfig:
    """What a verified ``config.json`` says of its checkpoint."""

    round: int
    """The round the checkpoint holds (the folder's)."""
    model_sha256: str
    """sha256 of ``model.safetensors``."""
    model_nbytes: int
    """Size of ``model.safetensors`` in bytes."""
    body: dict[str, Any]
    """The whole verified body (config, plan, versions, shapes)."""


def model_cap(run: RunHandle) -> int:
    """Largest ``model.safetensors`` this run can have: fp32 of every parameter, plus the header."""
    shapes = run.manifest.shapes
    numel = sum(int(torch.Size(s).numel()) for s in shapes.values())
    return 4 * numel + sum(len(n) + 160 for n in shapes) + (1 << 16)


def _parse(run: RunHandle, round_: int, data: bytes, url: str) -> CheckpointConfig:
    body = load_record(data, KIND_CHECKPOINT, url=url)
    run._operator_check(KIND_CHECKPOINT)(body, url)  # the run's verification: signature where it has a key
    model = body.get("model")
    if not isinstance(model, dict):
        raise InvalidInput("schema", f"config.json's model must be an object, got {type(model).__name__}", url=url)
    sha = model.get("sha256")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise InvalidInput("schema", "config.json's model.sha256 must be 64 hex digits", url=url)
    if model.get("file", "model.safetensors") != "model.safetensors":
        raise InvalidInput("schema", "config.json names a model file other than model.safetensors", url=url)
    nbytes = bounded_int(model, "nbytes", minimum=1, maximum=model_cap(run))
    if (got := bounded_int(body, "round", minimum=0)) != round_:
        raise InvalidInput("schema", f"config.json of round {got} in round {round_}'s folder", url=url)
    if body.get("run_id") != run.manifest.run_id:
        raise InvalidInput("schema", "config.json belongs to another run", url=url)
    return CheckpointConfig(round=round_, model_sha256=sha, model_nbytes=int(nbytes or 0), body=body)


def checkpoint_config(run: RunHandle, round_: int) -> CheckpointConfig | Skipped | None:
    """Round ``round_``'s verified checkpoint config, None if it has none, or :class:`Skipped`
    naming why it is unusable (not a plain object, oversized, malformed, a seal that does not
    verify, another run's or round's). Raises only a transient storage error."""
    key = paths.checkpoint_config_key(round_)
    data = read_bytes(run.store, key, MAX_CHECKPOINT_CONFIG_BYTES)
    if data is None or isinstance(data, Skipped):
        return data
    try:
        return _parse(run, round_, data, run.store.key_url(key))
    except TransientStorageError:
        raise
    except IntegrityError as e:
        return Skipped(key, RejectionKind.CORRUPT, e.what)
    except Exception as e:  # noqa: BLE001 - an unusable config is skipped, typed, never raised
        return skip_of(key, e)


def checked_checkpoint(run: RunHandle, round_: int, model_sizes: dict[str, int]) -> CheckpointConfig | Skipped:
    """Round ``round_``'s checkpoint if it is complete and verifies: its config verifies
    (:func:`checkpoint_config`) and ``model.safetensors`` is listed (``model_sizes``: the folder's
    plain objects by name, as its listing gave them) at the size the config names. What retention
    counts before it deletes an older checkpoint; :func:`load_checkpoint` also checks the sha256."""
    got = checkpoint_config(run, round_)
    key = paths.checkpoint_config_key(round_)
    if got is None:
        return Skipped(key, RejectionKind.MISSING_PAYLOAD, "no config.json: not a complete checkpoint")
    if isinstance(got, Skipped):
        return got
    size = model_sizes.get("model.safetensors")
    if size is None:
        return Skipped(paths.checkpoint_model_key(round_), RejectionKind.MISSING_PAYLOAD,
                       "the model file config.json names is missing")
    if size != got.model_nbytes:
        return Skipped(paths.checkpoint_model_key(round_), RejectionKind.CHECKSUM,
                       f"the model file has {size} bytes, config.json says {got.model_nbytes}")
    return got


def load_checkpoint(run: RunHandle, round_: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, verified: its config (seal, fields), then the model's size and
    sha256 against the config. Raises FileNotFoundError (no config), :class:`IntegrityError` (a
    seal that does not verify) or :class:`InvalidInput` (anything else unusable)."""
    ckey = paths.checkpoint_config_key(round_)
    curl = run.store.key_url(ckey)
    data = read_bytes(run.store, ckey, MAX_CHECKPOINT_CONFIG_BYTES)
    if data is None:
        raise FileNotFoundError(f"no checkpoint config at {curl}")
    if isinstance(data, Skipped):
        raise InvalidInput(data.kind, data.why, url=curl)
    try:
        config = _parse(run, round_, data, curl)
    except (IntegrityError, InvalidInput, TransientStorageError):
        raise
    except Exception as e:  # noqa: BLE001 - a malformed config is bad input, never a raw error
        raise InvalidInput("schema", f"config.json is malformed: {type(e).__name__}: {str(e)[:200]}", url=curl) from None
    mkey = paths.checkpoint_model_key(round_)
    murl = run.store.key_url(mkey)
    try:
        model = get_plain(run.store, mkey, config.model_nbytes)
    except InvalidInput as e:
        raise InvalidInput(e.kind, e.reason, url=murl) from None
    if model is None:
        raise InvalidInput("missing_payload", "checkpoint model file is missing", url=murl)
    if len(model) != config.model_nbytes or sha256_hex(model) != config.model_sha256:
        raise InvalidInput("checksum", "checkpoint model sha256 differs from config.json", url=murl)
    return bytes_to_tensors(model, url=murl)
