"""Instruction mix of the fused GEMM's inner loop, read from the compiled kernel (no GPU needed).

At m = 1 the decode GEMM is bound by instruction issue and the ALU pipe (benchmarks/results/ncu-gemm-h200.txt: ALU
pipe 70% of peak, DRAM 28%), so SASS instructions per 16x16 tile are the figure a kernel change must lower. This
compiles the m <= 64 GEMM family's instantiation unit (`csrc/gemm/gemm_instances.cu`) for sm_90 with nvcc once per
(bits, codebook) variant (or reads --cubin), disassembles it with cuobjdump, finds each
`gemm_kernel<K2, CB, MT, DEPTH>` instantiation's main loop (its longest backward branch: two groups of DEPTH tiles)
and counts its instructions by opcode, per tile.

  python experiments/sass_loop.py [--cubin FILE] [--out NAME]

cuobjdump is not in the nvcc-only toolkit of the CPU machine: `pip install nvidia-cuda-cuobjdump` ships it
(nvidia/cu13/bin/cuobjdump inside the package; put that folder on PATH). Writes benchmarks/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "sglang_exl3/kernels/csrc/gemm/gemm_instances.cu"
CODEBOOKS = {0: "3inst", 1: "mcg", 2: "mul1"}
ALU_OPS = ("PRMT", "LOP3", "SHF", "IADD3", "ISETP", "SEL", "LEA", "MOV", "IABS", "FLO", "POPC", "BMSK")
FMA_OPS = ("IMAD", "HADD2", "HFMA2", "HMUL2", "FFMA", "FADD", "FMUL", "IDP")
KERNEL = re.compile(r"gemm_kernelILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E")
ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")


def build_cubins(folder: Path) -> list[Path]:
    """The gemm family's unit for every (bits, codebook) variant the library builds, one cubin each."""
    from sglang_exl3.kernels.build import VARIANTS

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("sass_loop: nvcc not found (the kernel is compiled for sm_90 first)")
    out = []
    for k2, cb in VARIANTS:
        cubin = folder / f"gemm-k2{k2}-cb{cb}.cubin"
        subprocess.run([nvcc, "-arch=sm_90", "-O3", "-std=c++17", f"-DEXL3_K2={k2}", f"-DEXL3_CB={cb}", "-cubin",
                        "-o", str(cubin), str(SOURCE)], check=True)
        out.append(cubin)
    return out


def disassemble(cubin: Path) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("sass_loop: cuobjdump not found; `pip install nvidia-cuda-cuobjdump` and put its "
                         "nvidia/cu13/bin on PATH")
    return subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def main_loop(lines: list[str]) -> list[str]:
    """The instructions between the longest backward branch and its target."""
    best = None
    for line in lines:
        m = re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA\s+(0x[0-9a-f]+)", line)
        if m:
            here, target = int(m.group(1), 16), int(m.group(2), 16)
            if target < here and (best is None or here - target > best[1] - best[0]):
                best = (target, here)
    if best is None:
        return []
    return [ln for ln in lines if best[0] <= int(ADDRESS.search(ln).group(1), 16) <= best[1]]


def opcode_counts(body: list[str]) -> collections.Counter:
    counts = collections.Counter()
    for line in body:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            counts[m.group(1)] += 1
    return counts


def rows_from_sass(sass: str) -> list[dict]:
    rows = []
    for func in re.split(r"\n\s*Function : ", sass):
        m = KERNEL.search(func.split("\n", 1)[0])
        if not m:
            continue
        k2, cb, mt, depth = (int(g) for g in m.groups())
        lines = [ln for ln in func.split("\n") if ADDRESS.search(ln)]
        counts = opcode_counts(main_loop(lines))
        tiles = 2 * depth  # the loop body runs two groups of DEPTH tiles (ping-pong buffers)
        if not counts:
            continue
        per_tile = {op: n / tiles for op, n in counts.items()}
        rows.append({"bits": k2 / 2, "codebook": CODEBOOKS.get(cb, str(cb)), "mt": mt, "depth": depth,
                     "instr_per_tile": sum(per_tile.values()),
                     "alu_per_tile": sum(per_tile.get(op, 0) for op in ALU_OPS),
                     "fma_per_tile": sum(per_tile.get(op, 0) for op in FMA_OPS),
                     "ldg_per_tile": per_tile.get("LDG", 0), "hmma_per_tile": per_tile.get("HMMA", 0),
                     "top": dict(sorted(per_tile.items(), key=lambda kv: -kv[1])[:8])})
    return sorted(rows, key=lambda r: (r["mt"], r["bits"], r["codebook"]))


def write(rows: list[dict], name: str, command: str) -> None:
    import json

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"command": command, "source": str(SOURCE.name),
                                                      "rows": rows}, indent=1))
    cols = ["bits", "codebook", "mt", "instr_per_tile", "alu_per_tile", "fma_per_tile", "ldg_per_tile",
            "hmma_per_tile"]
    out = ["# fused GEMM inner loop, SASS per 16x16 tile (sm_90)\n", f"`{command}`\n",
           "| " + " | ".join(cols) + " | top opcodes |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        top = ", ".join(f"{op} {n:.1f}" for op, n in r["top"].items())
        out.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
                   + f" | {top} |")
    (RESULTS / f"{name}.md").write_text("\n".join(out) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cubin", type=Path, help="a cubin of the gemm unit (default: build one per variant)")
    ap.add_argument("--out", default="sass-loop-sm90")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubins = [args.cubin] if args.cubin else build_cubins(Path(tmp))
        rows = rows_from_sass("\n".join(disassemble(c) for c in cubins))
    if not rows:
        raise SystemExit("sass_loop: no gemm_kernel instantiation found in the cubin")
    write(rows, args.out, " ".join(["python", *sys.argv]))
    for r in rows:
        if r["mt"] == 1:
            print(f"{r['bits']:>4} bits {r['codebook']:>5} MT=1: {r['instr_per_tile']:.1f} instr/tile "
                  f"(ALU {r['alu_per_tile']:.1f}, FMA {r['fma_per_tile']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
