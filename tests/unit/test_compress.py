"""Compression codecs: round-trip bounds, shapes/dtypes, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.core import CompressionError, EncodedTensor, decode, encode, encoded_nbytes


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 33), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_preserves_shape_and_decodes_fp32(shape, dtype) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    for codec in ("fp32", "bf16", "int4"):
        y = decode(encode(x, codec))
        assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(decode(encode(x, "fp32")), x.float(), rtol=0, atol=0)


@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), scale=st.floats(1e-4, 1e4))
@settings(max_examples=80, deadline=None)
def test_error_bounds(seed: int, n: int, scale: float) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    bf = decode(encode(x, "bf16"))
    # bf16 keeps 8 significant bits: relative error <= 2^-8 per element.
    assert bool(((bf - x).abs() <= x.abs() * 2**-8 + 1e-30).all())
    for block in (2, 8, 32):
        q = decode(encode(x, "int4", block_size=block))
        pad = (-n) % block
        blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
        bound = (blocks.abs().amax(dim=1) / 14).repeat_interleave(block)[:n]
        assert bool(((q - x).abs() <= bound * (1 + 1e-5) + 1e-30).all())


def test_int4_wire_size() -> None:
    x = torch.randn(1000)
    enc = encode(x, "int4", block_size=32)
    # 1000 -> 1024 padded elements = 512 bytes of codes + 32 fp32 scales
    assert encoded_nbytes(enc) == 512 + 32 * 4
    assert encoded_nbytes(encode(x, "bf16")) == 2000 and encoded_nbytes(encode(x, "fp32")) == 4000


def test_decode_buffers_hand_back_what_was_given_back_and_decode_into_it_bit_for_bit() -> None:
    from atoll.core.compress import DecodeBuffers, decode_fragment

    torch.manual_seed(0)
    shapes = {"a": (3, 70), "b": (33,)}
    encoded = {n: encode(torch.randn(s), "int4", block_size=8) for n, s in shapes.items()}
    pool = DecodeBuffers()
    cpu = torch.device("cpu")
    first = decode_fragment(encoded, out=pool.take(shapes, cpu))
    fresh = decode_fragment(encoded)
    assert all(torch.equal(first[n], fresh[n]) for n in shapes)
    ptrs = {n: t.data_ptr() for n, t in first.items()}
    pool.give_back(first.values())
    again = pool.take(shapes, cpu)
    assert {n: t.data_ptr() for n, t in again.items()} == ptrs  # the same memory, handed out once
    assert all(t.data_ptr() not in ptrs.values() for t in pool.take(shapes, cpu).values())  # none left: new ones
    pool.give_back(again.values())  # a device named without its index is the same device
    assert {t.data_ptr() for t in pool.take(shapes, torch.device(cpu.type)).values()} == set(ptrs.values())
    odd = [torch.zeros(4, 4).t(), torch.zeros(4, 4, dtype=torch.float64), torch.zeros(20)[4:].view(4, 4)]
    pool.give_back(odd)  # transposed, fp64, an offset view: not kept (decode needs a whole fp32 tensor)
    taken = pool.take({"c": (4, 4), "d": (4, 4), "e": (4, 4)}, cpu)
    assert not {t.data_ptr() for t in taken.values()} & {t.data_ptr() for t in odd}


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), codec=st.sampled_from(["fp32", "bf16", "int4"]),
       block_size=st.sampled_from([2, 8, 32, 64]))
def test_encoded_size_is_known_from_the_shape(shape: list[int], codec: str, block_size: int) -> None:
    from atoll.core.compress import encoded_size

    x = torch.randn(shape)
    assert encoded_size(x.numel(), codec, block_size=block_size) == encoded_nbytes(encode(x, codec, block_size=block_size))
    with pytest.raises(CompressionError, match="unknown codec"):
        encoded_size(10, "int8")


def test_zero_block_and_exact_values() -> None:
    x = torch.tensor([0.0] * 32 + [7.0, -7.0, 1.0, 0.0] + [0.0] * 28)
    torch.testing.assert_close(decode(encode(x, "int4")), x)


@pytest.mark.parametrize(
    ("x", "kwargs", "match"),
    [
        (torch.tensor([1.0, float("nan")]), {"codec": "int4"}, "NaN or Inf"),
        (torch.tensor([1.0, float("inf")]), {"codec": "bf16"}, "NaN or Inf"),
        (torch.empty(0), {"codec": "fp32"}, "empty"),
        (torch.ones(4), {"codec": "int4", "block_size": 3}, "block_size"),
        (torch.ones(4), {"codec": "int4", "block_size": 0}, "block_size"),
        (torch.ones(4), {"codec": "int2"}, "unknown codec"),
        (torch.ones(4, dtype=torch.int64), {"codec": "fp32"}, "floating"),
    ],
)
def test_bad_input_is_refused_clearly(x, kwargs, match) -> None:
    with pytest.raises(CompressionError, match=match):
        encode(x, **kwargs)


def test_inconsistent_payload_is_refused() -> None:
    enc = encode(torch.randn(40), "int4")
    with pytest.raises(CompressionError, match="codes"):
        decode(EncodedTensor("int4", (41,) if False else (80,), enc.parts, 32))
    with pytest.raises(CompressionError, match="elements"):
        decode(EncodedTensor("fp32", (5,), {"data": torch.ones(4)}))
    with pytest.raises(CompressionError, match="needs"):
        decode(EncodedTensor("int4", (4,), {"codes": torch.zeros(2, dtype=torch.uint8)}, 4))


def test_safetensors_bytes_are_written_without_copies_and_read_by_safetensors() -> None:
    import safetensors.torch

    from atoll.storage.codec import bytes_to_tensors, tensors_to_bytes

    flat = torch.randn(400)
    tensors = {"a": flat[:100].view(10, 10), "b": flat[100:300], "scalar": torch.tensor(3.5),
               "empty": torch.zeros(0, 4), "bf": torch.randn(7).bfloat16(), "u8": torch.arange(9, dtype=torch.uint8),
               "i64": torch.arange(5), "bool": torch.tensor([True, False, True]), "t": torch.randn(4, 6).t()}
    data = tensors_to_bytes(tensors, metadata={"format": "test"})
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0 and data[8:9] == b"{"
    for back in (safetensors.torch.load(data), bytes_to_tensors(data)):
        assert list(sorted(back)) == sorted(tensors)
        for name, t in tensors.items():
            assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name


def test_the_sha256_of_a_payload_not_built_is_that_of_its_bytes() -> None:
    from atoll.storage.codec import sha256_hex, tensors_sha256, tensors_to_bytes

    flat = torch.randn(300)
    for tensors in ({"a": flat[:100].view(10, 10), "b": flat[100:], "t": torch.randn(4, 6).t()},
                    {"c": torch.randn(5, dtype=torch.float64)}, {}):
        data = tensors_to_bytes(tensors)
        assert tensors_sha256(tensors) == (sha256_hex(data), len(data))


def test_all_finite_finds_nan_and_inf_anywhere() -> None:
    from atoll.core.compress import all_finite

    x = torch.randn(1000)
    assert all_finite(x) and all_finite(torch.zeros(0)) and all_finite(x.bfloat16())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 500, 999):
            y = x.clone()
            y[at] = bad
            assert not all_finite(y), (bad, at)


# -- the int4 codec against a reference written out by hand -----------------------------------------
# The straightforward implementation (unpack each nibble, stack, convert, scale, trim): the fused
# codec must give the same bytes and the same fp32 values, bit for bit, on every input.

def reference_int4_encode(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.detach().float().reshape(-1)
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block_size)
    scales = blocks.abs().amax(dim=1) / 7
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-7, 7).to(torch.int16) + 8
    q = q.reshape(-1).to(torch.uint8)
    return q[0::2] | (q[1::2] << 4), scales


def reference_int4_decode(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...],
                          block_size: int) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    lo = (codes & 0x0F).to(torch.int16) - 8
    hi = (codes >> 4).to(torch.int16) - 8
    q = torch.stack([lo, hi], dim=1).reshape(-1, block_size).float()
    return (q * scales.float()[:, None]).reshape(-1)[:n].reshape(shape).contiguous()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (tells -0.0 from +0.0, and NaN payloads apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
    return torch.equal(a, b)


def int4_inputs() -> list[tuple[torch.Tensor, int]]:
    """Tensors of many shapes and block sizes: partial last blocks, zeros (signed), whole zero
    blocks, ties at x.5 codes, subnormal and near-overflow scales."""
    g = torch.Generator().manual_seed(7)
    tiny = torch.finfo(torch.float32).tiny
    big = torch.finfo(torch.float32).max
    cases: list[tuple[torch.Tensor, int]] = []
    for shape in [(1,), (2,), (3,), (31,), (32,), (33,), (7, 5), (4, 64), (3, 5, 7), (1000,), (257, 3)]:
        for block in (2, 4, 6, 32, 64, 128):
            cases.append((torch.randn(shape, generator=g), block))
    x = torch.randn(300, generator=g)
    x[:64] = 0.0
    x[64:96] = -0.0
    x[100:110] = torch.tensor([-0.0, 0.0, 3.5, -3.5, 0.5, -0.5, 7.0, -7.0, 1e-30, -1e-30])
    cases += [(x, 32), (x, 8), (torch.zeros(45), 32), (-torch.zeros(45), 16)]
    cases += [(torch.randn(100, generator=g) * s, b) for s in (1e-44, 1e-40, tiny, 1e-20, 1e20, 1e37) for b in (2, 32)]
    edge = torch.tensor([big, -big, big / 2, 1.0, tiny, -tiny, 1e-45, 0.0, 3e-45, 1.4e-44, -7e-45, 5.0])
    cases += [(edge, 2), (edge, 4), (edge, 12), (edge[4:], 8)]
    cases += [(torch.randn(64, 64, generator=g).t(), 32), (torch.randn(50, generator=g).bfloat16(), 32)]
    return cases


@pytest.fixture(params=["whole", "chunked"])
def int4_passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's chunked passes as they run (one chunk per test tensor) and with tiny chunks
    (many per tensor, down to one block at a time), so every chunk boundary is crossed."""
    if request.param == "chunked":
        monkeypatch.setattr("atoll.core.compress.CPU_PASS_ELEMENTS", 64)


