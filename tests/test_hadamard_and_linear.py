"""Hadamard-128 bit-exact with exllamav3's had_r_128; reference linear vs exllamav3's exl3_gemm."""

import pytest
import torch

from sglang_exl3.codec import exl3_linear_reference, had_r_128, hadamard_128, reconstruct
from sglang_exl3.codec.linear import pad_input
from sglang_exl3.format import Codebook


@pytest.mark.parametrize("mode", ["pre", "post", "plain"])
def test_had_r_128_fp16_bit_exact(golden, mode):
    x, scale = golden["had.x"], golden["had.scale"]
    kwargs = {"pre": {"pre_scale": scale}, "post": {"post_scale": scale}, "plain": {}}[mode]
    assert torch.equal(had_r_128(x, **kwargs).view(torch.int16), golden[f"had.y_{mode}"].view(torch.int16))


def test_had_r_128_fp32_bit_exact(golden):
    assert torch.equal(had_r_128(golden["had.xf32"]), golden["had.yf32"])


def test_hadamard_matrix_is_orthonormal_and_matches_butterfly():
    h = hadamard_128()
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    x = torch.randn(4, 256, dtype=torch.float64)
    ref = (x.view(4, 2, 128) @ h).view(4, 256)
    assert torch.allclose(had_r_128(x.float()).double(), ref, rtol=1e-5, atol=1e-5)


def test_had_r_128_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        had_r_128(torch.zeros(2, 100))
    s = torch.ones(128, dtype=torch.float16)
    with pytest.raises(ValueError, match="not both"):
        had_r_128(torch.ones(1, 128, dtype=torch.float16), pre_scale=s, post_scale=s)


GEMMS = [("3inst", 4), ("mcg", 4), ("mul1", 4), ("mul1", 2)]


@pytest.mark.parametrize("cb, bits", GEMMS)
@pytest.mark.parametrize("m", [1, 8, 33])
def test_reference_linear_matches_exl3_gemm(golden, cb, bits, m):
    pre = f"gemm.{cb}.{bits}"
    x, expected = golden[f"{pre}.m{m}.x"], golden[f"{pre}.m{m}.y"]
    y = exl3_linear_reference(x, golden[f"{pre}.trellis"], golden[f"{pre}.suh"], golden[f"{pre}.svh"],
                              Codebook.from_label(cb))
    assert y.dtype == torch.float16 and y.shape == expected.shape
    rel = (y.float() - expected.float()).norm() / expected.float().norm()
    assert rel < 2e-3, rel  # fp16 output rounding + fp32 accumulation order (+ int8 GEMV for MUL1 m=1)


def test_reference_linear_pads_input_and_trims_output():
    gen = torch.Generator().manual_seed(7)
    trellis = torch.randint(-32768, 32768, (8, 16, 48), generator=gen, dtype=torch.int16)
    suh = (torch.rand(128, generator=gen) * 0.1).half()
    svh = (torch.rand(256, generator=gen) * 0.1).half()
    x = torch.randn(3, 100, generator=gen, dtype=torch.bfloat16)
    y = exl3_linear_reference(x, trellis, suh, svh, Codebook.MCG, out_features=200)
    assert y.shape == (3, 200) and y.dtype == torch.bfloat16
    x_pad = torch.nn.functional.pad(x, (0, 28))
    full = exl3_linear_reference(x_pad, trellis, suh, svh, Codebook.MCG)
    assert torch.equal(y, full[:, :200])
    with pytest.raises(ValueError, match="input width 129 exceeds packed K 128"):
        pad_input(torch.zeros(1, 129), 128)
    with pytest.raises(ValueError, match="logical N 300 exceeds packed N 256"):
        exl3_linear_reference(x, trellis, suh, svh, Codebook.MCG, out_features=300)


def test_reference_linear_equals_dense_math():
    """y = x diag(suh) H W_hat H diag(svh): the forward and the dequantized weight agree."""
    from sglang_exl3.codec import dequantize_weight

    gen = torch.Generator().manual_seed(11)
    trellis = torch.randint(-32768, 32768, (16, 8, 64), generator=gen, dtype=torch.int16)
    suh = (torch.randn(256, generator=gen) * 0.1).half()
    svh = (torch.randn(128, generator=gen) * 0.1).half()
    bias = torch.randn(128, generator=gen).half()
    x = torch.randn(5, 256, generator=gen).half()
    w = dequantize_weight(trellis, suh, svh, Codebook.MUL1)
    dense = (x.float() @ w.float()).half() + bias
    y = exl3_linear_reference(x, trellis, suh, svh, Codebook.MUL1, bias=bias)
    assert ((y.float() - dense.float()).norm() / dense.float().norm()) < 2e-3
    assert reconstruct(trellis, Codebook.MUL1).shape == (256, 128)
