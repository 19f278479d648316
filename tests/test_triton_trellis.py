"""Triton trellis kernels against the reference codec (on CPU through Triton's interpreter)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

from sglang_exl3.codec import exl3_linear_reference, had_r_128, reconstruct
from sglang_exl3.format import Codebook

CHILD = os.environ.get("SGLANG_EXL3_TEST_TRITON_CHILD") == "1"
RUN_HERE = torch.cuda.is_available() or CHILD


def test_in_triton_interpreter():
    """Without a GPU the kernels run in Triton's interpreter, which must be switched on before triton is
    first imported: run this module's kernel tests in a fresh interpreter with TRITON_INTERPRET=1."""
    if RUN_HERE:
        pytest.skip("kernel tests run directly in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "SGLANG_EXL3_TEST_TRITON_CHILD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\b34 passed", proc.stdout), proc.stdout[-500:]


@pytest.fixture(scope="module")
def kernels():
    if not RUN_HERE:
        pytest.skip("runs in the Triton-interpreter child process (test_in_triton_interpreter)")
    module = importlib.import_module("sglang_exl3.kernels.triton_trellis")
    return module, ("cuda" if torch.cuda.is_available() else "cpu")


VARIANTS = [(cb, k) for cb in Codebook for k in (1, 2, 3, 4, 5, 6, 7, 8)] + [
    (Codebook.MUL1, 1.5), (Codebook.MUL1, 2.5), (Codebook.MUL1, 3.5)]


@pytest.mark.parametrize("cb, bits", VARIANTS, ids=[f"{c.label}-{b}" for c, b in VARIANTS])
def test_triton_reconstruct_bit_exact(kernels, cb, bits):
    module, device = kernels
    gen = torch.Generator().manual_seed(int(bits * 10) + int(cb))
    trellis = torch.randint(-32768, 32768, (2, 4, int(bits * 16)), generator=gen, dtype=torch.int16)
    ours = module.triton_reconstruct(trellis.to(device), cb).cpu()
    assert torch.equal(ours.view(torch.int16), reconstruct(trellis, cb).view(torch.int16))


def _check_rotated_gemm(gemm, cb: Codebook, bits: float, m: int, seed: int) -> None:
    """A 128x128 EXL3 linear through `gemm(xh, trellis) -> fp32 acc` (rotated basis, checkpoint-layout trellis) and
    the codec's rotations, against the reference linear: finite and within fp16 accumulation."""
    gen = torch.Generator().manual_seed(seed)
    k, n = 128, 128
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(bits * 16)), generator=gen, dtype=torch.int16)
    suh = (torch.randn(k, generator=gen) * 0.1).half()
    svh = (torch.randn(n, generator=gen) * 0.1).half()
    x = torch.randn(m, k, generator=gen).half()
    acc = gemm(had_r_128(x, pre_scale=suh), trellis)
    y = had_r_128(acc, post_scale=svh, out_dtype=torch.float16)
    ref = exl3_linear_reference(x, trellis, suh, svh, cb)
    assert torch.isfinite(y).all()
    assert ((y.float() - ref.float()).norm() / ref.float().norm()) < 2e-3


@pytest.mark.parametrize("cb, bits, m", [(Codebook.MUL1, 4, 1), (Codebook.MCG, 3, 5), (Codebook.INST3, 2, 17),
                                          (Codebook.MUL1, 2.5, 3)])
def test_triton_gemm_matches_reference(kernels, cb, bits, m):
    module, device = kernels
    _check_rotated_gemm(lambda xh, trellis: module.triton_gemm_rotated(xh.to(device), trellis.to(device), cb,
                                                                       splits=2).cpu(), cb, bits, m, seed=m)


@pytest.mark.parametrize("cb, bits, m", [(Codebook.MCG, 4, 37), (Codebook.MUL1, 3, 20), (Codebook.INST3, 2.5, 9)])
def test_triton_gemm_tiles_matches_reference(kernels, cb, bits, m):
    """The large-m kernel on the CUDA kernels' layout ([N/16, K/16, words], what the layers keep after load),
    several row blocks including a partial one."""
    module, device = kernels

    def gemm(xh, trellis):
        tiles = trellis.permute(1, 0, 2).contiguous()  # cuda_trellis.prepare's layout
        return module.triton_gemm_tiles(xh.to(device), tiles.to(device), cb, block_m=16, block_n=32, block_k=32,
                                        num_warps=4, num_stages=1).cpu()

    _check_rotated_gemm(gemm, cb, bits, m, seed=100 + m)
