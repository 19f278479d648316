"""R7 routed experts (`quantization_config.r7_routed_experts`), exactly as the reference vLLM implementation defines
them: per-projection bitrates K3/K4/K5, full (unsliced) per-expert tensors without rank segments, and one
hidden-side rotation per layer shared by every expert (`experts.r7_shared.gate_up_suh`, `experts.r7_shared.down_svh`).

Format layer: no torch, no SGLang. Every rejection names the key or tensor and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sglang_exl3.format.checkpoint import Exl3ModuleRecord
from sglang_exl3.format.constants import MARKER_VALUES, Codebook
from sglang_exl3.format.json_values import is_int
from sglang_exl3.format.rank_sliced import H_SIDE, ROLE_PROJECTIONS, stored_prefix

BLOCK = "r7_routed_experts"
SCHEMA = "r7-complete-v2-checkpoint-v1"
ALLOWED_K = (3, 4, 5)
# Per projection: the hidden-side rotation (rank_sliced.H_SIDE) is the layer's, stored once as SHARED_FIELD; the
# intermediate-side one (OWN_SIDE) each expert keeps.
SHARED_SIDE = H_SIDE
OWN_SIDE = {proj: "svh" if side == "suh" else "suh" for proj, side in H_SIDE.items()}
SHARED_FIELD = {"gate_proj": "gate_up_suh", "up_proj": "gate_up_suh", "down_proj": "down_svh"}

EXPERT_RE = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\."
                       r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<field>[A-Za-z0-9_]+)$")
SHARED_RE = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.r7_shared\.(?P<field>[A-Za-z0-9_]+)$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class R7Error(ValueError):
    pass


@dataclass(frozen=True)
class R7Spec:
    moe_layers: tuple[int, int]  # inclusive
    k_values: tuple[int, ...]  # sorted, unique

    def covers(self, layer: int) -> bool:
        return self.moe_layers[0] <= layer <= self.moe_layers[1]

    def covers_name(self, name: str) -> bool:
        """Whether a tensor name lies in an R7 layer's routed experts (the only modules R7 claims)."""
        if ".mlp.experts." not in name:
            return False
        layer = LAYER_RE.search(name)
        return layer is not None and self.covers(int(layer.group(1)))


def block_of(config: dict) -> dict | None:
    """config.json's `quantization_config.r7_routed_experts` (or the block in a quantization_config dict), if any."""
    quant = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else config
    return quant.get(BLOCK) if isinstance(quant, dict) else None


def claims(config: dict) -> bool:
    """An R7 checkpoint is EXL3 whatever its quant_method says (the reference's rule: seed 001's OOM came from a
    `modelopt` label that made vLLM drop the block and load the experts as BF16)."""
    return block_of(config) is not None


def parse(block) -> R7Spec:
    """Validate the `r7_routed_experts` block (R7Error naming the key on any problem)."""
    if not isinstance(block, dict):
        raise R7Error(f"quantization_config.{BLOCK} must be a JSON object, got {type(block).__name__}")
    checks = (("schema", SCHEMA), ("codebook", "mcg"), ("bits", "mixed_tensor"))
    for key, want in checks:
        if block.get(key) != want:
            raise R7Error(f"quantization_config.{BLOCK}.{key} must be {want!r}, got {block.get(key)!r}; this "
                          "checkpoint was not written as R7 routed experts")
    layers = block.get("moe_layers")
    if (not isinstance(layers, list) or len(layers) != 2 or not all(is_int(x) for x in layers)
            or layers[0] < 0 or layers[1] < layers[0]):
        raise R7Error(f"quantization_config.{BLOCK}.moe_layers must be two JSON integers [first, last] with "
                      f"0 <= first <= last (booleans and floats are refused), got {layers!r}")
    ks = block.get("k_values")
    if not isinstance(ks, list) or not ks or not all(is_int(k) and k in ALLOWED_K for k in ks):
        raise R7Error(f"quantization_config.{BLOCK}.k_values must be a non-empty list of JSON integers within "
                      f"{list(ALLOWED_K)}, got {ks!r}")
    return R7Spec(moe_layers=(layers[0], layers[1]), k_values=tuple(sorted(set(ks))))


def normalize_weight_name(name: str, spec: R7Spec) -> list[str]:
    """The names a checkpoint tensor loads under: a layer's shared hidden-side rotation goes to expert 0's slot
    (gate_up_suh to both gate_proj.suh and up_proj.suh), where the MoE method reads it for every expert."""
    shared = SHARED_RE.match(name)
    if shared is None or not spec.covers_name(name):
        return [name]
    field, experts = shared["field"], shared["experts"]
    if field == "gate_up_suh":
        return [f"{experts}.0.gate_proj.suh", f"{experts}.0.up_proj.suh"]
    if field == "down_svh":
        return [f"{experts}.0.down_proj.svh"]
    raise R7Error(f"{name}: unknown R7 shared tensor; r7_shared holds gate_up_suh and down_svh only")


def _vector_problem(info, length: int) -> str | None:
    if info.dtype != "F16" or len(info.shape) != 1 or info.shape[0] != length:
        return f"{info.name} must be fp16 [{length}], got {info.torch_dtype_name} {list(info.shape)}"
    return None


