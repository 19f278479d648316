"""Oracles for the MoE tests: the codec's MoE forward (EXL3 experts) and the same forward on a dequantized twin's
FusedMoE weights."""

from __future__ import annotations

import torch

from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.codec.trellis import reconstruct
from sglang_exl3.format import Codebook


def _activation(gelu: bool):
    return (lambda g: torch.nn.functional.gelu(g, approximate="tanh")) if gelu else torch.nn.functional.silu


def codec_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts, codebook: Codebook,
              gelu: bool = False) -> torch.Tensor:
    """fp32 [tokens, H] = sum over j of w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, j] (ids below 0:
    another expert-parallel rank's expert, skipped), through the reference codec with x rounded to fp16 as the layer
    does; experts[e] = (gate, up, down), each (trellis, suh, svh) on the CPU. Each W_hat is decoded once (decoding per
    token made the larger cases take minutes)."""
    act, w_hat = _activation(gelu), {}

    def linear(inp, e, role):
        t, s, v = experts[e][role]
        if (e, role) not in w_hat:
            w_hat[e, role] = reconstruct(t, codebook)
        return exl3_linear_reference(inp, t, s, v, codebook, w_hat=w_hat[e, role]).float()

    out = torch.zeros(x.shape[0], experts[0][2][2].numel())
    for t in range(x.shape[0]):
        xt = x[t:t + 1].half()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = (act(linear(xt, e, 0)) * linear(xt, e, 1)).half()
            out[t] += float(weights[t, j]) * linear(h, e, 2)[0]
    return out


def twin_moe(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """fp32 [tokens, H] from a dequantized twin's FusedMoE (unscaled): w13_weight [E, 2I, H] (gate rows, then up),
    w2_weight [E, H, I]."""
    w13, w2 = experts.w13_weight.float(), experts.w2_weight.float()
    inter, act = w2.shape[2], _activation(gelu)
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    xf = x.float()
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero(as_tuple=True)[0]
            gate_up = xf[rows] @ w13[e].T
            hidden = act(gate_up[:, :inter]) * gate_up[:, inter:]
            out[rows] += weights[rows, j, None].float() * (hidden @ w2[e].T)
    return out
