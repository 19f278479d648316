"""Online EXL3 encoding on the GPU: encoder speed, and what uncalibrated encoding costs in quality against exllamav3's
calibrated conversion of the same model.

  1. tiles/s of the torch encoder and of the CUDA kernel (`exl3_quantize_tiles`), K = 2..5, on Gaussian tiles;
  2. one Llama-3-8B-shaped decoder layer (q, k, v, o, gate, up, down; random BF16 weights) encoded with the kernel:
     seconds per layer, and the 32-layer model estimated from it;
  3. a trained model (--bf16: the `spec-train` target) encoded with `python -m sglang_exl3 encode --device cuda`
     (encode_s), then the online and the offline EXL3 model (--offline: exllamav3's calibrated conversion of the same
     BF16 model, `spec-convert`) dequantized bit-exactly and run with transformers on held-out text windows (--texts,
     the spec corpus): perplexity of each, and the KL divergence of each to the BF16 model, per token.
Writes benchmarks/results/encode-<gpu>.{json,md}.

  python benchmarks/encode.py --bf16 /tmp/specmodels/target --offline /tmp/specmodels/target-exl3 \
      --texts /tmp/spectexts [--bits 4] [--workdir /tmp/encode]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import gpu_workdir, header, write_results  # noqa: E402

COLUMNS = ["kind", "model", "bits", "params", "encoder", "tiles_per_s", "encode_s", "kld_online", "kld_offline",
           "ppl_online", "ppl_offline", "ppl_bf16"]
LLAMA3_8B_LAYER = (("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096), ("o_proj", 4096, 4096),
                   ("gate_proj", 14336, 4096), ("up_proj", 14336, 4096), ("down_proj", 4096, 14336))  # (name, out, in)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def tile_rates(tiles: int = 4096) -> list[dict]:
    from sglang_exl3.codec.codebook import Codebook, codebook_table
    from sglang_exl3.codec.encode import encode_tiles
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    x = torch.randn(tiles, 256, device="cuda") * codebook_table(Codebook.MCG, "cuda").float().std()
    rows = []
    for k in (2, 3, 4, 5):
        for name, fn, n in (("cuda kernel", encode_tiles_cuda, tiles), ("torch", encode_tiles, tiles // 8)):
            fn(x[:16], k)
            seconds = _timed(lambda f=fn, m=n, b=k: f(x[:m], b))
            rows.append({"kind": "tiles", "encoder": name, "bits": k, "tiles_per_s": round(n / seconds)})
            print("ROW " + json.dumps(rows[-1]), flush=True)
    return rows


def llama3_8b_layer(bits: int) -> dict:
    from sglang_exl3.codec.encode import encode_weight
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n_in, n_out, generator=gen, device="cuda") * 0.02 for _, n_out, n_in in LLAMA3_8B_LAYER]
    seconds = _timed(lambda: [encode_weight(w, bits, encoder=encode_tiles_cuda) for w in weights])
    params = sum(w.numel() for w in weights)
    return {"kind": "llama3-8b layer", "model": "Llama-3-8B shape, one decoder layer (x 32 for the model)",
            "bits": bits, "params": params, "encoder": "cuda kernel", "encode_s": round(seconds, 1),
            "encode_s_model_estimate": round(32 * seconds, 1)}


@torch.no_grad()
def token_logprobs(model_dir: Path, x: torch.Tensor) -> torch.Tensor:
    """log-softmax [B, T, V] of a Hugging Face model on windows x [B, T+1] (inputs x[:, :-1]), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(x.device).eval()
    out = torch.cat([F.log_softmax(model(input_ids=x[i:i + 1, :-1]).logits.float(), -1) for i in range(len(x))])
    del model
    return out


def quality(reference: torch.Tensor, test: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || test) per token, perplexity of test on x's next tokens), from log-probabilities."""
    kl = (reference.exp() * (reference - test)).sum(-1).mean()
    nll = -test.gather(-1, x[:, 1:].unsqueeze(-1)).mean()
    return float(kl), float(nll.exp())


def model_row(args, work: Path) -> dict:
    from tokenizers import Tokenizer

    from benchmarks.spec_models import split_corpus, windows
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda
    from sglang_exl3.tools.dequantize import dequantize_checkpoint
    from sglang_exl3.tools.encode_checkpoint import encode_checkpoint

    online = work / "online-exl3"
    shutil.rmtree(online, ignore_errors=True)
    t0 = time.perf_counter()
    summary = encode_checkpoint(args.bf16, online, args.bits, "mcg", head_bits=None, device="cuda", progress=False,
                                encoder=encode_tiles_cuda)
    encode_s = time.perf_counter() - t0
    twins = {}
    for name, src in (("online", online), ("offline", Path(args.offline))):
        twins[name] = work / f"{name}-bf16"
        shutil.rmtree(twins[name], ignore_errors=True)
        dequantize_checkpoint(src, twins[name], dtype="bfloat16", device="cuda", progress=False)
    tok = Tokenizer.from_file(str(Path(args.bf16) / "tokenizer.json"))
    _, held_plays, held_code, _ = split_corpus(Path(args.texts))
    x = windows(held_plays + held_code, tok, count=args.windows).cuda()
    ref = token_logprobs(Path(args.bf16), x)
    row = {"kind": "model", "model": Path(args.bf16).name, "bits": args.bits, "encoder": "cuda kernel",
           "params": _params(Path(args.bf16)), "encode_s": round(encode_s, 1), "encoded_linears": summary["encoded"],
           "tokens": int(x[:, 1:].numel())}
    row["ppl_bf16"] = quality(ref, ref, x)[1]
    for name, path in twins.items():
        row[f"kld_{name}"], row[f"ppl_{name}"] = quality(ref, token_logprobs(path, x), x)
    return row


def _params(model_dir: Path) -> int:
    from sglang_exl3.format.safetensors_index import scan_tensors

    total = 0
    for info in scan_tensors(model_dir).values():
        n = 1
        for d in info.shape:
            n *= d
        total += n
    return total


OPTIONS = (
    ("--bf16", {"help": "the BF16 model (the spec-train target)"}),
    ("--offline", {"help": "exllamav3's calibrated conversion of the same model"}),
    ("--texts", {"help": "the spec corpus (held-out plays and modules)"}),
    ("--bits", {"type": int, "default": 4}),
    ("--windows", {"type": int, "default": 16, "help": "held-out windows of the spec recipe's length"}),
    ("--skip-rates", {"action": "store_true"}),
    ("--workdir", {"default": "/tmp/encode"}),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, spec in OPTIONS:
        parser.add_argument(flag, **spec)
    args = parser.parse_args()
    work = gpu_workdir("benchmarks/encode.py", args.workdir)
    if work is None:
        return 2
    rows = [] if args.skip_rates else tile_rates()
    rows.append(llama3_8b_layer(args.bits))
    print("ROW " + json.dumps(rows[-1]), flush=True)
    head = header(sys.argv)
    write_results("encode", head, rows, COLUMNS)
    if args.bf16 and args.offline and args.texts:
        rows.append(model_row(args, work))
        print("ROW " + json.dumps(rows[-1]), flush=True)
        write_results("encode", head, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
