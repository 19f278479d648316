"""`torch.ops.exl3.gemm`: equals the reference codec and traces under torch.compile(fullgraph=True)."""

import pytest
import torch

from sglang_exl3.codec import exl3_linear_reference
from sglang_exl3.format import Codebook
from sglang_exl3.kernels import Backend, exl3_gemm  # noqa: F401  (registers the op)


def _layer(seed=0, k=256, n=384, bits=3):
    gen = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen, dtype=torch.int16)
    return trellis, (torch.randn(k, generator=gen) * 0.1).half(), (torch.randn(n, generator=gen) * 0.1).half()


def test_op_matches_reference_with_and_without_cached_weight():
    from sglang_exl3.codec import reconstruct

    trellis, suh, svh = _layer()
    x = torch.randn(7, 256).half()
    ref = exl3_linear_reference(x, trellis, suh, svh, Codebook.MCG)
    y = torch.ops.exl3.gemm(x, trellis, suh, svh, None, int(Codebook.MCG), int(Backend.TORCH))
    assert torch.equal(y, ref)
    w_hat = reconstruct(trellis, Codebook.MCG)
    assert torch.equal(torch.ops.exl3.gemm(x, trellis, suh, svh, w_hat, int(Codebook.MCG), int(Backend.TORCH)), ref)


def test_op_traces_with_dynamic_rows_and_no_graph_break():
    trellis, suh, svh = _layer(1)
    w_hat = None

    def forward(x):
        return torch.ops.exl3.gemm(x, trellis, suh, svh, w_hat, int(Codebook.MUL1), int(Backend.TORCH)) * 2

    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend="eager")
    for m in (1, 5, 33):
        x = torch.randn(m, 256).half()
        assert torch.equal(compiled(x), forward(x))


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    trellis, suh, svh = _layer(2)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(9, 256).half())
        t, s1, s2 = (mode.from_tensor(v) for v in (trellis, suh, svh))
        y = torch.ops.exl3.gemm(x, t, s1, s2, None, 2, 0)
        # our CUDA kernels take the trellis in their [N/16, K/16, words] layout (cuda_trellis.prepare)
        from sglang_exl3.kernels.backends import Backend
        from sglang_exl3.kernels.dense import prepare

        y_cuda = torch.ops.exl3.gemm(x, prepare(t), s1, s2, None, 2, int(Backend.CUDA))
    assert tuple(y.shape) == (9, 384) and y.dtype == torch.float16
    assert tuple(y_cuda.shape) == (9, 384) and y_cuda.dtype == torch.float16


