"""Where the MoE layer's time goes, kernel by kernel: the Qwen3-30B-A3B-shaped layer of `benchmarks/moe.py` (random
4-bit experts) run by the MoE method's capturable forward and by bf16 `fused_experts`, each captured in a CUDA graph
of `--calls` calls and replayed under the torch profiler. Per row count, every kernel's GPU time per call (summed over
its launches), its launch count per call, and the span from a call's first kernel to its last.

  python experiments/moe_profile.py [--ms 16,64,128,256] [--calls 8]

Writes benchmarks/results/moe-profile-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import capture_graph, header, publish_sglang_args, write_results  # noqa: E402
from benchmarks.moe import EXPERTS, HIDDEN, INTER, ROUTINGS, TOPK, expert_layer, random_expert_tensors, routing  # noqa: E402

COLUMNS = ["m", "forward", "kernel", "us_per_call", "launches_per_call", "share"]


def short_name(kernel: str) -> str:
    """A kernel's name without its argument list and namespaces, template arguments kept (they name the variant).
    Ours live in an anonymous namespace, whose "(anonymous namespace)::" must go before the argument list is cut."""
    name = kernel.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = re.sub(r"\([^()]*\)$", "", name)
    return re.sub(r"\b[A-Za-z_]\w*::", "", name)[:90]


def profile_graph(fn, calls: int) -> tuple[dict[str, list[float]], float]:
    """{kernel: [total us, launches]} per call and the mean span of one call, from replays of a graph of `calls`
    calls of fn(i)."""
    graph = capture_graph(fn, ROUTINGS, calls)
    replays = 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name and
              "Memcpy" not in e.name and "Memset" not in e.name]
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        entry = per[short_name(e.name)]
        entry[0] += e.time_range.elapsed_us() / (replays * calls)
        entry[1] += 1 / (replays * calls)
    span = 0.0
    if events:
        starts = sorted(e.time_range.start for e in events)
        ends = sorted(e.time_range.end for e in events)
        span = (ends[-1] - starts[0]) / (replays * calls)
    return dict(per), span


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,64,128,256")
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_exl3.kernels import exl3_gemm  # noqa: F401  (registers the ops)

    publish_sglang_args()  # fused_experts reads the server's published config, as inside a server
    layer, method, w13, w2 = expert_layer(random_expert_tensors(4))
    cfg = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN,
                          intermediate_size_per_partition=INTER, top_k=TOPK, params_dtype=torch.bfloat16,
                          inplace=False)
    rows: list[dict] = []
    for m in [int(v) for v in args.ms.split(",")]:
        gen = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, HIDDEN, generator=gen).bfloat16().cuda() for _ in range(ROUTINGS)]
        routes = [routing(m, gen) for _ in range(ROUTINGS)]

        def ours(i, xs=xs, routes=routes):
            w, ids, _ = routes[i]
            return method._capturable(layer, xs[i], w, ids).to(xs[i].dtype)

        def bf16(i, xs=xs, routes=routes):
            w, ids, logits = routes[i]
            return fused_experts(xs[i], w13, w2, StandardTopKOutput(w, ids, logits), cfg)

        for name, fn in (("ours", ours), ("bf16", bf16)):
            per, span = profile_graph(fn, args.calls)
            total = sum(us for us, _ in per.values())
            for kernel, (us, launches) in sorted(per.items(), key=lambda kv: -kv[1][0]):
                rows.append({"m": m, "forward": name, "kernel": kernel, "us_per_call": round(us, 2),
                             "launches_per_call": round(launches, 2), "share": round(us / total, 3)})
            rows.append({"m": m, "forward": name, "kernel": "(kernels total)", "us_per_call": round(total, 2),
                         "launches_per_call": round(sum(n for _, n in per.values()), 2), "share": 1.0})
            rows.append({"m": m, "forward": name, "kernel": "(span of a call)", "us_per_call": round(span, 2),
                         "launches_per_call": None, "share": None})
            print(f"m={m} {name}: kernels {total:.1f} us, span {span:.1f} us", flush=True)
    write_results("moe-profile", header(sys.argv), rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
