"""The trellis encoder on our CUDA kernels (csrc/encode/): the same search as codec/encode.py's torch encoder
and the same path bit for bit (tests/gpu/test_encode_cuda.py compares them), at GPU speed.

Two kernels find it. `exl3_quantize_tiles` (K = 1..8) is the search as written: one block per tile, codebook values
read from the table, both passes' backpointers in global memory (4 MiB per tile at K = 4, so it is bound by memory
traffic). `exl3_quantize_tiles_fast` (K = 2..8, used whenever it applies) computes the values in registers, keeps
the costs in shared memory, carries the first pass's answer as a per-state tag instead of backpointers, and solves
the second pass in segments recomputed from stored cost vectors: its scratch is one cost vector per segment per
resident block (128 KiB per block at K = 4, in L2; 4 MiB at K = 2).
"""

from __future__ import annotations

import ctypes

import torch

from sglang_exl3.codec.codebook import Codebook, codebook_table
from sglang_exl3.kernels.library import check, load_library, stream

SCRATCH_BYTES = 1 << 30  # the plain kernel's backpointers (256 x 2^(16-K) uint16 per tile) and costs of one chunk
_FAST_BLOCKS: dict[tuple[int, int, int], int] = {}


def encode_tiles_cuda(x: torch.Tensor, k: int, codebook: Codebook = Codebook.MCG, kernel: str = "auto") -> torch.Tensor:
    """x [T, 256] (position order, CUDA) -> int32 states [T, 256]: `codec.encode.encode_tiles` on the GPU.
    `kernel`: "auto" (the fast kernel for K >= 2), "fast" or "plain"."""
    if not x.is_cuda or x.dim() != 2 or x.shape[1] != 256:
        raise ValueError(f"expected CUDA tiles [T, 256], got {x.device} {tuple(x.shape)}")
    if k not in range(1, 9):
        raise ValueError(f"the encoder takes integer K in 1..8, got {k}")
    if kernel not in ("auto", "fast", "plain"):
        raise ValueError(f"kernel must be auto, fast or plain, got {kernel!r}")
    if kernel == "fast" and k < 2:
        raise ValueError("the fast encoder kernel takes K in 2..8")
    x = x.float().contiguous()
    states = torch.empty(x.shape[0], 256, dtype=torch.int32, device=x.device)
    if x.shape[0] == 0:
        return states
    if kernel == "plain" or k < 2:
        return _plain(x, k, codebook, states)
    return _fast(x, k, codebook, states)


def _fast(x: torch.Tensor, k: int, codebook: Codebook, states: torch.Tensor) -> torch.Tensor:
    lib = load_library()
    blocks = _resident_blocks(lib, x.device, k, int(codebook))
    snaps = torch.empty(blocks, lib.exl3_quantize_tiles_fast_scratch(k), dtype=torch.float32, device=x.device)
    check(lib.exl3_quantize_tiles_fast(x.data_ptr(), states.data_ptr(), snaps.data_ptr(), x.shape[0], k,
                                        int(codebook), blocks, None, stream(x)), "quantize_tiles_fast")
    return states


def _resident_blocks(lib, device: torch.device, k: int, cb: int) -> int:
    key = (device.index or 0, k, cb)
    if key not in _FAST_BLOCKS:
        out = ctypes.c_int(0)
        with torch.cuda.device(device):
            check(lib.exl3_quantize_tiles_fast(None, None, None, 0, k, cb, 0, ctypes.byref(out), None),
                   "quantize_tiles_fast (occupancy)")
        _FAST_BLOCKS[key] = out.value
    return _FAST_BLOCKS[key]


def _plain(x: torch.Tensor, k: int, codebook: Codebook, states: torch.Tensor) -> torch.Tensor:
    table = codebook_table(codebook, x.device).float().contiguous()
    edges = 1 << (16 - k)
    chunk = max(1, min(x.shape[0], SCRATCH_BYTES // (edges * (2 * 4 + 256 * 2))))
    cost = torch.empty(chunk, 2, edges, dtype=torch.float32, device=x.device)
    back = torch.empty(chunk, 256, edges, dtype=torch.int16, device=x.device)
    lib = load_library()
    for c0 in range(0, x.shape[0], chunk):
        n = min(chunk, x.shape[0] - c0)
        check(lib.exl3_quantize_tiles(x[c0:].data_ptr(), table.data_ptr(), states[c0:].data_ptr(), cost.data_ptr(),
                                       back.data_ptr(), n, k, stream(x)), "quantize_tiles")
    return states
