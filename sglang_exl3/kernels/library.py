"""Finding, building and loading our CUDA kernel library (`csrc/`, plain C ABI, loaded with ctypes).

The library has no torch headers, so it builds with nvcc alone and does not depend on the torch build. Found, in
order: `SGLANG_EXL3_KERNEL_LIB` (a prebuilt .so), then the per-user cache (`~/.cache/sglang_exl3`, keyed by the
sources' hash and the GPU arch). Built by `python -m sglang_exl3 build-kernels`, or on first use where nvcc exists
(`SGLANG_EXL3_BACKEND=cuda`, or `auto` unless `SGLANG_EXL3_AUTO_BUILD=0`), once, under a file lock shared by the
tensor-parallel ranks. A library is refused unless it was built against this package's ABI table (kernels/abi.py).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import torch

from sglang_exl3 import knobs
from sglang_exl3.kernels import abi
from sglang_exl3.kernels.build import BuildFailed, build, find_nvcc, sources_digest
from sglang_exl3.kernels.crossovers import CROSSOVERS
from sglang_exl3.native_paths import UnsafeNativePath, check_native_path

__all__ = ["KernelLibraryUnavailable", "build_library", "cache_path", "check", "find_nvcc", "load_library",
           "stream"]


class KernelLibraryUnavailable(RuntimeError):
    pass


def arch_tag(arch: str | None) -> str:
    if arch:
        return arch.replace("sm_", "").replace(".", "")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "90"


@cache
def _sources_digest() -> str:
    """The kernel sources' hash (read once: every kernel call resolves the library path through it)."""
    return sources_digest()


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang_exl3"


def cache_path(arch: str | None = None) -> Path:
    return cache_root() / f"libexl3_trellis-{_sources_digest()}-sm{arch_tag(arch)}.so"


def objects_dir(arch: str | None = None) -> Path:
    """Where the compiled units are kept between builds (one object per unit and hash)."""
    return cache_root() / f"objects-sm{arch_tag(arch)}"


def build_library(out: Path | None = None, arch: str | None = None, verbose: bool = False,
                  only_4bit_mcg: bool = False, jobs: int | None = None) -> Path:
    """Compile the kernels for one GPU arch (default: this GPU's, else sm_90) into `out` (default: the cache).

    Units are compiled in parallel (`jobs`, default the CPU count) and kept in the per-user object cache, so a rebuild
    after an edit compiles only the units that edit touched. `only_4bit_mcg` builds the 4-bit MCG variant of every
    kernel alone (the host code and its argument checks are the same, every other bitrate and codebook returns -1):
    for kernel development and the CPU tests, never for serving, so it refuses the default (cache) output."""
    if only_4bit_mcg and out is None:
        raise ValueError("a 4-bit-MCG-only library serves no other bitrate: give it an explicit `out`, away from "
                         "the cache the server loads")
    if find_nvcc() is None:
        raise KernelLibraryUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH) to build the EXL3 "
                                       "kernels, or point SGLANG_EXL3_KERNEL_LIB at a prebuilt library")
    tag = arch_tag(arch)
    if int(tag) < 80:
        raise KernelLibraryUnavailable(f"the EXL3 kernels need sm_80 or newer (mma.m16n8k16), not sm_{tag}")
    out = Path(out) if out else cache_path(tag)
    objects = objects_dir(tag)
    objects.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        build(out, tag, objects, dev=only_4bit_mcg, jobs=jobs, verbose=verbose, log=print if verbose else None)
    except BuildFailed as e:
        raise KernelLibraryUnavailable(str(e)) from e
    return out


# (SGLANG_EXL3_KERNEL_LIB, XDG_CACHE_HOME, HOME) -> the library found and checked for that setting
_CHECKED_LIBRARIES: dict[tuple[str, ...], Path] = {}


