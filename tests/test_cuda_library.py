"""Our CUDA kernel library on a machine without a GPU: the weight layout, the loader's errors, and (where
nvcc exists) that the source compiles and its C ABI rejects bad arguments before touching a device."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sglang_exl3.kernels import cuda_trellis as ck


def test_prepare_puts_each_column_strip_contiguous():
    trellis = torch.randint(-32768, 32768, (3, 5, 64), dtype=torch.int16)
    tiles = ck.prepare(trellis)
    assert tiles.shape == (5, 3, 64) and tiles.is_contiguous()
    for tk in range(3):
        for tn in range(5):
            assert torch.equal(tiles[tn, tk], trellis[tk, tn])
    with pytest.raises(ValueError, match="int16 trellis"):
        ck.prepare(trellis.float())


def test_missing_library_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SGLANG_EXL3_KERNEL_LIB", raising=False)
    with pytest.raises(ck.KernelLibraryUnavailable, match="build-kernels.*SGLANG_EXL3_KERNEL_LIB"):
        ck.load_library(build=False)


def test_no_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(ck, "find_nvcc", lambda: None)
    with pytest.raises(ck.KernelLibraryUnavailable, match="nvcc not found.*SGLANG_EXL3_KERNEL_LIB"):
        ck.build_library(out=tmp_path / "lib.so", arch="90")
    monkeypatch.setattr(ck, "find_nvcc", lambda: "/bin/true")
    with pytest.raises(ck.KernelLibraryUnavailable, match="sm_80 or newer"):
        ck.build_library(out=tmp_path / "lib.so", arch="75")


@pytest.mark.slow
@pytest.mark.skipif(ck.find_nvcc() is None, reason="needs nvcc")
def test_source_compiles_and_abi_rejects_bad_arguments(tmp_path):
    """About a minute on two cores: catches a kernel source that no longer compiles before a GPU run."""
    lib = ctypes.CDLL(str(ck.build_library(out=tmp_path / "libexl3_trellis.so", arch="90")))
    assert lib.exl3_abi_version() == ck.ABI_VERSION
    lib.exl3_error_string.restype = ctypes.c_char_p
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.exl3_gemm_partial.argtypes = [p, p, p, i, i, i, i, i, i, p]
    lib.exl3_reconstruct.argtypes = [p, p, i, i, i, i, i, i, i, p]
    # shape checks come before any CUDA call, so these run without a GPU
    assert lib.exl3_gemm_partial(None, None, None, 1, 16, 4, 17, 8, 1, None) == -3  # splits > K tiles
    assert lib.exl3_gemm_partial(None, None, None, 0, 16, 4, 1, 8, 1, None) == -3  # m = 0
    assert lib.exl3_reconstruct(None, None, 4, 4, 2, 3, 64, 8, 1, None) == -3  # column tiles past N
    assert lib.exl3_reconstruct(None, None, 4, 4, 0, 4, 64, 9, 1, None) == -1  # 4.5 bits in MCG: unsupported
    assert b"unsupported" in lib.exl3_error_string(-1)