def test_group_op_fake_shape_and_trace():
    """The grouped op's output width is the sum of its sources' (kernel-layout) widths, under fake tensors and
    torch.compile with a dynamic row count, so SGLang's piecewise graphs can trace a grouped q/k/v."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang_exl3.kernels.dense import prepare

    srcs = [_layer(3 + i, n=n) for i, n in enumerate((384, 128, 128))]
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 256).half())
        tiles = [prepare(mode.from_tensor(t)) for t, _, _ in srcs]
        suh = [mode.from_tensor(s) for _, s, _ in srcs]
        svh = [mode.from_tensor(v) for _, _, v in srcs]
        table = mode.from_tensor(torch.zeros(3, 8, dtype=torch.int64))
        y = torch.ops.exl3.gemm_group(x, tiles, suh, svh, table, [3, 16, 0, 640, 0, 6], 1)
    assert tuple(y.shape) == (5, 640) and y.dtype == torch.float16

    def forward(x, tiles, table):
        return torch.ops.exl3.gemm_group(x, tiles, suh, svh, table, [3, 16, 0, 640, 0, 6], 1) + 1

    gm = torch.compile(forward, fullgraph=True, dynamic=True, backend="eager")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(7, 256).half())
        out = gm(x, [prepare(t) for t, _, _ in srcs], torch.zeros(3, 8, dtype=torch.int64))
    assert tuple(out.shape) == (7, 640)


def test_group_op_takes_the_fused_launch_up_to_fused_max_m(monkeypatch, request):
    """exl3::gemm_group runs one grouped fused launch up to SGLANG_EXL3_DEV_FUSED_MAX_M rows (the x ring from RING_MIN_M
    rows, whatever the group's K slices) and per-source linears above; which one ran is recorded (the kernels
    themselves need a GPU: tests/gpu/test_cuda_trellis.py)."""
    from sglang_exl3.kernels import dense, dispatch, groups
    from sglang_exl3.kernels.dense import prepare

    ran = []
    monkeypatch.setattr(groups, "group_linear", lambda x, g: (ran.append(("group", g.ring_mode(x.shape[0]))),
                                                              torch.zeros(x.shape[0], 640))[1])
    monkeypatch.setattr(dense, "exl3_linear", lambda x, t, *a: (ran.append("linear"), torch.zeros(x.shape[0],
                                                                                               t.shape[0] * 16))[1])
    srcs = [_layer(3 + i, n=n) for i, n in enumerate((384, 128, 128))]
    tiles, suh, svh = [prepare(t) for t, _, _ in srcs], [s for _, s, _ in srcs], [v for _, _, v in srcs]
    table = torch.zeros(3, 8, dtype=torch.int64)

    def call(m, max_slice=16):  # meta: sources, K/16, items, columns, partials per row, words per tile, max slice
        meta = [3, 16, 0, 640, 0, 6, max_slice, 0, 0, 0]
        return torch.ops.exl3.gemm_group(torch.randn(m, 256).half(), tiles, suh, svh, table, meta, 1)

    for m in (1, 15, 16, 32, 33, 128, 129):
        call(m)
    assert ran == [("group", 0), ("group", 0), ("group", 82), ("group", 82), ("group", 81), ("group", 81)] + [
        "linear"] * 3
    ran.clear()
    long_slice = 52  # Llama-3-8B's gate/up at its load-time splits: 64 rows of x would need 105 KB in a slice
    assert dispatch.xs_smem(64, long_slice) > dispatch.CROSSOVERS.xs_group_smem_bytes
    call(64, long_slice)  # the ring streams x: no slice to fit
    assert ran == [("group", 81)]
    ran.clear()
    request.addfinalizer(dispatch.fused_max_m_knob.cache_clear)  # read once per process: the next test reads afresh
    monkeypatch.setenv("SGLANG_EXL3_DEV_FUSED_MAX_M", "32")
    dispatch.fused_max_m_knob.cache_clear()
    for m in (32, 33):
        assert tuple(call(m).shape) == (m, 640)
    assert ran == [("group", 82)] + ["linear"] * 3


def test_dense_dispatch_takes_the_x_ring_from_16_rows(monkeypatch):
    """exl3_linear's choice by m: the x-slice / global-load GEMM below RING_MIN_M rows, the x ring (its mode and
    half of default_splits, or all of them where half leaves fewer ring blocks than SMs) from there to the knob's
    rows, and the older kernels for a width the ring's 8-warp blocks cannot tile (N % 128 != 0)."""
    from sglang_exl3.kernels import dense, dispatch
    calls = []
    monkeypatch.setattr(dense, "had_in", lambda x, suh: x)
    monkeypatch.setattr(dense, "had_out", lambda acc, svh, dtype=torch.float16: acc[0].to(dtype))
    monkeypatch.setattr(dispatch, "default_splits", lambda kt, nt, device: 5)
    monkeypatch.setattr(dense, "gemm_rotated_partial", lambda xh, tiles, cb, splits, xs=None, ring=0: (
        calls.append((xh.shape[0], ring, splits)), torch.zeros(1, xh.shape[0], tiles.shape[0] * 16))[1])
    monkeypatch.setattr(dense, "reconstruct", lambda tiles, cb, cols, out: calls.append((out.shape, "reconstruct")))
    monkeypatch.setattr(dispatch, "fused_crossover_m", lambda device=None: 128)
    monkeypatch.setattr(dispatch, "sm_count", lambda index: 6)
    tiles = torch.zeros(16, 16, 64, dtype=torch.int16)  # N = 256: 16 column tiles
    suh, svh = torch.zeros(256).half(), torch.zeros(256).half()
    for m in (15, 16, 32, 33, 128):
        dense.exl3_linear(torch.zeros(m, 256).half(), tiles, suh, svh, Codebook.MCG)
    assert calls[1:] == [(16, 82, 3), (32, 82, 3), (33, 81, 3), (128, 81, 3)]  # 16 x 3 / 8 = 6 blocks per 64 rows
    assert calls[0][:2] == (15, 0)
    calls.clear()
    monkeypatch.setattr(dispatch, "sm_count", lambda index: 7)
    for m in (64, 65):
        dense.exl3_linear(torch.zeros(m, 256).half(), tiles, suh, svh, Codebook.MCG)
    assert calls == [(64, 81, 5), (65, 81, 3)]  # 6 blocks < 7 SMs: all 5 splits; two 64-row blocks: 12 blocks
    calls.clear()
    dense.exl3_linear(torch.zeros(16, 256).half(), torch.zeros(12, 16, 64, dtype=torch.int16), suh[:192].clone(),
                   svh[:192].clone(), Codebook.MCG)  # N = 192
    assert calls[0][1] == 0


