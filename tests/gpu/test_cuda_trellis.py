"""Our CUDA trellis kernels against the reference codec, on fresh random inputs (GPU only).

Reconstruct and the Hadamard rotations must be bit-identical; GEMMs within fp16 accumulation tolerance,
finite, with every output element written (outputs start as NaN).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_reference import codec_moe

from sglang_exl3.codec import exl3_linear_reference, had_r_128, reconstruct
from sglang_exl3.format import Codebook

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_exl3.kernels import dense, dispatch, groups, library, moe_ops, moe_tables  # noqa: E402

VARIANTS = [(cb, k) for cb in Codebook for k in (1, 2, 3, 4, 5, 6, 7, 8)] + [
    (Codebook.MUL1, 1.5), (Codebook.MUL1, 2.5), (Codebook.MUL1, 3.5)]
IDS = [f"{c.label}-{b}" for c, b in VARIANTS]


@pytest.fixture(scope="module", autouse=True)
def _built_library():
    return library.load_library(build=True)


def _trellis(kt: int, nt: int, bits: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, (kt, nt, int(bits * 16)), generator=gen, dtype=torch.int16)


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=IDS)
def test_reconstruct_bit_exact(cb, bits):
    trellis = _trellis(6, 10, bits, seed=int(bits * 10) + 100 * int(cb))
    ref = reconstruct(trellis, cb)
    tiles = dense.prepare(trellis.cuda())
    ours = dense.reconstruct(tiles, cb).cpu()
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))
    part = torch.full((96, 48), float("nan"), dtype=torch.float16, device="cuda")  # column tiles 3..5
    dense.reconstruct(tiles, cb, (3, 3), out=part)
    assert torch.equal(part.cpu().view(torch.int16), ref[:, 48:96].view(torch.int16))


def test_hadamards_bit_exact():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, 640, generator=gen).half()
    suh = torch.randn(640, generator=gen).half()
    assert torch.equal(dense.had_in(x.cuda(), suh.cuda()).cpu().view(torch.int16),
                       had_r_128(x, pre_scale=suh).view(torch.int16))
    acc = torch.randn(1, 37, 640, generator=gen) * 30
    svh = torch.randn(640, generator=gen).half()
    ref = had_r_128(acc[0], post_scale=svh, out_dtype=torch.float16)
    assert torch.equal(dense.had_out(acc.cuda(), svh.cuda()).cpu().view(torch.int16), ref.view(torch.int16))
    parts = torch.randn(3, 5, 256, generator=gen)
    svh2 = torch.randn(256, generator=gen).half()
    summed = (parts[0] + parts[1]) + parts[2]  # the kernel sums splits in order
    ref = had_r_128(summed, post_scale=svh2, out_dtype=torch.float16)
    assert torch.equal(dense.had_out(parts.cuda(), svh2.cuda()).cpu().view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("form", ["warp", "octet"])
def test_rotation_forms_bit_exact(form):
    """Both forms of every rotation launch give the codec's bits: fp16 and bf16 x; fp32 partials over 1-9 splits
    (the octet form loads two at a time); one fp16 split, also in place; bf16 output. 37 x 5 blocks: the last
    256-thread block of the octet form is part empty."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(37, 640, generator=gen).half()
    suh = torch.randn(640, generator=gen).half()
    svh = torch.randn(640, generator=gen).half()
    with dense.pinned_had_form(form):
        ref = had_r_128(x, pre_scale=suh).view(torch.int16)
        assert torch.equal(dense.had_in(x.cuda(), suh.cuda()).cpu().view(torch.int16), ref)
        xb = x.bfloat16()
        ref = had_r_128(xb.half(), pre_scale=suh).view(torch.int16)
        assert torch.equal(dense.had_in(xb.cuda(), suh.cuda()).cpu().view(torch.int16), ref)
        for splits in (1, 3, 4, 5, 9):
            parts = torch.randn(splits, 37, 640, generator=gen) * 30
            summed = parts[0].clone()
            for s in range(1, splits):
                summed = summed + parts[s]  # the kernels sum splits in order
            ref = had_r_128(summed, post_scale=svh, out_dtype=torch.float16)
            got = dense.had_out(parts.cuda(), svh.cuda())
            assert torch.equal(got.cpu().view(torch.int16), ref.view(torch.int16)), f"splits={splits}"
            got_bf16 = dense.had_out(parts.cuda(), svh.cuda(), dtype=torch.bfloat16).cpu()
            assert torch.equal(got_bf16.view(torch.int16), ref.bfloat16().view(torch.int16)), f"splits={splits}"
        acc = (torch.randn(1, 37, 640, generator=gen) * 30).half()
        ref = had_r_128(acc[0].float(), post_scale=svh, out_dtype=torch.float16).view(torch.int16)
        on_gpu = acc.cuda()
        assert torch.equal(dense.had_out(on_gpu, svh.cuda()).cpu().view(torch.int16), ref)
        dense.had_out(on_gpu, svh.cuda(), out=on_gpu[0])
        assert torch.equal(on_gpu[0].cpu().view(torch.int16), ref)


@pytest.mark.parametrize("m", [1, 20, 64])
def test_group_rotation_forms_are_bit_identical(m):
    """A q/k/v-like group run with each rotation form pinned: the same bits, fp16 and bf16."""
    k, widths, cb = 512, (384, 128, 256), Codebook.MCG
    srcs = [_case(k, n, 4, m, seed=80 + i) for i, n in enumerate(widths)]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    group = groups.make_group(tiles, [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs], cb)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().cuda()
    for dtype in (torch.float16, torch.bfloat16):
        with dense.pinned_had_form("warp"):
            want = groups.group_linear(x.to(dtype), group)
        with dense.pinned_had_form("octet"):
            got = groups.group_linear(x.to(dtype), group)
        assert torch.isfinite(got).all() and torch.equal(got.view(torch.int16), want.view(torch.int16)), dtype


