"""benchmarks/moe.py's layer shapes on the CPU: --shape points every function at that layer and names its results
file after it; the one-layer checkpoints (--ckpt-dir) exist only for the Qwen3-30B-A3B layer, so another shape with
them is refused before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks import moe


def test_shape_sets_the_layer_and_the_results_name():
    try:
        moe.use_shape("mixtral-8x7b")
        assert (moe.HIDDEN, moe.EXPERTS, moe.INTER, moe.TOPK) == (4096, 8, 14336, 2)
        experts = moe.random_expert_tensors(2)
        assert len(experts) == 8 and experts[0]["w2"][0].shape == (14336 // 16, 4096 // 16, 32)
        assert moe.results_name("mixtral-8x7b") == "moe-mixtral-8x7b"
    finally:
        moe.use_shape("qwen3-30b-a3b")
    assert (moe.HIDDEN, moe.EXPERTS, moe.INTER, moe.TOPK) == (2048, 128, 768, 8)
    assert moe.results_name("qwen3-30b-a3b") == "moe"


def test_checkpoints_only_for_the_qwen3_layer(tmp_path):
    script = Path(moe.__file__)
    run = subprocess.run([sys.executable, str(script), "--shape", "mixtral-8x7b", "--ckpt-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--ckpt-dir writes Qwen3-30B-A3B layers" in run.stderr
    assert not any(tmp_path.iterdir())


def test_fastest_forward_names_what_the_dispatch_left_on_the_table():
    """On the committed Mixtral-layer rows (H100): at 2 rows the per-pair sources beat the sorted tiles the dispatch
    chose, at 8 the sorted forward run stage by stage; rows without --both-paths columns get nothing."""
    import json

    rows = {r["m"]: r for r in json.loads((moe.RESULTS / "moe-mixtral-8x7b-h100-80gb-hbm3.json").read_text())["rows"]}
    two, eight = moe.fastest_forward(rows[2]), moe.fastest_forward(rows[8])
    assert two["fastest"] == "pairs" and two["ours_over_fastest"] == rows[2]["ours_us"] / rows[2]["ours_pairs_us"]
    assert eight["fastest"] == "sorted_staged" and eight["ours_over_fastest"] > 1.1
    assert moe.fastest_forward({"m": 1, "ours_us": 10.0}) == {}
    assert moe.fastest_forward({"m": 1, "ours_us": 10.0, "ours_decode_us": 10.0})["ours_over_fastest"] == 1.0
