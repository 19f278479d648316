"""Dense EXL3 linears on our kernels: the weight layout, reconstruct, the rotations, the decode GEMMs' split-K
partials and `exl3_linear`, which runs one linear by the dispatch policy (kernels/dispatch.py).

Forward for small m: `had_in` (x * suh, Hadamard-128, fp16) -> fused decode GEMM writing fp32 split-K partials ->
`had_out` (sum of partials, Hadamard-128, fp16, * svh). Larger m: W_hat reconstructed in column slices + cuBLAS,
then the output rotation. Same-input groups and the one-launch form are in kernels/groups.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sglang_exl3.format.constants import Codebook
from sglang_exl3.kernels.checks import check_act, check_fp16, check_tiles, k2_of
from sglang_exl3.kernels.dispatch import (
    CROSSOVERS,
    MMA_RING_MODES,
    WGMMA_RING_MODES,
    auto_xs_splits,
    default_splits,
    fused_crossover_m,
    plan_linear,
    use_xs,
    xs_fits,
    xs_splits,
)
from sglang_exl3.kernels.library import HAD_FORMS, check, load_library, stream


def prepare(trellis: torch.Tensor) -> torch.Tensor:
    """The kernels' weight layout: checkpoint trellis [K/16, N/16, words] -> [N/16, K/16, words], so that the
    tiles one warp walks down K are one contiguous stream (done once at load; same bytes)."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"expected an int16 trellis [K/16, N/16, words], got {trellis.dtype} {tuple(trellis.shape)}")
    return trellis.permute(1, 0, 2).contiguous()


