"""Our CUDA trellis kernels (`csrc/exl3_trellis.cu`): build with nvcc, load with ctypes, call on torch tensors.

The library has a plain C ABI and no torch headers, so it builds in seconds per variant with nvcc alone
and does not depend on the torch build. Found, in order: `SGLANG_EXL3_KERNEL_LIB` (a prebuilt .so), then
the per-user cache (`~/.cache/sglang_exl3`, keyed by source hash and GPU arch). Built by
`python -m sglang_exl3 build-kernels`, or on first use where nvcc exists (`SGLANG_EXL3_BACKEND=cuda`, or `auto`
unless `SGLANG_EXL3_AUTO_BUILD=0`), once, under a file lock shared by the tensor-parallel ranks.

Forward for small m: `had_in` (x * suh, Hadamard-128, fp16) -> fused decode GEMM writing fp32 split-K
partials -> `had_out` (sum of partials, Hadamard-128, fp16, * svh). Larger m: reconstruct W_hat in
column slices + cuBLAS, same rotations.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from sglang_exl3 import knobs
from sglang_exl3.format.constants import Codebook
from sglang_exl3.native_paths import UnsafeNativePath, check_native_path

SOURCE = Path(__file__).parent / "csrc" / "exl3_trellis.cu"
ABI_VERSION = 29
FUSED_MAX_M = 64  # the global-load and x-slice GEMMs' limit (8 groups of 8 rows); the x ring takes any m
# x through the shared-memory ring (benchmarks/results/ring-ab-h200.md, 4 bits, whole linear against the x-slice /
# global-load dispatch): 1.02-1.16x at m = 16, 1.14-1.44x at 32, 1.27-2.33x at 64, and against reconstruct + cuBLAS
# 1.01-1.23x at 128; at m = 1-8 it is 0.92-1.09x, so the smaller m keep the kernels they had. Ring blocks need
# N % 128 == 0 (8 warps of 16 columns); other shapes keep the older kernels up to 64 rows.
RING_MIN_M, RING_MAX_M = 16, 128
RING_BLOCK_ROWS = 64  # rows per ring block (blockIdx.y): more rows decode the weights again per block
RING_COUNTER_ROW_BLOCKS = -(-RING_MAX_M // RING_BLOCK_ROWS)  # a group's ring counters cover up to RING_MAX_M rows
# Above this m: reconstruct + cuBLAS. It is the default of SGLANG_EXL3_FUSED_MAX_M, which overrides it
# (fused_crossover_m()): the ring measured 1.01-1.23x of reconstruct + cuBLAS at 128 rows (ring-ab-h200).
FUSED_CROSSOVER_M = knobs.KNOBS["FUSED_MAX_M"].default
RECONSTRUCT_SLICE_BYTES = 128 << 20  # W_hat scratch per slice of columns for the large-m path
# Rows for which the small-m GEMM stages x in shared memory (one ldmatrix per tile, 48-56 registers instead of 64-96):
# 1.04-1.32x at m = 8 and 1.3-1.8x at m = 16; at m = 1-4 within +-3% for MCG, mostly 1.01-1.05x for MUL1
# (benchmarks/results/xs-ab-h200.md, xs-splits-h200.md). So MCG / 3INST from 8 rows, MUL1 from 1.
# m = 17-64 (4 or 8 row groups: 64-68 / 96 registers instead of 96-108 / 128-184): 1.7-2.0x at 32, 1.3-2.0x at 64.
XS_MIN_M, XS_MAX_M = 8, 64
XS_MIN_M_MUL1 = 1
XS_SMEM_BYTES = 24 << 10  # x slice per block up to 32 rows: splits grow until it fits (8 blocks per SM resident)
XS_SMEM_BYTES_64 = 48 << 10  # 33-64 rows: 48 KB (1.2-1.3x faster than 24 KB there; 96 KB is slower again)
XS_GROUP_SMEM_BYTES = 96 << 10  # a group's splits are fixed at load: above this slice (the kernel's limit), global
# loads; a longer slice costs occupancy but beats global loads (4096x14336, m = 32, 96 KB: 1.6x)
# More splits mean more fp32 partials [splits, m, N]: the raised split count stops where they would pass this (a
# 151936-wide lm_head at m = 64 would need 24 splits, 933 MB); the slice then grows up to XS_GROUP_SMEM_BYTES, and
# where it cannot, global loads (and above 32 rows, reconstruct + cuBLAS: measured faster there).
XS_PARTIAL_BYTES = 64 << 20
# Above this many rows the fused GEMM pays only with x in shared memory: with global loads it measured a median
# 1.68x of reconstruct + cuBLAS at m = 64 (kernels-h200). Single linears and groups then take reconstruct + cuBLAS.
GLOBAL_LOADS_MAX_M = 32
ONE_LAUNCH_MAX_ROWS = 16  # one_launch_linear: one or two 8-row groups (from 16 rows the x ring serves)
# Warps per one-launch block from this many rows: every block rotates its K slice of x for every row, so 8-warp blocks
# (a whole 128-column block each) halve that repeated work against 4-warp ones (half a column block). Measured
# (one-launch-ab, H100): 8 warps faster at every m >= 2 and at m = 1 on five of six shapes (1.7-5.5%; 1.4% slower
# on 4096 x 6144), so every row count takes 8; the 4-warp form stays for the A/B.
ONE_LAUNCH_WIDE_FROM_M = 1


class KernelLibraryUnavailable(RuntimeError):
    pass


def _arch_tag(arch: str | None) -> str:
    if arch:
        return arch.replace("sm_", "").replace(".", "")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "90"


@cache
def _source_digest() -> str:
    """The kernel source's hash (read once: every kernel call resolves the library path through it)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def cache_path(arch: str | None = None) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang_exl3"
    return root / f"libexl3_trellis-{_source_digest()}-sm{_arch_tag(arch)}.so"


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return str(Path(cand) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_library(out: Path | None = None, arch: str | None = None, verbose: bool = False,
                  only_4bit_mcg: bool = False) -> Path:
    """Compile the kernels for one GPU arch (default: this GPU's, else sm_90) into `out` (default: cache).

    `only_4bit_mcg` instantiates the kernels for 4-bit MCG alone (~35 s instead of 7-10 minutes on two cores): the
    host code and its argument checks are the same, every other bitrate and codebook returns -1 (unsupported). It
    is for kernel development and the CPU tests, never for serving, so it refuses the default (cache) output."""
    if only_4bit_mcg and out is None:
        raise ValueError("a 4-bit-MCG-only library serves no other bitrate: give it an explicit `out`, away from "
                         "the cache the server loads")
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelLibraryUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH) to build the EXL3 "
                                       "kernels, or point SGLANG_EXL3_KERNEL_LIB at a prebuilt library")
    tag = _arch_tag(arch)
    if int(tag) < 80:
        raise KernelLibraryUnavailable(f"the EXL3 kernels need sm_80 or newer (mma.m16n8k16), not sm_{tag}")
    out = Path(out) if out else cache_path(tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    # Hopper builds for sm_90a, whose wgmma the ring's warpgroup form needs. Its code runs on sm_90 GPUs only, which
    # is what a per-arch build is for, and sm_90a PTX could not be compiled for a later GPU either, so none is
    # embedded (it made the library 38.8 MB instead of ~28)
    arch_flags = ([f"-gencode=arch=compute_{tag},code=sm_{tag}", f"-gencode=arch=compute_{tag},code=compute_{tag}"]
                  if tag != "90" else ["-gencode=arch=compute_90a,code=sm_90a"])
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", *arch_flags,
           *(["-DEXL3_DEV_4BIT_MCG"] if only_4bit_mcg else []), "-o", str(tmp), str(SOURCE)]
    if verbose:
        cmd.insert(1, "-Xptxas=-v")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelLibraryUnavailable(f"nvcc failed building {SOURCE.name}:\n{proc.stderr[-4000:]}")
    if verbose:
        print(proc.stderr)
    os.replace(tmp, out)  # atomic: concurrent builders (TP ranks) never load a half-written file
    return out


# (SGLANG_EXL3_KERNEL_LIB, XDG_CACHE_HOME, HOME) -> the library found and checked for that setting
_CHECKED_LIBRARIES: dict[tuple[str, str, str], Path] = {}


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
                    "sglang-exl3: compiling the EXL3 CUDA kernels for sm_%s into %s (once; 1-2 minutes)",
                    _arch_tag(arch), path)
                build_library(path, arch)
    except OSError as e:  # an unwritable cache: say where, and how to avoid it
        raise KernelLibraryUnavailable(f"cannot build the EXL3 kernels into {path.parent} ({e}); set XDG_CACHE_HOME "
                                       "to a writable folder or SGLANG_EXL3_KERNEL_LIB to a prebuilt library") from e
    return path


@cache
def _open_library(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise KernelLibraryUnavailable(f"cannot load {path}: {e}") from e
    if lib.exl3_abi_version() != ABI_VERSION:
        raise KernelLibraryUnavailable(f"{path} has ABI {lib.exl3_abi_version()}, expected {ABI_VERSION}; rebuild it")
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.exl3_reconstruct.argtypes = [p, p, i, i, i, i, i, i, i, p]
    lib.exl3_reconstruct_rot_out.argtypes = [p, p, p, i, i, i, i, i, i, i, p]
    lib.exl3_gemm_partial.argtypes = [p, p, p, i, i, i, i, i, i, p]
    lib.exl3_gemm_partial_xs.argtypes = [p, p, p, i, i, i, i, i, i, p]
    lib.exl3_gemm_partial_ring.argtypes = [p, p, p, i, i, i, i, i, i, i, p]
    lib.exl3_had_in.argtypes = [p, i, p, p, i, i, p]
    lib.exl3_had_out.argtypes = [p, i, p, p, i, i, i, i, p]
    lib.exl3_set_had_form.argtypes = [i]
    lib.exl3_set_octet_min_items.restype = ctypes.c_longlong
    lib.exl3_set_octet_min_items.argtypes = [ctypes.c_longlong]
    lib.exl3_group_linear.argtypes = [p, i, p, i, p, p, p, i, i, i, i, i, i, i, i, i, p, ctypes.c_longlong, p]
    lib.exl3_group_linear_cluster.argtypes = [p, i, p, i, p, p, i, i, i, i, i, i, i, i, p]
    lib.exl3_linear_decode.argtypes = [p, i, p, p, i, p, p, ctypes.c_longlong, p, i, i, i, i, i, i, i, i, i, p]
    lib.exl3_routed_tables.argtypes = [p, i, p, i, i, p, i, p]
    lib.exl3_sorted_tables.argtypes = [p, i, p, p, i, i, p, i, p]
    lib.exl3_sorted_plan.argtypes = [p, i, i, i, i, i, p, p, p, i, p]
    lib.exl3_sorted_gather.argtypes = [p, p, i, i, i, p, p]
    lib.exl3_act_mul.argtypes = [p, p, i, i, i, i, i, p]
    lib.exl3_moe_combine.argtypes = [p, p, p, p, i, p, i, i, i, i, p]
    lib.exl3_moe_fused.argtypes = [p, i, p, p, i, i, i, i, i, i, i, i, i, i, p, p, p, p, p, p, p, i, i, i, i,
                                   i, i, p, p]
    lib.exl3_moe_decode.argtypes = [p, i, p, p, p, p, i, p, i, i, i, i, i, i, i, i, i, i, p, p, p, p,
                                    ctypes.c_longlong, i, p, i, i, p]
    lib.exl3_slab_rot_in.argtypes = [p, i, p, i, i, i, p, p, p, i, p]
    lib.exl3_slab_mid.argtypes = [p, p, i, i, p, p, p, p, i, i, p]
    lib.exl3_slab_tail.argtypes = [p, p, i, p, p, p, i, i, i, p]
    lib.exl3_quantize_tiles.argtypes = [p, p, p, p, p, i, i, p]
    lib.exl3_quantize_tiles_fast.argtypes = [p, p, p, i, i, i, i, ctypes.POINTER(i), p]
    lib.exl3_quantize_tiles_fast_scratch.restype = ctypes.c_longlong
    lib.exl3_quantize_tiles_fast_scratch.argtypes = [i]
    lib.exl3_set_octet_min_items(OCTET_MIN_ITEMS)
    lib.exl3_set_had_form(HAD_FORMS[knobs.get("ROTATION_FORM")])
    lib.exl3_set_plain_pdl.argtypes = [i]
    lib.exl3_set_plain_pdl(int(knobs.get("PDL_THREE_LAUNCH")))
    lib.exl3_pdl_usable.argtypes = []  # asked at the first programmatic launch, on the device it runs on
    lib.exl3_wgmma_available.argtypes = []
    lib.exl3_error_string.restype = ctypes.c_char_p
    lib.exl3_error_string.argtypes = [i]
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"EXL3 CUDA kernel {what} failed: {load_library().exl3_error_string(code).decode()}")


