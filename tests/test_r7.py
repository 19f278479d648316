"""R7 routed experts (`quantization_config.r7_routed_experts`): the block's every rejection, the name normalisation,
the per-expert checks, the writer, and the load through SGLang's real classes (a bad R7 layer stops the load naming
the tensor). The model-level equality with the dequantized twin is in test_model_vs_twin.py (`r7-per-projection-k`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import changed, mutate
from sglang_exl3.format import load_checkpoint, r7
from sglang_exl3.format.errors import Exl3FormatError

BLOCK = {"schema": r7.SCHEMA, "codebook": "mcg", "bits": "mixed_tensor", "moe_layers": [1, 2], "k_values": [5, 3, 3]}
PREFIX = "model.layers.0.mlp.experts"
HIDDEN = INTER = 256  # the tiny writer's hidden and moe_intermediate sizes


def block(**changes):
    return changed(BLOCK, **changes)


def test_block_parses_and_normalises_k_values():
    spec = r7.parse(block())
    assert spec.moe_layers == (1, 2) and spec.k_values == (3, 5)
    assert spec.covers(2) and not spec.covers(0) and not spec.covers(3)
    assert spec.covers_name("model.layers.1.mlp.experts.7.up_proj.trellis")
    assert not spec.covers_name("model.layers.1.self_attn.q_proj.trellis")
    assert not spec.covers_name("model.layers.3.mlp.experts.0.up_proj.trellis")


def test_claimed_under_another_quant_method():
    assert r7.claims({"quantization_config": {"quant_method": "modelopt", r7.BLOCK: block()}})
    assert r7.claims({"quant_method": "modelopt", r7.BLOCK: block()})  # the dict SGLang hands from_config
    assert not r7.claims({"quantization_config": {"quant_method": "exl3"}})


def test_the_hook_claims_r7_unless_another_method_is_asked_for():
    from types import SimpleNamespace

    from sglang_exl3.integration.hooks import _claimed_by_exl3

    hf = SimpleNamespace(quantization_config={"quant_method": "modelopt", r7.BLOCK: block()})
    assert _claimed_by_exl3(hf, None) and _claimed_by_exl3(hf, "exl3")
    assert not _claimed_by_exl3(hf, "fp8")
    assert not _claimed_by_exl3(SimpleNamespace(quantization_config={"quant_method": "modelopt"}), None)


@pytest.mark.parametrize("changes, message", [
    ({"schema": "r7-v1"}, "schema must be 'r7-complete-v2-checkpoint-v1'"),
    ({"schema": None}, "schema must be"),
    ({"codebook": "mul1"}, "codebook must be 'mcg'"),
    ({"bits": 4}, "bits must be 'mixed_tensor'"),
    ({"bits": "mixed"}, "bits must be 'mixed_tensor'"),
    ({"moe_layers": [2, 1]}, "moe_layers must be two JSON integers"),
    ({"moe_layers": [1]}, "moe_layers must be two JSON integers"),
    ({"moe_layers": [-1, 2]}, "moe_layers must be two JSON integers"),
    ({"moe_layers": [True, 2]}, "booleans and floats are refused"),
    ({"moe_layers": [1.0, 2]}, "booleans and floats are refused"),
    ({"moe_layers": "1-2"}, "moe_layers must be two JSON integers"),
    ({"moe_layers": None}, "moe_layers must be two JSON integers"),
    ({"k_values": []}, "k_values must be a non-empty list"),
    ({"k_values": [3, 6]}, "within [3, 4, 5]"),
    ({"k_values": [2]}, "within [3, 4, 5]"),
    ({"k_values": [True]}, "within [3, 4, 5]"),
    ({"k_values": [4.0]}, "within [3, 4, 5]"),
    ({"k_values": 4}, "k_values must be a non-empty list"),
])
def test_block_rejections(changes, message):
    with pytest.raises(r7.R7Error, match=message.replace("[", r"\[").replace("]", r"\]")):
        r7.parse(block(**changes))


def test_block_must_be_an_object():
    with pytest.raises(r7.R7Error, match="must be a JSON object"):
        r7.parse(["schema"])


def test_shared_rotations_load_under_expert_zero():
    spec = r7.parse(block())
    assert r7.normalize_weight_name("model.layers.1.mlp.experts.r7_shared.gate_up_suh", spec) == [
        "model.layers.1.mlp.experts.0.gate_proj.suh", "model.layers.1.mlp.experts.0.up_proj.suh"]
    assert r7.normalize_weight_name("model.layers.2.mlp.experts.r7_shared.down_svh", spec) == [
        "model.layers.2.mlp.experts.0.down_proj.svh"]
    for name in ("model.layers.1.mlp.experts.3.gate_proj.trellis", "model.layers.1.self_attn.q_proj.trellis",
                 "model.layers.0.mlp.experts.r7_shared.gate_up_suh"):  # outside the R7 layers: as it is
        assert r7.normalize_weight_name(name, spec) == [name]
    with pytest.raises(r7.R7Error, match="gate_up_suh and down_svh only"):
        r7.normalize_weight_name("model.layers.1.mlp.experts.r7_shared.down_suh", spec)


@pytest.fixture(scope="module")
def r7_ckpt(tmp_path_factory):
    from sglang_exl3.synth.r7_writer import write_r7_checkpoint

    return write_r7_checkpoint(tmp_path_factory.mktemp("r7") / "r7", seed=3)


def _records(tensors, **changes):
    spec = r7.parse(block(moe_layers=[0, 1], k_values=[3, 4, 5], **changes))
    return r7.expert_records(tensors, spec, PREFIX, 0, 4, HIDDEN, INTER)


def test_writer_layout_and_records(r7_ckpt):
    from sglang_exl3.synth.r7_writer import DEFAULT_PATTERN

    ckpt = load_checkpoint(r7_ckpt)
    config = json.loads((r7_ckpt / "config.json").read_text())
    assert config["quantization_config"][r7.BLOCK]["k_values"] == [3, 4, 5]
    assert not any(".mlp.experts." in k for k in ckpt.modules)  # R7 experts are no per-module records
    assert not any(".mlp.experts." in k for k in ckpt.tensor_storage)
    assert not any(".rank" in n for n in ckpt.tensors)
    assert not any(n.endswith(("gate_proj.suh", "up_proj.suh", "down_proj.svh")) for n in ckpt.tensors)
    records = _records(ckpt.tensors)
    assert len(records) == 4 * 3
    for (e, role), record in records.items():
        assert record.bits == DEFAULT_PATTERN[e % 4][("w1", "w3", "w2").index(role)]
        assert record.tensors["suh" if role != "w2" else "svh"].name.split(".")[-1] in ("gate_up_suh", "down_svh")
    tight, padded = r7.packed_bytes(records)
    per_k = HIDDEN * INTER // 256 * 16 * 2  # bytes of one projection's trellis per bit of K
    assert tight == sum(k for triple in DEFAULT_PATTERN for k in triple) * per_k
    assert padded == 12 * 5 * per_k


def test_dequantized_experts_use_the_layer_rotation(r7_ckpt, tmp_path):
    """Each twin weight is trellis + the expert's own intermediate-side scale + the layer's shared hidden-side one,
    read here by name, independently of expert_records."""
    from safetensors.torch import load_file

    from sglang_exl3.codec.weight import dequantize_weight
    from sglang_exl3.format import Codebook
    from sglang_exl3.tools.dequantize import dequantize_checkpoint

    dequantize_checkpoint(r7_ckpt, tmp_path / "twin", progress=False)
    twin = load_file(str(tmp_path / "twin" / "model.safetensors"))
    raw = {}
    for f in r7_ckpt.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    for e in (0, 1, 3):
        for proj, suh, svh in (("gate_proj", "r7_shared.gate_up_suh", f"{e}.gate_proj.svh"),
                               ("up_proj", "r7_shared.gate_up_suh", f"{e}.up_proj.svh"),
                               ("down_proj", f"{e}.down_proj.suh", "r7_shared.down_svh")):
            want = dequantize_weight(raw[f"{PREFIX}.{e}.{proj}.trellis"], raw[f"{PREFIX}.{suh}"],
                                     raw[f"{PREFIX}.{svh}"], Codebook.MCG).T
            assert torch.equal(twin[f"{PREFIX}.{e}.{proj}.weight"], want), (e, proj)
    assert not any("r7_shared" in n or n.endswith(".trellis") and ".experts." in n for n in twin)


def _with(tensors, name, **changes):
    out = dict(tensors)
    out[name] = dataclasses.replace(tensors[name], name=name, **changes)
    return out


def _copy(tensors, src, dst):
    out = dict(tensors)
    out[dst] = dataclasses.replace(tensors[src], name=dst)
    return out


def _without(tensors, name):
    return {n: t for n, t in tensors.items() if n != name}


@pytest.mark.parametrize("mutate, message", [
    (lambda t: _without(t, f"{PREFIX}.r7_shared.gate_up_suh"), "r7_shared.gate_up_suh is missing"),
    (lambda t: _with(t, f"{PREFIX}.r7_shared.down_svh", shape=(128,)), "r7_shared.down_svh must be fp16 [256]"),
    (lambda t: _copy(t, f"{PREFIX}.r7_shared.gate_up_suh", f"{PREFIX}.2.gate_proj.suh"),
     "2.gate_proj.suh: R7 stores the hidden-side rotation once per layer under experts.r7_shared.gate_up_suh"),
    (lambda t: _copy(t, f"{PREFIX}.r7_shared.down_svh", f"{PREFIX}.1.down_proj.svh"),
     "under experts.r7_shared.down_svh"),
    (lambda t: _without(t, f"{PREFIX}.3.up_proj.mcg"), "3.up_proj: missing mcg"),
    (lambda t: _without(t, f"{PREFIX}.1.down_proj.trellis"), "1.down_proj: missing trellis"),
    (lambda t: _without(t, f"{PREFIX}.0.gate_proj.svh"), "0.gate_proj: missing svh"),
    (lambda t: _copy(t, f"{PREFIX}.0.gate_proj.mcg", f"{PREFIX}.0.gate_proj.mul1"), "MCG codebook only"),
    (lambda t: _with(t, f"{PREFIX}.2.gate_proj.trellis", shape=(16, 16, 96)), "declare"),  # K6
    (lambda t: _with(t, f"{PREFIX}.2.gate_proj.trellis", shape=(16, 8, 80)), "must be int16 [16, 16, 16*K]"),
    (lambda t: _with(t, f"{PREFIX}.2.gate_proj.trellis", dtype="F16"), "must be int16"),
    (lambda t: _with(t, f"{PREFIX}.2.down_proj.suh", dtype="BF16"), "2.down_proj.suh must be fp16"),
    (lambda t: _copy(t, f"{PREFIX}.0.gate_proj.mcg", f"{PREFIX}.0.gate_proj.bias"), "unexpected tensor"),
])
def test_expert_rejections(r7_ckpt, mutate, message):
    tensors = load_checkpoint(r7_ckpt).tensors
    with pytest.raises(r7.R7Error, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        _records(mutate(tensors))


def test_bitrate_outside_k_values(r7_ckpt):
    tensors = load_checkpoint(r7_ckpt).tensors
    spec = r7.parse(block(moe_layers=[0, 1], k_values=[3, 4]))
    with pytest.raises(r7.R7Error, match=r"K=5 bits per weight, which quantization_config.r7_routed_experts.k_values "
                                         r"\[3, 4\] does not declare"):
        r7.expert_records(tensors, spec, PREFIX, 0, 4, HIDDEN, INTER)


def _bad_copy(r7_ckpt, tmp_path, fn):
    """A copy of the R7 fixture with fn(tensors, sidecar, config) applied."""
    import shutil

    shutil.copytree(r7_ckpt, tmp_path / "bad")
    return mutate(tmp_path / "bad", fn)


def _block_set(key, value):
    return lambda tensors, sidecar, config: config["quantization_config"][r7.BLOCK].__setitem__(key, value)


def test_r7_experts_listed_in_the_sidecar_are_refused(r7_ckpt, tmp_path):
    bad = _bad_copy(r7_ckpt, tmp_path, lambda tensors, sidecar, config: sidecar["tensor_storage"].__setitem__(
        f"{PREFIX}.0.gate_proj", {"stored_tensors": {}}))
    with pytest.raises(Exl3FormatError, match="also listed in quantization_config.json"):
        load_checkpoint(bad)


def test_bad_r7_layers_fail_the_checkpoint_load(r7_ckpt, tmp_path):
    """load_checkpoint (and so `inspect`) checks every R7 layer, not only SGLang's model build."""
    bad = _bad_copy(r7_ckpt, tmp_path, _block_set("k_values", [3, 5]))
    with pytest.raises(Exl3FormatError, match=r"layer 0 .*K=4 bits per weight") as e:
        load_checkpoint(bad)
    assert "layer 1 " in str(e.value)


def test_malformed_block_fails_the_checkpoint_load(r7_ckpt, tmp_path):
    bad = _bad_copy(r7_ckpt, tmp_path, _block_set("moe_layers", [0, False]))
    with pytest.raises(Exl3FormatError, match="booleans and floats are refused"):
        load_checkpoint(bad)


@pytest.mark.slow
def test_a_bad_r7_layer_stops_the_sglang_load(r7_ckpt, tmp_path):
    """Through SGLang's ModelConfig, quantization config and Qwen3-MoE class: a k_values that does not cover the
    stored bitrates stops the load naming the tensor, before the model is built."""
    from sglang_cpu import load_as_server, sglang_runtime

    sglang_runtime()
    bad = _bad_copy(r7_ckpt, tmp_path, _block_set("k_values", [3, 4]))
    with pytest.raises(Exl3FormatError, match=r"model.layers.0.mlp.experts.\d.\w+_proj.trellis holds K=5"):
        load_as_server(bad)
