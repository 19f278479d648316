"""End-to-end serving speed: a Llama-3-8B-shaped EXL3 checkpoint (random trellis, written on the GPU
machine by the fixture writer, 2/3/4 bits) against the same weights dequantized to bf16, both served
by SGLang with CUDA graphs. Decode tokens/s at batch 1, 8, 64; prefill tokens/s on 2048-token
prompts; time to ready; GPU memory after load; the KV-cache tokens each server sized at the same
--mem-fraction-static (the memory EXL3 saves becomes cache). Writes benchmarks/results/e2e-<gpu>.{json,md,png},
again after every row, so a run cut short keeps what it measured.

  python benchmarks/e2e.py [--bits 2,3,4] [--backend cuda|torch|exllamav3|triton] [--workdir /tmp/e2e]
                           [--variant SGLANG_EXL3_DEV_FUSED_MAX_M=32 ...]  (the first EXL3 model again, with that env)
  python benchmarks/e2e.py --replot benchmarks/results/e2e-h200.json   (the plot again, from a run's JSON; no GPU)
  python benchmarks/e2e.py --profile-steps 16 ...   (also: where a decode step's GPU time goes, per kernel category,
                                                     at --profile-batches, 1 and 64 by default, for every served model:
                                                     e2e-profile-<gpu>.{json,md}; the top kernels per step,
                                                     with launches and time per launch: e2e-profile-kernels-<gpu>)
  python benchmarks/e2e.py --serving-concurrency 1,16,64 ...   (also: SGLang's own load generator against each
                                                     server, random-ids 512 in / 128 out: output tok/s and mean ITL)
  python benchmarks/e2e.py --twin-only ...   (only the bf16 twin: with --skip-bf16 in an earlier call on the same
                                                     machine, the two servers of a run too long for one call)
  python benchmarks/e2e.py --merge A.json B.json   (one table, plot and profiles from such calls' JSON; no GPU)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gpu_workdir, graph_use, header, kv_tokens, pyplot, write_results  # noqa: E402
from benchmarks.serving_client import serving_throughput  # noqa: E402
from benchmarks.step_profile import profile_decode  # noqa: E402
from sglang_exl3.integration.server import launch, post, stop, wait_ready  # noqa: E402
from sglang_exl3.synth.exl3_writer import SHAPES  # noqa: E402

DECODE_BATCHES = (1, 8, 64)
DECODE_TOKENS = 128
PREFILL_LEN = 2048
PREFILL_BATCH = 8


def _weights_mem_gb(log: Path) -> float | None:
    m = re.search(r"Load weight end\..*?mem usage=([0-9.]+) GB", log.read_text(errors="replace"))
    return float(m.group(1)) if m else None


DECODE_REPEATS = 3


def prompt_ids(rows: int, length: int, a: int, b: int, vocab: int) -> list[list[int]]:
    """`rows` deterministic prompts of `length` token ids in [100, vocab) (random-weight models: any ids do)."""
    span = min(120000, vocab - 100)
    return [[(i * a + j * b) % span + 100 for j in range(length)] for i in range(rows)]


def measure(base: str, vocab: int) -> dict:
    """Decode tok/s per batch size: the batch's prompts sent as one request (one prefill, then `bs` rows decoding
    together; threads per prompt let the scheduler start some before the rest arrive, which put extra prefill steps
    into the decode and moved batch 8 by ~15% between two servers of the same model), the median of
    DECODE_REPEATS runs; then prefill tok/s."""
    out = {}
    ids = prompt_ids(max(DECODE_BATCHES), 32, 37, 11, vocab)
    post(base + "/generate", {"input_ids": ids[:8], "sampling_params": {"max_new_tokens": 8}})  # warm-up
    params = {"max_new_tokens": DECODE_TOKENS, "temperature": 0, "ignore_eos": True}
    for bs in DECODE_BATCHES:
        runs = []
        for _ in range(DECODE_REPEATS):
            t0 = time.time()
            post(base + "/generate", {"input_ids": ids[:bs], "sampling_params": params})
            runs.append(bs * DECODE_TOKENS / (time.time() - t0))
        out[f"decode_bs{bs}_tok_s"] = statistics.median(runs)
    prompts = prompt_ids(PREFILL_BATCH, PREFILL_LEN, 101, 7, vocab)
    t0 = time.time()
    post(base + "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1}})
    out["prefill_tok_s"] = PREFILL_BATCH * PREFILL_LEN / (time.time() - t0)
    return out


PROFILE_BATCHES = (1, 64)


def variant_settings(variant: str) -> tuple[dict[str, str], list[str]]:
    """A --variant's environment and server flags: VAR=VALUE items set the environment, --flag=VALUE items are
    passed to the server (e.g. --max-total-tokens=424000 to give it the twin's KV pool)."""
    env, flags = {}, []
    for item in variant.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--variant items are VAR=VALUE or --flag=VALUE, got {item!r}")
        if key.startswith("--"):
            flags += [key, value]
        else:
            env[key] = value
    return env, flags


def serve_and_measure(path: Path, label: str, extra: list[str], env: dict, out: Path, port: int,
                      profile_steps: int = 0, serving: tuple[int, ...] = (),
                      profile_batches: tuple[int, ...] = PROFILE_BATCHES) -> dict:
    """One server: its e2e row, with profile_steps its per-step kernel breakdown at profile_batches (in
    row["profile"], {batch: {category: us per step}}; its top kernels in row["profile_kernels"], {batch: [...]}), and
    per `serving` concurrency SGLang's load generator's output tok/s and mean inter-token latency."""
    log = out / f"e2e-server-{label}.log"
    t0 = time.time()
    proc = launch(path, port, ["--mem-fraction-static", "0.85", "--cuda-graph-max-bs-decode", "64", *extra],
                  env=env, log_path=log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, timeout=1200)
        row = {"model": label, "ready_s": time.time() - t0}
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        row.update(measure(base, vocab))
        row["weights_gb"] = _weights_mem_gb(log)
        row["kv_tokens"] = kv_tokens(log)
        row.update(graph_use(log))
        for c in serving:
            result = serving_throughput(path, port, c, out)
            row[f"serving_c{c}_out_tok_s"], row[f"serving_c{c}_itl_ms"] = result["output_tok_s"], result["mean_itl_ms"]
        if profile_steps:
            ids = prompt_ids(max(profile_batches), 32, 53, 13, vocab)
            profiles = {bs: profile_decode(base, out / f"profile-{port}-bs{bs}", bs, profile_steps, ids)
                        for bs in profile_batches}
            row["profile"] = {bs: cats for bs, (cats, _) in profiles.items()}
            row["profile_kernels"] = {bs: kernels for bs, (_, kernels) in profiles.items()}
        return row
    finally:
        stop(proc)


def profile_rows(rows: list[dict]) -> list[dict]:
    """Long-form rows (model, batch, category, us per step) of the served rows that carry a profile."""
    out = []
    for row in rows:
        for bs, cats in row.get("profile", {}).items():
            out += [{"model": row["model"], "batch": bs, "category": c, "us_per_step": round(us, 2)}
                    for c, us in cats.items()]
    return out


def kernel_rows(rows: list[dict]) -> list[dict]:
    """Long-form rows (model, batch, kernel, ...) of each profile's top kernels."""
    return [{"model": row["model"], "batch": bs, **{k: round(v, 2) if isinstance(v, float) else v
                                                     for k, v in kernel.items()}}
            for row in rows for bs, kernels in row.get("profile_kernels", {}).items() for kernel in kernels]


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Decode tokens/s per batch size, one bar per model (the EXL3 rows and their bf16 twin side by side)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        xs = [j + i * width for j in range(len(DECODE_BATCHES))]
        ax.bar(xs, [row.get(f"decode_bs{b}_tok_s") or 0 for b in DECODE_BATCHES], width, label=row["model"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(DECODE_BATCHES))], [f"batch {b}" for b in DECODE_BATCHES])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (higher is better)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--workdir", default="/tmp/e2e")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--twin-only", action="store_true", help="serve only the bf16 twin (of the first --bits)")
    ap.add_argument("--merge", type=Path, nargs="+", help="join these runs' JSON (one shape, one GPU) and exit")
    ap.add_argument("--twin", choices=["dequantized", "weightless"], default="dequantized",
                    help="the bf16 twin: the EXL3 weights dequantized, or the same config served with SGLang's "
                         "--load-format dummy (speed only; for shapes whose bf16 weights do not fit the disk)")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES),
                    help="qwen3-30b-a3b: the MoE shape (15 GB at 4 bpw; its bf16 twin, 61 GB, needs --workdir on a "
                         "disk that holds it)")
    ap.add_argument("--replot", type=Path, help="redraw the plot beside this results JSON and exit")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also profile this many decode steps per model at --profile-batches (e2e-profile-<gpu>)")
    ap.add_argument("--profile-batches", default=",".join(map(str, PROFILE_BATCHES)), metavar="B[,B]",
                    help="the decode batch sizes --profile-steps profiles")
    ap.add_argument("--serving-concurrency", default="", metavar="C[,C]",
                    help="also run python -m sglang.benchmark.serving (random-ids) at these concurrencies per server")
    ap.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                    help="serve the first EXL3 model again with these SGLANG_EXL3_* settings, or server flags as "
                         "--flag=VALUE (repeatable; pass as --variant=...): an A/B in the same run")
    args = ap.parse_args()
    if args.replot:
        data = json.loads(args.replot.read_text())
        plot(data["rows"], args.replot.with_suffix(".png"), _title(data["header"]))
        return 0
    if args.merge:
        return merge(args.merge)
    if args.twin_only and args.skip_bf16:
        ap.error("--twin-only serves only the bf16 twin, which --skip-bf16 skips")
    work = gpu_workdir("benchmarks/e2e.py", args.workdir)
    if work is None:
        return 2
    head = header(sys.argv)
    head.update(backend=args.backend, decode_tokens=DECODE_TOKENS, prefill_len=PREFILL_LEN,
                prefill_batch=PREFILL_BATCH, shape=f"{args.shape} (random trellis)")
    arch = SHAPES[args.shape][0]
    codebook = "mcg" if arch == "qwen3_moe" else "mul1"
    rows, py = [], sys.executable
    serving = tuple(int(c) for c in args.serving_concurrency.split(",") if c)
    measured = {"profile_steps": args.profile_steps, "serving": serving,
                "profile_batches": tuple(int(b) for b in args.profile_batches.split(",") if b)}
    head.update(serving_concurrency=list(serving), serving_lengths="random-ids, 512 in / 128 out")
    name = results_name(args.shape)
    head["profile_steps"] = args.profile_steps

    def add(row: dict) -> None:
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
        write_all(name, head, rows)

    for i, bits in enumerate(int(b) for b in args.bits.split(",")):
        ckpt = work / f"{args.shape}-exl3-{bits}bpw"
        if not ckpt.exists():
            subprocess.run([py, "-m", "sglang_exl3", "write-fixture", str(ckpt), "--arch", arch, "--shape", args.shape,
                            "--bits", str(bits), "--codebook", codebook, "--seed", str(bits)], check=True)
        exl3_env = {"SGLANG_EXL3_BACKEND": args.backend}
        if not args.twin_only:
            add(serve_and_measure(ckpt, f"exl3-{bits}bpw", ["--quantization", "exl3"], exl3_env, work, 32000 + i,
                                  **measured))
        for j, variant in enumerate(args.variant if i == 0 and not args.twin_only else []):
            env, flags = variant_settings(variant)
            add(serve_and_measure(ckpt, f"exl3-{bits}bpw ({variant})", ["--quantization", "exl3", *flags],
                                  {**exl3_env, **env}, work, 32200 + j, **measured))
        if i == 0 and not args.skip_bf16 and args.twin == "dequantized":
            dense = work / f"{args.shape}-bf16"
            if not dense.exists():
                subprocess.run([py, "-m", "sglang_exl3", "dequantize", str(ckpt), str(dense), "--dtype",
                                "bfloat16", "--device", "cuda", "--quiet"], check=True)
            add(serve_and_measure(dense, f"bf16 (the {bits} bpw weights dequantized)", ["--dtype", "bfloat16"], {},
                                  work, 32100, **measured))
        elif i == 0 and not args.skip_bf16:  # the same config with random bf16 weights: speed only
            from sglang_exl3.tools.dequantize import write_weightless_twin

            dense = work / f"{args.shape}-bf16-weightless"
            if not dense.exists():
                write_weightless_twin(ckpt, dense)
            add(serve_and_measure(dense, "bf16 (same config, random weights)", ["--dtype", "bfloat16",
                                  "--load-format", "dummy"], {}, work, 32100, **measured))
    return 0


