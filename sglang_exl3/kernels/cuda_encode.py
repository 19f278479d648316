"""The trellis encoder on our CUDA kernels (`exl3_quantize_tiles` in csrc/exl3_trellis.cu): one block per 16x16
tile, the same search as codec/encode.py's torch encoder and the same path bit for bit (tests/gpu/test_encode_cuda.py
compares them), at GPU speed. Scratch is bounded by encoding the tiles in chunks."""

from __future__ import annotations

import torch

from sglang_exl3.codec.codebook import Codebook, codebook_table
from sglang_exl3.kernels.cuda_trellis import _check, _stream, load_library

SCRATCH_BYTES = 1 << 30  # backpointers (256 x 2^(16-K) uint16 per tile) and costs of one chunk


def encode_tiles_cuda(x: torch.Tensor, k: int, codebook: Codebook = Codebook.MCG) -> torch.Tensor:
    """x [T, 256] (position order, CUDA) -> int32 states [T, 256]: `codec.encode.encode_tiles` on the GPU."""
    if not x.is_cuda or x.dim() != 2 or x.shape[1] != 256:
        raise ValueError(f"expected CUDA tiles [T, 256], got {x.device} {tuple(x.shape)}")
    if k not in range(1, 9):
        raise ValueError(f"the encoder takes integer K in 1..8, got {k}")
    x = x.float().contiguous()
    table = codebook_table(codebook, x.device).float().contiguous()
    edges = 1 << (16 - k)
    chunk = max(1, min(x.shape[0], SCRATCH_BYTES // (edges * (2 * 4 + 256 * 2))))
    cost = torch.empty(chunk, 2, edges, dtype=torch.float32, device=x.device)
    back = torch.empty(chunk, 256, edges, dtype=torch.int16, device=x.device)
    states = torch.empty(x.shape[0], 256, dtype=torch.int32, device=x.device)
    lib = load_library()
    for c0 in range(0, x.shape[0], chunk):
        n = min(chunk, x.shape[0] - c0)
        _check(lib.exl3_quantize_tiles(x[c0:].data_ptr(), table.data_ptr(), states[c0:].data_ptr(), cost.data_ptr(),
                                       back.data_ptr(), n, k, _stream(x)), "quantize_tiles")
    return states
