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


def test_all_finite_finds_nan_and_inf_anywhere() -> None:
    from atoll.core.compress import all_finite

    x = torch.randn(1000)
    assert all_finite(x) and all_finite(torch.zeros(0)) and all_finite(x.bfloat16())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 500, 999):
            y = x.clone()
            y[at] = bad
            assert not all_finite(y), (bad, at)
