"""`torch.ops.exl3.gemm`: equals the reference codec and traces under torch.compile(fullgraph=True)."""

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
