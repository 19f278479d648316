"""Write a Qwen3-MoE-shaped checkpoint in the reference implementation's rank-sliced MoE layout.

Routed experts are stored per tensor-parallel rank (`model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.*`,
MCG codebook): gate/up keep rank r's slice of the intermediate columns, down its intermediate rows, in
128-element units; with `rotation_layout='shared_h_v1'` the hidden-side rotations (gate/up suh, down svh)
are stored once per layer under `experts.shared_h`. Everything else is ordinary per-module EXL3 listed in
`quantization_config.json`, and `config.json` carries `hybrid_tr3_tail`. Built from `write_exl3_checkpoint`
output, so the full per-expert matrices the slices came from are known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from sglang_exl3.format.constants import ALIGN, SIDECAR_NAME
from sglang_exl3.format.rank_sliced import H_SIDE, SHARED_H_SCHEMA, TENSOR_SCHEMA
from sglang_exl3.format.shards import ShardPacker
from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

PROJECTIONS = tuple(H_SIDE)  # gate_proj, up_proj, down_proj


def slice_expert(tensors: dict[str, torch.Tensor], proj: str, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of one expert projection (trellis/suh/svh/mcg): gate/up cut the output
    (intermediate) columns, down the input (intermediate) rows."""
    out = {name: t.clone() for name, t in tensors.items()}  # each rank's file holds its own copy
    if proj == "down_proj":
        rows = tensors["trellis"].shape[0] // tp
        out["trellis"] = tensors["trellis"][rank * rows:(rank + 1) * rows].contiguous()
        out["suh"] = tensors["suh"][rank * rows * 16:(rank + 1) * rows * 16].contiguous()
    else:
        cols = tensors["trellis"].shape[1] // tp
        out["trellis"] = tensors["trellis"][:, rank * cols:(rank + 1) * cols].contiguous()
        out["svh"] = tensors["svh"][rank * cols * 16:(rank + 1) * cols * 16].contiguous()
    return out


def expert_donors(dims: ModelDims, bits, seed: int) -> dict[int, dict]:
    """Per distinct K in `bits`: the tensors of a whole per-expert checkpoint at that bitrate."""
    import tempfile

    donors = {}
    for k in sorted(set(bits)):
        with tempfile.TemporaryDirectory() as tmp:
            write_exl3_checkpoint(tmp, "qwen3_moe", dims=dims, bits=k, codebook="mcg", seed=seed + k,
                                  with_tokenizer=False)
            donors[k] = {}
            for f in sorted(Path(tmp).glob("*.safetensors")):
                donors[k].update(load_file(str(f)))
    return donors


