"""Int8 / int6 embedding tables with one scale per row (the reference implementation's F23 codec).

EXL3 checkpoints keep the embedding table in BF16, and with a large vocabulary it takes gigabytes. Encoded at load:
- int8: scale = rowmax / 127, q = round(x / scale) clamped to [-127, 127];
- int6: scale = rowmax / 31, q = round(x / scale) clamped to [-32, 31], stored + 32 and packed four values into
  three bytes, little-endian: v0 | v1 << 6 | v2 << 12 | v3 << 18 (H % 4 == 0).
An all-zero row gets scale 1 (the reference's int6 rule, max(rowmax, 1e-8) / 31, underflows fp16 to 0 and makes
the codes NaN), and every scale is kept within fp16's range.
Scales are fp16 and the codes are computed against the fp16-rounded scale, so decoding reproduces exactly what was
encoded. Rows are independent, so encoding in chunks of rows gives the same bytes as encoding the whole table at
once, with a bounded fp32 transient. Decoding gathers the requested rows only, with device ops and no host sync,
so CUDA graphs capture it.
"""

from __future__ import annotations

import torch

BITS = (8, 6)
CHUNK_ROWS = 16384  # rows encoded at a time: the fp32 transient of a 248k x 5120 table stays ~0.3 GB
_QMAX = {8: 127, 6: 31}
_FP16_TINY, _FP16_MAX = 2.0**-24, 65504.0


def _row_scales(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp16 scale per row: rowmax / qmax, 1 for an all-zero row, kept inside fp16's range (a tiny row's scale would
    otherwise round to 0 and its codes to NaN)."""
    rowmax = x.abs().amax(dim=-1) if x.shape[-1] else torch.zeros(x.shape[0], device=x.device)
    scale = torch.where(rowmax > 0, rowmax / _QMAX[bits], torch.ones_like(rowmax))
    return scale.clamp(_FP16_TINY, _FP16_MAX).to(torch.float16)


def _encode_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    scale = _row_scales(x, bits)
    q = torch.round(x / scale.float().unsqueeze(-1))
    if bits == 8:
        return q.clamp_(-127, 127).to(torch.int8), scale
    v = (q.clamp_(-32, 31) + 32).to(torch.int32).view(x.shape[0], -1, 4)
    word = v[..., 0] | (v[..., 1] << 6) | (v[..., 2] << 12) | (v[..., 3] << 18)
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return packed.to(torch.uint8).view(x.shape[0], -1), scale


def check_shape(rows: int, width: int, bits: int) -> None:
    """Raise ValueError naming the rule when a [rows, width] table cannot be encoded at `bits`."""
    if bits not in BITS:
        raise ValueError(f"embedding bits must be one of {BITS}, got {bits!r}")
    if bits == 6 and width % 4:
        raise ValueError(f"int6 embeddings pack four values into three bytes, so the hidden size must be a multiple of "
                         f"4; it is {width}. Use 8 bits")


def encode(table: torch.Tensor, bits: int, chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float table -> (codes, fp16 scales [V]); codes int8 [V, H] (8 bits) or uint8 [V, 3H/4] (6 bits)."""
    rows, width = table.shape
    check_shape(rows, width, bits)
    cols = width if bits == 8 else width // 4 * 3
    codes = torch.empty(rows, cols, dtype=torch.int8 if bits == 8 else torch.uint8, device=table.device)
    scales = torch.empty(rows, dtype=torch.float16, device=table.device)
    for r0 in range(0, rows, max(1, chunk_rows)):
        r1 = min(rows, r0 + chunk_rows)
        codes[r0:r1], scales[r0:r1] = _encode_rows(table[r0:r1], bits)
    return codes, scales


def unpack_int6(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3H/4] -> int values in [-32, 31], shape [..., H] (int16)."""
    b = packed.to(torch.int32).view(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    v = torch.stack([(word >> s) & 63 for s in (0, 6, 12, 18)], dim=-1)
    return (v - 32).to(torch.int16).view(*packed.shape[:-1], -1)


def lookup(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, bits: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of the encoded table, decoded to `dtype`: [*ids.shape, H]."""
    rows = codes[ids]
    values = rows if bits == 8 else unpack_int6(rows)
    return (values.to(torch.float32) * scales[ids].to(torch.float32).unsqueeze(-1)).to(dtype)


def decode(codes: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole table decoded (tests and tools)."""
    return lookup(codes, scales, torch.arange(codes.shape[0], device=codes.device), bits, dtype)
