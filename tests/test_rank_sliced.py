"""Rank-sliced routed-expert metadata (`hybrid_tr3_tail`): every rejection and the name normalisation."""

from __future__ import annotations

import json

import pytest

from conftest import changed
from sglang_exl3.format import rank_sliced as rs

BASE = {"format": "exl3-trellis", "bits": 3, "codebook": "mcg", "experts_per_layer": 4, "moe_layers": [1, 2],
        "tensor_schema": rs.TENSOR_SCHEMA, "tp": 2}


def cfg(**changes):
    return {"quant_method": "modelopt", "hybrid_tr3_tail": changed(BASE, **changes)}


def test_claimed_even_under_another_quant_method():
    assert rs.override_quantization_method(cfg(), None) == "exl3"
    assert rs.override_quantization_method(cfg(), "exl3") == "exl3"
    assert rs.override_quantization_method(cfg(), "fp8") is None
    assert rs.override_quantization_method({"hybrid_tr3_tail": {"format": "other"}}, None) is None
    spec = rs.parse(cfg())
    assert (spec.bits, spec.moe_layers, spec.tp, spec.rotation_layout) == (3, (1, 2), 2, "per_expert_v1")
    assert spec.covers(2) and not spec.covers(0) and spec.expert_bits(1, 3) == 3


@pytest.mark.parametrize("changes, message", [
    ({"tp": None, "codebook": None}, "rank-sliced EXL3 metadata is missing: codebook, tp"),
    ({"codebook": "mul1"}, "rank-sliced EXL3 currently requires the MCG codebook"),
    ({"moe_layers": [3, 2]}, "moe_layers must be [first, last] with 0 <= first <= last"),
    ({"moe_layers": [1]}, "moe_layers must be [first, last]"),
    ({"moe_layers": [-1, 2]}, "moe_layers must be [first, last]"),
    ({"tensor_schema": "model.layers.{L}.experts"}, "tensor_schema must be exactly"),
    ({"bits": 3.5}, "bits must be an integer in (2, 3, 4, 5, 6) or 'mixed'"),
    ({"bits": 7}, "bits must be an integer"),
    ({"bits": "three"}, "bits must be a number or 'mixed'"),
    ({"bits": "mixed"}, "requires k_values"),
    ({"bits": "mixed", "k_values": [3, 9]}, "requires k_values: integers within 2..6"),
    ({"bits": "mixed", "k_values": [3, 4]}, "requires bits_per_expert = 'file.json:field'"),
    ({"bits": "mixed", "k_values": [3, 4], "bits_per_expert": "../bits.json:k"}, "must not contain path separators"),
    ({"bits": "mixed", "k_values": [3, 4], "bits_per_expert": "sub/bits.json:k"}, "must not contain path separators"),
    ({"bits": "mixed", "k_values": [3, 4], "bits_per_expert": "/etc/bits.json:k"}, "must not contain path separators"),
    ({"rotation_layout": "per_row"}, "rotation_layout must be one of"),
    ({"rotation_layout": "shared_h_v1"}, "requires shared_h_tensor_schema"),
    ({"shared_h_tensor_schema": rs.SHARED_H_SCHEMA}, "without rotation_layout='shared_h_v1'"),
    # JSON true is not a count or an index (found by tests/test_fuzz.py)
    ({"experts_per_layer": True}, "experts_per_layer and tp must be positive integers"),
    ({"tp": True}, "experts_per_layer and tp must be positive integers"),
    ({"moe_layers": [0, True]}, "moe_layers must be [first, last]"),
    ({"bits": "mixed", "k_values": [True, 3]}, "requires k_values: integers within 2..6"),
])
def test_rejections(changes, message):
    with pytest.raises(rs.RankSlicedError) as info:
        rs.parse(cfg(**changes))
    assert message in str(info.value)


