"""The x-ring decode GEMM against today's dispatch and bf16 cuBLAS, side by side, m = 1..128.

Today's fused GEMM stages a block's whole K slice of x in shared memory before its first mma, so its split count
grows with m (the slice must fit the budget) and with it the fp32 partials. The ring kernel
(`dense.gemm_rotated_partial(ring=mode)`, a `dispatch.RingMode`: one or two trellis groups of four k-tiles per x
chunk) streams x through a shared-memory ring, so any split count works at any m; above 64 rows it runs 64-row
blocks, each decoding the weights again. Whole linear (both rotations) unless the column says `gemm`; CUDA-graph
replay over weight copies larger than L2. The ring's partials are checked against the global-load kernel's, bit
for bit, per 64-row block. Groups: the layer's policy against the group's launches pinned to each mma.sync ring
mode.

  python experiments/ring_ab.py [--shapes 4096x14336,...] [--ms 1,8,...] [--bits 4] [--codebooks mcg] [--groups ..]

Writes benchmarks/results/ring-ab-<gpu>.{json,md} and ring-ab-groups-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from benchmarks.kernels import bf16_time  # noqa: E402
from experiments.xs_ab import _weights  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense, dispatch, groups, library  # noqa: E402


def split_candidates(kt: int, nt: int, device: torch.device) -> list[int]:
    base = dispatch.default_splits(kt, nt, device)
    return sorted({max(1, (base + 1) // 2), base, min(kt // 8, 2 * base)})


def check_ring(xh: torch.Tensor, tiles: torch.Tensor, cb: Codebook, splits: int, mode: int) -> None:
    """Ring partials equal the global-load kernel's at the same splits, per 64-row block."""
    got = dense.gemm_rotated_partial(xh, tiles, cb, splits=splits, ring=mode)
    for r0 in range(0, xh.shape[0], 64):
        want = dense.gemm_rotated_partial(xh[r0:r0 + 64].contiguous(), tiles, cb, splits=splits, xs=False)
        if not torch.equal(got[:, r0:r0 + 64], want):
            diff = float((got[:, r0:r0 + 64] - want).abs().max())
            raise AssertionError(f"ring (mode {mode}, {splits} splits) differs from global loads: {diff:.3e}")


def bench_shape(k: int, n: int, bits: int, ms: list[int], cbs: list[Codebook]) -> list[dict]:
    copies, tiles, suh, svh, gen = _weights(k, n, bits)
    kt, nt = k // 16, n // 16
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).half().cuda()
        xs4 = [x] * 4
        bf16 = bf16_time(k, n, m, xs4)
        for cb in cbs:
            row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label, "bf16_us": bf16,
                   "policy_us": graph_us(lambda i, x=x, cb=cb: dense.exl3_linear(x, tiles[i % copies], suh, svh, cb),
                                         copies)}
            xh = dense.had_in(x, suh)
            best = None
            for mode in dispatch.MMA_RING_MODES:
                if nt % (mode // 10):
                    continue
                for sp in split_candidates(kt, nt, x.device):
                    check_ring(xh, tiles[0], cb, sp, mode)

                    def linear(i: int, sp=sp, mode=mode, x=x, cb=cb) -> torch.Tensor:
                        xh = dense.had_in(x, suh)
                        part = dense.gemm_rotated_partial(xh, tiles[i % copies], cb, splits=sp, ring=mode)
                        return dense.had_out(part, svh)

                    us = graph_us(linear, copies)
                    row[f"ring{mode}_s{sp}_us"] = us
                    if best is None or us < best[0]:
                        best = (us, mode, sp)
            if best:
                row["ring_best_us"], row["ring_best"] = best[0], f"{best[1]}/s{best[2]}"
                row["ring_gemm_us"] = graph_us(
                    lambda i, mode=best[1], sp=best[2], cb=cb, xh=xh:
                    dense.gemm_rotated_partial(xh, tiles[i % copies], cb, splits=sp, ring=mode), copies)
                row["ring_vs_policy"] = round(row["policy_us"] / best[0], 3)
                if bf16:
                    row["ring_vs_bf16"] = round(bf16 / best[0], 3)
            rows.append(row)
            print(row, flush=True)
    return rows


GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336))}  # Llama-3-8B