def _case(k: int, n: int, bits: float, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    trellis = _trellis(k // 16, n // 16, bits, seed)
    suh = (torch.randn(k, generator=gen) * 0.1).half()
    svh = (torch.randn(n, generator=gen) * 0.1).half()
    x = torch.randn(m, k, generator=gen).half()
    return trellis, suh, svh, x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=IDS)
@pytest.mark.parametrize("m", [1, 6, 13, 27, 64])
def test_fused_gemm_matches_reference(cb, bits, m):
    trellis, suh, svh, x = _case(256, 384, bits, m, seed=m + int(bits * 8))
    ref = exl3_linear_reference(x, trellis, suh, svh, cb)
    t, s, v = dense.prepare(trellis.cuda()), suh.cuda(), svh.cuda()
    xh = dense.had_in(x.cuda(), s)
    for splits in (1, 3, 16):
        partial = dense.gemm_rotated_partial(xh, t, cb, splits=splits)
        y = dense.had_out(partial, v).cpu()
        assert torch.isfinite(y).all(), f"splits={splits}"
        assert _rel(y, ref) < 2e-3, f"splits={splits}: rel {_rel(y, ref):.2e}"


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=IDS)
def test_gemm_with_x_in_shared_memory_is_bit_identical(cb, bits):
    """x staged per block in shared memory (ldmatrix) gives the global-load kernel's partials bit for bit, for
    every row count it takes (one and two 8-row groups, rows past m), uneven K slices and a split per tile."""
    trellis, _, _, x = _case(1152, 256, bits, 64, seed=int(bits * 4) + 3 * int(cb))
    t = dense.prepare(trellis.cuda())
    for m in (1, 2, 7, 8, 9, 13, 16, 17, 27, 32, 40, 64):
        xh = x[:m].cuda()
        for splits in ((1, 5, 72) if m <= 32 else (3, 72)):  # 64 rows of one 72-tile slice exceed 96 KB
            want = dense.gemm_rotated_partial(xh, t, cb, splits=splits, xs=False)
            got = dense.gemm_rotated_partial(xh, t, cb, splits=splits, xs=True)
            assert got.shape == want.shape and torch.isfinite(got).all(), f"m={m} splits={splits}"
            assert torch.equal(got, want), f"m={m} splits={splits}: max {float((got - want).abs().max()):.3e}"


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=IDS)
def test_gemm_with_x_ring_is_bit_identical(cb, bits):
    """x streamed through the shared-memory ring gives the global-load kernel's partials bit for bit: both mma.sync
    modes (one or two trellis groups per chunk), rows past m, a last chunk shorter than its groups (K slices of 1-18
    tiles), and rows beyond 64 as further 64-row blocks."""
    trellis, _, _, x = _case(1152, 256, bits, 150, seed=int(bits * 6) + 5 * int(cb))
    t = dense.prepare(trellis.cuda())
    for m in (1, 7, 9, 16, 27, 64, 65, 150):
        xh = x[:m].cuda()
        for splits in (1, 4, 7, 72):
            want = [dense.gemm_rotated_partial(xh[r0:r0 + 64].contiguous(), t, cb, splits=splits, xs=False)
                    for r0 in range(0, m, 64)]
            for mode in dispatch.MMA_RING_MODES:
                got = dense.gemm_rotated_partial(xh, t, cb, splits=splits, ring=mode)
                assert got.shape == (splits, m, 256) and torch.isfinite(got).all(), f"m={m} splits={splits}"
                for i, r0 in enumerate(range(0, m, 64)):
                    assert torch.equal(got[:, r0:r0 + 64], want[i]), f"m={m} splits={splits} mode={mode} rows {r0}+"


def _needs_wgmma() -> None:
    if not dispatch.wgmma_ready():
        pytest.skip("the wgmma ring needs an sm_90a build on a Hopper GPU")


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative distance of two partials; inf where got is not finite."""
    return float((got - want).norm() / want.norm()) if torch.isfinite(got).all() else float("inf")


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=IDS)
def test_gemm_with_wgmma_ring_matches_the_mma_ring(cb, bits):
    """The wgmma ring's partials equal the mma.sync ring's up to fp32 summation order (the tensor cores sum a k16
    step in their own order): both chunk modes, every block height (16-256 rows) with rows past m, more than 256 rows
    as further blocks, and K slices of 1-18 tiles (a last chunk shorter than its groups, a slice of one tile)."""
    _needs_wgmma()
    trellis, _, _, x = _case(1152, 256, bits, 300, seed=int(bits * 6) + 7 * int(cb))
    t = dense.prepare(trellis.cuda())
    for m in (1, 9, 16, 17, 33, 64, 100, 128, 129, 256, 300):
        xh = x[:m].cuda()
        for splits in (1, 4, 7, 72):
            want = dense.gemm_rotated_partial(xh, t, cb, splits=splits, ring=81)
            for mode in dispatch.WGMMA_RING_MODES:
                got = dense.gemm_rotated_partial(xh, t, cb, splits=splits, ring=mode)
                assert got.shape == want.shape
                assert _close(got, want) < 1e-5, f"m={m} splits={splits} mode={mode}: rel {_close(got, want):.2e}"


def test_group_with_wgmma_ring_matches_the_mma_ring():
    """A group through the wgmma ring: sources of different widths and splits in one launch, up to 300 rows, fp16
    and bf16, within fp32 summation order of the mma.sync ring; the policy's launch (group_linear) is group_run's on
    the policy's ring mode, bit for bit."""
    _needs_wgmma()
    k, widths, cb = 1024, (512, 128, 256), Codebook.MCG
    srcs = [_case(k, n, 4, 16, seed=80 + i) for i, n in enumerate(widths)]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    group = groups.make_group(tiles, [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs], cb,
                              splits=[3, 1, 7])
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(5)).half().cuda()

    def run(rows: torch.Tensor, **kw) -> torch.Tensor:
        m = rows.shape[0]
        return groups.group_run(rows.contiguous(), group.table, group.num, m, group.k_tiles, group.total_items,
                                group.total_cols, group.partial_per_row, group.k2, group.codebook, **kw)

    for m in (1, 9, 16, 33, 64, 150, 256, 300):
        for dtype in (torch.float16, torch.bfloat16):
            want = run(x[:m].to(dtype), ring=81)
            for mode in dispatch.WGMMA_RING_MODES:
                got = run(x[:m].to(dtype), ring=mode)
                assert got.dtype == dtype and _close(got.float(), want.float()) < 2e-3, f"m={m} mode={mode}"
    with dispatch.pinned_wgmma(True):
        assert group.ring_mode(64) in dispatch.WGMMA_RING_MODES
        assert not group.rotating_serves(64)  # explicit splits: no wgmma rows of its own, so never the rotating form
        assert torch.equal(groups.group_linear(x[:64], group).view(torch.int16),
                           run(x[:64], ring=group.ring_mode(64)).view(torch.int16))
    with dispatch.pinned_wgmma(False):
        assert group.ring_mode(64) in dispatch.MMA_RING_MODES


