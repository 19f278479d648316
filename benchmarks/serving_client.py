"""SGLang's own load generator (`python -m sglang.benchmark.serving`, random-ids) against a running server, as a
user benchmarks one: the command, the `datasets` stand-in it needs where that package is absent, and its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def datasets_stub(work: Path) -> str:
    """SGLang's benchmark imports `datasets` (for other datasets than random-ids); a stub where it is absent."""
    try:
        import datasets  # noqa: F401
        return ""
    except ImportError:
        stub = work / "stub" / "datasets"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text("def load_dataset(*args, **kwargs):\n"
                                          "    raise RuntimeError('datasets is not installed')\n")
        return str(stub.parent)


def bench_command(path: Path, host: str, port: int, prompts: int, concurrency: int, input_len: int, output_len: int,
                  range_ratio: float, out_file: Path) -> list[str]:
    """random-ids prompts sent as token ids (`--tokenize-prompt`: as text, a fixture's small tokenizer re-tokenized
    512 random ids into 4-8k tokens, past the context, and the server refused them); the tokenizer is the model's own
    (one smaller than the vocabulary miscounts tokens)."""
    return [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", host, "--port",
            str(port), "--model", str(path), "--tokenizer", str(path), "--dataset-name", "random-ids",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--random-input-len",
            str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", str(range_ratio),
            "--tokenize-prompt", "--output-file", str(out_file), "--output-details", "--disable-tqdm", "--seed", "1"]


def bench_env(work: Path) -> dict:
    stub = datasets_stub(work)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (stub, os.environ.get("PYTHONPATH")) if p)}


def last_result(out_file: Path) -> dict:
    """The benchmark's summary: the last line it appended to its output file ({} if it wrote none)."""
    lines = out_file.read_text().strip().splitlines() if out_file.exists() else []
    return json.loads(lines[-1]) if lines else {}


def serving_throughput(path: Path, port: int, concurrency: int, work: Path, input_len: int = 512,
                       output_len: int = 128, timeout: float = 300) -> dict:
    """Output tokens/s (and mean TTFT / ITL) of max(16, 4 x concurrency) random-ids requests of exactly input_len /
    output_len tokens at that concurrency; None values where any request failed (its log is kept in `work`)."""
    out_file = work / f"serving-{port}-c{concurrency}.jsonl"
    out_file.unlink(missing_ok=True)
    prompts = max(16, 4 * concurrency)
    cmd = bench_command(path, "127.0.0.1", port, prompts, concurrency, input_len, output_len, 1.0, out_file)
    with open(work / f"serving-{port}-c{concurrency}.log", "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=bench_env(work), timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    result = last_result(out_file)
    if result.get("completed") != prompts:  # a run that lost requests measured something else: no numbers
        print(f"serving at concurrency {concurrency}: {result.get('completed')} of {prompts} requests completed; "
              f"see {work / f'serving-{port}-c{concurrency}.log'}", file=sys.stderr)
        return {"output_tok_s": None, "mean_ttft_ms": None, "mean_itl_ms": None, "completed": result.get("completed")}
    return {"output_tok_s": result.get("output_throughput"), "mean_ttft_ms": result.get("mean_ttft_ms"),
            "mean_itl_ms": result.get("mean_itl_ms"), "completed": prompts}
