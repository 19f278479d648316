"""x from shared memory vs x from global loads in the small-m EXL3 GEMM, side by side.

The decode GEMM's B fragments (the rotated activations) come either from per-lane global loads (L1/L2 hits,
prefetched a group ahead in registers) or from the block's K-slice of x staged once in shared memory and read with
one ldmatrix per tile (`cuda_trellis.gemm_rotated_partial(xs=True)`; the partials are the same bit for bit at equal
splits). Whole linear (both rotations), CUDA-graph replay over weight copies larger than L2.

  python experiments/xs_ab.py [--shapes 4096x14336,...] [--ms 1,2,4,8,16] [--bits 2,4] [--budgets 24,48]
  python experiments/xs_ab.py --splits 2,3,4,5 --codebooks mul1 --ms 1 ...   (split sweep: xs-splits table)

Writes benchmarks/results/xs-ab-<gpu>.{json,md} (xs-splits-<gpu> with --splits).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense, dispatch, library  # noqa: E402

ROTATE_BYTES = 150 << 20


def _weights(k: int, n: int, bits: int):
    """Random trellis copies (more than L2 between them) and rotations, and the generator for the inputs."""
    copies = max(2, min(48, math.ceil(ROTATE_BYTES / (k * n * bits // 8))))
    gen = torch.Generator().manual_seed(k + n + bits)
    tiles = [dense.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen,
                                      dtype=torch.int16).cuda()) for _ in range(copies)]
    suh = (torch.randn(k, generator=gen) * 0.1).half().cuda()
    svh = (torch.randn(n, generator=gen) * 0.1).half().cuda()
    return copies, tiles, suh, svh, gen


def bench_shape(k: int, n: int, bits: int, ms: list[int], cbs: list[Codebook], budgets: list[int]) -> list[dict]:
    copies, tiles, suh, svh, gen = _weights(k, n, bits)
    kt, nt = k // 16, n // 16
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).half().cuda()
        base_splits = dispatch.default_splits(kt, nt, x.device)
        for cb in cbs:
            def linear(i: int, xs: bool, splits: int, x=x, cb=cb) -> torch.Tensor:
                xh = dense.had_in(x, suh)
                return dense.had_out(dense.gemm_rotated_partial(xh, tiles[i % copies], cb, splits=splits, xs=xs), svh)

            want = linear(0, False, base_splits).float()
            row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label, "splits": base_splits,
                   "global_us": graph_us(lambda i, s=base_splits, f=linear: f(i, False, s), copies)}
            for budget in budgets:
                splits = min(kt, max(base_splits, dispatch.xs_min_splits(m, kt, budget << 10)))
                got = linear(0, True, splits).float()
                rel = float((got - want).norm() / want.norm())
                if not rel < 1e-3:
                    raise AssertionError(f"{k}x{n} m={m} {cb.label}: x in shared memory differs, rel {rel:.2e}")
                row[f"xs{budget}k_splits"] = splits
                row[f"xs{budget}k_us"] = graph_us(lambda i, s=splits, f=linear: f(i, True, s), copies)
                row[f"xs{budget}k_speedup"] = round(row["global_us"] / row[f"xs{budget}k_us"], 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def sweep_splits(k: int, n: int, bits: int, ms: list[int], cbs: list[Codebook], splits: list[int]) -> list[dict]:
    """Long-form rows: the whole linear at each explicit split count, global loads and x in shared memory."""
    copies, tiles, suh, svh, gen = _weights(k, n, bits)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).half().cuda()
        for cb in cbs:
            row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label,
                   "default_splits": dispatch.default_splits(k // 16, n // 16, x.device)}
            for sp in splits:
                for xs in (False, True):
                    def linear(i: int, sp=sp, xs=xs, x=x, cb=cb) -> torch.Tensor:
                        xh = dense.had_in(x, suh)
                        part = dense.gemm_rotated_partial(xh, tiles[i % copies], cb, splits=sp, xs=xs)
                        return dense.had_out(part, svh)

                    row[f"{'xs' if xs else 'global'}_s{sp}_us"] = graph_us(linear, copies)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096,5120x27648,4096x1024")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--budgets", default="24,48", help="shared-memory budgets per block for the x slice, KB")
    ap.add_argument("--splits", default=None, help="explicit split counts: sweep them instead (xs-splits table)")
    ap.add_argument("--codebooks", default=None, help="with --splits: comma-separated codebook labels")
    args = ap.parse_args()
    library.load_library(build=True)
    ms = [int(v) for v in args.ms.split(",")]
    budgets = [int(v) for v in args.budgets.split(",")]
    rows = []
    if args.splits:
        splits = [int(v) for v in args.splits.split(",")]
        cbs = [Codebook.from_label(c) for c in (args.codebooks or "mcg,mul1").split(",")]
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            for bits in (int(b) for b in args.bits.split(",")):
                rows += sweep_splits(k, n, bits, ms, cbs, splits)
                torch.cuda.empty_cache()
        cols = ["k", "n", "m", "bits", "codebook", "default_splits"]
        cols += [f"{kind}_s{sp}_us" for sp in splits for kind in ("global", "xs")]
        write_results("xs-splits", header(sys.argv), rows, cols)
        return 0
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for bits in (int(b) for b in args.bits.split(",")):
            cbs = [Codebook.MCG, Codebook.MUL1] if bits == 4 else [Codebook.MCG]
            rows += bench_shape(k, n, bits, ms, cbs, budgets)
            torch.cuda.empty_cache()
    cols = ["k", "n", "m", "bits", "codebook", "splits", "global_us"]
    for b in budgets:
        cols += [f"xs{b}k_splits", f"xs{b}k_us", f"xs{b}k_speedup"]
    write_results("xs-ab", header(sys.argv), rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