def test_gemm_x_in_shared_memory_limits():
    t = dense.prepare(_trellis(8, 6, 4, seed=2).cuda())  # 6 column tiles: not a multiple of 4
    with pytest.raises(ValueError, match="x in shared memory"):
        dense.gemm_rotated_partial(torch.randn(4, 128, device="cuda").half(), t, Codebook.MCG, xs=True)
    for m, kt in ((1, 896), (8, 256), (16, 320), (16, 896), (20, 256), (64, 320)):
        budget = dispatch.CROSSOVERS.xs_smem_bytes if m <= 32 else dispatch.CROSSOVERS.xs_smem_bytes_64
        splits = dispatch.xs_min_splits(m, kt)
        assert dispatch.xs_smem(m, -(-kt // splits)) <= budget < dispatch.xs_smem(m, -(-kt // max(1, splits - 1))) \
            or splits == 1, (m, kt, splits)


def test_fused_gemm_writes_every_element():
    trellis, suh, svh, x = _case(512, 256, 4, 11, seed=3)
    xh = dense.had_in(x.cuda(), suh.cuda())
    for splits in (1, 5):
        torch.cuda.empty_cache()
        poison = torch.full((splits, 11, 256), float("nan"), device="cuda")
        del poison  # the allocator hands the same NaN-filled block to the kernel's output
        partial = dense.gemm_rotated_partial(xh, dense.prepare(trellis.cuda()), Codebook.MCG, splits=splits)
        assert torch.isfinite(partial).all()


@pytest.mark.parametrize("path", [None, "reconstruct"])
@pytest.mark.parametrize("m", [65, 300])
def test_reconstruct_path_matches_reference(m, path):
    trellis, suh, svh, x = _case(384, 512, 3, m, seed=m)
    ref = exl3_linear_reference(x, trellis, suh, svh, Codebook.MUL1)
    y = dense.exl3_linear(x.cuda(), dense.prepare(trellis.cuda()), suh.cuda(), svh.cuda(), Codebook.MUL1,
                          path=path).cpu()
    assert torch.isfinite(y).all() and _rel(y, ref) < 3e-3


def test_reconstruct_path_in_column_slices(monkeypatch):
    """Wide outputs (the lm_head) are reconstructed in column slices that each feed cuBLAS into a strided view."""
    # two 128-column blocks per slice (dense imported CROSSOVERS by name: patch its binding)
    monkeypatch.setattr(dense, "CROSSOVERS",
                        dataclasses.replace(dispatch.CROSSOVERS, reconstruct_slice_bytes=256 * 128 * 2 * 2))
    trellis, suh, svh, x = _case(256, 640, 4, 80, seed=21)  # 40 column tiles -> slices of 16, 16, 8
    ref = exl3_linear_reference(x, trellis, suh, svh, Codebook.MCG)
    y = dense.exl3_linear(x.cuda(), dense.prepare(trellis.cuda()), suh.cuda(), svh.cuda(), Codebook.MCG,
                          path="reconstruct").cpu()
    assert torch.isfinite(y).all() and _rel(y, ref) < 3e-3


@pytest.mark.parametrize("m", [1, 9, 16, 64, 100, 200])
def test_bf16_activations_equal_casting_around_fp16(m):
    """bf16 x read by had_in and bf16 y written by had_out (every dense path by m: global / x-slice, the x ring,
    reconstruct + cuBLAS; a group) are bit-identical to casting x to fp16 before an fp16 call and y to bf16 after."""
    trellis, suh, svh, x = _case(512, 384, 4, m, seed=90 + m)
    t, s, v = dense.prepare(trellis.cuda()), suh.cuda(), svh.cuda()
    xb = (x.float() * 4).bfloat16().cuda()
    for path in (None, "reconstruct"):
        want = dense.exl3_linear(xb.half(), t, s, v, Codebook.MCG, path=path).bfloat16()
        got = dense.exl3_linear(xb, t, s, v, Codebook.MCG, path=path)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all(), f"path={path}"
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"path={path}"
    srcs = [_case(512, n, 3, 1, seed=95 + i) for i, n in enumerate((256, 128))]
    group = groups.make_group([dense.prepare(tr.cuda()) for tr, _, _, _ in srcs],
                              [su.cuda() for _, su, _, _ in srcs], [sv.cuda() for _, _, sv, _ in srcs], Codebook.MUL1)
    if m <= dispatch.CROSSOVERS.fused_max_m or dispatch.uses_ring(m, 8):
        want = groups.group_linear(xb.half(), group).bfloat16()
        got = groups.group_linear(xb, group)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bad_inputs_are_refused_before_launch():
    t = dense.prepare(_trellis(8, 8, 4, seed=1).cuda())
    with pytest.raises(ValueError, match="suh must be a contiguous CUDA fp16 tensor"):
        dense.had_in(torch.randn(2, 128, device="cuda").half(), torch.randn(128, device="cuda"))
    with pytest.raises(ValueError, match="x must be a contiguous CUDA fp16 or bf16 tensor"):
        dense.had_in(torch.randn(2, 128, device="cuda"), torch.randn(128, device="cuda").half())
    with pytest.raises(ValueError, match="at most 64 rows"):
        dense.gemm_rotated_partial(torch.randn(65, 128, device="cuda").half(), t, Codebook.MCG)
    with pytest.raises(ValueError, match="prepare"):
        dense.reconstruct(t.transpose(0, 1), Codebook.MCG)


def test_real_shape_and_op():
    """4096 x 14336 at 4 bits through the registered op (the layer's entry point), fused and reconstruct."""
    from sglang_exl3.kernels.backends import Backend

    trellis, suh, svh, x = _case(4096, 14336, 4, 16, seed=11)
    ref = exl3_linear_reference(x, trellis, suh, svh, Codebook.MCG)
    args = (dense.prepare(trellis.cuda()), suh.cuda(), svh.cuda())
    y = torch.ops.exl3.gemm(x.cuda(), *args, None, int(Codebook.MCG), int(Backend.CUDA)).cpu()
    assert _rel(y, ref) < 2e-3
    y2 = dense.exl3_linear(x.cuda(), *args, Codebook.MCG, path="reconstruct").cpu()
    assert _rel(y2, ref) < 3e-3


def test_cuda_graph_capture_and_replay():
    trellis, suh, svh, x = _case(1024, 512, 4, 1, seed=5)
    t, s, v = dense.prepare(trellis.cuda()), suh.cuda(), svh.cuda()
    static_x = x.cuda()
    dense.exl3_linear(static_x, t, s, v, Codebook.MUL1)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = dense.exl3_linear(static_x, t, s, v, Codebook.MUL1)
    for seed in (1, 2):
        fresh = torch.randn(1, 1024, generator=torch.Generator().manual_seed(seed)).half()
        static_x.copy_(fresh.cuda())
        graph.replay()
        ref = exl3_linear_reference(fresh, trellis, suh, svh, Codebook.MUL1)
        assert _rel(static_y.cpu(), ref) < 2e-3


@pytest.mark.parametrize("m", [1, 7, 16, 33])
def test_group_equals_its_sources_run_one_by_one(m):
    """q/k/v-like group (384 + 128 + 128 columns): one launch per stage, bit-identical to three separate calls."""
    gen = torch.Generator().manual_seed(m)
    k, widths, cb = 512, (384, 128, 128), Codebook.MCG
    srcs = [_case(k, n, 4, m, seed=m * 10 + i) for i, n in enumerate(widths)]
    x = torch.randn(m, k, generator=gen).half()
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    suh = [s.cuda() for _, s, _, _ in srcs]
    svh = [v.cuda() for _, _, v, _ in srcs]
    group = groups.make_group(tiles, suh, svh, cb)
    y = groups.group_linear(x.cuda(), group)
    one_by_one = torch.cat([dense.exl3_linear(x.cuda(), t, s, v, cb, path="fused")
                            for t, s, v in zip(tiles, suh, svh, strict=True)], dim=1)
    assert torch.equal(y.view(torch.int16), one_by_one.view(torch.int16))
    ref = torch.cat([exl3_linear_reference(x, t, s, v, cb) for t, s, v, _ in srcs], dim=1)
    assert _rel(y.cpu(), ref) < 2e-3


@pytest.mark.parametrize("cb, bits", [(Codebook.MCG, 4), (Codebook.MUL1, 3), (Codebook.INST3, 2)])
def test_group_with_x_in_shared_memory_is_bit_identical(cb, bits):
    """The group GEMM with x slices in shared memory (m = 8..16 by policy) writes what global loads write, bit for
    bit, for sources of different widths and splits (so different slice lengths in one launch)."""
    k, widths = 1024, (512, 128, 256)
    srcs = [_case(k, n, bits, 16, seed=60 + i) for i, n in enumerate(widths)]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    group = groups.make_group(tiles, [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs], cb,
                              splits=[3, 1, 7])
    assert group.max_slice == 64
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(bits)).half().cuda()
    for m in (1, 8, 11, 16, 20, 32):
        args = (x[:m], group.table, group.num, m, group.k_tiles, group.total_items, group.total_cols,
                group.partial_per_row, group.k2, group.codebook)
        assert group.xs_slice(m) == (64 if dispatch.use_xs(m, cb) else 0)
        want = groups.group_run(*args, xs_slice=0)
        got = groups.group_run(*args, xs_slice=group.max_slice)
        assert torch.isfinite(got).all() and torch.equal(got.view(torch.int16), want.view(torch.int16)), f"m={m}"
        assert torch.equal(groups.group_linear(x[:m], group).view(torch.int16), want.view(torch.int16))


def test_group_on_the_wgmma_ring_runs_its_half_split_rows():
    """A group made at the policy's splits (the Llama-3-8B q/k/v widths) runs 33-64 rows on the wgmma ring from its
    second table rows, at half the load-time splits: the mma.sync ring's result at those splits, and the load-time
    rows' within fp32 summation order; the other paths keep the load-time rows."""
    _needs_wgmma()
    k, widths, cb = 4096, (4096, 1024, 1024), Codebook.MCG
    srcs = [_case(k, n, 4, 1, seed=90 + i) for i, n in enumerate(widths)]
    group = groups.make_group([dense.prepare(t.cuda()) for t, _, _, _ in srcs], [s.cuda() for _, s, _, _ in srcs],
                              [v.cuda() for _, _, v, _ in srcs], cb)
    splits = [dispatch.default_splits(k // 16, n // 16, torch.device("cuda")) for n in widths]
    halves = [-(-s // 2) * n for s, n in zip(splits, widths, strict=True)]
    assert group.wg_items and group.wg_partial_per_row == sum(halves)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(9)).half().cuda()

    def run(rows: torch.Tensor, wg: bool, **kw) -> torch.Tensor:
        table, items, part = group.launch_rows(91 if wg else 0)
        return groups.group_run(rows.contiguous(), table, group.num, rows.shape[0], group.k_tiles, items,
                                group.total_cols, part, group.k2, group.codebook, **kw)

    with dispatch.pinned_wgmma(True):
        for m in (33, 64):
            for dtype in (torch.float16, torch.bfloat16):
                got = groups.group_linear(x[:m].to(dtype), group)
                assert group.ring_mode(m) in dispatch.WGMMA_RING_MODES
                assert _close(got.float(), run(x[:m].to(dtype), True, ring=81).float()) < 2e-3, f"m={m}"
                assert _close(got.float(), run(x[:m].to(dtype), False, ring=91).float()) < 2e-3, f"m={m}"
        assert torch.equal(groups.group_linear(x[:16], group).view(torch.int16),
                           run(x[:16], False, ring=group.ring_mode(16)).view(torch.int16))


def test_group_rotating_form_is_bit_identical_to_its_partials():
    """The rotating form of a group whose wgmma rows are all at one split (Llama-3-8B gate/up: each block holds whole
    column sums and rotates them in the GEMM's launch) writes what the wgmma ring's partials and the separate output
    rotation write, bit for bit, over the same table rows, fp16 and bf16, 33-64 rows; in a CUDA graph too."""
    _needs_wgmma()
    k, widths, cb = 4096, (14336, 14336), Codebook.MCG
    srcs = [_case(k, n, 4, 1, seed=110 + i) for i, n in enumerate(widths)]
    group = groups.make_group([dense.prepare(t.cuda()) for t, _, _, _ in srcs], [s.cuda() for _, s, _, _ in srcs],
                              [v.cuda() for _, _, v, _ in srcs], cb)
    assert group.wg_one_split == 1
    table, items, part = group.launch_rows(91)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(11)).half().cuda()
    for m in (33, 50, 64):
        for dtype in (torch.float16, torch.bfloat16):
            xm = x[:m].to(dtype).contiguous()
            want = groups.group_run(xm, table, group.num, m, group.k_tiles, items, group.total_cols, part, group.k2,
                                    group.codebook, ring=91)
            got = groups.group_run_rotating(xm, group)
            assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16)), f"m={m} {dtype}"
    static_x = torch.zeros(48, k, dtype=torch.bfloat16, device="cuda")
    groups.group_run_rotating(static_x, group)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = groups.group_run_rotating(static_x, group)
    static_x.copy_(x[:48].bfloat16())
    graph.replay()
    eager = groups.group_run_rotating(x[:48].bfloat16(), group)
    assert torch.equal(static_y.view(torch.int16), eager.view(torch.int16))


def test_group_rotating_form_takes_only_one_split_rows():
    """A group whose wgmma rows are at several splits (the Llama-3-8B q/k/v widths: half the load-time splits) never
    takes the rotating form: the policy keeps its partials, and group_run_rotating refuses it before a launch."""
    _needs_wgmma()
    k, widths, cb = 4096, (4096, 1024, 1024), Codebook.MCG
    srcs = [_case(k, n, 4, 1, seed=110 + i) for i, n in enumerate(widths)]
    group = groups.make_group([dense.prepare(t.cuda()) for t, _, _, _ in srcs], [s.cuda() for _, s, _, _ in srcs],
                              [v.cuda() for _, _, v, _ in srcs], cb)
    assert group.wg_items and group.wg_one_split == 0
    assert not any(group.rotating_serves(m, 91) for m in (33, 64))
    with pytest.raises(ValueError, match="one split"):
        groups.group_run_rotating(torch.zeros(48, k, dtype=torch.float16, device="cuda"), group)


@pytest.mark.parametrize("cb, bits", [(Codebook.MCG, 4), (Codebook.MUL1, 3), (Codebook.INST3, 2)])
def test_group_with_x_ring_is_bit_identical(cb, bits):
    """The group GEMM with x through the shared-memory ring writes what global loads write, bit for bit, for
    sources of different widths and splits, fp16 and bf16; above 64 rows it equals the group run on each 64-row
    block."""
    k, widths = 1024, (512, 128, 256)
    srcs = [_case(k, n, bits, 16, seed=70 + i) for i, n in enumerate(widths)]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    group = groups.make_group(tiles, [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs], cb,
                              splits=[3, 1, 7])
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(bits)).half().cuda()

    def run(rows: torch.Tensor, **kw) -> torch.Tensor:
        m = rows.shape[0]
        return groups.group_run(rows.contiguous(), group.table, group.num, m, group.k_tiles, group.total_items,
                                group.total_cols, group.partial_per_row, group.k2, group.codebook, **kw)

    for m in (1, 9, 16, 33, 64, 150):
        want = torch.cat([run(x[r0:min(m, r0 + 64)]) for r0 in range(0, m, 64)])
        for mode in dispatch.MMA_RING_MODES:
            got = run(x[:m], ring=mode)
            assert torch.isfinite(got).all() and torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"m={m} mode={mode}"
    xb = x[:64].bfloat16()
    want = run(xb)
    assert want.dtype == torch.bfloat16
    for mode in dispatch.MMA_RING_MODES:
        got = run(xb, ring=mode)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16)), mode


