"""Write an `exl3-msrt-base/1` cartridge base (seeds.md §1.3) from a rank-sliced checkpoint of tp = 1: the same
full-rank `.rank0` expert tensors, with config.json's `hybrid_tr3_tail` replaced by the closed profile and its
compatibility digests computed from those tensors (what the reference's `fq_assemble_lora.py` writes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from sglang_exl3.format import msrt_base
from sglang_exl3.format.msrt_fingerprint import EXPERT_TENSOR, MCG_MULTIPLIER, PARTS, layer_digest, root_digest
from sglang_exl3.format.rank_sliced import TENSOR_SCHEMA


def write_msrt_base(src_dir: str | Path, out_dir: str | Path) -> Path:
    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    tail = config.get("hybrid_tr3_tail") or {}
    if tail.get("tp") != 1 or tail.get("rotation_layout", "per_expert_v1") != "per_expert_v1":
        raise ValueError(f"{src}: an msrt base is written from a rank-sliced checkpoint of tp=1 with per-expert "
                         "rotations")
    shutil.copytree(src, out)
    by_layer_tensors: dict[int, dict] = {}
    for f in sorted(out.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if ".rank0." in name and (m := EXPERT_TENSOR.match(name)) and m.group(4) in PARTS:
                by_layer_tensors.setdefault(int(m.group(1)), {})[name] = t
    k = int(tail["bits"])
    coverage = sorted(by_layer_tensors)
    by_layer = {layer: layer_digest(k, layer, by_layer_tensors[layer]) for layer in coverage}
    config["hybrid_tr3_tail"] = {
        "format": "exl3-trellis", "runtime_profile": msrt_base.PROFILE, "bits": float(k), "codebook": "mcg",
        "moe_layers": [coverage[0], coverage[-1]], "moe_layer_coverage": coverage, "tensor_schema": TENSOR_SCHEMA,
        "tensor_parallel": msrt_base.TENSOR_PARALLEL, "mcg_multiplier": MCG_MULTIPLIER,
        "compatibility_sha256": root_digest(k, by_layer),
        "compatibility_by_layer": {str(layer): d for layer, d in by_layer.items()},
        "experts_per_layer": tail["experts_per_layer"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
