"""Triton trellis kernels: bit-exact EXL3 decode and a fused decode+GEMM for small m.

Decode per weight (all 32-bit integer ops): the tile's stream is its int16 words with each pair
swapped; position t reads the 16-bit window ending at floor((t+1)*K2/2) modulo the ring, i.e. two
stream words and a shift; the codebook is an integer multiply plus either a masked fp16 pair sum
(3INST/MCG) or a byte sum (MUL1), exact as described in codec/codebook.py. Position -> (row, col)
inside the 16x16 tile is the mma B-fragment bit permutation, inverted here: for element (r, c),
p = (c%8)<<5 | ((r%8)//2)<<3 | (c//8)<<2 | (r//8)<<1 | (r%2).

`triton_gemm_tiles` is the large-m candidate: each program decodes its [BLOCK_K, BLOCK_N] weight blocks once for
BLOCK_M (128-256) rows and feeds them to `tl.dot` (wgmma on Hopper), so no fp16 W_hat goes through HBM as in
reconstruct + cuBLAS. It reads the CUDA kernels' prepare()d layout.

Status: correctness verified against the reference codec in Triton's interpreter on CPU
(tests/test_triton_trellis.py). On the H200 the small-m split-K kernel lost to the CUDA kernels (docs/decisions.md),
and `triton_gemm_tiles` measured 4-8x bf16 cuBLAS at m = 256/2048, slower than reconstruct + cuBLAS
(benchmarks/results/prefill-h200.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_exl3.format.constants import Codebook


@triton.jit
def _decode_block(trellis_ptr, k_tile0, n0, stride_tk, stride_tn, WORDS: tl.constexpr, CB: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp16 [BLOCK_K, BLOCK_N] block of W_hat starting at row 16*k_tile0, column n0. Tile (tk, tn) starts at word
    tk * stride_tk + tn * stride_tn: the checkpoint layout [K/16, N/16, words] (stride_tk = N/16 * words) or the
    CUDA kernels' prepare()d layout [N/16, K/16, words] (stride_tn = K/16 * words)."""
    r = tl.arange(0, BLOCK_K)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    tk = k_tile0 + r // 16
    tn = (n0 + c) // 16
    rr = r % 16
    cc = (n0 + c) % 16
    p = ((cc % 8) << 5) | (((rr % 8) // 2) << 3) | ((cc // 8) << 2) | ((rr // 8) << 1) | (rr % 2)
    K2: tl.constexpr = WORDS // 8
    RING: tl.constexpr = 16 * WORDS
    end = ((p + 1) * K2) // 2
    start = (end - 16 + RING) % RING
    i0 = start >> 4
    i1 = (i0 + 1) % WORDS
    shift = 16 - (start & 15)
    base = tk * stride_tk + tn * stride_tn
    w0 = tl.load(trellis_ptr + base + (i0 ^ 1)).to(tl.int32) & 0xFFFF  # pair swap: stream order
    w1 = tl.load(trellis_ptr + base + (i1 ^ 1)).to(tl.int32) & 0xFFFF
    window = ((w0 << 16) | w1).to(tl.uint32)
    x = (window >> shift.to(tl.uint32)) & 0xFFFF
    # Constants as uint32 tensors so that every product wraps mod 2^32 like the CUDA code.
    if CB == 2:  # MUL1
        x = x * tl.full((BLOCK_K, BLOCK_N), 0x83DCD12D, tl.uint32)
        s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        k_inv = 0.00676727294921875  # fp16 0x1EEE
        k_bias = -10.3828125  # fp16 0xC931
        val = ((1024 + s).to(tl.float32) * k_inv + k_bias).to(tl.float16)
    else:
        if CB == 1:  # MCG
            x = x * tl.full((BLOCK_K, BLOCK_N), 0xCBAC1FED, tl.uint32)
        else:  # 3INST
            x = x * tl.full((BLOCK_K, BLOCK_N), 89226354, tl.uint32) + tl.full((BLOCK_K, BLOCK_N), 64248484, tl.uint32)
        mask = tl.full((BLOCK_K, BLOCK_N), 0x8FFF8FFF, tl.uint32)
        x = (x & mask) ^ tl.full((BLOCK_K, BLOCK_N), 0x3B603B60, tl.uint32)
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        val = (lo.to(tl.float32) + hi.to(tl.float32)).to(tl.float16)
    return val


@triton.jit
def _reconstruct_kernel(trellis_ptr, out_ptr, K, N, nt, WORDS: tl.constexpr, CB: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    n0 = pid_n * BLOCK_N
    w = _decode_block(trellis_ptr, k0 // 16, n0, nt * WORDS, WORDS, WORDS, CB, BLOCK_K, BLOCK_N)
    r = k0 + tl.arange(0, BLOCK_K)[:, None]
    c = n0 + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_ptr + r * N + c, w)


def triton_reconstruct(trellis: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """W_hat fp16 [K, N] (== the reference codec's `reconstruct`, bit for bit)."""
    kt, nt, words = trellis.shape
    k, n = kt * 16, nt * 16
    out = torch.empty(k, n, dtype=torch.float16, device=trellis.device)
    block_k, block_n = 16, 16 if n % 64 else 64
    grid = (k // block_k, n // block_n)
    _reconstruct_kernel[grid](trellis, out, k, n, nt, WORDS=words, CB=int(codebook),
                              BLOCK_K=block_k, BLOCK_N=block_n)
    return out


@triton.jit
def _gemm_splitk_kernel(x_ptr, trellis_ptr, acc_ptr, M, K, N, nt, K_TILES_PER_SPLIT: tl.constexpr,
                        WORDS: tl.constexpr, CB: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc[M, N] (fp32, zeroed) += x[M, K] @ W_hat[K, N] over this program's slice of K."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kt0 = pid_s * K_TILES_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, K_TILES_PER_SPLIT, BLOCK_K // 16):  # splits divide the K tiles exactly
        kt = kt0 + i
        kk = kt * 16 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = _decode_block(trellis_ptr, kt, n0, nt * WORDS, WORDS, WORDS, CB, BLOCK_K, BLOCK_N)
        acc += tl.dot(a, w)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.atomic_add(acc_ptr + m[:, None] * N + cols[None, :], acc, mask=m[:, None] < M)


def triton_gemm_rotated(xh: torch.Tensor, trellis: torch.Tensor, codebook: Codebook,
                        splits: int | None = None) -> torch.Tensor:
    """fp32 [m, N] = xh (fp16 [m, K], already rotated) @ W_hat, decoding W_hat on the fly (split-K)."""
    kt, nt, words = trellis.shape
    k, n = kt * 16, nt * 16
    m = xh.shape[0]
    block_m = 16
    block_k = 16
    block_n = 64 if n % 64 == 0 else 16
    n_blocks = n // block_n
    if splits is None:  # aim for ~2 programs per SM on a 132-SM H200 (to be tuned on the GPU)
        splits = max(1, min(kt, 264 // max(1, n_blocks)))
    splits = max(d for d in range(1, min(splits, kt) + 1) if kt % d == 0)  # exact division of K tiles
    per_split = kt // splits
    acc = torch.zeros(m, n, dtype=torch.float32, device=xh.device)
    grid = (n_blocks, splits, -(-m // block_m))
    _gemm_splitk_kernel[grid](xh, trellis, acc, m, k, n, nt, K_TILES_PER_SPLIT=per_split, WORDS=words, CB=int(codebook),
                              BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n)
    return acc


@triton.jit
def _gemm_tiles_kernel(x_ptr, trellis_ptr, y_ptr, M, K: tl.constexpr, N, kt, WORDS: tl.constexpr, CB: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[M, N] (fp32) = x[M, K] @ W_hat[K, N], W_hat decoded block by block from the prepare()d layout. K is a
    constexpr (one compile per input width) because Triton's interpreter cannot loop to a runtime bound."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (checked by the caller)
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=m[:, None] < M, other=0.0)
        w = _decode_block(trellis_ptr, k0 // 16, n0, WORDS, kt * WORDS, WORDS, CB, BLOCK_K, BLOCK_N)
        acc += tl.dot(a, w)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + m[:, None] * N + cols[None, :], acc, mask=m[:, None] < M)


def triton_gemm_tiles(xh: torch.Tensor, tiles: torch.Tensor, codebook: Codebook, block_m: int = 128,
                      block_n: int = 128, block_k: int = 64, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """fp32 [m, N] = xh (fp16 [m, K], already rotated) @ W_hat for large m, from the CUDA kernels' prepare()d
    weights [N/16, K/16, words]: each weight block is decoded once per BLOCK_M rows (no W_hat in HBM)."""
    nt, kt, words = tiles.shape
    k, n = kt * 16, nt * 16
    if xh.dtype != torch.float16 or not xh.is_contiguous() or xh.shape[1] != k:
        raise ValueError(f"xh must be contiguous fp16 [m, {k}], got {xh.dtype} {tuple(xh.shape)}")
    if k % block_k or n % block_n or block_k % 16 or block_n % 16:
        raise ValueError(f"K={k} and N={n} must be multiples of block_k={block_k} and block_n={block_n} (of 16)")
    m = xh.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=xh.device)
    grid = (n // block_n, -(-m // block_m))
    _gemm_tiles_kernel[grid](xh, tiles, y, m, k, n, kt, WORDS=words, CB=int(codebook), BLOCK_M=block_m,
                             BLOCK_K=block_k, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return y
