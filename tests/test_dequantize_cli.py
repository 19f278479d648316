"""`python -m sglang_exl3 dequantize` and `inspect` on real exllamav3 output, end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, DENSE_CKPTS, EXLLAMAV3_CKPTS, fp16_ulp_distance

CLI = [sys.executable, "-m", "sglang_exl3"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True)


@pytest.mark.parametrize("ckpt", DENSE_CKPTS, ids=lambda p: p.name)
def test_dequantize_fp16_is_within_2_ulps_of_exllamav3(ckpt, tmp_path):
    out = tmp_path / "dq"
    proc = run("dequantize", str(ckpt), str(out), "--dtype", "float16", "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    written = load_file(str(out / "model.safetensors"))
    oracle = load_file(str(ckpt / "oracle" / "exllamav3_oracle.safetensors"))
    keys = [k for k in oracle if k.endswith(".weight")]
    assert keys
    for key in keys:
        ours = written[key]
        assert ours.dtype == torch.float16
        assert ours.shape == oracle[key].T.shape  # HF orientation [out, in]; tiny dims need no trim
        assert fp16_ulp_distance(ours.T, oracle[key]).max() <= 2, key
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float16"
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert not (out / "quantization_config.json").exists()
    embed = written["model.embed_tokens.weight"]
    assert embed.dtype == torch.float16


def test_dequantized_model_reproduces_exllamav3_logits(tmp_path):
    """The dequantized checkpoint runs in transformers and gives exllamav3's own logits."""
    from transformers import AutoModelForCausalLM

    for name in ("tiny-qwen3-mul1-2.5bpw", "tiny-mixtral-mcg-3bpw"):
        ckpt, out = DATA / "exllamav3" / name, tmp_path / name
        assert run("dequantize", str(ckpt), str(out), "--quiet", "--device", "cpu").returncode == 0
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        oracle = load_file(str(ckpt / "oracle" / "exllamav3_oracle.safetensors"))
        with torch.no_grad():
            logits = model(oracle["input_ids"]).logits
        ref = oracle["logits"]
        assert ((logits - ref).norm() / ref.norm()) < 1e-2
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_dequantize_bf16_and_refuses_non_empty_out(tmp_path):
    ckpt = EXLLAMAV3_CKPTS[0]
    out = tmp_path / "dq"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run("dequantize", str(ckpt), str(out), "--quiet")
    assert proc.returncode == 1 and "is not empty" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    out2 = tmp_path / "dq2"
    assert run("dequantize", str(ckpt), str(out2), "--dtype", "bfloat16", "--quiet").returncode == 0
    written = load_file(str(out2 / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in written.values())


def test_dequantize_trims_padding_and_legacy_signs(tmp_path):
    """k/v of one 64-wide KV head are padded to 128 in EXL3; the HF weight must be [64, hidden]."""
    from conftest import mutate
    from sglang_exl3.codec import dequantize_weight, unpack_sign_bits
    from sglang_exl3.format import load_checkpoint
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    dims = ModelDims(num_hidden_layers=1, num_key_value_heads=1, vocab_size=1000)
    ckpt = write_exl3_checkpoint(tmp_path / "c", "llama", dims=dims, bits=3, codebook="mcg",
                                 with_tokenizer=False)
    key = "model.layers.0.self_attn.k_proj"
    su = torch.randint(-32768, 32768, (16,), dtype=torch.int16)

    def to_legacy(t, s, c):
        t[f"{key}.su"] = su
        del t[f"{key}.suh"]
        stored = s["tensor_storage"][key]["stored_tensors"]
        stored[f"{key}.su"] = {**stored.pop(f"{key}.suh"), "shape": [16], "dtype": "torch.int16"}

    mutate(ckpt, to_legacy)
    dequantize_checkpoint(ckpt, tmp_path / "out", progress=False)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written[key + ".weight"].shape == (64, 256)
    assert written["lm_head.weight"].shape == (1000, 256)
    t = load_checkpoint(ckpt).load_module(key)
    expected = dequantize_weight(t["trellis"], unpack_sign_bits(su), t["svh"],
                                 load_checkpoint(ckpt).modules[key].codebook)
    assert torch.equal(written[key + ".weight"], expected[:, :64].T)


def test_dequantize_rejects_invalid_checkpoint_before_writing(tmp_path, tiny_ckpt):
    (tiny_ckpt / "quantization_config.json").write_text("{}")
    out = tmp_path / "dq"
    proc = run("dequantize", str(tiny_ckpt), str(out), "--quiet")
    assert proc.returncode == 1 and "tensor_storage" in proc.stderr
    assert not out.exists()


def test_inspect_reports_and_exit_codes(tiny_ckpt):
    ckpt = EXLLAMAV3_CKPTS[0]
    proc = run("inspect", str(ckpt))
    assert proc.returncode == 0, proc.stdout
    assert "LlamaForCausalLM" in proc.stdout and "no problems found" in proc.stdout
    proc = run("inspect", str(ckpt), "--json")
    summary = json.loads(proc.stdout)
    assert summary["exl3_modules"] == 15 and summary["problems"] == []
    assert summary["modules"]["lm_head"]["bits"] == 6
    (tiny_ckpt / "model.safetensors").rename(tiny_ckpt / "other.bin")
    proc = run("inspect", str(tiny_ckpt))
    assert proc.returncode == 1
    assert "PROBLEMS" in proc.stdout and "missing from the safetensors files" in proc.stdout


def test_dequantize_writes_sharded_output_with_index(tmp_path):
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    ckpt = EXLLAMAV3_CKPTS[0]
    summary = dequantize_checkpoint(ckpt, tmp_path / "dq", max_shard_bytes=1 << 20, progress=False)
    assert len(summary["shards"]) > 1
    index = json.loads((tmp_path / "dq" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(summary["shards"])
    single = tmp_path / "dq1"
    dequantize_checkpoint(ckpt, single, progress=False)
    whole = load_file(str(single / "model.safetensors"))
    assert set(index["weight_map"]) == set(whole)
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / "dq" / file))[name], whole[name])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_dequantized_checkpoint_loads_in_transformers_without_missing_keys(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    dims = ModelDims(num_hidden_layers=1, num_key_value_heads=1, vocab_size=1000)  # padded k/v and vocab
    ckpt = write_exl3_checkpoint(tmp_path / "c", arch, dims=dims, bits=3, codebook="mcg")
    dequantize_checkpoint(ckpt, tmp_path / "dq", dtype="bfloat16", progress=False)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "dq", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 1000) and torch.isfinite(logits).all()