@pytest.mark.parametrize("m", [1, 48])  # the x-slice GEMM; the x ring (the policy's mode)
def test_group_captures_in_a_cuda_graph(m):
    srcs = [_case(256, n, 3, 1, seed=40 + i) for i, n in enumerate((256, 128))]
    group = groups.make_group([dense.prepare(t.cuda()) for t, _, _, _ in srcs], [s.cuda() for _, s, _, _ in srcs],
                              [v.cuda() for _, _, v, _ in srcs], Codebook.MUL1)
    static_x = torch.zeros(m, 256, device="cuda").half()
    groups.group_linear(static_x, group)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = groups.group_linear(static_x, group)
    for seed in (3, 4):
        fresh = torch.randn(m, 256, generator=torch.Generator().manual_seed(seed)).half()
        static_x.copy_(fresh.cuda())
        graph.replay()
        ref = torch.cat([exl3_linear_reference(fresh, t, s, v, Codebook.MUL1) for t, s, v, _ in srcs], dim=1)
        assert _rel(static_y.cpu(), ref) < 2e-3


@pytest.mark.parametrize("cb, bits", [(Codebook.MCG, 4), (Codebook.MUL1, 3), (Codebook.INST3, 2),
                                     (Codebook.MUL1, 2.5)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_one_launch_is_bit_identical_to_three(cb, bits, dtype):
    """The one-launch linear (each block rotates its K slice of x; the last block per 128 columns sums the partials and
    rotates them into the output) writes what the group's three launches write at the same splits, bit for bit, for a
    q/k/v-like group and a single source at row counts up to 16 (one and two row groups), and leaves its counters
    zero, launched as a programmatic dependent or not."""
    k, widths = 1024, (384, 128, 128)
    srcs = [_case(k, n, bits, 16, seed=80 + i) for i, n in enumerate(widths)]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    suh, svh = [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs]
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(int(bits * 2))).to(dtype).cuda()
    for count in (3, 1):
        one = groups.make_one_launch(tiles[:count], suh[:count], svh[:count], cb)
        g = one.group
        for m in (1, 2, 5, 8, 13, 16):
            want = groups.group_run(x[:m], g.table, g.num, m, g.k_tiles, g.total_items, g.total_cols,
                                    g.partial_per_row, g.k2, g.codebook)
            for pdl in (True, False):
                got = groups.one_launch_linear(x[:m], g, one.counters, pdl=pdl)
                case = f"{count} sources, m={m}, pdl {pdl}"
                assert got.dtype == dtype and torch.isfinite(got).all()
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), case
                assert not one.counters.any(), f"counters left set: {case}"
    ref = torch.cat([exl3_linear_reference(x[:3].cpu().half(), t, s, v, cb) for t, s, v, _ in srcs], dim=1)
    got = groups.one_launch_linear(x[:3].half(), groups.make_one_launch(tiles, suh, svh, cb).group,
                                   groups.make_one_launch(tiles, suh, svh, cb).counters)
    assert _rel(got.cpu(), ref) < 2e-3


