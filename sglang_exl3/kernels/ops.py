"""Registered ops with fake (meta) implementations, so `torch.compile` / SGLang's piecewise graphs trace
through them and CUDA graphs capture them: `torch.ops.exl3.gemm` (one EXL3 linear), `torch.ops.exl3.gemm_group`
(same-input sources such as q/k/v run as one), `torch.ops.exl3.one_launch` (either as one launch, for decode-sized
m), and `torch.ops.exl3.moe_routed` / `moe_decode` / `moe_sorted` (MoE
experts on their routed tokens only: one source per (token, expert) pair in five or two launches, or per tile of
expert-sorted rows).

y[m, N] = had_r_128(had_r_128(x * suh) @ W_hat) * svh, for fp16 x [m, K] (K = packed K), or bf16 x on our CUDA
kernels, which read and write the model's bf16 activations directly (y has x's dtype).
Everything the op needs is a tensor argument or an int: no Python objects, no host syncs.
"""

from __future__ import annotations

import torch

from sglang_exl3.codec.hadamard import had_r_128
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.format.constants import Codebook
from sglang_exl3.kernels.backends import Backend, load_exllamav3_ext


def _torch_gemm(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                w_hat: torch.Tensor | None, codebook: int) -> torch.Tensor:
    if w_hat is None:
        w_hat = reconstruct(trellis, Codebook(codebook))
    xh = had_r_128(x, pre_scale=suh)
    if x.is_cuda:
        acc = torch.matmul(xh, w_hat).float()  # cuBLAS fp16 GEMM, fp32 accumulation
    else:
        acc = torch.matmul(xh.float(), w_hat.float())
    return had_r_128(acc, post_scale=svh, out_dtype=torch.float16)


def _exllamav3_gemm(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                    codebook: int) -> torch.Tensor:
    ext = load_exllamav3_ext()
    out = torch.empty(x.shape[0], trellis.shape[1] * 16, dtype=torch.float16, device=x.device)
    x_had = torch.empty_like(x)
    ext.exl3_gemm(x, trellis, out, suh, x_had, svh, -1, codebook == Codebook.MCG, codebook == Codebook.MUL1, 0)
    return out


def _cuda_gemm(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
               codebook: int) -> torch.Tensor:
    from sglang_exl3.kernels.dense import exl3_linear

    return exl3_linear(x, trellis, suh, svh, Codebook(codebook))


@torch.library.custom_op("exl3::gemm", mutates_args=())
def exl3_gemm(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
              w_hat: torch.Tensor | None, codebook: int, backend: int) -> torch.Tensor:
    """x: fp16 [m, K] contiguous (bf16 also for Backend.CUDA; y has x's dtype); trellis int16 [K/16, N/16, 16*bits]
    (for Backend.CUDA: [N/16, K/16, 16*bits], see dense.prepare); suh fp16 [K]; svh fp16 [N]."""
    if backend == Backend.CUDA:
        return _cuda_gemm(x, trellis, suh, svh, codebook)
    x16 = x.to(torch.float16)  # the other backends compute in fp16
    if backend == Backend.EXLLAMAV3:
        y = _exllamav3_gemm(x16, trellis, suh, svh, codebook)
    else:
        y = _torch_gemm(x16, trellis, suh, svh, w_hat, codebook)
    return y.to(x.dtype)


@exl3_gemm.register_fake
def _(x, trellis, suh, svh, w_hat, codebook, backend):
    n_tiles = trellis.shape[0] if backend == Backend.CUDA else trellis.shape[1]
    return x.new_empty((x.shape[0], n_tiles * 16))


@torch.library.custom_op("exl3::gemm_group", mutates_args=())
def exl3_gemm_group(x: torch.Tensor, tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor],
                    table: torch.Tensor, meta: list[int], codebook: int) -> torch.Tensor:
    """Our CUDA kernels only: [m, sum N] = the concatenated outputs of every source for fp16 or bf16 x [m, K] (of
    x's dtype).
    `tiles` are prepare()d; `table` and `meta` come from groups.make_group (Exl3Group.meta)."""
    from sglang_exl3.kernels.dense import exl3_linear
    from sglang_exl3.kernels.groups import Exl3Group, group_linear

    group = Exl3Group.from_meta(table, meta, codebook)
    if group.runs_fused(x.shape[0]):
        return group_linear(x, group)
    return torch.cat([exl3_linear(x, t, s, v, Codebook(codebook)) for t, s, v in zip(tiles, suh, svh, strict=True)],
                     dim=1)


@exl3_gemm_group.register_fake
def _(x, tiles, suh, svh, table, meta, codebook):
    return x.new_empty((x.shape[0], sum(t.shape[0] for t in tiles) * 16))