def test_int4_encode_and_decode_are_bit_identical_to_the_reference(int4_passes: None) -> None:
    from atoll.core.compress import decode_fragment

    for x, block in int4_inputs():
        enc = encode(x, "int4", block_size=block)
        codes, scales = reference_int4_encode(x, block)
        assert same_bits(enc.parts["codes"], codes) and same_bits(enc.parts["scales"], scales), (x.shape, block)
        want = reference_int4_decode(codes, scales, tuple(x.shape), block)
        assert same_bits(decode(enc), want), (x.shape, block)
        out = torch.full(tuple(x.shape), float("nan"))
        assert decode(enc, out=out) is out and same_bits(out, want)
        # Into memory at an odd fp32 offset (not 8-byte aligned: the byte lookup runs 2 x fp32).
        shifted = torch.full((x.numel() + 1,), float("nan"))[1:].view(tuple(x.shape))
        assert decode(enc, out=shifted) is shifted and same_bits(shifted, want)
        assert same_bits(decode_fragment({"t": enc})["t"], want)


def test_int4_decode_of_any_bytes_and_scales_matches_the_reference(int4_passes: None) -> None:
    """Whatever a payload holds: every byte value (nibble 0 decodes to -8, which no encoder
    writes), negative, zero, signed-zero, subnormal and huge scales."""
    g = torch.Generator().manual_seed(11)
    big = torch.finfo(torch.float32).max
    for n, block in [(1, 2), (5, 4), (256, 32), (513, 32), (100, 6), (4096, 128), (77, 64)]:
        nblocks = -(-n // block)
        codes = torch.randint(0, 256, (nblocks * block // 2,), dtype=torch.uint8, generator=g)
        scales = torch.randn(nblocks, generator=g) * 10.0 ** torch.randint(-40, 38, (nblocks,), generator=g).float()
        scales[::5] = 0.0
        scales[1::7] = -0.0
        scales[2::11] = big / 9
        enc = EncodedTensor("int4", (n,), {"codes": codes, "scales": scales}, block)
        assert same_bits(decode(enc), reference_int4_decode(codes, scales, (n,), block)), (n, block)
    every_byte = torch.arange(256, dtype=torch.uint8)
    enc = EncodedTensor("int4", (16, 32), {"codes": every_byte, "scales": torch.linspace(-3, 3, 16)}, 32)
    assert same_bits(decode(enc), reference_int4_decode(every_byte, torch.linspace(-3, 3, 16), (16, 32), 32))


def test_encode_residual_is_encode_then_decode_then_add(int4_passes: None) -> None:
    from atoll.core.compress import encode_residual

    g = torch.Generator().manual_seed(3)
    for x, block in int4_inputs():
        if not bool(torch.isfinite(x.float() * 2).all()):
            continue  # target - base would overflow
        base = torch.randn(x.shape, generator=g) * x.float().abs().amax().clamp(min=1e-30)
        base.view(-1)[:3] = torch.tensor([-0.0, 0.0, -0.0])[: base.numel()][: min(3, base.numel())]
        target = base + x.float()
        for codec in ("int4", "bf16", "fp32"):
            enc, applied = encode_residual(target, base, codec, block_size=block)
            ref = encode(target - base, codec, block_size=block)
            assert enc.parts.keys() == ref.parts.keys() and enc.shape == ref.shape
            assert all(same_bits(enc.parts[k], ref.parts[k]) for k in ref.parts), (codec, x.shape, block)
            assert same_bits(applied, torch.add(base, decode(ref))), (codec, x.shape, block)
    # A code that rounds to -0 over a base of -0: decode reads the code back as +0, so the view is +0.
    base = torch.tensor([-0.0, 1.0, -0.0, -0.0])
    enc, applied = encode_residual(torch.tensor([-1e-30, 2.0, -0.0, 1e-30]), base, "int4", block_size=4)
    assert same_bits(applied, torch.add(base, decode(enc)))
    assert same_bits(applied, torch.tensor([0.0, 2.0, 0.0, 0.0]))
    with pytest.raises(CompressionError, match="NaN or Inf"):
        encode_residual(torch.tensor([1.0, float("inf")]), torch.zeros(2), "int4")
    with pytest.raises(CompressionError, match="differ"):
        encode_residual(torch.ones(4), torch.zeros(5), "int4")


def test_int4_encode_refuses_nan_and_inf_wherever_they_are() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 31, 32, 99):
            x = torch.randn(100)
            x[at] = bad
            with pytest.raises(CompressionError, match="NaN or Inf") as info:
                encode(x, "int4", block_size=32)
            assert info.value.kind.value == "non_finite"


def test_parts_travel_in_one_staging_copy_with_their_dtypes_and_shapes() -> None:
    from atoll.core.compress import _staged, decode_fragment, parts_to_device

    encoded = {"a": encode(torch.randn(33, 3), "int4", block_size=32), "b": encode(torch.randn(5), "bf16"),
               "c": encode(torch.randn(2, 2), "fp32"), "d": encode(torch.randn(1), "int4", block_size=2)}
    staged = _staged(encoded, torch.device("cpu"))
    bases = {t.untyped_storage().data_ptr() for e in staged.values() for t in e.parts.values()}
    assert len(bases) == 1  # every part is a view of the one buffer that was copied
    for name, enc in encoded.items():
        for part, t in enc.parts.items():
            got = staged[name].parts[part]
            assert got.dtype == t.dtype and got.shape == t.shape and same_bits(got, t)
    assert parts_to_device(encoded, torch.device("cpu"))["a"] is encoded["a"]  # already there: no copy
    decoded = decode_fragment(encoded, device=torch.device("cpu"))
    assert all(same_bits(decoded[n], decode(e)) for n, e in encoded.items())


def test_int4_scales_bounded() -> None:
    from atoll.core.compress import INT4_SAFE_SCALE, int4_scales_bounded

    assert int4_scales_bounded(torch.tensor([0.0, -1.0, INT4_SAFE_SCALE, -INT4_SAFE_SCALE]))
    assert int4_scales_bounded(torch.zeros(0))
    for bad in (float("nan"), float("inf"), INT4_SAFE_SCALE * 1.0001, -INT4_SAFE_SCALE * 1.0001):
        assert not int4_scales_bounded(torch.tensor([1.0, bad]))
    # The bound is tight: -8 times it is still finite.
    codes = torch.zeros(1, dtype=torch.uint8)  # both nibbles 0: code -8
    out = decode(EncodedTensor("int4", (2,), {"codes": codes, "scales": torch.tensor([INT4_SAFE_SCALE])}, 2))
    assert bool(torch.isfinite(out).all())


def test_payload_finiteness_is_checked_once_on_what_was_read() -> None:
    """int4: scales are checked when read (NaN/Inf refused); decoded values only where a scale is
    large enough for a code times it to overflow. fp32/bf16 learner data is always checked."""
    from atoll.core.compress import INT4_SAFE_SCALE
    from atoll.storage.codec import bytes_to_encoded, encoded_to_bytes
    from atoll.storage.validation import InvalidInput

    x = {"w": torch.randn(6, 10), "b": torch.randn(3)}
    for codec in ("int4", "bf16", "fp32"):
        data, meta = encoded_to_bytes({n: encode(t, codec, block_size=8) for n, t in x.items()})
        got = bytes_to_encoded(data, meta)
        assert all(same_bits(got[n], decode(encode(t, codec, block_size=8))) for n, t in x.items())
        on_cpu = bytes_to_encoded(data, meta, device=torch.device("cpu"))
        assert all(same_bits(on_cpu[n], got[n]) for n in x)

    def payload(codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
        enc = EncodedTensor("int4", (4,), {"codes": codes, "scales": scales}, 4)
        data, meta = encoded_to_bytes({"w": enc})
        return bytes_to_encoded(data, meta)

    small_codes = torch.tensor([0x99, 0x79], dtype=torch.uint8)  # codes +1, +1, +1, -1
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidInput, match="part 'scales' has NaN or Inf") as info:
            payload(small_codes, torch.tensor([bad]))
        assert info.value.kind == "non_finite"
    big = torch.tensor([INT4_SAFE_SCALE * 4])  # above the bound: the decoded values are checked
    assert same_bits(payload(small_codes, big)["w"], reference_int4_decode(small_codes, big, (4,), 4))
    with pytest.raises(InvalidInput, match="decodes to NaN or Inf") as info:
        payload(torch.tensor([0x09, 0x99], dtype=torch.uint8), big)  # a code -8 times it overflows
    assert info.value.kind == "non_finite"
    data, meta = encoded_to_bytes({"w": EncodedTensor("fp32", (2,), {"data": torch.tensor([1.0, float("nan")])})})
    with pytest.raises(InvalidInput, match="NaN or Inf"):
        bytes_to_encoded(data, meta)


@pytest.mark.cuda
def test_codecs_on_cuda_are_bit_identical_to_the_cpu() -> None:
    from atoll.core.compress import decode_fragment, encode_residual

    cuda = torch.device("cuda")
    for x, block in int4_inputs():
        enc = encode(x, "int4", block_size=block)
        on = decode_fragment({"t": enc}, device=cuda)["t"]
        assert on.device.type == "cuda" and same_bits(on.cpu(), decode(enc))
        enc_cuda = encode(x.to(cuda), "int4", block_size=block)
        assert all(same_bits(enc_cuda.parts[k].cpu(), enc.parts[k]) for k in enc.parts)
        base = torch.randn(x.shape)
        if bool(torch.isfinite(x.float() * 2).all()):
            cpu_enc, cpu_view = encode_residual(base + x.float(), base, "int4", block_size=block)
            gpu_enc, gpu_view = encode_residual((base + x.float()).to(cuda), base.to(cuda), "int4", block_size=block)
            assert same_bits(gpu_view.cpu(), cpu_view)
            assert all(same_bits(gpu_enc.parts[k].cpu(), cpu_enc.parts[k]) for k in cpu_enc.parts)
    with pytest.raises(CompressionError, match="NaN or Inf"):
        encode(torch.tensor([1.0, float("nan")], device=cuda), "int4")
    from atoll.core.compress import DecodeBuffers

    pool = DecodeBuffers()  # asked for "cuda", its tensors say "cuda:0": given back, they are reused
    first = pool.take({"t": (64,)}, cuda)["t"]
    pool.give_back([first])
    assert pool.take({"t": (64,)}, cuda)["t"].data_ptr() == first.data_ptr()
