"""The trellis encoder's CUDA kernel against the torch encoder (codec/encode.py): the same states, bit for bit, for
every integer K and the three codebooks, on fresh Gaussian tiles; its throughput printed for the record."""

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
def test_the_kernel_finds_the_torch_encoders_path(k, codebook):
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    gen = torch.Generator().manual_seed(17 * k + int(codebook))
    x = torch.randn(6, 256, generator=gen) * codebook_table(codebook).float().std()
    want = encode_tiles(x.cuda(), k, codebook)
    got = encode_tiles_cuda(x.cuda(), k, codebook)
    assert torch.equal(got, want)


def test_throughput():
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    x = torch.randn(4096, 256, device="cuda") * codebook_table(Codebook.MCG, "cuda").float().std()
    for k in (2, 4):
        encode_tiles_cuda(x[:64], k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        encode_tiles_cuda(x, k)
        torch.cuda.synchronize()
        rate = x.shape[0] / (time.perf_counter() - t0)
        print(f"K={k}: {rate:,.0f} tiles/s ({rate * 256 / 1e6:.1f} M weights/s)")