def test_wgmma_ring_runs_a_group_at_fewer_splits(monkeypatch):
    """A group made at the policy's splits keeps a second set of table rows for the wgmma ring, where every split's
    fp32 partials are written and read back: one split where its 128-column blocks alone cover the SMs (Llama-3-8B
    gate/up, 224 blocks: 5 -> 1), else half of them rounded up (q/k/v, 48 blocks: 16 -> 8). None where nothing
    would change or the blocks would not fill half the SMs.
    group_linear launches those rows on a wgmma mode and the load-time rows on every other path."""
    from sglang_exl3.kernels import dispatch, groups
    monkeypatch.setattr(dispatch, "sm_count", lambda index: 132)
    cpu = torch.device("cpu")
    assert dispatch.wg_splits([256, 64, 64], [16, 16, 16], cpu) == [8, 8, 8]
    assert dispatch.wg_splits([896, 896], [5, 5], cpu) == [1, 1]
    assert dispatch.wg_splits([896, 896], [1, 1], cpu) is None
    assert dispatch.wg_splits([528, 520], [6, 5], cpu) == [3, 3]  # 66 + 65 = 131 column blocks: one short of the SMs
    assert dispatch.wg_splits([528, 528], [6, 5], cpu) == [1, 1]
    assert dispatch.wg_splits([16, 8], [4, 4], cpu) is None  # (2 + 1) x 2 blocks < 66
    rows, items, _, base = groups.group_table([(1, 2, 3, 256, 16), (4, 5, 6, 64, 16)])
    wg_rows, wg_items, _, wg_base = groups.group_table([(1, 2, 3, 256, 8), (4, 5, 6, 64, 8)])
    assert (wg_items, wg_base) == (items // 2, base // 2)
    group = groups.Exl3Group(table=torch.tensor(rows + wg_rows), num=2, k_tiles=256, total_items=items, total_cols=5120,
                         partial_per_row=base, k2=64, codebook=int(Codebook.MCG), wg_items=wg_items,
                         wg_partial_per_row=wg_base)
    assert groups.Exl3Group.from_meta(group.table, group.meta, group.codebook) == group
    launched = []
    monkeypatch.setattr(groups, "group_run", lambda x, table, num, m, kt, items, cols, part, *rest: (
        launched.append((table.tolist(), items, part, rest[3])), torch.zeros(m, cols))[1])
    x = torch.zeros(48, 4096).half()
    for ring in (91, 81, 0):
        groups.group_linear(x, group, ring=ring)
    assert launched == [(wg_rows, wg_items, wg_base, 91), (rows, items, base, 81), (rows, items, base, 0)]
    plain = groups.Exl3Group.from_meta(group.table[:2], group.meta[:7] + [0, 0, 0], group.codebook)
    assert plain.launch_rows(91)[1:] == (items, base)


def test_rotating_form_only_where_asked_and_possible(monkeypatch):
    """A group on the wgmma ring whose wgmma rows are all at one split runs group_run_rotating (its output rotated in
    the GEMM's launch, no partials) unless SGLANG_EXL3_DEV_WG_ROTATING=off; on another ring, or for a group whose wgmma
    rows keep several splits, the partials path. group_run_rotating refuses what it cannot run before touching the
    GPU."""
    from sglang_exl3.kernels import dispatch, groups
    rows, items, _, base = groups.group_table([(1, 2, 3, 256, 1), (4, 5, 6, 64, 1)])
    one_split = groups.Exl3Group(table=torch.tensor(rows + rows), num=2, k_tiles=256, total_items=items,
                                 total_cols=5120, partial_per_row=base, k2=8, codebook=int(Codebook.MCG),
                                 wg_items=items, wg_partial_per_row=base, wg_one_split=1)
    assert groups.Exl3Group.from_meta(one_split.table, one_split.meta, one_split.codebook) == one_split
    several = groups.Exl3Group.from_meta(one_split.table, one_split.meta[:9] + [0], one_split.codebook)
    ran = []
    monkeypatch.setattr(groups, "group_run_rotating", lambda x, g: (ran.append("rotating"), torch.zeros(1))[1])
    monkeypatch.setattr(groups, "group_run", lambda *a: (ran.append("partials"), torch.zeros(1))[1])
    x = torch.zeros(48, 4096).half()
    for knob, ring, g in (("one-split", 91, one_split), ("one-split", 81, one_split), ("one-split", 91, several),
                          ("off", 91, one_split)):
        monkeypatch.setattr(dispatch, "_rotating_knob", lambda knob=knob: knob != "off")
        groups.group_linear(x, g, ring=ring)
    assert ran == ["rotating", "partials", "partials", "partials"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="one split"):
        groups.group_run_rotating(x, several)
    with pytest.raises(ValueError, match="65 rows"):
        groups.group_run_rotating(torch.zeros(65, 4096).half(), one_split)
    assert dispatch.one_split([1, 1]) and not dispatch.one_split([1, 2]) and not dispatch.one_split(None)


def test_group_only_for_sources_that_can_share_launches():
    """Grouping needs our CUDA kernels, shared K/bits/codebook and untrimmed whole-block widths; anything else
    keeps the per-source path (grouping those would compute garbage, not fail)."""
    from sglang_exl3.kernels.dense import prepare
    from sglang_exl3.layers.linear import group_shards
    from sglang_exl3.layers.shard import Exl3Shard

    def shard(n, bits=3, cb=Codebook.MCG, out=None, k=256):
        t, s, v = _layer(n, k=k, n=n, bits=bits)
        return Exl3Shard(key=f"s{n}", trellis=prepare(t), suh=s, svh=v, codebook=cb, out_features=out or n,
                         kernel_layout=True)

    assert group_shards([shard(256), shard(128)], Backend.TORCH) is None
    assert group_shards([shard(256)], Backend.CUDA) is None
    assert group_shards([shard(256), shard(128, bits=4)], Backend.CUDA) is None
    assert group_shards([shard(256), shard(128, cb=Codebook.MUL1)], Backend.CUDA) is None
    assert group_shards([shard(256), shard(128, k=512)], Backend.CUDA) is None
    assert group_shards([shard(256), shard(128, out=112)], Backend.CUDA) is None  # trimmed width
    assert group_shards([shard(256), shard(144)], Backend.CUDA) is None  # not whole Hadamard blocks
    with pytest.raises(ValueError, match="contiguous CUDA int16"):  # eligible: make_group is reached (needs CUDA)
        group_shards([shard(256), shard(128)], Backend.CUDA)


def test_single_linear_rotating_form_only_with_its_knob(monkeypatch):
    """A single EXL3 linear on our CUDA kernels whose wgmma rows would be at one split gets a one-source group for the
    rotating form (read at load); with SGLANG_EXL3_DEV_WG_ROTATING=off, at more splits, on another backend, or for
    several shards (their group has it), none; and apply_shards runs that group only at the rows the form serves."""
    from types import SimpleNamespace

    from sglang_exl3.kernels import dispatch
    from sglang_exl3.kernels.dense import prepare
    from sglang_exl3.layers import linear
    from sglang_exl3.layers.shard import Exl3Shard

    t, s, v = _layer(0, k=256, n=256, bits=3)
    one = Exl3Shard(key="o", trellis=prepare(t), suh=s, svh=v, codebook=Codebook.MCG, out_features=256,
                    kernel_layout=True)
    monkeypatch.setattr(dispatch, "single_wg_one_split", lambda kt, nt, device: False)  # o / down on the H100: 8
    monkeypatch.delenv("SGLANG_EXL3_DEV_WG_ROTATING", raising=False)  # one-split by default
    assert linear.rotating_shard([one], Backend.CUDA) is None  # left to the partials, no group made
    monkeypatch.setattr(dispatch, "single_wg_one_split", lambda kt, nt, device: True)  # gate/up-like: one split
    monkeypatch.setenv("SGLANG_EXL3_DEV_WG_ROTATING", "off")
    assert linear.rotating_shard([one], Backend.CUDA) is None  # knob off
    monkeypatch.setenv("SGLANG_EXL3_DEV_WG_ROTATING", "one-split")
    assert linear.rotating_shard([one], Backend.TORCH) is None
    assert linear.rotating_shard([one, one], Backend.CUDA) is None
    with pytest.raises(ValueError, match="contiguous CUDA int16"):  # eligible: make_group is reached (needs CUDA)
        linear.rotating_shard([one], Backend.CUDA)
    ran = []
    monkeypatch.setattr(linear, "run_group", lambda x, shards, group: (ran.append(group),
                                                                       torch.zeros(x.shape[0], 256))[1])
    monkeypatch.setattr(linear, "run_shard", lambda x, sh, backend, where: (ran.append("shard"),
                                                                            torch.zeros(x.shape[0], 256))[1])
    rotating = SimpleNamespace(rotating_serves=lambda m: m >= 33)
    layer = SimpleNamespace(exl3_shards=[one], exl3_group=None, exl3_one_launch=None, exl3_rotating=rotating,
                            exl3_backend=int(Backend.CUDA))
    for m in (16, 48):
        linear.apply_shards(layer, torch.zeros(m, 256).half(), None, "EXL3 o")
    assert ran == ["shard", rotating]


@pytest.mark.parametrize("op", ["moe_routed", "moe_sorted"])
def test_moe_ops_fake_shape(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 256).half())
        ids = mode.from_tensor(torch.zeros(3, 2, dtype=torch.int64))
        w = mode.from_tensor(torch.rand(3, 2))
        rows = mode.from_tensor(torch.zeros(4, 8, dtype=torch.int64))
        meta = [16, 16, 4, 6, 1]
        y = getattr(torch.ops.exl3, op)(x, ids, w, rows, rows, rows, meta, meta, meta, False)
    assert tuple(y.shape) == (3, 256) and y.dtype == torch.float32