def test_one_launch_captures_and_replays_in_a_cuda_graph():
    """Captured once, replayed on fresh x twice: the counters reset themselves, so each replay equals an eager
    call."""
    import sglang_exl3.kernels.ops  # noqa: F401  (registers torch.ops.exl3)

    srcs = [_case(512, n, 4, 1, seed=90 + i) for i, n in enumerate((256, 128))]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    one = groups.make_one_launch(tiles, [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs],
                                 Codebook.MUL1)
    static_x = torch.zeros(4, 512, device="cuda", dtype=torch.bfloat16)
    torch.ops.exl3.one_launch(static_x, one.group.table, one.counters, one.group.meta, one.group.codebook)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = torch.ops.exl3.one_launch(static_x, one.group.table, one.counters, one.group.meta,
                                             one.group.codebook)
    for seed in (1, 2):
        fresh = torch.randn(4, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager = groups.one_launch_linear(fresh, one.group, one.counters)
        assert torch.equal(static_y.view(torch.int16), eager.view(torch.int16)), seed
        assert not one.counters.any()


def test_programmatic_launches_are_used_on_hopper_with_this_build():
    """exl3_pdl_usable: 1 on a compute-capability-9+ GPU with the build for its arch (from sm_90 PTX: the
    griddepcontrol waits present), so the PDL switches take effect; 0 below Hopper."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert library.load_library().exl3_pdl_usable() == int(hopper)


@pytest.mark.parametrize("cb", [Codebook.MUL1, Codebook.MCG])
def test_three_launches_as_programmatic_dependents_are_bit_identical(cb):
    """With the three-launch path's launches as programmatic dependents (SGLANG_EXL3_DEV_PDL_THREE_LAUNCH), a single
    linear and a q/k/v-like group write what plain launches write at 1-64 rows (x-slice, ring and wgmma GEMMs between
    the rotations), bf16, both rotation forms; and two linears chained in a CUDA graph (the second's input rotation
    reads the first's output rotation) replay on fresh x as eager plain launches compute."""
    k = 1024
    srcs = [_case(k, n, 4, 64, seed=120 + i) for i, n in enumerate((1024, 128, 128))]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    suh, svh = [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs]
    group = groups.make_group(tiles, suh, svh, cb)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(12)).bfloat16().cuda()
    for form in ("warp", "octet"):
        with dense.pinned_had_form(form):
            for m in (1, 4, 8, 16, 33, 64):
                want = (dense.exl3_linear(x[:m], tiles[0], suh[0], svh[0], cb), groups.group_linear(x[:m], group))
                with dense.pinned_plain_pdl(True):
                    got = (dense.exl3_linear(x[:m], tiles[0], suh[0], svh[0], cb), groups.group_linear(x[:m], group))
                for g, w, what in zip(got, want, ("single", "group"), strict=True):
                    assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{what} {form} m={m}"

    def chain(inp: torch.Tensor) -> torch.Tensor:
        return dense.exl3_linear(dense.exl3_linear(inp, tiles[0], suh[0], svh[0], cb), tiles[0], suh[0], svh[0], cb)

    with dense.pinned_plain_pdl(True):
        static_x = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
        chain(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = chain(static_x)
    for seed in (1, 2):
        fresh = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y.view(torch.int16), chain(fresh).view(torch.int16)), seed


def test_group_rejects_mismatched_sources():
    a = dense.prepare(_trellis(8, 8, 4, seed=1).cuda())
    b = dense.prepare(_trellis(8, 8, 3, seed=2).cuda())
    s, v = torch.ones(128, device="cuda").half(), torch.ones(128, device="cuda").half()
    with pytest.raises(ValueError, match="share K, bits and codebook"):
        groups.make_group([a, b], [s, s], [v, v], Codebook.MCG)


@pytest.mark.parametrize("m", [3, dispatch.CROSSOVERS.fused_crossover_m + 9])
def test_group_op_both_sides_of_the_crossover(m):
    """torch.ops.exl3.gemm_group as Exl3LinearMethod calls it: grouped kernel up to the crossover, per-source
    reconstruct + cuBLAS above it; both match the reference codec."""
    from sglang_exl3.kernels import exl3_gemm  # noqa: F401  (registers the ops)

    srcs = [_case(256, n, 4, m, seed=70 + i) for i, n in enumerate((256, 128, 128))]
    tiles = [dense.prepare(t.cuda()) for t, _, _, _ in srcs]
    suh, svh = [s.cuda() for _, s, _, _ in srcs], [v.cuda() for _, _, v, _ in srcs]
    group = groups.make_group(tiles, suh, svh, Codebook.INST3)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half()
    y = torch.ops.exl3.gemm_group(x.cuda(), tiles, suh, svh, group.table, group.meta, group.codebook)
    ref = torch.cat([exl3_linear_reference(x, t, s, v, Codebook.INST3) for t, s, v, _ in srcs], dim=1)
    assert not torch.isnan(y).any()
    assert _rel(y.cpu(), ref) < 2e-3


def _experts(n_experts: int, hidden: int, inter: int, bits: int | tuple[int, int, int], seed: int):
    """Random EXL3 experts: per expert (gate, up, down) as (trellis, suh, svh) on the CPU; `bits` per role or one
    for all."""
    out = []
    per_role = bits if isinstance(bits, tuple) else (bits,) * 3
    for e in range(n_experts):
        roles = []
        for r, (k, n) in enumerate(((hidden, inter), (hidden, inter), (inter, hidden))):
            t, s, v, _ = _case(k, n, per_role[r], 1, seed=seed + 10 * e + r)
            roles.append((t, s, v))
        out.append(roles)
    return out


def _banks(experts, cb):
    banks = []
    for r in range(3):
        banks.append(moe_tables.make_expert_bank([dense.prepare(e[r][0].cuda()) for e in experts],
                                                 [e[r][1].cuda() for e in experts], [e[r][2].cuda() for e in experts],
                                                 cb))
    return banks


def test_routed_linear_equals_each_pair_run_alone():
    """Routed group (one m = 1 source per (row, expert) pair, table gathered on the device): bit-identical to the
    fused kernel run on each pair's row alone, for two banks in one launch."""
    experts = _experts(5, 256, 384, 4, seed=100)
    gate, up, _ = _banks(experts, Codebook.MCG)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5)).half().cuda()
    ids = torch.tensor([4, 0, 2, 2, 1, 4, 3, 0, 2, 1, 3], device="cuda")  # top-2: pair p reads row p // 2
    g, u = moe_ops.routed_linear(x, [gate, up], ids, x_row_div=2)
    device_table = moe_tables.routed_table([gate, up], ids, 2, moe_tables.routed_table_builder())[0]
    assert torch.equal(device_table, moe_tables.routed_table([gate, up], ids, 2)[0])  # the one-launch builder
    for p in range(ids.numel()):
        e, r = int(ids[p]), p // 2
        for got, bank, role in ((g, gate, 0), (u, up, 1)):
            alone = dense.exl3_linear(x[r:r + 1], bank.sources[0][e], bank.sources[1][e], bank.sources[2][e],
                                      Codebook.MCG, path="fused")
            assert torch.equal(got[p:p + 1].view(torch.int16), alone.view(torch.int16)), (p, role)


