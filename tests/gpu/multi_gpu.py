"""Multi-GPU evidence (issue: tensor and expert parallelism): EXL3 models served with `--tp 2` (and the MoE one with
expert parallelism) against the same model at tp=1, on one machine with two GPUs.

Cases: an exllamav3-made Llama (4 heads, 2 KV heads), a project-written Llama with one KV head (tp > KV heads:
SGLang replicates the KV head and the EXL3 k/v slices follow), an exllamav3-made Qwen3-MoE with MoE tensor
parallelism, and the same with expert parallelism. Checks per case, by serve_parity's rule: top-5 logprobs within
TOL at every position, greedy tokens identical except at reference near-ties (MoE: positions after a token the two
servers routed differently are excused, at most 25%). With `--tp 1` every case runs at tp=1 on both sides (the
one-GPU dry run of this script). NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

  python tests/gpu/multi_gpu.py OUT [--tp 2] [--backend cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_parity as sp  # noqa: E402
from serve_parity import DATA, compare, generate, moe_shape, prompts  # noqa: E402

from sglang_exl3.integration.server import launch, stop, wait_ready  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COMMON = ["--quantization", "exl3", "--dtype", "float16", "--mem-fraction-static", "0.3",
          "--cuda-graph-max-bs-decode", "64"]


def cases(tp: int, work: Path) -> list[tuple[str, Path, list[str]]]:
    """(name, checkpoint, parallel args) per case."""
    kv1 = work / "tiny-llama-kv1-4bpw"
    if not kv1.exists():
        subprocess.run([sys.executable, "-m", "sglang_exl3", "write-fixture", str(kv1), "--arch", "llama",
                        "--kv-heads", "1", "--bits", "4", "--codebook", "mcg", "--seed", "6"], check=True)
    moe = DATA / "tiny-qwen3moe-mul1-4bpw"
    return [("llama-tp", DATA / "tiny-llama-mul1-4bpw", ["--tp", str(tp)]),
            ("llama-kv1-tp", kv1, ["--tp", str(tp)]),
            ("qwen3moe-tp", moe, ["--tp", str(tp)]),
            ("qwen3moe-ep", moe, ["--tp", str(tp), "--ep-size", str(tp)])]


def run_case(name: str, ckpt: Path, parallel: list[str], out: Path, backend: str, port: int) -> dict:
    """Reference at tp=1, then the parallel server, one at a time; the comparison and readiness times."""
    moe = moe_shape(ckpt)
    routed = ["--enable-return-routed-experts"] if moe else []
    ids = prompts(seed=len(name))
    results, entry = {}, {"checkpoint": ckpt.name, "parallel_args": parallel}
    for kind, extra in (("tp1", []), ("parallel", parallel)):
        t0 = time.time()
        proc = launch(ckpt, port, COMMON + routed + extra, env={"SGLANG_EXL3_BACKEND": backend, **NO_MULTICAST},
                      log_path=out / f"server-{name}-{kind}.log")
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            entry[f"{kind}_ready_s"] = round(time.time() - t0, 1)
            results[kind] = generate(f"http://127.0.0.1:{port}", ids, 16, bool(moe))
        finally:
            stop(proc)
    res = compare(results["parallel"], results["tp1"], moe)
    entry["parity"] = {**res, "failures": res["failures"][:20], "n_failures": len(res["failures"])}
    entry["passed"] = not res["failures"] and res["positions"] > 0
    return entry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="cuda", help="SGLANG_EXL3_BACKEND for every server")
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/multi_gpu")
    work.mkdir(exist_ok=True)
    import sglang

    report = {"command": " ".join(sys.argv), "tolerance_nats": sp.TOL, "gpus": torch.cuda.device_count(),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sglang": sglang.__version__,
              "server_args": COMMON, "backend": args.backend, "env": NO_MULTICAST, "cases": {}}
    ok = True
    try:
        for i, (name, ckpt, parallel) in enumerate(cases(args.tp, work)):
            try:
                report["cases"][name] = run_case(name, ckpt, parallel, out, args.backend, 31100 + i)
            except Exception as e:  # noqa: BLE001 - recorded in the evidence, then the run fails
                report["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
            ok &= report["cases"][name].get("passed", False)
            print(name, json.dumps({k: v for k, v in report["cases"][name].items() if k != "parity"}), flush=True)
    finally:
        report["passed"] = ok
        (out / f"multi-gpu-tp{args.tp}.json").write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