def group_sets(name: str, bits: int, cb: Codebook) -> tuple[int, tuple[int, ...], int, list, torch.Generator]:
    """K, widths, copies (more than L2 between them), the copies' (tiles, suh, svh, group) and the input generator."""
    k, widths = GROUPS[name]
    copies = max(2, min(48, -(-(150 << 20) // (k * sum(widths) * bits // 8))))
    gen = torch.Generator().manual_seed(bits)
    sets = []
    for _ in range(copies):
        tiles = [dense.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen,
                                          dtype=torch.int16).cuda()) for n in widths]
        suh = [(torch.randn(k, generator=gen) * 0.05).half().cuda() for _ in widths]
        svh = [(torch.randn(n, generator=gen) * 0.05).half().cuda() for n in widths]
        sets.append((tiles, suh, svh, groups.make_group(tiles, suh, svh, cb)))
    return k, widths, copies, sets, gen


def bench_group(name: str, bits: int, ms: list[int], cb: Codebook) -> list[dict]:
    """A same-input group as a layer runs it today (exl3::gemm_group's choice) against its ring launch."""
    k, widths, copies, sets, gen = group_sets(name, bits, cb)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).half().cuda()

        def policy(i: int, x=x) -> torch.Tensor:
            tiles, suh, svh, group = sets[i % copies]
            if group.runs_fused(x.shape[0]):
                return groups.group_linear(x, group)
            return torch.cat([dense.exl3_linear(x, t, s, v, cb) for t, s, v in zip(tiles, suh, svh, strict=True)], 1)

        row = {"group": name, "k": k, "n": "+".join(map(str, widths)), "m": m, "bits": bits, "codebook": cb.label,
               "policy_us": graph_us(policy, copies)}
        want = policy(0).float()
        for mode in dispatch.MMA_RING_MODES:
            got = groups.group_linear(x, sets[0][3], ring=mode).float()
            rel = float((got - want).norm() / want.norm())
            if not rel < 2e-3:
                raise AssertionError(f"group {name} m={m}: ring (mode {mode}) differs, rel {rel:.2e}")
            row[f"ring{int(mode)}_us"] = graph_us(lambda i, x=x, mode=mode: groups.group_linear(
                x, sets[i % copies][3], ring=mode), copies)
        fastest_ring = min(row[f"ring{int(mode)}_us"] for mode in dispatch.MMA_RING_MODES)
        row["ring_vs_policy"] = round(row["policy_us"] / fastest_ring, 3)
        rows.append(row)
        print(row, flush=True)
    return rows


def ab_args(shapes: str, ms: str) -> tuple[argparse.Namespace, list[int], list[Codebook]]:
    """The A/B scripts' command line (--shapes, --ms, --bits, --codebooks, --groups) with these defaults, parsed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--ms", default=ms)
    ap.add_argument("--bits", default="4")
    ap.add_argument("--codebooks", default="mcg")
    ap.add_argument("--groups", default="qkv,gate_up", help="Llama-3-8B same-input groups ('' for none)")
    args = ap.parse_args()
    return args, [int(v) for v in args.ms.split(",")], [Codebook.from_label(c) for c in args.codebooks.split(",")]


def over_shapes(args: argparse.Namespace, bench) -> list[dict]:
    """bench(k, n, bits) for every shape and bitrate of the command line, rows in order."""
    rows = []
    for shape in filter(None, args.shapes.split(",")):
        k, n = (int(v) for v in shape.split("x"))
        for bits in (int(b) for b in args.bits.split(",")):
            rows += bench(k, n, bits)
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    args, ms, cbs = ab_args("4096x14336,14336x4096,4096x4096,4096x1024", "1,8,16,32,64,128")
    library.load_library(build=True)
    rows = over_shapes(args, lambda k, n, bits: bench_shape(k, n, bits, ms, cbs))
    dyn = sorted({c for r in rows for c in r if c.startswith("ring") and c.count("_s") == 1 and c[4].isdigit()},
                 key=lambda c: (int(c[4:6]), int(c.split("_s")[1][:-3])))
    cols = ["k", "n", "m", "bits", "codebook", "bf16_us", "policy_us", "ring_best_us", "ring_best", "ring_gemm_us",
            "ring_vs_policy", "ring_vs_bf16"] + dyn
    if rows:
        write_results("ring-ab", header(sys.argv), rows, cols)
    group_rows = []
    for name in filter(None, args.groups.split(",")):
        group_rows += bench_group(name, int(args.bits.split(",")[0]), ms, cbs[0])
        torch.cuda.empty_cache()
    if group_rows:
        write_results("ring-ab-groups", header(sys.argv), group_rows,
                      ["group", "k", "n", "m", "bits", "codebook", "policy_us", "policy_rotate_out_launch_us",
                       "in_launch_gain"]
                      + [f"ring{mode}_us" for mode in dispatch.MMA_RING_MODES] + ["ring_vs_policy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
