"""Shared helpers for the GPU benchmarks: environment header, copy bandwidth, timing, table output."""

from __future__ import annotations

import json
import platform
import re
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def header(command: list[str]) -> dict:
    import triton

    out = {"command": " ".join(command), "python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "gpu": torch.cuda.get_device_name(), "sm_count":
           torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        import sglang

        out["sglang"] = sglang.__version__
    except ImportError:
        pass
    return out


def pyplot():
    """matplotlib.pyplot drawing to files, or None where matplotlib is absent (the plot is then skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def kv_tokens(server_log: Path) -> int | None:
    """The KV-cache tokens an SGLang server sized, from its log."""
    m = re.search(r"max_total_num_tokens=(\d+)", server_log.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def graph_use(server_log: Path) -> dict:
    """What an SGLang server's log says of its CUDA graphs: those it captured ("target decode", "draft decode",
    "target verify", ...), and of the decode batches it logged (every decode_log_interval steps, `cuda graph: True`
    or `False`) how many ran in one. A decode step outside its graph pays a host launch per kernel, a constant per
    step that tok/s alone cannot tell from slower kernels."""
    text = server_log.read_text(errors="replace")
    ran = re.findall(r"Decode batch\b.*?cuda graph: (True|False)", text)
    return {"graphs": sorted(set(re.findall(r"Capture (.+?) CUDA graph end", text))),
            "decode_logs_in_graph": ran.count("True"), "decode_logs_eager": ran.count("False")}


def gpu_workdir(script: str, workdir: str) -> Path | None:
    """A served benchmark's scratch folder, or None (after saying why) where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return None
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    return work


def publish_sglang_args() -> None:
    """Publish default server args and a one-rank TP group, as a server does before any layer runs: SGLang's
    kernels outside a server fail without them (fused_experts reads its `exec` config namespace and asks for the
    TP group). The tiny EXL3 fixture is the model. Once per process."""
    from sglang.srt.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_exl3.integration.server import free_port

    load_plugins()
    tiny = Path(__file__).resolve().parents[1] / "tests/data/exllamav3/tiny-llama-mul1-4bpw"
    set_global_server_args_for_scheduler(ServerArgs(model_path=str(tiny)))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    if not model_parallel_is_initialized():  # tests/sglang_cpu.py may have set it up in this process
        initialize_model_parallel(tensor_model_parallel_size=1)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def capture_graph(fn, rotations: int, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn(i) cycling over `rotations` input sets, replayed once. Anything that
    autotunes or allocates on first use runs before the capture."""
    for i in range(max(rotations, 3)):
        fn(i % rotations)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % rotations)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % rotations)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fn, rotations: int = 1, calls: int = 24, replays: int = 7) -> float:
    """Median time of one fn(i) call in microseconds, from CUDA-graph replays of `calls` calls cycling over
    `rotations` input sets: launch and Python overheads drop out, as they do under SGLang's CUDA graphs."""
    graph = capture_graph(fn, rotations, calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    del graph
    return times[len(times) // 2]


def eager_us(fn, rotations: int = 1, calls: int = 50) -> float:
    """Median time of one fn(i) call in microseconds, timed eagerly call by call (CUDA events): for code that
    cannot be captured, measured the way it runs."""
    for i in range(max(rotations, 3)):
        fn(i % rotations)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(calls):
        start.record()
        fn(i % rotations)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', the suffix of every results file."""
    return name.replace("NVIDIA ", "").replace(" ", "-").lower()


def write_results(name: str, head: dict, rows: list[dict], columns: list[str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{gpu_slug(head['gpu'])}.json"
    path.write_text(json.dumps({"header": head, "rows": rows}, indent=1))
    lines = [f"# {name} on {head['gpu']}", "", f"`{head['command']}` — torch {head['torch']}, "
             f"triton {head['triton']}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stderr)
    return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2e}" if 0 < abs(v) < 0.01 else f"{v:.2f}"
    return "" if v is None else str(v)
