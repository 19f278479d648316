"""Our CUDA kernel library on a machine without a GPU: the weight layout, the loader's errors, and (where
nvcc exists) that the source compiles and its C ABI rejects bad arguments before touching a device."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sglang_exl3.kernels import abi, build, dense, dispatch, groups, library, moe_ops, moe_tables


def test_prepare_puts_each_column_strip_contiguous():
    trellis = torch.randint(-32768, 32768, (3, 5, 64), dtype=torch.int16)
    tiles = dense.prepare(trellis)
    assert tiles.shape == (5, 3, 64) and tiles.is_contiguous()
    for tk in range(3):
        for tn in range(5):
            assert torch.equal(tiles[tn, tk], trellis[tk, tn])
    with pytest.raises(ValueError, match="int16 trellis"):
        dense.prepare(trellis.float())


def test_missing_library_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SGLANG_EXL3_KERNEL_LIB", raising=False)
    with pytest.raises(library.KernelLibraryUnavailable, match="build-kernels.*SGLANG_EXL3_KERNEL_LIB"):
        library.load_library(build=False)


def test_no_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(library, "find_nvcc", lambda: None)
    with pytest.raises(library.KernelLibraryUnavailable, match="nvcc not found.*SGLANG_EXL3_KERNEL_LIB"):
        library.build_library(out=tmp_path / "lib.so", arch="90")
    monkeypatch.setattr(library, "find_nvcc", lambda: "/bin/true")
    with pytest.raises(library.KernelLibraryUnavailable, match="sm_80 or newer"):
        library.build_library(out=tmp_path / "lib.so", arch="75")


def test_development_build_never_lands_in_the_servers_cache():
    with pytest.raises(ValueError, match="4-bit-MCG-only.*explicit `out`"):
        library.build_library(arch="90", only_4bit_mcg=True)


@pytest.fixture(scope="module")
def compiled(compiled_library):
    """The kernel library compiled once per test run (conftest.compiled_library), loaded for the tests below."""
    lib = ctypes.CDLL(str(compiled_library))
    abi.bind(lib)
    return lib


def _probe(lib, table: torch.Tensor, item: int, col: int) -> list[int]:
    out = torch.zeros(7, dtype=torch.int64)
    assert lib.exl3_group_probe(table.data_ptr(), table.shape[0], item, col, out.data_ptr()) == 0
    return out.tolist()


@pytest.mark.slow
def test_source_compiles_and_abi_rejects_bad_arguments(compiled):
    """Catches a kernel source that no longer compiles before a GPU run."""
    lib = compiled
    assert lib.exl3_abi_digest().decode() == abi.digest()
    # shape checks come before any CUDA call, so these run without a GPU
    assert lib.exl3_gemm_partial(None, None, None, 1, 16, 4, 17, 8, 1, None) == -3  # splits > K tiles
    assert lib.exl3_gemm_partial(None, None, None, 0, 16, 4, 1, 8, 1, None) == -3  # m = 0
    assert lib.exl3_reconstruct(None, None, 4, 4, 2, 3, 64, 8, 1, None) == -3  # column tiles past N
    assert lib.exl3_reconstruct(None, None, 4, 4, 0, 4, 64, 9, 1, None) == -1  # 4.5 bits in MCG: unsupported
    assert b"unsupported" in lib.exl3_error_string(-1)
    assert lib.exl3_gemm_partial_xs(None, None, None, 65, 16, 4, 1, 8, 1, None) == -3  # x in smem: m <= 64
    assert lib.exl3_gemm_partial_xs(None, None, None, 4, 16, 6, 1, 8, 1, None) == -3  # N tiles not a multiple of 4
    assert lib.exl3_gemm_partial_xs(None, None, None, 16, 256, 4, 1, 8, 1, None) == -3  # 131 KB x slice > 96 KB
    assert lib.exl3_gemm_partial_ring(None, None, None, 16, 16, 8, 1, 8, 1, 42, None) == -3  # not a built mode
    assert lib.exl3_gemm_partial_ring(None, None, None, 16, 16, 4, 1, 8, 1, 81, None) == -3  # N tiles % 8
    assert lib.exl3_gemm_partial_ring(None, None, None, 0, 16, 8, 1, 8, 1, 82, None) == -3  # m = 0
    assert lib.exl3_gemm_partial_ring(None, None, None, 16, 16, 8, 1, 9, 1, 81, None) == -1  # 4.5 bits in MCG
    # the wgmma ring: refused as unsupported until exl3_wgmma_available() has found it (never, without a GPU)
    assert lib.exl3_gemm_partial_ring(None, None, None, 16, 16, 8, 1, 8, 1, 92, None) == -1
    assert lib.exl3_gemm_partial_ring(None, None, None, 16, 16, 4, 1, 8, 1, 91, None) == -3  # N tiles % 8
    assert lib.exl3_gemm_partial_ring(None, None, None, 16, 16, 8, 1, 8, 1, 93, None) == -3  # not a built mode

    def one_launch(m=1, k_tiles=16, items=8, cols=128, k2=8, counters=1, xs_slice=16):
        return lib.exl3_linear_decode(None, 0, None, 1, None, None, counters, None, m, k_tiles, items, cols, k2, 1,
                                      xs_slice, 1, None)

    assert one_launch(m=0) == one_launch(m=17) == -3  # 1-16 rows
    assert one_launch(k_tiles=12) == -3  # K not whole 128-blocks
    assert one_launch(cols=192) == -3  # output not whole 128-blocks
    assert one_launch(xs_slice=12) == -3  # a slice of a partial 128-block
    assert one_launch(counters=0) == -3  # fewer counters than 128-column blocks
    assert one_launch(items=12) == -3  # a block's 8 warps would straddle sources
    assert one_launch(m=16, k_tiles=256, xs_slice=256) == -3  # 131 KB x slice > 96 KB
    assert one_launch(k2=9) == -1  # 4.5 bits in MCG

    def rotating(m=64, total_items=256, total_cols=1024):  # pointers never read: refused before launching
        return lib.exl3_group_linear_rotating(None, 0, None, 1, None, None, 0, m, 16, total_items, total_cols, 8, 1,
                                              None)

    assert rotating(m=65) == rotating(m=0) == -3  # 1-64 rows
    assert rotating(total_items=204) == rotating(total_cols=1000) == -3  # whole 8-warp blocks; 128 columns
    assert rotating() == -1  # past the checks: no wgmma (the probe has not run here)
    # the rotated slab's glue launches check their shapes before launching
    assert lib.exl3_slab_rot_in(None, 0, None, 4, 10, 4, None, None, None, 256, None) == -3  # pairs not whole tokens
    assert lib.exl3_slab_rot_in(None, 0, None, 4, 8, 4, None, None, None, 192, None) == -3  # K not whole blocks
    assert lib.exl3_slab_rot_in(None, 0, None, 2, 8, 4, None, None, None, 256, None) == -3  # 16-bit ids
    assert lib.exl3_slab_mid(None, None, 4, 0, None, None, None, None, 256, 0, None) == -3  # no pairs
    assert lib.exl3_slab_mid(None, None, 8, 8, None, None, None, None, 96, 0, None) == -3  # N not whole blocks
    assert lib.exl3_slab_tail(None, None, 4, None, None, None, 2, 0, 256, None) == -3  # top-0
    assert lib.exl3_slab_tail(None, None, 4, None, None, None, 2, 4, 320, None) == -3  # H not whole blocks
    one = (ctypes.c_longlong * 6)(1, 48, 0, 0, 0, 1)  # a bank: rows, n_tiles, items, columns, partials, splits
    assert lib.exl3_sorted_tables(one, 0, 1, 1, 4, 8, 1, 1, None) == -3  # no banks
    assert lib.exl3_sorted_tables(one, 1, 1, 1, 0, 8, 1, 1, None) == -3  # no sources
    assert lib.exl3_sorted_tables(one, 1, None, 1, 4, 8, 1, 1, None) == -3  # no tile experts
    assert lib.exl3_sorted_tables((ctypes.c_longlong * 6)(1, 0, 0, 0, 0, 1), 1, 1, 1, 4, 8, 1, 1, None) == -3  # 0 tiles
    no_splits = (ctypes.c_longlong * 6)(1, 48, 0, 0, 0, 0)
    assert lib.exl3_sorted_tables(no_splits, 1, 1, 1, 4, 8, 1, 1, None) == -3


@pytest.mark.slow
def test_group_tables_read_back_as_the_kernels_read_them(compiled):
    """The Python-built tables (same-input groups and routed MoE groups) decoded by the library's own struct and
    source lookup on the host: every work item and output column lands in the source the Python side meant."""
    # same-input group: q/k/v-like widths and split counts
    sources = [(1000, 2000, 3000, 24, 5), (1100, 2100, 3100, 8, 11), (1200, 2200, 3200, 8, 3)]
    rows, items, cols, _ = groups.group_table(sources)
    table = torch.tensor(rows, dtype=torch.int64)
    starts = [0, 24 * 5, 24 * 5 + 8 * 11]
    for s, (_, _, _, nt, sp) in enumerate(sources):
        for item in (starts[s], starts[s] + nt * sp - 1):
            got = _probe(compiled, table, item, sum(x[3] for x in sources[:s]) * 16)
            assert got[:6] == [s, s, nt, sp, 0, starts[s]], (s, item, got)
    assert items == starts[-1] + 8 * 3 and cols == 40 * 16
    # routed group: two banks (gate, up) x 5 pairs, each pair reading its own x row
    banks = [moe_tables.Exl3ExpertBank(
            rows=moe_tables.bank_rows([(10 + e, 20 + e, 30 + e) for e in range(6)], 48, 8), n_tiles=48,
                               k_tiles=128, splits=8, k2=4, codebook=1) for _ in range(2)]
    ids = torch.tensor([5, 0, 3, 3, 1])
    x_rows = torch.tensor([0, 0, 1, 1, 2])  # pair p reads x row p // 2 (top-2 routing)
    table, items, cols, partial, widths = moe_tables.routed_table(banks, ids, 2)
    per_item, per_col = 48 * 8, 48 * 16
    assert table.shape == (10, 8) and items == 10 * per_item and cols == 10 * per_col and widths == [768, 768]
    assert partial == 10 * 8 * 768
    for s in range(10):
        p = s % 5
        got = _probe(compiled, table, s * per_item + per_item // 2, s * per_col + 5)
        assert got == [s, s, 48, 8, int(x_rows[p]), s * per_item, s * 8 * 768], (s, got)
        assert table[s, 0] == 10 + int(ids[p])  # the routed expert's weights


def test_first_use_build_happens_once_across_concurrent_ranks(monkeypatch, tmp_path):
    """Tensor-parallel ranks start together: one builds into the cache under the lock, the others wait and find
    the finished library (the compiler itself is exercised by the nvcc tests above)."""
    import threading
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SGLANG_EXL3_KERNEL_LIB", raising=False)
    calls = []

    def fake_build(out, arch=None, verbose=False):
        calls.append(out)
        time.sleep(0.3)
        out.write_bytes(b"lib")
        return out

    monkeypatch.setattr(library, "build_library", fake_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(library.build_cached_library("90"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0].read_bytes() == b"lib"
    assert results[0] == library.cache_path("90")


def test_auto_build_knob(monkeypatch):
    from sglang_exl3.kernels import backends

    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setenv("SGLANG_EXL3_AUTO_BUILD", "0")
    assert backends._may_build() is False
    monkeypatch.setenv("SGLANG_EXL3_AUTO_BUILD", "")  # blank = unset = default on
    assert backends._may_build() is True
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    assert backends._may_build() is False


def test_unwritable_cache_is_a_clear_unavailable_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder cannot be created under a file
    with pytest.raises(library.KernelLibraryUnavailable, match="XDG_CACHE_HOME.*SGLANG_EXL3_KERNEL_LIB"):
        library.build_cached_library("90")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_routed_table_kernel_code_equals_the_torch_reference(compiled, monkeypatch, dtype):
    """The one-launch table builder's per-source code (run over host memory) writes exactly the rows of the torch
    reference builder, for two banks of different widths, a top-3 routing as SGLang hands it (int32 too) and an
    id of -1 (another EP rank's expert: reads expert 0)."""
    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", compiled._name)
    banks = [moe_tables.Exl3ExpertBank(
            rows=moe_tables.bank_rows([(100 * b + e, 200 + e, 300 + e) for e in range(7)], nt, sp),
                               n_tiles=nt, k_tiles=64, splits=sp, k2=6, codebook=2)
             for b, (nt, sp) in enumerate(((48, 8), (128, 3)))]
    ids = torch.tensor([6, 0, 3, 3, 1, 5, 2, -1, 4], dtype=dtype)
    want = moe_tables.routed_table(banks, ids, 3)
    got = moe_tables.routed_table(banks, ids, 3, moe_tables.routed_table_builder(on_host=True))
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    assert want[0][:, 4].tolist() == [p // 3 for p in range(9)] * 2
    assert want[0][7, 0] == 100 * 0 + 0 and want[0][9 + 7, 0] == 100 * 1 + 0  # -1 reads each bank's expert 0
    assert want[0][9, 0] == 100 + 6  # the second bank's block follows the first's


@pytest.mark.slow
def test_routed_tables_for_both_moe_launches_in_one(compiled, monkeypatch):
    """gate/up (x row = token = pair // top-k) and down (x row = pair) tables built by one launch: each group's
    block numbers its items, columns and partials from 0, the host-run kernel code equals the torch reference."""
    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", compiled._name)
    banks = [moe_tables.Exl3ExpertBank(
            rows=moe_tables.bank_rows([(100 * b + e, 200 + e, 300 + e) for e in range(7)], nt, sp),
                               n_tiles=nt, k_tiles=kt, splits=sp, k2=6, codebook=2)
             for b, (nt, kt, sp) in enumerate(((48, 128, 8), (48, 128, 8), (128, 48, 3)))]
    ids = torch.tensor([6, 0, 3, -1, 1, 5], dtype=torch.int32)
    groups = [(banks[:2], 2), (banks[2:], 1)]
    want, blocks = moe_tables.routed_tables(groups, ids)
    got, same = moe_tables.routed_tables(groups, ids, moe_tables.routed_table_builder(on_host=True))
    assert torch.equal(got, want) and same == blocks
    gu, dn = blocks
    assert (gu.start, gu.num, dn.start, dn.num) == (0, 12, 12, 6)
    assert (gu.items, gu.cols, dn.items, dn.cols) == (12 * 48 * 8, 12 * 768, 6 * 128 * 3, 6 * 2048)
    down = want[dn.start:]
    assert down[:, 4].tolist() == list(range(6)) and want[:6, 4].tolist() == [0, 0, 1, 1, 2, 2]
    assert down[:, 5].tolist() == [p * 128 * 3 for p in range(6)] and down[0, 6] == 0 and down[0, 7] == 0
    assert down[:, 0].tolist() == [200 + e for e in (6, 0, 3, 0, 1, 5)]  # -1 reads expert 0


@pytest.mark.slow
@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul_kernel_code_equals_torch(compiled, monkeypatch, gelu):
    """The MoE activation launch over host memory against torch's own functions on fresh random values: the
    [rows, 2 * sources * n] output of a gate/up group (gate sources first) becomes source-major rows
    [sources * rows, n] of act(gate) * up, fp32 math: within one fp16 rounding (plus, for gelu's far negative
    tail, where 1 + tanh cancels, 1e-5 of |up|: the two tanh implementations differ there), almost always
    identical."""
    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", compiled._name)
    gen = torch.Generator().manual_seed(3 + gelu)
    rows, sources, n = 3, 5, 256
    gate_up = (torch.randn(rows, 2 * sources * n, generator=gen) * 3).half()
    gate = gate_up[:, :sources * n].reshape(rows, sources, n).transpose(0, 1).reshape(sources * rows, n)
    up = gate_up[:, sources * n:].reshape(rows, sources, n).transpose(0, 1).reshape(sources * rows, n)
    act = torch.nn.functional.gelu(gate.float(), approximate="tanh") if gelu else torch.nn.functional.silu(gate.float())
    want = (act * up.float()).half()
    got = moe_ops.act_mul(gate_up, sources, n, gelu)
    ulp = want.float().abs().clamp(min=2 ** -14) * 2 ** -10
    assert got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= ulp + 1e-5 * up.float().abs()).all()
    assert (got == want).float().mean() > 0.99
    with pytest.raises(ValueError, match="gate/up group"):
        moe_ops.act_mul(gate_up.float(), sources, n)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_moe_combine_kernel_code_equals_torch(compiled, monkeypatch, dtype):
    """The weighted top-k combine over host memory against the torch reference, with ids of -1 skipped: rows
    p * n apart, and rows found through an offset per pair (how the sorted path's tiles hold them)."""
    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", compiled._name)
    gen = torch.Generator().manual_seed(9)
    tokens, topk, n = 5, 3, 256
    y = torch.randn(tokens * topk, n, generator=gen).half()
    w = torch.rand(tokens, topk, generator=gen)
    ids = torch.randint(0, 8, (tokens, topk), generator=gen, dtype=dtype)
    ids[1, 2] = ids[4, 0] = -1
    want = (y.float().view(tokens, topk, n) * (w * (ids >= 0)).unsqueeze(-1)).sum(dim=1)
    got = moe_ops.moe_combine(y, w.reshape(-1), ids.reshape(-1), topk, n)
    assert got.shape == (tokens, n) and torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    perm = torch.randperm(tokens * topk, generator=gen)  # pair p's row stored at row perm[p] of a shuffled y
    shuffled = torch.empty_like(y)
    shuffled[perm] = y
    got = moe_ops.moe_combine(shuffled, w.reshape(-1), ids.reshape(-1), topk, n, rows=perm * n)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="moe_combine"):
        moe_ops.moe_combine(y, w.reshape(-1).half(), ids.reshape(-1), topk, n)


