"""`python -m sglang_exl3 dequantize CKPT OUT`: an EXL3 checkpoint -> a plain HF safetensors checkpoint.

Every EXL3 linear becomes `<key>.weight` [out, in] = get_weight_tensor().T with the 128-padding
trimmed (and `<key>.bias`); the fp16 weight is bit-identical to exllamav3's `get_weight_tensor()`
(see codec/weight.py). Rank-sliced experts (`hybrid_tr3_tail`) become whole per-expert weights: each
rank's slice dequantized with its own (or the layer's shared-H) rotations, joined along the intermediate
dimension; R7 experts (`r7_routed_experts`) likewise, each with its layer's shared hidden-side rotation. Other
tensors are copied; floating ones are cast to --dtype. config.json loses its
quantization_config (and hybrid_tr3_tail); tokenizer and other side files are copied. OUT must be empty.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from sglang_exl3.codec.signs import input_output_scales
from sglang_exl3.codec.weight import dequantize_weight
from sglang_exl3.format import Exl3Checkpoint, load_checkpoint, r7
from sglang_exl3.format.constants import CONFIG_NAME, SIDECAR_NAME
from sglang_exl3.format.rank_sliced import claims
from sglang_exl3.format.shards import ShardPacker
from sglang_exl3.tools.logical_shapes import logical_sizes, meta_model_shapes

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_SKIP_FILES = {CONFIG_NAME, SIDECAR_NAME, "model.safetensors.index.json"}


def _module_weight(
    ckpt: Exl3Checkpoint, key: str, device: str, meta_shapes: dict
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp16 weight [out, in] (trimmed) and optional bias [out] of one EXL3 module."""
    record = ckpt.modules[key]
    t = ckpt.load_module(key, device)
    suh, svh = input_output_scales(t)
    w = dequantize_weight(t["trellis"], suh, svh, record.codebook)
    k, n = logical_sizes(key, ckpt.config, record.in_features, record.out_features, meta_shapes)
    bias = t["bias"][:n].half() if "bias" in t else None
    return w[:k, :n].T.contiguous(), bias


def _rank_sliced_experts(ckpt: Exl3Checkpoint, device: str):
    """(name, fp16 weight [out, in]) of every rank-sliced routed expert, its tp slices joined. Each rank's slices are
    found (and their bitrates checked) by the loader's own `expert_records`."""
    from sglang_exl3.format.rank_sliced import ROLE_PROJECTIONS, expert_records
    from sglang_exl3.format.tail import parse_tail

    spec = parse_tail(ckpt.config, ckpt.path)
    for layer in filter(spec.covers, range(spec.moe_layers[0], spec.moe_layers[1] + 1)):
        prefix = f"model.layers.{layer}.mlp.experts"
        ranks = [expert_records(ckpt.tensors, spec, prefix, layer, r) for r in range(spec.tp)]
        for e in range(spec.experts_per_layer):
            for role, proj in ROLE_PROJECTIONS:
                parts = []
                for records in ranks:
                    record = records[(e, role)]
                    t = {f: ckpt.load_tensor(record.tensors[f].name, device) for f in ("trellis", "suh", "svh")}
                    w = dequantize_weight(t["trellis"], t["suh"], t["svh"], record.codebook)
                    parts.append(w.T)  # [out, in] of this rank's slice
                yield f"{prefix}.{e}.{proj}.weight", torch.cat(parts, dim=1 if role == "w2" else 0)


def _r7_experts(ckpt: Exl3Checkpoint, device: str):
    """(name, fp16 weight [out, in]) of every R7 routed expert, read through the loader's own `expert_records` (which
    pairs each expert with its layer's shared hidden-side rotation)."""
    spec = r7.parse(r7.block_of(ckpt.config))
    dims = r7.expert_dims(ckpt.config)
    if dims is None:
        raise ValueError("config.json does not give the expert count, hidden and intermediate sizes of the R7 layers")
    for layer in range(spec.moe_layers[0], spec.moe_layers[1] + 1):
        prefix = f"model.layers.{layer}.mlp.experts"
        records = r7.expert_records(ckpt.tensors, spec, prefix, layer, *dims)
        for record in records.values():
            t = {f: ckpt.load_tensor(record.tensors[f].name, device) for f in ("trellis", "suh", "svh")}
            w = dequantize_weight(t["trellis"], t["suh"], t["svh"], record.codebook)
            yield f"{record.key}.weight", w.T.contiguous()


