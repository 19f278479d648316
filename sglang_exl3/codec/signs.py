"""Legacy EXL3 sign vectors: `su`/`sv` int16 bitfields instead of fp16 `suh`/`svh`."""

from __future__ import annotations

import torch


def unpack_sign_bits(packed: torch.Tensor) -> torch.Tensor:
    """int16 [n/16] -> fp16 [n] of +-1: bit i (LSB first) of word j is the sign of element 16j+i.

    A set bit means -1. Arithmetic (1 - 2*bit) instead of torch.where, which exllamav3 avoids
    because of a cross-device scalar bug.
    """
    if packed.dtype != torch.int16 or packed.dim() != 1:
        raise ValueError(f"packed signs must be a 1-D int16 tensor, got {packed.dtype} {tuple(packed.shape)}")
    words = packed.to(torch.int32) & 0xFFFF
    bits = (words[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def input_output_scales(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(suh, svh) of one EXL3 linear from its tensors: fp16 vectors, or expanded legacy su/sv bitfields."""
    suh = tensors["suh"] if "suh" in tensors else unpack_sign_bits(tensors["su"])
    svh = tensors["svh"] if "svh" in tensors else unpack_sign_bits(tensors["sv"])
    return suh, svh