def moe_base(out: Path, dims: ModelDims, bits: int, seed: int, with_tokenizer: bool) -> tuple[dict, dict]:
    """A per-expert Qwen3-MoE EXL3 checkpoint (MCG) written to `out` and taken apart for rewriting: its sidecar and
    every tensor, with the shards deleted."""
    write_exl3_checkpoint(out, "qwen3_moe", dims=dims, bits=bits, codebook="mcg", seed=seed,
                          with_tokenizer=with_tokenizer)
    sidecar = json.loads((out / SIDECAR_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    return sidecar, tensors


def write_rank_sliced_checkpoint(out_dir: str | Path, dims: ModelDims | None = None, bits: int = 3, tp: int = 2,
                                 rotation_layout: str = "per_expert_v1", seed: int = 0,
                                 with_tokenizer: bool = False,
                                 expert_bits: dict[int, list[int]] | None = None) -> Path:
    """`expert_bits` ({layer: [K per expert]}) writes a mixed-bitrate checkpoint (`bits: "mixed"`, `k_values` and a
    `bits_per_expert` JSON beside config.json); `bits` is then the rest of the model's bitrate."""
    dims = dims or ModelDims()
    if dims.moe_intermediate_size % (tp * ALIGN):
        raise ValueError(f"moe_intermediate_size {dims.moe_intermediate_size} does not split into {tp} slices of "
                         f"a multiple of {ALIGN}")
    out = Path(out_dir)
    sidecar, tensors = moe_base(out, dims, bits, seed, with_tokenizer)
    packer = ShardPacker()
    shared = rotation_layout == "shared_h_v1"
    donors = expert_donors(dims, [k for ks in expert_bits.values() for k in ks], seed) if expert_bits else {}
    for key in list(sidecar["tensor_storage"]):
        parts = key.split(".")
        if len(parts) < 7 or parts[3:5] != ["mlp", "experts"] or parts[6] not in PROJECTIONS:
            packer.add({n: t for n, t in tensors.items() if n.startswith(key + ".")})
            continue
        del sidecar["tensor_storage"][key]  # rank-sliced experts live outside tensor_storage
        layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
        source = donors[expert_bits[layer][expert]] if expert_bits else tensors
        full = {fld: source[f"{key}.{fld}"] for fld in ("trellis", "suh", "svh", "mcg")}
        for rank in range(tp):
            part = slice_expert(full, proj, rank, tp)
            group = {f"{key}.rank{rank}.{fld}": t for fld, t in part.items()
                     if not (shared and fld == H_SIDE[proj])}
            if shared and expert == 0:
                prefix = f"model.layers.{layer}.mlp.experts.shared_h.{proj}.rank{rank}"
                group[f"{prefix}.{H_SIDE[proj]}"] = part[H_SIDE[proj]]
            packer.add(group)
    packer.save(out)
    (out / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=4))
    config = json.loads((out / "config.json").read_text())
    config["hybrid_tr3_tail"] = {
        "format": "exl3-trellis", "bits": bits, "codebook": "mcg", "experts_per_layer": dims.num_experts,
        "moe_layers": [0, dims.num_hidden_layers - 1], "tensor_schema": TENSOR_SCHEMA, "tp": tp,
        "rotation_layout": rotation_layout, **({"shared_h_tensor_schema": SHARED_H_SCHEMA} if shared else {})}
    if expert_bits:
        config["hybrid_tr3_tail"].update(bits="mixed", k_values=sorted(donors), bits_per_expert="expert_bits.json:k")
        (out / "expert_bits.json").write_text(json.dumps({str(layer): {"k": ks} for layer, ks in expert_bits.items()}))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_hybrid_from_hf(src_dir: str | Path, out_dir: str | Path, bits: int = 3, tp: int = 1,
                         rotation_layout: str = "shared_h_v1", seed: int = 0) -> Path:
    """The reference's hybrid layout (GLM-5.2 TR3) from a plain HF MoE checkpoint with per-expert weights
    (`model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight`; DeepSeek-V3, GLM-4.5, Qwen3-MoE naming): every
    routed expert becomes random rank-sliced EXL3 (MCG, `bits`), everything else (attention, dense layers, shared
    experts, routers) stays as it is, and config.json gains `hybrid_tr3_tail` over the layers that have experts. No
    quantization sidecar: the hybrid claim alone makes it EXL3."""
    from safetensors.torch import save_file

    from sglang_exl3.format import Codebook
    from sglang_exl3.synth.exl3_writer import random_exl3_linear

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    config = json.loads((src / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    if inter % (tp * ALIGN):
        raise ValueError(f"moe_intermediate_size {inter} does not split into {tp} slices of a multiple of {ALIGN}")
    gen = torch.Generator().manual_seed(seed)
    kept, layers, experts = {}, set(), set()
    shared = rotation_layout == "shared_h_v1"
    shared_h: dict[tuple[int, str], torch.Tensor] = {}
    for name in sorted(tensors):
        parts = name.split(".")
        if len(parts) != 8 or parts[3:5] != ["mlp", "experts"] or parts[6] not in PROJECTIONS or parts[7] != "weight":
            kept[name] = tensors[name]
            continue
        layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
        layers.add(layer)
        experts.add(expert)
        k, n = (inter, hidden) if proj == "down_proj" else (hidden, inter)
        full = random_exl3_linear(k, n, bits, Codebook.MCG, gen)
        side = H_SIDE[proj]
        if shared:  # one hidden-side rotation per layer and projection
            full[side] = shared_h.setdefault((layer, proj), full[side])
        key = ".".join(parts[:7])
        for rank in range(tp):
            part = slice_expert(full, proj, rank, tp)
            kept.update({f"{key}.rank{rank}.{fld}": t for fld, t in part.items() if not (shared and fld == side)})
            if shared and expert == 0:
                kept[f"model.layers.{layer}.mlp.experts.shared_h.{proj}.rank{rank}.{side}"] = part[side]
    if not layers:
        raise ValueError(f"{src} has no per-expert weights (model.layers.L.mlp.experts.E.PROJ.weight)")
    save_file({n: t.contiguous() for n, t in kept.items()}, str(out / "model.safetensors"))
    config.pop("quantization_config", None)
    config["hybrid_tr3_tail"] = {
        "format": "exl3-trellis", "bits": bits, "codebook": "mcg", "experts_per_layer": len(experts),
        "moe_layers": [min(layers), max(layers)], "tensor_schema": TENSOR_SCHEMA, "tp": tp,
        "rotation_layout": rotation_layout, **({"shared_h_tensor_schema": SHARED_H_SCHEMA} if shared else {})}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out
