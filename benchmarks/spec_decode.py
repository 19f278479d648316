"""Speculative decoding on an EXL3 target against the same target dequantized to bf16, with the same drafts: accept
length and decode tok/s at batch 1, 8 and 32 with and without speculation, lossless greedy output, structured output
under speculation, and SGLang's own SPEED-Bench run per category.

MODELS is what benchmarks/spec_models.py trained, converted on the GPU machine (tests/gpu/h200_steps.sh spec-convert):
target-exl3/ (exllamav3's converter), target-bf16/ (its dequantized twin: `python -m sglang_exl3 dequantize`),
small-exl3/ (the STANDALONE draft), eagle3/ (the head trained for the target), prompts.json, speed-bench.jsonl.

Per variant one server (CUDA graphs and the radix cache on, the same KV pool for all), timed in order, so that a
target's `none` baseline comes before its speculative variants. With --starts N, N servers come up together (each
started once the one before has sized its KV pool), and each is timed only once all of them are ready, the others
idle. Per server:
- greedy: every held-out prompt in the chat template (the form the models were trained on), GREEDY_TOKENS tokens with
  top-2 logprobs; a speculative variant must reproduce its target's baseline (spec_checks.compare);
- batch 1: BATCH1_PROMPTS prompts per category one after another; batch 8 and 32: that many concurrent requests over
  all categories; DECODE_TOKENS tokens each, ignore_eos, greedy. tok/s = completion tokens / wall time (the 192-token
  prompts' prefill included); accept length = completion tokens / verify passes (meta_info.spec_verify_ct);
- structured output (spec_checks.structured) on speculative variants;
- SPEED-Bench: `python -m sglang.benchmark.serving --dataset-name speed-bench` per category at concurrency 1 (its
  accept_length is the server's running average, so the per-category accept lengths above are this script's own).

Every row also carries its server's CUDA-graph use from the log (common.graph_use: the graphs captured, and how many
logged decode batches ran in one or eagerly), so a constant per-step cost shows whether it is a step outside its graph.

Rows are rewritten to benchmarks/results/spec-decode-<gpu>.{json,md,png} after every server, so the variants can be
split across calls (--only) and earlier rows are kept.

  python benchmarks/spec_decode.py MODELS [--only exl3-none,exl3-EAGLE3] [--starts 3] [--workdir /tmp/specbench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, gpu_slug, gpu_workdir, graph_use, header, kv_tokens, pyplot, write_results  # noqa: E402
from benchmarks.step_profile import profile_decode  # noqa: E402
from sglang_exl3.integration.server import free_port, launch, post, stop, wait_ready  # noqa: E402
from sglang_exl3.integration.spec_checks import SERVER_ARGS, TOL, compare, settle, structured, structured_ok  # noqa: E402

GREEDY_TOKENS, DECODE_TOKENS, BATCH1_PROMPTS, BATCHES = 64, 256, 2, (1, 8, 32)
SPEED_BENCH_PROMPTS = 4  # per category
# One KV pool size for every server (~6.4 GB for the trained target): far more than the prompts need. The static
# fraction only has to leave that pool room beside two other servers' (--starts 3 on a 141 GB H200).
KV_TOKENS, MEM_FRACTION = 262144, 0.15
EAGLE = ["--speculative-num-steps", "4", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5"]
# Two draft steps: a shorter cycle for a lower ceiling on the accept length (3 instead of 5). On the trained pair a
# cycle cost 1.6-2.2 ms more than a plain step at accept lengths of 2.2-2.5 (NOTES), so whether the draft's steps
# are that cost is measured by the draft length alone.
EAGLE_SHORT = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
# (target folder, algorithm, speculative arguments; {m} = MODELS)
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    "exl3-none": ("target-exl3", "none", []),
    "exl3-EAGLE3": ("target-exl3", "EAGLE3", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                              "{m}/eagle3", *EAGLE]),
    "exl3-STANDALONE": ("target-exl3", "STANDALONE", ["--speculative-algorithm", "STANDALONE",
                                                      "--speculative-draft-model-path", "{m}/small-exl3", *EAGLE]),
    "exl3-NGRAM": ("target-exl3", "NGRAM", ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"]),
    "exl3-EAGLE3-2steps": ("target-exl3", "EAGLE3", ["--speculative-algorithm", "EAGLE3",
                                                     "--speculative-draft-model-path", "{m}/eagle3", *EAGLE_SHORT]),
    "bf16-none": ("target-bf16", "none", []),
    "bf16-EAGLE3": ("target-bf16", "EAGLE3", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                              "{m}/eagle3", *EAGLE]),
    # the same EXL3 draft on the bf16 target: its config's quant_method selects EXL3 for the draft alone
    "bf16-STANDALONE": ("target-bf16", "STANDALONE", ["--speculative-algorithm", "STANDALONE",
                                                      "--speculative-draft-model-path", "{m}/small-exl3", *EAGLE]),
    "bf16-NGRAM": ("target-bf16", "NGRAM", ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"]),
    "bf16-EAGLE3-2steps": ("target-bf16", "EAGLE3", ["--speculative-algorithm", "EAGLE3",
                                                     "--speculative-draft-model-path", "{m}/eagle3", *EAGLE_SHORT]),
}
COLUMNS = ["algorithm", "draft_steps", "target", "batch", "category", "accept_length", "tok_s", "tok_s_no_spec",
           "speedup", "vs_bf16_same_draft", "lossless", "structured_ok", "step_span_us", "step_kernels_us"]


def chat_ids(models: Path, prompts: dict[str, list[str]]) -> dict[str, list[list[int]]]:
    """Each prompt as the training's chat form: bos, user, the passage, assistant (synth/tokenizer.py)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(models / "tokenizer" / "tokenizer.json"))
    bos, user, assistant = (tok.token_to_id(t) for t in ("<|bos|>", "<|user|>", "<|assistant|>"))
    return {c: [[bos, user, *tok.encode(p).ids, assistant] for p in rows] for c, rows in prompts.items()}