def test_a_failed_first_use_build_is_not_retried(monkeypatch, tmp_path):
    """auto: when the first-use build fails, the process falls back once; later layers do not compile again."""
    from sglang_exl3.kernels import backends

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SGLANG_EXL3_KERNEL_LIB", raising=False)
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(backends, "_BUILD_FAILED", [])
    calls = []

    def failing_build(out, arch=None, verbose=False):
        calls.append(out)
        raise library.KernelLibraryUnavailable("nvcc failed on linear (linear/linear.cu)")

    monkeypatch.setattr(library, "build_library", failing_build)
    for _ in range(3):
        with pytest.raises(backends.BackendUnavailable, match="not built|nvcc failed"):
            backends._auto_load_our_kernels()
    assert len(calls) == 1 and backends._may_build() is False


@pytest.mark.slow
def test_rotation_form_switch_returns_the_previous_form(compiled):
    """exl3_set_had_form pins the rotation launches' form (0 by size, 1 warp, 2 octet) and rejects others;
    exl3_set_octet_min_items sets the size from which the octet form is taken."""
    lib = compiled
    assert lib.exl3_set_had_form(3) == -3 and lib.exl3_set_had_form(-1) == -3
    assert lib.exl3_set_had_form(2) == 0
    assert lib.exl3_set_had_form(1) == 2
    assert lib.exl3_set_had_form(0) == 1
    before = lib.exl3_set_octet_min_items(-1)  # negative: a query
    assert lib.exl3_set_octet_min_items(77) == before and lib.exl3_set_octet_min_items(before) == 77


