"""The reference codec on CUDA gives exactly what it gives on CPU (fresh random inputs)."""

import pytest
import torch

from sglang_exl3.codec import dequantize_weight, had_r_128, reconstruct
from sglang_exl3.format import Codebook

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cb", list(Codebook))
@pytest.mark.parametrize("bits", [2, 3, 4, 2.5])
def test_reconstruct_cuda_equals_cpu(cb, bits):
    if bits == 2.5 and cb != Codebook.MUL1:
        pytest.skip("half rates are MUL1 only")
    trellis = torch.randint(-32768, 32768, (32, 24, int(bits * 16)), dtype=torch.int16)
    cpu = reconstruct(trellis, cb)
    gpu = reconstruct(trellis.cuda(), cb).cpu()
    assert torch.equal(cpu.view(torch.int16), gpu.view(torch.int16))


def test_hadamard_and_weight_cuda_equals_cpu():
    x = torch.randn(64, 512).half()
    s = torch.randn(512).half()
    assert torch.equal(had_r_128(x, pre_scale=s), had_r_128(x.cuda(), pre_scale=s.cuda()).cpu())
    trellis = torch.randint(-32768, 32768, (16, 16, 64), dtype=torch.int16)
    suh, svh = (torch.randn(256) * 0.05).half(), (torch.randn(256) * 0.05).half()
    cpu = dequantize_weight(trellis, suh, svh, Codebook.MCG)
    gpu = dequantize_weight(trellis.cuda(), suh.cuda(), svh.cuda(), Codebook.MCG).cpu()
    assert torch.equal(cpu.view(torch.int16), gpu.view(torch.int16))
