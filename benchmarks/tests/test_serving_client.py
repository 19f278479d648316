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


def test_graph_use_reads_the_capture_and_decode_lines_of_a_server_log(tmp_path):
    """The decode lines are checked against SGLang's own log parser, so a change of its format fails here rather than
    leaving a benchmark's graph columns silently at zero."""
    import re

    from sglang.srt.debug_utils.log_parser import _PATTERN_DECODE

    from benchmarks.common import graph_use

    decode = ("[2026-12-07 10:00:0{}] Decode batch, #running-req: 1, #token: 300, token usage: 0.00, cuda graph: {}, "
              "gen throughput (token/s): 512.00, #queue-req: 0, ")
    lines = ["[2026-12-07 10:00:00] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
             "bs=[1, 2, 4], avail mem=10.00 GB",
             "[2026-12-07 10:00:01] Capture target decode CUDA graph end. elapsed=1.00 s, mem usage=0.10 GB, "
             "avail mem=9.90 GB.",
             "[2026-12-07 10:00:02] Capture draft decode CUDA graph end. elapsed=1.00 s, mem usage=0.10 GB, "
             "avail mem=9.80 GB.",
             decode.format(3, True), decode.format(4, False), decode.format(5, True)]
    assert all(re.search(_PATTERN_DECODE, line) for line in lines[3:])
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    assert graph_use(log) == {"graphs": ["draft decode", "target decode"], "decode_logs_in_graph": 2,
                              "decode_logs_eager": 1}
    log.write_text(lines[0] + "\n")  # a capture that never ended
    assert graph_use(log) == {"graphs": [], "decode_logs_in_graph": 0, "decode_logs_eager": 0}
