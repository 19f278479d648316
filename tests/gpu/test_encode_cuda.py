"""The trellis encoder's CUDA kernels (plain and fast) against the torch encoder (codec/encode.py): the same states,
bit for bit, for every integer K and the three codebooks, on fresh Gaussian tiles; their throughput printed for the
record."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_exl3.codec.codebook import Codebook, codebook_table
from sglang_exl3.codec.encode import encode_tiles

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("codebook", [Codebook.MCG, Codebook.MUL1, Codebook.INST3])
def test_the_kernels_find_the_torch_encoders_path(k, codebook):
    """More tiles than the fast kernel has resident blocks at high K, so its blocks loop over tiles."""
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    gen = torch.Generator().manual_seed(17 * k + int(codebook))
    x = torch.randn(6, 256, generator=gen) * codebook_table(codebook).float().std()
    want = encode_tiles(x.cuda(), k, codebook)
    assert torch.equal(encode_tiles_cuda(x.cuda(), k, codebook, kernel="plain"), want)
    if k >= 2:
        many = torch.randn(300, 256, generator=gen) * codebook_table(codebook).float().std()
        sample = torch.arange(0, 300, 37)
        got = encode_tiles_cuda(many.cuda(), k, codebook, kernel="fast")
        assert torch.equal(got[:6], encode_tiles_cuda(many[:6].cuda(), k, codebook, kernel="plain"))
        assert torch.equal(got[sample], encode_tiles(many[sample].cuda(), k, codebook))
        assert torch.equal(encode_tiles_cuda(x.cuda(), k, codebook, kernel="fast"), want)


def test_throughput():
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    x = torch.randn(8192, 256, device="cuda") * codebook_table(Codebook.MCG, "cuda").float().std()
    for k in (2, 3, 4, 5):
        for kernel, n in (("plain", 1024), ("fast", 8192)):
            encode_tiles_cuda(x[:64], k, kernel=kernel)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            encode_tiles_cuda(x[:n], k, kernel=kernel)
            torch.cuda.synchronize()
            rate = n / (time.perf_counter() - t0)
            print(f"K={k} {kernel}: {rate:,.0f} tiles/s ({rate * 256 / 1e6:.1f} M weights/s)")
