"""The fused decoder layer's steps (layers/fused_decoder.py), on our kernels and as their torch references.

`FusedOps` / `ReferenceOps`: the group form (from 2 rows): norms folded into input rotations, the MLP's middle in one
launch; a partial is a group's fp32 split-K partials on the kernels, the fp32 accumulator [m, sum N] in torch.
`OneRowOps` / `OneRowReferenceOps`: the one-row form, the one-launch linears with the glue as their prologues. The
references keep the kernels' roundings, so the GPU tests compare the two within a rounding or two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.codec.hadamard import had_r_128
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.kernels.cuda_trellis import one_launch_linear
from sglang_exl3.kernels.fused_layer import (
    X_ACT_MUL,
    X_ADD_NORM,
    add_norm_rotate,
    group_from_rotated,
    group_partials,
    mlp_mid,
    one_launch_prologue,
    torch_act_mul,
    torch_add_norm,
    torch_add_norm_rotate,
    torch_mlp_mid,
    torch_output_rotation,
)
from sglang_exl3.layers.shard import Exl3Shard


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


class FusedOps:
    """The fused layer's steps on our kernels (kernels/fused_layer.py); a partial is a group's fp32 split-K
    partials."""

    @staticmethod
    def norm_rotate(dst: FusedProjection, norm, h=None, residual=None, h_of=None, partial=None, m=None):
        return add_norm_rotate(dst.group, norm.weight, norm.variance_epsilon, h=h, residual=residual,
                               h_group=None if h_of is None else h_of.group, partial=partial, m=m)

    @staticmethod
    def partials(p: FusedProjection, x=None, xh=None):
        return group_partials(p.group, x=x, xh=xh)

    @staticmethod
    def from_rotated(p: FusedProjection, xh, dtype):
        return group_from_rotated(p.group, xh, dtype)

    @staticmethod
    def mid(partial, gate_up: FusedProjection, down: FusedProjection, m: int):
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


class OneRowOps:
    """The one-row forward's steps on our kernels: the one-launch linears, two with the glue as their prologue."""

    @staticmethod
    def norm_linear(p: FusedProjection, norm, h, residual, residual_out):
        one = p.module.exl3_one_launch
        return one_launch_prologue(h, one.group, one.counters, X_ADD_NORM, residual=residual,
                                   residual_out=residual_out, weight=norm.weight, eps=norm.variance_epsilon)

    @staticmethod
    def linear(p: FusedProjection, x):
        one = p.module.exl3_one_launch
        return one_launch_linear(x, one.group, one.counters)

    @staticmethod
    def act_linear(p: FusedProjection, gate_up):
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
