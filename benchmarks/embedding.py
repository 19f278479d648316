"""Int8 / int6 embedding tables served (`SGLANG_EXL3_EMBED_ONLINE_BITS`): a Llama-3-8B-shaped EXL3 model (random
trellis, 128,256 x 4,096 table) served by SGLang with CUDA graphs, with the table in BF16, int8 and int6.

Per table: the memory the encoding freed (the method's startup log), the weights' memory and the KV-cache tokens the
server sized (same --mem-fraction-static), and on the same prompts the log-probability of every prompt token and
the greedy continuation. Against the BF16 table: the mean |Δ logprob| and Δ NLL per token (a random-weight model's
sensitivity, not a quality figure: the real-model KL is experiments/embedding_quality.py's, copied into `delta_kl`
when its results exist). Against a twin, the same checkpoint whose BF16 table holds the decoded int8 / int6 values
(served with the knob unset): the served lookup must reproduce the codec, so the two servers' log-probabilities must
be identical (`twin_max_abs_dlogprob`).

  python benchmarks/embedding.py [--workdir /tmp/embed] [--variants bf16,int8,twin8,int6,twin6]

Each variant's log-probabilities are kept in the workdir, so the variants may run in several calls (rows are
added to benchmarks/results/embedding-<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, gpu_slug, gpu_workdir, header, kv_tokens, write_results  # noqa: E402
from sglang_exl3.integration.server import launch, post, stop, wait_ready  # noqa: E402

PROMPTS, PROMPT_LEN, NEW_TOKENS = 32, 96, 16
TABLE = "model.embed_tokens.weight"
COLUMNS = ["table", "bits", "delta_kl", "mem_saved_gib", "kv_tokens", "kv_tokens_gained", "weights_gb",
           "mean_abs_dlogprob", "delta_nll", "greedy_same", "twin_max_abs_dlogprob", "ready_s"]


def prompts() -> list[list[int]]:
    return [[(i * 7919 + j * 104729) % 128000 + 100 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]


def serve(path: Path, label: str, env: dict, work: Path, port: int) -> dict:
    """Start a server, take the prompts' logprobs and greedy continuations, read the log, stop it."""
    log = work / f"embedding-server-{label}.log"
    t0 = time.time()
    args = ["--quantization", "exl3", "--mem-fraction-static", "0.85", "--cuda-graph-max-bs-decode", "32"]
    proc = launch(path, port, args, env=env, log_path=log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=900)
        ready = time.time() - t0
        out = post(f"http://127.0.0.1:{port}/generate", {
            "input_ids": prompts(), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    freed = re.search(r"EXL3 embedding .*?\(([0-9.]+) MiB freed on this rank\)", text)
    weights = re.search(r"Load weight end\..*?mem usage=([0-9.]+) GB", text)
    result = {
        "input": [[lp[0] for lp in o["meta_info"]["input_token_logprobs"][1:]] for o in out],
        "output_ids": [[lp[1] for lp in o["meta_info"]["output_token_logprobs"]] for o in out],
        "output": [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in out],
        "kv_tokens": kv_tokens(log), "freed_mib": float(freed.group(1)) if freed else 0.0,
        "weights_gb": float(weights.group(1)) if weights else None, "ready_s": ready}
    (work / f"embedding-{label}.json").write_text(json.dumps(result))
    return result


def write_twin(src: Path, dst: Path, bits: int) -> None:
    """`src` with its BF16 table replaced by the table encoded and decoded at `bits` (in the model's dtype, as the
    served lookup decodes it); every other file linked."""
    import torch
    from safetensors.torch import load_file, save_file

    from sglang_exl3.codec import embedding as codec

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors" and TABLE in load_file(str(f), device="cpu").keys():
            tensors = load_file(str(f))
            table = tensors[TABLE].to(dtype)  # on the CPU: CUDA memory held here would shrink the next server's KV
            codes, scales = codec.encode(table, bits)
            tensors[TABLE] = codec.decode(codes, scales, bits, dtype).to(tensors[TABLE].dtype).cpu()
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        elif not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())


def flat(rows: list[list[float]]) -> list[float]:
    return [v for r in rows for v in r]


def compare(a: dict, b: dict) -> dict:
    """Mean |Δ logprob| and Δ NLL over every prompt token, greedy agreement, max |Δ| over prompt and output."""
    x, y = flat(a["input"]), flat(b["input"])
    same = sum(p == q for p, q in zip(a["output_ids"], b["output_ids"], strict=True))
    both = [(p, q) for p, q in zip(x + flat(a["output"]), y + flat(b["output"]), strict=True)]
    return {"mean_abs_dlogprob": sum(abs(p - q) for p, q in zip(x, y, strict=True)) / len(x),
            "delta_nll": (sum(x) - sum(y)) / len(x), "greedy_same": f"{same}/{len(a['output_ids'])}",
            "max_abs": max(abs(p - q) for p, q in both) if same == len(a["output_ids"]) else None}


def real_model_kl() -> dict[int, float]:
    for name in ("embedding-quality-cpu.json", "embedding-quality-gpu.json"):
        path = RESULTS / name
        if path.exists():
            return {r["bits"]: r["kl_mean"] for r in json.loads(path.read_text())["rows"]}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/embed")
    ap.add_argument("--variants", default="bf16,int8,twin8,int6,twin6")
    args = ap.parse_args()
    work = gpu_workdir("benchmarks/embedding.py", args.workdir)
    if work is None:
        return 2
    ckpt = work / "llama3-8b-exl3-4bpw"
    if not ckpt.exists():
        subprocess.run([sys.executable, "-m", "sglang_exl3", "write-fixture", str(ckpt), "--arch", "llama", "--shape",
                        "llama3-8b", "--bits", "4", "--codebook", "mul1", "--seed", "4"], check=True)
    head = header(sys.argv)
    head.update(shape="llama3-8b (random trellis, 4 bpw)", prompts=PROMPTS, prompt_len=PROMPT_LEN,
                new_tokens=NEW_TOKENS, delta_kl_source="benchmarks/results/embedding-quality-*.json (real model)")
    existing = RESULTS / f"embedding-{gpu_slug(head['gpu'])}.json"
    rows = [r for r in json.loads(existing.read_text())["rows"]] if existing.exists() else []
    kl = real_model_kl()

    def loaded(label: str) -> dict | None:
        path = work / f"embedding-{label}.json"
        return json.loads(path.read_text()) if path.exists() else None

    for i, variant in enumerate(args.variants.split(",")):
        bits = int(variant[-1]) if variant != "bf16" else 16
        env = {"SGLANG_EXL3_EMBED_ONLINE_BITS": str(bits)} if variant.startswith("int") else {}
        path = ckpt
        if variant.startswith("twin"):
            path = work / f"llama3-8b-exl3-4bpw-twin{bits}"
            if not path.exists():
                write_twin(ckpt, path, bits)
        got = serve(path, variant, env, work, 33000 + i)
        base = loaded("bf16")
        row = {"table": variant, "bits": bits, "kv_tokens": got["kv_tokens"], "weights_gb": got["weights_gb"],
               "mem_saved_gib": got["freed_mib"] / 1024, "ready_s": got["ready_s"]}
        if variant.startswith("twin"):
            served = loaded(f"int{bits}")
            if served is not None:
                row["twin_max_abs_dlogprob"] = compare(served, got)["max_abs"]
        elif base is not None and variant != "bf16":
            diff = compare(base, got)
            row.update(mean_abs_dlogprob=diff["mean_abs_dlogprob"], delta_nll=diff["delta_nll"],
                       greedy_same=diff["greedy_same"], delta_kl=kl.get(bits))
            if base["kv_tokens"] and got["kv_tokens"]:
                row["kv_tokens_gained"] = got["kv_tokens"] - base["kv_tokens"]
        rows = [r for r in rows if r["table"] != variant] + [row]
        print("ROW " + json.dumps(row), flush=True)
        write_results("embedding", head, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
