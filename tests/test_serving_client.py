"""SGLang's load generator as the benchmarks run it (CPU): its command imports with the `datasets` stand-in, uses
the model's own tokenizer, and its summary is read from the last line it appends."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.serving_client import bench_command, bench_env, last_result


def test_sglangs_benchmark_imports_with_the_stand_in(tmp_path):
    """`python -m sglang.benchmark.serving` imports `datasets` at module level; where it is absent the stub must be
    enough for the random-ids dataset (`--help` imports the whole module)."""
    done = subprocess.run([sys.executable, "-m", "sglang.benchmark.serving", "--help"], env=bench_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--dataset-name" in done.stdout


def test_the_command_uses_the_models_tokenizer_and_fixed_lengths(tmp_path):
    cmd = bench_command(tmp_path / "model", "127.0.0.1", 30000, 64, 16, 512, 128, 1.0, tmp_path / "out.jsonl")
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[1:3] == ["-m", "sglang.benchmark.serving"]
    assert args["--tokenizer"] == args["--model"] == str(tmp_path / "model")
    assert (args["--dataset-name"], args["--max-concurrency"], args["--random-range-ratio"]) == ("random-ids", "16",
                                                                                                  "1.0")
    assert "--tokenize-prompt" in cmd  # ids as ids: as text they were re-tokenized past the context


def test_the_summary_is_the_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    assert last_result(out) == {}
    out.write_text(json.dumps({"output_throughput": 1.0}) + "\n" + json.dumps({"output_throughput": 2.0}) + "\n")
    assert last_result(out) == {"output_throughput": 2.0}
