"""A dense decoder layer's EXL3 glue in fewer launches (our CUDA kernels), and its torch reference.

Around each group GEMM the unfused layer launches an input rotation, an output rotation and SGLang's elementwise
kernels: residual add + RMSNorm before q/k/v and before gate/up, SiLU-and-mul before down. Each rotation is local to
its 128 columns, so these fold together:
- `add_norm_rotate`: residual add + RMSNorm + the next group's input rotation, one launch (the norm's output is
  written only in its rotated forms); it can start from a one-source group's partials (the o projection), whose
  output rotation it then does too.
- `group_partials` / `group_from_rotated`: a group's GEMM from already-rotated inputs, with or without its output
  rotation (exl3_group_linear with x or out null).
- `mlp_mid`: gate/up's output rotation + act(gate) * up + down's input rotation, one launch (MoE's moe_mid).
A Llama layer then takes 10 launches around its attention instead of 15 (layers/fused_decoder.py). At the rows
the one-launch linears serve (1 by default) the norms and SiLU-and-mul ride on each block's staging of its x slice
instead (`one_launch_prologue`): 4 launches around the attention instead of 8. The values are
the unfused path's up to the order of the norm's sum of squares and the MLP's roundings (fp16 where SGLang's
SiLU-and-mul rounds to bf16), so its test is parity with the reference below, not bit equality.
"""

from __future__ import annotations

import torch

from sglang_exl3.codec.hadamard import had_r_128
from sglang_exl3.kernels.cuda_trellis import (
    Exl3Group,
    _check,
    _check_act,
    _check_fp16,
    _stream,
    group_launch,
    load_library,
    one_launch_scratch,
    one_launch_warps,
)


def _launch_group(group: Exl3Group, m: int, xh: torch.Tensor, x: torch.Tensor | None,
                  out: torch.Tensor | None) -> torch.Tensor:
    """cuda_trellis.group_launch at the group's policy for m rows (ring, x slice or global loads); x None: xh holds
    the rotated inputs already; out None: no output rotation. Returns the fp32 partials."""
    if not group.runs_fused(m):
        raise ValueError(f"this EXL3 group does not run {m} rows on its fused GEMM (Exl3Group.runs_fused)")
    ring = group.ring_mode(m)
    return group_launch(xh, group.table, group.num, m, group.k_tiles, group.total_items, group.total_cols,
                        group.partial_per_row, group.k2, group.codebook, 0 if ring else group.xs_slice(m), ring, x=x,
                        out=out)


def _rotated_inputs(group: Exl3Group, m: int, device: torch.device) -> torch.Tensor:
    return torch.empty(group.num, m, group.k_tiles * 16, dtype=torch.float16, device=device)


def group_partials(group: Exl3Group, x: torch.Tensor | None = None, xh: torch.Tensor | None = None) -> torch.Tensor:
    """The group's fp32 split-K partials for bf16 / fp16 x [m, K] (input rotation + GEMM), or for its rotated
    inputs xh [num, m, K] (GEMM only): what add_norm_rotate and mlp_mid read."""
    if (x is None) == (xh is None):
        raise ValueError("group_partials takes x or its rotated inputs xh, not both")
    m = x.shape[0] if x is not None else xh.shape[1]
    if x is not None:
        _check_rows("x", x, m, group.k_tiles * 16)
        xh = _rotated_inputs(group, m, x.device)
    else:
        _check_xh(xh, group, m)
    return _launch_group(group, m, xh, x, None)


