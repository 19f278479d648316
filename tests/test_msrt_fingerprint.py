"""exl3-msrt-base/1 compatibility fingerprints against the reference's golden digests (seeds.md §1.3: K = 2, layer 3,
expert 0 with zero trellis / suh / svh and the MCG marker), their TP invariance and the producer's rules."""

from __future__ import annotations

import pytest
import torch

from sglang_exl3.format.msrt_fingerprint import FingerprintError, layer_digest, root_digest, tensor_record, verify

GOLDEN_LAYER = "3518095ac1ae5fd32f775862acce5daa5f0c8a4c96fb308b45df4e95da377d58"
GOLDEN_ROOT = "cbb1f591900487ad16f33fd2d33174beb09d55d301f164aff37ed829f712ce01"


def golden_layer(rank_suffix: str = ".rank0") -> dict[str, torch.Tensor]:
    out = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        base = f"model.layers.3.mlp.experts.0.{proj}{rank_suffix}"
        out[f"{base}.trellis"] = torch.zeros(8, 8, 32, dtype=torch.int16)
        out[f"{base}.suh"] = torch.zeros(128, dtype=torch.float16)
        out[f"{base}.svh"] = torch.zeros(128, dtype=torch.float16)
        out[f"{base}.mcg"] = torch.tensor(-877912083, dtype=torch.int32)
    return out


def test_golden_digests():
    digest = layer_digest(2, 3, golden_layer())
    assert digest == GOLDEN_LAYER
    assert root_digest(2, {3: digest}) == GOLDEN_ROOT


def test_the_rank_suffix_is_not_part_of_the_fingerprint():
    assert layer_digest(2, 3, golden_layer("")) == GOLDEN_LAYER


def test_one_changed_byte_changes_the_layer_digest():
    tensors = golden_layer()
    tensors["model.layers.3.mlp.experts.0.down_proj.rank0.suh"][5] = 1.0
    assert layer_digest(2, 3, tensors) != GOLDEN_LAYER


def test_record_of_a_scalar():
    rec = tensor_record("model.layers.3.mlp.experts.0.up_proj.rank0.mcg", torch.tensor(-877912083, dtype=torch.int32))
    assert rec["name"] == "model.layers.3.mlp.experts.0.up_proj.mcg" and rec["shape"] == [] and rec["dtype"] == "I32"


@pytest.mark.parametrize(("name", "value", "match"), [
    ("model.layers.3.mlp.experts.0.up_proj.rank0.mcg", torch.tensor(7, dtype=torch.int32), "MCG multiplier"),
    ("model.layers.3.mlp.experts.0.up_proj.rank0.trellis", torch.zeros(8, 8, 48, dtype=torch.int16), "K=2"),
    ("model.layers.3.mlp.experts.0.up_proj.rank0.suh", torch.zeros(64, dtype=torch.float16), "needs 128"),
    ("model.layers.3.mlp.experts.0.up_proj.rank0.svh", torch.zeros(128, dtype=torch.float32), "float16"),
])
def test_the_producers_rules_name_the_tensor(name, value, match):
    tensors = golden_layer()
    tensors[name] = value
    with pytest.raises(FingerprintError, match=match):
        layer_digest(2, 3, tensors)


def test_a_missing_part_is_named():
    tensors = golden_layer()
    del tensors["model.layers.3.mlp.experts.0.gate_proj.rank0.svh"]
    with pytest.raises(FingerprintError, match=r"expert 0: missing \['gate_proj.svh'\]"):
        layer_digest(2, 3, tensors)


def test_verify():
    verify(2, GOLDEN_ROOT, {"3": GOLDEN_LAYER}, {3: golden_layer()})
    with pytest.raises(FingerprintError, match="does not match its compatibility"):
        verify(2, GOLDEN_ROOT, {"3": GOLDEN_LAYER, "4": GOLDEN_LAYER}, {})
    changed = golden_layer()
    changed["model.layers.3.mlp.experts.0.gate_proj.rank0.trellis"][0, 0, 0] = 1
    with pytest.raises(FingerprintError, match="do not match compatibility digest"):
        verify(2, GOLDEN_ROOT, {"3": GOLDEN_LAYER}, {3: changed})
