"""Bytes on the wire: safetensors for tensors, canonical JSON for records, sha256 addresses.

Never pickle: a payload written by a remote learner must not be able to run code. Loading uses
``safetensors.torch.load`` on bytes, which only parses a JSON header and raw buffers.

Encoded deltas (:class:`atoll.core.compress.EncodedTensor`) are stored as one safetensors file
whose tensor names are ``<param name>::<part>`` (``data`` for fp32/bf16; ``codes`` and
``scales`` for int4); the codec, shape and block size of each tensor travel in the JSON record.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from atoll.core.compress import (
    CompressionError,
    EncodedTensor,
    all_finite,
    check_parts,
    decode_fragment,
    int4_scales_bounded,
)
from atoll.storage.reading import NumberBoundError, loads_bounded
from atoll.storage.validation import InvalidInput

__all__ = [
    "SCHEMA_VERSION",
    "LAYOUT_SCHEMA_VERSION",
    "READABLE_SCHEMA_VERSIONS",
    "record_version",
    "PART_SEPARATOR",
    "sha256_hex",
    "tensors_to_bytes",
    "bytes_to_tensors",
    "encoded_to_bytes",
    "bytes_to_encoded",
    "dump_record",
    "load_record",
]

SCHEMA_VERSION = 3
"""Version written into every record. 2: commit records store each rejection as
``{"kind", "detail"}`` (core's typed :class:`~atoll.core.rejection.Rejection`). 3: bucket layout 2
(``learners/<id>/`` and ``sync/`` prefixes) and sealed records (``digest``, optional
``signature``, commits chained by ``prev_sha256``)."""

LAYOUT_SCHEMA_VERSION = 3
"""The oldest ``run.json`` version with this bucket layout; older runs are refused clearly."""

READABLE_SCHEMA_VERSIONS = (1, 2, 3)
"""Record versions this atoll parses (a run must still be layout 2, see LAYOUT_SCHEMA_VERSION)."""
"""Version of every JSON record this code writes; readers reject any other."""

PART_SEPARATOR = "::"

_PART_DTYPES = {
    ("fp32", "data"): torch.float32,
    ("bf16", "data"): torch.bfloat16,
    ("int4", "codes"): torch.uint8,
    ("int4", "scales"): torch.float32,
}
_CODEC_PARTS = {"fp32": ("data",), "bf16": ("data",), "int4": ("codes", "scales")}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def tensors_to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Safetensors bytes of ``tensors`` (any device and layout; views of one buffer are fine).

    Written here rather than by ``safetensors.torch.save``, which needs tensors that share no
    storage (a copy of each) and then copies them again into its output: this writes the header
    and joins the tensors' raw bytes into the output once. The format is safetensors' own (an
    8-byte little-endian header length, the JSON header, the data at the header's offsets), read
    by ``safetensors.torch.load`` (:func:`bytes_to_tensors`) and by any safetensors reader."""
    return b"".join(_safetensors_parts(tensors, metadata))


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """(sha256, size) of :func:`tensors_to_bytes`' output, without building it: a payload named
    and not written (a master rebuilt by replay) costs one pass of hashing, no copy."""
    h, n = hashlib.sha256(), 0
    for part in _safetensors_parts(tensors, None):
        h.update(part)
        n += len(part)
    return h.hexdigest(), n


def _safetensors_parts(tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str] | None) -> list[bytes | memoryview]:
    """The pieces of a safetensors file of ``tensors``, in order (the tensors' own bytes where they can be)."""
    if sys.byteorder != "little" or any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        plain = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
        return [safetensors.torch.save(plain, metadata=dict(metadata) if metadata else None)]
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks: list[memoryview] = []
    offset = 0
    for name, t in tensors.items():
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        header[name] = {"dtype": _ST_DTYPES[flat.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        if nbytes:
            chunks.append(flat.view(torch.uint8).numpy().data)
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes
    return [len(head).to_bytes(8, "little"), head, *chunks]


def bytes_to_tensors(data: bytes, *, url: str | None = None) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes; a truncated or garbled file is InvalidInput('corrupt')."""
    try:
        return dict(safetensors.torch.load(bytes(data)))
    except Exception as e:  # safetensors raises SafetensorError / ValueError / OSError variants
        raise InvalidInput("corrupt", f"not a valid safetensors payload: {e}", url=url) from None


def encoded_to_bytes(encoded: Mapping[str, EncodedTensor]) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """Safetensors bytes plus per-tensor metadata ``{name: {codec, shape, block_size}}`` for the record."""
    flat: dict[str, torch.Tensor] = {}
    meta: dict[str, dict[str, Any]] = {}
    for name, enc in encoded.items():
        if PART_SEPARATOR in name:
            raise InvalidInput("layout", f"tensor name {name!r} contains {PART_SEPARATOR!r}")
        for part, t in enc.parts.items():
            flat[f"{name}{PART_SEPARATOR}{part}"] = t
        meta[name] = {"codec": enc.codec, "shape": list(enc.shape), "block_size": int(enc.block_size)}
    return tensors_to_bytes(flat), meta


def bytes_to_encoded(
    data: bytes, meta: Mapping[str, Mapping[str, Any]], *, url: str | None = None, device: torch.device | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a delta payload to fp32 tensors (on ``device``; None: the host), checking parts,
    dtypes, shapes and finiteness.

    Finiteness is checked once, on what was read: fp32/bf16 values, and int4 scales (finite and
    at most :data:`~atoll.core.compress.INT4_SAFE_SCALE`). Decoded int4 values are not checked
    again: each is a code in [-8, 7] times such a scale, finite by construction. Only a tensor
    with a larger scale (no encoder writes one for values under 7/8 of fp32's largest) has its
    decoded values checked. Off the host, the encoded bytes travel to ``device`` in one copy
    and are decoded there (:func:`~atoll.core.compress.decode_fragment`; ``out``: tensors to
    decode into, by name)."""
    encoded = _encoded_parts(bytes_to_tensors(data, url=url), meta, url=url)
    unbounded = [name for name, enc in encoded.items()
                 if enc.codec == "int4" and not int4_scales_bounded(enc.parts["scales"])]
    decoded = decode_fragment(encoded, device=device, out=out)
    for name in unbounded:
        if not all_finite(decoded[name]):
            raise InvalidInput("non_finite", f"{name!r} decodes to NaN or Inf values", url=url)
    return decoded


def _encoded_parts(flat: Mapping[str, torch.Tensor], meta: Mapping[str, Mapping[str, Any]], *,
                   url: str | None) -> dict[str, EncodedTensor]:
    """The payload's tensors grouped into encodings by ``meta``, each checked (names, parts,
    dtypes, sizes, finite floating parts) before anything is decoded."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, sep, part = key.rpartition(PART_SEPARATOR)
        if not sep:
            raise InvalidInput("layout", f"payload tensor {key!r} is not named <param>{PART_SEPARATOR}<part>", url=url)
        grouped.setdefault(name, {})[part] = t
    if set(grouped) != set(meta):
        raise InvalidInput(
            "layout",
            f"payload tensors {sorted(grouped)[:5]} differ from the record's {sorted(meta)[:5]}",
            url=url,
        )
    encoded: dict[str, EncodedTensor] = {}
    for name, m in meta.items():
        codec = m.get("codec")
        if codec not in _CODEC_PARTS:
            raise InvalidInput("schema", f"{name!r}: unknown codec {codec!r}", url=url)
        parts = grouped[name]
        if set(parts) != set(_CODEC_PARTS[codec]):
            raise InvalidInput(
                "layout", f"{name!r}: {codec} needs parts {_CODEC_PARTS[codec]}, payload has {sorted(parts)}", url=url
            )
        for part, t in parts.items():
            want = _PART_DTYPES[(codec, part)]
            if t.dtype != want:
                raise InvalidInput("layout", f"{name!r}: part {part!r} has dtype {t.dtype}, {codec} needs {want}", url=url)
            if t.is_floating_point() and not all_finite(t):
                raise InvalidInput("non_finite", f"{name!r}: part {part!r} has NaN or Inf values", url=url)
        try:
            shape = tuple(int(d) for d in m["shape"])
            encoded[name] = EncodedTensor(codec, shape, parts, int(m.get("block_size", 0)))
            check_parts(encoded[name])
        except CompressionError as e:
            raise InvalidInput("layout", f"{name!r}: {e}", url=url) from None
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput("schema", f"{name!r}: bad tensor metadata {dict(m)!r}: {e}", url=url) from None
    return encoded


def dump_record(kind: str, body: Mapping[str, Any]) -> bytes:
    """Canonical JSON (sorted keys, no NaN) with ``schema`` and ``schema_version`` first-class."""
    doc = {"schema": kind, "schema_version": SCHEMA_VERSION, **body}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def load_record(data: bytes, kind: str, *, url: str | None = None) -> dict[str, Any]:
    """Parse a record and check its schema name and version; returns the body (without them)."""
    try:
        doc = loads_bounded(data)  # bounded numbers: no overflow, no NaN/Infinity (atoll.storage.reading)
    except NumberBoundError as e:
        raise InvalidInput("schema", f"a number out of bounds: {e}", url=url) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurd nesting
        raise InvalidInput("corrupt", f"not a valid JSON record: {type(e).__name__}: {str(e)[:200]}", url=url) from None
    if not isinstance(doc, dict):
        raise InvalidInput("schema", "a record must be a JSON object", url=url)
    if doc.get("schema") != kind:
        raise InvalidInput("schema", f"expected a {kind!r} record, got schema {doc.get('schema')!r}", url=url)
    version = doc.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise InvalidInput(
            "schema",
            f"unknown schema_version {version!r} for {kind!r} (this atoll reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})",
            url=url,
        )
    doc.pop("schema"), doc.pop("schema_version")
    return doc


def record_version(data: bytes) -> object:
    """The ``schema_version`` a record claims (None if it is not a JSON object); never raises."""
    try:
        doc = loads_bounded(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return doc.get("schema_version") if isinstance(doc, dict) else None


def finite_json(value: Any) -> bool:
    """True if ``value`` is JSON-able without NaN/Inf (for caller-supplied info/stats dicts)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


