"""Block-diagonal Hadamard-128 rotation with exllamav3's `had_r_128` arithmetic.

`had_r_128` multiplies every 128-wide block of the last dimension by the Sylvester H128/sqrt(128).
The kernel does it as an fp32 butterfly (strides 1, 2, ..., 64; pairs (a, b) -> (a+b, a-b)),
scales by `scale * 0.088388347648f` in fp32 and rounds once to fp16; an fp16 pre-scale is applied
before (one fp16 rounding) or an fp16 post-scale after, never both. Reproducing that order makes
the result bit-identical to the CUDA kernel.
"""

from __future__ import annotations

from functools import cache

import torch

BLOCK = 128
_R_SCALE = 0.088388347648  # the kernel's fp32 literal for 1/sqrt(128)


@cache
def _hadamard_128_f64() -> torch.Tensor:
    i = torch.arange(BLOCK)
    parity = torch.zeros(BLOCK, BLOCK, dtype=torch.int64)
    anded = i[:, None] & i[None, :]
    for b in range(7):
        parity ^= (anded >> b) & 1
    return (1.0 - 2.0 * parity.double()) / BLOCK**0.5


def hadamard_128(dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised, symmetric Sylvester H128 (H @ H = I)."""
    return _hadamard_128_f64().to(dtype=dtype, device=device)


@cache
def _r_scale(scale: float) -> float:
    """The kernel's fp32 `scale * 0.088388347648f` (exact as a Python float)."""
    return float(torch.tensor(scale, dtype=torch.float32) * torch.tensor(_R_SCALE, dtype=torch.float32))


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised fp32 Walsh-Hadamard transform of rows of 128, in the kernel's stage order."""
    h = 1
    while h < BLOCK:
        v = v.view(-1, BLOCK // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return v.reshape(-1, BLOCK)


def had_r_128(
    x: torch.Tensor,
    pre_scale: torch.Tensor | None = None,
    post_scale: torch.Tensor | None = None,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate each 128-block of the last dim of `x` (fp16 or fp32), as exllamav3 does.

    fp16 input -> fp16 output. fp32 input -> fp32 output, or fp16 with `out_dtype=torch.float16`
    (the GEMM epilogue: fp32 accumulators, butterfly, x r_scale, fp16, x post_scale).
    """
    if x.shape[-1] % BLOCK:
        raise ValueError(f"had_r_128 needs the last dim to be a multiple of 128, got {x.shape[-1]}")
    if pre_scale is not None and post_scale is not None:
        raise ValueError("had_r_128 applies a pre-scale or a post-scale, not both")
    out_dtype = out_dtype or x.dtype
    shape = x.shape
    if pre_scale is not None:
        x = (x.float() * pre_scale.float()).to(x.dtype)
    v = _butterfly(x.float().reshape(-1, BLOCK))
    y = (v * _r_scale(float(scale))).reshape(shape).to(out_dtype)
    if post_scale is not None:
        y = (y.float() * post_scale.float()).to(out_dtype)
    return y
