"""SGLang's dense Llama and Qwen2 decoder layers with their EXL3 glue fused (SGLANG_EXL3_FUSED_DECODER,
kernels/fused_layer.py).

Unfused, a layer on the group kernels launches 15 kernels around its attention: RMSNorm, q/k/v (input rotation,
GEMM, output rotation), o (three), RMSNorm, gate/up (three), SiLU-and-mul, down (three). Fused it launches 10:
residual add + RMSNorm + q/k/v's input rotation; q/k/v's GEMM and output rotation; o's input rotation and GEMM;
o's output rotation + residual add + RMSNorm + gate/up's input rotation; gate/up's GEMM; its output rotation +
SiLU-and-mul + down's input rotation; down's GEMM and output rotation.

At the rows the one-launch linears serve (1 by default) a layer already launches only 8 kernels around its
attention; there `one_row_forward` folds the norms into q/k/v's and gate/up's one launch and SiLU-and-mul into
down's (each block forms its x slice before rotating it): 4.

A plan is attached to each eligible layer once the weights are loaded (`attach_plans`); `fusion_blockers` names
what keeps a layer unfused. `route` picks the forward per call: the one-row form where every projection's one-launch
form serves the rows, the fused form where every group runs them on its fused GEMM, and SGLang's own forward
otherwise and whenever something is being compiled (SGLang's piecewise prefill graphs trace the unfused forward).
The steps' kernels and their torch references (any device), which the tests compare against, are in
`fused_decoder_ops.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang_exl3 import knobs
from sglang_exl3.kernels.backends import Backend
from sglang_exl3.kernels.cuda_trellis import make_group
from sglang_exl3.layers.fused_decoder_ops import (
    FusedOps,
    FusedProjection,
    OneRowOps,
    OneRowReferenceOps,
    ReferenceOps,
)
from sglang_exl3.layers.shard import Exl3Shard

logger = logging.getLogger(__name__)

# (attribute path, sources) of the four projections a plan fuses
PROJECTIONS = (("self_attn.qkv_proj", 3), ("self_attn.o_proj", 1), ("mlp.gate_up_proj", 2), ("mlp.down_proj", 1))


@dataclass(frozen=True)
class FusedDecoderPlan:
    qkv: FusedProjection
    o: FusedProjection
    gate_up: FusedProjection
    down: FusedProjection

    @property
    def projections(self) -> tuple[FusedProjection, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def serves_one_row(self, m: int) -> bool:
        """Whether m rows run as the one-launch linears with the glue in their prologues: every projection's
        one-launch form serves m as one launch."""
        ones = [getattr(p.module, "exl3_one_launch", None) for p in self.projections]
        return all(o is not None and o.serves(m) and not o.rotates_first(m) for o in ones)

    def serves(self, m: int) -> bool:
        """Whether m rows run fused: no projection would take its one-launch form, every group runs them fused."""
        for p in self.projections:
            one = getattr(p.module, "exl3_one_launch", None)
            if one is not None and one.serves(m):
                return False
            if p.group is not None and not p.group.runs_fused(m):
                return False
        return m > 0


def _module(layer: torch.nn.Module, path: str):
    for name in path.split("."):
        layer = getattr(layer, name, None)
    return layer


def _plain_rms_norm(norm) -> bool:
    from sglang.srt.layers.layernorm import RMSNorm

    return (type(norm) is RMSNorm and norm.has_weight and not norm.cast_x_before_out_mul and not norm.fp32_residual
            and norm.variance_size_override is None and norm.weight.dtype in (torch.bfloat16, torch.float16))


def _share_launches(shards, need_kernels: bool) -> bool:
    """The same K, bits and codebook, every output untrimmed and whole 128-blocks (and in our kernels' layout)."""
    first = shards[0]

    def width(s: Exl3Shard) -> int:
        return s.trellis.shape[0 if s.kernel_layout else 1] * 16

    return all((s.launch_ready or not need_kernels) and width(s) == s.out_features and width(s) % 128 == 0 and
               s.in_features == first.in_features and s.trellis.shape[2] == first.trellis.shape[2] and
               s.codebook == first.codebook for s in shards)


def layer_classes() -> dict[type, tuple[type, type]]:
    """SGLang's decoder layers the fused forward reproduces, with the attention and MLP classes each must hold (the
    same forward: norms, q/k/v, RoPE, attention, o, norm, gate/up, SiLU-and-mul, down; Qwen2 adds q/k/v biases)."""
    from sglang.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from sglang.srt.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2MLP

    return {LlamaDecoderLayer: (LlamaAttention, LlamaMLP), Qwen2DecoderLayer: (Qwen2Attention, Qwen2MLP)}


def fusion_blockers(layer: torch.nn.Module, need_kernels: bool = True) -> list[str]:
    """What keeps `layer` from the fused forward (empty: nothing). need_kernels: its linears must run on our CUDA
    kernels (the reference plan of the tests does not need them)."""
    from sglang.srt.runtime_context import get_exec

    parts = layer_classes().get(type(layer))
    if parts is None or (type(getattr(layer, "self_attn", None)), type(getattr(layer, "mlp", None))) != parts:
        return [f"{type(layer).__name__} is not SGLang's Llama or Qwen2 decoder layer with its own attention and MLP"]
    out = [f"{name} is not a plain fp16 / bf16 RMSNorm" for name in ("input_layernorm", "post_attention_layernorm")
           if not _plain_rms_norm(getattr(layer, name))]
    if knobs.get("CHECK_OUTPUTS"):
        out.append("SGLANG_EXL3_CHECK_OUTPUTS checks each linear's output, which the fused layer never forms")
    if get_exec().deterministic.rl_on_policy_target is not None:
        out.append("SGLang's RL on-policy mode casts the MLP's input, which the fused layer does not")
    for path, sources in PROJECTIONS:
        module = _module(layer, path)
        shards = getattr(module, "exl3_shards", None)
        if shards is None:
            out.append(f"{path} is not an EXL3 linear")
            continue
        on_kernels = getattr(module, "exl3_backend", None) == Backend.CUDA
        if need_kernels and not on_kernels:
            out.append(f"{path} does not run on our CUDA kernels")
        if getattr(module, "bias", None) is not None and path != "self_attn.qkv_proj":  # q/k/v's: added after
            out.append(f"{path} has a bias")
        if getattr(module, "tp_size", 1) != 1:
            out.append(f"{path} is tensor-parallel (o / down's all-reduce sits between the GEMM and the norm)")
        if len(shards) != sources or not _share_launches(shards, need_kernels and on_kernels):
            out.append(f"{path}: {len(shards)} sources that cannot share launches (want {sources})")
    if out:
        return out
    qkv, o, gate_up, down = (_module(layer, p).exl3_shards for p, _ in PROJECTIONS)
    hidden, inter = qkv[0].in_features, gate_up[0].out_features
    if not (o[0].out_features == gate_up[0].in_features == down[0].out_features == hidden and
            gate_up[1].out_features == inter == down[0].in_features):
        out.append(f"widths disagree: hidden {hidden} (o writes {o[0].out_features}, gate/up read "
                   f"{gate_up[0].in_features}, down writes {down[0].out_features}), gate/up write "
                   f"{[s.out_features for s in gate_up]}, down reads {down[0].in_features}")
    return out


def build_plan(layer: torch.nn.Module, reference: bool = False) -> FusedDecoderPlan | None:
    """The layer's plan, or None where `fusion_blockers` names something (logged). reference: no groups, the torch
    reference runs it (tests)."""
    blockers = fusion_blockers(layer, need_kernels=not reference)
    if blockers:
        logger.info("EXL3 fused decoder layer off for %s: %s", type(layer).__name__, "; ".join(blockers))
        return None
    parts = []
    for path, _ in PROJECTIONS:
        module = _module(layer, path)
        shards = tuple(module.exl3_shards)
        group = None
        if not reference:
            group = getattr(module, "exl3_group", None)
            if group is None:  # o and down: a group of their one source
                group = make_group([s.trellis for s in shards], [s.suh for s in shards], [s.svh for s in shards],
                                   shards[0].codebook)
        parts.append(FusedProjection(module, shards, group))
    return FusedDecoderPlan(*parts)


def attach_plans(model: torch.nn.Module) -> int:
    """A plan on every Llama / Qwen2 decoder layer of `model` that can take one (`layer.exl3_fused`); the number
    attached."""
    classes = tuple(layer_classes())
    count = 0
    for module in model.modules():
        if isinstance(module, classes):
            module.exl3_fused = build_plan(module)
            count += module.exl3_fused is not None
    if count:
        logger.info("EXL3 fused decoder layers: %d", count)
    return count


def _attention(layer, qkv: torch.Tensor, positions: torch.Tensor, forward_batch) -> torch.Tensor:
    """q/k/v's bias (as apply_shards adds it), RoPE and the attention, as the layer's attention class runs them."""
    attn, dtype = layer.self_attn, qkv.dtype
    if attn.qkv_proj.bias is not None:
        qkv = (qkv.float() + attn.qkv_proj.bias.float()).to(dtype)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(positions, q, k)
    return attn.attn(q, k, v, forward_batch).reshape(qkv.shape[0], -1).to(dtype).contiguous()


def fused_forward(layer, plan: FusedDecoderPlan, positions: torch.Tensor, hidden_states: torch.Tensor,
                  forward_batch, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's forward (with its attention's and MLP's: `layer_classes`) in the fused launches. The
    residual is updated in place, as SGLang's fused_add_rmsnorm does; with none (the first layer) hidden_states
    becomes it."""
    ops = ReferenceOps if plan.qkv.group is None else FusedOps
    m, dtype = hidden_states.shape[0], hidden_states.dtype
    if residual is None:
        residual = hidden_states
        xh = ops.norm_rotate(plan.qkv, layer.input_layernorm, h=hidden_states)
    else:
        xh = ops.norm_rotate(plan.qkv, layer.input_layernorm, h=hidden_states, residual=residual)
    attn_out = _attention(layer, ops.from_rotated(plan.qkv, xh, dtype), positions, forward_batch)
    xh = ops.norm_rotate(plan.gate_up, layer.post_attention_layernorm, residual=residual, h_of=plan.o,
                         partial=ops.partials(plan.o, x=attn_out), m=m)
    xh = ops.mid(ops.partials(plan.gate_up, xh=xh), plan.gate_up, plan.down, m)
    return ops.from_rotated(plan.down, xh, dtype), residual


def one_row_forward(layer, plan: FusedDecoderPlan, positions: torch.Tensor, hidden_states: torch.Tensor,
                    forward_batch, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's forward at the rows the one-launch linears serve: 4 launches around the attention (q/k/v
    and gate/up with the residual add + RMSNorm as their prologue, o, down with SiLU-and-mul as its prologue) instead
    of 8. Every block reads the residual, so the new one is a new tensor (returned, as SGLang's layers return it),
    not the old one updated in place."""
    ops = OneRowReferenceOps if plan.qkv.group is None else OneRowOps
    first = torch.empty_like(hidden_states) if residual is not None else None
    qkv = ops.norm_linear(plan.qkv, layer.input_layernorm, hidden_states, residual, first)
    residual = first if first is not None else hidden_states
    o = ops.linear(plan.o, _attention(layer, qkv, positions, forward_batch))
    second = torch.empty_like(residual)
    gate_up = ops.norm_linear(plan.gate_up, layer.post_attention_layernorm, o, residual, second)
    return ops.act_linear(plan.down, gate_up), second


def route(plan: FusedDecoderPlan | None, layer, hidden_states: torch.Tensor, residual: torch.Tensor | None):
    """The forward this call takes, fused_forward or one_row_forward, or None for SGLang's own: a current plan that
    serves the rows, rows of the norms' dtype in place, not while torch.compile traces."""
    if plan is None or torch.compiler.is_compiling():
        return None
    dtype = layer.input_layernorm.weight.dtype
    if hidden_states.dim() != 2 or hidden_states.dtype != dtype or not hidden_states.is_contiguous():
        return None
    if residual is not None and (residual.shape != hidden_states.shape or residual.dtype != dtype
                                 or not residual.is_contiguous()):
        return None
    if not all(p.current for p in plan.projections):
        return None
    m = hidden_states.shape[0]
    if plan.serves_one_row(m):
        return one_row_forward
    return fused_forward if plan.serves(m) else None
