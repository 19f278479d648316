"""The rotated-basis MoE forward (layers/moe_rotated.py) on the CPU: W_hat views in fused_experts' strided [E, N, K]
layout, per-pair rotations as fp16 matmuls with H/8, the grouped GEMM by its torch stand-in; against the codec."""

from __future__ import annotations

import pytest
import torch
from moe_reference import codec_moe

from sglang_exl3.codec import had_r_128, reconstruct
from sglang_exl3.format import Codebook
from sglang_exl3.layers.moe_rotated import reference_gemm, rotate, rotated_forward


def test_rotation_is_sqrt2_times_the_normalised_one():
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)).half()
    want = had_r_128(x, out_dtype=torch.float32).double() * 2 ** 0.5
    assert torch.allclose(rotate(x).double(), want, rtol=2 ** -10, atol=1e-4)


def _experts(n_exp: int, hidden: int, inter: int, bits: int, gen: torch.Generator):
    out = []
    for _ in range(n_exp):
        out.append([(torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), generator=gen, dtype=torch.int16),
                     (torch.randn(k, generator=gen) * 0.1).half(), (torch.randn(n, generator=gen) * 0.1).half())
                    for k, n in ((hidden, inter), (hidden, inter), (inter, hidden))])
    return out


@pytest.mark.parametrize("tokens, topk, gelu", [(3, 2, False), (11, 3, True)])
def test_rotated_forward_equals_the_codec(tokens, topk, gelu):
    hidden, inter, n_exp, cb = 256, 128, 5, Codebook.MCG
    gen = torch.Generator().manual_seed(tokens)
    experts = _experts(n_exp, hidden, inter, 3, gen)
    weights, rotations = [], []
    for role in range(3):
        w_hat = torch.cat([reconstruct(e[role][0], cb) for e in experts], dim=1)  # [K, E*N], as decode_rotated
        k, n = w_hat.shape[0], w_hat.shape[1] // n_exp
        weights.append(w_hat.view(k, n_exp, n).permute(1, 2, 0))  # [E, N, K] through strides
        rotations += [torch.stack([e[role][1] for e in experts]), torch.stack([e[role][2] for e in experts])]
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
    ids[0, -1] = -1  # another expert-parallel rank's expert: weight 0
    w = torch.rand(tokens, topk, generator=gen)
    got = rotated_forward(tuple(weights), tuple(rotations), x, w, ids, gelu, reference_gemm)

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
