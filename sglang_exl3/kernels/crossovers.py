"""Every row-count crossover and budget of the dense dispatch (kernels/dispatch.py), in one named table, each with
the measurement behind it. Data only: the library's loader (the rotation forms' crossover) and the dispatch read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseCrossovers:
    """Where the dense dispatch changes form. Results are in benchmarks/results/ (4 bits, whole linear) unless said."""

    # The global-load and x-slice GEMMs' limit (8 groups of 8 rows); the x ring takes any m.
    fused_max_m: int = 64
    # x staged in shared memory (one ldmatrix per tile, 48-56 registers instead of 64-96): 1.04-1.32x at m = 8 and
    # 1.3-1.8x at 16; at m = 1-4 within +-3% for MCG, mostly 1.01-1.05x for MUL1 (xs-ab-h200, xs-splits-h200). So
    # MCG / 3INST from 8 rows, MUL1 from 1; 17-64 rows (64-68 / 96 registers instead of 96-108 / 128-184): 1.7-2.0x at
    # 32, 1.3-2.0x at 64.
    xs_min_m: int = 8
    xs_min_m_mul1: int = 1
    xs_max_m: int = 64
    # x slice per block up to 32 rows (splits grow until it fits; 8 blocks per SM resident), and at 33-64 rows (1.2-1.3x
    # faster there than 24 KB; 96 KB is slower again)
    xs_smem_bytes: int = 24 << 10
    xs_smem_bytes_64: int = 48 << 10
    # A group's splits are fixed at load: above this slice (the kernel's limit), global loads; a longer slice costs
    # occupancy but beats global loads (4096x14336, m = 32, 96 KB: 1.6x).
    xs_group_smem_bytes: int = 96 << 10
    # More splits mean more fp32 partials [splits, m, N]: the raised split count stops where they would pass this (a
    # 151936-wide lm_head at m = 64 would need 24 splits, 933 MB); the slice then grows up to xs_group_smem_bytes, and
    # where it cannot, global loads (and above global_loads_max_m rows, reconstruct + cuBLAS).
    xs_partial_bytes: int = 64 << 20
    # Above this many rows the fused GEMM pays only with x in shared memory: with global loads it measured a median
    # 1.68x of reconstruct + cuBLAS at m = 64 (kernels-h200).
    global_loads_max_m: int = 32
    # The mma.sync x ring (ring-ab-h200, against the x-slice / global-load dispatch): 1.02-1.16x at m = 16, 1.14-1.44x
    # at 32, 1.27-2.33x at 64, and against reconstruct + cuBLAS 1.01-1.23x at 128; at m = 1-8 0.92-1.09x, so smaller m
    # keep the x-slice GEMMs. Ring blocks need N % 128 == 0 (8 warps of 16 columns).
    ring_min_m: int = 16
    ring_max_m: int = 128
    ring_block_rows: int = 64  # rows per mma.sync ring block (blockIdx.y): more rows decode the weights again
    # The wgmma ring (sm_90a builds), decoding the weights once per block of wg_block_rows(m) rows: H100, wgmma-ab
    # (four shapes): its best cell 0.88-1.06x the mma.sync ring at 16-32 rows, 1.01-1.10x at 48-64, 1.32-1.49x at
    # 96-128 on the wide shapes, 1.23-1.74x against reconstruct + cuBLAS at 192-256 and 0.69-0.99x at 384 and 1,024;
    # at 48-256 rows one trellis group per chunk is within 2.2% of two where two won.
    wg_min_m: int = 33
    wg_max_m: int = 256
    # A group runs at its load-time splits, which the wgmma ring measured slow with above 64 rows (gate/up 162 µs at
    # 128 rows against 2 x 61 for its two sources alone, at a quarter of default_splits): above, source by source.
    wg_group_max_m: int = 64
    # The most rows on the fused GEMMs where SGLANG_EXL3_DEV_FUSED_MAX_M is unset: the mma.sync ring measured
    # 1.01-1.23x of reconstruct + cuBLAS at 128 rows (ring-ab-h200); with the wgmma ring, its wg_max_m. Above:
    # reconstruct + cuBLAS.
    fused_crossover_m: int = 128
    # W_hat scratch per slice of columns on the large-m path
    reconstruct_slice_bytes: int = 128 << 20
    # A rotation launch over at least this many 128-blocks takes eight threads per block, except over fp32 split-K
    # partials (H100, rotation-ab: had_out of one fp16 split 1.38-1.47x at 7,168-8,192 blocks and 2.0-2.3x above;
    # had_in 1.00-1.03x there and 1.17-1.32x above; 0.70-0.96x at 2,048 and below).
    octet_min_items: int = 4096
    # The one-launch linear's kernel limit (one or two 8-row groups; from 16 rows the x ring serves)
    one_launch_max_rows: int = 16
    # Resident warps per SM that a decode launch's (MoE decode, one-launch linear) splits aim to fill once
    decode_wave_warps: int = 32


CROSSOVERS = DenseCrossovers()