def test_dequantize_rank_sliced_joins_the_slices_into_whole_experts(tmp_path):
    """A rank-sliced checkpoint (tp=2, per-expert rotations) dequantizes to exactly the weights of the per-expert
    checkpoint its slices were cut from (128-column slices commute with the block Hadamards), and the result
    loads in transformers with no missing or unexpected keys."""
    from transformers import AutoModelForCausalLM

    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    dims = ModelDims(num_hidden_layers=1)
    sliced = write_rank_sliced_checkpoint(tmp_path / "rs", dims=dims, bits=3, tp=2, seed=4)
    full = write_exl3_checkpoint(tmp_path / "full", "qwen3_moe", dims=dims, bits=3, codebook="mcg", seed=4,
                                 with_tokenizer=False)
    dequantize_checkpoint(sliced, tmp_path / "dq-rs", progress=False)
    dequantize_checkpoint(full, tmp_path / "dq-full", progress=False)
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("dq-rs", "dq-full"))
    assert set(got) == set(want)
    experts = [n for n in want if ".experts." in n]
    assert len(experts) == 4 * 3
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert "hybrid_tr3_tail" not in json.loads((tmp_path / "dq-rs" / "config.json").read_text())
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "dq-rs", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("option, value", [("--layers", "-1"), ("--layers", "0"), ("--kv-heads", "two")])
def test_write_fixture_refuses_a_non_positive_override(tmp_path, option, value):
    """A shape override must be a positive count: said by argparse, naming the option, and nothing is written."""
    out = tmp_path / "fixture"
    r = run("write-fixture", str(out), option, value)
    assert r.returncode == 2 and f"argument {option}: must be a positive integer" in r.stderr
    assert not out.exists()


def test_a_weightless_twin_is_the_config_and_side_files_only(tmp_path):
    """The speed-only twin (served with --load-format dummy): the dequantized checkpoint's config (no quantization
    block, bf16) and tokenizer, no weights; it refuses a folder that is not empty."""
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint
    from sglang_exl3.tools.dequantize import write_weightless_twin

    ckpt = write_exl3_checkpoint(tmp_path / "c", "qwen3_moe", dims=ModelDims(num_hidden_layers=1, vocab_size=512),
                                 bits=4, codebook="mcg")
    twin = write_weightless_twin(ckpt, tmp_path / "twin")
    config = json.loads((twin / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["architectures"] == json.loads((ckpt / "config.json").read_text())["architectures"]
    assert (twin / "tokenizer.json").exists() and not list(twin.glob("*.safetensors*"))
    assert not (twin / "quantization_config.json").exists()
    with pytest.raises(FileExistsError, match="not empty"):
        write_weightless_twin(ckpt, twin)
