"""MoE experts for long prefills in the rotated basis: each expert's W_hat decoded once, no rotations in the weights.

An EXL3 expert computes y = had_out(W_hat^T had_in(x, suh), svh): the rotations act on activations, the GEMM on
W_hat alone. So for many rows the slab holds the W_hat of every expert, decoded in one reconstruct launch per tier
and role straight into fused_experts' [E, N, K] layout (a strided view of [K, E*N]: no transpose, no rotation
pass), gate and up side by side as 2E experts of one GEMM. SGLang's grouped Triton GEMM (`invoke_fused_moe_kernel`,
the kernel behind fused_experts) runs every (token, expert) pair on its expert's W_hat, and three glue launches of
ours do the per-pair rotations between the GEMMs (kernels/moe_ops.py `slab_*`):

  rotate_in  x -> each pair's row rotated by its expert's gate suh and by its up suh  [2P, K]
  gate/up    one grouped GEMM over 2E experts                                        [2P, N]
  mid        gate and up output rotations, act(gate) * up, the down input rotation  [P, N]
  down       one grouped GEMM over E experts                                         [P, H]
  tail       the down output rotation and the routing-weighted top-k sum            fp32 [m, H]

The torch glue below does the same arithmetic (the codec's had_r_128, one rounding where the kernels round): the
CPU reference and the GPU check of the kernels. The MoE plan's forward from rotated_min_rows rows
(layers/moe_kernels.py); `benchmarks/moe.py --both-paths` measures it beside the other forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sglang_exl3.codec.hadamard import had_r_128

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Glue(NamedTuple):
    """The per-pair work between the grouped GEMMs (signatures of kernels/moe_ops.py's slab_* functions)."""
    rotate_in: Callable[..., torch.Tensor]  # (x, ids, topk, gate_suh, up_suh) -> fp16 [2P, K]
    mid: Callable[..., torch.Tensor]  # (c [2P, N], ids, gate_svh, up_svh, down_suh, gelu) -> fp16 [P, N]
    tail: Callable[..., torch.Tensor]  # (y [P, H], ids, fp32 weights [P], down_svh, topk) -> fp32 [P / topk, H]


def _experts(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's expert (0 for an unrouted pair) and whether it is routed, as a column."""
    return ids.clamp(min=0).long(), (ids >= 0)[:, None]


def _torch_rotate_in(x, ids, topk, gate_suh, up_suh):
    e, live = _experts(ids)
    xp = x.to(torch.float16).repeat_interleave(topk, dim=0)  # row p = token p // top-k
    a = torch.cat([had_r_128(xp, pre_scale=gate_suh[e]), had_r_128(xp, pre_scale=up_suh[e])])
    return torch.where(live.repeat(2, 1), a, 0)


def _torch_mid(c, ids, gate_svh, up_svh, down_suh, gelu):
    e, live = _experts(ids)
    pairs = ids.numel()
    g = had_r_128(c[:pairs], post_scale=gate_svh[e]).float()
    u = had_r_128(c[pairs:], post_scale=up_svh[e]).float()
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    return torch.where(live, had_r_128((act * u).to(torch.float16), pre_scale=down_suh[e]), 0)


def _torch_tail(y, ids, weights, down_svh, topk):
    e, live = _experts(ids)
    rows = torch.where(live, had_r_128(y, post_scale=down_svh[e]).float() * weights[:, None], 0)
    rows = rows.view(-1, topk, y.shape[1])
    out = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=y.device)
    for j in range(topk):  # top-k order, as the kernel sums
        out += rows[:, j]
    return out


TORCH_GLUE = Glue(_torch_rotate_in, _torch_mid, _torch_tail)


def cuda_glue() -> Glue:
    from sglang_exl3.kernels import moe_ops
    return Glue(moe_ops.slab_rotate_in, moe_ops.slab_mid, moe_ops.slab_tail)


def decode_rotated(tiers, slab: dict, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's W_hat into the slab, tier by tier: gate and up as one [2E, N, K] view (gate experts, then up
    experts), down as [E, H, N]; one reconstruct launch per tier and role, writing column blocks of [K, 2E*N] and
    [N, E*H] (fused_experts reads B through its strides)."""
    from sglang_exl3.kernels.dense import reconstruct

    e = tiers.num_experts
    gate_up = slab["w13"][: 2 * e * inter * hidden].view(hidden, 2 * e * inter)
    down = slab["w2"][: e * hidden * inter].view(inter, e * hidden)
    at = 0
    for tier in tiers.tiers:
        n = len(tier.experts)
        for (stacked, _, _, codebook), buf, first, width in zip(
                tier.dense, (gate_up, gate_up, down), (at, e + at, at), (inter, inter, hidden), strict=True):
            reconstruct(stacked, codebook, out=buf[:, first * width:(first + n) * width])
        at += n
    return (gate_up.view(hidden, 2 * e, inter).permute(1, 2, 0), down.view(inter, e, hidden).permute(1, 2, 0))


def rotated_forward(weights: tuple[torch.Tensor, torch.Tensor], rotations: tuple[torch.Tensor, ...], x: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, gelu: bool, gemm: GroupedGemm,
                    glue: Glue) -> torch.Tensor:
    """fp32 [m, H] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) over the pairs (ids in slab order; below
    0: weight 0), with W_hat views `weights` (gate/up [2E, N, K], down [E, H, N]) and `gemm(a [P, K], b [E, N, K],
    ids [P])` the grouped GEMM c [P, N] = a[p] @ b[ids[p]]^T."""
    m, topk = topk_ids.shape
    if x.dtype not in (torch.float16, torch.bfloat16):  # the glue reads fp16 or bf16 (bf16 rounded to fp16 as read)
        x = x.to(torch.float16)
    x = x.contiguous()
    gate_up_w, down_w = weights
    gate_suh, gate_svh, up_suh, up_svh, down_suh, down_svh = rotations
    ids = topk_ids.reshape(-1).contiguous()
    gemm_ids = ids.clamp(min=0).to(torch.int32)  # an unrouted pair's rows are zero: any expert will do
    experts = down_w.shape[0]
    a = glue.rotate_in(x, ids, topk, gate_suh, up_suh)
    c = gemm(a, gate_up_w, torch.cat([gemm_ids, gemm_ids + experts]))
    h = glue.mid(c, ids, gate_svh, up_svh, down_suh, gelu)
    y = gemm(h, down_w, gemm_ids)
    return glue.tail(y, ids, topk_weights.reshape(-1).float().contiguous(), down_svh, topk)


def reference_gemm(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM expert by expert in torch (fp32 products, one fp16 rounding): the CPU stand-in for the
    Triton kernel, and its GPU check."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float16, device=a.device)
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero(as_tuple=True)[0]
        out[rows] = (a[rows].float() @ b[e].float().t()).to(torch.float16)
    return out


def triton_gemm(m_tokens: int, topk: int, experts: int, inter: int, hidden: int) -> GroupedGemm:
    """SGLang's fused_moe Triton kernel as the grouped GEMM (pairs as rows: top_k = 1), with the config fused_experts
    picks for m tokens of top-k on this layer's shapes."""
    import triton.language as tl
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import try_get_optimal_moe_config
    from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size

    config = dict(try_get_optimal_moe_config((experts, 2 * inter, hidden), (experts, hidden, inter), topk, None,
                                             m_tokens))
    config.pop("USE_TMA", None)

    def run(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pair_ids = ids.to(torch.int32).view(-1, 1)
        sorted_ids, expert_ids, padded = moe_align_block_size(pair_ids, config["BLOCK_SIZE_M"], b.shape[0])
        c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float16, device=a.device)
        unit = torch.ones(a.shape[0], 1, dtype=torch.float32, device=a.device)  # not applied (no routed weight)
        invoke_fused_moe_kernel(a, b, None, c, None, None, None, unit, pair_ids, sorted_ids, expert_ids, padded,
                                False, 1, config, compute_type=tl.float16, use_fp8_w8a8=False, use_int8_w8a8=False,
                                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False)
        return c
    return run


def rotated_slab_forward(tiers, slab: dict, inter: int, hidden: int, x: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, gelu: bool, gemm: GroupedGemm | None = None,
                         glue: Glue | None = None) -> torch.Tensor:
    """The layer's experts for many rows (x fp16 or bf16): decode every W_hat into the slab, then rotated_forward on
    the Triton GEMM and our glue kernels (or `gemm`, `glue`). fp32 [m, H]."""
    weights = decode_rotated(tiers, slab, inter, hidden)
    gemm = gemm or triton_gemm(x.shape[0], topk_ids.shape[1], tiers.num_experts, inter, hidden)
    return rotated_forward(weights, tiers.rotations, x, topk_weights, tiers.slab_ids(topk_ids), gelu, gemm,
                           glue or cuda_glue())
