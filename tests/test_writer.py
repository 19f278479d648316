"""The fixture writer produces exllamav3's exact on-disk layout (compared with converter output)."""

from __future__ import annotations

import json

import pytest

from conftest import DATA
from sglang_exl3.format import load_checkpoint
from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

# (our arch, exllamav3-made twin, its dims)
TWINS = [
    ("llama", "tiny-llama-mul1-4bpw", ModelDims(), 4, "mul1"),
    ("qwen3", "tiny-qwen3-mcg-4bpw", ModelDims(), 4, "mcg"),
    ("qwen3_moe", "tiny-qwen3moe-mul1-4bpw", ModelDims(), 4, "mul1"),
    ("mixtral", "tiny-mixtral-mcg-3bpw", ModelDims(intermediate_size=256), 3, "mcg"),
]


@pytest.mark.parametrize("arch, twin, dims, bits, cb", TWINS, ids=[t[0] for t in TWINS])
def test_layout_matches_exllamav3_converter(tmp_path, arch, twin, dims, bits, cb):
    ours = write_exl3_checkpoint(tmp_path / arch, arch, dims=dims, bits=bits, codebook=cb)
    theirs = DATA / "exllamav3" / twin
    ours_storage = json.loads((ours / "quantization_config.json").read_text())
    theirs_storage = json.loads((theirs / "quantization_config.json").read_text())
    assert ours_storage["tensor_storage"] == theirs_storage["tensor_storage"]  # keys, order, shapes, dtypes
    assert list(ours_storage["tensor_storage"]) == list(theirs_storage["tensor_storage"])
    ours_cfg = json.loads((ours / "config.json").read_text())
    theirs_cfg = json.loads((theirs / "config.json").read_text())
    assert set(ours_cfg["quantization_config"]) == set(theirs_cfg["quantization_config"])
    a, b = load_checkpoint(ours), load_checkpoint(theirs)
    assert {k: (m.bits, m.codebook, m.in_features, m.out_features) for k, m in a.modules.items()} == \
           {k: (m.bits, m.codebook, m.in_features, m.out_features) for k, m in b.modules.items()}
    assert {n: (a.tensors[n].dtype, a.tensors[n].shape) for n in a.plain_tensor_names()} == \
           {n: (b.tensors[n].dtype, b.tensors[n].shape) for n in b.plain_tensor_names()}


def test_writer_is_deterministic_and_seeded(tmp_path):
    a = write_exl3_checkpoint(tmp_path / "a", "llama", dims=ModelDims(num_hidden_layers=1), seed=1,
                              with_tokenizer=False)
    b = write_exl3_checkpoint(tmp_path / "b", "llama", dims=ModelDims(num_hidden_layers=1), seed=1,
                              with_tokenizer=False)
    c = write_exl3_checkpoint(tmp_path / "c", "llama", dims=ModelDims(num_hidden_layers=1), seed=2,
                              with_tokenizer=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_writer_tokenizer_and_half_rate(tmp_path):
    from transformers import AutoTokenizer

    ckpt = write_exl3_checkpoint(tmp_path / "t", "qwen3", dims=ModelDims(num_hidden_layers=1), bits=2.5,
                                 codebook="mul1")
    assert {m.bits for m in load_checkpoint(ckpt).modules.values()} == {2.5, 6}
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == 1024
    ids = tok("The quick brown fox")["input_ids"]
    assert tok.decode(ids) == "The quick brown fox"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>")


def test_writer_rejects_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture"):
        write_exl3_checkpoint(tmp_path / "x", "gpt2")