def group_from_rotated(group: Exl3Group, xh: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[m, total_cols] of `dtype` (fp16, or bf16 rounded from it) from the group's rotated inputs xh [num, m, K]:
    the GEMM and the output rotation, two launches."""
    m = xh.shape[1]
    _check_xh(xh, group, m)
    out = torch.empty(m, group.total_cols, dtype=dtype, device=xh.device)
    _launch_group(group, m, xh, None, out)
    return out


def add_norm_rotate(dst: Exl3Group, weight: torch.Tensor, eps: float, h: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, h_group: Exl3Group | None = None,
                    partial: torch.Tensor | None = None, m: int | None = None) -> torch.Tensor:
    """dst's rotated inputs fp16 [num, m, K] from rmsnorm(h + residual) * weight rounded to the model's dtype (that
    of `weight`: bf16 or fp16), one launch. h: [m, K]; or `partial` of the one-source group `h_group`
    (group_partials), h being that group's output. residual: [m, K], updated in place to h + residual (None: x = h,
    SGLang's first layer). `m`: rows, with partial."""
    if (h is None) == (partial is None) or (partial is not None and (h_group is None or h_group.num != 1 or m is None)):
        raise ValueError("add_norm_rotate takes h, or the partials of a one-source h_group with m")
    cols, dtype = dst.k_tiles * 16, weight.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"add_norm_rotate: the norm weight must be fp16 or bf16, got {dtype}")
    if h is not None:
        m = h.shape[0]
        _check_rows("h", h, m, cols, dtype)
    elif h_group.total_cols != cols or partial.numel() != h_group.partial_per_row * m:
        raise ValueError(f"add_norm_rotate: h_group writes {h_group.total_cols} columns with "
                         f"{h_group.partial_per_row * m} partials for {m} rows; dst reads {cols} columns, got "
                         f"{partial.numel()} partials")
    if residual is not None:
        _check_rows("residual", residual, m, cols, dtype)
    _check_rows("weight", weight.view(1, -1), 1, cols, dtype)
    xh = _rotated_inputs(dst, m, weight.device)
    _check(load_library().exl3_add_norm_rotate(
        None if h is None else h.data_ptr(), None if h_group is None else h_group.table.data_ptr(),
        None if partial is None else partial.data_ptr(), None if residual is None else residual.data_ptr(),
        weight.data_ptr(), int(dtype == torch.bfloat16), float(eps), dst.table.data_ptr(), dst.num, xh.data_ptr(),
        m, cols, _stream(xh)), "add_norm_rotate")
    return xh


def mlp_mid(partial: torch.Tensor, gate_up: Exl3Group, down: Exl3Group, m: int, gelu: bool = False) -> torch.Tensor:
    """down's rotated inputs fp16 [1, m, I] = had_in(act(gate) * up, down's suh) from gate_up's partials (a
    two-source group: gate, then up, each I wide), one launch."""
    inter = down.k_tiles * 16
    if gate_up.num != 2 or down.num != 1 or gate_up.total_cols != 2 * inter or \
            partial.numel() != gate_up.partial_per_row * m:
        raise ValueError(f"mlp_mid needs gate/up as one two-source group of 2 x {inter} columns and down as one "
                         f"source reading {inter}, got {gate_up.num} sources of {gate_up.total_cols} columns, "
                         f"{down.num} down sources, {partial.numel()} partials for {m} rows")
    xh = _rotated_inputs(down, m, partial.device)
    _check(load_library().exl3_mlp_mid(partial.data_ptr(), gate_up.table.data_ptr(), down.table.data_ptr(), m, inter,
                                       xh.data_ptr(), int(gelu), _stream(partial)), "mlp_mid")
    return xh


X_ADD_NORM, X_ACT_MUL = 1, 2  # the one-launch GEMM's x prologues (XPrologue in the library)