@pytest.mark.parametrize("op", ["moe_routed", "moe_sorted"])
@pytest.mark.parametrize("m, topk, id_dtype, bits", [(1, 2, torch.int32, 3), (5, 3, torch.int64, 3),
                                                     (33, 2, torch.int32, 3), (5, 3, torch.int32, (3, 4, 5)),
                                                     (33, 2, torch.int64, (5, 3, 4))])
def test_moe_routed_op_matches_reference_and_captures(op, m, topk, id_dtype, bits):
    """torch.ops.exl3.moe_routed (one source per pair) and moe_sorted (expert-sorted tiles of 8 rows, with empty
    sources past the filled tiles at m = 33) against the codec: only routed experts, ids of -1 (another EP rank)
    weigh 0, ids as SGLang hands them (int32) or int64, gate and up at one bitrate (the fused forward) or at two
    (R7: two groups); then the same op replayed from a CUDA graph on fresh routing."""
    from sglang_exl3.kernels import exl3_gemm  # noqa: F401  (registers the ops)

    n_exp, hidden, inter = 6, 256, 256
    experts = _experts(n_exp, hidden, inter, bits, seed=7 * m)
    gate, up, down = _banks(experts, Codebook.MUL1)
    gen = torch.Generator().manual_seed(m)

    def case():
        x = torch.randn(m, hidden, generator=gen).half()
        ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)]).to(id_dtype)
        ids[0, -1] = -1
        w = torch.rand(m, topk, generator=gen)
        return x, ids, w

    def reference(x, ids, w):
        return codec_moe(x, ids, w, experts, Codebook.MUL1)

    def run(x, ids, w):
        return getattr(torch.ops.exl3, op)(x, ids, w, gate.rows, up.rows, down.rows, gate.meta, up.meta, down.meta,
                                           False)

    x, ids, w = case()
    y = run(x.cuda(), ids.cuda(), w.cuda())
    ref = reference(x, ids, w)
    assert not torch.isnan(y).any() and _rel(y.cpu(), ref) < 3e-3
    sx, sids, sw = x.cuda(), ids.cuda(), w.cuda()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = run(sx, sids, sw)
    x, ids, w = case()
    sx.copy_(x.cuda()), sids.copy_(ids.cuda()), sw.copy_(w.cuda())
    graph.replay()
    assert _rel(sy.cpu(), reference(x, ids, w)) < 3e-3


