"""The x ring on Hopper's warpgroup MMA against the mma.sync ring, today's large-m path and bf16 cuBLAS, m = 16..1024.

The mma.sync ring (`ring=81/82`) spends a tile's instructions on one mma.sync per 8 rows of x and decodes the weights
again per 64-row block. The wgmma ring (`ring=91/92`, sm_90a builds) issues one wgmma per tile and 64 rows and
decodes once per block of up to 256 rows. Whole linear (both rotations), CUDA-graph replay over weight copies larger
than L2. Each wgmma cell's output is checked against the dispatch's with the wgmma ring off (relative error < 1e-3:
the splits differ, and the tensor cores' order inside a k16 step is unspecified). Columns: `m1_us` the dispatch at
m = 1 (issue 20 asks m = 64 <= 1.25x of it), `mma_us` the mma.sync ring at its policy splits (m <= 128),
`policy_us` the dispatch with the wgmma ring off, `wg_policy_us` with it on (the default where the build has it),
`wg<mode>_s<splits>_us` per cell, `wg_best_us` and the ratios.

  python experiments/wgmma_ab.py [--shapes 4096x14336,...] [--ms 16,32,...] [--bits 4] [--codebooks mcg] [--groups ..]

Writes benchmarks/results/wgmma-ab-<gpu>.{json,md} (and -groups).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from benchmarks.kernels import bf16_time  # noqa: E402
from experiments.ring_ab import ab_args, group_sets, over_shapes  # noqa: E402
from experiments.xs_ab import _weights  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense, dispatch, groups, library  # noqa: E402


def split_candidates(m: int, kt: int, nt: int, device: torch.device) -> list[int]:
    base = dispatch.default_splits(kt, nt, device)
    policy = dispatch.ring_splits(m, kt, nt, device, dispatch.WGMMA_RING_MODES[0])
    return sorted({1, max(1, base // 4), max(1, (base + 1) // 2), base, policy} - {0})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_shape(k: int, n: int, bits: int, ms: list[int], cbs: list[Codebook]) -> list[dict]:
    copies, tiles, suh, svh, gen = _weights(k, n, bits)
    kt, nt = k // 16, n // 16
    dev = tiles[0].device
    rows = []
    for cb in cbs:
        x1 = torch.randn(1, k, generator=gen).half().cuda()
        with dispatch.pinned_wgmma(False):
            m1 = graph_us(lambda i, cb=cb, x1=x1: dense.exl3_linear(x1, tiles[i % copies], suh, svh, cb), copies)
        for m in ms:
            x = torch.randn(m, k, generator=gen).half().cuda()
            row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label, "bf16_us": bf16_time(k, n, m, [x] * 4),
                   "m1_us": m1}
            with dispatch.pinned_wgmma(False):
                row["policy_us"] = graph_us(lambda i, x=x, cb=cb: dense.exl3_linear(x, tiles[i % copies], suh, svh, cb),
                                            copies)
                want = dense.exl3_linear(x, tiles[0], suh, svh, cb)
            row["wg_policy_us"] = graph_us(lambda i, x=x, cb=cb: dense.exl3_linear(x, tiles[i % copies], suh, svh, cb),
                                           copies)
            row["wg_policy_vs_bf16_time"] = round(row["wg_policy_us"] / row["bf16_us"], 3) if row["bf16_us"] else None
            if m <= dispatch.CROSSOVERS.ring_max_m:
                mode = dispatch.mma_ring_mode(m)
                sp = dispatch.ring_splits(m, kt, nt, dev, mode)
                row["mma_us"] = graph_us(lambda i, x=x, cb=cb, sp=sp, mode=mode: dense.had_out(
                    dense.gemm_rotated_partial(dense.had_in(x, suh), tiles[i % copies], cb, splits=sp, ring=mode),
                    svh), copies)
            best = None
            for mode in dispatch.WGMMA_RING_MODES:
                for sp in split_candidates(m, kt, nt, dev):
                    def linear(i: int, x=x, cb=cb, sp=sp, mode=mode) -> torch.Tensor:
                        xh = dense.had_in(x, suh)
                        part = dense.gemm_rotated_partial(xh, tiles[i % copies], cb, splits=sp, ring=mode)
                        return dense.had_out(part, svh)

                    err = rel(linear(0), want)
                    if not err < 1e-3:
                        raise AssertionError(f"{k}x{n} m={m} wgmma mode {mode} splits {sp}: rel {err:.2e}")
                    us = graph_us(linear, copies)
                    row[f"wg{mode}_s{sp}_us"] = us
                    if best is None or us < best[0]:
                        best = (us, mode, sp)
            row["wg_best_us"], row["wg_best"] = best[0], f"{best[1]}/s{best[2]}"
            row["wg_vs_policy"] = round(row["policy_us"] / best[0], 3)
            if row["bf16_us"]:
                row["wg_time_vs_bf16"] = round(best[0] / row["bf16_us"], 3)
            row["wg_time_vs_m1"] = round(best[0] / m1, 3)
            rows.append(row)
            print(row, flush=True)
    return rows


SPLIT_VARIANTS = {1: "wg_load_splits_us", 4: "wg_quarter_splits_us", 8: "wg_eighth_splits_us"}


def at_splits(tiles: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor], cb: Codebook,
              divisor: int) -> groups.Exl3Group:
    """The group at its load-time splits divided by `divisor` (rounded up), given explicitly: no wgmma rows, so the
    wgmma ring runs these splits (the policy runs half, `wg_splits`)."""
    splits = [max(1, -(-dispatch.default_splits(t.shape[1], t.shape[0], t.device) // divisor)) for t in tiles]
    return groups.make_group(tiles, suh, svh, cb, splits=splits)


def bench_group(name: str, bits: int, ms: list[int], cb: Codebook) -> list[dict]:
    """A same-input group as a layer runs it with the wgmma ring off and on (the policy in both), and on the wgmma
    ring at its load-time splits, a quarter and an eighth of them (SPLIT_VARIANTS, where the policy takes the wgmma
    ring: 33-64 rows) against the policy's own (wg_splits: one split or half); where the policy's wgmma rows are at
    one split (they rotate inside the GEMM's launch), the same rows through fp32 partials and an output rotation
    launch (`wg_partials_us`, what SGLANG_EXL3_DEV_WG_ROTATING=off runs)."""
    k, widths, copies, sets, gen = group_sets(name, bits, cb)
    variants = {d: [at_splits(*st[:3], cb, d) for st in sets] for d in SPLIT_VARIANTS}
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).half().cuda()

        def policy(i: int, x=x) -> torch.Tensor:
            tiles, suh, svh, group = sets[i % copies]
            if group.runs_fused(x.shape[0]):
                return groups.group_linear(x, group)
            return torch.cat([dense.exl3_linear(x, t, s, v, cb) for t, s, v in zip(tiles, suh, svh, strict=True)], 1)

        row = {"group": name, "k": k, "n": "+".join(map(str, widths)), "m": m, "bits": bits, "codebook": cb.label,
               "bf16_us": sum(bf16_time(k, w, m, [x] * 4) or 0.0 for w in widths)}
        with dispatch.pinned_wgmma(False):
            row["policy_us"] = graph_us(policy, copies)
            want = policy(0)
        err = rel(policy(0), want)
        if not err < 1e-3:
            raise AssertionError(f"group {name} m={m}: wgmma differs, rel {err:.2e}")
        row["wg_policy_us"] = graph_us(policy, copies)
        if sets[0][3].runs_fused(m) and sets[0][3].ring_mode(m) in dispatch.WGMMA_RING_MODES:
            for d, column in SPLIT_VARIANTS.items():
                row[column] = graph_us(lambda i, x=x, d=d: groups.group_linear(x, variants[d][i % copies]), copies)
            if sets[0][3].wg_one_split:
                def partials(i: int, x=x) -> torch.Tensor:
                    group = sets[i % copies][3]
                    table, items, part = group.launch_rows(dispatch.RingMode.WGMMA_1)
                    return groups.group_run(x, table, group.num, x.shape[0], group.k_tiles, items, group.total_cols,
                                            part, group.k2, group.codebook, 0, dispatch.RingMode.WGMMA_1)

                row["wg_partials_us"] = graph_us(partials, copies)
        row["wg_vs_policy"] = round(row["policy_us"] / row["wg_policy_us"], 3)
        row["wg_time_vs_bf16"] = round(row["wg_policy_us"] / row["bf16_us"], 3)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> int:
    args, ms, cbs = ab_args("4096x14336,14336x4096,4096x4096,4096x1024", "16,32,48,64,96,128,192,256,384,1024")
    library.load_library(build=True)
    if not dispatch.wgmma_ready():
        print("the wgmma ring is not available here (needs an sm_90a build on a Hopper GPU)")
        return 1
    rows = over_shapes(args, lambda k, n, bits: bench_shape(k, n, bits, ms, cbs))
    dyn = sorted({c for r in rows for c in r if c.startswith("wg9")},
                 key=lambda c: (c[2:4], int(c.split("_s")[1][:-3])))
    if rows:
        write_results("wgmma-ab", header(sys.argv), rows,
                      ["k", "n", "m", "bits", "codebook", "bf16_us", "m1_us", "policy_us", "wg_policy_us",
                       "wg_policy_vs_bf16_time", "mma_us", "wg_best_us", "wg_best", "wg_vs_policy", "wg_time_vs_bf16",
                       "wg_time_vs_m1"] + dyn)
    group_rows = []
    for name in filter(None, args.groups.split(",")):
        group_rows += bench_group(name, int(args.bits.split(",")[0]), ms, cbs[0])
        torch.cuda.empty_cache()
    if group_rows:
        write_results("wgmma-ab-groups", header(sys.argv), group_rows,
                      ["group", "k", "n", "m", "bits", "codebook", "bf16_us", "policy_us", "wg_policy_us",
                       *SPLIT_VARIANTS.values(), "wg_partials_us", "wg_vs_policy", "wg_time_vs_bf16"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