def _stream(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)


def _k2(trellis: torch.Tensor) -> int:
    words = trellis.shape[-1]
    if words % 8:
        raise ValueError(f"trellis last dim {words} is not 8 * (2 * bits)")
    return words // 8


def prepare(trellis: torch.Tensor) -> torch.Tensor:
    """The kernels' weight layout: checkpoint trellis [K/16, N/16, words] -> [N/16, K/16, words], so that the
    tiles one warp walks down K are one contiguous stream (done once at load; same bytes)."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"expected an int16 trellis [K/16, N/16, words], got {trellis.dtype} {tuple(trellis.shape)}")
    return trellis.permute(1, 0, 2).contiguous()


def _check_tiles(tiles: torch.Tensor) -> None:
    if tiles.dtype != torch.int16 or not tiles.is_cuda or not tiles.is_contiguous() or tiles.dim() != 3:
        raise ValueError("expected prepare()d weights: a contiguous CUDA int16 tensor [N/16, K/16, words]")
    if tiles.data_ptr() % 4:
        raise ValueError("trellis must be 4-byte aligned")


def reconstruct(tiles: torch.Tensor, codebook: Codebook, col_tiles: tuple[int, int] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat fp16 [K, N] (or the column tiles [t0, t0+count)) from prepare()d weights; bit-identical to the
    reference codec."""
    _check_tiles(tiles)
    nt, kt, _ = tiles.shape
    t0, count = col_tiles or (0, nt)
    if out is None:
        out = torch.empty(kt * 16, count * 16, dtype=torch.float16, device=tiles.device)
    lib = load_library()
    _check(lib.exl3_reconstruct(tiles.data_ptr(), out.data_ptr(), kt, nt, t0, count, out.stride(0), _k2(tiles),
                                int(codebook), _stream(tiles)), "reconstruct")
    return out