def one_launch_prologue(x: torch.Tensor, group: Exl3Group, counters: torch.Tensor, kind: int,
                        residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, eps: float = 0.0, gelu: bool = False,
                        warps: int | None = None, pdl: bool = True) -> torch.Tensor:
    """[m, total_cols] of x's dtype: the one-launch linear (cuda_trellis.one_launch_linear, its group and counters)
    on x formed by a prologue as each block stages its slice, the fused decoder layer at one row. X_ADD_NORM: x [m, K]
    + residual (or x alone), RMSNorm with `weight` and `eps`, rounded to x's dtype; x + residual is written to
    residual_out where given (never in place: every block reads the residual). X_ACT_MUL: x = gate/up's output
    [m, 2K], act(gate) * up rounded to x's dtype (SiLU, or GELU-tanh with gelu)."""
    m, k = x.shape[0], group.k_tiles * 16
    if kind == X_ADD_NORM:
        _check_rows("x", x, m, k)
        for name, t in (("residual", residual), ("residual_out", residual_out)):
            if t is not None:
                _check_rows(name, t, m, k, x.dtype)
        if weight is None:
            raise ValueError("the add-norm prologue needs the norm's weight")
        _check_rows("weight", weight.view(1, -1), 1, k, x.dtype)
    elif kind == X_ACT_MUL:
        _check_rows("x (gate/up's output)", x, m, 2 * k)
    else:
        raise ValueError(f"one_launch_prologue: kind must be X_ADD_NORM or X_ACT_MUL, got {kind}")
    partial, out = one_launch_scratch(x, group, counters, "one_launch_prologue")

    def ptr(t: torch.Tensor | None):
        return None if t is None else t.data_ptr()

    _check(load_library().exl3_linear_decode_prologue(
        x.data_ptr(), int(x.dtype == torch.bfloat16), group.table.data_ptr(), group.num, partial.data_ptr(),
        counters.data_ptr(), counters.numel(), out.data_ptr(), m, group.k_tiles, group.total_items, group.total_cols,
        group.k2, group.codebook, group.max_slice, warps or one_launch_warps(m), int(pdl), kind, ptr(residual),
        ptr(residual_out), ptr(weight), float(eps), int(gelu), _stream(x)), "one-launch linear with a prologue")
    return out


def _check_rows(name: str, t: torch.Tensor, m: int, cols: int, dtype: torch.dtype | None = None) -> None:
    """An activation [m, cols] (cuda_trellis._check_act), of `dtype` where given (the norm's)."""
    _check_act(name, t, (m, cols))
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} like the norm's weight, got {t.dtype}")


def _check_xh(xh: torch.Tensor, group: Exl3Group, m: int) -> None:
    _check_fp16("rotated inputs", xh, (group.num, m, group.k_tiles * 16))


# ---- the torch reference (any device): the same roundings, the kernels' tests compare against it ----------------

def torch_add_norm(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(h + residual) * weight, h + residual or None) in the model's dtype (that of h, residual, weight),
    from the fp32 sum, as SGLang's fused add + RMSNorm rounds them."""
    x = h.float() if residual is None else h.float() + residual.float()
    rrms = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return (x * rrms * weight.float()).to(weight.dtype), None if residual is None else x.to(weight.dtype)


def torch_add_norm_rotate(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                          suh: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rotated inputs fp16 [len(suh), m, K], the updated residual or None) for h, residual [m, K] and the norm's
    weight, all of the model's dtype (bf16 or fp16)."""
    normed, updated = torch_add_norm(h, residual, weight, eps)
    return torch.stack([had_r_128(normed.to(torch.float16), pre_scale=s) for s in suh]), updated


def torch_act_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """act(gate) * up of gate/up's output [m, 2I] in its dtype, as SGLang's SiLU-and-mul rounds it."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    return (act * up).to(gate_up.dtype)


def torch_output_rotation(acc: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """A linear's fp16 output from its fp32 accumulator [m, N] (the sum of its split-K partials)."""
    return had_r_128(acc.float(), post_scale=svh, out_dtype=torch.float16)


def torch_mlp_mid(gate_acc: torch.Tensor, up_acc: torch.Tensor, gate_svh: torch.Tensor, up_svh: torch.Tensor,
                  down_suh: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """down's rotated inputs fp16 [m, I] from gate's and up's fp32 accumulators [m, I]."""
    gate = torch_output_rotation(gate_acc, gate_svh).float()
    up = torch_output_rotation(up_acc, up_svh).float()
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    return had_r_128((act * up).to(torch.float16), pre_scale=down_suh)
