"""EXL3 servers under sustained load with aborts: SGLang's own load generator plus clients that misbehave.

For each model (an exllamav3-made dense Llama and Qwen3-MoE by default), one SGLang server with CUDA graphs on our
kernels:
  1. a probe prompt's greedy output, and the GPU memory in use;
  2. `python -m sglang.benchmark.serving` (random-ids, mixed lengths) at --concurrency for --requests requests, while
     other clients, at the same time, open streams and hang up after a few chunks (~10% of all requests) and send
     prompts longer than the context (the server must refuse them);
  3. the server must still be alive, the probe's greedy output identical (cache flushed first), and the GPU memory
     flat; the KV-cache tokens the server sized are read from its log.
Writes benchmarks/results/load-<gpu>.{json,md}; exits 1 when any check fails.

  python benchmarks/load.py [--models dense,moe] [--requests 2000] [--concurrency 64] [--workdir /tmp/load]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import gpu_workdir, header, kv_tokens, write_results  # noqa: E402
from benchmarks.serving_client import bench_command, bench_env, last_result  # noqa: E402
from sglang_exl3.integration.server import launch, post, stop, wait_ready  # noqa: E402

MODELS = {"dense": ROOT / "tests/data/exllamav3/tiny-llama-mul1-4bpw",
          "moe": ROOT / "tests/data/exllamav3/tiny-qwen3moe-mul1-4bpw"}
CONTEXT = 1024
PROBE = [[(i * 37) % 900 + 50 for i in range(24)]]
COLUMNS = ["model", "requests", "failed", "aborted", "refused", "server_alive", "probe_identical",
           "gpu_mem_growth_mib", "kv_tokens", "bench_completed", "bench_s", "request_per_s"]


def gpu_used_mib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def probe(base: str) -> list[int]:
    """The probe prompt's greedy output, from an empty radix cache (so both probes take the same path)."""
    _flush(base)
    out = post(base + "/generate", {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
    return out[0].get("output_ids") or out[0]["text"]


def _flush(base: str, attempts: int = 30) -> None:
    """Empty the radix cache; SGLang refuses while requests are still in flight, so wait for it."""
    for _ in range(attempts):
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
        conn.request("POST", "/flush_cache")
        ok = conn.getresponse().status == 200
        conn.close()
        if ok:
            return
        time.sleep(1)
    raise RuntimeError(f"{base}/flush_cache kept refusing: requests still in flight")


def abort_midstream(host: str, port: int, i: int) -> str:
    """Open a streaming request and hang up after a few chunks: 'aborted', or 'failed' if the server misbehaved."""
    ids = [(i * 13 + j * 7) % 900 + 50 for j in range(64 + i % 300)]
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 512,
                                                                            "ignore_eos": True}})
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return "failed"
        for _ in range(2 + i % 5):
            if not resp.readline():
                break
        return "aborted"
    except OSError:
        return "failed"
    finally:
        conn.close()  # the disconnect the server must survive


def over_context(host: str, port: int, i: int) -> str:
    """A prompt longer than the context: 'refused' (a 4xx answer naming it), else 'failed'."""
    ids = [(i * 11 + j) % 900 + 50 for j in range(CONTEXT + 100 + i)]
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", "/generate", json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        return "refused" if 400 <= resp.status < 500 and "context" in text.lower() else "failed"
    except OSError:
        return "failed"
    finally:
        conn.close()


def run_model(name: str, path: Path, args, work: Path, port: int) -> dict:
    log = work / f"load-server-{name}.log"
    proc = launch(path, port, ["--quantization", "exl3", "--context-length", str(CONTEXT),
                               "--mem-fraction-static", "0.5", "--cuda-graph-max-bs-decode", str(args.concurrency)],
                  env={"SGLANG_EXL3_BACKEND": "cuda"}, log_path=log)
    base, host = f"http://127.0.0.1:{port}", "127.0.0.1"
    try:
        wait_ready(base, proc, timeout=600)
        before = probe(base)
        mem0 = gpu_used_mib()
        bad = args.requests // 9  # ~10% of all requests hang up mid-stream
        refused_n = max(20, args.requests // 50)
        out_file = work / f"bench-{name}.jsonl"
        bench_cmd = bench_command(path, host, port, args.requests, args.concurrency, 512, 128, 0.1, out_file)
        env = bench_env(work)
        t0 = time.time()
        bench = subprocess.Popen(bench_cmd, stdout=open(work / f"bench-{name}.log", "w"), stderr=subprocess.STDOUT,
                                 env=env)
        peak = [mem0]

        def sample() -> None:
            while bench.poll() is None:
                peak[0] = max(peak[0], gpu_used_mib())
                time.sleep(1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(3)  # the abusers run while the benchmark's requests are in flight
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(lambda i: abort_midstream(host, port, i), range(bad)))
            outcomes += list(pool.map(lambda i: over_context(host, port, i), range(refused_n)))
        try:
            bench.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # counted below: whatever it did not complete failed
            bench.kill()
        bench_s = time.time() - t0
        sampler.join(timeout=5)
        result = last_result(out_file)
        completed = int(result.get("completed") or 0)
        time.sleep(5)  # aborted requests drain
        alive = proc.poll() is None and _healthy(base)
        after = probe(base) if alive else None
        mem1 = gpu_used_mib()
        return {"model": f"{name} ({path.name})", "requests": args.requests + bad + refused_n,
                "failed": (args.requests - completed) + outcomes.count("failed"),
                "aborted": outcomes.count("aborted"), "refused": outcomes.count("refused"),
                "server_alive": alive, "probe_identical": after == before, "gpu_mem_growth_mib": round(mem1 - mem0, 1),
                "gpu_mem_peak_growth_mib": round(peak[0] - mem0, 1), "kv_tokens": kv_tokens(log),
                "bench_completed": completed, "bench_s": round(bench_s, 1),
                "request_per_s": result.get("request_throughput"), "bench_errors": sorted(
                    {str(e)[:120] for e in result.get("errors") or [] if e})[:5]}
    finally:
        stop(proc)


def _healthy(base: str) -> bool:
    try:
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/load")
    ap.add_argument("--timeout", type=float, default=400, help="seconds the load generator may run per model")
    args = ap.parse_args()
    work = gpu_workdir("benchmarks/load.py", args.workdir)
    if work is None:
        return 2
    head = header(sys.argv)
    head.update(context_length=CONTEXT, concurrency=args.concurrency,
                note="prompts 51-512 random ids, outputs 12-128 tokens (random-ids, range ratio 0.1); aborts: "
                     "streams closed after 2-6 chunks; refused: prompts longer than the context")
    rows = []
    for i, name in enumerate(args.models.split(",")):
        rows.append(run_model(name, MODELS[name], args, work, 33000 + i))
        print("ROW " + json.dumps(rows[-1]), flush=True)
    write_results("load", head, rows, COLUMNS)
    ok = all(r["failed"] == 0 and r["server_alive"] and r["probe_identical"] and abs(r["gpu_mem_growth_mib"]) < 64
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