def _expert_shard(k, n, seed, bits=3, cb=Codebook.MCG, out=None):
    from sglang_exl3.kernels.dense import prepare
    from sglang_exl3.layers.shard import Exl3Shard

    t, s, v = _layer(seed, k=k, n=n, bits=bits)
    return Exl3Shard(key="e", trellis=prepare(t), suh=s, svh=v, codebook=cb, out_features=out or n,
                     kernel_layout=True)


def _expert(seed, bits=3, cb=Codebook.MCG, down_out=None):
    return {"w1": _expert_shard(256, 128, seed, bits, cb), "w3": _expert_shard(256, 128, seed + 1, bits, cb),
            "w2": _expert_shard(128, 256, seed + 2, bits, out=down_out)}


def test_tiers_group_experts_by_bitrate_and_refuse_what_our_kernels_cannot_run():
    """Experts of one shape/bitrate/codebook form a tier (mixed-bitrate checkpoints: one tier per K, in order of
    first appearance; gate and up of two bitrates, R7, are a key of their own); an expert with trimmed widths has no
    tier at all."""
    from sglang_exl3.layers.moe_kernels import tier_groups

    assert tier_groups([_expert(1), _expert(2, bits=4), _expert(3), _expert(4, bits=4), _expert(5, bits=5)]) == \
        [[0, 2], [1, 3], [4]]
    assert tier_groups([_expert(1), _expert(2, cb=Codebook.MUL1)]) == [[0], [1]]
    assert tier_groups([_expert(1), _expert(2, down_out=240)]) is None  # trimmed width
    odd = _expert(3)
    odd["w3"] = _expert_shard(256, 128, 9, bits=4)  # gate 3 bits, up 4 bits (R7): a tier of its own
    assert tier_groups([_expert(1), odd, _expert(4)]) == [[0, 2], [1]]