@pytest.mark.parametrize("gelu", [False, True])
def test_moe_glue_kernels_match_their_host_code(gelu):
    """The activation and combine launches on the device against the same code on the host (itself checked against
    torch in tests/test_cuda_library.py): the device's expf/tanhf and fused multiply-adds may move a last bit."""
    gen = torch.Generator().manual_seed(21)
    gate_up = (torch.randn(8, 2 * 5 * 768, generator=gen) * 3).half()
    got = moe_ops.act_mul(gate_up.cuda(), 5, 768, gelu).cpu().float()
    want = moe_ops.act_mul(gate_up, 5, 768, gelu).float()
    up = gate_up[:, 5 * 768:].reshape(8, 5, 768).transpose(0, 1).reshape(40, 768).float()
    assert ((got - want).abs() <= want.abs().clamp(min=2 ** -14) * 2 ** -10 + 1e-5 * up.abs()).all()
    assert (got == want).float().mean() > 0.99
    y = torch.randn(40, 256, generator=gen).half()
    w = torch.rand(40, generator=gen)
    ids = torch.randint(-1, 6, (40,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(40, generator=gen) * 256
    for r in (None, rows):
        got = moe_ops.moe_combine(y.cuda(), w.cuda(), ids.cuda(), 8, 256, None if r is None else r.cuda()).cpu()
        assert torch.allclose(got, moe_ops.moe_combine(y, w, ids, 8, 256, r), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cb", [Codebook.MCG, Codebook.MUL1], ids=["mcg", "mul1"])
@pytest.mark.parametrize("path", ["routed", "sorted"])
@pytest.mark.parametrize("m, topk, gelu, id_dtype", [(1, 2, False, torch.int32), (3, 3, True, torch.int64),
                                                     (33, 2, False, torch.int32)])
def test_fused_moe_bit_identical_to_its_stages(path, m, topk, gelu, id_dtype, cb):
    """The five-launch forward (rotations folded into act * up and into the combine) against the same forward run
    stage by stage (itself checked against the codec above): bit-identical fp32 outputs, for fp16 x and for bf16 x
    (rounded to fp16 inside, as the cast it replaces), ids of -1 skipped, empty sorted sources (m = 33). The fused
    GEMMs stage x in shared memory where the policy says so (sorted tiles of 8+ rows; MUL1 also per pair), the
    stages never: so this also checks that path."""
    from sglang_exl3.kernels.moe_routed import routed_moe
    from sglang_exl3.kernels.moe_sorted import sorted_moe

    n_exp, hidden, inter = 6, 256, 384
    gate, up, down = _banks(_experts(n_exp, hidden, inter, 3 if m == 3 else 4, seed=11 * m), cb)
    gen = torch.Generator().manual_seed(100 + m)
    x = (torch.randn(m, hidden, generator=gen) * 2).bfloat16().cuda()
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)]).to(id_dtype)
    ids[0, -1] = -1
    ids, w = ids.cuda(), torch.rand(m, topk, generator=gen).cuda()
    forward = routed_moe if path == "routed" else sorted_moe
    staged = forward(x.half(), ids, w, gate, up, down, gelu, fused=False)
    for xin in (x.half(), x):
        fused = forward(xin, ids, w, gate, up, down, gelu)
        assert torch.equal(fused.view(torch.int32), staged.view(torch.int32)), (xin.dtype, (fused - staged).abs().max())
    assert torch.isfinite(staged).all()


@pytest.mark.parametrize("m, topk", [(1, 2), (3, 3), (33, 2)])
def test_sorted_moe_split_along_k_matches_unsplit(m, topk):
    """Sorted sources split along K (split_k; 2 splits for gate/up and 3 for down at 1-3 rows here): fused and
    stage by stage bit-identical, and within fp32 summation order of the unsplit forward."""
    from sglang_exl3.kernels.moe_sorted import sorted_moe, sorted_plan, sorted_splits, tile_rows

    n_exp, hidden, inter = 6, 256, 384
    gate, up, down = _banks(_experts(n_exp, hidden, inter, 4, seed=7 * m), Codebook.MCG)
    gen = torch.Generator().manual_seed(200 + m)
    x = (torch.randn(m, hidden, generator=gen) * 2).half().cuda()
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)]).to(torch.int32).cuda()
    w = torch.rand(m, topk, generator=gen).cuda()
    sources = sorted_plan(ids.reshape(-1), n_exp, tile_rows(m * topk, n_exp)).sources
    if m < 33:
        assert sorted_splits(gate, 2 * sources, x.device) > 1 and sorted_splits(down, sources, x.device) > 1
    split = sorted_moe(x, ids, w, gate, up, down, False, split_k=True)
    staged = sorted_moe(x, ids, w, gate, up, down, False, fused=False, split_k=True)
    assert torch.equal(split.view(torch.int32), staged.view(torch.int32)), (split - staged).abs().max()
    unsplit = sorted_moe(x, ids, w, gate, up, down, False)
    assert torch.isfinite(split).all()
    assert torch.allclose(split, unsplit, rtol=2e-3, atol=2e-3 * float(unsplit.abs().max())), \
        (split - unsplit).abs().max()


