"""How far apart two correct servers of one MoE model can be: the fp16 twin of a checkpoint run by HF transformers in
fp32 and in fp16 on the CPU, teacher-forced on serving parity's prompts (tests/gpu/serve_parity.py), compared the
way the parity rule compares servers (top-5 log-probabilities of every prompt position), together with how many
tokens each layer routes to a different top-k set. No EXL3 kernel is involved: what this finds is the spread fp16
rounding alone causes, which a strict serving-parity tolerance must leave room for (or a routing-aware rule must
excuse). `--router-scale S` multiplies the routers' weights (a model with more decisive routing).

  python experiments/routing_sensitivity.py TWIN_DIR [--router-scale 1,20] [--name NAME]
  python experiments/routing_sensitivity.py TWIN_DIR --at 44:40,6:d6   # router margins where a parity run failed

Writes benchmarks/results/routing-sensitivity-<name>-cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from serve_parity import TOL, TOP, prompts  # noqa: E402

from benchmarks.common import write_results  # noqa: E402

COLUMNS = ["router_scale", "positions", "max_abs_diff", "positions_over_tol", "tokens", "routed_differently",
           "share_routed_differently", "min_router_margin", "max_router_prob_change", "tokens_within_10x_change"]


def _run(model, ids: list[int]):
    out = model(torch.tensor([ids]), output_router_logits=True)
    return out.logits[0].float().log_softmax(-1), [r.float() for r in out.router_logits]


def _topk_margin(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Per token: router probability of the k-th expert minus the (k+1)-th (how near a routing flip is)."""
    probs = router_logits.softmax(-1).sort(-1, descending=True).values
    return probs[:, topk - 1] - probs[:, topk]


def compare(twin: Path, scale: float, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    models = {dt: AutoModelForCausalLM.from_pretrained(twin, dtype=dt).eval() for dt in (torch.float32, torch.float16)}
    topk = models[torch.float32].config.num_experts_per_tok
    for model in models.values():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.data.mul_(scale)
    stats = {"router_scale": scale, "positions": 0, "max_abs_diff": 0.0, "positions_over_tol": 0, "tokens": 0,
             "routed_differently": 0, "min_router_margin": float("inf"), "max_router_prob_change": 0.0}
    margins = []
    with torch.no_grad():
        for ids in prompts(seed):
            lp32, r32 = _run(models[torch.float32], ids)
            lp16, r16 = _run(models[torch.float16], ids)
            top = lp32.topk(TOP, dim=-1).indices
            diff = (lp32.gather(-1, top) - lp16.gather(-1, top)).abs().amax(-1)
            stats["positions"] += diff.numel()
            stats["max_abs_diff"] = max(stats["max_abs_diff"], float(diff.max()))
            stats["positions_over_tol"] += int((diff > TOL).sum())
            changed = torch.zeros(len(ids), dtype=torch.bool)
            token_margin = torch.full((len(ids),), float("inf"))
            for a, b in zip(r32, r16, strict=True):
                sa, sb = a.topk(topk, -1).indices.sort(-1).values, b.topk(topk, -1).indices.sort(-1).values
                changed |= (sa != sb).any(-1)
                pa, pb = a.softmax(-1), b.softmax(-1)
                stats["max_router_prob_change"] = max(stats["max_router_prob_change"], float((pa - pb).abs().max()))
                token_margin = torch.minimum(token_margin, _topk_margin(a, topk))
            margins.append(token_margin)
            stats["min_router_margin"] = min(stats["min_router_margin"], float(token_margin.min()))
            stats["tokens"] += len(ids)
            stats["routed_differently"] += int(changed.sum())
    stats["share_routed_differently"] = stats["routed_differently"] / stats["tokens"]
    # tokens whose top-k margin (router probability, smallest over layers) is within 10x the largest change fp16
    # made to any router probability: where a routing flip between two fp16 implementations is plausible
    stats["tokens_within_10x_change"] = int((torch.cat(margins) < 10 * stats["max_router_prob_change"]).sum())
    return stats


def prefix_margins(twin: Path, seed: int, decode: int) -> list[tuple[int, torch.Tensor]]:
    """Per prompt (extended by `decode` greedy tokens of the fp32 twin, as a server at temperature 0 would), its
    length and the smallest top-k router margin (probability of the k-th minus the (k+1)-th expert) over all layers
    and all positions up to each position: logprobs can only move through a routing flip at or before them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    topk = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for ids in prompts(seed):
            seq = list(ids)
            for _ in range(decode):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            _, routers = _run(model, seq)
            margin = torch.full((len(seq),), float("inf"))
            for r in routers:
                margin = torch.minimum(margin, _topk_margin(r, topk))
            out.append((len(ids), torch.cummin(margin, 0).values))
    return out


def report_at(twin: Path, seed: int, spec: str, decode: int = 8) -> list[dict]:
    """Where the named failures of a parity run sit among all positions' prefix margins. Items are PROMPT:POS
    (prefill: the logprobs at POS come from position POS - 1) or PROMPT:dPOS (decode: the distribution of
    generated token POS, computed at prompt length - 1 + POS)."""
    series = prefix_margins(twin, seed, decode)
    everything = torch.cat([m for _, m in series])
    rows = []
    for item in spec.split(","):
        prompt, pos = item.split(":")
        n, margins = series[int(prompt)]
        at = n - 1 + int(pos[1:]) if pos.startswith("d") else int(pos) - 1
        m = float(margins[at])
        rows.append({"prompt": int(prompt), "position": pos, "prefix_margin": f"{m:.3g}",
                     "share_of_positions_at_or_below": f"{float((everything <= m).float().mean()):.4f}",
                     "positions": everything.numel()})
        print("ROW", rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("twin", type=Path)
    ap.add_argument("--router-scale", default="1")
    ap.add_argument("--name", default=None)
    ap.add_argument("--seed", type=int, default=None, help="serve_parity's prompt seed (default: len(name))")
    ap.add_argument("--at", default=None, help="PROMPT:POS or PROMPT:dPOS,...: margins where parity failed")
    args = ap.parse_args()
    name = args.name or args.twin.name
    seed = len(name) if args.seed is None else args.seed
    if args.at:
        rows = report_at(args.twin, seed, args.at)
        head = {"command": " ".join(["python"] + sys.argv), "gpu": "cpu", "torch": torch.__version__,
                "triton": "-", "model": name, "prompt_seed": seed}
        write_results(f"routing-margins-{name}", head, rows, list(rows[0]))
        return 0
    rows = [compare(args.twin, float(s), seed) for s in args.router_scale.split(",")]
    for r in rows:
        print("ROW", r, flush=True)
        for key in ("max_abs_diff", "share_routed_differently", "min_router_margin", "max_router_prob_change"):
            r[key] = f"{r[key]:.3g}"  # small values: the table's fixed two decimals would show 0.00
    head = {"command": " ".join(["python"] + sys.argv), "gpu": "cpu", "torch": torch.__version__,
            "triton": "-", "model": name, "prompt_seed": seed, "tolerance_nats": TOL}
    write_results(f"routing-sensitivity-{name}", head, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