def _marker_problem(info) -> str | None:
    if info.name.endswith(".mul1"):
        return f"{info.name}: R7 experts use the MCG codebook only (quantization_config.{BLOCK}.codebook)"
    if info.dtype != "I32" or info.shape != () or int.from_bytes(info.read_bytes(), "little") != MARKER_VALUES["mcg"]:
        return f"{info.name} is not the MCG codebook marker (a scalar int32 {MARKER_VALUES['mcg']:#x})"
    return None


def expert_records(tensors: dict, spec: R7Spec, experts_prefix: str, layer: int, experts: int, hidden: int,
                   inter: int) -> dict[tuple[int, str], Exl3ModuleRecord]:
    """(expert, SGLang role) -> record of every routed expert projection of one R7 layer, its hidden-side rotation
    taken from `experts.r7_shared`. Every missing tensor, bitrate outside k_values, wrong shape or dtype is one
    R7Error listing the problems, at load time."""
    stored = stored_prefix(tensors, experts_prefix, "0.gate_proj.trellis")
    problems, records = [], {}
    shared = {}
    for field in ("gate_up_suh", "down_svh"):
        info = tensors.get(f"{stored}.r7_shared.{field}")
        if info is None:
            problems.append(f"{stored}.r7_shared.{field} is missing")
        elif (p := _vector_problem(info, hidden)) is not None:
            problems.append(p)
        else:
            shared[field] = info
    for e in range(experts):
        for role, proj in ROLE_PROJECTIONS:
            base = f"{stored}.{e}.{proj}"
            k_in, n_out = (inter, hidden) if proj == "down_proj" else (hidden, inter)
            present = {n[len(base) + 1:] for n in tensors if n.startswith(base + ".")}
            unexpected = present - {"trellis", OWN_SIDE[proj], "mcg", "mul1"}
            if SHARED_SIDE[proj] in unexpected:
                problems.append(f"{base}.{SHARED_SIDE[proj]}: R7 stores the hidden-side rotation once per layer "
                                f"under experts.r7_shared.{SHARED_FIELD[proj]}, not per expert")
            elif unexpected:
                problems.append(f"{base}: unexpected tensor(s) {sorted(unexpected)}")
            lacking = [f for f in ("trellis", OWN_SIDE[proj], "mcg") if f not in present]
            if lacking:
                problems.append(f"{base}: missing {', '.join(lacking)}")
                continue
            trellis, own, marker = (tensors[f"{base}.{f}"] for f in ("trellis", OWN_SIDE[proj], "mcg"))
            for m in ("mcg", "mul1"):
                if m in present and (p := _marker_problem(tensors[f"{base}.{m}"])) is not None:
                    problems.append(p)
            want = [k_in // 16, n_out // 16]
            if trellis.dtype != "I16" or len(trellis.shape) != 3 or list(trellis.shape[:2]) != want:
                problems.append(f"{base}.trellis must be int16 [{want[0]}, {want[1]}, 16*K] (hidden {hidden}, "
                                f"intermediate {inter}), got {trellis.torch_dtype_name} {list(trellis.shape)}")
                continue
            words = trellis.shape[2]
            if words % 16 or words // 16 not in spec.k_values:
                problems.append(f"{base}.trellis holds K={words / 16:g} bits per weight, which "
                                f"quantization_config.{BLOCK}.k_values {list(spec.k_values)} does not declare")
                continue
            if (p := _vector_problem(own, n_out if OWN_SIDE[proj] == "svh" else k_in)) is not None:
                problems.append(p)
                continue
            fields = {"trellis": trellis, OWN_SIDE[proj]: own, "mcg": marker}
            if SHARED_FIELD[proj] in shared:
                fields[SHARED_SIDE[proj]] = shared[SHARED_FIELD[proj]]
            records[(e, role)] = Exl3ModuleRecord(key=f"{experts_prefix}.{e}.{proj}", tensors=fields,
                                                  bits=words // 16, codebook=Codebook.MCG, in_features=k_in,
                                                  out_features=n_out)
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise R7Error(f"R7 routed experts of layer {layer} ({stored}): {'; '.join(problems[:6])}{more}. Re-export "
                      "the layer with the R7 producer")
    return records


def expert_dims(config: dict) -> tuple[int, int, int] | None:
    """(routed experts per layer, hidden size, expert intermediate size) from config.json, or None where it does not
    say (then the layers are checked when SGLang builds them)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    experts = next((text[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in text), None)
    inter = text.get("moe_intermediate_size", text.get("intermediate_size"))
    dims = (experts, text.get("hidden_size"), inter)
    return dims if all(is_int(d) and d > 0 for d in dims) else None


def check_layers(tensors: dict, spec: R7Spec, config: dict) -> list[str]:
    """Every R7 layer's problems (expert_records' messages), for `inspect` and the checkpoint load."""
    dims = expert_dims(config)
    if dims is None:
        return []
    out = []
    for layer in range(spec.moe_layers[0], spec.moe_layers[1] + 1):
        try:
            expert_records(tensors, spec, f"model.layers.{layer}.mlp.experts", layer, *dims)
        except R7Error as e:
            out.append(str(e))
    return out


def packed_bytes(records: dict[tuple[int, str], Exl3ModuleRecord]) -> tuple[int, int]:
    """(bytes as stored, one trellis per projection at its own K; bytes if every projection were padded to the
    layer's widest K, the reference's first layout)."""
    widest = max(int(r.bits) for r in records.values())
    tight = sum(r.tensors["trellis"].nbytes for r in records.values())
    padded = sum(r.tensors["trellis"].nbytes // int(r.bits) * widest for r in records.values())
    return tight, padded
