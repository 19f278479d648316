"""Every validation rule: feed the bad input, check the specific message (and that it names where)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import mutate
from sglang_exl3.format import Codebook, Exl3FormatError, load_checkpoint
from sglang_exl3.format.constants import EMPTY_STORAGE_MESSAGE, MCG_MULTIPLIER

Q = "model.layers.0.self_attn.q_proj"  # 256 x 256, MUL1, 4 bits in the tiny fixture


def _set(name, value):
    def fn(t, s, c):
        t[name] = value
    return fn


def _drop(name):
    def fn(t, s, c):
        del t[name]
        for entry in s["tensor_storage"].values():
            entry["stored_tensors"].pop(name, None)
    return fn


def _listed(name, value):
    """Add a tensor that the module's sidecar entry lists too (as exllamav3 writes legacy signs and biases)."""
    def fn(t, s, c):
        t[name] = value
        s["tensor_storage"][Q]["stored_tensors"][name] = {"shape": list(value.shape), "dtype": str(value.dtype)}
    return fn


def _replace(name, value):
    """Change a tensor and keep the sidecar's shape in step, so only the tensor rule fires."""
    def fn(t, s, c):
        t[name] = value
        for entry in s["tensor_storage"].values():
            if name in entry["stored_tensors"]:
                entry["stored_tensors"][name]["shape"] = list(value.shape)
                entry["stored_tensors"][name]["dtype"] = str(value.dtype)
    return fn


def _storage(update):
    def fn(t, s, c):
        update(s["tensor_storage"][Q])
    return fn