def results_name(shape: str) -> str:
    return "e2e" if shape == "llama3-8b" else f"e2e-{shape}"


def write_all(name: str, head: dict, rows: list[dict]) -> None:
    """The table and plot of these rows, and their step profiles where they have them (rewritten after every row)."""
    serving = [c for c in dict.fromkeys(k for r in rows for k in r) if c.startswith("serving_c")]
    cols = ["model", "ready_s", "weights_gb", "kv_tokens", *[f"decode_bs{b}_tok_s" for b in DECODE_BATCHES],
            "prefill_tok_s", *serving]
    path = write_results(name, head, rows, cols)
    plot(rows, path.with_suffix(".png"), _title(head))
    if any(r.get("profile") for r in rows):
        write_results(f"{name}-profile", head, profile_rows(rows), ["model", "batch", "category", "us_per_step"])
        write_results(f"{name}-profile-kernels", head, kernel_rows(rows),
                      ["model", "batch", "kernel", "category", "us_per_step", "launches_per_step", "us_per_launch"])


def merge(paths: list[Path]) -> int:
    """One table, plot and profiles from several calls' JSON: the same shape on the same GPU, rows in order."""
    runs = [json.loads(p.read_text()) for p in paths]
    shapes = {r["header"]["shape"] for r in runs} | {r["header"]["gpu"] for r in runs}
    if len(shapes) != 2:
        raise SystemExit(f"--merge takes runs of one shape on one GPU, got {sorted(shapes)}")
    head = dict(runs[0]["header"], command=" ; ".join(r["header"]["command"] for r in runs))
    write_all(results_name(head["shape"].split(" ")[0]), head, [row for r in runs for row in r["rows"]])
    return 0


def _title(head: dict) -> str:
    return f"{head.get('shape', '')} served by SGLang on the {head['gpu'].replace('NVIDIA ', '')}"


if __name__ == "__main__":
    sys.exit(main())