def library_path() -> Path | None:
    """The library that `load_library` would open, or None if there is none yet. SGLANG_EXL3_KERNEL_LIB is checked
    by its knob; a cached library must pass the same rules (native_paths), and so must the cache folder. Every kernel
    launch asks for the library, and the rules cost several system calls, so a library found is checked once per
    setting of the variables that locate it (it is opened once per path anyway)."""
    key = tuple(os.environ.get(name, "") for name in (knobs.KNOBS["KERNEL_LIB"].env, "XDG_CACHE_HOME", "HOME"))
    found = _CHECKED_LIBRARIES.get(key)
    if found is None:
        found = _find_library()
        if found is not None:
            _CHECKED_LIBRARIES[key] = found
    return found


def _find_library() -> Path | None:
    explicit = knobs.get("KERNEL_LIB")
    if explicit:
        return Path(explicit)
    path = cache_path()
    if not path.exists():
        return None
    _check_cache(path.parent)
    _check_cache(path, "file")
    return path


def _check_cache(path: Path, kind: str = "dir") -> None:
    try:
        check_native_path(str(path), "the EXL3 kernel build cache", kind)
    except UnsafeNativePath as e:
        raise KernelLibraryUnavailable(f"{e}; or set XDG_CACHE_HOME to a folder only you can write, or "
                                       "SGLANG_EXL3_KERNEL_LIB to a prebuilt library") from None


def load_library(build: bool = False) -> ctypes.CDLL:
    """The kernel library (opened once per path); `build=True` compiles it first if there is none."""
    path = library_path()
    if path is None:
        if not build:
            raise KernelLibraryUnavailable(
                "the EXL3 CUDA kernels are not built: run `python -m sglang_exl3 build-kernels` (needs nvcc) "
                "or set SGLANG_EXL3_KERNEL_LIB to a prebuilt libexl3_trellis .so")
        path = build_cached_library()
    return _open_library(str(path))


def build_cached_library(arch: str | None = None) -> Path:
    """Build into the per-user cache unless there already; one process builds while the others (tensor-parallel
    ranks starting together) wait on a file lock and then find the finished library."""
    import fcntl
    import logging

    path = cache_path(arch)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_cache(path.parent)  # what is built here is loaded into every server process
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                _check_cache(path, "file")
            else:
                logging.getLogger(__name__).warning(
                    "sglang-exl3: compiling the EXL3 CUDA kernels for sm_%s into %s (once per GPU arch and source "
                    "version; docs/kernels.md gives the build time)", arch_tag(arch), path)
                build_library(path, arch)
    except OSError as e:  # an unwritable cache: say where, and how to avoid it
        raise KernelLibraryUnavailable(f"cannot build the EXL3 kernels into {path.parent} ({e}); set XDG_CACHE_HOME "
                                       "to a writable folder or SGLANG_EXL3_KERNEL_LIB to a prebuilt library") from e
    return path


# The rotation forms the library takes (exl3_set_had_form), by SGLANG_EXL3_DEV_ROTATION_FORM's values
HAD_FORMS = {"auto": 0, "warp": 1, "octet": 2}


@cache
def _open_library(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise KernelLibraryUnavailable(f"cannot load {path}: {e}") from e
    built = abi.library_digest(lib)
    if built != abi.digest():
        raise KernelLibraryUnavailable(f"{path} was built against ABI {built or 'unknown'}, this package's is "
                                       f"{abi.digest()}; rebuild it (python -m sglang_exl3 build-kernels)")
    abi.bind(lib)
    lib.exl3_set_octet_min_items(CROSSOVERS.octet_min_items)
    lib.exl3_set_had_form(HAD_FORMS[knobs.get("DEV_ROTATION_FORM")])
    lib.exl3_set_plain_pdl(int(knobs.get("DEV_PDL_THREE_LAUNCH")))
    return lib


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"EXL3 CUDA kernel {what} failed: {load_library().exl3_error_string(code).decode()}")


def stream(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)
