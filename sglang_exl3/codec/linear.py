"""Reference EXL3 linear forward: y = had(x * suh) @ W_hat -> had(.) * svh (+ bias).

Same arithmetic as exllamav3's `exl3_gemm` up to the order of the fp32 accumulation: the input
rotation rounds to fp16 (like `had_r_128` with a pre-scale), the product accumulates in fp32 and
the output rotation rounds once to fp16 before the svh scale (the kernel's epilogue).
"""

from __future__ import annotations

import torch

from sglang_exl3.codec.codebook import Codebook
from sglang_exl3.codec.hadamard import had_r_128
from sglang_exl3.codec.trellis import reconstruct


def pad_input(x: torch.Tensor, packed_in: int, name: str = "EXL3 linear") -> torch.Tensor:
    """Zero-extend the last dim of x to the packed K; wider input is an error."""
    width = x.shape[-1]
    if width > packed_in:
        raise ValueError(f"{name}: input width {width} exceeds packed K {packed_in}")
    if width == packed_in:
        return x
    return torch.nn.functional.pad(x, (0, packed_in - width))


def exl3_linear_reference(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: Codebook,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
    w_hat: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] (any float dtype) -> y [..., out_features] in x's dtype.

    `w_hat` may carry a cached `reconstruct(trellis)`; `out_features` trims padded columns.
    """
    packed_in = trellis.shape[0] * 16
    packed_out = trellis.shape[1] * 16
    out_features = packed_out if out_features is None else out_features
    if out_features > packed_out:
        raise ValueError(f"EXL3 linear: logical N {out_features} exceeds packed N {packed_out}")
    lead = x.shape[:-1]
    x16 = pad_input(x, packed_in).reshape(-1, packed_in).to(torch.float16)
    xh = had_r_128(x16, pre_scale=suh)
    if w_hat is None:
        w_hat = reconstruct(trellis, codebook)
    acc = torch.matmul(xh.float(), w_hat.float())
    y = had_r_128(acc, post_scale=svh, out_dtype=torch.float16)
    if bias is not None:
        y = y + bias.to(torch.float16)
    return y[:, :out_features].reshape(*lead, out_features).to(x.dtype)
