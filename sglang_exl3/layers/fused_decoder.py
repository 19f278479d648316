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
`FusedOps` / `OneRowOps` are the kernels, `ReferenceOps` / `OneRowReferenceOps` the same steps in torch (any
device), which the tests compare against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang_exl3 import knobs
from sglang_exl3.codec.hadamard import had_r_128
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.kernels.backends import Backend
from sglang_exl3.kernels.fused_layer import (
    torch_act_mul,
    torch_add_norm,
    torch_add_norm_rotate,
    torch_mlp_mid,
    torch_output_rotation,
)
from sglang_exl3.layers.shard import Exl3Shard

logger = logging.getLogger(__name__)

# (attribute path, sources) of the four projections a plan fuses
PROJECTIONS = (("self_attn.qkv_proj", 3), ("self_attn.o_proj", 1), ("mlp.gate_up_proj", 2), ("mlp.down_proj", 1))


@dataclass(frozen=True)
class FusedProjection:
    """One projection of a fused layer: its SGLang module, its shards, and its group on our kernels (None: the
    torch reference)."""

    module: torch.nn.Module
    shards: tuple[Exl3Shard, ...]
    group: object | None = None

    @property
    def current(self) -> bool:
        """Still the shards the module serves (a weight reload replaces them, and the plan with them)."""
        held = getattr(self.module, "exl3_shards", None)
        return held is not None and len(held) == len(self.shards) and all(
            a is b for a, b in zip(held, self.shards, strict=True))


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
                from sglang_exl3.kernels.cuda_trellis import make_group

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


class FusedOps:
    """The fused layer's steps on our kernels (kernels/fused_layer.py); a partial is a group's fp32 split-K
    partials."""

    @staticmethod
    def norm_rotate(dst: FusedProjection, norm, h=None, residual=None, h_of=None, partial=None, m=None):
        from sglang_exl3.kernels.fused_layer import add_norm_rotate

        return add_norm_rotate(dst.group, norm.weight, norm.variance_epsilon, h=h, residual=residual,
                               h_group=None if h_of is None else h_of.group, partial=partial, m=m)

    @staticmethod
    def partials(p: FusedProjection, x=None, xh=None):
        from sglang_exl3.kernels.fused_layer import group_partials

        return group_partials(p.group, x=x, xh=xh)

    @staticmethod
    def from_rotated(p: FusedProjection, xh, dtype):
        from sglang_exl3.kernels.fused_layer import group_from_rotated

        return group_from_rotated(p.group, xh, dtype)

    @staticmethod
    def mid(partial, gate_up: FusedProjection, down: FusedProjection, m: int):
        from sglang_exl3.kernels.fused_layer import mlp_mid

        return mlp_mid(partial, gate_up.group, down.group, m)


def _w_hat(shard: Exl3Shard) -> torch.Tensor:
    if shard.w_hat is not None:
        return shard.w_hat
    trellis = shard.trellis.transpose(0, 1).contiguous() if shard.kernel_layout else shard.trellis
    return reconstruct(trellis, shard.codebook)


class ReferenceOps:
    """The same steps in torch with the same roundings; a partial is the fp32 accumulator [m, sum N]."""

    @staticmethod
    def norm_rotate(dst: FusedProjection, norm, h=None, residual=None, h_of=None, partial=None, m=None):
        if partial is not None:
            h = torch_output_rotation(partial, h_of.shards[0].svh).to(norm.weight.dtype)
        xh, updated = torch_add_norm_rotate(h, residual, norm.weight, norm.variance_epsilon,
                                            [s.suh for s in dst.shards])
        if residual is not None:
            residual.copy_(updated)
        return xh

    @staticmethod
    def partials(p: FusedProjection, x=None, xh=None):
        if xh is None:
            xh = torch.stack([had_r_128(x.to(torch.float16), pre_scale=s.suh) for s in p.shards])
        return torch.cat([xh[i].float() @ _w_hat(s).float() for i, s in enumerate(p.shards)], dim=-1)

    @staticmethod
    def from_rotated(p: FusedProjection, xh, dtype):
        acc = ReferenceOps.partials(p, xh=xh)
        outs, at = [], 0
        for s in p.shards:
            outs.append(torch_output_rotation(acc[:, at:at + s.out_features], s.svh))
            at += s.out_features
        return torch.cat(outs, dim=-1).to(dtype)

    @staticmethod
    def mid(partial, gate_up: FusedProjection, down: FusedProjection, m: int):
        gate, up = gate_up.shards
        n = gate.out_features
        return torch_mlp_mid(partial[:, :n], partial[:, n:], gate.svh, up.svh, down.shards[0].suh).unsqueeze(0)


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


class OneRowOps:
    """The one-row forward's steps on our kernels: the one-launch linears, two with the glue as their prologue."""

    @staticmethod
    def norm_linear(p: FusedProjection, norm, h, residual, residual_out):
        from sglang_exl3.kernels.fused_layer import X_ADD_NORM, one_launch_prologue

        one = p.module.exl3_one_launch
        return one_launch_prologue(h, one.group, one.counters, X_ADD_NORM, residual=residual,
                                   residual_out=residual_out, weight=norm.weight, eps=norm.variance_epsilon)

    @staticmethod
    def linear(p: FusedProjection, x):
        from sglang_exl3.kernels.cuda_trellis import one_launch_linear

        one = p.module.exl3_one_launch
        return one_launch_linear(x, one.group, one.counters)

    @staticmethod
    def act_linear(p: FusedProjection, gate_up):
        from sglang_exl3.kernels.fused_layer import X_ACT_MUL, one_launch_prologue

        one = p.module.exl3_one_launch
        return one_launch_prologue(gate_up, one.group, one.counters, X_ACT_MUL)


class OneRowReferenceOps:
    """The same steps in torch, with the unfused path's roundings (the linears through ReferenceOps)."""

    @staticmethod
    def linear(p: FusedProjection, x):
        xh = torch.stack([had_r_128(x.to(torch.float16), pre_scale=s.suh) for s in p.shards])
        return ReferenceOps.from_rotated(p, xh, x.dtype)

    @staticmethod
    def norm_linear(p: FusedProjection, norm, h, residual, residual_out):
        normed, updated = torch_add_norm(h, residual, norm.weight, norm.variance_epsilon)
        if residual_out is not None:
            residual_out.copy_(updated)
        return OneRowReferenceOps.linear(p, normed)

    @staticmethod
    def act_linear(p: FusedProjection, gate_up):
        return OneRowReferenceOps.linear(p, torch_act_mul(gate_up))


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
