"""The rotated-basis MoE forward (layers/moe_rotated.py) on the CPU: W_hat views in fused_experts' strided [E, N, K]
layout (gate and up as 2E experts of one GEMM), the torch glue (the arithmetic of the slab_* kernels) and the grouped
GEMM's torch stand-in; against the codec."""

from __future__ import annotations

import pytest
import torch
from moe_reference import codec_moe

from sglang_exl3.codec import reconstruct
from sglang_exl3.format import Codebook
from sglang_exl3.layers.moe_rotated import TORCH_GLUE, reference_gemm, rotated_forward


def _experts(n_exp: int, hidden: int, inter: int, bits: int, gen: torch.Generator):
    out = []
    for _ in range(n_exp):
        out.append([(torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), generator=gen, dtype=torch.int16),
                     (torch.randn(k, generator=gen) * 0.1).half(), (torch.randn(n, generator=gen) * 0.1).half())
                    for k, n in ((hidden, inter), (hidden, inter), (inter, hidden))])
    return out


def _slab(experts, hidden: int, inter: int, cb: Codebook):
    """W_hat views and rotation tables as decode_rotated and tier_rotations give them."""
    n_exp = len(experts)
    w_hat = [torch.cat([reconstruct(e[role][0], cb) for e in experts], dim=1) for role in range(3)]  # [K, E*N]
    gate_up = torch.cat(w_hat[:2], dim=1)  # gate experts, then up experts
    weights = (gate_up.view(hidden, 2 * n_exp, inter).permute(1, 2, 0),
               w_hat[2].view(inter, n_exp, hidden).permute(1, 2, 0))
    return weights, tuple(torch.stack([e[role][i] for e in experts]) for role in range(3) for i in (1, 2))


@pytest.mark.parametrize("tokens, topk, gelu", [(3, 2, False), (11, 3, True)])
def test_rotated_forward_equals_the_codec(tokens, topk, gelu):
    hidden, inter, n_exp, cb = 256, 128, 5, Codebook.MCG
    gen = torch.Generator().manual_seed(tokens)
    experts = _experts(n_exp, hidden, inter, 3, gen)
    weights, rotations = _slab(experts, hidden, inter, cb)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
    ids[0, -1] = -1  # another expert-parallel rank's expert: weight 0
    w = torch.rand(tokens, topk, generator=gen)
    got = rotated_forward(weights, rotations, x, w, ids, gelu, reference_gemm, TORCH_GLUE)

    want = codec_moe(x, ids, w, experts, cb, gelu)
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 3e-3


def test_reference_gemm_reads_each_pair_s_expert():
    gen = torch.Generator().manual_seed(4)
    b = torch.randn(3, 16, 32, generator=gen).half()
    a = torch.randn(7, 32, generator=gen).half()
    ids = torch.tensor([2, 0, 2, 1, 1, 0, 2])
    got = reference_gemm(a, b, ids)
    want = torch.stack([(a[p].float() @ b[ids[p]].float().t()) for p in range(7)]).half()
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -10, atol=1e-3)


def test_an_unrouted_pair_adds_nothing():
    """A pair routed to another rank (id -1) gives the same bits as the same pair on a real expert with weight 0: its
    rows are zero through both GEMMs and the tail skips it."""
    hidden, inter, n_exp, cb, tokens, topk = 128, 128, 3, Codebook.MCG, 4, 2
    gen = torch.Generator().manual_seed(7)
    weights, rotations = _slab(_experts(n_exp, hidden, inter, 2, gen), hidden, inter, cb)
    x = torch.randn(tokens, hidden, generator=gen).half()
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]], dtype=torch.int32)
    w = torch.rand(tokens, topk, generator=gen)
    zero_weight = w.clone()
    zero_weight[1, 1] = 0.0
    unrouted = ids.clone()
    unrouted[1, 1] = -1
    want = rotated_forward(weights, rotations, x, zero_weight, ids, False, reference_gemm, TORCH_GLUE)
    got = rotated_forward(weights, rotations, x, w, unrouted, False, reference_gemm, TORCH_GLUE)
    assert torch.equal(got, want)
    routed = rotated_forward(weights, rotations, x, w, ids, False, reference_gemm, TORCH_GLUE)
    assert not torch.equal(routed, want)  # the pair's weight matters when it is routed