def reconstruct(tiles: torch.Tensor, codebook: Codebook, col_tiles: tuple[int, int] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat fp16 [K, N] (or the column tiles [t0, t0+count)) from prepare()d weights; bit-identical to the
    reference codec."""
    check_tiles(tiles)
    nt, kt, _ = tiles.shape
    t0, count = col_tiles or (0, nt)
    if out is None:
        out = torch.empty(kt * 16, count * 16, dtype=torch.float16, device=tiles.device)
    lib = load_library()
    check(lib.exl3_reconstruct(tiles.data_ptr(), out.data_ptr(), kt, nt, t0, count, out.stride(0), k2_of(tiles),
                                int(codebook), stream(tiles)), "reconstruct")
    return out


def had_in(x: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """fp16(had_r_128(x * suh)) for fp16 or bf16 x [m, K] (bit-identical to the codec's had_r_128 with pre_scale on
    x cast to fp16: bf16 is rounded to fp16 as it is read, so the model's bf16 activations need no cast kernel)."""
    check_act("x", x, (x.shape[0], x.shape[-1]))
    check_fp16("suh", suh, (x.shape[1],))
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    check(load_library().exl3_had_in(x.data_ptr(), int(x.dtype == torch.bfloat16), suh.data_ptr(), out.data_ptr(),
                                      x.shape[0], x.shape[1], stream(x)), "had_in")
    return out


def had_out(acc: torch.Tensor, svh: torch.Tensor, out: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """had_r_128(sum over splits of acc [S, m, N] (fp32 or fp16), post_scale=svh) -> [m, N] of `dtype`: fp16, or bf16
    rounded from the fp16 result (what casting it afterwards gives). `out` may be acc itself when there is one fp16
    split (each 128-block is read whole before it is written)."""
    splits, m, n = acc.shape
    if acc.dtype not in (torch.float16, torch.float32) or not acc.is_contiguous():
        raise ValueError(f"acc must be contiguous fp32 or fp16 [splits, m, N], got {acc.dtype}")
    check_fp16("svh", svh, (n,))
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=acc.device)
    else:
        check_act("out", out, (m, n))
    check(load_library().exl3_had_out(acc.data_ptr(), int(acc.dtype == torch.float32), svh.data_ptr(),
                                       out.data_ptr(), int(out.dtype == torch.bfloat16), splits, m, n, stream(acc)),
           "had_out")
    return out


@contextmanager
def pinned_plain_pdl(on: bool) -> Iterator[None]:
    """The three-launch path's rotations and x-slice GEMMs launched inside go as programmatic dependents (True) or
    plain launches (False); SGLANG_EXL3_DEV_PDL_THREE_LAUNCH sets it for the process when the library loads. The same
    bits either way; for A/B measurements and tests. A CUDA graph keeps the launches it was captured with."""
    lib = load_library()
    before = lib.exl3_set_plain_pdl(int(on))
    try:
        yield
    finally:
        lib.exl3_set_plain_pdl(before)


@contextmanager
def pinned_had_form(form: str) -> Iterator[None]:
    """Every rotation launched inside (had_in, had_out and a group's rotations) takes `form`: 'warp' (one warp per
    128-block, shuffle butterflies), 'octet' (eight threads per 128-block, registers and one shared-memory
    transpose) or 'auto' (octet from a size; the default). Both forms give the same bits; this is for A/B
    measurements and tests. A CUDA graph keeps the form it was captured with."""
    if form not in HAD_FORMS:
        raise ValueError(f"rotation form must be one of {sorted(HAD_FORMS)}, got {form!r}")
    lib = load_library()
    before = lib.exl3_set_had_form(HAD_FORMS[form])
    try:
        yield
    finally:
        lib.exl3_set_had_form(before)


def gemm_rotated_partial(xh: torch.Tensor, tiles: torch.Tensor, codebook: Codebook,
                         splits: int | None = None, xs: bool | None = None, ring: int = 0) -> torch.Tensor:
    """fp32 split-K partials [S, m, N] of xh (fp16 [m, K], rotated) @ W_hat (prepare()d weights); m <= 64.
    `xs`: stage x in shared memory (None: `use_xs`); the partials are the same bit for bit.
    `ring` (a dispatch.RingMode): stream x through a shared-memory ring instead (any m; N a multiple of 128): on
    mma.sync in 64-row blocks, the same partials at equal splits; on wgmma (wgmma_ready() builds) in blocks of
    wg_block_rows(m) rows, within fp32 summation order."""
    check_tiles(tiles)
    nt, kt, _ = tiles.shape
    m = xh.shape[0]
    if xh.dtype != torch.float16 or not xh.is_contiguous() or xh.shape[1] != kt * 16:
        raise ValueError(f"xh must be contiguous fp16 [m, {kt * 16}], got {xh.dtype} {tuple(xh.shape)}")
    if ring:
        return _gemm_ring(xh, tiles, codebook, splits or default_splits(kt, nt, xh.device), ring)
    if m > CROSSOVERS.fused_max_m:
        raise ValueError(f"the fused EXL3 kernel takes at most {CROSSOVERS.fused_max_m} rows, got {m}")
    if xs and nt % 4:
        raise ValueError(f"x in shared memory takes N % 64 == 0, got N={nt * 16}")
    if xs is None and not splits:  # the policy
        splits = auto_xs_splits(m, kt, nt, codebook, xh.device)
        xs = splits is not None
    elif xs is None:  # a caller's own splits keep global loads where their slice is too long
        xs = use_xs(m, codebook) and nt % 4 == 0 and xs_fits(m, -(-kt // splits))
    if not splits:
        splits = default_splits(kt, nt, xh.device)
        if xs:
            chosen = xs_splits(m, kt, nt, splits)
            xs, splits = (True, chosen) if chosen else (False, splits)
    partial = torch.empty(splits, m, nt * 16, dtype=torch.float32, device=xh.device)
    fn = load_library().exl3_gemm_partial_xs if xs else load_library().exl3_gemm_partial
    check(fn(xh.data_ptr(), tiles.data_ptr(), partial.data_ptr(), m, kt, nt, splits, k2_of(tiles), int(codebook),
              stream(xh)), "gemm")
    return partial


def _check_ring(mode: int, n_tiles: int) -> None:
    if mode not in MMA_RING_MODES + WGMMA_RING_MODES or n_tiles % 8:
        modes = [int(r) for r in MMA_RING_MODES + WGMMA_RING_MODES]
        raise ValueError(f"the x-ring GEMM takes a mode in {modes} and N % 128 == 0, got mode {mode} and "
                         f"N={n_tiles * 16}")


def _gemm_ring(xh: torch.Tensor, tiles: torch.Tensor, codebook: Codebook, splits: int, mode: int) -> torch.Tensor:
    nt, kt, _ = tiles.shape
    _check_ring(mode, nt)
    m = xh.shape[0]
    partial = torch.empty(splits, m, nt * 16, dtype=torch.float32, device=xh.device)
    check(load_library().exl3_gemm_partial_ring(xh.data_ptr(), tiles.data_ptr(), partial.data_ptr(), m, kt, nt,
                                                 splits, k2_of(tiles), int(codebook), mode, stream(xh)), "gemm")
    return partial


def exl3_linear(x: torch.Tensor, tiles: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                codebook: Codebook, splits: int | None = None, path: str | None = None,
                fused_max_m: int | None = None) -> torch.Tensor:
    """y [m, N] = had(had(x * suh) @ W_hat) * svh for fp16 or bf16 x [m, K] (y of x's dtype, bf16 rounded from the
    fp16 result) and prepare()d weights.
    `path`: None (dispatch.plan_linear: the fused GEMMs up to `fused_max_m` rows, default fused_crossover_m(), the x
    ring where it serves, else reconstruct + cuBLAS), 'fused' (the x-slice / global-load GEMM, m <= 64) or
    'reconstruct' (W_hat in column slices, cuBLAS, then the output rotation). `splits` given with no path: the fused
    GEMM at those splits up to the crossover, without the ring."""
    m = x.shape[0]
    xh = had_in(x.contiguous(), suh)
    xs, ring = None, 0
    if path is None and not splits:
        plan = plan_linear(m, tiles.shape[1], tiles.shape[0], codebook, x.device, fused_max_m)
        path, ring, splits, xs = plan.path, plan.ring, plan.splits, plan.xs
    elif path is None:
        crossover = fused_crossover_m(x.device) if fused_max_m is None else fused_max_m
        path = "fused" if m <= crossover else "reconstruct"
    if path == "fused":
        return had_out(gemm_rotated_partial(xh, tiles, codebook, splits, xs=xs, ring=ring), svh, dtype=x.dtype)
    if path != "reconstruct":
        raise ValueError(f"unknown EXL3 linear path {path!r} (None, 'fused' or 'reconstruct')")
    nt, kt, _ = tiles.shape
    y = torch.empty(1, m, nt * 16, dtype=torch.float16, device=x.device)
    cols = max(8, CROSSOVERS.reconstruct_slice_bytes // (kt * 16 * 2) // 128 * 8)  # column tiles per slice
    scratch = torch.empty(kt * 16, min(cols, nt) * 16, dtype=torch.float16, device=x.device)
    for t0 in range(0, nt, cols):
        count = min(cols, nt - t0)
        w = scratch[:, : count * 16]
        if count * 16 != scratch.shape[1]:
            w = torch.empty(kt * 16, count * 16, dtype=torch.float16, device=x.device)
        reconstruct(tiles, codebook, (t0, count), out=w)
        torch.matmul(xh, w, out=y[0, :, t0 * 16:(t0 + count) * 16])
    return had_out(y, svh, dtype=x.dtype)