def _is_r7_tensor(spec: r7.R7Spec, name: str) -> bool:
    return spec.covers_name(name) and bool(r7.EXPERT_RE.match(name) or r7.SHARED_RE.match(name))


def _is_rank_sliced_tensor(name: str) -> bool:
    from sglang_exl3.format.rank_sliced import RANK_SLICED_WEIGHT_RE, SHARED_H_WEIGHT_RE

    return bool(RANK_SLICED_WEIGHT_RE.match(name) or SHARED_H_WEIGHT_RE.match(name))


def _out_config(config: dict, dtype: str) -> dict:
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "hybrid_tr3_tail")}
    out["dtype"] = dtype
    out.pop("torch_dtype", None)
    return out


def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder (nothing was written)")


def dequantize_checkpoint(
    ckpt_path: str | Path,
    out_path: str | Path,
    dtype: str = "float16",
    device: str = "cpu",
    max_shard_bytes: int = 4 << 30,
    progress: bool = True,
) -> dict:
    """Write the dequantized checkpoint; returns a summary (modules, tensors, shards)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_path)
    _check_out_dir(out)
    ckpt = load_checkpoint(ckpt_path)  # strict: invalid checkpoints fail before anything is written
    target = DTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    keys = list(ckpt.modules)
    meta_shapes = meta_model_shapes(ckpt.config)
    rank_sliced = claims(ckpt.config)
    r7_spec = r7.parse(r7.block_of(ckpt.config)) if r7.claims(ckpt.config) else None
    plain = [n for n in ckpt.plain_tensor_names() if not (rank_sliced and _is_rank_sliced_tensor(n))
             and not (r7_spec and _is_r7_tensor(r7_spec, n))]
    items = [("exl3", k) for k in keys] + [("plain", n) for n in plain] + \
        ([("rank_sliced", "")] if rank_sliced else []) + ([("r7", "")] if r7_spec else [])
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="dequantizing", unit="tensor")
    packer = ShardPacker(max_shard_bytes)
    for kind, name in items:
        if kind in ("rank_sliced", "r7"):
            for n, w in (_rank_sliced_experts if kind == "rank_sliced" else _r7_experts)(ckpt, device):
                packer.add({n: w.to(target).cpu()})
            continue
        if kind == "exl3":
            weight, bias = _module_weight(ckpt, name, device, meta_shapes)
            tensors = {f"{name}.weight": weight.to(target).cpu()}
            if bias is not None:
                tensors[f"{name}.bias"] = bias.to(target).cpu()
        else:
            t = ckpt.load_tensor(name)
            tensors = {name: t.to(target) if t.is_floating_point() else t}
        packer.add(tensors)
    names = packer.save(out)
    _write_side_files(ckpt, out, dtype)
    return {"exl3_modules": len(keys), "plain_tensors": len(plain), "shards": names, "dtype": dtype}


def write_weightless_twin(ckpt_path: str | Path, out_path: str | Path, dtype: str = "bfloat16") -> Path:
    """The dequantized checkpoint's config and side files (tokenizer, generation config) without its weights: a twin
    for speed alone, which SGLang serves with `--load-format dummy` (random weights: the same kernels at the same
    sizes). For shapes whose dense weights do not fit the disk beside the EXL3 checkpoint (Qwen3-30B-A3B: ~61 GB in
    bf16 on a 64 GB disk). OUT must be empty."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_path)
    _check_out_dir(out)
    ckpt = load_checkpoint(ckpt_path)
    out.mkdir(parents=True, exist_ok=True)
    _write_side_files(ckpt, out, dtype)
    return out


def _write_side_files(ckpt, out: Path, dtype: str) -> None:
    (out / CONFIG_NAME).write_text(json.dumps(_out_config(ckpt.config, dtype), indent=2))
    for f in sorted(ckpt.path.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIP_FILES:
            shutil.copy2(f, out / f.name)