def test_mixed_bitrate_map(tmp_path):
    (tmp_path / "bits.json").write_text(json.dumps({"1": {"k": [3, 4, 4, 3]}, "2": {"tail_tr3": [0, 0, 0, 0]}}))
    spec = rs.parse(cfg(bits="mixed", k_values=[3, 4], bits_per_expert="bits.json:k"), tmp_path)
    assert spec.bits_per_expert == {1: (3, 4, 4, 3), 2: (3, 3, 3, 3)}
    assert spec.expert_bits(1, 1) == 4
    (tmp_path / "bits.json").write_text(json.dumps({"1": {"k": [3, 5, 4, 3]}, "2": {"k": [3, 3, 3, 3]}}))
    with pytest.raises(rs.RankSlicedError, match="uses K=5, which k_values"):
        rs.parse(cfg(bits="mixed", k_values=[3, 4], bits_per_expert="bits.json:k"), tmp_path)
    (tmp_path / "bits.json").write_text(json.dumps({"1": {"k": [3, 3]}}))
    with pytest.raises(rs.RankSlicedError, match="must list 4 bitrates"):
        rs.parse(cfg(bits="mixed", k_values=[3, 4], bits_per_expert="bits.json:k"), tmp_path)
    with pytest.raises(rs.RankSlicedError, match="cannot read"):
        rs.parse(cfg(bits="mixed", k_values=[3, 4], bits_per_expert="nope.json:k"), tmp_path)


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "bits.json: must hold a JSON object of layer -> {field: bitrates}, got list"),
    ("\"k\"", "bits.json: must hold a JSON object"),
    ("{\"1\": {\"k\": [3, 3, 3, true]}, \"2\": {\"k\": [3, 3, 3, 3]}}", "layer 1 uses K=True"),
    ("\xff", "cannot read hybrid_tr3_tail.bits_per_expert file bits.json"),
])
def test_malformed_bits_per_expert_files(tmp_path, content, message):
    """Found by tests/test_fuzz.py: a bits_per_expert file that is JSON but not an object raised AttributeError."""
    (tmp_path / "bits.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(rs.RankSlicedError) as info:
        rs.parse(cfg(bits="mixed", k_values=[3, 4], bits_per_expert="bits.json:k"), tmp_path)
    assert message in str(info.value)


def test_runtime_checks():
    spec = rs.parse(cfg())
    rs.check_runtime(spec, tp_size=2, num_experts=4)
    with pytest.raises(rs.RankSlicedError, match="TP does not match runtime.*pass --tp 2"):
        rs.check_runtime(spec, tp_size=4, num_experts=4)
    with pytest.raises(rs.RankSlicedError, match="4 experts per layer, the model config 8"):
        rs.check_runtime(spec, tp_size=2, num_experts=8)


def test_name_normalisation():
    spec = rs.parse(cfg())
    p = "model.layers.1.mlp.experts.3.gate_proj"
    assert rs.normalize_weight_name(f"{p}.rank1.trellis", 1, spec) == f"{p}.trellis"
    assert rs.normalize_weight_name(f"{p}.rank0.trellis", 1, spec) is None
    assert rs.normalize_weight_name("model.norm.weight", 1, spec) == "model.norm.weight"
    with pytest.raises(rs.RankSlicedError, match="does not declare rotation_layout='shared_h_v1'"):
        rs.normalize_weight_name("model.layers.1.mlp.experts.shared_h.gate_proj.rank0.suh", 0, spec)
    shared = rs.parse(cfg(rotation_layout="shared_h_v1", shared_h_tensor_schema=rs.SHARED_H_SCHEMA))
    e = "model.layers.1.mlp.experts"
    assert rs.normalize_weight_name(f"{e}.shared_h.up_proj.rank0.suh", 0, shared) == f"{e}.0.up_proj.suh"
    assert rs.normalize_weight_name(f"{e}.shared_h.down_proj.rank1.svh", 0, shared) is None
    with pytest.raises(rs.RankSlicedError, match="experts.shared_h.down_proj requires svh"):
        rs.normalize_weight_name(f"{e}.shared_h.down_proj.rank0.suh", 0, shared)
    with pytest.raises(rs.RankSlicedError, match="must store H-side rotations under experts.shared_h"):
        rs.normalize_weight_name(f"{e}.2.gate_proj.rank0.suh", 0, shared)
    assert rs.normalize_weight_name(f"{e}.2.gate_proj.rank0.svh", 0, shared) == f"{e}.2.gate_proj.svh"


def _names_and_tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("layout", ["per_expert_v1", "shared_h_v1"])
def test_writer_produces_the_reference_layout(tmp_path, layout):
    """The project's writer: metadata the validator accepts, names each rank normalises to its own experts,
    and slices that put back together give exactly the full expert matrices they were cut from."""
    import torch

    from sglang_exl3.format import load_checkpoint
    from sglang_exl3.format.rank_sliced import check_runtime, normalize_weight_name, parse
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint
    from sglang_exl3.synth.rank_sliced_writer import write_rank_sliced_checkpoint

    dims = ModelDims(num_hidden_layers=1)
    path = write_rank_sliced_checkpoint(tmp_path / "rs", dims=dims, bits=3, tp=2, rotation_layout=layout, seed=5)
    config = json.loads((path / "config.json").read_text())
    spec = parse(config, path)
    assert (spec.bits, spec.tp, spec.experts_per_layer, spec.rotation_layout) == (3, 2, 4, layout)
    check_runtime(spec, tp_size=2, num_experts=4)
    ckpt = load_checkpoint(path)  # the per-module EXL3 part (attention, lm_head) stays a valid checkpoint
    assert not ckpt.problems and not any(".experts." in k for k in ckpt.modules)

    tensors = _names_and_tensors(path)
    full = _names_and_tensors(write_exl3_checkpoint(tmp_path / "full", "qwen3_moe", dims=dims, bits=3,
                                                    codebook="mcg", seed=5, with_tokenizer=False))
    shared = layout == "shared_h_v1"
    per_rank = {}
    for rank in range(2):
        per_rank[rank] = {}
        for name, t in tensors.items():
            local = normalize_weight_name(name, rank, spec)
            if local is not None and ".experts." in local:
                per_rank[rank][local] = t
        want = {f"model.layers.0.mlp.experts.{e}.{p}.{f}" for e in range(4) for p in ("gate_proj", "up_proj",
                "down_proj") for f in ("trellis", "suh", "svh", "mcg")
                if not (shared and e > 0 and f == {"down_proj": "svh"}.get(p, "suh"))}
        assert set(per_rank[rank]) == want
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        for proj, dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 0)):
            joined = torch.cat([per_rank[r][f"{p}.{proj}.trellis"] for r in range(2)], dim=dim)
            assert torch.equal(joined, full[f"{p}.{proj}.trellis"])
            side = "svh" if proj != "down_proj" else "suh"  # the sliced (intermediate-side) rotation
            assert torch.equal(torch.cat([per_rank[r][f"{p}.{proj}.{side}"] for r in range(2)]),
                               full[f"{p}.{proj}.{side}"])
    with pytest.raises(rs.RankSlicedError, match="TP does not match runtime"):
        check_runtime(spec, tp_size=1, num_experts=4)