def test_tier_ids_and_slab_positions():
    """Routing ids as each tier sees them (its local index, else -1; EP's -1 stays -1) and the tier-ordered slab
    rows the dense path hands to fused_experts."""
    from sglang_exl3.layers.moe_kernels import ExpertTiers

    groups = [[0, 2, 3], [1, 4]]
    tier_of, local_of, position = torch.tensor([0, 1, 0, 0, 1]), torch.tensor([0, 0, 1, 2, 1]), \
        torch.tensor([0, 3, 1, 2, 4])
    tiers = ExpertTiers([None, None], tier_of, local_of, position)
    ids = torch.tensor([[4, 0], [2, -1], [1, 3]], dtype=torch.int32)
    assert tiers.ids_in_tier(ids, 0).tolist() == [[-1, 0], [1, -1], [-1, 2]]
    assert tiers.ids_in_tier(ids, 1).tolist() == [[1, -1], [-1, -1], [0, -1]]
    slab = tiers.slab_ids(ids)
    assert slab.tolist() == [[4, 0], [1, -1], [3, 2]] and slab.dtype == torch.int32
    for e in range(5):  # the slab row of expert e is where its tier's block puts it
        t = int(tier_of[e])
        assert int(position[e]) == sum(len(g) for g in groups[:t]) + groups[t].index(e)
    single = ExpertTiers([None])
    assert single.ids_in_tier(ids, 0) is ids and single.slab_ids(ids) is ids


