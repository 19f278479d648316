"""The one-launch linear with and without programmatic dependent launch against the three launches it replaces.

`groups.one_launch_linear` runs a linear (or a same-input group) as one kernel: each block rotates its K slice of x,
runs the decode GEMM on it, and the last block per 128 columns rotates the output; PDL lets its first weight loads
overlap the kernel before it. Rows: the product's three-launch path (`exl3_linear`, fused decode GEMM between the two
rotation launches) and the variants, beside bf16 `x @ W.T` (cuBLAS) on the same shape (`bf16_vs_fastest`: its time
over the fastest EXL3 form's, above 1 where EXL3 wins). Whole linear, CUDA-graph replay over weight copies larger
than L2; each variant is checked against the three launches.

  python experiments/one_launch_ab.py [--shapes 4096x4096,4096x14336] [--ms 1,2,4,8,16] [--codebooks mul1,mcg]
      [--variants one,one_nopdl]
  python experiments/one_launch_ab.py --shapes 1536x2560,1536x1536,1536x8192,4096x1536 --ms 1,4,8
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
from experiments.xs_ab import _weights  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense, groups  # noqa: E402

SHAPES = "4096x4096,4096x6144,4096x14336,14336x4096,4096x28672,4096x151936"
VARIANTS = {"one": True, "one_nopdl": False}  # launched as a programmatic dependent, or plain


def bench_shape(k: int, n: int, bits: int, ms: list[int], cbs: list[Codebook], variants: list[str]) -> list[dict]:
    copies, tiles, suh, svh, gen = _weights(k, n, bits)
    bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]  # 4x the trellis bytes
    rows = []
    for cb in cbs:
        ones = [groups.make_one_launch([t], [suh], [svh], cb) for t in tiles]
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            if not ones[0].serves(m):
                continue
            def three(i: int, x=x, cb=cb) -> torch.Tensor:
                return dense.exl3_linear(x, tiles[i % copies], suh, svh, cb, path="fused")

            want = three(0).float()
            row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label,
                   "splits": ones[0].group.k_tiles // ones[0].group.max_slice, "three_us": graph_us(three, copies)}
            for name in variants:
                pdl = VARIANTS[name]

                def one(i: int, x=x, ones=ones, pdl=pdl) -> torch.Tensor:
                    o = ones[i % copies]
                    return groups.one_launch_linear(x, o.group, o.counters, pdl=pdl)

                rel = float((one(0).float() - want).norm() / want.norm())
                if not rel < 1e-3:
                    raise AssertionError(f"{k}x{n} m={m} {cb.label} {name}: differs from three launches, rel {rel:.2e}")
                row[f"{name}_us"] = graph_us(one, copies)
            best = min(variants, key=lambda v: row[f"{v}_us"])
            row["best"], row["best_vs_three"] = best, round(row["three_us"] / row[f"{best}_us"], 3)
            row["bf16_us"] = graph_us(lambda i, x=x: x @ bf16[i % copies].T, copies)
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