@pytest.mark.slow
def test_no_programmatic_launches_without_a_pdl_device(compiled):
    """exl3_pdl_usable: 0 where no device answers (here: no GPU), so every launch stays plain whatever the switches
    ask, and the failed query leaves no CUDA error behind for the next launch's check."""
    lib = compiled
    assert lib.exl3_pdl_usable() == 0
    assert lib.exl3_pdl_usable() == 0  # cached, the same answer


@pytest.mark.slow
def test_plain_pdl_switch_returns_the_previous_setting(compiled):
    """exl3_set_plain_pdl turns the three-launch path's programmatic launches on (1) or off (0), answers a negative
    value without changing anything, and rejects other values."""
    lib = compiled
    assert lib.exl3_set_plain_pdl(2) == -3
    before = lib.exl3_set_plain_pdl(-1)
    assert lib.exl3_set_plain_pdl(1) == before and lib.exl3_set_plain_pdl(-1) == 1
    assert lib.exl3_set_plain_pdl(0) == 1 and lib.exl3_set_plain_pdl(before) == 0


@pytest.mark.slow
@pytest.mark.parametrize("value, code", [("1", 1), ("0", 0), ("", 1)])
def test_three_launch_pdl_knob_is_applied_when_the_library_loads(compiled_library, monkeypatch, value, code):
    monkeypatch.setenv("SGLANG_EXL3_DEV_PDL_THREE_LAUNCH", value)
    lib = library._open_library.__wrapped__(str(compiled_library))
    assert lib.exl3_set_plain_pdl(-1) == code


