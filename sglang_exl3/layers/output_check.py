"""`SGLANG_EXL3_CHECK_OUTPUTS=1`: every EXL3 linear and MoE forward compared with an fp32 reference, in a server.

Why: a served model can go wrong where a layer test cannot reach (real activations, the scheduler's batch shapes,
the paths a plan picks for them). With the knob on, each eager forward is recomputed from the layer's own loaded
weights in fp32 (the decoded trellis, both Hadamard rotations, the routed experts one by one) and a warning names
the layer, the rows, the path and the relative error when the output is non-finite or off by more than
`REL_TOL` (the first forward of each layer is logged whatever its error, so a quiet log shows the check ran).
Slow (host syncs, fp32 matmuls): a debugging aid, never on by default; skipped inside CUDA-graph capture.
"""

from __future__ import annotations

import logging

import torch

from sglang_exl3.codec.hadamard import had_r_128
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.layers.shard import Exl3Shard

logger = logging.getLogger(__name__)

REL_TOL = 2e-2  # fp16 roundings of the served path (activations, rotations) stay far below this
MAX_REPORTS = 20  # warnings per layer


def enabled(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether this forward of `layer` is checked. The knob is read at the layer's first forward and kept on the
    layer (knobs are fixed for a process): every eager forward afterwards pays one attribute lookup, not a parse."""
    on = getattr(layer, "exl3_check_outputs", None)
    if on is None:
        from sglang_exl3 import knobs

        on = layer.exl3_check_outputs = bool(knobs.get("CHECK_OUTPUTS"))
    return on and not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _w_hat(shard: Exl3Shard) -> torch.Tensor:
    """The shard's decoded fp32 W_hat [K, N] (cached on the shard)."""
    cached = getattr(shard, "check_w_hat", None)
    if cached is None:
        if shard.kernel_layout:
            from sglang_exl3.kernels.dense import reconstruct as cuda_reconstruct

            cached = cuda_reconstruct(shard.trellis, shard.codebook).float()
        else:
            cached = reconstruct(shard.trellis, shard.codebook).float()
        shard.check_w_hat = cached
    return cached


def shard_reference(x: torch.Tensor, shard: Exl3Shard) -> torch.Tensor:
    """fp32 [m, out_features]: had(had(x * suh) @ W_hat) * svh, x zero-padded to the packed K."""
    w_hat = _w_hat(shard)
    x = x.float()
    if x.shape[-1] < w_hat.shape[0]:
        x = torch.nn.functional.pad(x, (0, w_hat.shape[0] - x.shape[-1]))
    acc = had_r_128(x, pre_scale=shard.suh.float()) @ w_hat
    return had_r_128(acc, post_scale=shard.svh.float())[:, : shard.out_features]


def moe_reference(x: torch.Tensor, experts: list[dict[str, Exl3Shard]], topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, gelu: bool) -> torch.Tensor:
    """fp32 [m, H]: each routed local expert (ids < 0 belong to another rank) on its rows, weighted."""
    x = x.float()
    out = torch.zeros(x.shape[0], experts[0]["w2"].out_features, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate = shard_reference(x[rows], experts[e]["w1"])
        up = shard_reference(x[rows], experts[e]["w3"])
        act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
        y = shard_reference(act * up, experts[e]["w2"])
        out.index_add_(0, rows, topk_weights[rows, slot].float()[:, None] * y)
    return out


def report(layer: torch.nn.Module, where: str, path: str, x: torch.Tensor, got: torch.Tensor,
           want: torch.Tensor) -> None:
    """Log the comparison when it fails (and once per layer regardless)."""
    got, want = got.float(), want.float()
    finite = bool(torch.isfinite(got).all())
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30)) if finite else float("nan")
    count = getattr(layer, "exl3_check_reports", 0)
    bad = not finite or not rel <= REL_TOL
    if (bad and count < MAX_REPORTS) or count == 0:
        layer.exl3_check_reports = count + 1
        worst = (got - want).abs().amax(-1)
        worst = torch.where(torch.isfinite(worst), worst, torch.full_like(worst, float("inf")))
        row = int(worst.argmax())
        log = logger.warning if bad else logger.info
        log("EXL3 output check %s %s: %s rows=%d path=%s rel=%.3g finite=%s max|x|=%.3g max|y|=%.3g "
            "max|ref|=%.3g worst row %d (|x| %.3g, err %.3g)", "FAILED" if bad else "ok", where,
            tuple(x.shape), x.shape[0], path, rel, finite, float(x.float().abs().max()),
            float(got.abs().nan_to_num(posinf=float("inf")).max()), float(want.abs().max()), row,
            float(x[row].float().abs().max()), float(worst[row]))
