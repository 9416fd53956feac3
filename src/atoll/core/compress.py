"""Compression of what travels: fp32, bf16, and 4-bit with one fp32 scale per block.

Pure encode/decode between tensors; storage turns the encoded parts into safetensors. Decoding
always yields fp32 so the synchronizer accumulates in fp32.

int4 is symmetric absmax quantisation: each block of ``block_size`` consecutive elements (of the
flattened tensor, zero-padded at the end) gets ``scale = max|x| / 7`` and codes
``q = round(x / scale)`` in [-7, 7], stored as ``q + 8`` in a nibble, two per byte. The error per
element is at most ``scale / 2 = max|block| / 14``.

int4 runs in few passes over the data, on whatever device its tensors are on: encoding checks
the input's finiteness through the block scales, decoding looks both nibbles of every byte up in
one 256-row table and scales them in place, :func:`encode_residual` makes the compressed
downlink's update and new view in one go, and :func:`decode_fragment` moves a payload's encoded
bytes to a device in one copy and decodes there. Each gives the same bits as the plain
unpack / convert / scale steps (tests/unit/test_compress.py holds that reference).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from atoll.core.rejection import RejectionKind

__all__ = ["all_finite", "CODECS", "CompressionError", "EncodedTensor", "INT4_SAFE_SCALE", "check_parts", "decode",
           "DecodeBuffers", "decode_fragment", "encode", "encode_residual", "encoded_nbytes", "encoded_size", "int4_scales_bounded",
           "parts_to_device"]

CODECS = ("fp32", "bf16", "int4")
_INT4_MAX = 7

CPU_PASS_ELEMENTS = 1 << 22
"""int4 work on the CPU goes at most this many elements at a time (16 MiB of fp32): a larger
tensor (a 1 B model's) is encoded and decoded in chunks, each chunk's steps into scratch of that
size rather than tensor-sized buffers (which page-fault afresh on every call, 4 KiB at a time).
Not smaller: each step is one parallel operation, and on a busy machine many short ones cost
more in thread hand-offs than they save in cache (measured, 2 shared cores)."""

INT4_SAFE_SCALE = torch.finfo(torch.float32).max / 8
"""The largest |scale| whose int4 values are all finite (a code in [-8, 7] times it). An encoder
writes max|block| / 7, below it for every block whose values stay under 7/8 of fp32's largest."""


class CompressionError(ValueError):
    """The tensor cannot be encoded/decoded as asked; the message says why, ``kind`` says what
    class of bad input it is (``NON_FINITE`` for NaN/Inf, ``LAYOUT`` for everything else)."""

    def __init__(self, message: str, kind: RejectionKind = RejectionKind.LAYOUT) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor in wire form: named parts plus what is needed to rebuild it."""

    codec: str
    shape: tuple[int, ...]
    parts: Mapping[str, torch.Tensor]
    """'data' for fp32/bf16; 'codes' (uint8, packed nibbles) and 'scales' (fp32) for int4."""

    block_size: int = 0
    """Elements per scale block (int4 only)."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf (empty: True).

    One reduction (``torch.aminmax``, which propagates NaN) instead of ``isfinite(t).all()``,
    which writes a boolean tensor as large as ``t`` first: about 10x faster on the CPU."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def int4_scales_bounded(scales: torch.Tensor) -> bool:
    """Whether every int4 value these scales give is finite: each scale finite and at most
    :data:`INT4_SAFE_SCALE` in magnitude (a code in [-8, 7] times such a scale cannot overflow).

    One reduction over the scales (1/``block_size`` of the tensor): what stands in for a
    finiteness check of the decoded values."""
    if scales.numel() == 0:
        return True
    lo, hi = torch.aminmax(scales.detach().float())
    return math.isfinite(float(lo)) and math.isfinite(float(hi)) and max(-float(lo), float(hi)) <= INT4_SAFE_SCALE


def _check_codec(codec: str, block_size: int) -> None:
    if codec not in CODECS:
        raise CompressionError(f"unknown codec {codec!r}; choose one of {CODECS}")
    if codec == "int4" and (not isinstance(block_size, int) or block_size < 2 or block_size % 2):
        raise CompressionError(f"int4 block_size must be an even integer >= 2, got {block_size!r}")


def _checked_float(x: torch.Tensor, codec: str, block_size: int) -> torch.Tensor:
    """``x`` as a contiguous fp32 tensor, after the checks every encoding makes."""
    _check_codec(codec, block_size)
    if not x.is_floating_point():
        raise CompressionError(f"only floating tensors can be encoded, got {x.dtype}")
    if x.numel() == 0:
        raise CompressionError(f"cannot encode an empty tensor (shape {tuple(x.shape)})")
    return x.detach().float().contiguous()


def _non_finite() -> CompressionError:
    return CompressionError("cannot encode a tensor with NaN or Inf values", RejectionKind.NON_FINITE)


def _blocks_per_pass(nblocks: int, block_size: int, device: torch.device) -> int:
    """Blocks int4 work takes at a time: on the CPU :data:`CPU_PASS_ELEMENTS` worth, so that all
    of a chunk's steps run while it is in cache; elsewhere all of them (one kernel per step)."""
    if device.type != "cpu":
        return max(1, nblocks)
    return max(1, CPU_PASS_ELEMENTS // block_size)


def _int4_encode_flat(x: torch.Tensor, block_size: int, base: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, applied) of the flat fp32 tensor ``x``, or of ``x - base`` with ``base``
    given, and then also ``applied = base + decode(codes, scales)``; the tail zero-padded to a
    whole block. Chunk by chunk (:func:`_blocks_per_pass`), each chunk's steps into reused scratch:
    the block scales (``max|block| / 7``; a NaN or Inf anywhere makes its block's scale
    non-finite, ``amin``/``amax`` propagate NaN, so checking the scales checks the input), the codes
    ``round(x / scale)`` clamped to [-7, 7], packed two per byte as ``q + 8``; with ``base`` the
    decoded values ``q x scale`` taken from these same codes and added to ``base``."""
    n, device = x.numel(), x.device
    nblocks = -(-n // block_size)
    codes = torch.empty(nblocks * block_size // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=device)
    applied = None if base is None else torch.empty(n, dtype=torch.float32, device=device)
    per = _blocks_per_pass(nblocks, block_size, device)
    work = torch.empty(min(per, nblocks) * block_size, dtype=torch.float32, device=device)
    pair = torch.empty(work.numel() // 2, dtype=torch.float32, device=device)
    for b0 in range(0, nblocks, per):
        b1 = min(nblocks, b0 + per)
        e0, e1, k = b0 * block_size, min(n, b1 * block_size), (b1 - b0) * block_size
        w = work[:k]
        src = x[e0:e1] if base is None else torch.sub(x[e0:e1], base[e0:e1], out=w[:e1 - e0])
        if e1 - e0 < k:  # the last, partial block: zero-padded
            w[:e1 - e0].copy_(src)
            w[e1 - e0:].zero_()
            src = w
        blocks = src.view(-1, block_size)
        # amin and amax apart: on the CPU torch's fused aminmax over 32-element rows is ~3.5x
        # slower than the two reductions together (both propagate NaN the same way).
        lo, hi = torch.amin(blocks, dim=1), torch.amax(blocks, dim=1)
        s = torch.maximum(lo.abs_(), hi.abs_(), out=scales[b0:b1]).div_(_INT4_MAX)  # abs: +0 for zero blocks
        if not all_finite(s):
            raise _non_finite()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.div(blocks, safe[:, None], out=w.view(-1, block_size)).round_().clamp_(-_INT4_MAX, _INT4_MAX)
        q2 = q.view(-1, 2)  # (q_lo + 8) + 16 (q_hi + 8): the byte, exact in fp32
        packed = torch.add(q2[:, 0], q2[:, 1], alpha=16, out=pair[:k // 2]).add_(8 + 16 * 8)
        codes[e0 // 2:e0 // 2 + k // 2].copy_(packed)
        if applied is not None and base is not None:
            # The code as decode reads it back (an integer; + 0.0 turns round's -0 into +0 like
            # decode's int16 conversion) times the scale, plus the base: base + decode, bit for bit
            # (fp32 addition commutes).
            decoded = q.add_(0.0).mul_(s[:, None]).view(-1)[:e1 - e0]
            torch.add(decoded, base[e0:e1], out=applied[e0:e1])
    return codes, scales, applied


def encode(x: torch.Tensor, codec: str = "fp32", *, block_size: int = 32, copy: bool = True) -> EncodedTensor:
    """Encode a floating tensor. NaN/Inf and empty tensors are refused (they are never valid deltas).

    ``copy=False``: an fp32 encoding may hold ``x`` itself (when it is fp32 and contiguous) rather
    than a copy, for a caller that serializes it before ``x`` can change."""
    x32 = _checked_float(x, codec, block_size)
    shape = tuple(x32.shape)
    if codec != "int4":
        if not all_finite(x32):
            raise _non_finite()
        data = x32.to(torch.bfloat16) if codec == "bf16" else x32.clone() if copy else x32
        return EncodedTensor(codec, shape, {"data": data})
    codes, scales, _ = _int4_encode_flat(x32.view(-1), block_size)
    return EncodedTensor(codec, shape, {"codes": codes, "scales": scales}, block_size)


def encode_residual(target: torch.Tensor, base: torch.Tensor, codec: str, *,
                    block_size: int = 32) -> tuple[EncodedTensor, torch.Tensor]:
    """``encode(target - base)`` and ``base + decode(that encoding)`` (fp32, a new tensor), bit for
    bit what the three steps give. int4 in one sweep: the residual, its codes and the decoded
    values added to ``base`` are made chunk by chunk, the decoded values from the quantizer's own
    codes instead of unpacked from the bytes again."""
    t32, b32 = _checked_float(target, codec, block_size), base.detach().float().contiguous()
    if t32.shape != b32.shape:
        raise CompressionError(f"encode_residual: shapes {tuple(t32.shape)} and {tuple(b32.shape)} differ")
    shape = tuple(t32.shape)
    if codec != "int4":
        enc = encode(t32 - b32, codec, copy=False)
        return enc, torch.add(b32, enc.parts["data"].float())
    codes, scales, applied = _int4_encode_flat(t32.view(-1), block_size, b32.view(-1))
    assert applied is not None
    return EncodedTensor(codec, shape, {"codes": codes, "scales": scales}, block_size), applied.view(shape)


def _nibble_table(device: torch.device) -> torch.Tensor:
    """256 x 2 fp32: row ``b`` holds the two values byte ``b`` decodes to, low nibble first
    (``(b & 15) - 8``, ``(b >> 4) - 8``), on ``device`` (built once per device)."""
    table = _NIBBLE_TABLES.get(device)
    if table is None:
        b = torch.arange(256, dtype=torch.int16)
        table = torch.stack([(b & 0x0F) - 8, (b >> 4) - 8], dim=1).to(device=device, dtype=torch.float32)
        _NIBBLE_TABLES[device] = table
    return table


_NIBBLE_TABLES: dict[torch.device, torch.Tensor] = {}


def check_parts(enc: EncodedTensor) -> None:
    """Raise CompressionError unless ``enc``'s parts fit its codec, shape and block size."""
    _check_codec(enc.codec, enc.block_size if enc.codec == "int4" else 0)
    n = math.prod(enc.shape)
    if enc.codec in ("fp32", "bf16"):
        data = enc.parts.get("data")
        if data is None or data.numel() != n:
            raise CompressionError(f"{enc.codec} payload must hold {n} elements for shape {enc.shape}")
        return
    codes, scales = enc.parts.get("codes"), enc.parts.get("scales")
    if codes is None or scales is None:
        raise CompressionError("int4 payload needs 'codes' and 'scales'")
    nblocks = -(-n // enc.block_size)
    if codes.dtype != torch.uint8 or codes.numel() != nblocks * enc.block_size // 2:
        raise CompressionError(
            f"int4 codes: expected {nblocks * enc.block_size // 2} uint8 for shape {enc.shape} "
            f"and block_size {enc.block_size}, got {codes.numel()} {codes.dtype}"
        )
    if scales.numel() != nblocks:
        raise CompressionError(f"int4 scales: expected {nblocks}, got {scales.numel()}")


def decode(enc: EncodedTensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the fp32 tensor where its parts are; raises CompressionError if the parts are
    inconsistent. ``out``: a contiguous fp32 tensor of ``enc.shape`` on that device to write into
    (returned), instead of a new one.

    int4, chunk by chunk (:func:`_blocks_per_pass`): the packed bytes widened to indices, one
    lookup in a 256-row table that writes both nibbles' values of every byte into the output
    (as one 8-byte row),
    one multiply by each block's scale in place (the last, partial block on its own)."""
    check_parts(enc)
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != enc.shape or not out.is_contiguous()):
        raise CompressionError(f"decode: out must be a contiguous fp32 tensor of shape {enc.shape}")
    if enc.codec != "int4":
        data = enc.parts["data"].reshape(enc.shape)
        return data.to(torch.float32, copy=True) if out is None else out.copy_(data)
    codes, scales = enc.parts["codes"].reshape(-1), enc.parts["scales"].reshape(-1).float()
    n, bs, device = math.prod(enc.shape), enc.block_size, codes.device
    flat = torch.empty(n, dtype=torch.float32, device=device) if out is None else out.view(-1)
    table = _nibble_table(device)
    # Each byte's two fp32 values looked up as one 8-byte row: a 1-D gather of int64 is ~3x faster
    # on the CPU than the same gather of (256, 2) fp32 rows, and it moves the same bytes. It needs
    # the output 8-byte aligned (an fp32 view at an odd element offset is not).
    pairs = table.view(torch.int64).view(-1) if flat.storage_offset() % 2 == 0 else None
    full = n // bs
    per = _blocks_per_pass(full, bs, device)
    index = torch.empty(min(per, full) * bs // 2, dtype=torch.int32, device=device)
    for b0 in range(0, full, per):
        b1 = min(full, b0 + per)
        body = flat[b0 * bs:b1 * bs]
        i = index[:body.numel() // 2].copy_(codes[b0 * bs // 2:b1 * bs // 2])
        if pairs is not None:
            torch.index_select(pairs, 0, i, out=body.view(torch.int64))
        else:
            torch.index_select(table, 0, i, out=body.view(-1, 2))
        body.view(-1, bs).mul_(scales[b0:b1, None])
    if n > full * bs:
        last = table.index_select(0, codes[full * bs // 2:].to(torch.int32)).view(-1)
        torch.mul(last[:n - full * bs], scales[full], out=flat[full * bs:])
    return flat.view(enc.shape) if out is None else out


def parts_to_device(encoded: Mapping[str, EncodedTensor], device: torch.device) -> dict[str, EncodedTensor]:
    """``encoded`` with every part on ``device``, in one host-to-device copy: the parts' bytes
    are gathered into one staging buffer (each part 16-byte aligned), copied once, and split
    into views of their own dtype and shape. Nothing is copied for parts already there."""
    parts = [t for enc in encoded.values() for t in enc.parts.values()]
    if all(t.device.type == device.type and device.index in (None, t.device.index) for t in parts):
        return dict(encoded)
    return _staged(encoded, device)


def _staged(encoded: Mapping[str, EncodedTensor], device: torch.device) -> dict[str, EncodedTensor]:
    """:func:`parts_to_device`'s copy, made whether or not the parts are already on ``device``."""
    items = list(encoded.items())
    parts = [t for _, enc in items for t in enc.parts.values()]
    sizes = [t.numel() * t.element_size() for t in parts]
    starts = [sum(-(-s // 16) * 16 for s in sizes[:i]) for i in range(len(sizes))]
    staging = torch.empty(starts[-1] + sizes[-1] if parts else 0, dtype=torch.uint8)
    for t, start, size in zip(parts, starts, sizes, strict=True):
        if size:
            staging[start:start + size].copy_(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
    moved = staging.to(device)
    out: dict[str, EncodedTensor] = {}
    i = 0
    for name, enc in items:
        new_parts = {}
        for part, t in enc.parts.items():
            new_parts[part] = moved[starts[i]:starts[i] + sizes[i]].view(t.dtype).view(t.shape)
            i += 1
        out[name] = EncodedTensor(enc.codec, enc.shape, new_parts, enc.block_size)
    return out


def decode_fragment(encoded: Mapping[str, EncodedTensor], *, device: torch.device | None = None,
                    out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``encoded`` decoded to fp32 on ``device`` (None: where the parts are). Off
    the parts' device the encoded bytes travel (one copy, :func:`parts_to_device`), not the 4 to 8
    times larger fp32 values, and decoding runs there. Every part is checked before anything moves.
    ``out``: tensors to decode into, by name (e.g. from :class:`DecodeBuffers`); each other name
    gets a new tensor."""
    for enc in encoded.values():
        check_parts(enc)
    if device is not None:
        encoded = parts_to_device(encoded, device)
    return {name: decode(enc, out=None if out is None else out.get(name)) for name, enc in encoded.items()}


class DecodeBuffers:
    """fp32 tensors to decode into, given back once nothing reads their values any more, so that
    each round's decodes write into memory that is already mapped: on the CPU a fresh tensor of a
    few MB costs more in page faults than decoding into it (2.5x the decode at 86 M here). Holds at
    most as many tensors of a shape as were taken at once. Thread-safe: decodes run on I/O threads."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.device], list[torch.Tensor]] = {}
        self._devices: dict[torch.device, torch.device] = {}
        """A requested device as its tensors name it (``cuda`` -> ``cuda:0``): the free lists' key."""
        self._lock = threading.Lock()

    def take(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> dict[str, torch.Tensor]:
        """One tensor per name, of its shape, on ``device``: a given-back one where there is one."""
        with self._lock:
            if device not in self._devices:
                self._devices[device] = torch.empty(0, device=device).device
            return {name: self._pop(tuple(shape), self._devices[device]) for name, shape in shapes.items()}

    def _pop(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        free = self._free.get((shape, device))
        return free.pop() if free else torch.empty(shape, dtype=torch.float32, device=device)

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors that nothing will read again (their values are overwritten by a later take)."""
        with self._lock:
            for t in tensors:
                if t.dtype == torch.float32 and t.is_contiguous() and t.storage_offset() == 0:
                    self._free.setdefault((tuple(t.shape), t.device), []).append(t)


def encoded_nbytes(enc: EncodedTensor) -> int:
    """Bytes of tensor data on the wire (excluding container headers)."""
    return sum(t.numel() * t.element_size() for t in enc.parts.values())


def encoded_size(numel: int, codec: str, *, block_size: int = 32) -> int:
    """:func:`encoded_nbytes` of any tensor of ``numel`` elements in ``codec``, known before it
    is encoded: fp32 4 bytes an element, bf16 2, int4 half a byte an element of the zero-padded
    blocks plus one fp32 scale per block."""
    _check_codec(codec, block_size)
    if codec == "int4":
        nblocks = -(-numel // block_size)
        return nblocks * block_size // 2 + 4 * nblocks
    return numel * (2 if codec == "bf16" else 4)