def _signs(n: int) -> torch.Tensor:
    return torch.randint(-32768, 32768, (n // 16,), dtype=torch.int16)


def _both(*fns):
    def fn(t, s, c):
        for f in fns:
            f(t, s, c)
    return fn


def _move_to_mcg_marker(t, s, c):
    del t[f"{Q}.mul1"]
    t[f"{Q}.mcg"] = torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32)
    entry = s["tensor_storage"][Q]
    entry.pop("mul1_multiplier")
    entry["mcg_multiplier"] = MCG_MULTIPLIER
    entry["stored_tensors"][f"{Q}.mcg"] = entry["stored_tensors"].pop(f"{Q}.mul1")


CASES = {
    "trellis not int16": (_replace(f"{Q}.trellis", torch.zeros(16, 16, 64, dtype=torch.int32)),
                          f"{Q}.trellis: trellis must be int16, got torch.int32"),
    "trellis rank 2": (_replace(f"{Q}.trellis", torch.zeros(16, 1024, dtype=torch.int16)),
                       f"{Q}.trellis: trellis must have rank 3"),
    "bits 9": (_both(_replace(f"{Q}.trellis", torch.zeros(16, 16, 144, dtype=torch.int16)),
                     _storage(lambda e: e.update(bits_per_weight=9))),
               "last dimension 144 is not 16*bits for bits in 1..8"),
    "odd words": (_both(_replace(f"{Q}.trellis", torch.zeros(16, 16, 60, dtype=torch.int16)),
                        _storage(lambda e: e.pop("bits_per_weight"))),
                  "last dimension 60 is not 16*bits"),
    "half rate without mul1": (_both(_move_to_mcg_marker,
                                     _replace(f"{Q}.trellis", torch.zeros(16, 16, 40, dtype=torch.int16)),
                                     _storage(lambda e: e.update(bits_per_weight=2.5))),
                               "half-bit rate 2.5 needs the mul1 codebook"),
    "half rate 4.5": (_replace(f"{Q}.trellis", torch.zeros(16, 16, 72, dtype=torch.int16)),
                      "last dimension 72 is not 16*bits"),
    "K not 128-aligned": (_both(_replace(f"{Q}.trellis", torch.zeros(12, 16, 64, dtype=torch.int16)),
                                _replace(f"{Q}.suh", torch.ones(192, dtype=torch.float16))),
                          "packed K (in features) = 192 is not a multiple of 128"),
    "N not 128-aligned": (_both(_replace(f"{Q}.trellis", torch.zeros(16, 12, 64, dtype=torch.int16)),
                                _replace(f"{Q}.svh", torch.ones(192, dtype=torch.float16))),
                          "packed N (out features) = 192 is not a multiple of 128"),
    "suh wrong length": (_replace(f"{Q}.suh", torch.ones(128, dtype=torch.float16)),
                         f"{Q}.suh: must be fp16 [256] (K), got torch.float16 [128]"),
    "svh wrong dtype": (_replace(f"{Q}.svh", torch.ones(256, dtype=torch.bfloat16)),
                        f"{Q}.svh: must be fp16 [256] (N), got torch.bfloat16 [256]"),
    "svh missing": (_drop(f"{Q}.svh"), f"{Q}.svh: missing svh (or legacy sv)"),
    "suh missing": (_drop(f"{Q}.suh"), f"{Q}.suh: missing suh (or legacy su)"),
    "legacy su wrong length": (_both(_drop(f"{Q}.suh"), _set(f"{Q}.su", _signs(128))),
                               f"{Q}.su: legacy sign bitfield must be int16 [16], got torch.int16 [8]"),
    "suh and su": (_set(f"{Q}.su", _signs(256)), f"{Q}.su: both suh and legacy su present"),
    "marker wrong value": (_set(f"{Q}.mul1", torch.tensor(12345, dtype=torch.int32)),
                           f"{Q}.mul1: codebook marker holds 0x3039, expected 0x83dcd12d"),
    "marker not scalar": (_replace(f"{Q}.mul1", torch.tensor([-2082680531], dtype=torch.int32)),
                          f"{Q}.mul1: codebook marker must be a scalar int32, got torch.int32 [1]"),
    "marker wrong dtype": (_replace(f"{Q}.mul1", torch.tensor(-2082680531, dtype=torch.int64)),
                           "codebook marker must be a scalar int32, got torch.int64 []"),
    "both markers": (_set(f"{Q}.mcg", torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32)),
                     "both mcg and mul1 markers present"),
    "bias wrong length": (_set(f"{Q}.bias", torch.zeros(100, dtype=torch.float16)),
                          f"{Q}.bias: bias must be a float vector of length N=256"),
    "bias int": (_set(f"{Q}.bias", torch.zeros(256, dtype=torch.int32)),
                 "bias must be a float vector of length N=256, got torch.int32"),
    "trellis missing": (_drop(f"{Q}.trellis"), f"{Q}.trellis: EXL3 module has no trellis tensor"),
    "unexpected tensor": (_set(f"{Q}.scale", torch.ones(1)), f"{Q}.scale: unexpected tensor 'scale'"),
    "listed but missing": (lambda t, s, c: t.pop(f"{Q}.svh"),
                           f"{Q}.svh: listed in quantization_config.json but missing from the safetensors"),
    "sidecar shape mismatch": (_storage(lambda e: e["stored_tensors"][f"{Q}.suh"].update(shape=[512])),
                               f"{Q}.suh: shape [256] in the file but [512] in quantization_config.json"),
    "sidecar bits mismatch": (_storage(lambda e: e.update(bits_per_weight=3)),
                              "says bits_per_weight=3 but the trellis holds 4"),
    "sidecar multiplier mismatch": (_storage(lambda e: e.update(mcg_multiplier=MCG_MULTIPLIER)),
                                    "lists mcg_multiplier but the module lacks a .mcg marker"),
    "module not in sidecar": (lambda t, s, c: s["tensor_storage"].pop(Q),
                              f"{Q}: EXL3 tensors present but the module is not in quantization_config.json"),
    "empty tensor_storage": (lambda t, s, c: s.update(tensor_storage={}), EMPTY_STORAGE_MESSAGE),
    "tensor_storage absent": (lambda t, s, c: s.pop("tensor_storage"), EMPTY_STORAGE_MESSAGE),
    "no quantization_config": (lambda t, s, c: c.pop("quantization_config"),
                               "config.json has no quantization_config: this is not an EXL3 checkpoint"),
    "quantized embedding": (_both(_set("model.embed_tokens.trellis", torch.zeros(32, 16, 64, dtype=torch.int16)),
                                  _set("model.embed_tokens.signs", torch.zeros(256, dtype=torch.int16))),
                            "model.embed_tokens.signs: quantized embedding table"),
    "other quant_method": (lambda t, s, c: c["quantization_config"].update(quant_method="gptq"),
                           "quant_method is 'gptq', not 'exl3'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validation_rule(tiny_ckpt, case):
    fn, message = CASES[case]
    mutate(tiny_ckpt, fn)
    with pytest.raises(Exl3FormatError) as info:
        load_checkpoint(tiny_ckpt)
    assert message in str(info.value), str(info.value)
    assert any(message in str(p) for p in info.value.problems)
    # strict=False keeps the problems for `inspect` instead of raising
    assert load_checkpoint(tiny_ckpt, strict=False).problems


def test_valid_fixture_has_no_problems(tiny_ckpt):
    ckpt = load_checkpoint(tiny_ckpt)
    assert not ckpt.problems and len(ckpt.modules) == 8
    rec = ckpt.modules[Q]
    assert (rec.bits, rec.codebook, rec.in_features, rec.out_features) == (4, Codebook.MUL1, 256, 256)
    assert ckpt.modules["lm_head"].bits == 6


def test_legacy_signs_and_bias_are_accepted(tiny_ckpt):
    mutate(tiny_ckpt, _both(_drop(f"{Q}.suh"), _drop(f"{Q}.svh"), _listed(f"{Q}.su", _signs(256)),
                            _listed(f"{Q}.sv", _signs(256)), _set(f"{Q}.bias", torch.ones(256, dtype=torch.float32))))
    rec = load_checkpoint(tiny_ckpt).modules[Q]
    assert rec.legacy_signs and rec.has_bias


def test_half_rate_mul1_is_accepted(tiny_ckpt):
    mutate(tiny_ckpt, _both(_replace(f"{Q}.trellis", torch.zeros(16, 16, 56, dtype=torch.int16)),
                            _storage(lambda e: e.update(bits_per_weight=3.5))))
    assert load_checkpoint(tiny_ckpt).modules[Q].bits == 3.5


def test_no_exl3_records(tiny_ckpt):
    def strip(t, s, c):
        for name in [n for n in t if n.endswith((".trellis", ".suh", ".svh", ".mul1"))]:
            del t[name]
        s["tensor_storage"] = {k: {"stored_tensors": {n: v for n, v in e["stored_tensors"].items() if n in t}}
                               for k, e in s["tensor_storage"].items()}
    mutate(tiny_ckpt, strip)
    with pytest.raises(Exl3FormatError, match="has no EXL3 tensor records"):
        load_checkpoint(tiny_ckpt)


def test_every_problem_is_reported_at_once(tiny_ckpt):
    mutate(tiny_ckpt, _both(_set(f"{Q}.scale", torch.ones(1)),
                            _replace("model.layers.0.mlp.up_proj.suh", torch.ones(8, dtype=torch.float16))))
    with pytest.raises(Exl3FormatError) as info:
        load_checkpoint(tiny_ckpt)
    assert len(info.value.problems) == 2
    assert re.search(r"invalid \(2 problem\(s\)\)", str(info.value))


def test_missing_files(tmp_path, tiny_ckpt):
    with pytest.raises(Exl3FormatError, match="is not a directory"):
        load_checkpoint(tmp_path / "nope")
    (tiny_ckpt / "quantization_config.json").unlink()
    with pytest.raises(Exl3FormatError, match="quantization_config.json missing"):
        load_checkpoint(tiny_ckpt)
    (tiny_ckpt / "quantization_config.json").write_text("{not json")
    with pytest.raises(Exl3FormatError, match="cannot parse quantization_config.json"):
        load_checkpoint(tiny_ckpt)
    (tiny_ckpt / "model.safetensors").unlink()
    with pytest.raises(Exl3FormatError, match="no safetensors files found"):
        load_checkpoint(tiny_ckpt)
    (tiny_ckpt / "config.json").unlink()
    with pytest.raises(Exl3FormatError, match="config.json not found"):
        load_checkpoint(tiny_ckpt)


def test_sharded_checkpoint_with_index(tmp_path):
    from safetensors.torch import load_file, save_file

    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    ckpt = write_exl3_checkpoint(tmp_path / "c", "qwen3", dims=ModelDims(num_hidden_layers=1),
                                 with_tokenizer=False)
    tensors = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(ckpt / file))
        weight_map.update({n: file for n in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert len(load_checkpoint(ckpt).modules) == 8


@pytest.mark.parametrize("scale", ["suh", "svh"])
def test_exl3_record_must_list_its_scales(tiny_ckpt, scale):
    """The sidecar's record of an EXL3 module lists the trellis and both scales (the tensors may still be there)."""
    mutate(tiny_ckpt, _storage(lambda e: e["stored_tensors"].pop(f"{Q}.{scale}")))
    with pytest.raises(Exl3FormatError, match=rf"{Q}.{scale}: the EXL3 record in quantization_config.json does "
                                              rf"not list {scale} or {scale[:2]}\b"):
        load_checkpoint(tiny_ckpt)


def test_truncated_shard_is_named(tiny_ckpt):
    """A partial download: the file is named as truncated, and no misleading per-module problem follows."""
    shard = tiny_ckpt / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100_000])
    with pytest.raises(Exl3FormatError) as info:
        load_checkpoint(tiny_ckpt)
    (problem,) = info.value.problems
    assert "model.safetensors" in str(problem) and "the file is truncated" in str(problem)
    assert "copy the file again" in str(problem)


@pytest.mark.parametrize("cut, words", [(5, "fewer than the 8-byte length"), (20, "truncated or not a safetensors")])
def test_shard_cut_inside_its_header(tiny_ckpt, cut, words):
    shard = tiny_ckpt / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:cut])
    with pytest.raises(Exl3FormatError, match=f"model.safetensors: .*{words}"):
        load_checkpoint(tiny_ckpt)


