"""The fused decoder layer's launches (kernels/fused_layer.py) on fresh random inputs (GPU only, torch only): a
group's GEMM from rotated inputs and its partials against group_linear bit for bit, the norm launch against its
torch reference and against itself fed by partials, the MLP's middle against its reference, CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from sglang_exl3.format import Codebook

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_exl3.kernels import cuda_trellis as ck  # noqa: E402
from sglang_exl3.kernels import fused_layer as fl  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def library():
    return ck.load_library(build=True)


def _group(k: int, widths: tuple[int, ...], seed: int, bits: int = 4, cb: Codebook = Codebook.MUL1):
    """A group of random sources on the GPU: (group, suh list, svh list)."""
    gen = torch.Generator().manual_seed(seed)
    tiles, suh, svh = [], [], []
    for n in widths:
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen, dtype=torch.int16)
        tiles.append(ck.prepare(trellis.cuda()))
        suh.append((torch.randn(k, generator=gen) * 0.1).half().cuda())
        svh.append((torch.randn(n, generator=gen) * 0.1).half().cuda())
    return ck.make_group(tiles, suh, svh, cb), suh, svh


def _rows(m: int, n: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).cuda()


def _source_partials(group, partial: torch.Tensor, m: int) -> list[torch.Tensor]:
    """Each source's partials [splits, m, N] as the table lays them out."""
    table = group.table.cpu()
    out = []
    for s in range(group.num):
        packed, base = int(table[s, 3]), int(table[s, 7])
        n, splits = (packed & 0xFFFFFFFF) * 16, packed >> 32
        out.append(partial[base * m: base * m + splits * m * n].view(splits, m, n))
    return out


def _summed(p: torch.Tensor) -> torch.Tensor:
    """The splits summed one at a time, in the kernels' order."""
    acc = p[0].clone()
    for s in range(1, p.shape[0]):
        acc += p[s]
    return acc


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("m", [2, 8, 16, 40, 64])
def test_group_from_rotated_inputs_and_its_partials_equal_group_linear(m):
    """x null (rotated inputs given) and out null (partials only) change nothing else: the same bits as
    group_linear on every path the policy picks for m (global loads, x slice, mma.sync and wgmma rings)."""
    group, suh, svh = _group(1024, (512, 128, 128), seed=m)
    x = _rows(m, 1024, seed=100 + m)
    want = ck.group_linear(x, group)
    xh = torch.stack([ck.had_in(x, s) for s in suh])
    assert _same(fl.group_from_rotated(group, xh), want)
    partials = _source_partials(group, fl.group_partials(group, x=x), m)
    rotated = torch.cat([ck.had_out(p, v, dtype=torch.bfloat16) for p, v in zip(partials, svh, strict=True)], dim=1)
    assert _same(rotated, want)
    assert _same(fl.group_partials(group, xh=xh), fl.group_partials(group, x=x))


