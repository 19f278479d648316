"""Expert cartridges swapped on a serving EXL3 MoE model under load, with faults, per mode (SGLANG_EXL3_CARTRIDGES).

Per mode, one SGLang server (CUDA graphs, our kernels) on an exl3-msrt-base/1 base written here (Qwen3-MoE layout,
random trellis, `--dims`), with two cartridges written by `sglang_exl3.synth.cartridge_writer` (A: two stages on
every layer; B: one stage on some layers) and a tampered copy of A:
  1. the base's greedy probe (tokens and logprobs) and the teacher-forced logprobs of its continuation; the same
     with A active (the quality effect: mean and max |delta logprob|, greedy agreement); deactivated again, the
     probe must be bit-identical to the base's;
  2. `python -m sglang.benchmark.serving` (random-ids, --concurrency); once it sends its real requests, cartridges are
     loaded and deactivated --swaps times (A and B alternating; a swap counts as under load when requests were in
     flight as it was asked for), with a fault before every fourth swap: the tampered shard, then failures
     injected (SGLANG_EXL3_TEST_CARTRIDGE_FAULTS=1) while preparing, while committing and at the recapture; each must be
     answered 400 with the base served (status inactive) and the load continuing;
  3. the load's failed requests, the server alive, the probe bit-identical to the base's.
Pause-to-resume latency: the time the model-update lock is held (drained, the scheduler's swap, resumed).
Rows merge into benchmarks/results/cartridges-<gpu>.{json,md} (one server per mode; --modes picks them).

  python benchmarks/cartridges.py [--modes recapture,resident] [--swaps 20] [--requests 1200] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, gpu_slug, gpu_workdir, header, kv_tokens, pyplot, write_results  # noqa: E402
from benchmarks.load import _flush, _healthy  # noqa: E402
from benchmarks.serving_client import datasets_stub  # noqa: E402
from sglang_exl3.integration.server import launch, stop, wait_ready  # noqa: E402

PROBE = [(i * 37) % 900 + 50 for i in range(48)]
FAULTS = ("tampered", "prepare", "commit", "recapture")
COLUMNS = ["mode", "swaps", "swaps_under_load", "requests", "failed_requests", "faults_injected", "rollbacks",
           "pause_ms_p50", "pause_ms_p99", "scheduler_ms_p50", "probe_identical_after", "server_alive",
           "dlogprob_mean", "dlogprob_max", "greedy_agree"]


def write_models(work: Path, dims: str) -> dict[str, Path]:
    from sglang_exl3.synth.cartridge_writer import StageSpec, write_cartridge
    from sglang_exl3.synth.exl3_writer import ModelDims
    from sglang_exl3.synth.msrt_base_writer import write_msrt_base
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    hidden, layers, experts, topk, inter = (int(v) for v in dims.split(","))
    models = work / "models"
    shutil.rmtree(models, ignore_errors=True)
    d = ModelDims(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=hidden // 8, num_experts=experts, num_experts_per_tok=topk,
                  moe_intermediate_size=inter)
    sliced = write_rank_sliced_checkpoint(models / "rs", dims=d, bits=4, tp=1, seed=11, with_tokenizer=True)
    base = write_msrt_base(sliced, models / "base")
    a = write_cartridge(base, models / "A", [StageSpec("a", 3, 8.0), StageSpec("b", 2, 32.0, tuple(range(0, experts,
                                                                                                         2)))],
                        seed=1, assembly="A")
    b = write_cartridge(base, models / "B", [StageSpec("n", 2, 16.0)], layers=list(range(1, layers, 2)), seed=2,
                        assembly="B")
    tampered = shutil.copytree(a, models / "A-tampered")
    shard = next(tampered.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    return {"base": base, "A": a, "B": b, "tampered": tampered}


def call(url: str, payload: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def greedy(base: str) -> dict:
    _flush(base)
    _, out = call(base + "/generate", {"input_ids": PROBE, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0}})
    return {"ids": out["output_ids"], "logprobs": [t[0] for t in out["meta_info"]["output_token_logprobs"]]}


def scored(base: str, ids: list[int]) -> list[float]:
    """Teacher-forced logprob of every token of `ids` after the first."""
    _flush(base)
    _, out = call(base + "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    return [t[0] for t in out["meta_info"]["input_token_logprobs"][1:]]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_mode(mode: str, models: dict[str, Path], args, work: Path, port: int) -> dict:
    log = work / f"server-{mode}.log"
    env = {"SGLANG_EXL3_BACKEND": "cuda", "SGLANG_EXL3_CARTRIDGES": mode, "SGLANG_EXL3_TEST_CARTRIDGE_FAULTS": "1"}
    proc = launch(models["base"], port, ["--quantization", "exl3", "--context-length", "1024",
                                         "--mem-fraction-static", "0.5", "--cuda-graph-max-bs-decode",
                                         str(args.concurrency), *args.server_args.split()], env=env, log_path=log)
    url = f"http://127.0.0.1:{port}"
    row: dict = {"mode": mode}
    try:
        row["ready_s"] = round(wait_ready(url, proc, timeout=600), 1)
        before = greedy(url)
        sequence = PROBE + before["ids"]
        base_scores = scored(url, sequence)
        status, loaded = call(url + "/load_exl3_cartridge", {"adapter_path": str(models["A"])})
        if status != 200:
            raise RuntimeError(f"loading cartridge A failed: {status} {loaded}")
        row["first_load"] = loaded
        with_a = greedy(url)
        deltas = [abs(x - y) for x, y in zip(scored(url, sequence), base_scores, strict=True)]
        row.update(dlogprob_mean=statistics.fmean(deltas), dlogprob_max=max(deltas),
                   greedy_agree=sum(x == y for x, y in zip(with_a["ids"], before["ids"], strict=True)) / len(
                       before["ids"]))
        call(url + "/deactivate_exl3_cartridge", {})
        row["probe_identical_first_deactivate"] = greedy(url) == before

        stub = datasets_stub(work)
        out_file = work / f"bench-{mode}.jsonl"
        bench_cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
                     "--port", str(port), "--model", str(models["base"]), "--tokenizer", str(models["base"]),
                     "--dataset-name", "random-ids", "--num-prompts", str(args.requests), "--max-concurrency",
                     str(args.concurrency), "--random-input-len", "256", "--random-output-len", "128",
                     "--random-range-ratio", "0.2", "--output-file", str(out_file), "--disable-tqdm", "--seed", "1"]
        bench_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (stub, os.environ.get("PYTHONPATH")) if p)}
        bench = subprocess.Popen(bench_cmd, stdout=open(work / f"bench-{mode}.log", "w"), stderr=subprocess.STDOUT,
                                 env=bench_env)
        started = time.time()
        while "Starting main benchmark run" not in _read(work / f"bench-{mode}.log") and time.time() - started < 120:
            time.sleep(0.5)  # swaps start once the load generator sends its real requests
        time.sleep(2)
        pauses, scheduler_ms, events, under_load, rollbacks, faults = [], [], [], 0, 0, 0
        deadline = time.time() + args.swap_budget_s
        swaps = 0
        for i in range(args.swaps):
            if time.time() > deadline:
                break
            if i % 4 == 3:  # a fault before every fourth swap, each kind in turn
                kind = FAULTS[(i // 4) % len(FAULTS)]
                body = {"adapter_path": str(models["tampered" if kind == "tampered" else "A"])}
                if kind != "tampered":
                    body["inject_fault"] = kind
                status, answer = call(url + "/load_exl3_cartridge", body)
                _, state = call(url + "/exl3_cartridge_status")
                faults += 1
                ok = status == 400 and not any(state["active"]) and proc.poll() is None
                rollbacks += ok
                events.append({"fault": kind, "status": status, "error": answer.get("error", "")[:160],
                               "active_after": state["active"], "rolled_back": ok})
            for action, body in (("load", {"adapter_path": str(models["A" if i % 2 == 0 else "B"])}),
                                 ("deactivate", {})):
                status, answer = call(url + f"/{'load' if action == 'load' else 'deactivate'}_exl3_cartridge", body)
                if status != 200:
                    raise RuntimeError(f"swap {i} {action} failed: {status} {answer}")
                pauses.append(answer["pause_ms"])
                scheduler_ms += answer["swap_ms"]
                loading = answer["in_flight"] > 0  # requests in flight when the swap was asked for
                events.append({"swap": i, "action": action, "pause_ms": round(answer["pause_ms"], 1),
                               "drain_ms": round(answer["drain_ms"], 1), "updated_layers": answer["updated_layers"],
                               "in_flight": answer["in_flight"]})
                under_load += loading and action == "load"
                time.sleep(args.gap_s)
            swaps += 1
        try:
            bench.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            bench.kill()
        lines = out_file.read_text().strip().splitlines() if out_file.exists() else []
        result = json.loads(lines[-1]) if lines else {}
        completed = int(result.get("completed") or 0)
        alive = proc.poll() is None and _healthy(url)
        row.update(swaps=swaps, swaps_under_load=under_load, requests=args.requests,
                   failed_requests=args.requests - completed, faults_injected=faults, rollbacks=rollbacks,
                   pause_ms_p50=_pct(pauses, 0.5), pause_ms_p99=_pct(pauses, 0.99),
                   scheduler_ms_p50=_pct(scheduler_ms, 0.5), scheduler_ms_p99=_pct(scheduler_ms, 0.99),
                   server_alive=alive, probe_identical_after=alive and greedy(url) == before,
                   request_per_s=result.get("request_throughput"), kv_tokens=kv_tokens(log), events=events)
        return row
    except Exception as e:  # the row says what broke; the server log is kept in the workdir
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    finally:
        stop(proc)


def summarize(rows: list[dict]) -> dict:
    """The evidence's totals over every mode's server; swap latency = pause-to-resume (the model-update lock held)."""
    by = {r["mode"]: r for r in rows}
    return {"swaps": sum(r.get("swaps", 0) for r in rows),
            "swaps_under_load": sum(r.get("swaps_under_load", 0) for r in rows),
            "requests": sum(r.get("requests", 0) for r in rows),
            "failed_requests": sum(r.get("failed_requests", 0) for r in rows),
            "faults_injected": sum(r.get("faults_injected", 0) for r in rows),
            "rollbacks": sum(r.get("rollbacks", 0) for r in rows),
            "swap_ms_p50": by.get("recapture", {}).get("pause_ms_p50"),
            "swap_ms_p99": by.get("recapture", {}).get("pause_ms_p99"),
            "swap_ms_p50_no_recapture": by.get("resident", {}).get("pause_ms_p50"),
            "swap_ms_p99_no_recapture": by.get("resident", {}).get("pause_ms_p99")}


def publish(head: dict, rows: list[dict]) -> Path:
    """JSON (the summary at the top level too), the Markdown table and a plot of every swap's pause."""
    summary = summarize(rows)
    path = write_results("cartridges", {**head, **summary}, rows, COLUMNS)
    data = json.loads(path.read_text())
    data.update(summary)
    path.write_text(json.dumps(data, indent=1))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for r in rows:
            pauses = [e["pause_ms"] for e in r.get("events", []) if "pause_ms" in e]
            ax.plot(range(1, len(pauses) + 1), pauses, marker="o", ms=3, label=f"{r['mode']}")
        ax.set(yscale="log", xlabel="swap request (load / deactivate, in order)", ylabel="pause to resume (ms)",
               title=f"Cartridge swaps under load, {head['gpu']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="recapture,resident")
    ap.add_argument("--swaps", type=int, default=20, help="cartridge loads (each followed by a deactivation)")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--gap-s", type=float, default=0.5, help="serving time between swap requests")
    ap.add_argument("--swap-budget-s", type=float, default=240, help="no new swap starts after this many seconds")
    ap.add_argument("--timeout", type=float, default=300, help="seconds the load generator may still run")
    ap.add_argument("--dims", default="1024,8,16,4,512", help="hidden, layers, experts, top-k, expert intermediate")
    ap.add_argument("--server-args", default="--cuda-graph-max-bs-prefill 512",
                    help="more server flags (the default bounds the prefill graphs a recapture captures again)")
    ap.add_argument("--workdir", default="/tmp/cartridges")
    args = ap.parse_args()
    work = gpu_workdir("benchmarks/cartridges.py", args.workdir)
    if work is None:
        return 2
    models = write_models(work, args.dims)
    head = header(sys.argv)
    head.update(dims=args.dims, concurrency=args.concurrency,
                note="drain = waiting under the model-update lock for the requests in flight and an idle scheduler; "
                     "pause = from there to the resume (the swap: commit, flush, recapture); scheduler = the swap "
                     "timed on the scheduler")
    previous = RESULTS / f"cartridges-{gpu_slug(head['gpu'])}.json"
    rows = [r for r in (json.loads(previous.read_text())["rows"] if previous.exists() else [])
            if r["mode"] not in args.modes.split(",")]
    for i, mode in enumerate(args.modes.split(",")):
        row = run_mode(mode, models, args, work, 34000 + i)
        row["command"] = head["command"]
        print("ROW " + json.dumps({k: v for k, v in row.items() if k != "events"}), flush=True)
        rows.append(row)
        publish(head, rows)
    ok = all("error" not in r and r["failed_requests"] == 0 and r["probe_identical_after"]
             and r["rollbacks"] == r["faults_injected"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
