"""EXL3 MoE layer on a Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8): ours (the MoE method's
capturable forward: routed groups below DENSE_MIN_ROWS rows, dense slab + fused_experts above) vs SGLang's bf16
`fused_experts` (Triton) on the same weights dequantized, side by side in one run (CUDA-graph replay medians,
routing rotated across calls).

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


def expert_layer(bits: int):
    """Random EXL3 experts as the MoE layer holds them on our kernels (stacks, banks, slab), the layer's method,
    and the bf16 dequantized twins in fused_experts' layout (decoded by the product's own dense path)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from sglang_exl3.kernels import cuda_trellis as ck
    from sglang_exl3.kernels.backends import Backend
    from sglang_exl3.layers.linear import Exl3Shard
    from sglang_exl3.layers.moe import Exl3MoEMethod
    from sglang_exl3.layers.moe_kernels import build_tiers

    roles = {"w1": (HIDDEN, INTER), "w3": (HIDDEN, INTER), "w2": (INTER, HIDDEN)}
    experts = [{role: Exl3Shard(key=role, trellis=ck.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16),
                                                                            dtype=torch.int16, device="cuda")),
                                suh=(torch.randn(k, device="cuda") * 0.05).half(),
                                svh=(torch.randn(n, device="cuda") * 0.05).half(), codebook=Codebook.MCG,
                                out_features=n, kernel_layout=True)
                for role, (k, n) in roles.items()} for _ in range(EXPERTS)]
    layer = SimpleNamespace(exl3_experts=experts, intermediate_size_per_partition=INTER, hidden_size=HIDDEN,
                            exl3_backend=int(Backend.CUDA))
    layer.exl3_tiers = build_tiers(experts, Backend.CUDA)
    method = Exl3MoEMethod({}, "bench.experts")
    method.moe_runner_config = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN,
                                               intermediate_size_per_partition=INTER, top_k=TOPK,
                                               params_dtype=torch.float16)
    method._reserve_slab(layer, torch.device("cuda"))
    w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.float16, device="cuda")
    w2 = torch.empty(EXPERTS, HIDDEN, INTER, dtype=torch.float16, device="cuda")
    (tier,) = layer.exl3_tiers.tiers
    gate, up, down = tier.dense
    ck.dense_experts(*gate, out=w13[:, :INTER])
    ck.dense_experts(*up, out=w13[:, INTER:])
    ck.dense_experts(*down, out=w2)
    return layer, method, w13.bfloat16(), w2.bfloat16()


def routing(m: int, gen: torch.Generator):
    logits = torch.randn(m, EXPERTS, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    return (w / w.sum(-1, keepdim=True)).cuda(), ids.to(torch.int32).cuda(), logits.cuda()


def bench_bits(bits: int, ms: list[int]) -> list[dict]:
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_exl3.kernels import exl3_gemm  # noqa: F401  (registers the ops)

    layer, method, w13, w2 = expert_layer(bits)
    cfg = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN,
                          intermediate_size_per_partition=INTER, top_k=TOPK, params_dtype=torch.bfloat16,
                          inplace=False)
    rows = []
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, HIDDEN, generator=gen).half().cuda() for _ in range(ROUTINGS)]
        routes = [routing(m, gen) for _ in range(ROUTINGS)]

        def ours(i, xs=xs, routes=routes):  # the product's forward for m rows (routed groups or the dense slab)
            w, ids, _ = routes[i]
            return method._capturable(layer, xs[i], w, ids)

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