@pytest.mark.parametrize("m, cols", [(1, 1024), (5, 4096), (64, 4096), (3, 8192), (2, 16384)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_add_norm_rotate_matches_its_reference(m, cols, with_residual, dtype):
    """Residual add + RMSNorm + every source's input rotation: the residual bit for bit, the rotated inputs within
    the norm's sum order (one row's rrms may differ in its last bit, flipping a few roundings of the model dtype)."""
    dst, suh, _ = _group(cols, (256, 128, 128), seed=cols + m)
    h = _rows(m, cols, seed=m, dtype=dtype)
    residual = _rows(m, cols, seed=m + 1, scale=4.0, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(cols, generator=torch.Generator().manual_seed(5))).to(dtype).cuda()
    want, want_residual = fl.torch_add_norm_rotate(h, residual, weight, 1e-5, suh)
    got_residual = None if residual is None else residual.clone()
    got = fl.add_norm_rotate(dst, weight, 1e-5, h=h, residual=got_residual)
    assert got.shape == want.shape and torch.isfinite(got.float()).all()
    if with_residual:
        assert _same(got_residual, want_residual)
    differ = (got.view(torch.int16) != want.view(torch.int16)).float().mean().item()
    assert differ < 0.02 and (got.float() - want.float()).norm() / want.float().norm() < 1e-3, differ


@pytest.mark.parametrize("m", [2, 16, 64])
def test_add_norm_rotate_from_partials_equals_it_from_the_rotated_output(m):
    """Fed by the o projection's partials, the norm launch gives what it gives on o's own bf16 output."""
    o, _, _ = _group(512, (1024,), seed=7)
    dst, _, _ = _group(1024, (512, 512), seed=8)
    x = _rows(m, 512, seed=m)
    weight = (1 + 0.1 * torch.randn(1024, generator=torch.Generator().manual_seed(6))).bfloat16().cuda()
    residual = _rows(m, 1024, seed=m + 2)
    want_residual = residual.clone()
    want = fl.add_norm_rotate(dst, weight, 1e-6, h=ck.group_linear(x, o), residual=want_residual)
    got = fl.add_norm_rotate(dst, weight, 1e-6, residual=residual, h_group=o, partial=fl.group_partials(o, x=x), m=m)
    assert _same(got, want) and _same(residual, want_residual)


@pytest.mark.parametrize("m", [2, 16, 64])
def test_mlp_mid_matches_its_reference(m):
    """gate/up's output rotations + SiLU-and-mul + down's input rotation against the torch steps on the same partial
    sums (torch's SiLU against the kernel's expf: a few fp16 roundings apart)."""
    gate_up, _, svh = _group(512, (1024, 1024), seed=m)
    down, suh, _ = _group(1024, (512,), seed=m + 1)
    x = _rows(m, 512, seed=m)
    partial = fl.group_partials(gate_up, x=x)
    got = fl.mlp_mid(partial, gate_up, down, m)
    gate, up = (_summed(p) for p in _source_partials(gate_up, partial, m))
    want = fl.torch_mlp_mid(gate, up, svh[0], svh[1], suh[0]).unsqueeze(0)
    differ = (got.view(torch.int16) != want.view(torch.int16)).float().mean().item()
    assert got.shape == want.shape and differ < 0.05
    assert (got.float() - want.float()).norm() / want.float().norm() < 1e-3


def test_fused_steps_capture_in_a_cuda_graph():
    """The norm (its 64 KB row needs the shared-memory attribute, set during capture), partials and the MLP's middle
    replay with fresh inputs as they ran eagerly."""
    m, cols, inter = 8, 16384, 1024
    gate_up, _, _ = _group(cols, (inter, inter), seed=1)
    down, _, _ = _group(inter, (cols,), seed=2)
    weight = torch.ones(cols, dtype=torch.bfloat16, device="cuda")
    h, residual = _rows(m, cols, seed=3), _rows(m, cols, seed=4)

    def steps():
        xh = fl.add_norm_rotate(gate_up, weight, 1e-6, h=h, residual=residual)
        return fl.mlp_mid(fl.group_partials(gate_up, xh=xh), gate_up, down, m)

    start = residual.clone()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        steps()  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    residual.copy_(start)
    with torch.cuda.graph(graph):
        out = steps()
    for seed in (10, 11):
        h.copy_(_rows(m, cols, seed=seed))
        fresh = _rows(m, cols, seed=seed + 1)
        residual.copy_(fresh)
        graph.replay()
        graphed, graphed_residual = out.clone(), residual.clone()
        residual.copy_(fresh)
        assert _same(steps(), graphed) and _same(residual, graphed_residual)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_launch_prologues_match_the_linear_on_torch_formed_rows(m, dtype):
    """The one-launch linear forming x in its prologue against the same launch on x formed in torch: the new
    residual bit for bit; the output within a flipped rounding or two (the norm's sum order, SiLU's exp)."""
    k, inter = 1024, 512
    qkv, _, _ = _group(k, (512, 256, 256), seed=m)
    down, _, _ = _group(inter, (k,), seed=m + 1)
    qkv_one, down_one = _one_launch(qkv), _one_launch(down)
    h, residual = _rows(m, k, seed=m, dtype=dtype), _rows(m, k, seed=m + 2, scale=4.0, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(9))).to(dtype).cuda()
    for res in (residual, None):
        out_residual = torch.full_like(h, float("nan"))
        got = fl.one_launch_prologue(h, qkv_one.group, qkv_one.counters, fl.X_ADD_NORM, residual=res,
                                     residual_out=out_residual if res is not None else None, weight=weight, eps=1e-5)
        normed, updated = fl.torch_add_norm(h, res, weight, 1e-5)
        want = ck.one_launch_linear(normed, qkv_one.group, qkv_one.counters)
        assert torch.isfinite(got.float()).all() and _rel(got, want) < 2e-3
        if res is not None:
            assert _same(out_residual, updated)
    gate_up = _rows(m, 2 * inter, seed=m + 3, dtype=dtype)
    got = fl.one_launch_prologue(gate_up, down_one.group, down_one.counters, fl.X_ACT_MUL)
    want = ck.one_launch_linear(fl.torch_act_mul(gate_up), down_one.group, down_one.counters)
    assert torch.isfinite(got.float()).all() and _rel(got, want) < 2e-3
    assert not qkv_one.counters.any() and not down_one.counters.any()  # left zero for the next call


def _one_launch(group) -> ck.Exl3OneLaunch:
    """The group's sources at one-launch splits (whole 128-blocks per split), with its counters."""
    tiles, suh, svh = (list(t) for t in group.sources)
    return ck.make_one_launch(tiles, suh, svh, Codebook(group.codebook))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
