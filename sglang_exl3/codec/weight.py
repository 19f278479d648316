"""Original-basis EXL3 weight: W = diag(suh) . H_in . W_hat . H_out . diag(svh), [in, out].

Mirrors exllamav3's `LinearEXL3.get_weight_tensor()`: left Hadamard as an fp32 GEMM, round to
fp16, times suh (fp16), right Hadamard as an fp32 GEMM, round to fp16, times svh (fp16).
cuBLAS' fp32 GEMM accumulates each output as a sequential FMA chain over the 128-long block, and
that chain's rounding decides the fp16 result whenever the exact value sits near an fp16 rounding
boundary (about 0.6% of elements; a different rounding there moves small, cancelling outputs by up
to ~100 ulps). So the chain is emulated exactly: products in float64 (exact: 24 x 11 bits), the
running sum rounded to fp32 after every step. Verified against exllamav3 on the H200: 0 of 1.44M
elements differ (tests/test_exllamav3_checkpoints.py).
"""

from __future__ import annotations

import math

import torch

from sglang_exl3.codec.hadamard import BLOCK, hadamard_128
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.format.constants import Codebook

_C32 = float(torch.tensor(1 / math.sqrt(BLOCK), dtype=torch.float32))  # exllamav3 scales H in fp32
_ROWS_PER_CHAIN = {"cpu": 2048, "cuda": 1 << 18}  # CPU: cache-sized working set; GPU: few launches


def _fma_chain_rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """fp32 sequential-FMA (x @ h) for x [rows, 128] holding fp16 values (as float64) -> fp32."""
    acc = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    acc32 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    prod = torch.empty_like(acc)
    for j in range(BLOCK):
        torch.mul(x[:, j : j + 1], h[j], out=prod)
        acc.add_(prod)
        acc32.copy_(acc)  # the chain rounds to fp32 after every step
        acc.copy_(acc32)
    return acc32


def rotate_like_fp32_gemm(x: torch.Tensor) -> torch.Tensor:
    """(x @ H128) per 128-block of the last dim, rounded to fp16 as exllamav3's fp32 GEMM does."""
    shape = x.shape
    flat = x.reshape(-1, BLOCK)
    h = torch.sign(hadamard_128(torch.float64, x.device)) * _C32
    out = torch.empty(flat.shape, dtype=torch.float16, device=x.device)
    step = _ROWS_PER_CHAIN.get(x.device.type, 2048)
    for r0 in range(0, flat.shape[0], step):
        rows = slice(r0, r0 + step)
        out[rows] = _fma_chain_rotate(flat[rows].double(), h).half()
    return out.view(shape)


def _scale(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp16 x fp16 product with one rounding (exact in fp32, like torch's fp16 mul)."""
    return (w.float() * scale.float()).half()


def dequantize_weight(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: Codebook,
    rows_per_chunk: int = 1024,
) -> torch.Tensor:
    """Full fp16 weight in [in, out] orientation, padded dims included (== get_weight_tensor()).

    Works on `rows_per_chunk` rows at a time (a multiple of 128) to bound memory.
    """
    w_hat = reconstruct(trellis, codebook)
    k, n = w_hat.shape
    suh, svh = suh.to(w_hat.device), svh.to(w_hat.device)
    out = torch.empty_like(w_hat)
    step = max(BLOCK, rows_per_chunk // BLOCK * BLOCK)
    for r0 in range(0, k, step):
        r1 = min(k, r0 + step)
        # Left rotation mixes the 128 rows of each block: rotate the block's columns.
        cols = w_hat[r0:r1].view(-1, BLOCK, n).transpose(1, 2)
        left = rotate_like_fp32_gemm(cols).transpose(1, 2).reshape(r1 - r0, n)
        left = _scale(left, suh[r0:r1, None])
        out[r0:r1] = _scale(rotate_like_fp32_gemm(left), svh[None, :])
    return out
