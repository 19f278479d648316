"""The one-launch linear's block width, PDL and two-launch form against the three launches it replaces, side by side.

`cuda_trellis.one_launch_linear` runs a linear (or a same-input group) as one kernel: each block rotates its K slice
of x, runs the decode GEMM on it, and the last block per 128 columns rotates the output. Every block repeats the
rotation of its slice, so the block width (4 or 8 warps: half or a whole 128-column block) sets how often; PDL lets
its first weight loads overlap the kernel before it; the two-launch form (`rotate_first`) rotates x once in its own
launch and the blocks copy it. Rows: the product's three-launch path (`exl3_linear`, fused decode GEMM between the
two rotation launches) and the variants, beside bf16 `x @ W.T` (cuBLAS) on the same shape (`bf16_vs_fastest`: its
time over the fastest EXL3 form's, above 1 where EXL3 wins). Whole linear, CUDA-graph replay over weight copies larger
than L2; each variant is checked against the three launches.

  python benchmarks/one_launch_ab.py [--shapes 4096x4096,4096x14336] [--ms 1,2,4,8,16] [--codebooks mul1,mcg]
      [--variants one8,two8]
  python benchmarks/one_launch_ab.py --shapes 1536x2560,1536x1536,1536x8192,4096x1536 --ms 1,4,8
      (the speculative benchmark's target: where decode is bound by launches)

Writes benchmarks/results/one-launch-ab-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from benchmarks.xs_ab import _weights  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import cuda_trellis as ck  # noqa: E402

SHAPES = "4096x4096,4096x6144,4096x14336,14336x4096,4096x28672,4096x151936"
VARIANTS = {"one4": (4, True, False), "one8": (8, True, False), "one4_nopdl": (4, False, False),
            "one8_nopdl": (8, False, False), "two4": (4, True, True), "two8": (8, True, True)}  # warps, pdl, x first


def bench_shape(k: int, n: int, bits: int, ms: list[int], cbs: list[Codebook], variants: list[str]) -> list[dict]:
    copies, tiles, suh, svh, gen = _weights(k, n, bits)
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]  # 4x the trellis bytes
    rows = []
    for cb in cbs:
        ones = [ck.make_one_launch([t], [suh], [svh], cb) for t in tiles]
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            if not ones[0].serves(m):
                continue
            def three(i: int, x=x, cb=cb) -> torch.Tensor:
                return ck.exl3_linear(x, tiles[i % copies], suh, svh, cb, path="fused")

            want = three(0).float()
            row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label,
                   "splits": ones[0].group.k_tiles // ones[0].group.max_slice, "three_us": graph_us(three, copies)}
            for name in variants:
                warps, pdl, first = VARIANTS[name]

                def one(i: int, x=x, ones=ones, warps=warps, pdl=pdl, first=first) -> torch.Tensor:
                    o = ones[i % copies]
                    return ck.one_launch_linear(x, o.group, o.counters, warps=warps, pdl=pdl, rotate_first=first)

                rel = float((one(0).float() - want).norm() / want.norm())
                if not rel < 1e-3:
                    raise AssertionError(f"{k}x{n} m={m} {cb.label} {name}: differs from three launches, rel {rel:.2e}")
                row[f"{name}_us"] = graph_us(one, copies)
            best = min(variants, key=lambda v: row[f"{v}_us"])
            row["best"], row["best_vs_three"] = best, round(row["three_us"] / row[f"{best}_us"], 3)
            row["bf16_us"] = graph_us(lambda i, x=x: x @ dense[i % copies].T, copies)
            row["bf16_vs_fastest"] = round(row["bf16_us"] / min(row["three_us"], row[f"{best}_us"]), 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebooks", default="mul1,mcg")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    cbs = [Codebook.from_label(c) for c in args.codebooks.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        rows += bench_shape(k, n, args.bits, ms, cbs, variants)
    columns = ["k", "n", "m", "bits", "codebook", "splits", "three_us", *[f"{v}_us" for v in variants], "best",
               "best_vs_three", "bf16_us", "bf16_vs_fastest"]
    path = write_results("one-launch-ab", header(sys.argv), rows, columns)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
