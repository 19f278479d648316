"""Compiling the kernel library: one nvcc unit per plain source file and per (family, bits, codebook) variant of the
templated families, in parallel, each object cached by the hash of what it is compiled from, then one link.

A unit's hash covers its source, every local header it includes (followed transitively), its defines and the nvcc
command, so an edit to one family's kernels recompiles that family's units alone. `csrc/common/dispatch.cuh` lists
the same variants for the C side's switch (tests/test_kernel_build.py checks that the lists agree).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sglang_exl3.kernels import abi

CSRC = Path(__file__).parent / "csrc"

# (K2 = 2 * bits, codebook) of the decode families: whole bits 1-8 in 3INST (0), MCG (1) and MUL1 (2), the half bits
# 1.5, 2.5 and 3.5 in MUL1
VARIANTS: tuple[tuple[int, int], ...] = tuple((k2, cb) for k2 in range(2, 17, 2) for cb in range(3)) + \
    ((3, 2), (5, 2), (7, 2))
# (K, codebook) of the fast trellis search
ENCODE_VARIANTS: tuple[tuple[int, int], ...] = tuple((k, cb) for k in range(2, 9) for cb in range(3))
# the kernel development build (EXL3_DEV_4BIT_MCG): 4-bit MCG only
DEV_VARIANTS, DEV_ENCODE_VARIANTS = ((8, 1),), ((4, 1),)

PLAIN_UNITS: tuple[str, ...] = (
    "abi.cu", "common/launch.cu", "reconstruct/reconstruct.cu", "hadamard/hadamard.cu", "linear/linear.cu",
    "wgmma/wgmma.cu", "moe/moe.cu", "moe/tables.cu", "moe/glue.cu", "moe/slab.cu", "encode/encode.cu",
)
# families templated on (K2, codebook): their instantiation unit
DECODE_FAMILIES: tuple[str, ...] = (
    "reconstruct/reconstruct_instances.cu", "gemm/gemm_instances.cu", "ring/ring_instances.cu",
    "wgmma/wgmma_instances.cu", "one_launch/one_launch_instances.cu", "moe/moe_decode_instances.cu",
)
ENCODE_FAMILY = "encode/encode_instances.cu"

CODEBOOK_NAMES = {0: "3inst", 1: "mcg", 2: "mul1"}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


class BuildFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Unit:
    source: str  # relative to CSRC
    defines: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """gemm-4bit-mcg, encode-k4-mul1, moe-tables, abi: what the unit builds, for logs and object names."""
        family = self.source.removesuffix(".cu").removesuffix("_instances").split("/")
        stem = "-".join(dict.fromkeys(family))  # reconstruct/reconstruct -> reconstruct
        values = dict(d.split("=", 1) for d in self.defines if "=" in d)
        cb = CODEBOOK_NAMES.get(int(values.get("EXL3_CB", -1)), "")
        if "EXL3_K2" in values:
            k2 = int(values["EXL3_K2"])
            return f"{stem}-{k2 // 2}{'.5' if k2 % 2 else ''}bit-{cb}"
        if "EXL3_K" in values:
            return f"{stem}-k{values['EXL3_K']}-{cb}"
        return stem


def units(dev: bool = False) -> list[Unit]:
    """Every unit of a full build (dev: the 4-bit-MCG development build)."""
    variants, encode = (DEV_VARIANTS, DEV_ENCODE_VARIANTS) if dev else (VARIANTS, ENCODE_VARIANTS)
    out = [Unit(s, (f'EXL3_ABI_DIGEST="{abi.digest()}"',) if s == "abi.cu" else ()) for s in PLAIN_UNITS]
    out += [Unit(f, (f"EXL3_K2={k2}", f"EXL3_CB={cb}")) for f in DECODE_FAMILIES for k2, cb in variants]
    out += [Unit(ENCODE_FAMILY, (f"EXL3_K={k}", f"EXL3_CB={cb}")) for k, cb in encode]
    return out


def includes(source: Path) -> list[Path]:
    """The local headers a source includes, transitively, in a stable order."""
    seen: dict[Path, None] = {}
    todo = [source]
    while todo:
        path = todo.pop()
        for name in _INCLUDE.findall(path.read_text()):
            dep = (path.parent / name).resolve()
            if dep not in seen and dep.exists():
                seen[dep] = None
                todo.append(dep)
    return sorted(seen)


def sources_digest() -> str:
    """The hash of every kernel source file and the ABI table: the cached library's name."""
    h = hashlib.sha256(abi.digest().encode())
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h"):
            h.update(str(path.relative_to(CSRC)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return str(Path(cand) / "bin" / "nvcc")
    return shutil.which("nvcc")


def arch_flags(tag: str) -> list[str]:
    """Hopper builds for sm_90a, whose wgmma the x ring's warpgroup form needs; its code runs on sm_90 GPUs only, which
    is what a per-arch build is for (sm_90a PTX could not be compiled for a later GPU either, so none is embedded)."""
    if tag == "90":
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-gencode=arch=compute_{tag},code=sm_{tag}", f"-gencode=arch=compute_{tag},code=compute_{tag}"]


@cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def compile_command(nvcc: str, unit: Unit, tag: str, out: Path, dev: bool, verbose: bool = False) -> list[str]:
    defines = [*unit.defines, *(["EXL3_DEV_4BIT_MCG"] if dev else [])]
    # every unit's fatbinary compressed: without it nvcc leaves small units' code uncompressed (the library was 7.5x
    # the size); the kernels' code is the same either way
    return [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "-Xfatbin=-compress-all", *arch_flags(tag),
            *(["-Xptxas=-v"] if verbose else []), *(f"-D{d}" for d in defines), "-c", str(CSRC / unit.source),
            "-o", str(out)]


def unit_hash(nvcc: str, unit: Unit, tag: str, dev: bool) -> str:
    source = CSRC / unit.source
    h = hashlib.sha256(_nvcc_version(nvcc).encode())
    h.update(" ".join(compile_command("nvcc", unit, tag, Path("o"), dev)[1:]).encode())
    for path in (source, *includes(source)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class BuildReport:
    compiled: list[str]
    cached: list[str]
    seconds: float


def build(out: Path, tag: str, objects_dir: Path, dev: bool = False, jobs: int | None = None,
          verbose: bool = False, log: Callable[[str], None] | None = None) -> BuildReport:
    """Compile every unit missing from `objects_dir` (in parallel, `jobs` at a time; default: the CPU count) and link
    them into `out` (written to a temporary name, then moved: concurrent builders never load a half-written file)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildFailed("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    start = time.monotonic()
    objects_dir.mkdir(parents=True, exist_ok=True)
    todo, objects, cached = [], [], []
    for unit in units(dev):
        obj = objects_dir / f"{unit.name}-{unit_hash(nvcc, unit, tag, dev)}.o"
        objects.append(obj)
        if obj.exists() and not verbose:
            cached.append(unit.name)
        else:
            todo.append((unit, obj))

    def compile_one(item: tuple[Unit, Path]) -> str:
        unit, obj = item
        tmp = obj.with_suffix(f".{os.getpid()}.{id(item)}.tmp")
        proc = subprocess.run(compile_command(nvcc, unit, tag, tmp, dev, verbose), capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildFailed(f"nvcc failed on {unit.name} ({unit.source}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, obj)
        if log:
            log(f"compiled {unit.name}" + (f"\n{proc.stderr}" if verbose else ""))
        return unit.name

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        compiled = list(pool.map(compile_one, todo))  # the first failure is raised here
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    link = [nvcc, "-shared", *arch_flags(tag), "-Xlinker", "--no-undefined", "-o", str(tmp), *map(str, objects)]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildFailed(f"linking the EXL3 kernel library failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
    return BuildReport(compiled=compiled, cached=cached, seconds=time.monotonic() - start)