def _rewrite_header(shard, edit):
    import struct

    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


@pytest.mark.parametrize("edit, words", [
    (lambda h: h[f"{Q}.suh"].update(dtype="F32"), rf"tensor {Q}.suh: data_offsets span 512 bytes, but F32 \[256\]"),
    (lambda h: h[f"{Q}.suh"].update(shape=[-1]), rf"tensor {Q}.suh: shape \[-1\] is not a list"),
    (lambda h: h[f"{Q}.suh"].update(data_offsets=[8, 4]), rf"tensor {Q}.suh: data_offsets \[8, 4\] is not"),
    (lambda h: h.update(extra=[1, 2]), "tensor extra: header entry is list, not an object"),
], ids=["dtype", "shape", "offsets", "entry"])
def test_malformed_header_entries_are_named(tiny_ckpt, edit, words):
    _rewrite_header(tiny_ckpt / "model.safetensors", edit)
    with pytest.raises(Exl3FormatError, match=f"model.safetensors, {words}"):
        load_checkpoint(tiny_ckpt)


def test_a_tensor_in_two_shards_is_refused(tiny_ckpt):
    from safetensors.torch import save_file

    save_file({f"{Q}.suh": torch.ones(256, dtype=torch.float16)}, str(tiny_ckpt / "zz-extra.safetensors"))
    with pytest.raises(Exl3FormatError, match=rf"zz-extra.safetensors, tensor {Q}.suh: holds {Q}.suh, which "
                                              r"model.safetensors holds too"):
        load_checkpoint(tiny_ckpt)


def test_index_naming_a_missing_shard(tiny_ckpt):
    (tiny_ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(Exl3FormatError, match="model-00002-of-00002.safetensors: is listed in "
                                              "model.safetensors.index.json but missing"):
        load_checkpoint(tiny_ckpt)
    (tiny_ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(Exl3FormatError, match=r"names the file '../x.safetensors', which is not a file beside it"):
        load_checkpoint(tiny_ckpt)


def test_bits_per_weight_must_be_a_number(tiny_ckpt):
    """Found by tests/test_fuzz.py: a bits_per_weight object raised TypeError in the comparison."""
    mutate(tiny_ckpt, _storage(lambda e: e.update(bits_per_weight={"4": 4})))
    with pytest.raises(Exl3FormatError, match=rf"{Q}: quantization_config.json says bits_per_weight={{'4': 4}}, "
                                              "which is not a number"):
        load_checkpoint(tiny_ckpt)
