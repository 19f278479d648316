"""Argument checks shared by the ops on our kernel library: a kernel cannot check a device tensor's dtype, shape or
layout, so every op checks what it hands over, and names the argument, before the launch."""

from __future__ import annotations

import torch


def k2_of(trellis: torch.Tensor) -> int:
    """2 * bits per weight, from a trellis' last dimension (16 * bits int16 words per 16x16 tile)."""
    words = trellis.shape[-1]
    if words % 8:
        raise ValueError(f"trellis last dim {words} is not 8 * (2 * bits)")
    return words // 8


def check_tiles(tiles: torch.Tensor) -> None:
    if tiles.dtype != torch.int16 or not tiles.is_cuda or not tiles.is_contiguous() or tiles.dim() != 3:
        raise ValueError("expected prepare()d weights: a contiguous CUDA int16 tensor [N/16, K/16, words]")
    if tiles.data_ptr() % 4:
        raise ValueError("trellis must be 4-byte aligned")


def check_fp16(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float16 or not t.is_cuda or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a contiguous CUDA fp16 tensor {list(shape)}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")


def check_act(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """An activation our kernels read or write: fp16, or bf16 (converted as it is read or written)."""
    if t.dtype not in (torch.float16, torch.bfloat16) or not t.is_cuda or not t.is_contiguous() or \
            tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a contiguous CUDA fp16 or bf16 tensor {list(shape)}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")


def check_source(what: str, tiles: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> None:
    """One source of a group or bank: prepare()d weights, its rotations, whole 128-wide output blocks."""
    check_tiles(tiles)
    nt, kt = tiles.shape[0], tiles.shape[1]
    if nt * 16 % 128:
        raise ValueError(f"{what}: N = {nt * 16} is not a multiple of 128")
    check_fp16(f"{what} suh", suh, (kt * 16,))
    check_fp16(f"{what} svh", svh, (nt * 16,))


def ids_bytes(ids: torch.Tensor) -> int:
    if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(f"routing ids must be contiguous int32 or int64, got {ids.dtype}")
    return ids.element_size()