def test_pinned_rotation_form_names_the_forms():
    with pytest.raises(ValueError, match="auto.*octet.*warp"), dense.pinned_had_form("fast"):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("form, code", [("warp", 1), ("octet", 2), ("auto", 0)])
def test_rotation_form_knob_is_applied_when_the_library_loads(compiled_library, monkeypatch, form, code):
    monkeypatch.setenv("SGLANG_EXL3_DEV_ROTATION_FORM", form)
    lib = library._open_library.__wrapped__(str(compiled_library))
    assert lib.exl3_set_had_form(0) == code
    assert lib.exl3_set_octet_min_items(-1) == dispatch.CROSSOVERS.octet_min_items


def test_ring_mode_takes_the_wgmma_ring_where_it_is_ready(monkeypatch):
    """The ring's mode by m: the wgmma ring (91) from WG_MIN_M rows where the library's probe found it, up to
    WG_MAX_M rows, else the mma.sync ring (82 up to 32 rows, 81 above, up to RING_MAX_M rows); pinned_wgmma and
    SGLANG_EXL3_DEV_WGMMA=off turn it off for A/B."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._WGMMA, 0, True)
    assert [dispatch.ring_mode(m, dev) for m in (16, 32, 33, 128, 256)] == [82, 82, 91, 91, 91]
    assert [dispatch.uses_ring(m, 8, dev) for m in (15, 16, 256, 257)] == [False, True, True, False]
    with dispatch.pinned_wgmma(False):
        assert [dispatch.ring_mode(m, dev) for m in (16, 32, 33, 128)] == [82, 82, 81, 81]
        assert [dispatch.uses_ring(m, 8, dev) for m in (128, 129)] == [True, False]
        with dispatch.pinned_wgmma(True):
            assert dispatch.ring_mode(64, dev) == 91
    monkeypatch.setenv("SGLANG_EXL3_DEV_WGMMA", "off")
    dispatch._wgmma_knob.cache_clear()
    try:
        assert dispatch.ring_mode(64, dev) == 81
    finally:
        monkeypatch.delenv("SGLANG_EXL3_DEV_WGMMA")
        dispatch._wgmma_knob.cache_clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    group = groups.Exl3Group.from_meta(torch.zeros(1, 8, dtype=torch.int64), [1, 16, 8, 128, 0, 8, 16, 0, 0, 0], 1)
    assert [group.runs_fused(m) for m in (16, 64, 65, 256)] == [True, True, False, False]  # then source by source
    with dispatch.pinned_wgmma(False):
        assert [group.runs_fused(m) for m in (65, 128, 129)] == [True, True, False]
    monkeypatch.setitem(dispatch._WGMMA, 0, False)
    assert dispatch.ring_mode(64, dev) == 81
    rows = [dispatch.wg_block_rows(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 300)]
    assert rows == [16, 16, 32, 32, 64, 64, 128, 128, 256, 256]


def test_wgmma_ring_splits_follow_the_measured_cells(monkeypatch):
    """The wgmma ring's split count (ring_splits): half of default_splits up to 64 rows, a quarter above, default_splits
    where that leaves fewer blocks than half the SMs (the fastest measured cells on the H100's 132 SMs, wgmma-ab)."""
    monkeypatch.setattr(dispatch, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    got = {shape: [dispatch.ring_splits(m, *shape, dev, 91) for m in (48, 64, 96, 256)]
           for shape in ((256, 896), (896, 256), (256, 64))}  # K/16, N/16: 4096 x 14336, 14336 x 4096, 4096 x 1024
    assert got == {(256, 896): [3, 3, 1, 1], (896, 256): [8, 8, 4, 4], (256, 64): [16, 16, 16, 16]}
