"""The int8 / int6 embedding codec (codec/embedding.py): error bound, packing, chunking, zero rows, empty tables."""

from __future__ import annotations

import pytest
import torch

from sglang_exl3.codec import embedding as codec


def _table(rows: int = 700, width: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()


@pytest.mark.parametrize("bits", codec.BITS)
def test_every_value_is_within_half_a_step_of_its_row_scale(bits):
    x = _table()
    codes, scales = codec.encode(x, bits)
    assert scales.dtype == torch.float16 and scales.shape == (x.shape[0],)
    assert codes.shape == ((x.shape[0], x.shape[1]) if bits == 8 else (x.shape[0], x.shape[1] * 3 // 4))
    err = (codec.decode(codes, scales, bits) - x.float()).abs()
    assert bool((err <= scales.float().unsqueeze(-1) * 0.5 + 1e-6).all())
    assert float(err.mean() / x.float().abs().mean()) < (0.01 if bits == 8 else 0.04)


def _int6_reference(x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """The packing written out value by value, as the reference defines it."""
    out = bytearray()
    scales = torch.where(x.float().abs().amax(-1) > 0, x.float().abs().amax(-1) / 31, torch.ones(x.shape[0]))
    scales = scales.half()
    for row, scale in zip(x.float(), scales.float(), strict=True):
        v = [int(min(31, max(-32, round(float(a) / float(scale))))) + 32 for a in row]
        for i in range(0, len(v), 4):
            word = v[i] | v[i + 1] << 6 | v[i + 2] << 12 | v[i + 3] << 18
            out += word.to_bytes(3, "little")
    return bytes(out), scales


def test_int6_packs_four_values_into_three_little_endian_bytes():
    x = _table(rows=9, width=16)
    codes, scales = codec.encode(x, 6)
    packed, want_scales = _int6_reference(x)
    assert codes.numpy().tobytes() == packed and torch.equal(scales, want_scales)
    assert torch.equal(codec.unpack_int6(codes).float() * scales.float()[:, None], codec.decode(codes, scales, 6))


@pytest.mark.parametrize("bits", codec.BITS)
def test_chunked_encoding_is_bit_identical(bits):
    x = _table(rows=1001)
    whole = codec.encode(x, bits, chunk_rows=10**9)
    for chunk in (1, 7, 256, 1000):
        part = codec.encode(x, bits, chunk_rows=chunk)
        assert torch.equal(part[0], whole[0]) and torch.equal(part[1], whole[1])


@pytest.mark.parametrize("bits", codec.BITS)
def test_zero_and_tiny_rows_and_empty_tables(bits):
    x = _table(rows=4, width=8).float()
    x[1] = 0
    x[2] = 1e-9
    codes, scales = codec.encode(x, bits)
    decoded = codec.decode(codes, scales, bits)
    assert bool(torch.isfinite(decoded).all()) and bool((decoded[1] == 0).all())
    assert float(decoded[2].abs().max()) < 1e-7
    empty_codes, empty_scales = codec.encode(torch.zeros(0, 8), bits)
    assert empty_codes.shape[0] == 0 and empty_scales.shape == (0,)


def test_lookup_gathers_any_shape_of_ids():
    x = _table()
    codes, scales = codec.encode(x, 8)
    ids = torch.tensor([[3, 0, 699], [5, 5, 1]])
    rows = codec.lookup(codes, scales, ids, 8, torch.bfloat16)
    assert rows.shape == (2, 3, x.shape[1]) and rows.dtype == torch.bfloat16
    assert torch.equal(rows[0, 2], codec.decode(codes, scales, 8, torch.bfloat16)[699])


def test_bad_shapes_and_bits_name_the_rule():
    with pytest.raises(ValueError, match="multiple of 4; it is 10. Use 8 bits"):
        codec.encode(torch.zeros(2, 10), 6)
    with pytest.raises(ValueError, match=r"embedding bits must be one of \(8, 6\), got 4"):
        codec.encode(torch.zeros(2, 8), 4)
