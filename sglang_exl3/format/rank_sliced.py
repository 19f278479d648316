"""Rank-sliced routed-expert checkpoints (`hybrid_tr3_tail`, format `exl3-trellis`), exactly as the
reference vLLM implementation defines them: metadata validation, the mixed-bitrate map and the
tensor-name normalisation (`.rank{r}` slices, shared Hadamard-side rotations).

Format layer: no torch, no SGLang. Every rejection names the key and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from sglang_exl3.format.checkpoint import Exl3ModuleRecord
from sglang_exl3.format.constants import Codebook
from sglang_exl3.format.json_values import is_int

TENSOR_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
SHARED_H_SCHEMA = "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}"
REQUIRED = ("bits", "codebook", "experts_per_layer", "moe_layers", "tensor_schema", "tp")
ALLOWED_BITS = (2, 3, 4, 5, 6)
LAYOUTS = ("per_expert_v1", "shared_h_v1")

RANK_SLICED_WEIGHT_RE = re.compile(r"^(?P<prefix>.+)\.rank(?P<rank>\d+)\.(?P<field>trellis|suh|svh|mcg|mul1)$")
SHARED_H_WEIGHT_RE = re.compile(r"^(?P<experts_prefix>.+\.experts)\.shared_h\."
                                r"(?P<projection>gate_proj|up_proj|down_proj)\.rank(?P<rank>\d+)\.(?P<field>suh|svh)$")
EXPERT_PROJECTION_RE = re.compile(r"^.+\.experts\.\d+\.(?P<projection>gate_proj|up_proj|down_proj)$")
# The Hadamard-side (hidden-size) rotation of each projection: input side of gate/up, output of down.
H_SIDE = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}


class RankSlicedError(ValueError):
    pass


@dataclass(frozen=True)
class RankSlicedSpec:
    bits: int | str  # uniform K, or "mixed"
    experts_per_layer: int
    moe_layers: tuple[int, int]  # inclusive
    tp: int
    rotation_layout: str = "per_expert_v1"
    k_values: tuple[int, ...] = ()
    bits_per_expert: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> K per expert
    coverage: tuple[int, ...] = ()  # the layers holding experts where not every layer of moe_layers does (msrt base)
    profile: str | None = None  # runtime_profile (msrt_base.PROFILE) of a cartridge base
    compatibility_sha256: str | None = None  # a cartridge base's root digest and per-layer digests (msrt_fingerprint)
    compatibility_by_layer: dict[int, str] = field(default_factory=dict)

    def covers(self, layer: int) -> bool:
        if self.coverage:
            return layer in self.coverage
        return self.moe_layers[0] <= layer <= self.moe_layers[1]

    def expert_bits(self, layer: int, expert: int) -> int:
        return self.bits_per_expert[layer][expert] if self.bits == "mixed" else int(self.bits)


def is_layer_range(value) -> bool:
    """`moe_layers`: [first, last] with 0 <= first <= last."""
    return (isinstance(value, list) and len(value) == 2 and all(is_int(x) for x in value)
            and 0 <= value[0] <= value[1])


def claims(config: dict) -> bool:
    meta = config.get("hybrid_tr3_tail")
    return isinstance(meta, dict) and meta.get("format") == "exl3-trellis"


def override_quantization_method(config: dict, user_quant: str | None) -> str | None:
    """`exl3` for a rank-sliced checkpoint (even when quant_method names another method), unless the
    user asked for a different method explicitly."""
    if claims(config) and user_quant in (None, "exl3"):
        return "exl3"
    return None


def _safe_json_name(name: str) -> str:
    if not name or os.path.isabs(name) or "/" in name or "\\" in name or ".." in name:
        raise RankSlicedError(f"hybrid_tr3_tail.bits_per_expert file name {name!r} must not contain path "
                              "separators, '..' or be absolute; keep the JSON beside config.json")
    return name


def _load_bits_map(meta: dict, model_dir: Path | None, first: int, last: int, experts: int,
                   k_values: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    spec = meta.get("bits_per_expert")
    if not isinstance(spec, str) or ":" not in spec:
        raise RankSlicedError("hybrid_tr3_tail.bits='mixed' requires bits_per_expert = 'file.json:field'")
    name, field_name = spec.split(":", 1)
    name = _safe_json_name(name)
    if model_dir is None:
        raise RankSlicedError(f"hybrid_tr3_tail.bits_per_expert needs the checkpoint folder to read {name}")
    try:
        data = json.loads((Path(model_dir) / name).read_text())
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON
        raise RankSlicedError(f"cannot read hybrid_tr3_tail.bits_per_expert file {name}: {e}") from e
    if not isinstance(data, dict):
        raise RankSlicedError(f"{name}: must hold a JSON object of layer -> {{field: bitrates}}, got "
                              f"{type(data).__name__}")
    out = {}
    for layer in range(first, last + 1):
        entry = data.get(str(layer))
        if not isinstance(entry, dict):
            raise RankSlicedError(f"{name}: no entry for MoE layer {layer}")
        values = entry.get(field_name)
        if values is None and isinstance(entry.get("tail_tr3"), list) and len(entry["tail_tr3"]) == experts:
            values = [3] * experts  # an all-K3 overlay (GLM MTP layer)
        if not isinstance(values, list) or len(values) != experts:
            raise RankSlicedError(f"{name}: layer {layer} field {field_name!r} must list {experts} bitrates")
        for k in values:
            if not is_int(k) or k not in k_values:
                raise RankSlicedError(f"{name}: layer {layer} uses K={k}, which k_values {list(k_values)} "
                                      "does not declare")
        out[layer] = tuple(int(k) for k in values)
    return out


def parse(config: dict, model_dir: str | Path | None = None) -> RankSlicedSpec:
    """Validate config.json's `hybrid_tr3_tail` and return the spec (RankSlicedError on any problem)."""
    meta = config.get("hybrid_tr3_tail")
    if not isinstance(meta, dict):
        raise RankSlicedError("config.json has no hybrid_tr3_tail object")
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise RankSlicedError(f"rank-sliced EXL3 metadata is missing: {', '.join(missing)}")
    if meta["codebook"] != "mcg":
        raise RankSlicedError(f"rank-sliced EXL3 currently requires the MCG codebook, got {meta['codebook']!r}")
    layers = meta["moe_layers"]
    if not is_layer_range(layers):
        raise RankSlicedError("hybrid_tr3_tail.moe_layers must be [first, last] with 0 <= first <= last, "
                              f"got {layers!r}")
    if meta["tensor_schema"] != TENSOR_SCHEMA:
        raise RankSlicedError(f"hybrid_tr3_tail.tensor_schema must be exactly {TENSOR_SCHEMA!r}, "
                              f"got {meta['tensor_schema']!r}")
    experts, tp = meta["experts_per_layer"], meta["tp"]
    if not is_int(experts) or experts <= 0 or not is_int(tp) or tp <= 0:
        raise RankSlicedError("hybrid_tr3_tail.experts_per_layer and tp must be positive integers")
    layout = meta.get("rotation_layout", "per_expert_v1")
    if layout not in LAYOUTS:
        raise RankSlicedError(f"hybrid_tr3_tail.rotation_layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "shared_h_v1" and meta.get("shared_h_tensor_schema") != SHARED_H_SCHEMA:
        raise RankSlicedError(f"rotation_layout='shared_h_v1' requires shared_h_tensor_schema == {SHARED_H_SCHEMA!r}")
    if layout != "shared_h_v1" and "shared_h_tensor_schema" in meta:
        raise RankSlicedError("hybrid_tr3_tail declares shared_h_tensor_schema without rotation_layout='shared_h_v1'")
    bits = meta["bits"]
    k_values: tuple[int, ...] = ()
    bits_map: dict[int, tuple[int, ...]] = {}
    if bits == "mixed":
        raw = meta.get("k_values")
        if not isinstance(raw, list) or not raw or not all(is_int(k) and k in ALLOWED_BITS for k in raw):
            raise RankSlicedError(f"hybrid_tr3_tail.bits='mixed' requires k_values: integers within "
                                  f"{ALLOWED_BITS[0]}..{ALLOWED_BITS[-1]}, got {raw!r}")
        k_values = tuple(raw)
        bits_map = _load_bits_map(meta, Path(model_dir) if model_dir else None, layers[0], layers[1], experts,
                                  k_values)
    elif isinstance(bits, (int, float)) and not isinstance(bits, bool):
        if float(bits) != int(bits) or int(bits) not in ALLOWED_BITS:
            raise RankSlicedError(f"hybrid_tr3_tail.bits must be an integer in {ALLOWED_BITS} or 'mixed', got {bits!r}")
        bits = int(bits)
    else:
        raise RankSlicedError(f"hybrid_tr3_tail.bits must be a number or 'mixed', got {bits!r}")
    return RankSlicedSpec(bits=bits, experts_per_layer=experts, moe_layers=(layers[0], layers[1]), tp=tp,
                          rotation_layout=layout, k_values=k_values, bits_per_expert=bits_map)


def check_runtime(spec: RankSlicedSpec, tp_size: int, num_experts: int) -> None:
    """A base stored full-rank (`profile`) serves any TP (each rank slices it at load); a rank-sliced checkpoint
    only its own."""
    if spec.profile is None and tp_size != spec.tp:
        raise RankSlicedError(f"rank-sliced EXL3 checkpoint TP does not match runtime: the checkpoint was sliced "
                              f"for tp={spec.tp}, the server runs tp={tp_size}; pass --tp {spec.tp}")
    if num_experts != spec.experts_per_layer:
        raise RankSlicedError(f"rank-sliced EXL3 checkpoint has {spec.experts_per_layer} experts per layer, the "
                              f"model config {num_experts}")


def normalize_weight_name(name: str, tp_rank: int, spec: RankSlicedSpec | None) -> str | None:
    """Checkpoint name -> the name this rank loads, or None to drop it (another rank's slice)."""
    shared = SHARED_H_WEIGHT_RE.match(name)
    if shared:
        if spec is None or spec.rotation_layout != "shared_h_v1":
            raise RankSlicedError(f"{name}: a shared_h tensor, but the checkpoint does not declare "
                                  "rotation_layout='shared_h_v1'")
        proj, fld = shared["projection"], shared["field"]
        if fld != H_SIDE[proj]:
            raise RankSlicedError(f"{name}: experts.shared_h.{proj} requires {H_SIDE[proj]}")
        if int(shared["rank"]) != tp_rank:
            return None
        return f"{shared['experts_prefix']}.0.{proj}.{fld}"
    sliced = RANK_SLICED_WEIGHT_RE.match(name)
    if not sliced:
        return name
    if int(sliced["rank"]) != tp_rank:
        return None
    prefix, fld = sliced["prefix"], sliced["field"]
    expert = EXPERT_PROJECTION_RE.match(prefix)
    if expert and spec is not None and spec.rotation_layout == "shared_h_v1" and fld == H_SIDE[expert["projection"]]:
        raise RankSlicedError(f"{name}: rotation_layout='shared_h_v1' must store H-side rotations under "
                              "experts.shared_h, not per expert")
    return f"{prefix}.{fld}"


ROLE_PROJECTIONS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))  # SGLang shard id, checkpoint name
ROLE_H_SIDE = {role: H_SIDE[proj] for role, proj in ROLE_PROJECTIONS}


