"""Online EXL3 encoding on the GPU: encoder speed, and what uncalibrated encoding costs in quality against exllamav3's
calibrated conversion of the same model.

  1. tiles/s of the torch encoder and of the CUDA kernel (`exl3_quantize_tiles`), K = 2..5, on Gaussian tiles;
  2. one Llama-3-8B-shaped decoder layer (q, k, v, o, gate, up, down; random BF16 weights) encoded with the kernel:
     seconds per layer, and the 32-layer model estimated from it;
  3. a trained model (--bf16: the `spec-train` target) encoded with `python -m sglang_exl3 encode --device cuda`
     (encode_s), then the online and the offline EXL3 model (--offline: exllamav3's calibrated conversion of the same
     BF16 model, `spec-convert`) dequantized bit-exactly and run with transformers on held-out text windows (--texts,
     the spec corpus): perplexity of each, and the KL divergence of each to the BF16 model, per token;
  4. (--vs-exllamav3) our kernel against exllamav3's own `quantize_tiles` on the same tiles, K = 2..5: identical
     tiles and states, each side's squared error, each side's tiles/s;
  5. (--serve) the same BF16 model served by SGLang with CUDA graphs: as BF16; as the `encode` output from disk (a
     normal EXL3 load); encoded at load (SGLANG_EXL3_ONLINE_BITS) into an empty cache, then again from the warm cache;
     and with the FP8 overlay (SGLANG_EXL3_ONLINE_FP8). Per server: seconds to ready, the CUDA graphs captured, greedy
     tokens and logprobs on held-out prompts against the BF16 server and against the from-disk EXL3 server (online
     encoding must serve exactly the model `encode` writes), and decode tok/s at batch 1.
Writes benchmarks/results/encode-<gpu>.{json,md}; a run keeps the rows of the kinds it does not measure.

  python benchmarks/encode.py --bf16 /tmp/specmodels/target --offline /tmp/specmodels/target-exl3 \
      --texts /tmp/spectexts [--bits 4] [--workdir /tmp/encode] [--skip-rates] [--skip-quality] [--serve]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, gpu_slug, gpu_workdir, graph_use, header, write_results  # noqa: E402

COLUMNS = ["kind", "model", "bits", "params", "encoder", "tiles_per_s", "encode_s", "kld_online", "kld_offline",
           "ppl_online", "ppl_offline", "ppl_bf16", "same_tiles", "mse_ours", "mse_exllamav3", "tiles_per_s_exllamav3",
           "variant", "load_s", "graphs", "same_as_disk", "same_as_bf16", "tok_s_bs1"]
LLAMA3_8B_LAYER = (("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096), ("o_proj", 4096, 4096),
                   ("gate_proj", 14336, 4096), ("up_proj", 14336, 4096), ("down_proj", 4096, 14336))  # (name, out, in)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def tile_rates(tiles: int = 16384) -> list[dict]:
    from sglang_exl3.codec.codebook import Codebook, codebook_table
    from sglang_exl3.codec.encode import encode_tiles
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    x = torch.randn(tiles, 256, device="cuda") * codebook_table(Codebook.MCG, "cuda").float().std()
    rows = []
    for k in (2, 3, 4, 5):
        plain = partial(encode_tiles_cuda, kernel="plain")
        for name, fn, n in (("cuda kernel", encode_tiles_cuda, tiles), ("cuda kernel (plain)", plain, tiles // 4),
                            ("torch", encode_tiles, tiles // 8)):
            fn(x[:16], k)
            seconds = _timed(lambda f=fn, m=n, b=k: f(x[:m], b))
            rows.append({"kind": "tiles", "encoder": name, "bits": k, "tiles_per_s": round(n / seconds)})
            print("ROW " + json.dumps(rows[-1]), flush=True)
    return rows


def exllamav3_agreement(tiles: int = 8192) -> list[dict]:
    """Our encoder against exllamav3's own `quantize_tiles` (MCG) on the same Gaussian tiles, per K: how many tiles
    and states are identical, each side's mean squared error to the input, and exllamav3's tiles/s beside ours."""
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_tiles

    from sglang_exl3.codec.codebook import Codebook, codebook_table
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda

    table = codebook_table(Codebook.MCG, "cuda").float()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tiles, 256, device="cuda", generator=gen) * table.std()
    rows = []
    for k in (2, 3, 4, 5):
        args = {"K": k, "mcg": True}
        quantize_tiles(x[:64], args)
        encode_tiles_cuda(x[:64], k)
        theirs_s = _timed(lambda a=args: quantize_tiles(x, a))
        ours_s = _timed(lambda b=k: encode_tiles_cuda(x, b))
        values, theirs = quantize_tiles(x, args)
        theirs = theirs.int() & 0xFFFF
        ours = encode_tiles_cuda(x, k)
        rows.append({"kind": "vs exllamav3", "encoder": "cuda kernel", "bits": k,
                     "same_tiles": f"{int((ours == theirs).all(-1).sum())}/{tiles}",
                     "same_states": round(float((ours == theirs).float().mean()), 4),
                     "mse_ours": float((table[ours.long()] - x).square().mean()),
                     "mse_exllamav3": float((table[theirs.long()] - x).square().mean()),
                     "exllamav3_values_decode": bool(torch.equal(table[theirs.long()], values.float())),
                     "tiles_per_s": round(tiles / ours_s), "tiles_per_s_exllamav3": round(tiles / theirs_s)})
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


def encode_model(args, work: Path) -> tuple[Path, dict, float]:
    """The --bf16 model through `encode` with the CUDA kernel: (folder, summary, seconds)."""
    from sglang_exl3.kernels.cuda_encode import encode_tiles_cuda
    from sglang_exl3.tools.encode_checkpoint import encode_checkpoint

    online = work / "online-exl3"
    shutil.rmtree(online, ignore_errors=True)
    t0 = time.perf_counter()
    summary = encode_checkpoint(args.bf16, online, args.bits, "mcg", head_bits=None, device="cuda", progress=False,
                                encoder=encode_tiles_cuda)
    return online, summary, time.perf_counter() - t0


def held_out(args, count: int) -> torch.Tensor:
    from tokenizers import Tokenizer

    from benchmarks.spec_models import split_corpus, windows

    tok = Tokenizer.from_file(str(Path(args.bf16) / "tokenizer.json"))
    _, held_plays, held_code, _ = split_corpus(Path(args.texts))
    return windows(held_plays + held_code, tok, count=count).cuda()


def model_row(args, work: Path) -> dict:
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    online, summary, encode_s = encode_model(args, work)
    twins = {}
    for name, src in (("online", online), ("offline", Path(args.offline))):
        twins[name] = work / f"{name}-bf16"
        shutil.rmtree(twins[name], ignore_errors=True)
        dequantize_checkpoint(src, twins[name], dtype="bfloat16", device="cuda", progress=False)
    x = held_out(args, args.windows)
    ref = token_logprobs(Path(args.bf16), x)
    row = {"kind": "model", "model": Path(args.bf16).name, "bits": args.bits, "encoder": "cuda kernel",
           "params": _params(Path(args.bf16)), "encode_s": round(encode_s, 1), "encoded_linears": summary["encoded"],
           "tokens": int(x[:, 1:].numel())}
    row["ppl_bf16"] = quality(ref, ref, x)[1]
    for name, path in twins.items():
        row[f"kld_{name}"], row[f"ppl_{name}"] = quality(ref, token_logprobs(path, x), x)
    return row


SERVE_PROMPTS, SERVE_PROMPT_LEN, SERVE_TOKENS, BS1_TOKENS = 16, 96, 48, 128
ONLINE_KNOBS = ("SGLANG_EXL3_ONLINE_BITS", "SGLANG_EXL3_ONLINE_MODULES", "SGLANG_EXL3_ONLINE_FP8",
                "SGLANG_EXL3_ONLINE_CACHE", "SGLANG_EXL3_ONLINE_CACHE_DIR")


def serve_rows(args, work: Path, on_row) -> list[dict]:
    """Five servers of one model, one after another (see the module docstring, item 5)."""
    import os

    from sglang_exl3.integration.server import free_port, launch, post, stop, wait_ready

    for knob in ONLINE_KNOBS:
        os.environ.pop(knob, None)
    disk = work / "online-exl3"
    if not (disk / "config.json").is_file():
        disk = encode_model(args, work)[0]
    cache = work / "online-cache"
    shutil.rmtree(cache, ignore_errors=True)
    online = {"SGLANG_EXL3_ONLINE_BITS": str(args.bits), "SGLANG_EXL3_ONLINE_CACHE_DIR": str(cache)}
    variants = (("bf16", args.bf16, [], {}), ("exl3 from disk", disk, ["--quantization", "exl3"], {}),
                ("online, cold cache", args.bf16, ["--quantization", "exl3"], online),
                ("online, warm cache", args.bf16, ["--quantization", "exl3"], online),
                ("fp8 overlay", args.bf16, ["--quantization", "exl3"], {"SGLANG_EXL3_ONLINE_FP8": "proj"}))
    ids = held_out(args, SERVE_PROMPTS)[:, :SERVE_PROMPT_LEN].tolist()
    payload = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": SERVE_TOKENS,
                                                                          "temperature": 0, "ignore_eos": True}}
    rows, outputs = [], {}
    for name, path, flags, env in variants:
        if args.variants and not any(v in name for v in args.variants.split(",")) and name != "bf16":
            continue
        port, log = free_port(), work / f"server-{name.split(',')[0].replace(' ', '-')}-{len(rows)}.log"
        t0 = time.perf_counter()
        proc = launch(path, port, [*flags, "--mem-fraction-static", "0.5", "--cuda-graph-max-bs-decode", "32"],
                      env=env, log_path=log)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc)
            load_s = time.perf_counter() - t0
            outputs[name] = post(base + "/generate", payload)
            t1 = time.perf_counter()
            done = post(base + "/generate", {"input_ids": ids[:1], "sampling_params": {
                "max_new_tokens": BS1_TOKENS, "temperature": 0, "ignore_eos": True}})
            tok_s = done[0]["meta_info"]["completion_tokens"] / (time.perf_counter() - t1)
        finally:
            stop(proc)
        text = log.read_text(errors="replace")
        row = {"kind": "serve", "model": Path(args.bf16).name, "bits": args.bits, "variant": name,
               "load_s": round(load_s, 1), "graphs": graph_use(log)["graphs"],
               "tok_s_bs1": round(tok_s, 1), "online_log": re.findall(r"EXL3 online: \d+/\d+ linears.*", text)[-1:]}
        for ref, column in (("bf16", "same_as_bf16"), ("exl3 from disk", "same_as_disk")):
            if ref in outputs and ref != name:
                row.update(_agreement(outputs[ref], outputs[name], column))
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
        on_row(rows)
    return rows


def _agreement(ref: list[dict], got: list[dict], column: str) -> dict:
    """The share of prompts whose greedy tokens equal the reference's, and the largest logprob difference of the
    tokens both chose up to the first difference."""
    from sglang_exl3.integration.spec_checks import output_tokens

    same, gap = 0, 0.0
    for a, b in zip(ref, got, strict=True):
        ta, tb = output_tokens(a), output_tokens(b)
        same += ta == tb
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        gap = max([gap, *(abs(la[i][0] - lb[i][0]) for i in range(n))])
    return {column: f"{same}/{len(ref)}", f"{column}_max_logprob_diff": round(gap, 4)}


def merged(rows: list[dict]) -> list[dict]:
    """This run's rows after the rows of the results file that it did not measure again (by kind, and variant for
    the served rows)."""
    path = RESULTS / f"encode-{gpu_slug(torch.cuda.get_device_name())}.json"
    measured = {(r["kind"], r.get("variant")) for r in rows}
    kinds = {r["kind"] for r in rows if r["kind"] != "serve"}
    kept = json.loads(path.read_text())["rows"] if path.is_file() else []
    return [r for r in kept if r.get("kind") not in kinds and (r.get("kind"), r.get("variant")) not in measured] + rows


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
    ("--skip-rates", {"action": "store_true", "help": "skip the tiles/s and Llama-3-8B layer rows"}),
    ("--skip-quality", {"action": "store_true", "help": "skip the KL / perplexity row"}),
    ("--vs-exllamav3", {"action": "store_true", "help": "our encoder against exllamav3's quantize_tiles"}),
    ("--serve", {"action": "store_true", "help": "serve the model five ways (docstring, item 5)"}),
    ("--variants", {"help": "only the served variants whose names contain one of these comma-separated words "
                            "(bf16 always runs)"}),
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
    head, rows = header(sys.argv), []

    def save(measured: list[dict]) -> None:  # after every part: a run cut short keeps what it measured
        write_results("encode", head, merged(measured), COLUMNS)

    if not args.skip_rates:
        rows += tile_rates()
        rows.append(llama3_8b_layer(args.bits))
        print("ROW " + json.dumps(rows[-1]), flush=True)
        save(rows)
    if args.vs_exllamav3:
        rows += exllamav3_agreement()
        save(rows)
    if args.bf16 and args.offline and args.texts and not args.skip_quality:
        rows.append(model_row(args, work))
        print("ROW " + json.dumps(rows[-1]), flush=True)
        save(rows)
    if args.serve:
        if not (args.bf16 and args.texts):
            parser.error("--serve needs --bf16 and --texts")
        done = list(rows)
        serve_rows(args, work, lambda served: save(done + served))
    return 0


if __name__ == "__main__":
    sys.exit(main())
