"""The MoE layer's CUDA paths against the reference codec (GPU with SGLang importable): routed groups and the
rotated slab + SGLang's Triton grouped GEMM, through Exl3MoEMethod's own forwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from moe_reference import codec_moe

from sglang_exl3.format import Codebook

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")

HIDDEN, INTER, EXPERTS, TOPK = 256, 256, 6, 2


@pytest.fixture(autouse=True, scope="module")
def _server_args():
    """SGLang's Triton MoE kernels read the published server config, as inside a server."""
    from sglang_cpu import sglang_runtime

    sglang_runtime(device="cuda")


def _layer(bits_per_expert=(4,) * EXPERTS, shared_h: bool = False):
    """Random experts as the MoE method holds them; `shared_h`: one hidden-side rotation for every expert (gate/up
    suh, down svh), as a rank-sliced shared_h_v1 checkpoint stores them (each expert still gets its own copy)."""
    from sglang_exl3.kernels.backends import Backend
    from sglang_exl3.kernels.dense import prepare
    from sglang_exl3.layers.moe_kernels import build_tiers
    from sglang_exl3.layers.shard import Exl3Shard

    gen = torch.Generator().manual_seed(11)
    experts, cpu = [], []
    for bits in bits_per_expert:
        shards, raw = {}, {}
        for role, (k, n) in (("w1", (HIDDEN, INTER)), ("w3", (HIDDEN, INTER)), ("w2", (INTER, HIDDEN))):
            t = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), generator=gen, dtype=torch.int16)
            s, v = (torch.randn(k, generator=gen) * 0.1).half(), (torch.randn(n, generator=gen) * 0.1).half()
            if shared_h and experts:  # expert 0's hidden-side rotation
                s, v = (s, experts[0][role].svh.cpu()) if role == "w2" else (experts[0][role].suh.cpu(), v)
            raw[role] = (t, s, v)
            shards[role] = Exl3Shard(key=role, trellis=prepare(t.cuda()), suh=s.cuda(), svh=v.cuda(),
                                     codebook=Codebook.MCG, out_features=n, kernel_layout=True)
        experts.append(shards)
        cpu.append(raw)
    layer = SimpleNamespace(exl3_experts=experts, intermediate_size_per_partition=INTER, hidden_size=HIDDEN,
                            exl3_backend=int(Backend.CUDA))
    layer.exl3_tiers = build_tiers(experts, Backend.CUDA)
    return layer, cpu


def _method(layer):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from sglang_exl3.layers.moe import Exl3MoEMethod

    method = Exl3MoEMethod({}, "test.experts")
    method.moe_runner_config = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN,
                                               intermediate_size_per_partition=INTER, top_k=TOPK,
                                               params_dtype=torch.float16)
    method._reserve_slab(layer, torch.device("cuda"))
    return method


def _reference(cpu, x, ids, w):
    """The codec's forward over the experts as _layer drew them."""
    return codec_moe(x, ids, w, [(c["w1"], c["w3"], c["w2"]) for c in cpu], Codebook.MCG)


@pytest.mark.parametrize("m", [3, 300])
@pytest.mark.parametrize("bits, shared_h", [((4,) * EXPERTS, False), ((3, 4, 3, 5, 4, 3), False),
                                            ((3,) * EXPERTS, True)], ids=["uniform", "mixed", "shared-h-3bit"])
def test_routed_and_capturable_paths_match_the_codec(m, bits, shared_h):
    """The routed forward (tier by tier when bitrates are mixed) and the plan's own choice (routed at 3 rows, the
    rotated slab at 300), each against the codec's forward (tests/moe_reference.py codec_moe: every expert through
    exl3_linear_reference, independent of our kernels). shared-h-3bit: the data layout of the rank-sliced fixture
    whose server returned NaN on the H200 (MCG 3 bits, shared hidden-side rotations)."""
    from sglang_exl3.layers.moe_kernels import routed_forward

    layer, cpu = _layer(bits, shared_h)
    assert len(layer.exl3_tiers.tiers) == len(set(bits))
    method = _method(layer)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, HIDDEN, generator=gen).half()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, TOPK, generator=gen)
    ref = _reference(cpu, x, ids, w)
    xc, idc, wc = x.cuda(), ids.cuda(), w.cuda()
    routed = routed_forward(layer.exl3_tiers, xc, wc, idc, False)
    chosen = method._capturable(layer, xc, wc, idc)
    for name, y in (("routed", routed), ("capturable", chosen)):
        assert not torch.isnan(y).any(), name
        assert float((y.cpu() - ref).norm() / ref.norm()) < 5e-3, name


