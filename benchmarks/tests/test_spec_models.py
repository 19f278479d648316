"""The speculative-decoding benchmark's training recipe (benchmarks/spec_models.py) at tiny sizes on the CPU: the
training-time-test attention is the attention SGLang's draft steps compute, the whole recipe writes what the benchmark
reads, and the EAGLE3 head it writes loads into SGLang's own LlamaForCausalLMEagle3 with every parameter set."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import spec_models as sm

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32)


def naive_ttt(q, k1, v1, chain_k, chain_v):
    """Position by position: step-1 keys of positions <= j, then j's own chain keys."""
    out = torch.empty_like(q)
    for j in range(q.shape[2]):
        keys = torch.cat([k1[:, :, : j + 1], *(k[:, :, j:j + 1] for k in chain_k)], dim=2)
        values = torch.cat([v1[:, :, : j + 1], *(v[:, :, j:j + 1] for v in chain_v)], dim=2)
        p = (q[:, :, j:j + 1] @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        out[:, :, j:j + 1] = p @ values
    return out


@pytest.mark.parametrize("chain", [0, 1, 3])
def test_ttt_attention_matches_per_position_attention(chain):
    g = torch.Generator().manual_seed(chain)
    q, k1, v1 = (torch.randn(2, 3, 7, 16, generator=g, dtype=torch.float64) for _ in range(3))
    chain_k = [torch.randn(2, 3, 7, 16, generator=g, dtype=torch.float64) for _ in range(chain)]
    chain_v = [torch.randn(2, 3, 7, 16, generator=g, dtype=torch.float64) for _ in range(chain)]
    torch.testing.assert_close(sm.ttt_attention(q, k1, v1, chain_k, chain_v), naive_ttt(q, k1, v1, chain_k, chain_v))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The whole recipe at tiny sizes, one second per model, on a corpus shaped like --collect's."""
    import random

    texts, out = tmp_path_factory.mktemp("texts"), tmp_path_factory.mktemp("models")
    rng = random.Random(0)
    words = "thou art my lord and I shall speak of honour love death crown night".split()
    for name in ("lear_gut.txt", *sm.VALIDATION, *sm.HELD_OUT):
        lines = [f"{rng.choice(words).upper()}. " + " ".join(rng.choices(words, k=12)) for _ in range(400)]
        (texts / name).write_text("\n".join(lines))
    for i in range(2 * sm.CODE_HOLD_OUT):
        body = "\n".join(f"    x{j} = f(x{j - 1}, {rng.randrange(99)})" for j in range(1, 200))
        (texts / f"mod{i:02d}.py").write_text(f"def g{i}(x0):\n{body}\n    return x199\n")
    patch = pytest.MonkeyPatch()
    for name, value in dict(VOCAB=512, SEQ=64, PROMPT_TOKENS=24, TARGET=TINY, SMALL=dict(TINY, num_hidden_layers=1),
                            EAGLE_STEPS=2).items():
        patch.setattr(sm, name, value)
    patch.setattr("sys.argv", ["spec_models.py", str(texts), str(out), "--target-s", "1", "--small-s", "1",
                               "--eagle-s", "1"])
    try:
        assert sm.main() == 0
    finally:
        patch.undo()
    return out


def test_the_recipe_writes_what_the_benchmark_reads(trained):
    for folder in ("target", "small", "eagle3"):
        assert (trained / folder / "config.json").exists() and (trained / folder / "tokenizer.json").exists()
    prompts = json.loads((trained / "prompts.json").read_text())
    assert set(prompts) == {"low_entropy", "mixed", "high_entropy"}
    assert all(len(v) == sm.PROMPTS_PER_CATEGORY and all(v) for v in prompts.values())
    rows = [json.loads(line) for line in (trained / "speed-bench.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * sm.PROMPTS_PER_CATEGORY and all(set(r) == {"category", "turns"} for r in rows)
    report = json.loads((trained / "train.json").read_text())
    assert report["target_log"][-1]["tokens"] > 0 and len(report["eagle3_held_out_agree"]) == 2
    for name in ("target", "small"):  # the weights kept are those of the lowest validation loss seen
        log = report[f"{name}_log"]
        seen = [e["validation_loss"] for e in log[:-1] if "validation_loss" in e]
        assert log[-1]["validation_loss"] == min(seen) and len(seen) >= 2


def test_the_eagle3_head_loads_into_sglang(trained):
    from sglang_cpu import load_as_server, sglang_runtime

    sglang_runtime()
    model, cfg = load_as_server(trained / "eagle3", dtype=torch.bfloat16)
    assert cfg is None and type(model).__name__ == "LlamaForCausalLMEagle3"
    assert model.load_lm_head_from_target  # no head of its own: the target's (an EXL3 one included) is handed over
    saved = load_file(str(trained / "eagle3" / "model.safetensors"))
    params = dict(model.named_parameters())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, p in params.items():
        if name.startswith("lm_head"):
            continue
        key = name.removeprefix("model.")
        parts = next(((f, ps) for f, ps in fused.items() if f in key), None)
        want = (torch.cat([saved[key.replace(parts[0], s)] for s in parts[1]]) if parts else saved[key])
        torch.testing.assert_close(p.data, want, rtol=0, atol=0, msg=name)
    config = json.loads((trained / "eagle3" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]


# SGLang's benchmark with its run replaced by the part before the first request: the dataset as it would be sent.
READ_SPEED_BENCH = """import json, sys
import sglang.benchmark.serving as serving
def read(args):
    rows = serving.get_dataset(args, serving.get_tokenizer(args.tokenizer))
    print(json.dumps([len(rows), min(r.prompt_len for r in rows), max(r.prompt_len for r in rows), rows[0].output_len]))
serving.run_benchmark = read
serving.cli_main()
"""


@pytest.mark.parametrize("category", ["low_entropy", "mixed", "high_entropy"])
def test_sglangs_speed_bench_reads_what_the_recipe_wrote(trained, tmp_path, category):
    """The benchmark's SPEED-Bench command through SGLang's own argument parser, tokenizer loader and SPEED-Bench
    reader, on the recipe's file and target tokenizer: each category yields its prompts, tokenized (only the requests,
    which need a server, are left out)."""
    from benchmarks.serving_client import bench_env
    from benchmarks.spec_decode import DECODE_TOKENS, SPEED_BENCH_PROMPTS, speed_bench_command

    cmd = speed_bench_command("http://127.0.0.1:9", trained, category, tmp_path / "out.jsonl")
    assert cmd[1:3] == ["-m", "sglang.benchmark.serving"]
    done = subprocess.run([cmd[0], "-c", READ_SPEED_BENCH, *cmd[3:]], env=bench_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    count, shortest, longest, output_len = json.loads(done.stdout.strip().splitlines()[-1])
    assert (count, output_len) == (SPEED_BENCH_PROMPTS, DECODE_TOKENS)
    assert 0 < shortest <= longest <= sm.SEQ


def test_a_missing_held_out_play_stops_the_recipe(tmp_path):
    (tmp_path / "lear_gut.txt").write_text("LEAR. Speak.")
    (tmp_path / "mod.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="held-out plays .*hamlet_gut.txt"):
        sm.split_corpus(tmp_path)


def test_the_fixture_shape_for_profiling_is_the_trained_target():
    """e2e --shape llama-spec-target profiles a random-trellis model of the trained target's dimensions: they must
    not drift apart."""
    from sglang_exl3.synth.exl3_writer import SHAPES

    arch, dims = SHAPES["llama-spec-target"]
    assert arch == "llama" and dims.vocab_size == sm.VOCAB
    assert {k: getattr(dims, k) for k in sm.TARGET} == sm.TARGET
