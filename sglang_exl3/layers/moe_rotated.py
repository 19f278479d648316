"""MoE experts for long prefills in the rotated basis: each expert's W_hat decoded once, no rotations in the weights.

An EXL3 expert computes y = diag(svh) H (W_hat^T (H diag(suh) x)): the rotations act on activations, the GEMM on
W_hat alone. So for many rows the slab can hold the W_hat of every expert, decoded in one reconstruct launch per
role straight into fused_experts' [E, N, K] layout (a strided view of [K, E*N]: no transpose, no rotation pass; the
dense slab of moe_kernels makes five passes), SGLang's grouped Triton GEMM (`invoke_fused_moe_kernel`, the kernel
behind fused_experts) runs every (token, expert) pair on its expert's W_hat, and the per-pair rotations and the
activation run between the GEMMs on the pair rows. The Hadamard blocks are fp16 matmuls with H/8 (exact in
fp16): each such rotation is sqrt(2) times the normalised one, so a GEMM between two of them comes out 2x and the
output scale takes an exact 0.5.

The MoE plan's forward from rotated_min_rows rows (layers/moe_kernels.py: the crossover with expert-sorted tiles
measured on the H200); `benchmarks/moe.py --both-paths` measures it beside the other forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from sglang_exl3.codec.hadamard import BLOCK, hadamard_128

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@cache
def _h8(device: torch.device) -> torch.Tensor:
    """Sylvester H128 / 8 in fp16: entries +-1/8, exact; sqrt(2) times the normalised H128."""
    return (hadamard_128(torch.float64) * (BLOCK ** 0.5 / 8)).to(device=device, dtype=torch.float16)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """fp16 [R, K] -> fp16: every 128-block times H/8 (fp32 accumulation, one rounding)."""
    rows, k = x.shape
    return (x.reshape(-1, BLOCK) @ _h8(x.device)).reshape(rows, k)


def rotate_in(x: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """sqrt(2) x the input rotation H diag(suh) x, per row (suh per row: [R, K])."""
    return rotate((x.float() * suh.float()).to(torch.float16))


def rotate_out(c: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """The output rotation diag(svh) H c of a GEMM run between two `rotate`s (so 2x too large): x 0.5, exact."""
    return (rotate(c).float() * (0.5 * svh.float())).to(torch.float16)


def decode_rotated(tiers, slab: dict, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every expert's W_hat into the slab, tier by tier, as [E, N, K] views (gate, up, down): one reconstruct launch
    per tier and role, writing [K, E*N] column blocks (fused_experts reads B through its strides)."""
    from sglang_exl3.kernels.cuda_trellis import reconstruct

    e = tiers.num_experts
    buffers = (slab["w13"][: e * inter * hidden].view(hidden, e * inter),
               slab["w13"][e * inter * hidden: 2 * e * inter * hidden].view(hidden, e * inter),
               slab["w2"][: e * hidden * inter].view(inter, e * hidden))
    at = 0
    for tier in tiers.tiers:
        n = len(tier.experts)
        for (stacked, _, _, codebook, _), buf in zip(tier.dense, buffers, strict=True):
            width = buf.shape[1] // e
            reconstruct(stacked, codebook, out=buf[:, at * width:(at + n) * width])
        at += n
    return tuple(buf.view(buf.shape[0], e, buf.shape[1] // e).permute(1, 2, 0) for buf in buffers)


def rotation_tables(tiers) -> tuple[torch.Tensor, ...]:
    """Per role, suh [E, K] and svh [E, N] of every expert in slab order: (gate suh, gate svh, up suh, up svh, down
    suh, down svh)."""
    out = []
    for role in range(3):
        suh = torch.cat([tier.dense[role][1] for tier in tiers.tiers])
        svh = torch.cat([tier.dense[role][2].view(len(tier.experts), -1) for tier in tiers.tiers])
        out += [suh, svh]
    return tuple(out)


def rotated_forward(weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rotations: tuple[torch.Tensor, ...],
                    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gelu: bool,
                    gemm: GroupedGemm) -> torch.Tensor:
    """fp32 [m, H] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) over the pairs (ids in slab order; below
    0: weight 0), with W_hat views `weights` ([E, N, K] each) and `gemm(a [P, K], b [E, N, K], ids [P])` the grouped
    GEMM c [P, N] = a[p] @ b[ids[p]]^T."""
    m, topk = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    valid = ids >= 0
    ids = torch.where(valid, ids, 0)
    gate_w, up_w, down_w = weights
    gate_suh, gate_svh, up_suh, up_svh, down_suh, down_svh = rotations
    xp = x.to(torch.float16).repeat_interleave(topk, dim=0)  # row p = token p // top-k
    g = rotate_out(gemm(rotate_in(xp, gate_suh[ids]), gate_w, ids), gate_svh[ids]).float()
    u = rotate_out(gemm(rotate_in(xp, up_suh[ids]), up_w, ids), up_svh[ids]).float()
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    h = (act * u).to(torch.float16)
    y = rotate_out(gemm(rotate_in(h, down_suh[ids]), down_w, ids), down_svh[ids])
    w = (topk_weights.reshape(-1).float() * valid).view(m, topk, 1)
    return (y.float().view(m, topk, y.shape[1]) * w).sum(1)


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
                         topk_ids: torch.Tensor, gelu: bool, gemm: GroupedGemm | None = None) -> torch.Tensor:
    """The layer's experts for many rows: decode every W_hat into the slab, then rotated_forward on the Triton GEMM
    (or `gemm`). fp32 [m, H]."""
    weights = decode_rotated(tiers, slab, inter, hidden)
    gemm = gemm or triton_gemm(x.shape[0], topk_ids.shape[1], tiers.num_experts, inter, hidden)
    return rotated_forward(weights, rotation_tables(tiers), x, topk_weights, tiers.slab_ids(topk_ids), gelu, gemm)
