"""EXL3 MoE layer on a Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8): ours
(`torch.ops.exl3.moe_routed`, routed experts only) vs SGLang's bf16 `fused_experts` (Triton) on the same
weights dequantized, side by side in one run (CUDA-graph replay medians, routing rotated across calls).

  python benchmarks/moe.py [--bits 2,3,4,5] [--ms 1,4,16,64,512,4096]

Writes benchmarks/results/moe-<gpu>.{json,md}. The exllamav3 column needs its extension (not built here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402

HIDDEN, EXPERTS, INTER, TOPK = 2048, 128, 768, 8
ROUTINGS = 8
COLUMNS = ["m", "bits", "ours_us", "exllamav3_us", "bf16_us", "ours_vs_bf16"]


def expert_weights(bits: int):
    """Random EXL3 experts (kernel layout) + banks, and their bf16 dequantized twins in fused_moe's layout."""
    from sglang_exl3.kernels import cuda_trellis as ck

    roles = {"gate": (HIDDEN, INTER), "up": (HIDDEN, INTER), "down": (INTER, HIDDEN)}
    tiles, suh, svh, dense = {}, {}, {}, {}
    for role, (k, n) in roles.items():
        tiles[role] = [ck.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), dtype=torch.int16,
                                                device="cuda")) for _ in range(EXPERTS)]
        suh[role] = [(torch.randn(k, device="cuda") * 0.05).half() for _ in range(EXPERTS)]
        svh[role] = [(torch.randn(n, device="cuda") * 0.05).half() for _ in range(EXPERTS)]
        # the dequantized weight W [k, n] = had(had(diag(suh)) W_hat) diag(svh): the layer's linear map on x
        eye = torch.eye(k, device="cuda", dtype=torch.float16)
        dense[role] = torch.stack([ck.exl3_linear(eye, t, s, v, Codebook.MCG, path="reconstruct").t().bfloat16()
                                   for t, s, v in zip(tiles[role], suh[role], svh[role], strict=True)])
    banks = [ck.make_expert_bank(tiles[r], suh[r], svh[r], Codebook.MCG) for r in roles]
    w13 = torch.cat([dense["gate"], dense["up"]], dim=1)  # [E, 2I, H]
    return banks, w13, dense["down"]  # w2 [E, H, I]


def routing(m: int, gen: torch.Generator):
    logits = torch.randn(m, EXPERTS, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    return (w / w.sum(-1, keepdim=True)).cuda(), ids.to(torch.int32).cuda(), logits.cuda()


def bench_bits(bits: int, ms: list[int]) -> list[dict]:
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_exl3.kernels import exl3_gemm  # noqa: F401  (registers the ops)

    banks, w13, w2 = expert_weights(bits)
    gate, up, down = banks
    cfg = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN,
                          intermediate_size_per_partition=INTER, top_k=TOPK, params_dtype=torch.bfloat16,
                          inplace=False)
    rows = []
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, HIDDEN, generator=gen).half().cuda() for _ in range(ROUTINGS)]
        routes = [routing(m, gen) for _ in range(ROUTINGS)]

        def ours(i, xs=xs, routes=routes):
            w, ids, _ = routes[i]
            return torch.ops.exl3.moe_routed(xs[i], ids.long(), w, gate.rows, up.rows, down.rows, gate.meta,
                                             down.meta, False)

        def bf16(i, xs=xs, routes=routes):
            w, ids, logits = routes[i]
            return fused_experts(xs[i].bfloat16(), w13, w2, StandardTopKOutput(w, ids, logits), cfg)

        ref = bf16(0).float()
        got = ours(0)
        rel = float((got - ref).norm() / ref.norm())
        row = {"m": m, "bits": bits, "rel_err_vs_bf16": rel, "exllamav3_us": None,
               "ours_us": graph_us(ours, ROUTINGS, calls=ROUTINGS), "bf16_us": graph_us(bf16, ROUTINGS, calls=ROUTINGS)}
        row["ours_vs_bf16"] = row["bf16_us"] / row["ours_us"]
        print("ROW", row, flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--ms", default="1,4,16,64,512,4096")
    args = ap.parse_args()
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        rows += bench_bits(bits, [int(m) for m in args.ms.split(",")])
        torch.cuda.empty_cache()
    write_results("moe", header(sys.argv), rows, COLUMNS + ["rel_err_vs_bf16"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