def expert_records(tensors: dict, spec: RankSlicedSpec, experts_prefix: str, layer: int, rank: int):
    """(expert, SGLang role) -> Exl3ModuleRecord of rank `rank`'s slice of each routed expert of one layer, from the
    `.rank{rank}` tensors (shared-H rotations filled in per expert). Records are keyed by the name the tensors load
    under after `normalize_weight_name`. Every missing tensor and every bitrate that disagrees with the metadata is
    an error here, at load time."""
    stored = stored_prefix(tensors, experts_prefix, f"0.gate_proj.rank{rank}.trellis")
    records, problems = {}, []
    for e in range(spec.experts_per_layer):
        for role, proj in ROLE_PROJECTIONS:
            base = f"{stored}.{e}.{proj}.rank{rank}"
            fields = {}
            for fld in ("trellis", "suh", "svh", "mcg"):
                name = f"{base}.{fld}"
                if spec.rotation_layout == "shared_h_v1" and fld == H_SIDE[proj]:
                    name = f"{stored}.shared_h.{proj}.rank{rank}.{fld}"
                if name not in tensors:
                    problems.append(name)
                else:
                    fields[fld] = tensors[name]
            if "trellis" not in fields:
                continue
            k, n, words = fields["trellis"].shape
            bits = words // 16
            want = spec.expert_bits(layer, e)
            if words % 16 or bits != want:
                raise RankSlicedError(f"{base}.trellis: {words / 16:g} bits per weight, but hybrid_tr3_tail says "
                                      f"expert {e} of layer {layer} has K={want}")
            records[(e, role)] = Exl3ModuleRecord(key=f"{experts_prefix}.{e}.{proj}", tensors=fields, bits=bits,
                                                  codebook=Codebook.MCG, in_features=k * 16, out_features=n * 16)
    if problems:
        raise RankSlicedError(f"rank-sliced EXL3 layer {layer}, rank {rank}: {len(problems)} tensor(s) missing, e.g. "
                              f"{problems[:4]}; the checkpoint does not hold this rank's slices (tp={spec.tp})")
    return records


def stored_prefix(tensors: dict, experts_prefix: str, probe: str) -> str:
    """The checkpoint's spelling of an SGLang experts prefix (with or without a leading `model.`): the one under
    which `probe` (e.g. expert 0's gate trellis) is stored."""
    for cand in (experts_prefix, f"model.{experts_prefix}", experts_prefix.removeprefix("model.")):
        if f"{cand}.{probe}" in tensors:
            return cand
    return experts_prefix