def test_build_tiers_stacks_each_tier_and_needs_our_kernels():
    """Stacking moves every shard's trellis into its tier's per-role tensor (views: no second copy); banks need
    CUDA tensors; other backends get no tiers."""
    from sglang_exl3.layers.moe_kernels import build_tiers, stack_experts

    experts = [_expert(10 * e) for e in range(3)]
    before = [{r: s.trellis.clone() for r, s in e.items()} for e in experts]
    assert build_tiers(experts, Backend.TORCH) is None
    gate, up, down = stack_experts(experts)
    tiles, suh, svh, cb = down
    assert tiles.shape == (3 * 16, 8, 48) and suh.shape == (3, 128) and svh.shape == (3 * 256,)
    assert cb == Codebook.MCG
    for e in range(3):
        for r, (stack, *_rest) in zip(("w1", "w3", "w2"), (gate, up, down), strict=True):
            s = experts[e][r]
            assert s.trellis.data_ptr() == stack[e * s.trellis.shape[0]:].data_ptr()
            assert torch.equal(s.trellis, before[e][r])
    with pytest.raises(ValueError, match="contiguous CUDA int16"):  # the banks are reached, and need CUDA
        build_tiers([_expert(1), _expert(2, bits=4)], Backend.CUDA)


def test_moe_forward_choice_by_rows(monkeypatch):
    """The capturable plans' choice: no tiers (other backends) -> every expert on every row; below the layer's
    rotated_min_rows -> routed groups; from it -> the rotated slab. Records which forward ran (the forwards themselves
    need a GPU and are checked against the codec in tests/gpu/test_moe_cuda.py)."""
    from types import SimpleNamespace

    from sglang_exl3.layers import moe as moe_layer
    from sglang_exl3.layers.moe_kernels import rotated_min_rows

    ran, out_dtypes = [], []
    monkeypatch.setattr(moe_layer, "routed_forward", lambda *a, **k: (ran.append("routed"), out_dtypes.append(a[5])))
    monkeypatch.setattr(moe_layer, "rotated_slab_forward", lambda *a, **k: ran.append("rotated"))
    method = moe_layer.Exl3MoEMethod({}, "x.experts")
    method.moe_runner_config = SimpleNamespace(activation="silu", top_k=8, routed_scaling_factor=None)
    monkeypatch.setattr(method, "_all_experts", lambda *a: ran.append("all"))
    layer = SimpleNamespace(exl3_tiers=SimpleNamespace(num_experts=128), intermediate_size_per_partition=128,
                            hidden_size=256, exl3_moe_slab={})
    rows = rotated_min_rows(128, 8)
    for m in (1, rows - 1, rows, 4 * rows):
        method._capturable(layer, torch.zeros(m, 256, dtype=torch.float16), None, None)
    layer.exl3_tiers = None
    method._capturable(layer, torch.zeros(1, 256, dtype=torch.float16), None, None)
    assert ran == ["routed", "routed", "rotated", "rotated", "all"]
    # the routed forward rounds into x's dtype itself unless a routed scaling follows in fp32
    assert out_dtypes == [torch.float16, torch.float16]
    method.moe_runner_config.routed_scaling_factor = 2.5
    layer.exl3_tiers = SimpleNamespace(num_experts=128)
    method._capturable(layer, torch.zeros(1, 256, dtype=torch.bfloat16), None, None)
    assert out_dtypes[-1] == torch.float32


