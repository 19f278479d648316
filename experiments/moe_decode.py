"""The decode MoE (two launches: `cuda_trellis.moe_decode`) against the five-launch fused forward (`routed_moe`), on
a Qwen3-30B-A3B-shaped layer (hidden 2048, 128 experts of 768, top-8), side by side in one run: CUDA-graph replay
medians over 8 routings, bf16 x in and bf16 out as the layer uses them (the fused forward timed with its output
cast). Also the split counts of both launches swept at each m, bit-identity with the fused forward at its banks'
splits, and the time per kernel at m = 1 (torch profiler, eager).

  python experiments/moe_decode.py [--ms 1,2,4,8] [--bits 4] [--codebooks mcg,mul1] [--no-sweep]

Writes benchmarks/results/moe-decode-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense, dispatch, library, moe_ops, moe_tables  # noqa: E402

HIDDEN, EXPERTS, INTER, TOPK = 2048, 128, 768, 8
ROUTINGS = 8
GU_SPLITS, DN_SPLITS = (1, 2, 4, 8, 16), (1, 2, 3, 6)


def banks(cb: Codebook, bits: int):
    gen = torch.Generator().manual_seed(bits)
    out = []
    for k, n in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
        tiles = [dense.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen,
                                          dtype=torch.int16).cuda()) for _ in range(EXPERTS)]
        suh = [(torch.randn(k, generator=gen) * 0.05).half().cuda() for _ in range(EXPERTS)]
        svh = [(torch.randn(n, generator=gen) * 0.05).half().cuda() for _ in range(EXPERTS)]
        out.append(moe_tables.make_expert_bank(tiles, suh, svh, cb))
    return out


def kernel_breakdown(run, calls: int = 40) -> dict[str, float]:
    """Mean device µs per call of each kernel over `calls` eager calls."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(5):
        run(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            run(i)
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            out[ev.key[:70]] = round(t / calls, 2)
    return out


def bench(cb: Codebook, bits: int, ms: list[int], sweep: bool) -> tuple[list[dict], list[dict]]:
    from sglang_exl3.kernels.moe_routed import routed_moe

    gate, up, down = banks(cb, bits)
    rows, breakdowns = [], []
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, HIDDEN, generator=gen).bfloat16().cuda() for _ in range(ROUTINGS)]
        routes = []
        for _ in range(ROUTINGS):
            w, ids = torch.softmax(torch.randn(m, EXPERTS, generator=gen), -1).topk(TOPK, dim=-1)
            routes.append(((w / w.sum(-1, keepdim=True)).cuda(), ids.to(torch.int32).cuda()))
        counters = moe_ops.decode_counters(m * TOPK, m, HIDDEN, INTER, "cuda")

        def fused(i, xs=xs, routes=routes):
            w, ids = routes[i % ROUTINGS]
            return routed_moe(xs[i % ROUTINGS], ids, w, gate, up, down, False).bfloat16()

        def decode(i, gu=None, dn=None, pdl=True, out=torch.bfloat16, xs=xs, routes=routes, counters=counters):
            w, ids = routes[i % ROUTINGS]
            return moe_ops.moe_decode(xs[i % ROUTINGS], ids.reshape(-1), w.reshape(-1), gate, up, down, TOPK, False,
                                 counters, gu, dn, out_dtype=out, pdl=pdl)

        want = routed_moe(xs[0], routes[0][1], routes[0][0], gate, up, down, False)
        same = decode(0, gate.splits, down.splits, out=torch.float32)
        row = {"m": m, "bits": bits, "codebook": cb.label,
               "gu_splits": dispatch.decode_splits(gate.k_tiles, gate.n_tiles, 2 * m * TOPK, xs[0].device, least=2),
               "dn_splits": dispatch.decode_splits(down.k_tiles, down.n_tiles, m * TOPK, xs[0].device),
               "bit_identical": bool(torch.equal(same, want)),
               "fused_us": graph_us(fused, ROUTINGS, calls=ROUTINGS),
               "decode_us": graph_us(decode, ROUTINGS, calls=ROUTINGS),
               "decode_no_pdl_us": graph_us(lambda i: decode(i, pdl=False), ROUTINGS, calls=ROUTINGS)}
        row["speedup"] = row["fused_us"] / row["decode_us"]
        if sweep:
            best = None
            for gu in GU_SPLITS:
                for dn in DN_SPLITS:
                    us = graph_us(lambda i, gu=gu, dn=dn: decode(i, gu, dn), ROUTINGS, calls=ROUTINGS)
                    row[f"s{gu}x{dn}_us"] = us
                    if best is None or us < best[0]:
                        best = (us, f"{gu}x{dn}")
            row["best_us"], row["best_splits"] = best
        if m == 1:
            breakdowns.append({"codebook": cb.label, "bits": bits, "decode": kernel_breakdown(decode),
                               "fused": kernel_breakdown(fused)})
            print(breakdowns[-1], flush=True)
        rows.append(row)
        print(row, flush=True)
    return rows, breakdowns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--codebooks", default="mcg,mul1")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    library.load_library(build=True)
    rows, breakdowns = [], []
    for bits in (int(b) for b in args.bits.split(",")):
        for label in args.codebooks.split(","):
            r, b = bench(Codebook.from_label(label), bits, [int(v) for v in args.ms.split(",")], not args.no_sweep)
            rows += r
            breakdowns += b
            torch.cuda.empty_cache()
    head = header(["python"] + sys.argv)
    head["kernel_breakdown_m1"] = breakdowns
    cols = ["m", "bits", "codebook", "fused_us", "decode_us", "speedup", "decode_no_pdl_us", "gu_splits",
            "dn_splits", "best_us", "best_splits", "bit_identical"]
    write_results("moe-decode", head, rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
