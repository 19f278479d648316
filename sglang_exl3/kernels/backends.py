"""Choosing and loading a GEMM backend (`SGLANG_EXL3_BACKEND`: auto|cuda|exllamav3|torch)."""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import sys
from functools import cache

import torch

from sglang_exl3 import knobs


class Backend(enum.IntEnum):
    TORCH = 0
    EXLLAMAV3 = 1
    CUDA = 3  # 2 was the Triton backend (docs/decisions.md)


class BackendUnavailable(RuntimeError):
    pass


@cache
def load_exllamav3_ext():
    """exllamav3's compiled extension: from SGLANG_EXL3_EXT_PATH if set, else through exllamav3
    (which JIT-builds it on first import). Raises BackendUnavailable naming the fix."""
    path = knobs.get("EXT_PATH")
    try:
        if path:
            folder = path if os.path.isdir(path) else os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            ext = importlib.import_module("exllamav3_ext")
        else:
            ext = importlib.import_module("exllamav3.ext").exllamav3_ext
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        raise BackendUnavailable(
            f"exllamav3's extension is not importable ({type(e).__name__}: {e}); install "
            "sglang-exl3[exllamav3] (its CUDA extension builds on first import) or point "
            "SGLANG_EXL3_EXT_PATH at a prebuilt exllamav3_ext") from e
    if not hasattr(ext, "exl3_gemm"):
        raise BackendUnavailable(f"{getattr(ext, '__file__', ext)} has no exl3_gemm; it is not exllamav3_ext")
    return ext


def _load_our_kernels(build: bool):
    from sglang_exl3.kernels.library import KernelLibraryUnavailable, load_library

    try:
        return load_library(build)
    except KernelLibraryUnavailable as e:
        raise BackendUnavailable(str(e)) from e


_BUILD_FAILED: list[str] = []  # a failed first-use build is not retried by every later layer of the process


def _may_build() -> bool:
    from sglang_exl3.kernels.build import find_nvcc

    return bool(knobs.get("AUTO_BUILD")) and not _BUILD_FAILED and find_nvcc() is not None


def _auto_load_our_kernels():
    build = _may_build()
    try:
        return _load_our_kernels(build)
    except BackendUnavailable as e:
        if build:
            _BUILD_FAILED.append(str(e))
        raise


@cache
def _warn_once(message: str) -> None:
    import logging

    logging.getLogger(__name__).warning(message)


def resolve_backend(device: torch.device) -> Backend:
    """The backend the knob asks for, checked against what this device and install can run."""
    choice = knobs.get("BACKEND")
    if choice == "torch":
        return Backend.TORCH
    cuda = torch.device(device).type == "cuda"
    if choice == "cuda":
        if not cuda:
            raise BackendUnavailable("SGLANG_EXL3_BACKEND=cuda needs a CUDA device")
        _load_our_kernels(build=True)
        return Backend.CUDA
    if choice == "exllamav3":
        if not cuda:
            raise BackendUnavailable("SGLANG_EXL3_BACKEND=exllamav3 needs a CUDA device")
        load_exllamav3_ext()
        return Backend.EXLLAMAV3
    # auto: our kernels, compiled on first use where nvcc exists (once per GPU arch and source version;
    # SGLANG_EXL3_AUTO_BUILD=0 turns that off); exllamav3 only when its extension is already built
    # (SGLANG_EXL3_EXT_PATH or a prebuilt exllamav3_ext module): importing exllamav3 otherwise starts its own
    # JIT build of several minutes.
    if cuda and torch.cuda.get_device_capability(device)[0] >= 8:
        try:
            _auto_load_our_kernels()
            return Backend.CUDA
        except BackendUnavailable as e:
            _warn_once(f"sglang-exl3: our CUDA kernels are unavailable ({e}); falling back")
    if cuda and (knobs.get("EXT_PATH") or importlib.util.find_spec("exllamav3_ext") is not None):
        try:
            load_exllamav3_ext()
            return Backend.EXLLAMAV3
        except BackendUnavailable:
            return Backend.TORCH
    return Backend.TORCH