@pytest.mark.parametrize("tokens, topk, experts, tile", [(64, 8, 128, 8), (300, 2, 8, 64), (5, 3, 6, 8)])
def test_sorted_tables_on_the_device_equal_the_torch_reference(tokens, topk, experts, tile):
    """The expert-sorted tables in one device launch (the filled count read on the device) against the torch
    reference: the fused forward's groups and R7's, ids of -1, empty sources; and inside a CUDA graph, on fresh
    routing."""
    from sglang_exl3.kernels.moe_sorted import sorted_plan, sorted_tables

    pointers = [[(1000 * r + e, 2000 * r + e, 3000 * r + e) for e in range(experts)] for r in range(3)]
    gate, up, down = (moe_tables.Exl3ExpertBank(rows=moe_tables.bank_rows(pointers[r], nt, 1).cuda(), n_tiles=nt,
                                                k_tiles=16, splits=1, k2=4, codebook=1)
                      for r, nt in enumerate((48, 40, 16)))
    gen = torch.Generator().manual_seed(tokens)

    def routing():
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
        ids.view(-1)[:3] = -1
        return ids.reshape(-1).cuda()

    build = moe_tables.sorted_table_builder()
    for bank_groups in ([[gate, up], [down]], [[gate], [up], [down]]):
        plan = sorted_plan(routing(), experts, tile)
        for w, g in zip(sorted_tables(bank_groups, plan), sorted_tables(bank_groups, plan, build), strict=True):
            assert torch.equal(g.table, w.table) and (g.items, g.cols, g.part) == (w.items, w.cols, w.part)
    ids = routing()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sorted_tables([[gate, up], [down]], sorted_plan(ids, experts, tile), build)
    ids.copy_(routing())
    graph.replay()
    torch.cuda.synchronize()
    want = sorted_tables([[gate, up], [down]], sorted_plan(ids, experts, tile))
    for w, g in zip(want, captured, strict=True):
        assert torch.equal(g.table, w.table)


@pytest.mark.parametrize("tokens, topk, experts, tile", [(64, 8, 128, 8), (700, 8, 256, 16), (1000, 6, 1024, 8),
                                                         (3, 1, 1, 64), (40, 2, 6, 1)])
def test_sorted_plan_on_the_device_equals_the_torch_reference(tokens, topk, experts, tile):
    """The one-launch plan (one block ranks the pairs chunk by chunk from its warps' match masks) against
    torch_sorted_plan on the same ids, int32 and int64, with ids of -1 and past the last expert; in a CUDA graph on
    fresh routing; and the one-launch gather of x against index_copy, for the pairs that have a row."""
    from sglang_exl3.kernels.moe_sorted import sorted_plan, torch_sorted_plan

    gen = torch.Generator().manual_seed(tokens)

    def routing(dtype=torch.int32):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).reshape(-1)
        ids[:2] = -1
        ids[-1] = experts
        return ids.to(dtype).cuda()

    for dtype in (torch.int32, torch.int64):
        ids = routing(dtype)
        got, want = sorted_plan(ids, experts, tile), torch_sorted_plan(ids, experts, tile)
        assert torch.equal(got.rows, want.rows) and torch.equal(got.experts, want.experts), dtype
        assert int(got.filled) == int(want.filled) and got.sources == want.sources
    ids = routing()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sorted_plan(ids, experts, tile)
    ids.copy_(routing())
    graph.replay()
    torch.cuda.synchronize()
    want = torch_sorted_plan(ids, experts, tile)
    assert torch.equal(captured.rows, want.rows) and torch.equal(captured.experts, want.experts)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).cuda()
    xs = torch.zeros(want.sources * tile + 1, 256, dtype=torch.bfloat16, device="cuda")
    moe_tables.sorted_gather(x, want.rows, topk, xs)
    ref = torch.zeros_like(xs).index_copy_(0, want.rows, x.unsqueeze(1).expand(-1, topk, -1).reshape(-1, 256))
    have = want.rows[want.rows < want.sources * tile]
    assert torch.equal(xs[have], ref[have])


@pytest.mark.parametrize("cb, bits", [(Codebook.MCG, 4), (Codebook.MUL1, 3), (Codebook.INST3, 2)],
                         ids=["mcg-4", "mul1-3", "3inst-2"])
@pytest.mark.parametrize("m, topk, gelu, id_dtype", [(1, 8, False, torch.int32), (3, 2, True, torch.int64)])
def test_moe_decode_bit_identical_to_the_fused_forward(cb, bits, m, topk, gelu, id_dtype):
    """The two-launch decode MoE (experts found from the routing on the device, x rotated per block, moe_mid and
    moe_tail done by the last block to finish) against the five-launch fused forward (checked against its stages
    above) at the same splits: bit-identical fp32 for fp16 and bf16 x, its fp16/bf16 outputs that result rounded,
    with and without the programmatic launch; ids of -1 skipped, a token with none of its experts here gets zeros;
    the counters are left zero; a CUDA graph replays it on fresh routing."""
    from sglang_exl3.kernels.moe_routed import routed_moe

    n_exp, hidden, inter = 10, 512, 384
    experts = _experts(n_exp, hidden, inter, bits, seed=13 * m + bits)
    gate, up, down = (moe_tables.make_expert_bank([dense.prepare(e[r][0].cuda()) for e in experts],
                                                  [e[r][1].cuda() for e in experts],
                                                  [e[r][2].cuda() for e in experts], cb, splits=sp)
                      for r, sp in ((0, 2), (1, 2), (2, 3)))
    gen = torch.Generator().manual_seed(200 + m)

    def case():
        x = (torch.randn(m, hidden, generator=gen) * 2).bfloat16().cuda()
        ids = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)]).to(id_dtype)
        ids[0, -1] = -1
        if m > 1:
            ids[-1] = -1  # the last token has no expert on this rank
        return x, ids.cuda(), torch.rand(m, topk, generator=gen).cuda()

    counters = moe_ops.decode_counters(m * topk, m, hidden, inter, "cuda")
    x, ids, w = case()
    flat = ids.reshape(-1)
    want = routed_moe(x, ids, w, gate, up, down, gelu)
    if m > 1:
        assert torch.equal(want[-1], torch.zeros_like(want[-1]))
    for xin in (x, x.half()):
        for pdl in (True, False):
            got = moe_ops.moe_decode(xin, flat, w.reshape(-1), gate, up, down, topk, gelu, counters, 2, 3, pdl=pdl)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (xin.dtype, pdl,
                                                                                (got - want).abs().max())
    for dtype in (torch.float16, torch.bfloat16):
        got = moe_ops.moe_decode(x, flat, w.reshape(-1), gate, up, down, topk, gelu, counters, 2, 3, out_dtype=dtype)
        assert torch.equal(got, want.to(dtype)), dtype
    assert not counters.any()
    default = moe_ops.moe_decode(x, flat, w.reshape(-1), gate, up, down, topk, gelu, counters)  # its own splits
    assert _rel(default.cpu(), want.cpu()) < 1e-3

    sx, sids, sw = x.clone(), flat.clone(), w.reshape(-1).clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = moe_ops.moe_decode(sx, sids, sw, gate, up, down, topk, gelu, counters, 2, 3, out_dtype=torch.bfloat16)
    for _ in range(2):
        x, ids, w = case()
        sx.copy_(x), sids.copy_(ids.reshape(-1)), sw.copy_(w.reshape(-1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(sy, routed_moe(x, ids, w, gate, up, down, gelu).to(torch.bfloat16))
    assert not counters.any()