@torch.library.custom_op("exl3::one_launch", mutates_args=())
def exl3_one_launch(x: torch.Tensor, table: torch.Tensor, counters: torch.Tensor, meta: list[int],
                    codebook: int) -> torch.Tensor:
    """Our CUDA kernels only: gemm_group's result in one launch for decode-sized m (groups.one_launch_linear);
    `table` / `meta` / `counters` come from groups.make_one_launch. The counters are zero before and after every call
    (the kernel resets what it counts), so the op mutates nothing that outlives it."""
    from sglang_exl3.kernels.groups import Exl3Group, one_launch_linear

    return one_launch_linear(x, Exl3Group.from_meta(table, meta, codebook), counters)


@exl3_one_launch.register_fake
def _(x, table, counters, meta, codebook):
    return x.new_empty((x.shape[0], meta[3]))  # Exl3Group.meta: total_cols


def _expert_banks(gate_rows, up_rows, down_rows, gate_meta, up_meta, down_meta):
    from sglang_exl3.kernels.moe_tables import Exl3ExpertBank

    return (Exl3ExpertBank.from_meta(gate_rows, gate_meta), Exl3ExpertBank.from_meta(up_rows, up_meta),
            Exl3ExpertBank.from_meta(down_rows, down_meta))


@torch.library.custom_op("exl3::moe_routed", mutates_args=())
def exl3_moe_routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_rows: torch.Tensor,
                    up_rows: torch.Tensor, down_rows: torch.Tensor, gate_meta: list[int], up_meta: list[int],
                    down_meta: list[int], gelu: bool) -> torch.Tensor:
    """Our CUDA kernels only: fp32 [m, H] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j],
    for fp16 x [m, K] (or bf16, read by the fused forward as if cast); only routed experts are read (ids < 0:
    another expert-parallel rank's, weight 0), one source per (token, expert) pair (kernels/moe_routed.py). The
    rows/meta come from moe_tables.make_expert_bank (Exl3ExpertBank.rows / .meta)."""
    from sglang_exl3.kernels.moe_routed import routed_moe

    banks = _expert_banks(gate_rows, up_rows, down_rows, gate_meta, up_meta, down_meta)
    return routed_moe(x, topk_ids, topk_weights, *banks, gelu)


@torch.library.custom_op("exl3::moe_sorted", mutates_args=())
def exl3_moe_sorted(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_rows: torch.Tensor,
                    up_rows: torch.Tensor, down_rows: torch.Tensor, gate_meta: list[int], up_meta: list[int],
                    down_meta: list[int], gelu: bool) -> torch.Tensor:
    """moe_routed's result over expert-sorted tiles (kernels/moe_sorted.py): each expert read once per tile of
    rows instead of once per (token, expert) pair; for batches whose pairs share experts."""
    from sglang_exl3.kernels.moe_sorted import sorted_moe

    banks = _expert_banks(gate_rows, up_rows, down_rows, gate_meta, up_meta, down_meta)
    return sorted_moe(x, topk_ids, topk_weights, *banks, gelu)


def _moe_fake(x, topk_ids, topk_weights, gate_rows, up_rows, down_rows, gate_meta, up_meta, down_meta, gelu):
    return x.new_empty((x.shape[0], down_meta[0] * 16), dtype=torch.float32)


exl3_moe_routed.register_fake(_moe_fake)
exl3_moe_sorted.register_fake(_moe_fake)

@torch.library.custom_op("exl3::moe_decode", mutates_args=())
def exl3_moe_decode(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_rows: torch.Tensor,
                    up_rows: torch.Tensor, down_rows: torch.Tensor, gate_up_meta: list[int], down_meta: list[int],
                    gelu: bool, counters: torch.Tensor, out_kind: int) -> torch.Tensor:
    """moe_routed's result in two launches (moe_ops.moe_decode), in fp32, fp16 or bf16 (out_kind 0 / 1 / 2: the
    fp32 result rounded, so a layer's cast back to the model's dtype is folded in). `counters` come from
    moe_ops.decode_counters: zero before and after every call (the kernels reset what they count), so the op mutates
    nothing that outlives it."""
    from sglang_exl3.kernels.moe_ops import DECODE_OUT_DTYPES, moe_decode
    from sglang_exl3.kernels.moe_tables import flat_routing_ids

    gate, up, down = _expert_banks(gate_rows, up_rows, down_rows, gate_up_meta, gate_up_meta, down_meta)
    return moe_decode(x, flat_routing_ids(topk_ids), topk_weights.reshape(-1).to(torch.float32), gate, up, down,
                      topk_ids.shape[1], gelu, counters, out_dtype=DECODE_OUT_DTYPES[out_kind])


@exl3_moe_decode.register_fake
def _(x, topk_ids, topk_weights, gate_rows, up_rows, down_rows, gate_up_meta, down_meta, gelu, counters, out_kind):
    from sglang_exl3.kernels.moe_ops import DECODE_OUT_DTYPES

    return x.new_empty((x.shape[0], down_meta[0] * 16), dtype=DECODE_OUT_DTYPES[out_kind])