def test_rotated_crossover_scales_with_experts_over_topk():
    """Measured for Qwen3-30B-A3B (128 experts, top-8): the rotated slab beats sorted tiles from ~414 rows (26 pairs
    per expert); fewer experts per routed pair cross sooner (Mixtral: 8 experts, top-2), never below the floor."""
    from sglang_exl3.layers.moe_kernels import MIN_SLAB_ROWS, rotated_min_rows

    assert 384 < rotated_min_rows(128, 8) <= 512
    assert rotated_min_rows(8, 2) == 104
    assert rotated_min_rows(1, 16) == MIN_SLAB_ROWS


def test_sorted_tiles_from_half_a_pair_per_expert():
    """Expert-sorted tiles from E/2 routed pairs (Qwen3-30B-A3B, H100: sorted 119.1 µs against the decode forward's
    119.6 at m = 8 = 64 pairs, 154.9 against 171.1 at 12, 81.3 against 68.2 at 4): m = 8 there; a Mixtral-like
    layer (8 experts, top-2) sorts from m = 2, so its m = 1 decode still takes the per-pair forward."""
    from sglang_exl3.layers.moe_kernels import sorted_rows

    assert not sorted_rows(7, 8, 128) and sorted_rows(8, 8, 128) and sorted_rows(24, 8, 128)
    assert not sorted_rows(1, 2, 8) and sorted_rows(2, 2, 8)
    assert not sorted_rows(31, 8, 512) and sorted_rows(32, 8, 512)