def reconstruct_rot_out(tiles: torch.Tensor, codebook: Codebook, svh: torch.Tensor,
                        col_tiles: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """W' = W_hat H r diag(svh) fp16 [K, N] (or the column tiles [t0, t0+count), whole 128-column blocks): the
    reconstructed weight with the output rotation folded in, so that had_in(x) @ W' is the linear's output."""
    _check_tiles(tiles)
    nt, kt, _ = tiles.shape
    t0, count = col_tiles or (0, nt)
    _check_fp16("svh", svh, (nt * 16,))
    if count % 8 or t0 % 8:
        raise ValueError(f"column tiles [{t0}, {t0 + count}) are not whole 128-column blocks")
    if out is None:
        out = torch.empty(kt * 16, count * 16, dtype=torch.float16, device=tiles.device)
    _check(load_library().exl3_reconstruct_rot_out(tiles.data_ptr(), svh[t0 * 16:].data_ptr(), out.data_ptr(), kt, nt,
                                                    t0, count, out.stride(0), _k2(tiles), int(codebook),
                                                    _stream(tiles)), "reconstruct_rot_out")
    return out


def _check_fp16(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float16 or not t.is_cuda or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a contiguous CUDA fp16 tensor {list(shape)}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")


def _check_act(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """An activation our kernels read or write: fp16, or bf16 (converted as it is read or written)."""
    if t.dtype not in (torch.float16, torch.bfloat16) or not t.is_cuda or not t.is_contiguous() or \
            tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a contiguous CUDA fp16 or bf16 tensor {list(shape)}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")


def had_in(x: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """fp16(had_r_128(x * suh)) for fp16 or bf16 x [m, K] (bit-identical to the codec's had_r_128 with pre_scale on
    x cast to fp16: bf16 is rounded to fp16 as it is read, so the model's bf16 activations need no cast kernel)."""
    _check_act("x", x, (x.shape[0], x.shape[-1]))
    _check_fp16("suh", suh, (x.shape[1],))
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    _check(load_library().exl3_had_in(x.data_ptr(), int(x.dtype == torch.bfloat16), suh.data_ptr(), out.data_ptr(),
                                      x.shape[0], x.shape[1], _stream(x)), "had_in")
    return out


def had_out(acc: torch.Tensor, svh: torch.Tensor, out: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """had_r_128(sum over splits of acc [S, m, N] (fp32 or fp16), post_scale=svh) -> [m, N] of `dtype`: fp16, or bf16
    rounded from the fp16 result (what casting it afterwards gives). `out` may be acc itself when there is one fp16
    split (each 128-block is read whole before it is written)."""
    splits, m, n = acc.shape
    if acc.dtype not in (torch.float16, torch.float32) or not acc.is_contiguous():
        raise ValueError(f"acc must be contiguous fp32 or fp16 [splits, m, N], got {acc.dtype}")
    _check_fp16("svh", svh, (n,))
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=acc.device)
    else:
        _check_act("out", out, (m, n))
    _check(load_library().exl3_had_out(acc.data_ptr(), int(acc.dtype == torch.float32), svh.data_ptr(),
                                       out.data_ptr(), int(out.dtype == torch.bfloat16), splits, m, n, _stream(acc)),
           "had_out")
    return out


HAD_FORMS = {"auto": 0, "warp": 1, "octet": 2}
# A rotation launch over at least this many 128-blocks takes the octet form (set in the library when it is loaded),
# except over fp32 split-K partials. H100, rotation-ab: had_out of one fp16 split 1.38-1.47x at 7,168-8,192 blocks and
# 2.0-2.3x above; had_in 1.00-1.03x there and 1.17-1.32x above; the octet form 0.70-0.96x at 2,048 and below
OCTET_MIN_ITEMS = 4096


@contextmanager
def pinned_plain_pdl(on: bool) -> Iterator[None]:
    """The three-launch path's rotations and x-slice GEMMs launched inside go as programmatic dependents (True) or
    plain launches (False); SGLANG_EXL3_PDL_THREE_LAUNCH sets it for the process when the library loads. The same
    bits either way; for A/B measurements and tests. A CUDA graph keeps the launches it was captured with."""
    lib = load_library()
    before = lib.exl3_set_plain_pdl(int(on))
    try:
        yield
    finally:
        lib.exl3_set_plain_pdl(before)


@contextmanager
def pinned_had_form(form: str) -> Iterator[None]:
    """Every rotation launched inside (had_in, had_out and a group's rotations) takes `form`: 'warp' (one warp per
    128-block, shuffle butterflies), 'octet' (eight threads per 128-block, registers and one shared-memory
    transpose) or 'auto' (octet from a size; the default). Both forms give the same bits; this is for A/B
    measurements and tests. A CUDA graph keeps the form it was captured with."""
    if form not in HAD_FORMS:
        raise ValueError(f"rotation form must be one of {sorted(HAD_FORMS)}, got {form!r}")
    lib = load_library()
    before = lib.exl3_set_had_form(HAD_FORMS[form])
    try:
        yield
    finally:
        lib.exl3_set_had_form(before)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(k_tiles: int, n_tiles: int, device: torch.device, warps_per_sm: int = 32,
                   min_tiles_per_warp: int = 16) -> int:
    """Split K so that the (16-column strip, K split) work items -- one warp each -- about fill the resident
    warps of every SM, keeping at least `min_tiles_per_warp` tiles per warp (benchmarks/kernels.py --tune on
    the H200: fewer, longer warps lose occupancy; more, shorter ones pay their set-up and the reduction). Where
    one wave would take fewer than 4 splits, rounding is coarse (5120 x 27648: 2.4 -> 2, a 0.8 wave); aim for two
    waves there (5 splits: 4-6% faster, benchmarks/results/xs-splits-h200.md)."""
    capacity = _sm_count(device.index or 0) * warps_per_sm
    waves = capacity / n_tiles
    splits = max(1, round(waves if waves >= 4 else 2 * waves))
    return max(1, min(splits, k_tiles // min_tiles_per_warp))


def xs_rows(m: int) -> int:
    """Rows of x a block stages: m up to 16, else whole 16-row groups of the kernel's row groups (32 or 64)."""
    return m if m <= 16 else (32 if m <= 32 else 64)


def xs_smem(m: int, slice_tiles: int) -> int:
    """Shared memory of one block's x slice: 32 bytes per tile and row, plus a 16-byte skew per row."""
    return xs_rows(m) * (slice_tiles * 32 + 16)


def xs_min_splits(m: int, k_tiles: int, smem_bytes: int | None = None) -> int:
    """Fewest K splits whose x slice fits `smem_bytes` of shared memory per block (default: the policy's budget)."""
    smem_bytes = smem_bytes or (XS_SMEM_BYTES if m <= 32 else XS_SMEM_BYTES_64)
    slice_tiles = max(1, (smem_bytes // xs_rows(m) - 16) // 32)
    return -(-k_tiles // slice_tiles)


def use_xs(m: int, codebook: Codebook | int | None = None) -> bool:
    """Whether m rows of this codebook stage x in shared memory (one ldmatrix per tile instead of per-lane global
    loads). The kernels also need N % 64 == 0, which every group source and expert has (N % 128 == 0)."""
    lo = XS_MIN_M_MUL1 if codebook is not None and int(codebook) == int(Codebook.MUL1) else XS_MIN_M
    return lo <= m <= XS_MAX_M


def xs_splits(m: int, k_tiles: int, n_tiles: int, base_splits: int) -> int | None:
    """Split count for the shared-memory-x GEMM: the policy's budget's (`xs_min_splits`), no fewer than
    `base_splits`, no more than keep the partials within XS_PARTIAL_BYTES; None where the slice that leaves cannot
    fit XS_GROUP_SMEM_BYTES (then global loads)."""
    cap = max(base_splits, XS_PARTIAL_BYTES // (m * n_tiles * 16 * 4))
    splits = min(k_tiles, max(base_splits, min(xs_min_splits(m, k_tiles), cap)))
    return splits if xs_smem(m, -(-k_tiles // splits)) <= XS_GROUP_SMEM_BYTES else None


def auto_xs_splits(m: int, k_tiles: int, n_tiles: int, codebook: Codebook | int, device: torch.device) -> int | None:
    """The policy for a single linear given no split count: the shared-memory-x split count, or None for global
    loads at `default_splits`."""
    if not use_xs(m, codebook) or n_tiles % 4:
        return None
    return xs_splits(m, k_tiles, n_tiles, default_splits(k_tiles, n_tiles, device))


def gemm_rotated_partial(xh: torch.Tensor, tiles: torch.Tensor, codebook: Codebook,
                         splits: int | None = None, xs: bool | None = None, ring: int = 0) -> torch.Tensor:
    """fp32 split-K partials [S, m, N] of xh (fp16 [m, K], rotated) @ W_hat (prepare()d weights); m <= 64.
    `xs`: stage x in shared memory (None: `use_xs`); the partials are the same bit for bit.
    `ring` (RING_MODES: warps per block * 10 + trellis groups per chunk): stream x through the shared-memory ring
    instead (any m, in 64-row blocks; N a multiple of 16 * warps); the same partials at equal splits. WG_MODES: the
    same ring on wgmma (wgmma_ready() builds; blocks of wg_block_rows(m) rows)."""
    _check_tiles(tiles)
    nt, kt, _ = tiles.shape
    m = xh.shape[0]
    if xh.dtype != torch.float16 or not xh.is_contiguous() or xh.shape[1] != kt * 16:
        raise ValueError(f"xh must be contiguous fp16 [m, {kt * 16}], got {xh.dtype} {tuple(xh.shape)}")
    if ring:
        return _gemm_ring(xh, tiles, codebook, splits or default_splits(kt, nt, xh.device), ring)
    if m > FUSED_MAX_M:
        raise ValueError(f"the fused EXL3 kernel takes at most {FUSED_MAX_M} rows, got {m}")
    if xs and nt % 4:
        raise ValueError(f"x in shared memory takes N % 64 == 0, got N={nt * 16}")
    if xs is None and not splits:  # the policy
        splits = auto_xs_splits(m, kt, nt, codebook, xh.device)
        xs = splits is not None
    elif xs is None:  # a caller's own splits keep global loads where their slice is too long
        xs = use_xs(m, codebook) and nt % 4 == 0 and xs_smem(m, -(-kt // splits)) <= XS_GROUP_SMEM_BYTES
    if not splits:
        splits = default_splits(kt, nt, xh.device)
        if xs:
            chosen = xs_splits(m, kt, nt, splits)
            xs, splits = (True, chosen) if chosen else (False, splits)
    partial = torch.empty(splits, m, nt * 16, dtype=torch.float32, device=xh.device)
    fn = load_library().exl3_gemm_partial_xs if xs else load_library().exl3_gemm_partial
    _check(fn(xh.data_ptr(), tiles.data_ptr(), partial.data_ptr(), m, kt, nt, splits, _k2(tiles), int(codebook),
              _stream(xh)), "gemm")
    return partial


RING_MODES = (81, 82)  # x-ring GEMM: warps per block (8) * 10 + trellis groups per x chunk (1, 2)
# The x ring on Hopper's warpgroup MMA (sm_90a builds), decoding the weights once per block of wg_block_rows(m) rows
# (up to 256), wgmma fed from registers: 90 + trellis groups per x chunk. H100, wgmma-ab (four shapes, whole linear,
# 4 bits): its best cell 0.88-1.06x the mma.sync ring at 16-32 rows, 1.01-1.10x at 48-64, 1.32-1.49x at 96-128 on
# the wide shapes, 1.23-1.74x against reconstruct + cuBLAS at 192-256 and 0.69-0.99x at 384 and 1,024; at 48-256 rows
# mode 91 is within 2.2% of 92 where 92 won. So it serves WG_MIN_M..WG_MAX_M rows where the build has it.
WG_MODES = (91, 92)
WG_MIN_M, WG_MAX_M = 33, 256
# A group's launch runs at its load-time splits, which the wgmma ring measured slow with above 64 rows (gate/up
# 162 µs at 128 rows against 2 x 61 for its two sources alone, which take a quarter of default_splits there): above
# this a group on the wgmma ring runs source by source.
WG_GROUP_MAX_M = 64
_WGMMA: dict[int, bool] = {}  # the library's probe, per device index
_WGMMA_PIN: list[bool] = []  # pinned_wgmma's stack


@cache
def _wgmma_knob() -> bool:
    return knobs.get("WGMMA") != "off"


@contextmanager
def pinned_wgmma(on: bool) -> Iterator[None]:
    """Inside, the policy takes the wgmma ring where it is available (on) or the mma.sync ring (off), whatever
    SGLANG_EXL3_WGMMA says: for A/B measurements and tests. A CUDA graph keeps the kernels it was captured with."""
    _WGMMA_PIN.append(on)
    try:
        yield
    finally:
        _WGMMA_PIN.pop()


def wgmma_ready(device: torch.device | None = None) -> bool:
    """Whether the wgmma ring serves this GPU: the library was built for sm_90a and runs on it, and
    SGLANG_EXL3_WGMMA is not off. The library's probe synchronizes, so it runs once per device, never inside a CUDA
    graph capture (a capture before any probe keeps the mma.sync ring)."""
    if not (_WGMMA_PIN[-1] if _WGMMA_PIN else _wgmma_knob()) or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _WGMMA:
        if torch.cuda.is_current_stream_capturing():
            return False
        with torch.cuda.device(index):
            _WGMMA[index] = load_library().exl3_wgmma_available() == 1
    return _WGMMA[index]


def wg_block_rows(m: int) -> int:
    """Rows of x per wgmma ring block (the library's wg_rows): the wgmma N, 16 to 256."""
    return next(r for r in (16, 32, 64, 128) if m <= r) if m <= 128 else 256


def ring_mode(m: int, device: torch.device | None = None) -> int:
    """The ring's mode for m rows: the wgmma ring (91) from WG_MIN_M rows where wgmma_ready(), else the mma.sync ring
    (mma_ring_mode)."""
    if m >= WG_MIN_M and wgmma_ready(device):
        return 91
    return mma_ring_mode(m)


def mma_ring_mode(m: int) -> int:
    """The mma.sync ring's mode for m rows: 8 warps per block, x in chunks of two trellis groups up to 32 rows and of
    one above (ring-ab-h200: with ring_splits, the fastest measured cell at 32 and 64 rows on all four shapes, within
    4% at 16 and 128)."""
    return 82 if m <= 32 else 81


def ring_splits(m: int, k_tiles: int, n_tiles: int, device: torch.device, mode: int | None = None) -> int:
    """Half of default_splits, rounded up, unless that leaves fewer ring blocks than SMs (then default_splits): a
    ring block serves 8 column strips of one 64-row block, and fewer, longer K splits write fewer partials
    (ring-ab-h200: the best of {half, default, double} at m = 16-128 on 4096 x 14336, 14336 x 4096 and 4096 x 4096;
    on 4096 x 1024 half gives 64 blocks and default_splits is up to 21% faster). The wgmma ring: half up to 64 rows
    and a quarter above (wgmma-ab, H100: the fastest of {1, quarter, half, default} at 64-256 rows on 4096 x 14336
    and 14336 x 4096, where a block of 128-256 rows has the most work per tile), unless that leaves fewer blocks than
    half the SMs (then default_splits: 4096 x 1024 at 48-256 rows, 1.02-1.08x the best other count)."""
    base = default_splits(k_tiles, n_tiles, device)
    half = max(1, -(-base // 2))
    mode = ring_mode(m, device) if mode is None else mode
    if mode in WG_MODES:
        chosen = half if m <= 64 else max(1, base // 4)
        blocks = n_tiles // 8 * chosen * -(-m // wg_block_rows(m))
        return chosen if 2 * blocks >= _sm_count(device.index or 0) else base
    blocks = n_tiles * half // 8 * -(-m // RING_BLOCK_ROWS)
    return half if blocks >= _sm_count(device.index or 0) else base


def uses_ring(m: int, n_tiles: int, device: torch.device | None = None) -> bool:
    """Whether m rows of a linear (or of every source of a group) with N = 16 n_tiles take the x-ring GEMM: up to
    WG_MAX_M rows where the wgmma ring serves, else RING_MAX_M."""
    most = WG_MAX_M if m > RING_MAX_M and wgmma_ready(device) else RING_MAX_M
    return RING_MIN_M <= m <= most and n_tiles % 8 == 0


def _check_ring(mode: int, n_tiles: int) -> None:
    if mode not in RING_MODES + WG_MODES or n_tiles % 8:
        raise ValueError(f"the x-ring GEMM takes a mode in {RING_MODES + WG_MODES} and N % 128 == 0, got mode {mode} "
                         f"and N={n_tiles * 16}")


def _gemm_ring(xh: torch.Tensor, tiles: torch.Tensor, codebook: Codebook, splits: int, mode: int) -> torch.Tensor:
    nt, kt, _ = tiles.shape
    _check_ring(mode, nt)
    m = xh.shape[0]
    partial = torch.empty(splits, m, nt * 16, dtype=torch.float32, device=xh.device)
    _check(load_library().exl3_gemm_partial_ring(xh.data_ptr(), tiles.data_ptr(), partial.data_ptr(), m, kt, nt,
                                                 splits, _k2(tiles), int(codebook), mode, _stream(xh)), "gemm")
    return partial


@cache
def fused_max_m_knob() -> int | None:
    """SGLANG_EXL3_FUSED_MAX_M where it is set, else None. Read once per process (validated at startup; parsing the
    environment per linear call cost ~2 µs on the eager path)."""
    return knobs.get("FUSED_MAX_M") if os.environ.get(knobs.KNOBS["FUSED_MAX_M"].env, "").strip() else None


def fused_crossover_m(device: torch.device | None = None) -> int:
    """The most rows a dense linear runs on the fused GEMM: SGLANG_EXL3_FUSED_MAX_M where set, else WG_MAX_M where the
    wgmma ring serves, else FUSED_CROSSOVER_M."""
    knob = fused_max_m_knob()
    if knob is not None:
        return knob
    return WG_MAX_M if wgmma_ready(device) else FUSED_CROSSOVER_M


def exl3_linear(x: torch.Tensor, tiles: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                codebook: Codebook, splits: int | None = None, path: str | None = None,
                fused_max_m: int | None = None) -> torch.Tensor:
    """y [m, N] = had(had(x * suh) @ W_hat) * svh for fp16 or bf16 x [m, K] (y of x's dtype, bf16 rounded from the
    fp16 result) and prepare()d weights.
    `path`: 'fused', 'reconstruct' (W' = W_hat H r diag(svh) per column slice, then had_in(x) @ W' in cuBLAS),
    'reconstruct_staged' (W_hat, cuBLAS, then the output rotation over m x N) or None (fused up to `fused_max_m`
    rows, default fused_crossover_m(), else 'reconstruct_staged': on the H200 the rotated reconstruct measured 168
    vs 107 µs at m = 256 and 0.94-1.06x at m = 2048, benchmarks/results/prefill-h200.md)."""
    m = x.shape[0]
    if fused_max_m is None:
        fused_max_m = fused_crossover_m(x.device)
    xh = had_in(x.contiguous(), suh)
    xs, ring = None, 0
    if path is None:
        path = "fused" if m <= fused_max_m else "reconstruct_staged"
        if path == "fused" and not splits and uses_ring(m, tiles.shape[0], x.device):
            ring = ring_mode(m, x.device)
            splits = ring_splits(m, tiles.shape[1], tiles.shape[0], x.device, ring)
        elif path == "fused" and not splits:  # decided once here: 33-64 rows pay only with x in shared memory
            splits = auto_xs_splits(m, tiles.shape[1], tiles.shape[0], codebook, x.device)
            xs = splits is not None
            if m > GLOBAL_LOADS_MAX_M and not xs:
                path = "reconstruct_staged"
    if path == "fused":
        return had_out(gemm_rotated_partial(xh, tiles, codebook, splits, xs=xs, ring=ring), svh, dtype=x.dtype)
    if path not in ("reconstruct", "reconstruct_staged"):
        raise ValueError(f"unknown EXL3 linear path {path!r}")
    rotated = path == "reconstruct"
    nt, kt, _ = tiles.shape
    y = torch.empty(1, m, nt * 16, dtype=torch.float16, device=x.device)
    cols = max(8, RECONSTRUCT_SLICE_BYTES // (kt * 16 * 2) // 128 * 8)  # column tiles per slice (x128 columns)
    scratch = torch.empty(kt * 16, min(cols, nt) * 16, dtype=torch.float16, device=x.device)
    for t0 in range(0, nt, cols):
        count = min(cols, nt - t0)
        w = scratch[:, : count * 16]
        if count * 16 != scratch.shape[1]:
            w = torch.empty(kt * 16, count * 16, dtype=torch.float16, device=x.device)
        if rotated:
            reconstruct_rot_out(tiles, codebook, svh, (t0, count), out=w)
        else:
            reconstruct(tiles, codebook, (t0, count), out=w)
        torch.matmul(xh, w, out=y[0, :, t0 * 16:(t0 + count) * 16])
    return y[0].to(x.dtype) if rotated else had_out(y, svh, dtype=x.dtype)


def dense_experts(tiles: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: Codebook, ones: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Original-basis weights of E experts in the [E, N, K] layout of SGLang's fused_experts: out[e] =
    (diag(suh_e) H W_hat_e H diag(svh_e))^T, for the experts' prepare()d weights stacked along N (tiles
    [E*N/16, K/16, words]), suh [E, K], svh [E*N] and `ones` fp16 [K]. Five launches for all E experts: reconstruct,
    output rotation (x svh), transpose, input rotation, x suh. `out` may be a strided view (a slab's gate half)."""
    e_count, k = suh.shape
    nt = tiles.shape[0]
    w = reconstruct(tiles, codebook)  # [K, E*N]
    had_out(w.view(1, k, nt * 16), svh, out=w)
    wt = w.t().contiguous()  # [E*N, K]
    had_out(wt.view(1, nt * 16, k), ones, out=wt)  # the rotation; x 1 is exact, so suh can follow per expert
    torch.mul(wt.view(e_count, nt * 16 // e_count, k), suh.view(e_count, 1, k), out=out)


@dataclass(frozen=True)
class Exl3Group:
    """Same-input sources (q/k/v, gate/up) that run as one: a multi-source input rotation, one GEMM launch over
    every source's work items and one output rotation writing the concatenated output (3 launches, not 3 per
    source). Built once per layer at load; `table` (GroupSource[] in device memory) points into the source
    tensors, which `sources` keeps alive. On the wgmma ring a group made at the policy's splits runs a second set of
    rows at fewer splits (`wg_splits`: one where its columns fill the SMs, else half): `launch_rows`."""

    table: torch.Tensor  # int64 [num, 8], then the wgmma ring's [num, 8] where wg_items > 0
    num: int
    k_tiles: int
    total_items: int
    total_cols: int
    partial_per_row: int  # sum over sources of splits * N
    k2: int
    codebook: int
    sources: tuple = ()
    max_slice: int = 0  # the longest K slice of any source, in tiles (sizes x in shared memory)
    # int32 [RING_COUNTER_ROW_BLOCKS * total_cols / 128], zero between calls: with them the ring GEMM rotates its own
    # output (the last block of each 64 rows x 128 columns), one launch fewer
    ring_counters: torch.Tensor | None = None
    wg_items: int = 0  # the wgmma ring's rows (table[num:]): work items and partials per row; 0: none
    wg_partial_per_row: int = 0
    wg_cluster: int = 0  # those rows' split count where every source has it and a cluster holds it (<= 8), else 0

    @property
    def meta(self) -> list[int]:
        """The ints a registered op needs to rebuild this group around its table (see from_meta)."""
        return [self.num, self.k_tiles, self.total_items, self.total_cols, self.partial_per_row, self.k2,
                self.max_slice, self.wg_items, self.wg_partial_per_row, self.wg_cluster]

    @classmethod
    def from_meta(cls, table: torch.Tensor, meta: list[int], codebook: int) -> Exl3Group:
        num, k_tiles, total_items, total_cols, partial_per_row, k2, max_slice, wg_items, wg_partial, wg_cluster = meta
        return cls(table=table, num=num, k_tiles=k_tiles, total_items=total_items, total_cols=total_cols,
                   partial_per_row=partial_per_row, k2=k2, codebook=int(codebook), max_slice=max_slice,
                   wg_items=wg_items, wg_partial_per_row=wg_partial, wg_cluster=wg_cluster)

    def launch_rows(self, ring: int) -> tuple[torch.Tensor, int, int]:
        """The table rows, work items and partials per row that a launch on `ring` takes: the wgmma ring's own rows
        where the group has them, else the load-time rows."""
        if ring in WG_MODES and self.wg_items:
            return self.table[self.num:], self.wg_items, self.wg_partial_per_row
        return self.table[:self.num], self.total_items, self.partial_per_row

    def runs_fused(self, m: int) -> bool:
        """Whether m rows run as this group's one fused launch: up to fused_crossover_m(); through the x ring from
        RING_MIN_M rows (the wgmma ring up to WG_GROUP_MAX_M); otherwise above GLOBAL_LOADS_MAX_M only where x can be
        staged (its splits are fixed at load; a gate/up group with long K slices cannot stage 64 rows). Otherwise
        each source runs as a single linear, by the single-linear policy."""
        if m > fused_crossover_m():
            return False
        ring = self.ring_mode(m)
        if ring in WG_MODES:
            return m <= WG_GROUP_MAX_M
        return bool(ring) or (m <= GLOBAL_LOADS_MAX_M or self.xs_slice(m) > 0)

    def ring_mode(self, m: int) -> int:
        """The x-ring mode for m rows, 0 where the ring does not serve them (every source's N is a multiple of 128,
        which the ring's 8-warp blocks need). The mma.sync ring runs at the group's load-time splits, the wgmma ring at
        launch_rows'."""
        return ring_mode(m) if uses_ring(m, 8) else 0

    def xs_slice(self, m: int) -> int:
        """The x slice to stage in shared memory for m rows (0: global loads): where use_xs says so and the
        slice fits XS_GROUP_SMEM_BYTES (the group's splits are fixed at load, unlike a single linear's)."""
        fits = xs_smem(m, self.max_slice) <= XS_GROUP_SMEM_BYTES
        return self.max_slice if use_xs(m, self.codebook) and fits else 0

    def cluster_serves(self, m: int, ring: int | None = None) -> bool:
        """Whether m rows on `ring` (default ring_mode(m)) run in the cluster form (group_run_cluster): a wgmma mode,
        at most 64 rows, and wgmma rows whose split count SGLANG_EXL3_WG_CLUSTER takes (cluster_form_for)."""
        ring = self.ring_mode(m) if ring is None else ring
        return ring in WG_MODES and m <= FUSED_MAX_M and cluster_form_for(self.wg_cluster, _cluster_knob())

    def ring_counters_for(self, m: int) -> torch.Tensor | None:
        """The counters with which m rows' ring launch rotates its own output; None where they cannot cover m."""
        c = self.ring_counters
        return c if c is not None and c.numel() >= -(-m // RING_BLOCK_ROWS) * (self.total_cols // 128) else None


def _check_source(what: str, tiles: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> None:
    """One source of a group or bank: prepare()d weights, its rotations, whole 128-wide output blocks."""
    _check_tiles(tiles)
    nt, kt = tiles.shape[0], tiles.shape[1]
    if nt * 16 % 128:
        raise ValueError(f"{what}: N = {nt * 16} is not a multiple of 128")
    _check_fp16(f"{what} suh", suh, (kt * 16,))
    _check_fp16(f"{what} svh", svh, (nt * 16,))


def make_group(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor], codebook: Codebook,
               splits: list[int] | None = None) -> Exl3Group:
    """Sources must share K, bits and codebook; each source's N a multiple of 128 (its output Hadamard blocks)."""
    if not tiles or not (len(tiles) == len(suh) == len(svh)):
        raise ValueError("a group needs matching, non-empty lists of tiles, suh and svh")
    _check_tiles(tiles[0])
    kt, k2 = tiles[0].shape[1], _k2(tiles[0])
    sources = []
    for i, t in enumerate(tiles):
        nt = t.shape[0]
        if t.shape[1] != kt or _k2(t) != k2:
            raise ValueError(f"group source {i}: K/16 = {t.shape[1]}, words = {t.shape[2]}; the group has K/16 = {kt}, "
                             f"words = {tiles[0].shape[2]} (sources of one group share K, bits and codebook)")
        _check_source(f"group source {i}", t, suh[i], svh[i])
        sp = splits[i] if splits else default_splits(kt, nt, t.device)
        sources.append((t.data_ptr(), suh[i].data_ptr(), svh[i].data_ptr(), nt, sp))
    rows, item, col, base = group_table(sources)
    wg = None if splits else wg_splits([src[3] for src in sources], [src[4] for src in sources], tiles[0].device)
    wg_rows, wg_item, wg_base = [], 0, 0
    if wg:
        wg_rows, wg_item, _, wg_base = group_table([(*src[:4], sp) for src, sp in zip(sources, wg, strict=True)])
    table = torch.tensor(rows + wg_rows, dtype=torch.int64).to(tiles[0].device)
    counters = torch.zeros(RING_COUNTER_ROW_BLOCKS * col // 128, dtype=torch.int32, device=tiles[0].device)
    return Exl3Group(table=table, num=len(tiles), k_tiles=kt, total_items=item, total_cols=col, partial_per_row=base,
                     k2=k2, codebook=int(codebook), sources=(tuple(tiles), tuple(suh), tuple(svh)),
                     max_slice=max(-(-kt // src[4]) for src in sources), ring_counters=counters, wg_items=wg_item,
                     wg_partial_per_row=wg_base, wg_cluster=cluster_splits(wg))


def wg_splits(n_tiles: list[int], splits: list[int], device: torch.device) -> list[int] | None:
    """A group's splits on the wgmma ring (33-64 rows). Every split writes fp32 partials [S, m, N] that the output
    rotation reads back, and K splits are there only to give every SM a block: where the group's 128-column blocks
    alone number the SMs (Llama-3-8B gate/up: 224), one split (its 64 rows in 79.6 µs against 83.6 at 2 splits and
    86.2 at 3; H100, benchmarks/results/wgmma-ab-group-splits-h100-80gb-hbm3.md); otherwise half the load-time splits,
    rounded up -- the single-linear policy's count there (ring_splits; q/k/v: 16 -> 8, 26.5 µs against 26.8 at a
    quarter and 28.2 at an eighth) -- unless that leaves fewer blocks than half the SMs. None where no source would
    change."""
    sms = _sm_count(device.index or 0)
    if sum(nt // 8 for nt in n_tiles) >= sms:
        fewer = [1] * len(splits)
    else:
        fewer = [max(1, -(-sp // 2)) for sp in splits]
    blocks = sum(nt // 8 * sp for nt, sp in zip(n_tiles, fewer, strict=True))
    if fewer == list(splits) or 2 * blocks < sms:
        return None
    return fewer


def cluster_splits(wg: list[int] | None) -> int:
    """Exl3Group.wg_cluster for wgmma rows at these splits (wg_splits): their shared split count where a cluster
    holds it (at most 8), else 0."""
    return wg[0] if wg and len(set(wg)) == 1 and wg[0] <= 8 else 0


def single_wg_cluster(k_tiles: int, n_tiles: int, device: torch.device) -> int:
    """wg_cluster of a single linear's one-source group at default splits, without making the group."""
    return cluster_splits(wg_splits([n_tiles], [default_splits(k_tiles, n_tiles, device)], device))


def group_table(sources: list[tuple[int, int, int, int, int]]) -> tuple[list[list[int]], int, int, int]:
    """GroupSource rows for same-input sources (tiles, suh, svh pointers, n_tiles, splits), numbered in order: the
    rows, the total work items, output columns and partial elements per row."""
    rows, item, col, base = [], 0, 0, 0
    for tiles, suh, svh, nt, sp in sources:
        rows.append([tiles, suh, svh, pack_tiles_splits(nt, sp), 0, item, col, base])
        item, col, base = item + nt * sp, col + nt * 16, base + sp * nt * 16
    return rows, item, col, base


def pack_tiles_splits(n_tiles: int, splits: int) -> int:
    """GroupSource's two int32 fields n_tiles, splits as one little-endian int64."""
    return n_tiles | (splits << 32)


@dataclass(frozen=True)
class Exl3ExpertBank:
    """One role (gate, up or down) of a MoE layer's local experts as GroupSource rows [E, 8] in device memory, for
    routed groups: one source per (token, expert) pair, gathered on the device from the routing (capturable).
    Every expert of a bank shares K, N, bits and codebook."""

    rows: torch.Tensor  # int64 [E, 8]: tiles, suh, svh, n_tiles | splits << 32, then 4 fields set per pair
    n_tiles: int
    k_tiles: int
    splits: int
    k2: int
    codebook: int
    sources: tuple = ()

    @property
    def meta(self) -> list[int]:
        return [self.n_tiles, self.k_tiles, self.splits, self.k2, self.codebook]

    @classmethod
    def from_meta(cls, rows: torch.Tensor, meta: list[int]) -> Exl3ExpertBank:
        n_tiles, k_tiles, splits, k2, codebook = meta
        return cls(rows=rows, n_tiles=n_tiles, k_tiles=k_tiles, splits=splits, k2=k2, codebook=codebook)

    def runs_with(self, other: Exl3ExpertBank) -> bool:
        """Whether one launch can run both banks (the fused forwards run gate and up as one group): same shape,
        bits and codebook. R7 checkpoints give an expert's gate and up their own bitrates."""
        return (self.n_tiles, self.k_tiles, self.k2, self.codebook) == (other.n_tiles, other.k_tiles, other.k2,
                                                                         other.codebook)


def make_expert_bank(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor],
                     codebook: Codebook, splits: int | None = None) -> Exl3ExpertBank:
    if not tiles or not (len(tiles) == len(suh) == len(svh)):
        raise ValueError("an expert bank needs matching, non-empty lists of tiles, suh and svh")
    nt, kt, k2 = tiles[0].shape[0], tiles[0].shape[1], _k2(tiles[0])
    for i, t in enumerate(tiles):
        _check_source(f"expert {i}", t, suh[i], svh[i])
        if tuple(t.shape) != tuple(tiles[0].shape):
            raise ValueError(f"expert {i}: weights {tuple(t.shape)}, expert 0 {tuple(tiles[0].shape)} (the experts "
                             "of one bank share K, N and bits)")
    sp = splits or default_splits(kt, nt, tiles[0].device)
    rows = bank_rows([(t.data_ptr(), u.data_ptr(), v.data_ptr()) for t, u, v in zip(tiles, suh, svh, strict=True)],
                     nt, sp)
    return Exl3ExpertBank(rows=rows.to(tiles[0].device), n_tiles=nt, k_tiles=kt, splits=sp, k2=k2,
                          codebook=int(codebook), sources=(tuple(tiles), tuple(suh), tuple(svh)))


def bank_rows(pointers: list[tuple[int, int, int]], n_tiles: int, splits: int) -> torch.Tensor:
    """int64 [E, 8] GroupSource rows of one bank (per-pair fields left 0: routed_table fills them)."""
    return torch.tensor([[t, u, v, pack_tiles_splits(n_tiles, splits), 0, 0, 0, 0] for t, u, v in pointers],
                        dtype=torch.int64)


@dataclass(frozen=True)
class RoutedBlock:
    """One group's block of a routed table: its rows [start, start + num) and the totals its launch needs."""

    start: int
    num: int
    items: int
    cols: int
    partial: int
    widths: tuple[int, ...]


def routed_tables(groups: list[tuple[list[Exl3ExpertBank], int]], ids: torch.Tensor,
                  build=None) -> tuple[torch.Tensor, list[RoutedBlock]]:
    """GroupSource rows for every (group, bank, pair): bank b's expert ids[p] reading x row p // x_row_div (the
    group's), numbered bank by bank, pair by pair, each group's work items, columns and partials from 0; an id below
    0 (another EP rank's expert) reads expert 0, to be weighed 0 by the caller. `build(banks, ids, params, table)`
    fills the table, params holding per bank (item0, col0, base0, x_row_div) (default: the torch reference;
    `routed_table_builder` is the library's one launch for all banks of all groups)."""
    pairs = ids.shape[0]
    banks, params, blocks = [], [], []
    for group, x_row_div in groups:
        item = col = base = 0
        for b in group:
            params.append((item, col, base, x_row_div))
            items, cols, part = source_sizes(b)
            item, col, base = item + pairs * items, col + pairs * cols, base + pairs * part
        blocks.append(RoutedBlock(start=len(banks) * pairs, num=len(group) * pairs, items=item, cols=col,
                                  partial=base, widths=tuple(b.n_tiles * 16 for b in group)))
        banks += group
    table = torch.empty(len(banks) * pairs, 8, dtype=torch.int64, device=ids.device)
    (build or _torch_routed_rows)(banks, ids, params, table)
    return table, blocks


def routed_table(banks: list[Exl3ExpertBank], ids: torch.Tensor, x_row_div: int,
                 build=None) -> tuple[torch.Tensor, int, int, int, list[int]]:
    """One group's routed table: the table, total work items, output columns, partial elements and each bank's
    output width."""
    table, (block,) = routed_tables([(banks, x_row_div)], ids, build)
    return table, block.items, block.cols, block.partial, list(block.widths)


def source_sizes(bank: Exl3ExpertBank) -> tuple[int, int, int]:
    """Work items, output columns and partial elements of one source of the bank."""
    n = bank.n_tiles * 16
    return bank.n_tiles * bank.splits, n, bank.splits * n


def _torch_routed_rows(banks: list[Exl3ExpertBank], ids: torch.Tensor, params: list[tuple[int, int, int, int]],
                       table: torch.Tensor) -> None:
    """The reference builder (torch ops): what the kernel's routed_source computes per pair."""
    pairs = ids.shape[0]
    arange = torch.arange(pairs, device=ids.device, dtype=torch.int64)
    experts = ids.to(torch.int64).clamp(min=0)
    for i, (b, (item0, col0, base0, x_row_div)) in enumerate(zip(banks, params, strict=True)):
        items, cols, part = source_sizes(b)
        out = table[i * pairs:(i + 1) * pairs]
        out[:, :4] = b.rows.index_select(0, experts)[:, :4]
        out[:, 4] = arange // x_row_div
        out[:, 5] = item0 + arange * items
        out[:, 6] = col0 + arange * cols
        out[:, 7] = base0 + arange * part


def flat_routing_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """[tokens * top-k] routing ids as the MoE kernels read them: SGLang's int32 (or int64) as they come, anything
    else as int32; ids below 0 (another expert-parallel rank's experts) are kept, the kernels skip them."""
    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int32)
    return ids.contiguous()


def _ids_bytes(ids: torch.Tensor) -> int:
    if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(f"routing ids must be contiguous int32 or int64, got {ids.dtype}")
    return ids.element_size()


def routed_table_builder(on_host: bool = False):
    """The library's one-launch builder for all banks (`on_host`: the same code over host memory, for tests without
    a GPU)."""
    lib = load_library()

    def build(banks, ids, params, table):
        flat = []
        for b, (item0, col0, base0, x_row_div) in zip(banks, params, strict=True):
            flat += [b.rows.data_ptr(), item0, col0, base0, *source_sizes(b), x_row_div]
        host = (ctypes.c_longlong * len(flat))(*flat)
        stream = None if on_host else _stream(ids)
        _check(lib.exl3_routed_tables(host, len(banks), ids.data_ptr(), _ids_bytes(ids), ids.shape[0],
                                      table.data_ptr(), int(on_host), stream), "routed tables")
    return build


def sorted_table_builder(on_host: bool = False):
    """The library's one-launch builder of expert-sorted tables for all banks (kernels/moe_sorted.py sorted_tables;
    `on_host`: the same code over host memory, for tests without a GPU)."""
    lib = load_library()

    def build(banks, experts, filled, tile, params, table):
        flat = []
        for b, (items_before, cols_before, parts_before, splits) in zip(banks, params, strict=True):
            flat += [b.rows.data_ptr(), b.n_tiles, items_before, cols_before, parts_before, splits]
        host = (ctypes.c_longlong * len(flat))(*flat)
        _check(lib.exl3_sorted_tables(host, len(banks), experts.data_ptr(), filled.data_ptr(), experts.shape[0], tile,
                                      table.data_ptr(), int(on_host), None if on_host else _stream(table)),
               "sorted tables")
    return build


MAX_PLAN_EXPERTS = 1024  # the library's one-block plan keeps per-expert counts in shared memory


def sorted_plan_launch(ids: torch.Tensor, experts: int, tile: int,
                       sources: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The library's expert-sorted plan in one launch, in place of kernels/moe_sorted.py torch_sorted_plan's ~25:
    int64 rows [pairs], each tile's expert [sources] and the filled tile count []. CPU ids: the same plan from the
    library's host code, for tests without a GPU."""
    pairs = ids.numel()
    if not 0 < experts <= MAX_PLAN_EXPERTS or tile <= 0 or sources <= 0 or pairs == 0:
        raise ValueError(f"sorted plan: 1-{MAX_PLAN_EXPERTS} experts, a positive tile and sources and some pairs, got "
                         f"{experts} experts, tile {tile}, {sources} sources, {pairs} pairs")
    rows = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    src_expert = torch.empty(sources, dtype=torch.int64, device=ids.device)
    filled = torch.empty((), dtype=torch.int64, device=ids.device)
    on_host = not ids.is_cuda
    _check(load_library().exl3_sorted_plan(ids.data_ptr(), _ids_bytes(ids), pairs, experts, tile, sources,
                                           rows.data_ptr(), src_expert.data_ptr(), filled.data_ptr(), int(on_host),
                                           None if on_host else _stream(ids)), "sorted plan")
    return rows, src_expert, filled


def sorted_gather(x: torch.Tensor, rows: torch.Tensor, topk: int, out: torch.Tensor) -> torch.Tensor:
    """out[rows[p]] = x[p // topk] for every pair p, in one launch (fp16 or bf16 x and out of one dtype)."""
    pairs = rows.numel()
    if x.dtype not in (torch.float16, torch.bfloat16) or out.dtype != x.dtype or x.dim() != 2 or \
            out.shape[1:] != x.shape[1:] or rows.dtype != torch.int64 or pairs != x.shape[0] * topk or \
            not out.is_contiguous():
        raise ValueError(f"sorted_gather: fp16/bf16 x [tokens, H] and contiguous out [*, H] of its dtype, int64 rows "
                         f"[tokens * {topk}]; got x {x.dtype} {tuple(x.shape)}, out {out.dtype} "
                         f"{tuple(out.shape)}, rows {rows.dtype} {pairs}")
    _check(load_library().exl3_sorted_gather(x.contiguous().data_ptr(), rows.contiguous().data_ptr(), pairs, topk,
                                             x.shape[1], out.data_ptr(), _stream(x)), "sorted gather")
    return out


def act_mul(gate_up: torch.Tensor, sources: int, n: int, gelu: bool = False) -> torch.Tensor:
    """fp16 [sources * rows, n] = act(gate) * up for the fp16 [rows, 2 * sources * n] output of a two-bank group
    (gate sources' columns first), rows regrouped source by source, as a down projection over the same sources
    reads them; silu, or gelu's tanh approximation; fp32 math; one launch (CPU tensors: the same code on the
    host)."""
    rows = gate_up.shape[0]
    if gate_up.dtype != torch.float16 or gate_up.dim() != 2 or gate_up.shape[1] != 2 * sources * n:
        raise ValueError(f"act_mul takes the fp16 [rows, 2 * {sources} * {n}] output of a gate/up group, got "
                         f"{gate_up.dtype} {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    out = torch.empty(sources * rows, n, dtype=torch.float16, device=gate_up.device)
    on_host = not gate_up.is_cuda
    _check(load_library().exl3_act_mul(gate_up.data_ptr(), out.data_ptr(), sources, rows, n, int(gelu), int(on_host),
                                       None if on_host else _stream(gate_up)), "act mul")
    return out


def moe_combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, topk: int, n: int,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [tokens, n]: each token's top-k expert outputs summed with fp32 routing weights [tokens * top-k], in
    top-k order; pairs whose id is below 0 are skipped. Pair p's output row starts at element rows[p] of fp16 y
    (int64; None: p * n). One launch."""
    pairs = ids.numel()
    if y.dtype != torch.float16 or weights.dtype != torch.float32 or weights.numel() != pairs or pairs % topk or \
            (rows is None and y.numel() < pairs * n) or (rows is not None and (rows.dtype != torch.int64 or
                                                                               rows.numel() != pairs)):
        raise ValueError(f"moe_combine: fp16 y, fp32 weights and ids (and int64 row offsets) of tokens * {topk} "
                         f"pairs; got y {y.dtype} {tuple(y.shape)}, weights {weights.dtype} {weights.numel()}, "
                         f"{pairs} ids")
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(pairs // topk, n, dtype=torch.float32, device=y.device)
    on_host = not y.is_cuda
    _check(load_library().exl3_moe_combine(y.data_ptr(), None if rows is None else rows.contiguous().data_ptr(),
                                           weights.data_ptr(), ids.data_ptr(), _ids_bytes(ids), out.data_ptr(),
                                           pairs // topk, topk, n, int(on_host), None if on_host else _stream(y)),
           "moe combine")
    return out


def _check_slab_ids(ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or not ids.is_contiguous() or not ids.is_cuda:
        raise ValueError(f"the rotated slab's ids must be contiguous CUDA int32 / int64 [pairs], got {ids.dtype} "
                         f"{list(ids.shape)} on {ids.device}")


def _check_table(name: str, t: torch.Tensor, width: int) -> None:
    """A per-expert rotation table: fp16 [experts, width]."""
    _check_fp16(name, t, (t.shape[0] if t.dim() == 2 else -1, width))


def slab_rotate_in(x: torch.Tensor, ids: torch.Tensor, topk: int, gate_suh: torch.Tensor,
                   up_suh: torch.Tensor) -> torch.Tensor:
    """fp16 [2 * pairs, K]: row p = had_in(x[p // topk], gate_suh[ids[p]]), row pairs + p the same with up_suh, for
    fp16 or bf16 x [pairs / topk, K] (ids in slab order; below 0: a zero row). One launch."""
    pairs, k = ids.numel(), x.shape[-1]
    _check_act("x", x, (pairs // max(topk, 1), k))
    _check_slab_ids(ids)
    _check_table("gate_suh", gate_suh, k)
    _check_table("up_suh", up_suh, k)
    a = torch.empty(2 * pairs, k, dtype=torch.float16, device=x.device)
    _check(load_library().exl3_slab_rot_in(x.data_ptr(), int(x.dtype == torch.bfloat16), ids.data_ptr(),
                                           _ids_bytes(ids), pairs, topk, gate_suh.data_ptr(), up_suh.data_ptr(),
                                           a.data_ptr(), k, _stream(x)), "slab rotate in")
    return a


def slab_mid(c: torch.Tensor, ids: torch.Tensor, gate_svh: torch.Tensor, up_svh: torch.Tensor,
             down_suh: torch.Tensor, gelu: bool) -> torch.Tensor:
    """fp16 [pairs, N]: pair p's down-projection input had_in(act(had_out(c[p], gate_svh[e])) * had_out(c[pairs + p],
    up_svh[e]), down_suh[e]), e = ids[p], from the gate/up GEMM's fp16 c [2 * pairs, N]. One launch."""
    pairs = ids.numel()
    n = c.shape[-1]
    _check_fp16("c", c, (2 * pairs, n))
    _check_slab_ids(ids)
    for name, t in (("gate_svh", gate_svh), ("up_svh", up_svh), ("down_suh", down_suh)):
        _check_table(name, t, n)
    h = torch.empty(pairs, n, dtype=torch.float16, device=c.device)
    _check(load_library().exl3_slab_mid(c.data_ptr(), ids.data_ptr(), _ids_bytes(ids), pairs, gate_svh.data_ptr(),
                                        up_svh.data_ptr(), down_suh.data_ptr(), h.data_ptr(), n, int(gelu),
                                        _stream(c)), "slab mid")
    return h


def slab_tail(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down_svh: torch.Tensor,
              topk: int) -> torch.Tensor:
    """fp32 [pairs / topk, H]: each token's pairs' had_out(y[p], down_svh[ids[p]]) summed with the fp32 routing
    weights in top-k order (ids below 0 skipped), from the down GEMM's fp16 y [pairs, H]. One launch."""
    pairs, hidden = ids.numel(), y.shape[-1]
    _check_fp16("y", y, (pairs, hidden))
    _check_slab_ids(ids)
    _check_table("down_svh", down_svh, hidden)
    if weights.dtype != torch.float32 or weights.numel() != pairs or not weights.is_contiguous() or topk <= 0 or \
            pairs % topk:
        raise ValueError(f"slab_tail: contiguous fp32 weights of {pairs} pairs in tokens of top-{topk}, got "
                         f"{weights.dtype} {weights.numel()}")
    out = torch.empty(pairs // topk, hidden, dtype=torch.float32, device=y.device)
    _check(load_library().exl3_slab_tail(y.data_ptr(), ids.data_ptr(), _ids_bytes(ids), weights.data_ptr(),
                                         down_svh.data_ptr(), out.data_ptr(), pairs // topk, topk, hidden,
                                         _stream(y)), "slab tail")
    return out


@cache
def _cluster_knob() -> str:
    return knobs.get("WG_CLUSTER")


def cluster_form_for(wg_cluster: int, mode: str) -> bool:
    """Whether wgmma rows of `wg_cluster` splits (0: none that a cluster holds) run in the cluster form under
    SGLANG_EXL3_WG_CLUSTER=`mode`: all of them at 1; at one-split only rows of one split, whose blocks each hold
    whole column sums and so rotate them in the launch with no cluster reduction and no partials."""
    return bool(wg_cluster) and (mode == "1" or (mode == "one-split" and wg_cluster == 1))


@cache
def _pdl_knob() -> bool:
    return bool(knobs.get("PDL"))


def launch_pdl(pdl: bool | None) -> bool:
    """Whether a kernel that can launch as a programmatic dependent does: `pdl` where given, else SGLANG_EXL3_PDL
    (read once per process, as the other knobs of the call path: an environment read costs ~2 µs)."""
    return _pdl_knob() if pdl is None else pdl


def group_run_cluster(x: torch.Tensor, group: Exl3Group) -> torch.Tensor:
    """[m, total_cols] of x's dtype: the group on the wgmma ring from its wgmma rows in two launches, each column
    block's K splits summed inside a thread-block cluster and its output rotated in the same launch (no fp32 partials
    in global memory); bit-identical to group_run over those rows with mode 91. m <= 64, and the group's wgmma rows
    share one split count of at most 8 (Exl3Group.wg_cluster)."""
    m = x.shape[0]
    if not group.wg_cluster or m > FUSED_MAX_M:
        raise ValueError(f"group_run_cluster: needs a group whose wgmma rows share one split count of at most 8 and "
                         f"at most {FUSED_MAX_M} rows, got wg_cluster={group.wg_cluster} and {m} rows")
    _check_act("x", x, (m, group.k_tiles * 16))
    table, items, _ = group.launch_rows(WG_MODES[0])
    xh = torch.empty(group.num, m, group.k_tiles * 16, dtype=torch.float16, device=x.device)
    out = torch.empty(m, group.total_cols, dtype=x.dtype, device=x.device)
    bf16 = int(x.dtype == torch.bfloat16)
    _check(load_library().exl3_group_linear_cluster(x.data_ptr(), bf16, table.data_ptr(), group.num, xh.data_ptr(),
                                                    out.data_ptr(), bf16, m, group.k_tiles, items, group.total_cols,
                                                    group.wg_cluster, group.k2, group.codebook, _stream(x)),
           "group linear (cluster)")
    return out


def group_run(x: torch.Tensor, table: torch.Tensor, num: int, m: int, k_tiles: int, total_items: int,
              total_cols: int, partial_elems: int, k2: int, codebook: int, xs_slice: int = 0,
              ring: int = 0, counters: torch.Tensor | None = None) -> torch.Tensor:
    """[m, total_cols] of x's dtype: the three launches of a group over a table of `num` sources (x fp16 or bf16
    rows as the table's x_row fields address them; bf16 in and out give what casting around an fp16 call gives).
    Sources with n_tiles = 0 are skipped; the items and columns counted for them may be an upper bound. xs_slice > 0:
    x staged in shared memory for K slices up to that many tiles; `ring` (a RING_MODES or WG_MODES mode): x through
    the shared-memory ring instead (any m); with `counters` (Exl3Group.ring_counters_for; RING_MODES only) the ring
    launch rotates its own output: two launches, the same values."""
    _check_act("x", x, (x.shape[0], k_tiles * 16))
    if counters is not None and (ring not in RING_MODES or counters.dtype != torch.int32
                                 or counters.device != x.device):
        raise ValueError(f"group_run: counters need an mma.sync ring mode {RING_MODES} (the wgmma ring does not "
                         f"rotate its own output) and int32 on {x.device}, got ring {ring}, {counters.dtype} on "
                         f"{counters.device}")
    xh = torch.empty(num, m, k_tiles * 16, dtype=torch.float16, device=x.device)
    partial = torch.empty(partial_elems * m, dtype=torch.float32, device=x.device)
    out = torch.empty(m, total_cols, dtype=x.dtype, device=x.device)
    bf16 = int(x.dtype == torch.bfloat16)
    _check(load_library().exl3_group_linear(x.data_ptr(), bf16, table.data_ptr(), num, xh.data_ptr(),
                                            partial.data_ptr(), out.data_ptr(), bf16, m, k_tiles, total_items,
                                            total_cols, k2, codebook, xs_slice, ring,
                                            0 if counters is None else counters.data_ptr(),
                                            0 if counters is None else counters.numel(), _stream(x)), "group linear")
    return out


MAX_FUSED_TOPK = 32  # moe_tail's shared rows: more experts per token run the MoE stages one by one


@dataclass(frozen=True)
class MoeTables:
    """The two group tables of one MoE forward: `gate_up` holds S gate sources then S up sources, `down` S sources,
    each source `rows` rows (per pair: 1; sorted: a tile); items and partials are the tables' static totals."""
    gate_up: torch.Tensor
    down: torch.Tensor
    sources: int
    rows: int
    gate_up_items: int
    gate_up_partial: int
    down_items: int
    down_partial: int
    gate_up_slice: int = 0  # K tiles of one source's split (sizes x in shared memory; 0: global loads)
    down_slice: int = 0

    def xs_slices(self, gate: Exl3ExpertBank, down: Exl3ExpertBank) -> tuple[int, int]:
        """The slices the fused forward's two GEMMs stage in shared memory (0: global loads), by the same policy as
        a group's: use_xs for `rows` rows of the bank's codebook, the slice within XS_GROUP_SMEM_BYTES."""
        def one(slice_tiles: int, bank: Exl3ExpertBank) -> int:
            fits = slice_tiles > 0 and xs_smem(self.rows, slice_tiles) <= XS_GROUP_SMEM_BYTES
            return slice_tiles if fits and use_xs(self.rows, bank.codebook) else 0
        return one(self.gate_up_slice, gate), one(self.down_slice, down)


def moe_fused(x: torch.Tensor, tables: MoeTables, gate: Exl3ExpertBank, down: Exl3ExpertBank,
              weights: torch.Tensor, ids: torch.Tensor, topk: int, gelu: bool,
              pair_rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [tokens, H]: a whole MoE forward over prepared tables in five launches (input rotation, gate/up GEMM,
    output rotations + act * up + the down projection's input rotation, down GEMM, output rotation + weighted top-k
    combine), every fp16 rounding of the unfused stages kept. x fp16 or bf16 (rounded to fp16 as a cast would);
    pair p's down row is pair_rows[p] (int64; None: p)."""
    pairs = ids.numel()
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] != gate.k_tiles * 16 or \
            weights.dtype != torch.float32 or weights.numel() != pairs or pairs % topk or topk > MAX_FUSED_TOPK or \
            (pair_rows is not None and (pair_rows.dtype != torch.int64 or pair_rows.numel() != pairs)):
        raise ValueError(f"moe_fused: fp16/bf16 x [*, {gate.k_tiles * 16}], fp32 weights and ids (and int64 pair "
                         f"rows) of tokens * top-k (<= {MAX_FUSED_TOPK}) pairs; top-k {topk}, got x {x.dtype} "
                         f"{tuple(x.shape)}, weights {weights.dtype} {weights.numel()}, {pairs} ids")
    x, weights = x.contiguous(), weights.contiguous()
    t, dev = tables, x.device
    hidden, inter = gate.k_tiles * 16, gate.n_tiles * 16
    xh_gu = torch.empty(2 * t.sources, t.rows, hidden, dtype=torch.float16, device=dev)
    partial_gu = torch.empty(t.gate_up_partial * t.rows, dtype=torch.float32, device=dev)
    xh_dn = torch.empty(t.sources, t.rows, inter, dtype=torch.float16, device=dev)
    partial_dn = torch.empty(t.down_partial * t.rows, dtype=torch.float32, device=dev)
    out = torch.empty(pairs // topk, down.n_tiles * 16, dtype=torch.float32, device=dev)
    gu_xs, dn_xs = t.xs_slices(gate, down)
    _check(load_library().exl3_moe_fused(
        x.data_ptr(), int(x.dtype == torch.bfloat16), t.gate_up.data_ptr(), t.down.data_ptr(), t.sources, t.rows,
        hidden, inter, t.gate_up_items, t.down_items, gate.k2, gate.codebook, down.k2, down.codebook,
        xh_gu.data_ptr(), partial_gu.data_ptr(), xh_dn.data_ptr(), partial_dn.data_ptr(),
        None if pair_rows is None else pair_rows.contiguous().data_ptr(), weights.data_ptr(), ids.data_ptr(),
        _ids_bytes(ids), pairs // topk, topk, int(gelu), gu_xs, dn_xs, out.data_ptr(), _stream(x)), "fused moe")
    return out


DECODE_WAVE_WARPS = 32  # resident warps per SM that a decode launch's splits aim to fill once
DECODE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernel's out_kind 0, 1, 2


def decode_splits(k_tiles: int, n_tiles: int, sources: int, device: torch.device, least: int = 1) -> int:
    """K splits of one decode-MoE launch: slices of whole 128-blocks (the block rotates its own slice of x), the
    most that keep sources * n_tiles * splits warps within one wave of resident warps, and at least `least` where
    it divides. H200 sweep (benchmarks/results/moe-decode-h200.md, Qwen3-30B-A3B layer): one wave is best at m = 1
    (4 x 3), while from m = 4 the gate/up launch's single split lost 2-8% to two (1.2-1.5 waves)."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    blocks, best = k_tiles // 8, 1
    for s in range(1, blocks + 1):
        if blocks % s == 0 and sources * n_tiles * s <= sms * DECODE_WAVE_WARPS:
            best = s
    return least if best < least and blocks % least == 0 else best


def decode_counters(max_pairs: int, max_tokens: int, hidden: int, inter: int, device) -> torch.Tensor:
    """The decode MoE's arrival counters for up to max_pairs pairs of max_tokens tokens: zero, and left zero by
    every call (each is reset by the block that completes it), so one buffer serves every call of its owner."""
    return torch.zeros(max_pairs * (inter // 128) + max_tokens * (hidden // 128), dtype=torch.int32, device=device)


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Exl3ExpertBank, up: Exl3ExpertBank,
               down: Exl3ExpertBank, topk: int, gelu: bool, counters: torch.Tensor, gu_splits: int | None = None,
               dn_splits: int | None = None, out_dtype: torch.dtype = torch.float32,
               pdl: bool | None = None) -> torch.Tensor:
    """[tokens, H] in out_dtype: the MoE forward for one source per (token, expert) pair in two launches (gate/up
    GEMM + the mid rotations; down GEMM + the tail), the expert of each pair read from `ids` on the device. x fp16
    or bf16 [tokens, H]; ids int32/int64 and fp32 weights [tokens * top-k] (ids below 0: not this rank's, weight
    0). Bit-identical to `moe_fused` at the same splits (fp32 out; fp16/bf16 out is that result rounded)."""
    pairs = ids.numel()
    hidden, inter = gate.k_tiles * 16, gate.n_tiles * 16
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] != hidden or \
            weights.dtype != torch.float32 or weights.numel() != pairs or pairs % topk or topk > MAX_FUSED_TOPK or \
            x.shape[0] != pairs // topk or out_dtype not in DECODE_OUT_DTYPES:
        raise ValueError(f"moe_decode: fp16/bf16 x [tokens, {hidden}], fp32 weights and ids of tokens * top-k "
                         f"(<= {MAX_FUSED_TOPK}) pairs, out fp32/fp16/bf16; got x {x.dtype} {tuple(x.shape)}, "
                         f"weights {weights.dtype} {weights.numel()}, {pairs} ids, top-k {topk}, out {out_dtype}")
    if (up.k_tiles, up.n_tiles, up.k2, up.codebook) != (gate.k_tiles, gate.n_tiles, gate.k2, gate.codebook) or \
            (down.k_tiles, down.n_tiles) != (gate.n_tiles, gate.k_tiles):
        raise ValueError("moe_decode: gate and up share shape, bits and codebook; down maps the intermediate back")
    tokens, dev = pairs // topk, x.device
    need = pairs * (inter // 128) + tokens * (hidden // 128)
    if counters.dtype != torch.int32 or counters.numel() < need or counters.device != dev:
        raise ValueError(f"moe_decode: counters must be int32 with at least {need} elements on {dev} "
                         f"(decode_counters), got {counters.dtype} {counters.numel()} on {counters.device}")
    gu = gu_splits or decode_splits(gate.k_tiles, gate.n_tiles, 2 * pairs, dev, least=2)
    dn = dn_splits or decode_splits(down.k_tiles, down.n_tiles, pairs, dev)
    if (hidden // 128) % gu or (inter // 128) % dn:
        raise ValueError(f"moe_decode: splits must cut K into whole 128-blocks: gu_splits {gu} must divide "
                         f"{hidden // 128} and dn_splits {dn} must divide {inter // 128} (or pass None: "
                         "decode_splits)")
    x, weights = x.contiguous(), weights.contiguous()
    partial_gu = torch.empty(pairs * 2 * gu * inter, dtype=torch.float32, device=dev)
    xh_dn = torch.empty(pairs * inter, dtype=torch.float16, device=dev)
    partial_dn = torch.empty(pairs * dn * hidden, dtype=torch.float32, device=dev)
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=dev)
    if pairs == 0:
        return out.zero_()
    _check(load_library().exl3_moe_decode(
        x.data_ptr(), int(x.dtype == torch.bfloat16), gate.rows.data_ptr(), up.rows.data_ptr(), down.rows.data_ptr(),
        ids.data_ptr(), _ids_bytes(ids), weights.data_ptr(), tokens, topk, hidden, inter, gate.k2, gate.codebook,
        down.k2, down.codebook, gu, dn, partial_gu.data_ptr(), xh_dn.data_ptr(), partial_dn.data_ptr(),
        counters.data_ptr(), counters.numel(), int(gelu), out.data_ptr(), DECODE_OUT_DTYPES.index(out_dtype),
        int(launch_pdl(pdl)),
        _stream(x)), "moe decode")
    return out


def routed_group(x: torch.Tensor, banks: list[Exl3ExpertBank], ids: torch.Tensor, x_row_div: int = 1) -> torch.Tensor:
    """For every pair p: bank_b's expert ids[p] applied to x[p // x_row_div], for each bank b: one table launch for
    all banks, then three launches. x fp16 [R, K]; ids int32/int64 [P] on the device (local experts; below 0: read
    expert 0, for the caller to weigh 0). Returns fp16 [1, sum_b P * N_b]: bank by bank, pair by pair."""
    first = banks[0]
    for b in banks:
        if (b.k_tiles, b.k2, b.codebook) != (first.k_tiles, first.k2, first.codebook):
            raise ValueError("the banks of one routed launch share K, bits and codebook")
    _check_fp16("x", x, (x.shape[0], first.k_tiles * 16))
    pairs = ids.shape[0]
    if pairs == 0:
        return torch.empty(1, 0, dtype=torch.float16, device=x.device)
    table, item, col, base, _ = routed_table(banks, ids.contiguous(), x_row_div, routed_table_builder())
    return group_run(x, table, len(banks) * pairs, 1, first.k_tiles, item, col, base, first.k2, first.codebook)


def routed_linear(x: torch.Tensor, banks: list[Exl3ExpertBank], ids: torch.Tensor,
                  x_row_div: int = 1) -> list[torch.Tensor]:
    """routed_group's output as fp16 [P, N_b] per bank."""
    out, pairs, outs, at = routed_group(x, banks, ids, x_row_div), ids.shape[0], [], 0
    for b in banks:
        n = b.n_tiles * 16
        outs.append(out[0, at:at + pairs * n].view(pairs, n))
        at += pairs * n
    return outs


def group_linear(x: torch.Tensor, group: Exl3Group, ring: int | None = None, ring_rotates_out: bool = False
                 ) -> torch.Tensor:
    """[m, sum N] = the concatenated outputs of every source of the group for fp16 or bf16 x [m, K] (y of x's
    dtype). `ring`: a RING_MODES mode (x through the shared-memory ring, any m), 0 for the x-slice / global-load
    kernels (m <= 64), or None for the group's policy (Exl3Group.ring_mode). The output rotation is its own launch;
    ring_rotates_out=True lets the ring launch rotate its own output where the group's counters cover m, the same
    values (opt-in: it measured 0.61-0.95x as fast at m = 16-128, ring-ab-groups-h100-80gb-hbm3), on the mma.sync
    ring only (the policy's wgmma mode gives way to it)."""
    m = x.shape[0]
    ring = group.ring_mode(m) if ring is None else ring
    if ring in WG_MODES and ring_rotates_out:
        ring = mma_ring_mode(m)
    if m > FUSED_MAX_M and not ring:
        raise ValueError(f"the fused EXL3 kernel takes at most {FUSED_MAX_M} rows without the x ring, got {m}")
    counters = group.ring_counters_for(m) if ring and ring_rotates_out else None
    if group.cluster_serves(m, ring):
        return group_run_cluster(x, group)
    table, items, partial_per_row = group.launch_rows(ring)
    return group_run(x, table, group.num, m, group.k_tiles, items, group.total_cols, partial_per_row, group.k2,
                     group.codebook, 0 if ring else group.xs_slice(m), ring, counters)


@dataclass(frozen=True)
class Exl3OneLaunch:
    """A dense linear or same-input group run as one launch for decode-sized m (`exl3_linear_decode`): its group
    table at splits that cut K into whole 128-blocks (each block rotates its own slice of x), its arrival counters
    (one per 128 output columns; zero between calls) and the most rows it is used for. Built once per layer at load."""

    group: Exl3Group
    counters: torch.Tensor
    max_m: int = ONE_LAUNCH_MAX_ROWS
    two_launch_max_m: int = 0  # above max_m and up to this, x is rotated by its own launch first (rotates_first)

    def serves(self, m: int) -> bool:
        """Whether m rows run in this form (one launch up to max_m, two up to two_launch_max_m; at most
        ONE_LAUNCH_MAX_ROWS), the x slice within XS_GROUP_SMEM_BYTES."""
        most = min(max(self.max_m, self.two_launch_max_m), ONE_LAUNCH_MAX_ROWS)
        return m <= most and xs_smem(m, self.group.max_slice) <= XS_GROUP_SMEM_BYTES

    def rotates_first(self, m: int) -> bool:
        """Whether m rows take the two-launch form (x rotated once, by its own launch): those past max_m."""
        return m > self.max_m


def one_launch_splits(k_tiles: int, n_tiles: list[int], device: torch.device) -> int | None:
    """One split count for every source of a one-launch linear: the most that cut K into whole 128-blocks and keep
    the group's warps within one wave (decode_splits); None where K or an N is not whole 128-blocks."""
    if k_tiles % 8 or any(nt % 8 for nt in n_tiles):
        return None
    return decode_splits(k_tiles, sum(n_tiles), 1, device)


def make_one_launch(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor],
                    codebook: Codebook, max_m: int = ONE_LAUNCH_MAX_ROWS,
                    two_launch_max_m: int = 0) -> Exl3OneLaunch | None:
    """The one-launch form of these same-input sources (one source: a single linear) at one_launch_splits, used for up
    to max_m rows (and as two launches up to two_launch_max_m), or None where it cannot run them (K or an N not whole
    128-blocks)."""
    splits = one_launch_splits(tiles[0].shape[1], [t.shape[0] for t in tiles], tiles[0].device)
    if splits is None:
        return None
    group = make_group(tiles, suh, svh, codebook, splits=[splits] * len(tiles))
    return Exl3OneLaunch(group, torch.zeros(group.total_cols // 128, dtype=torch.int32, device=tiles[0].device), max_m,
                         two_launch_max_m)


def one_launch_warps(m: int) -> int:
    """Warps per block of the one-launch linear for m rows (ONE_LAUNCH_WIDE_FROM_M)."""
    return 8 if m >= ONE_LAUNCH_WIDE_FROM_M else 4


def one_launch_linear(x: torch.Tensor, group: Exl3Group, counters: torch.Tensor, warps: int | None = None,
                      pdl: bool | None = None, rotate_first: bool = False) -> torch.Tensor:
    """[m, total_cols] of x's dtype for fp16 or bf16 x [m, K]: group_linear's result in one launch (bit-identical at
    the same splits, for either block width). The group's splits must cut K into whole 128-blocks (make_one_launch's
    table). warps: 4 or 8 per block (default one_launch_warps(m)); pdl: launched as a programmatic dependent of the
    kernel before it (its first weight loads overlap that kernel's end; default SGLANG_EXL3_PDL); rotate_first: the
    two-launch form, x rotated once per source by its own launch, which the GEMM's blocks then copy (the same output
    bits)."""
    m = x.shape[0]
    warps = warps or one_launch_warps(m)
    if warps not in (4, 8):
        raise ValueError(f"one_launch_linear: warps must be 4 or 8, got {warps}")
    _check_act("x", x, (m, group.k_tiles * 16))
    if m > ONE_LAUNCH_MAX_ROWS:
        raise ValueError(f"the one-launch EXL3 linear takes at most {ONE_LAUNCH_MAX_ROWS} rows, got {m}")
    if counters.dtype != torch.int32 or counters.numel() < group.total_cols // 128 or counters.device != x.device:
        raise ValueError(f"one_launch_linear: counters must be int32 with at least {group.total_cols // 128} elements "
                         f"on {x.device}, got {counters.dtype} {counters.numel()} on {counters.device}")
    partial = torch.empty(group.partial_per_row * m, dtype=torch.float32, device=x.device)
    out = torch.empty(m, group.total_cols, dtype=x.dtype, device=x.device)
    bf16 = int(x.dtype == torch.bfloat16)
    xh_all = torch.empty(group.num, m, group.k_tiles * 16, dtype=torch.float16, device=x.device) if rotate_first \
        else None
    _check(load_library().exl3_linear_decode(x.data_ptr(), bf16, None if xh_all is None else xh_all.data_ptr(),
                                             group.table.data_ptr(), group.num,
                                             partial.data_ptr(), counters.data_ptr(), counters.numel(),
                                             out.data_ptr(), m, group.k_tiles, group.total_items, group.total_cols,
                                             group.k2, group.codebook, group.max_slice, warps, int(launch_pdl(pdl)),
                                             _stream(x)),
           "one-launch linear")
    return out
