"""Where a decode step's GPU time goes: SGLang's own profiler (`POST /start_profile`, torch profiler traces) on a
running server while a batch decodes, summed per kernel category per step. `benchmarks/e2e.py --profile-steps N`
runs it for each served model at batch 1 and 64, so the EXL3 model and its bf16 twin are compared in one run, each
profiled at the same positions of its sequences (LEAD_TOKENS decoded first).

The categories are matched on kernel names, first match wins: our GEMMs contain "gemm" too, so they come first, and
flashinfer's norm and activation kernels before its attention.
`span_us` is the time from a step's first kernel to its last, averaged: beside the kernel sum it shows the GPU idle
time a step spends waiting on the host.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import http.client
import json
import re
import threading
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

TRACE_WAIT_S = 120  # SGLang exports the trace after the profiled steps, from its scheduler process
LEAD_TOKENS = 128  # every request of the batch has decoded this many tokens when the profiled steps begin

CATEGORIES = [
    ("exl3 GEMM", r"gemm_ring_kernel|gemm_xs_kernel|gemm_wg_kernel|gemm_group|gemm_kernel<|linear_decode_kernel|"
                  r"moe_decode|moe_mid|moe_tail"),
    ("exl3 rotations", r"had_in|had_out|slab_"),  # slab_*: the rotated-slab MoE's per-pair rotations
    ("exl3 reconstruct", r"reconstruct"),
    ("dense GEMM", r"gemm|cutlass|xmma|nvjet|cublas"),
    ("norm", r"rmsnorm|RMSNorm|layernorm|LayerNorm"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("rope", r"rotary|Rotary|rope"),
    ("attention", r"flashinfer|attention|Attention|fmha|BatchDecode|BatchPrefill|paged"),
    ("elementwise (casts, adds, copies)", r"elementwise|copy|Copy|cast|fill"),
    ("sampling", r"sampl|softmax|argmax|topk|top_k"),
]


def category(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel):
            return name
    return "other"


def kernel_events(trace: Path) -> list[dict]:
    """The GPU kernel events of one torch-profiler trace (.json or .json.gz)."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not events:
        raise ValueError(f"{trace}: no GPU kernel events (was the profile taken with activities=['GPU']?)")
    return events


def trace_breakdown(events: list[dict], steps: int) -> dict:
    """Per-step microseconds by category from one trace's kernel events (kernel_events) over `steps` steps."""
    per = defaultdict(float)
    for e in events:
        per[category(e["name"])] += float(e["dur"])
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    out = {name: us / steps for name, us in sorted(per.items(), key=lambda kv: -kv[1])}
    out["kernels_total"] = sum(per.values()) / steps
    out["span_us"] = (end - start) / steps
    out["kernel_count"] = len(events) / steps
    return out


def short_name(kernel: str) -> str:
    """A kernel's name without `void`, anonymous namespaces and its parameter list; its template arguments stay,
    since they tell the variants apart (tile rows, codebook, output type)."""
    name = kernel.replace("(anonymous namespace)::", "").removeprefix("void ")
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def top_kernels(events: list[dict], steps: int, top: int = 15) -> list[dict]:
    """The `top` kernels of one trace's kernel events by time per step, each with its launches per step and mean
    time per launch: which rotation or GEMM variant a category's time comes from."""
    per, count = defaultdict(float), defaultdict(int)
    for e in events:
        name = short_name(e["name"])
        per[name] += float(e["dur"])
        count[name] += 1
    ranked = sorted(per, key=lambda n: -per[n])[:top]
    return [{"kernel": n, "category": category(n), "us_per_step": per[n] / steps,
             "launches_per_step": count[n] / steps, "us_per_launch": per[n] / count[n]} for n in ranked]


def streamed_tokens(line: bytes) -> int | None:
    """The completion tokens so far from one line of SGLang's streaming /generate answer (`data: {json}`), None for
    other lines (blank separators, `data: [DONE]`)."""
    line = line.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return None
    out = json.loads(line[5:])
    if "error" in out:  # SGLang reports a failure inside the stream, with status 200
        raise RuntimeError(f"the server's stream reported {out['error']}")
    return out["meta_info"]["completion_tokens"]


def stream_generate(base: str, payload: dict, lead: int, reached: threading.Event) -> int:
    """A streaming /generate read to its end; `reached` is set once it has `lead` completion tokens (or when it ends,
    so that nobody waits on a request that failed). Returns its completion tokens."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    tokens = 0
    try:
        conn.request("POST", "/generate", json.dumps({**payload, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{base}/generate answered {resp.status}: {resp.read()[:300]!r}")
        for line in resp:
            if (n := streamed_tokens(line)) is not None:
                tokens = n
                if tokens >= lead:
                    reached.set()
    finally:
        reached.set()
        conn.close()
    return tokens


def profile_decode(base: str, out_dir: Path, batch: int, steps: int, ids: list[list[int]]) -> tuple[dict, list[dict]]:
    """Start `batch` greedy decodes on the server at `base`, profile `steps` of its steps once every one has decoded
    LEAD_TOKENS tokens, and return trace_breakdown and top_kernels of the trace SGLang wrote. The lead is counted in
    tokens, not seconds: after a fixed time a faster server's requests are longer, and its attention per step with
    them (a 1 s lead-in put the EXL3 servers' batch-1 steps past 256 tokens, two key blocks per split of SGLang's
    Triton decode attention, and their twins' below: 6.8-6.9 against 3.8 µs per layer)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {"max_new_tokens": LEAD_TOKENS + 1024 + 8 * steps, "temperature": 0, "ignore_eos": True}
    reached = [threading.Event() for _ in ids[:batch]]
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        jobs = [pool.submit(stream_generate, base, {"input_ids": p, "sampling_params": params}, LEAD_TOKENS, ev)
                for p, ev in zip(ids[:batch], reached, strict=True)]
        for ev in reached:
            ev.wait(timeout=600)
        # answers once profiling has started; the trace is written after the steps, possibly after the decodes end
        req = urllib.request.Request(base + "/start_profile", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"output_dir": str(out_dir), "num_steps": steps,
                                                      "activities": ["GPU"]}).encode())
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
        for job in jobs:
            job.result()
    deadline = time.monotonic() + TRACE_WAIT_S
    while not (traces := sorted(out_dir.rglob("*.trace.json*"), key=lambda p: p.stat().st_mtime)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"SGLang wrote no trace under {out_dir} within {TRACE_WAIT_S} s")
        time.sleep(1.0)
    time.sleep(2.0)  # a trace that just appeared may still be being written
    events = kernel_events(traces[-1])
    return trace_breakdown(events, steps), top_kernels(events, steps)
