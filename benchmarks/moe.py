"""EXL3 MoE layer on a Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8; `--shape mixtral-8x7b`: 4096,
8 x 14336, top-2, written as moe-mixtral-8x7b-<gpu>): ours (the MoE method's
capturable forward: routed groups below rotated_min_rows rows, the rotated slab above) vs SGLang's bf16
`fused_experts` (Triton) on the same weights dequantized, side by side in one run (CUDA-graph replay medians,
routing rotated across calls). Both take the hidden states in the model's dtype (--x-dtype, bf16 by default) and
return that dtype, as the layer does inside a model: ours is the MoE method's forward plus its output cast (and, before
the routed forwards read bf16 themselves, it was timed from fp16 x to fp32 out: two casts short of the layer).

  python benchmarks/moe.py [--bits 2,3,4,5] [--ms 1,4,16,64,512,4096] [--ckpt-dir DIR] [--x-dtype bf16|fp16]

With --ckpt-dir, each bitrate's experts come from a one-layer checkpoint of this shape written there
(`write-fixture --arch qwen3_moe --shape qwen3-30b-a3b --layers 1 --codebook mcg`), and the exllamav3 column is
exllamav3's own `BlockSparseMLP` loaded from that checkpoint by exllamav3 (its router replaced by the benchmark's
routing, so both sides run the same experts on the same weights; the outputs are compared). exllamav3 is timed
under CUDA-graph replay where it captures, else eagerly (the row says which). Without it, random experts and no
exllamav3 column.

With --marlin, a third anchor: SGLang's `fused_marlin_moe` (GPTQ-Marlin int4, group 128, bf16 x) on random packed
weights of the same shape, the 4-bit MoE an SGLang user serves on Hopper today (its JIT modules compile on first use:
build them here with scripts/prebuild_jit.py and carry the cache).

Writes benchmarks/results/moe-<gpu>.{json,md,png}. `--merge A.json B.json ...` joins the rows of separate runs
(e.g. one per bitrate) into that one table and plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    RESULTS,
    eager_us,
    gpu_slug,
    graph_us,
    header,
    publish_sglang_args,
    pyplot,
    write_results,
)
from sglang_exl3.format import Codebook  # noqa: E402

# (hidden, experts, intermediate, top-k) per --shape; the module-level names hold the chosen one (main sets them)
SHAPES = {"qwen3-30b-a3b": (2048, 128, 768, 8), "mixtral-8x7b": (4096, 8, 14336, 2)}
HIDDEN, EXPERTS, INTER, TOPK = SHAPES["qwen3-30b-a3b"]
ROUTINGS = 8
COLUMNS = ["m", "bits", "ours_us", "exllamav3_us", "bf16_us", "marlin_us", "ours_vs_bf16", "ours_vs_exllamav3",
           "ours_vs_marlin"]
DECODE_FORCED_MAX_M = 64  # --both-paths times the decode forward up to here (its per-pair partials grow with m)
EXLLAMAV3_GRAPH_MAX_M = 8  # its fused decode tier (bsz <= 8); above, it reads expert counts back to the host
EXTRA_COLUMNS = ["x_dtype", "rel_err_vs_bf16", "rel_err_vs_exllamav3", "exllamav3_timing", "ours_pairs_us",
                 "ours_pairs_staged_us", "ours_decode_us", "ours_sorted_us", "ours_sorted_staged_us",
                 "ours_sorted_split_us", "ours_sorted_split_staged_us", "ours_rotated_us",
                 "ours_rotated_decode_us", "ours_rotated_glue_us", "fastest", "ours_over_fastest"]
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def random_expert_tensors(bits: int):
    """(trellis, suh, svh, codebook) per expert and role, random (valid EXL3: any bit pattern decodes)."""
    roles = {"w1": (HIDDEN, INTER), "w3": (HIDDEN, INTER), "w2": (INTER, HIDDEN)}
    return [{role: (torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), dtype=torch.int16),
                    (torch.randn(k) * 0.05).half(), (torch.randn(n) * 0.05).half(), Codebook.MCG)
             for role, (k, n) in roles.items()} for _ in range(EXPERTS)]


def checkpoint_expert_tensors(ckpt: Path):
    """The same, read from layer 0 of a checkpoint (the weights exllamav3 loads for its column), through the
    product's own validated checkpoint reader."""
    from sglang_exl3.format import load_checkpoint

    checkpoint = load_checkpoint(ckpt)
    out = []
    for e in range(EXPERTS):
        roles = {}
        for role, proj in PROJ.items():
            key = f"model.layers.0.mlp.experts.{e}.{proj}"
            t = checkpoint.load_module(key)
            roles[role] = (t["trellis"], t["suh"].half(), t["svh"].half(), checkpoint.modules[key].codebook)
        out.append(roles)
    return out