def generate(base: str, ids: list[list[int]], tokens: int, logprobs: bool = False) -> tuple[list[dict], float]:
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    if logprobs:
        payload.update(return_logprob=True, top_logprobs_num=2)
    t0 = time.perf_counter()
    out = post(base + "/generate", payload, timeout=900)
    return out, time.perf_counter() - t0


def decode_row(outs: list[dict], seconds: float) -> dict:
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) or 0 for o in outs)
    return {"tok_s": tokens / seconds, "accept_length": tokens / verify if verify else None, "tokens": tokens,
            "seconds": seconds}


def speed_bench_command(base: str, models: Path, category: str, result: Path) -> list[str]:
    """SGLang's load generator on one category of the recipe's SPEED-Bench file, one request at a time, tokenized
    with the target's own tokenizer."""
    return [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", base,
            "--dataset-name", "speed-bench", "--dataset-path", str(models / "speed-bench.jsonl"),
            "--speed-bench-category", category, "--speed-bench-output-len", str(DECODE_TOKENS),
            "--num-prompts", str(SPEED_BENCH_PROMPTS), "--max-concurrency", "1",
            "--tokenizer", str(models / "target"), "--output-file", str(result)]


def speed_bench(base: str, models: Path, category: str, work: Path) -> dict:
    """speed_bench_command's result (with the stand-in for `datasets` where it is absent: SGLang's MMMU reader
    imports it at module level)."""
    from benchmarks.serving_client import bench_env

    result = work / f"speed-bench-{category}.jsonl"
    result.unlink(missing_ok=True)
    log = work / f"speed-bench-{category}.log"
    with open(log, "w") as f:
        rc = subprocess.run(speed_bench_command(base, models, category, result), stdout=f, stderr=subprocess.STDOUT,
                            env=bench_env(work), timeout=300).returncode
    if rc or not result.exists():
        return {"speed_bench_error": f"exit {rc}, see {log.name}: "
                + " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])}
    row = json.loads(result.read_text().strip().splitlines()[-1])
    return {"tok_s": row.get("output_throughput"), "median_itl_ms": row.get("median_itl_ms"),
            "server_accept_length": row.get("accept_length"), "completed": row.get("completed")}


def target_of(name: str) -> str:
    """`exl3` or `bf16`: the target a variant serves (its folder, target-exl3 or target-bf16)."""
    return VARIANTS[name][0].removeprefix("target-")


def draft_steps(name: str) -> int | None:
    """A variant's --speculative-num-steps (None without a draft model: `none`, NGRAM). Rows of one algorithm are
    compared per draft length."""
    spec = VARIANTS[name][2]
    return int(spec[spec.index("--speculative-num-steps") + 1]) if "--speculative-num-steps" in spec else None


@dataclass
class Server:
    """One variant's server as started: its process, log and URL."""

    name: str
    proc: subprocess.Popen
    log: Path
    base: str
    started: float


def start_server(name: str, models: Path, work: Path) -> Server:
    """Every variant's server gets the same KV pool (KV_TOKENS): the pool follows free memory at start otherwise,
    which differs between EXL3 and bf16 weights and between servers started beside others."""
    folder, _, spec = VARIANTS[name]
    extra = [a.replace("{m}", str(models)) for a in spec]
    quant = ["--quantization", "exl3"] if target_of(name) == "exl3" else []
    log = work / f"server-{name}.log"
    port = free_port()
    proc = launch(models / folder, port, [*quant, "--mem-fraction-static", str(MEM_FRACTION), "--max-total-tokens",
                                          str(KV_TOKENS), "--cuda-graph-max-bs-decode", "32", *SERVER_ARGS, *extra],
                  log_path=log)
    return Server(name, proc, log, f"http://127.0.0.1:{port}", time.time())


def pool_allocated(server_log: Path) -> bool:
    """Whether the server has allocated its (first) KV pool: SGLang logs "KV Cache is allocated" then, before it
    captures its CUDA graphs (unless SGLANG_ENABLE_POST_CAPTURE_KV_SIZING sizes the pool after them)."""
    text = server_log.read_text(errors="replace") if server_log.exists() else ""
    return "KV Cache is allocated" in text or "KV cache allocated" in text


def wait_sized(server: Server, timeout: float = 900) -> None:
    """Until the server has allocated its KV pool (or died): SGLang budgets a pool from the memory free at its own
    start, so the next server starts only once this one has taken its pool; their graph captures then overlap."""
    t0 = time.time()
    while not pool_allocated(server.log) and server.proc.poll() is None and time.time() - t0 < timeout:
        time.sleep(2)


def start_group(names: list[str], models: Path, work: Path) -> tuple[list[Server], dict[str, Exception]]:
    """The servers of a group started one after another (each once the one before has sized its pool), then every
    one waited for: none is timed while another is still capturing graphs. Returns the servers, and the error of each
    that did not come up."""
    servers: list[Server] = []
    for name in names:
        if servers:
            wait_sized(servers[-1])
        servers.append(start_server(name, models, work))
    errors: dict[str, Exception] = {}
    for server in servers:
        try:
            wait_ready(server.base, server.proc)
            print(f"{server.name}: ready in {time.time() - server.started:.0f}s, KV tokens {kv_tokens(server.log)}",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - recorded against this variant; the others still run
            errors[server.name] = e
    return servers, errors


def measure_variant(server: Server, models: Path, ids: dict[str, list[list[int]]], work: Path,
                    profile_steps: int = 0) -> list[dict]:
    """The variant's rows from its ready server (lossless check, batch 1 / 8 / 32, structured output, SPEED-Bench);
    with profile_steps, a `none` variant's batch-1 decode step profiled too (step_profile: its span and kernel time,
    on the first row): whether a slower step is kernels or host time."""
    algorithm, target = VARIANTS[server.name][1], target_of(server.name)
    base = server.base
    common = {"variant": server.name, "algorithm": algorithm, "target": target}  # derive adds draft_steps
    rows = []
    generate(base, ids["mixed"][:2], 16)  # warm-up
    every = [p for rows_ in ids.values() for p in rows_]
    greedy, _ = generate(base, every, GREEDY_TOKENS, logprobs=True)
    baseline = work / f"greedy-{target}.json"
    check: dict = {}
    if algorithm == "none":
        baseline.write_text(json.dumps(greedy))
    elif baseline.exists():
        check = compare(json.loads(baseline.read_text()), greedy)
    one_outs, one_seconds = [], 0.0  # batch 1 over every category
    for category, prompts in ids.items():
        outs, seconds = [], 0.0
        for p in prompts[:BATCH1_PROMPTS]:
            o, s = generate(base, [p], DECODE_TOKENS)
            outs += o
            seconds += s
        rows.append({**common, "batch": 1, "category": category, **decode_row(outs, seconds)})
        one_outs, one_seconds = one_outs + outs, one_seconds + seconds
    rows.insert(0, {**common, "batch": 1, "category": "all", **decode_row(one_outs, one_seconds)})
    for batch in BATCHES[1:]:
        outs, seconds = generate(base, [every[i % len(every)] for i in range(batch)], DECODE_TOKENS)
        rows.append({**common, "batch": batch, "category": "all", **decode_row(outs, seconds)})
    extras = {}
    if algorithm != "none":
        extras["structured"] = structured(base)
        extras["structured_ok"] = structured_ok(extras["structured"])
    for category in ids:
        rows.append({**common, "batch": 1, "category": f"speed-bench:{category}",
                     **speed_bench(base, models, category, work)})
    for r in rows:
        r.update(near_ties=check.get("near_ties"), failures=check.get("failures"),
                 identical=check.get("identical"), **extras)
    if profile_steps and algorithm == "none":
        cats, kernels = profile_decode(base, work / f"profile-{server.name}", 1, profile_steps, every[:1])
        rows[0].update(step_span_us=cats["span_us"], step_kernels_us=cats["kernels_total"], profile=cats,
                       profile_kernels=kernels)
    return rows


def groups(names: list[str], size: int) -> list[list[str]]:
    """The variants in order, `size` at a time: a target's `none` stays before its speculative variants (their
    lossless check reads its greedy output), whichever group each lands in."""
    return [names[i:i + size] for i in range(0, len(names), size)]


def derive(rows: list[dict]) -> None:
    """lossless from the recorded greedy comparison at the current TOL; tok_s_no_spec / speedup against the same
    target's `none` row of the same batch and category, and the EXL3 target's tok/s over the bf16 target's with the
    same algorithm and draft length (`draft_steps`, set here from each row's variant where the row has none)."""
    for r in rows:
        if "draft_steps" not in r:
            r["draft_steps"] = draft_steps(r["variant"]) if r.get("variant") in VARIANTS else None
    by = {(r["target"], r["algorithm"], r["draft_steps"], r["batch"], r["category"]): r for r in rows}
    for r in rows:
        if r.get("failures") is not None:  # a speculative variant with its target's baseline
            r.update(settle(r))
            r["lossless"] = not r["failures"]
        key = (r["batch"], r["category"])
        none = by.get((r["target"], "none", None, *key))
        r["tok_s_no_spec"] = none["tok_s"] if none and none.get("tok_s") else None
        r["speedup"] = r["tok_s"] / r["tok_s_no_spec"] if r.get("tok_s") and r["tok_s_no_spec"] else None
        bf16 = by.get(("bf16", r["algorithm"], r["draft_steps"], *key))
        r["vs_bf16_same_draft"] = (r["tok_s"] / bf16["tok_s"] if r["target"] == "exl3" and bf16
                                   and bf16.get("tok_s") and r.get("tok_s") else None)


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["batch"], r["tok_s"]) for r in rows if r["variant"] == variant and r["category"] == "all")
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=variant, ls="-" if "exl3" in variant else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(BATCHES), [str(b) for b in BATCHES])
    ax.set(xlabel="concurrent requests", ylabel="decode tok/s (all requests)",
           title="Speculative decoding: EXL3 4 bpw target vs its bf16 twin, trained drafts")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models")
    ap.add_argument("--only", default=",".join(VARIANTS), help="variants, comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--workdir", default="/tmp/specbench")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many batch-1 decode steps of each `none` variant (its span and kernel time)")
    ap.add_argument("--starts", type=int, default=1,
                    help="servers brought up together (each started once the one before has sized its KV pool, all "
                         "timed one by one once every one is ready): their start-ups overlap, the timings do not")
    args = ap.parse_args()
    if args.starts < 1:
        raise SystemExit(f"--starts must be 1 or more, got {args.starts}")
    work = gpu_workdir("spec_decode.py", args.workdir)
    if work is None:
        return 1
    names = args.only.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    models = Path(args.models)
    ids = chat_ids(models, json.loads((models / "prompts.json").read_text()))
    head = header(sys.argv)
    head.update(greedy_tokens=GREEDY_TOKENS, decode_tokens=DECODE_TOKENS, batch1_prompts=BATCH1_PROMPTS,
                near_tie_nats=TOL, eagle_args=EAGLE, eagle_short_args=EAGLE_SHORT,
                speed_bench_prompts=SPEED_BENCH_PROMPTS, kv_tokens=KV_TOKENS, mem_fraction_static=MEM_FRACTION,
                starts=args.starts)
    train = models / "train.json"
    if train.exists():
        head["training"] = {k: v for k, v in json.loads(train.read_text()).items() if not k.endswith("_log")}
    previous = RESULTS / f"spec-decode-{gpu_slug(head['gpu'])}.json"
    rows = json.loads(previous.read_text())["rows"] if previous.exists() else []
    failed = False
    for group in groups(names, args.starts):
        servers, errors = start_group(group, models, work)
        try:
            for server in servers:
                try:
                    if server.name in errors:
                        raise errors[server.name]
                    new = measure_variant(server, models, ids, work, args.profile_steps)
                except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
                    print(f"{server.name}: FAILED {type(e).__name__}: {e}", flush=True)
                    failed = True
                    continue
                finally:
                    stop(server.proc)  # before the next is timed: an idle server still polls a CPU core
                graphs = graph_use(server.log)  # whether the decode steps timed above ran in their CUDA graphs
                for r in new:
                    r.update(graphs)
                rows = [r for r in rows if r["variant"] != server.name] + new
                derive(rows)
                path = write_results("spec-decode", head, rows, COLUMNS)
                plot(rows, path.with_suffix(".png"))
                for r in new:
                    print("ROW", json.dumps({k: r.get(k) for k in COLUMNS}), flush=True)
        finally:
            for server in servers:  # those a failure above left running
                stop(server.proc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