@pytest.mark.parametrize("m", [3, 40])
def test_rotation_forms_give_the_same_routed_output(m):
    """The routed forward (per-source rotations over routing tables whose unrouted experts are empty sources) with
    each rotation form pinned: the same bits."""
    from sglang_exl3.kernels import dense
    from sglang_exl3.layers.moe_kernels import routed_forward

    layer, _ = _layer((4,) * EXPERTS, False)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, HIDDEN, generator=gen).half().cuda()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(m)]).to(torch.int32).cuda()
    w = torch.rand(m, TOPK, generator=gen).cuda()
    with dense.pinned_had_form("warp"):
        want = routed_forward(layer.exl3_tiers, x, w, ids, False)
    with dense.pinned_had_form("octet"):
        got = routed_forward(layer.exl3_tiers, x, w, ids, False)
    assert not torch.isnan(got).any() and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("x_dtype, ids_dtype, gelu", [(torch.bfloat16, torch.int32, False),
                                                       (torch.float16, torch.int64, True)])
def test_slab_glue_kernels_match_the_torch_glue(x_dtype, ids_dtype, gelu):
    """The rotated slab's three glue launches (kernels/moe_ops.py slab_*) against the torch glue on fresh random
    inputs, unrouted pairs included: the rotations bit for bit, the activation and the fp32 top-k sum within a
    rounding (expf / FMA)."""
    from sglang_exl3.layers.moe_rotated import TORCH_GLUE, cuda_glue

    gen = torch.Generator().manual_seed(5)
    tokens, topk, experts, k, n, h = 37, 3, 5, 384, 256, 384
    cuda, ref = cuda_glue(), TORCH_GLUE
    table = [(torch.randn(experts, width, generator=gen) * 0.5).half().cuda() for width in (k, k, n, n, n, h)]
    gate_suh, up_suh, gate_svh, up_svh, down_suh, down_svh = table
    ids = torch.randint(0, experts, (tokens * topk,), generator=gen).to(ids_dtype)
    ids[torch.randperm(ids.numel(), generator=gen)[:7]] = -1
    ids = ids.cuda()
    x = torch.randn(tokens, k, generator=gen).to(x_dtype).cuda()
    a = cuda.rotate_in(x, ids, topk, gate_suh, up_suh)
    assert torch.equal(a, ref.rotate_in(x, ids, topk, gate_suh, up_suh))
    c = (torch.randn(2 * ids.numel(), n, generator=gen) * 4).half().cuda()
    got, want = cuda.mid(c, ids, gate_svh, up_svh, down_suh, gelu), ref.mid(c, ids, gate_svh, up_svh, down_suh, gelu)
    assert (got.float() - want.float()).abs().max() <= 2e-3 * want.float().abs().max()
    assert torch.equal(got[ids < 0], torch.zeros_like(got[ids < 0]))
    y = (torch.randn(ids.numel(), h, generator=gen) * 4).half().cuda()
    w = torch.rand(ids.numel(), generator=gen).cuda()
    got, want = cuda.tail(y, ids, w, down_svh, topk), ref.tail(y, ids, w, down_svh, topk)
    assert got.shape == (tokens, h) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [3, 300])
@pytest.mark.parametrize("bits, shared_h", [((4,) * EXPERTS, False), ((3, 4, 3, 5, 4, 3), False),
                                            ((3,) * EXPERTS, True)], ids=["uniform", "mixed", "shared-h-3bit"])
def test_rotated_slab_matches_the_codec(m, bits, shared_h):
    """The rotated-basis forward for long prefills (layers/moe_rotated.py: W_hat decoded once into the slab, SGLang's
    Triton grouped GEMM between our per-pair rotation kernels), with the Triton kernel or its torch stand-in and our
    glue or the torch glue, against the codec; mixed bitrates decode tier by tier into slab order."""
    from sglang_exl3.layers.moe_rotated import TORCH_GLUE, reference_gemm, rotated_slab_forward

    layer, cpu = _layer(bits, shared_h)
    _method(layer)
    gen = torch.Generator().manual_seed(m + 1)
    x = torch.randn(m, HIDDEN, generator=gen).half()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, TOPK, generator=gen)
    ref = _reference(cpu, x, ids, w)
    for name, gemm, glue in (("triton", None, None), ("torch gemm", reference_gemm, None),
                             ("torch glue", None, TORCH_GLUE)):
        y = rotated_slab_forward(layer.exl3_tiers, layer.exl3_moe_slab, INTER, HIDDEN, x.cuda(), w.cuda(), ids.cuda(),
                                 False, gemm, glue)
        assert torch.isfinite(y).all(), name
        assert float((y.cpu() - ref).norm() / ref.norm()) < 5e-3, name
