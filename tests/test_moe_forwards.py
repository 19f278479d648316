"""Our MoE forwards on the CPU: expert-sorted tiles (kernels/moe_sorted.py: the plan's placement of every
(token, expert) pair, the group table the kernels read) and per-pair sources (kernels/moe_routed.py), each whole
forward against the codec, with the group launches emulated from the tables (what the CUDA kernels compute per
source, through the codec) and the table and glue kernels' own code run on the host."""

from __future__ import annotations

import pytest
import torch
from moe_reference import codec_moe

from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.format import Codebook
from sglang_exl3.kernels import dense, dispatch, groups, moe_tables
from sglang_exl3.kernels.moe_sorted import max_tiles, sorted_plan, sorted_tables


def _routing(tokens: int, topk: int, experts: int, seed: int, drop: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
    ids.view(-1)[torch.randperm(ids.numel(), generator=gen)[:drop]] = -1  # other EP ranks' experts
    return ids


@pytest.mark.parametrize("tokens, topk, experts, tile", [(1, 2, 6, 8), (13, 3, 6, 8), (40, 8, 128, 8), (9, 2, 4, 1)])
def test_plan_places_every_pair_in_a_tile_of_its_expert(tokens, topk, experts, tile):
    ids = _routing(tokens, topk, experts, seed=tokens)
    plan = sorted_plan(ids.reshape(-1), experts, tile)
    flat = ids.reshape(-1).long()
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=experts)
    assert int(plan.filled) == int(((counts + tile - 1) // tile).sum()) <= plan.sources
    assert plan.sources == max_tiles(flat.numel(), experts, tile)
    rows = plan.rows[valid]
    assert rows.unique().numel() == rows.numel() and bool((rows < plan.filled * tile).all())
    assert bool((plan.experts[rows // tile] == flat[valid]).all())  # each pair's tile belongs to its expert
    assert bool((plan.rows[~valid] == plan.sources * tile).all())  # ids below 0: the dump row, no tile
    filled = int(plan.filled)
    assert bool((plan.experts[1:filled] >= plan.experts[:filled - 1]).all())  # experts in order
    for x in flat[valid].unique():  # an expert's pairs keep their order: its rows rise with the pair index
        r = plan.rows[flat == x]
        assert bool((r[1:] > r[:-1]).all())


def test_plan_of_no_pairs_is_empty():
    """A routing with no pairs (an empty batch slice) plans no tiles rather than failing."""
    plan = sorted_plan(torch.zeros(0, dtype=torch.int32), 8, 16)
    assert plan.rows.numel() == 0 and int(plan.filled) == 0 and plan.sources == max_tiles(0, 8, 16)


def test_table_owns_items_for_filled_tiles_only():
    """Two banks over a plan with empty sources: per-source fields (unsplit: the tiles give the parallelism), and
    the items of the second bank start right after the first bank's filled tiles (the kernels binary-search
    item_begin; empty sources own none)."""
    experts, tile = 5, 8
    banks = [moe_tables.Exl3ExpertBank(
            rows=moe_tables.bank_rows([(100 * b + e, 200 + e, 300 + e) for e in range(experts)], nt, sp),
                               n_tiles=nt, k_tiles=16, splits=sp, k2=4, codebook=1)
             for b, (nt, sp) in enumerate(((48, 8), (16, 2)))]
    ids = torch.tensor([[0, 3], [3, 1], [4, 3], [-1, 0]], dtype=torch.int32)
    plan = sorted_plan(ids.reshape(-1), experts, tile)
    (t,) = sorted_tables([banks], plan)
    table, items, cols, part = t.table, t.items, t.cols, t.part
    s, filled = plan.sources, int(plan.filled)
    assert filled == 4 and s == max_tiles(8, experts, tile) == 6  # experts 0, 1, 3, 4: one tile each
    assert (items, cols, part) == (s * (48 + 16), s * (768 + 256), s * (768 + 256))
    for b, nt in enumerate((48, 16)):
        block = table[b * s:(b + 1) * s]
        assert block[:filled, 0].tolist() == [100 * b + e for e in (0, 1, 3, 4)]
        assert block[:filled, 3].tolist() == [groups.pack_tiles_splits(nt, 1)] * filled
        assert block[filled:, 3].tolist() == [groups.pack_tiles_splits(0, 1)] * (s - filled)
        assert block[:, 4].tolist() == [i * tile for i in range(s)]
    first_up_item = filled * 48
    assert table[:s, 5].tolist() == [i * 48 for i in range(filled)] + [first_up_item] * (s - filled)
    assert table[s:, 5].tolist() == [first_up_item + i * 16 for i in range(filled)] + \
        [first_up_item + filled * 16] * (s - filled)
    assert table[s:, 6].tolist() == [s * 768 + i * 256 for i in range(s)]
    assert table[:, 7].tolist() == table[:, 6].tolist()  # unsplit: a source's partials are its columns


def test_split_table_numbers_items_and_partials_per_split():
    """With K splits (split_k), a filled tile owns n_tiles x splits work items and splits [tile, N] partial blocks,
    while its output columns stay where they were; empty tiles still own none."""
    experts, tile, k_splits = 5, 8, 3
    banks = [moe_tables.Exl3ExpertBank(
            rows=moe_tables.bank_rows([(100 * b + e, 200 + e, 300 + e) for e in range(experts)], nt, 1),
                               n_tiles=nt, k_tiles=48, splits=1, k2=4, codebook=1)
             for b, nt in enumerate((48, 16))]
    plan = sorted_plan(torch.tensor([0, 3, 3, 1, 4, 3, -1, 0], dtype=torch.int32), experts, tile)
    (t,) = sorted_tables([banks], plan, splits=[k_splits])
    table, s, filled = t.table, plan.sources, int(plan.filled)
    assert (t.items, t.cols, t.part) == (s * 64 * k_splits, s * 1024, s * 1024 * k_splits)
    assert table[:filled, 3].tolist() == [groups.pack_tiles_splits(48, k_splits)] * filled
    assert table[filled:s, 3].tolist() == [groups.pack_tiles_splits(0, k_splits)] * (s - filled)
    first_up_item = filled * 48 * k_splits
    assert table[:s, 5].tolist() == [i * 48 * k_splits for i in range(filled)] + [first_up_item] * (s - filled)
    assert table[s:, 5].tolist() == [first_up_item + i * 16 * k_splits for i in range(filled)] + \
        [first_up_item + filled * 16 * k_splits] * (s - filled)
    assert table[s:, 6].tolist() == [s * 768 + i * 256 for i in range(s)]
    assert table[s:, 7].tolist() == [s * 768 * k_splits + i * 256 * k_splits for i in range(s)]


@pytest.mark.slow
@pytest.mark.parametrize("tokens, topk, experts, tile", [(40, 8, 12, 8), (9, 2, 4, 1), (30, 3, 6, 16)])
def test_library_tables_equal_the_torch_reference(compiled_lib, monkeypatch, tokens, topk, experts, tile):
    """sorted_tables in one library launch (its host mode: the kernel's own per-row code) against the torch
    reference, for the fused forward's two groups (gate + up, down) and R7's three (gate, up, down) of unequal widths,
    unsplit and split along K, with ids of -1 and empty sources."""
    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", str(compiled_lib))
    gate, up, down = (moe_tables.Exl3ExpertBank(rows=moe_tables.bank_rows([(1000 * r + e, 2000 * r + e, 3000 * r + e)
                                                            for e in range(experts)], nt, 1),
                                        n_tiles=nt, k_tiles=16, splits=1, k2=4, codebook=1)
                      for r, nt in enumerate((48, 40, 16)))
    plan = sorted_plan(_routing(tokens, topk, experts, seed=tokens).reshape(-1), experts, tile)
    assert int(plan.filled) < plan.sources  # some sources are empty
    for bank_groups, splits in (([[gate, up], [down]], None), ([[gate, up], [down]], [2, 4]),
                                ([[gate], [up], [down]], None), ([[gate], [up], [down]], [1, 2, 3])):
        want = sorted_tables(bank_groups, plan, splits=splits)
        got = sorted_tables(bank_groups, plan, moe_tables.sorted_table_builder(on_host=True), splits)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(g.table, w.table) and (g.items, g.cols, g.part) == (w.items, w.cols, w.part)


@pytest.mark.slow
@pytest.mark.parametrize("tokens, topk, experts, tile", [(40, 8, 12, 8), (9, 2, 4, 1), (300, 8, 128, 16),
                                                         (700, 6, 1024, 8), (3, 1, 1, 64)])
def test_library_plan_equals_the_torch_reference(compiled_lib, monkeypatch, tokens, topk, experts, tile):
    """The one-launch sorted plan (its host code) against torch_sorted_plan: rows, each tile's expert and the filled
    count, for int32 and int64 ids, with ids of -1 and one past the last expert (no tile, the dump row)."""
    from sglang_exl3.kernels.moe_sorted import torch_sorted_plan

    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", str(compiled_lib))
    ids = _routing(tokens, topk, experts, seed=tokens).reshape(-1)
    ids[ids.numel() // 2] = experts  # outside [0, experts): another rank's expert
    for dtype in (torch.int32, torch.int64):
        want = torch_sorted_plan(ids.to(dtype), experts, tile)
        rows, src_expert, filled = moe_tables.sorted_plan_launch(ids.to(dtype), experts, tile, want.sources)
        assert torch.equal(rows, want.rows) and torch.equal(src_expert, want.experts), (dtype, tokens)
        assert int(filled) == int(want.filled)


def test_tile_rows_follow_the_mean_pairs_per_expert():
    from sglang_exl3.kernels.moe_sorted import tile_rows

    assert tile_rows(128, 128) == 8  # Qwen3-30B-A3B at m = 16: one pair per expert on average
    assert tile_rows(512 * 8, 128) == 32 and tile_rows(4096 * 8, 128) == 64 and tile_rows(3, 5) == 8


def _emulated_group(experts_by_ptr: dict[int, tuple], codebook: Codebook):
    """What exl3_group_linear computes from a table, source by source, through the codec: out[r, col_begin + n] =
    linear_e(x[x_row + r])[n] for every non-empty source (empty ones write nothing)."""

    def run(x, table, num, m, k_tiles, items, cols, part, k2, cb):
        out = torch.full((m, cols), float("nan"), dtype=torch.float16)
        for row in table.tolist():
            n_tiles = row[3] & 0xFFFFFFFF
            if n_tiles == 0:
                continue
            tiles, suh, svh = experts_by_ptr[row[0]]
            y = exl3_linear_reference(x[row[4]:row[4] + m], tiles.permute(1, 0, 2), suh, svh, codebook)
            out[:, row[6]:row[6] + n_tiles * 16] = y
        return out
    return run


@pytest.fixture(scope="module")
def compiled_lib(compiled_library):
    """The glue kernels' host code: the library compiled once per test run (conftest.compiled_library)."""
    return compiled_library


@pytest.mark.slow
@pytest.mark.parametrize("path", ["sorted", "routed"])
@pytest.mark.parametrize("tokens, topk, gelu, bits", [(7, 2, False, (3, 3, 3)), (20, 3, True, (3, 3, 3)),
                                                      (11, 2, False, (3, 4, 5)), (9, 3, True, (5, 3, 4))])
def test_moe_forward_equals_the_codec(compiled_lib, monkeypatch, path, tokens, topk, gelu, bits):
    """`bits` per role (gate, up, down): R7 checkpoints give gate and up their own bitrates, which run as two
    groups."""
    from sglang_exl3.kernels.moe_routed import routed_moe
    from sglang_exl3.kernels.moe_sorted import sorted_moe

    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", str(compiled_lib))
    hidden, inter, experts, cb = 256, 128, 5, Codebook.MCG
    gen = torch.Generator().manual_seed(tokens)
    weights = []  # per expert: (trellis [K/16, N/16, words], suh, svh) per role
    for _ in range(experts):
        weights.append([(torch.randint(-32768, 32768, (k // 16, n // 16, 16 * b), generator=gen, dtype=torch.int16),
                         (torch.randn(k, generator=gen) * 0.1).half(), (torch.randn(n, generator=gen) * 0.1).half())
                        for (k, n), b in zip(((hidden, inter), (hidden, inter), (inter, hidden)), bits, strict=True)])
    by_ptr, banks = {}, []
    for r in range(3):
        tiles = [dense.prepare(w[r][0]) for w in weights]
        for e, t in enumerate(tiles):
            by_ptr[t.data_ptr()] = (t, weights[e][r][1], weights[e][r][2])
        nt, kt = tiles[0].shape[:2]
        pointers = [(t.data_ptr(), w[r][1].data_ptr(), w[r][2].data_ptr())
                    for t, w in zip(tiles, weights, strict=True)]
        rows = moe_tables.bank_rows(pointers, nt, 2)
        banks.append(moe_tables.Exl3ExpertBank(
                rows=rows, n_tiles=nt, k_tiles=kt, splits=2, k2=2 * bits[r], codebook=int(cb),
                                       sources=(tuple(tiles),)))
    x = torch.randn(tokens, hidden, generator=gen).half()
    ids = _routing(tokens, topk, experts, seed=tokens + 1)
    w = torch.rand(tokens, topk, generator=gen)
    run = _emulated_group(by_ptr, cb)
    if path == "sorted":
        got = sorted_moe(x, ids, w, *banks, gelu, run=run, fused=False)
    else:
        got = routed_moe(x, ids, w, *banks, gelu, run=run, build=moe_tables.routed_table_builder(on_host=True),
                         fused=False)

    want = codec_moe(x, ids, w, weights, cb, gelu)
    assert not torch.isnan(got).any()
    assert torch.allclose(got, want, rtol=2e-3, atol=2e-4), (got - want).abs().max()


@pytest.mark.slow
def test_kernel_lookup_skips_empty_sources(compiled_lib, monkeypatch):
    """The library's own source lookup (host probe) over a sorted table: the up bank's first item lands on its
    first tile, not on the gate bank's empty sources that share its item_begin; items past the filled tiles land
    on an empty source (n_tiles 0: the GEMM returns at once); columns stay static per source."""
    import ctypes

    monkeypatch.setenv("SGLANG_EXL3_KERNEL_LIB", str(compiled_lib))  # the tables from the library's own launch
    lib = ctypes.CDLL(str(compiled_lib))
    lib.exl3_group_probe.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                                     ctypes.c_void_p]
    banks = [moe_tables.Exl3ExpertBank(
            rows=moe_tables.bank_rows([(100 * b + e, 200 + e, 300 + e) for e in range(5)], 48, 8),
                               n_tiles=48, k_tiles=16, splits=8, k2=4, codebook=1) for b in range(2)]
    plan = sorted_plan(torch.tensor([0, 3, 3, 1, 4, 3, -1, 0], dtype=torch.int32), 5, 8)
    (t,) = sorted_tables([banks], plan, moe_tables.sorted_table_builder(on_host=True))
    table, items, cols = t.table, t.items, t.cols
    s, filled, per = plan.sources, int(plan.filled), 48  # unsplit: one item per column tile

    def probe(item, col):
        out = torch.zeros(7, dtype=torch.int64)
        assert lib.exl3_group_probe(table.data_ptr(), table.shape[0], item, col, out.data_ptr()) == 0
        return out.tolist()

    assert probe(filled * per, 0)[0] == s and probe(filled * per, 0)[2] == 48  # up's first tile
    assert probe(filled * per - 1, 0)[0] == filled - 1  # gate's last filled tile
    past = probe(2 * filled * per, 0)
    assert past[0] >= s + filled and past[2] == 0  # an empty source: no work
    assert probe(0, (s + 2) * 768 + 5)[1] == s + 2  # columns: static, source by source
    assert items == 2 * s * per and cols == 2 * s * 768


def test_fused_moe_stages_x_in_shared_memory_by_the_group_policy():
    """Which of the fused forward's two GEMMs stage x in shared memory: sorted tiles of 8+ rows (MCG) and per-pair
    sources of MUL1, each while its K slice fits XS_GROUP_SMEM_BYTES (Qwen3-30B-A3B: gate/up K = 2048, down 768)."""
    from sglang_exl3.kernels.moe_ops import MoeTables
    from sglang_exl3.kernels.moe_tables import Exl3ExpertBank

    def bank(k_tiles: int, cb: Codebook) -> Exl3ExpertBank:
        return Exl3ExpertBank(rows=torch.zeros(4, 8, dtype=torch.int64), n_tiles=48, k_tiles=k_tiles, splits=1, k2=8,
                              codebook=int(cb))

    def slices(rows: int, cb: Codebook) -> tuple[int, int]:
        t = MoeTables(gate_up=torch.empty(0), down=torch.empty(0), sources=4, rows=rows, gate_up_items=4,
                      gate_up_partial=4, down_items=4, down_partial=4, gate_up_slice=128, down_slice=48)
        return t.xs_slices(bank(128, cb), bank(48, cb))

    assert slices(1, Codebook.MCG) == (0, 0)  # per pair, MCG: global loads
    assert slices(1, Codebook.MUL1) == (128, 48)
    assert slices(8, Codebook.MCG) == (128, 48)
    assert slices(16, Codebook.MCG) == (128, 48)  # 16 x 4,112 B = 66 KB
    assert slices(32, Codebook.MCG) == (0, 48)  # gate/up 131 KB: too long a slice; down 50 KB
    assert slices(64, Codebook.INST3) == (0, 0)

def test_shared_memory_x_splits_keep_the_partials_bounded():
    """The split count raised for the x slice stops at XS_PARTIAL_BYTES of fp32 partials; past that the slice grows
    up to the kernel's shared memory, else no shared-memory x at all (a 151936-wide lm_head at 64 rows)."""
    assert dispatch.xs_splits(16, 256, 896, 5) == 6  # 4096x14336: the 24 KB budget's 6 splits, 5.5 MB of partials
    assert dispatch.xs_splits(64, 256, 896, 5) == 12  # 48 KB budget, 44 MB of partials
    s = dispatch.xs_splits(64, 320, 1728, 5)  # 5120x27648: the budget wants 14 splits (99 MB); the cap allows 9
    assert s == 9 and s * 64 * 27648 * 4 <= dispatch.CROSSOVERS.xs_partial_bytes
    assert dispatch.xs_smem(64, -(-320 // s)) <= 96 << 10
    assert dispatch.xs_splits(64, 256, 9496, 1) is None  # lm_head: 1 split (39 MB) leaves a 526 KB slice
    s = dispatch.xs_splits(32, 256, 9496, 1)  # at 32 rows: 3 splits, an 88 KB slice
    assert s == 3 and dispatch.xs_smem(32, -(-256 // s)) <= 96 << 10


def test_sorted_splits_only_where_the_tiles_leave_the_sms_idle():
    """sorted_splits on the two measured shapes (132 SMs): Mixtral's down projection (K = 14336, 256 column strips)
    splits while its few tiles fill less than a wave; the Qwen3-30B-A3B layer, sorted from 64 tiles, stays unsplit."""
    from sglang_exl3.kernels.moe_sorted import sorted_splits

    def bank(k_tiles: int, n_tiles: int) -> moe_tables.Exl3ExpertBank:
        return moe_tables.Exl3ExpertBank(rows=torch.zeros(8, 8, dtype=torch.int64), n_tiles=n_tiles, k_tiles=k_tiles,
                                 splits=1, k2=8, codebook=1)

    cpu = torch.device("cpu")
    mixtral_down, mixtral_gate = bank(896, 256), bank(256, 896)
    assert [sorted_splits(mixtral_down, s, cpu) for s in (2, 4, 8, 10)] == [8, 4, 2, 1]
    assert sorted_splits(mixtral_gate, 2 * 2, cpu) == 1  # gate and up of 2 tiles: 3,584 strips already
    assert sorted_splits(bank(48, 128), 64, cpu) == sorted_splits(bank(128, 48), 2 * 64, cpu) == 1