def test_rotation_tables_follow_the_slab_order_and_copy_only_for_several_tiers():
    """The rotated slab's per-role suh / svh tables: tier by tier in slab order (what slab_ids maps to), made once by
    build_tiers; a single tier's are views of its stacked tables."""
    from sglang_exl3.layers.moe_kernels import ExpertTier, stack_experts, tier_rotations

    experts = [_expert(10 * e, bits=3 + e % 2) for e in range(4)]
    groups = [[0, 2], [1, 3]]
    tiers = [ExpertTier(g, stack_experts([experts[e] for e in g]), ()) for g in groups]
    tables = tier_rotations(tiers)
    order = [e for g in groups for e in g]
    for i, (role, what) in enumerate((r, w) for r in ("w1", "w3", "w2") for w in ("suh", "svh")):
        want = torch.stack([getattr(experts[e][role], what).reshape(-1) for e in order])
        assert torch.equal(tables[i], want), (role, what)
    single = ExpertTier([0, 2], tiers[0].dense, ())
    views = tier_rotations([single])
    assert views[0].data_ptr() == single.dense[0][1].data_ptr() and views[5].data_ptr() == single.dense[2][2].data_ptr()


def test_one_launch_only_for_layers_within_its_weight_budget(monkeypatch):
    """The one-launch form is offered only to layers of at most SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_WEIGHTS weights on this
    rank (K x N over the sources): 4194304 by default, so every Llama-3-8B linear runs three launches."""
    from sglang_exl3.kernels.dense import prepare
    from sglang_exl3.layers import linear
    from sglang_exl3.layers.shard import Exl3Shard

    t, s, v = _layer(0, k=256, n=256, bits=3)
    one = Exl3Shard(key="o", trellis=prepare(t), suh=s, svh=v, codebook=Codebook.MCG, out_features=256,
                    kernel_layout=True)
    assert linear.layer_weights([one]) == 256 * 256
    assert linear.layer_weights([one, one]) == 2 * 256 * 256
    monkeypatch.delenv("SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_WEIGHTS", raising=False)
    assert linear.one_launch_shards([one] * 65, Backend.CUDA) is None  # 4,259,840 weights: over the default
    with pytest.raises(ValueError, match="contiguous CUDA int16"):  # 4,194,304: make_one_launch is reached
        linear.one_launch_shards([one] * 64, Backend.CUDA)
    monkeypatch.setenv("SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_WEIGHTS", str(256 * 256))
    assert linear.one_launch_shards([one, one], Backend.CUDA) is None  # over the budget
    with pytest.raises(ValueError, match="contiguous CUDA int16"):  # within it: make_one_launch is reached
        linear.one_launch_shards([one], Backend.CUDA)
    monkeypatch.setenv("SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_WEIGHTS", str(2 * 256 * 256))
    with pytest.raises(ValueError, match="contiguous CUDA int16"):
        linear.one_launch_shards([one, one], Backend.CUDA)


def test_single_linear_wgmma_splits_match_its_one_source_group(monkeypatch):
    """single_wg_one_split (what rotating_shard asks before making a group) is the wg_one_split make_group would give
    a one-source group: o and down of Llama-3-8B stay at 8 splits, a 28672-wide linear goes to one, an lm_head none
    (it already runs at one split)."""
    from sglang_exl3.kernels import dispatch
    monkeypatch.setattr(dispatch, "sm_count", lambda index: 132)
    cpu = torch.device("cpu")
    assert dispatch.wg_splits([256], [dispatch.default_splits(256, 256, cpu)], cpu) == [8]  # 4096 x 4096
    assert dispatch.single_wg_one_split(256, 256, cpu) is False
    assert dispatch.single_wg_one_split(896, 256, cpu) is False  # 14336 -> 4096: 8 splits
    assert dispatch.single_wg_one_split(256, 1792, cpu) is True  # 4096 -> 28672: 224 column blocks fill the SMs
    assert dispatch.single_wg_one_split(256, 8016, cpu) is False  # 4096 -> 128256: no wgmma rows of its own