def write_layer_checkpoint(path: Path, bits: int) -> Path:
    """A one-layer Qwen3-30B-A3B-shaped EXL3 checkpoint from the product's fixture writer."""
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "sglang_exl3", "write-fixture", str(path), "--arch", "qwen3_moe",
                        "--shape", "qwen3-30b-a3b", "--layers", "1", "--codebook", "mcg", "--bits", str(bits),
                        "--seed", str(bits)], check=True)
    return path


def exllamav3_moe(ckpt: Path):
    """exllamav3's own MoE module for layer 0 of the checkpoint, loaded by exllamav3, and a holder whose
    routing replaces its router's."""
    from exllamav3 import Config, Model
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    model = Model.from_config(Config.from_directory(str(ckpt)))
    model.load()
    module = next(m for m in model if isinstance(m, BlockSparseMLP))
    current = [None]
    module.routing_fn = lambda bsz, cfg, z, params: current[0]
    return model, module, current


def expert_layer(tensors):
    """EXL3 experts as the MoE layer holds them on our kernels (stacks, banks, slab), the layer's method,
    and the bf16 dequantized twins in fused_experts' layout (decoded by the product's own dense path)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from sglang_exl3.kernels import dense
    from sglang_exl3.kernels.backends import Backend
    from sglang_exl3.layers.moe import Exl3MoEMethod
    from sglang_exl3.layers.moe_kernels import build_tiers
    from sglang_exl3.layers.shard import Exl3Shard

    experts = [{role: Exl3Shard(key=role, trellis=dense.prepare(trellis.cuda()), suh=suh.cuda(), svh=svh.cuda(),
                                codebook=cb, out_features=svh.numel(), kernel_layout=True)
                for role, (trellis, suh, svh, cb) in roles.items()} for roles in tensors]
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
    twin_experts(*gate, out=w13[:, :INTER])
    twin_experts(*up, out=w13[:, INTER:])
    twin_experts(*down, out=w2)
    return layer, method, w13.bfloat16(), w2.bfloat16()


def twin_experts(tiles: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook, out: torch.Tensor) -> None:
    """Original-basis weights of E experts in fused_experts' [E, N, K] layout, out[e] = (diag(suh_e) H W_hat_e H
    diag(svh_e))^T, for the experts' prepare()d weights stacked along N: the bf16 twin's weights (the rotations in
    torch; the anchor's timing does not depend on how its weights were made)."""
    from sglang_exl3.codec.hadamard import had_r_128
    from sglang_exl3.kernels import dense

    e_count, k = suh.shape
    w = had_r_128(dense.reconstruct(tiles, codebook), post_scale=svh)  # [K, E*N], rotated along N
    wt = had_r_128(w.t().contiguous())  # [E*N, K], rotated along K
    torch.mul(wt.view(e_count, -1, k), suh.view(e_count, 1, k), out=out)


def routing(m: int, gen: torch.Generator):
    logits = torch.randn(m, EXPERTS, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    return (w / w.sum(-1, keepdim=True)).cuda(), ids.to(torch.int32).cuda(), logits.cuda()


def marlin_experts():
    """fused_marlin_moe on random GPTQ-Marlin int4 experts (uint4b8, group 128, no act-order) of this shape: its work
    does not depend on the values. Returns run(x, weights, ids, logits), or None (the reason printed) where SGLang's
    Marlin MoE is unavailable."""
    try:
        from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
        from sglang.srt.layers.quantization.marlin_utils import marlin_make_workspace
    except Exception as e:  # noqa: BLE001
        print(f"marlin column skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    dev, big = torch.device("cuda"), 2**31 - 1
    w1 = torch.randint(-big, big, (EXPERTS, HIDDEN // 16, 2 * INTER * 2), dtype=torch.int32, device=dev)
    w2 = torch.randint(-big, big, (EXPERTS, INTER // 16, HIDDEN * 2), dtype=torch.int32, device=dev)
    s1 = (torch.rand(EXPERTS, HIDDEN // 128, 2 * INTER, device=dev) * 0.01 + 0.001).bfloat16()
    s2 = (torch.rand(EXPERTS, INTER // 128, HIDDEN, device=dev) * 0.01 + 0.001).bfloat16()
    empty = torch.empty(EXPERTS, 0, dtype=torch.int32, device=dev)
    workspace = marlin_make_workspace(dev, max_blocks_per_sm=4)

    def run(x, w, ids, logits):
        return fused_marlin_moe(x, w1, w2, s1, s2, logits, w, ids, g_idx1=empty, g_idx2=empty, sort_indices1=empty,
                                sort_indices2=empty, workspace=workspace, num_bits=4, is_k_full=True)
    return run


def bench_bits(bits: int, ms: list[int], ckpt_dir: Path | None, rows: list[dict], flush,
               both_paths: bool = False, x_dtype: torch.dtype = torch.bfloat16, marlin=None) -> None:
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_exl3.kernels import exl3_gemm  # noqa: F401  (registers the ops)
    from sglang_exl3.kernels.moe_ops import decode_counters
    from sglang_exl3.kernels.moe_routed import routed_moe
    from sglang_exl3.kernels.moe_sorted import sorted_moe
    from sglang_exl3.layers.moe_rotated import decode_rotated, rotated_slab_forward

    theirs = None
    if ckpt_dir is None:
        tensors = random_expert_tensors(bits)
    else:
        ckpt = write_layer_checkpoint(ckpt_dir / f"qwen3-30b-a3b-1layer-{bits}bpw", bits)
        tensors = checkpoint_expert_tensors(ckpt)
        try:
            theirs = exllamav3_moe(ckpt)
        except Exception as e:  # noqa: BLE001 - the column stays empty, with the reason printed and recorded
            print(f"exllamav3 column skipped: {type(e).__name__}: {e}", file=sys.stderr)
            theirs = f"{type(e).__name__}: {e}"
    layer, method, w13, w2 = expert_layer(tensors)
    del tensors
    cfg = MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_size=HIDDEN,
                          intermediate_size_per_partition=INTER, top_k=TOPK, params_dtype=torch.bfloat16,
                          inplace=False)
    (tier,) = layer.exl3_tiers.tiers
    gate, up, down = tier.banks
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, HIDDEN, generator=gen).to(x_dtype).cuda() for _ in range(ROUTINGS)]
        xs_bf16 = [x.bfloat16() for x in xs]
        routes = [routing(m, gen) for _ in range(ROUTINGS)]

        def ours(i, xs=xs, routes=routes):  # the MoE method's forward for m rows + its cast back (as in apply)
            w, ids, _ = routes[i]
            return method._capturable(layer, xs[i], w, ids).to(xs[i].dtype)

        def bf16(i, xs=xs_bf16, routes=routes):
            w, ids, logits = routes[i]
            return fused_experts(xs[i], w13, w2, StandardTopKOutput(w, ids, logits), cfg)

        ref = bf16(0).float()
        got = ours(0).float()
        rel = float((got - ref).norm() / ref.norm())
        row = {"m": m, "bits": bits, "x_dtype": str(x_dtype).removeprefix("torch."), "rel_err_vs_bf16": rel,
               "exllamav3_us": None,
               "ours_us": graph_us(ours, ROUTINGS, calls=ROUTINGS), "bf16_us": graph_us(bf16, ROUTINGS, calls=ROUTINGS)}
        row["ours_vs_bf16"] = row["bf16_us"] / row["ours_us"]
        if marlin is not None:
            row["marlin_us"] = graph_us(lambda i, xs=xs_bf16, routes=routes: marlin(xs[i], *routes[i]), ROUTINGS,
                                        calls=ROUTINGS)
            row["ours_vs_marlin"] = row["marlin_us"] / row["ours_us"]
        if both_paths:  # each forward at every m: where the pairs/sorted/dense crossovers really lie
            xs16 = [x.half() for x in xs]  # the staged forwards and the fp16 slab take fp16 x

            def forward(fn, xs=xs, xs16=xs16, routes=routes, **kw):
                inputs = xs16 if kw.get("fused") is False else xs

                def run(i):
                    w, ids, _ = routes[i]
                    return fn(inputs[i], ids, w, gate, up, down, False, **kw)
                return run

            for name, fn in (("pairs", routed_moe), ("sorted", sorted_moe)):  # fused, and stage by stage
                row[f"ours_{name}_us"] = graph_us(forward(fn), ROUTINGS, calls=ROUTINGS)
                row[f"ours_{name}_staged_us"] = graph_us(forward(fn, fused=False), ROUTINGS, calls=ROUTINGS)
            # the sorted sources split along K while their tiles fill less than a wave (not yet the dispatch's)
            row["ours_sorted_split_us"] = graph_us(forward(sorted_moe, split_k=True), ROUTINGS, calls=ROUTINGS)
            row["ours_sorted_split_staged_us"] = graph_us(forward(sorted_moe, fused=False, split_k=True), ROUTINGS,
                                                          calls=ROUTINGS)
            if m <= DECODE_FORCED_MAX_M:  # the two-launch decode forward at every small m, whatever sorted_rows says
                counters = decode_counters(m * TOPK, m, HIDDEN, INTER, xs[0].device)

                def decode(i, xs=xs, routes=routes, counters=counters):  # the op routed_forward calls
                    w, ids, _ = routes[i]
                    return torch.ops.exl3.moe_decode(xs[i], ids, w, gate.rows, up.rows, down.rows, gate.meta,
                                                     down.meta, False, counters, 0)

                row["ours_decode_us"] = graph_us(decode, ROUTINGS, calls=ROUTINGS)

            def rotated(i, xs=xs, routes=routes):  # W_hat slab + SGLang's Triton GEMM between our rotations
                w, ids, _ = routes[i]
                return rotated_slab_forward(layer.exl3_tiers, layer.exl3_moe_slab, INTER, HIDDEN, xs[i], w, ids, False)

            row["ours_rotated_us"] = graph_us(rotated, ROUTINGS, calls=ROUTINGS)

            def rotated_decode(i):  # the rotated slab's first stage alone: every W_hat decoded into the slab
                return decode_rotated(layer.exl3_tiers, layer.exl3_moe_slab, INTER, HIDDEN)

            row["ours_rotated_decode_us"] = graph_us(rotated_decode, ROUTINGS, calls=ROUTINGS)
            row["ours_rotated_glue_us"] = graph_us(rotated_glue(layer.exl3_tiers, xs, routes), ROUTINGS,
                                                   calls=ROUTINGS)
        if isinstance(theirs, str):
            row["exllamav3_error"] = theirs
        elif theirs is not None:
            row.update(time_exllamav3(theirs, [x.half() for x in xs], routes, got))  # exllamav3 runs fp16
            if row["exllamav3_us"]:
                row["ours_vs_exllamav3"] = row["exllamav3_us"] / row["ours_us"]
        row.update(fastest_forward(row))
        print("ROW", row, flush=True)
        rows.append(row)
        flush()  # a run cut short still leaves every finished row


# The whole forwards --both-paths times (not the rotated slab's parts), each a choice the dispatch could make
FORWARDS = ("pairs", "pairs_staged", "decode", "sorted", "sorted_staged", "sorted_split", "sorted_split_staged",
            "rotated")


def fastest_forward(row: dict) -> dict:
    """The fastest of the forwards timed in this row, and the dispatch's time (ours_us) over it: 1.0 where the
    dispatch picks the fastest, above 1 where another forward would have been faster at this m ({} without
    --both-paths)."""
    timed = {name: row[f"ours_{name}_us"] for name in FORWARDS if row.get(f"ours_{name}_us")}
    if not timed:
        return {}
    name = min(timed, key=timed.get)
    return {"fastest": name, "ours_over_fastest": row["ours_us"] / timed[name]}


def rotated_glue(tiers, xs, routes):
    """The rotated slab's three glue launches alone (rotate_in, mid, tail) on GEMM outputs of the right shapes: with
    ours_rotated_decode_us, what the two grouped GEMMs take is the rest of ours_rotated_us."""
    from sglang_exl3.layers.moe_rotated import cuda_glue

    glue, tables = cuda_glue(), tiers.rotations
    gate_suh, gate_svh, up_suh, up_svh, down_suh, down_svh = tables
    pairs = routes[0][1].numel()
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(2 * pairs, INTER, generator=gen).half().cuda()
    y = torch.randn(pairs, HIDDEN, generator=gen).half().cuda()

    def run(i):
        w, ids, _ = routes[i]
        flat = tiers.slab_ids(ids).reshape(-1).contiguous()
        glue.rotate_in(xs[i], flat, TOPK, gate_suh, up_suh)
        glue.mid(c, flat, gate_svh, up_svh, down_suh, False)
        return glue.tail(y, flat, w.reshape(-1).float().contiguous(), down_svh, TOPK)
    return run


def time_exllamav3(theirs, xs, routes, ours_out: torch.Tensor) -> dict:
    """exllamav3's MoE forward on the same inputs and routing: its time, how it was timed, and how far its output
    is from ours (same weights, so this checks both sides)."""
    _, module, current = theirs
    picks = [(ids.long(), w.half()) for w, ids, _ in routes]

    def run(i):
        current[0] = picks[i]
        return module.forward(xs[i].view(1, -1, HIDDEN), {})

    out = {}
    try:
        ref = run(0).float().view(-1, HIDDEN)
        out["rel_err_vs_exllamav3"] = float((ours_out - ref).norm() / ref.norm())
        out["exllamav3_us"], out["exllamav3_timing"] = None, "eager"
        if xs[0].shape[0] <= EXLLAMAV3_GRAPH_MAX_M:
            try:
                out["exllamav3_us"], out["exllamav3_timing"] = graph_us(run, ROUTINGS, calls=ROUTINGS), "graph"
            except Exception as e:  # noqa: BLE001 - not capturable: timed as it runs, eagerly
                print(f"  exllamav3 capture failed ({type(e).__name__}: {e}); timing eagerly", file=sys.stderr)
                torch.cuda.synchronize()
        if out["exllamav3_us"] is None:
            out["exllamav3_us"] = eager_us(run, ROUTINGS)
    except Exception as e:  # noqa: BLE001
        print(f"  exllamav3 failed: {type(e).__name__}: {e}", file=sys.stderr)
        out["exllamav3_error"] = f"{type(e).__name__}: {e}"
    return out


def plot(rows: list[dict], path: Path, gpu: str) -> None:
    """µs per layer call against rows m, one panel per bitrate: ours, exllamav3, bf16 fused_experts, Marlin int4."""
    plt = pyplot()
    if plt is None:
        return
    bits = sorted({r["bits"] for r in rows})
    fig, axes = plt.subplots(1, len(bits), figsize=(3.2 * len(bits), 3.4), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], bits, strict=True):
        rs = sorted((r for r in rows if r["bits"] == b), key=lambda r: r["m"])
        ms = [r["m"] for r in rs]
        for key, style, label in (("ours_us", "o-", "ours"), ("exllamav3_us", "s--", "exllamav3"),
                                  ("bf16_us", "k:", "bf16 fused_experts"),
                                  ("marlin_us", "m^-", "GPTQ-Marlin int4 (g128)")):
            if any(r.get(key) for r in rs):
                ax.plot(ms, [r.get(key) for r in rs], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows m")
        ax.set_title(f"{b} bits", fontsize=9)
    axes[0][0].set_ylabel("µs per MoE layer call")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"MoE layer ({HIDDEN}, {EXPERTS} x {INTER}, top-{TOPK}), {gpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def results_name(shape: str) -> str:
    """moe-<gpu> for the Qwen3-30B-A3B layer (the issue's anchor), moe-<shape>-<gpu> for another."""
    return "moe" if shape == "qwen3-30b-a3b" else f"moe-{shape}"


def use_shape(shape: str) -> None:
    """Point the module's shape names at `shape` (every function reads them when called)."""
    global HIDDEN, EXPERTS, INTER, TOPK
    HIDDEN, EXPERTS, INTER, TOPK = SHAPES[shape]


def merge(paths: list[Path]) -> int:
    """One table and plot from several runs' JSON (same GPU, same shape)."""
    runs = [json.loads(p.read_text()) for p in paths]
    head = dict(runs[0]["header"], command=" ; ".join(r["header"]["command"] for r in runs))
    shape = head.get("shape", "qwen3-30b-a3b")
    use_shape(shape)
    rows = sorted((row for r in runs for row in r["rows"]), key=lambda r: (r["bits"], r["m"]))
    out = write_results(results_name(shape), head, rows, COLUMNS + EXTRA_COLUMNS)
    plot(rows, out.with_suffix(".png"), head["gpu"])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--ms", default="1,4,16,64,512,4096")
    ap.add_argument("--ckpt-dir", type=Path, default=None,
                    help="write/read one-layer checkpoints here and add exllamav3's column")
    ap.add_argument("--merge", type=Path, nargs="+", help="join these runs' JSON into one table and plot")
    ap.add_argument("--both-paths", action="store_true",
                    help="also time each forward (per pair, expert-sorted tiles, rotated-basis slab) "
                         "at every m")
    ap.add_argument("--x-dtype", choices=["bf16", "fp16"], default="bf16",
                    help="the model's dtype: what the layer receives and returns")
    ap.add_argument("--marlin", action="store_true", help="add SGLang's fused_marlin_moe (GPTQ int4, g128) column")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                    help="the layer (random experts; --ckpt-dir only for qwen3-30b-a3b): mixtral-8x7b times the "
                         "decode / sorted crossing of an 8-expert top-2 layer")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge)
    if args.ckpt_dir and args.shape != "qwen3-30b-a3b":
        ap.error(f"--ckpt-dir writes Qwen3-30B-A3B layers; --shape {args.shape} runs on random experts")
    use_shape(args.shape)
    publish_sglang_args()
    rows, head = [], dict(header(sys.argv), shape=args.shape)
    marlin = marlin_experts() if args.marlin else None
    for bits in (int(b) for b in args.bits.split(",")):
        bench_bits(bits, [int(m) for m in args.ms.split(",")], args.ckpt_dir, rows,
                   lambda: write_results(results_name(args.shape), head, rows, COLUMNS + EXTRA_COLUMNS),
                   args.both_paths,
                   torch.bfloat16 if args.x_dtype == "bf16" else torch.float16, marlin)
        torch.cuda.empty_cache()
    plot(rows, RESULTS / f"{results_name(args.shape)}-{gpu_slug(head['gpu'])}.png", head["gpu"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
