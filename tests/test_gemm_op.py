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
        from sglang_exl3.kernels.cuda_trellis import prepare

        y_cuda = torch.ops.exl3.gemm(x, prepare(t), s1, s2, None, 2, int(Backend.CUDA))
    assert tuple(y.shape) == (9, 384) and y.dtype == torch.float16
    assert tuple(y_cuda.shape) == (9, 384) and y_cuda.dtype == torch.float16


def test_group_op_fake_shape_and_trace():
    """The grouped op's output width is the sum of its sources' (kernel-layout) widths, under fake tensors and
    torch.compile with a dynamic row count, so SGLang's piecewise graphs can trace a grouped q/k/v."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang_exl3.kernels.cuda_trellis import prepare

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


def test_group_only_for_sources_that_can_share_launches():
    """Grouping needs our CUDA kernels, shared K/bits/codebook and untrimmed whole-block widths; anything else
    keeps the per-source path (grouping those would compute garbage, not fail)."""
    from sglang_exl3.kernels.cuda_trellis import prepare
    from sglang_exl3.layers.linear import Exl3Shard, group_shards

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


def test_moe_routed_op_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 256).half())
        ids = mode.from_tensor(torch.zeros(3, 2, dtype=torch.int64))
        w = mode.from_tensor(torch.rand(3, 2))
        rows = mode.from_tensor(torch.zeros(4, 8, dtype=torch.int64))
        y = torch.ops.exl3.moe_routed(x, ids, w, rows, rows, rows, [16, 16, 4, 6, 1], [16, 16, 4, 6, 1], False)
    assert tuple(y.shape) == (3, 256) and y.dtype == torch.float32


def test_expert_banks_only_for_uniform_experts_on_our_kernels():
    from sglang_exl3.kernels.cuda_trellis import prepare
    from sglang_exl3.layers.linear import Exl3Shard
    from sglang_exl3.layers.moe import expert_banks

    def shard(k, n, bits=3, cb=Codebook.MCG, out=None):
        t, s, v = _layer(k + n, k=k, n=n, bits=bits)
        return Exl3Shard(key="e", trellis=prepare(t), suh=s, svh=v, codebook=cb, out_features=out or n,
                         kernel_layout=True)

    def expert(**kw):
        return {"w1": shard(256, 128, **kw), "w3": shard(256, 128, **kw), "w2": shard(128, 256)}

    assert expert_banks([expert(), expert()], Backend.TORCH) is None
    assert expert_banks([expert(), expert(bits=4)], Backend.CUDA) is None  # mixed bitrates
    assert expert_banks([expert(), expert(cb=Codebook.MUL1)], Backend.CUDA) is None
    trimmed = expert()
    trimmed["w2"] = shard(128, 256, out=240)
    assert expert_banks([expert(), trimmed], Backend.CUDA) is None
    with pytest.raises(ValueError, match="contiguous CUDA int16"):  # eligible: make_expert_bank is reached
        expert_banks([expert(), expert()], Backend.CUDA)


def test_stack_experts_moves_each_expert_into_one_tensor_per_role():
    """The dense-slab path's per-role stacks: every shard's trellis becomes a view of its role's stack (no second
    copy), suh stacked [E, K], svh concatenated [E*N]; not built for other backends or non-uniform experts."""
    from sglang_exl3.kernels.cuda_trellis import prepare
    from sglang_exl3.layers.linear import Exl3Shard
    from sglang_exl3.layers.moe import stack_experts

    def shard(k, n, seed, bits=3):
        t, s, v = _layer(seed, k=k, n=n, bits=bits)
        return Exl3Shard(key="e", trellis=prepare(t), suh=s, svh=v, codebook=Codebook.MCG, out_features=n,
                         kernel_layout=True)

    experts = [{"w1": shard(256, 128, 10 + e), "w3": shard(256, 128, 20 + e), "w2": shard(128, 256, 30 + e)}
               for e in range(3)]
    before = [{r: s.trellis.clone() for r, s in e.items()} for e in experts]
    assert stack_experts(experts, Backend.TORCH) is None
    gate, up, down = stack_experts(experts, Backend.CUDA)
    tiles, suh, svh, cb, ones = down
    assert tiles.shape == (3 * 16, 8, 48) and suh.shape == (3, 128) and svh.shape == (3 * 256,)
    assert cb == Codebook.MCG and torch.equal(ones, torch.ones(128, dtype=torch.float16))
    for e in range(3):
        for r, (stack, *_rest) in zip(("w1", "w3", "w2"), (gate, up, down), strict=True):
            s = experts[e][r]
            assert s.trellis.data_ptr() == stack[e * s.trellis.shape[0]:].data_ptr()
            assert torch.equal(s.trellis, before[e][r])
    mixed = [{"w1": shard(256, 128, 1), "w3": shard(256, 128, 2), "w2": shard(128, 256, 3)},
             {"w1": shard(256, 128, 4, bits=4), "w3": shard(256, 128, 5, bits=4), "w2": shard(128, 256, 6)}]
    assert stack_experts(mixed, Backend.CUDA) is None
