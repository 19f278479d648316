"""The closed `fq-cartridge-adapter/3` manifest (`adapter_config.json`, shared/reference/seeds.md §1.6): what an
expert cartridge declares about itself before any tensor is read. Every field is required and no other is allowed,
so a manifest from another producer version fails here, naming the field, and never half-loads.

A cartridge adds residual stages to an `exl3-msrt-base/1` base's routed experts:
y = base_exl3_gemm(x) + sum over stages of stage_exl3_gemm(x) / stage_scale, per projection, with the base's
rotations. The manifest names the base it was encoded for (root and per-layer compatibility digests), the chain of
stages (each with its bitrate K and parent), the TP layout of its tensors, the shards with their sizes and SHA-256,
and the coverage: which experts of which layers each stage holds.

Format layer: no torch, no SGLang.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath

from sglang_exl3.format.json_values import is_int
from sglang_exl3.format.msrt_fingerprint import MCG_MULTIPLIER

SCHEMA = "fq-cartridge-adapter/3"
FIELDS = frozenset({
    "schema", "assembly", "base", "chain", "format", "runtime_profile", "rotation_ownership",
    "standard_lora_compatible", "runtime_operation", "codebook", "mcg_multiplier", "mcg_ownership", "scale_shape",
    "tensor_parallel", "shards", "num_tensors", "selected_experts", "selected_layers", "coverage",
    "producer_verified_signer", "campaign", "source_assembly", "tool_version", "created_utc"})
CONSTANTS = {
    "schema": SCHEMA, "format": "exl3-msrt-packed", "runtime_profile": "exl3-msrt-additive/1",
    "rotation_ownership": "base", "standard_lora_compatible": False,
    "runtime_operation": "base_exl3_gemm + sum(stage_exl3_gemm / stage_scale)", "codebook": "mcg",
    "mcg_multiplier": MCG_MULTIPLIER, "mcg_ownership": "adapter-config", "scale_shape": []}
AXIS_BY_PROJECTION = {"gate_proj": "output", "up_proj": "output", "down_proj": "input"}
CAMPAIGN_FIELDS = frozenset({"recipe_sha256", "base_model", "base_revision", "encoder_sha256", "signer_pubkey",
                             "block_size", "moe_layers"})
LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
BASE_K = range(2, 7)
STAGE_K = range(1, 7)
MAX_SHARD_BYTES = 64 << 30
MAX_TOTAL_BYTES = 1 << 40
MANIFEST_NAME = "adapter_config.json"


class CartridgeError(ValueError):
    """A cartridge (manifest, shard or tensor) that cannot be served; the message names the file, field or tensor
    and the rule it breaks. Raised before anything live changes."""


@dataclass(frozen=True)
class Stage:
    label: str
    k: int  # residual bitrate
    parent: str
    experts: tuple[int, ...] | None  # None: "all" selected experts


@dataclass(frozen=True)
class ShardEntry:
    path: str  # relative to the adapter directory
    size: int
    sha256: str


@dataclass(frozen=True)
class CartridgeManifest:
    assembly: str
    base_label: str
    base_k: int
    base_root: str
    base_by_layer: dict[int, str]
    chain: tuple[Stage, ...]
    layout: str  # "full" (one rank0 artefact, sliced at load) or "rank-sharded"
    world_size: int
    shards: tuple[ShardEntry, ...]
    num_tensors: int
    selected_experts: tuple[int, ...]
    selected_layers: tuple[int, ...]
    coverage: dict[str, dict[int, tuple[int, ...]]]  # stage label -> layer -> experts

    def stage(self, label: str) -> Stage:
        return next(s for s in self.chain if s.label == label)


def _fail(where: str, message: str) -> CartridgeError:
    return CartridgeError(f"{where}: {message}")


def _exact_keys(value, keys: frozenset, where: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(where, f"must be an object with keys {sorted(keys)}, got {type(value).__name__}")
    missing, unexpected = sorted(keys - set(value)), sorted(set(value) - keys)
    if missing or unexpected:
        raise _fail(where, f"fields do not match {SCHEMA}; missing={missing}, unexpected={unexpected}")
    return value


def _label(value, where: str) -> str:
    if not isinstance(value, str) or not LABEL.match(value):
        raise _fail(where, f"label {value!r} must match {LABEL.pattern} (a letter or digit, then up to 31 letters, "
                           "digits, '_' or '-')")
    return value


def _hex64(value, where: str, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not HEX64.match(value):
        raise _fail(where, f"must be a lowercase 64-digit SHA-256 hex string{' or null' if nullable else ''}, "
                           f"got {value!r}")
    return value


def _index_list(value, where: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value or not all(is_int(v) and v >= 0 for v in value)
            or len(set(value)) != len(value)):
        raise _fail(where, f"must be a non-empty list of unique non-negative integers, got {value!r}")
    return tuple(value)


def _relative_path(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"path must be a non-empty string, got {value!r}")
    p = PurePosixPath(value)
    if p.is_absolute() or value.startswith("\\") or ":" in p.parts[0] or ".." in p.parts or "\\" in value:
        raise _fail(where, f"path {value!r} must be relative to the adapter directory, without '..'")
    return value


def _k(value, allowed: range, where: str) -> int:
    if not is_int(value) or value not in allowed:
        raise _fail(where, f"k must be an integer in {allowed.start}..{allowed.stop - 1}, got {value!r}")
    return value


def parse_manifest(doc, runtime_tp: int | None = None, where: str = MANIFEST_NAME) -> CartridgeManifest:
    """Validate a decoded manifest; `runtime_tp` (the server's TP size) checks a rank-sharded layout's world size."""
    _exact_keys(doc, FIELDS, where)
    for key, want in CONSTANTS.items():
        if doc[key] != want or type(doc[key]) is not type(want):
            raise _fail(f"{where}.{key}", f"must be {want!r}, got {doc[key]!r}")
    assembly = _label(doc["assembly"], f"{where}.assembly")
    selected_layers = _index_list(doc["selected_layers"], f"{where}.selected_layers")
    selected_experts = _index_list(doc["selected_experts"], f"{where}.selected_experts")

    base = _exact_keys(doc["base"], frozenset({"label", "k", "compatibility_sha256", "compatibility_by_layer"}),
                       f"{where}.base")
    base_label = _label(base["label"], f"{where}.base.label")
    base_k = _k(base["k"], BASE_K, f"{where}.base")
    root = _hex64(base["compatibility_sha256"], f"{where}.base.compatibility_sha256")
    by_layer_raw = base["compatibility_by_layer"]
    want_layers = {str(layer) for layer in selected_layers}
    if not isinstance(by_layer_raw, dict) or set(by_layer_raw) != want_layers:
        raise _fail(f"{where}.base.compatibility_by_layer",
                    f"must map exactly the selected layers {sorted(selected_layers)} (as strings) to digests, got "
                    f"keys {sorted(by_layer_raw) if isinstance(by_layer_raw, dict) else by_layer_raw!r}")
    by_layer = {int(layer): _hex64(d, f"{where}.base.compatibility_by_layer[{layer}]")
                for layer, d in by_layer_raw.items()}

    chain = _chain(doc["chain"], base_label, f"{where}.chain")
    layout, world_size = _tensor_parallel(doc["tensor_parallel"], runtime_tp, f"{where}.tensor_parallel")
    shards = _shards(doc["shards"], f"{where}.shards")
    if not is_int(doc["num_tensors"]) or doc["num_tensors"] < 1:
        raise _fail(f"{where}.num_tensors", f"must be a positive integer, got {doc['num_tensors']!r}")
    coverage = _coverage(doc["coverage"], chain, selected_layers, selected_experts, f"{where}.coverage")
    _hex64(doc["producer_verified_signer"], f"{where}.producer_verified_signer", nullable=True)
    _campaign(doc["campaign"], f"{where}.campaign")
    source = _exact_keys(doc["source_assembly"], frozenset({"path", "sha256"}), f"{where}.source_assembly")
    _relative_path(source["path"], f"{where}.source_assembly")
    _hex64(source["sha256"], f"{where}.source_assembly.sha256")
    if not isinstance(doc["tool_version"], str) or not doc["tool_version"].strip():
        raise _fail(f"{where}.tool_version", f"must be a non-empty string, got {doc['tool_version']!r}")
    _timestamp(doc["created_utc"], f"{where}.created_utc")
    return CartridgeManifest(assembly=assembly, base_label=base_label, base_k=base_k, base_root=root,
                             base_by_layer=by_layer, chain=chain, layout=layout, world_size=world_size,
                             shards=shards, num_tensors=doc["num_tensors"], selected_experts=selected_experts,
                             selected_layers=selected_layers, coverage=coverage)


def decode_manifest(raw: bytes, where: str = MANIFEST_NAME) -> dict:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _fail(where, f"is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise _fail(where, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def _chain(value, base_label: str, where: str) -> tuple[Stage, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(where, f"must be a non-empty list of stages, got {value!r}")
    stages, parent = [], base_label
    for i, raw in enumerate(value):
        at = f"{where}[{i}]"
        _exact_keys(raw, frozenset({"label", "k", "parent", "experts"}), at)
        label = _label(raw["label"], f"{at}.label")
        if label == base_label or any(s.label == label for s in stages):
            raise _fail(f"{at}.label", f"duplicate label {label!r} (labels of the base and the stages are unique)")
        if raw["parent"] != parent:
            raise _fail(f"{at}.parent", f"must be {parent!r} (the {'base' if i == 0 else 'previous stage'}), got "
                                        f"{raw['parent']!r}")
        experts = None if raw["experts"] == "all" else _index_list(raw["experts"], f"{at}.experts")
        stages.append(Stage(label, _k(raw["k"], STAGE_K, at), parent, experts))
        parent = label
    return tuple(stages)


def _tensor_parallel(value, runtime_tp: int | None, where: str) -> tuple[str, int]:
    tp = _exact_keys(value, frozenset({"layout", "world_size", "ranks", "axis_by_projection"}), where)
    layout, world = tp["layout"], tp["world_size"]
    if layout not in ("full", "rank-sharded"):
        raise _fail(f"{where}.layout", f"must be 'full' or 'rank-sharded', got {layout!r}")
    if not is_int(world) or world < 1:
        raise _fail(f"{where}.world_size", f"must be a positive integer, got {world!r}")
    if tp["ranks"] != list(range(world)):
        raise _fail(f"{where}.ranks", f"must be {list(range(world))} for world_size {world}, got {tp['ranks']!r}")
    if tp["axis_by_projection"] != AXIS_BY_PROJECTION:
        raise _fail(f"{where}.axis_by_projection", f"must be {AXIS_BY_PROJECTION}, got {tp['axis_by_projection']!r}")
    if layout == "full" and world != 1:
        raise _fail(where, f"a 'full' layout is one rank0 artefact: world_size 1, ranks [0] (got {world})")
    if layout == "rank-sharded" and runtime_tp is not None and world != runtime_tp:
        raise _fail(where, f"a rank-sharded cartridge of world_size {world} cannot serve tp={runtime_tp}; "
                           f"write it for {runtime_tp} ranks or with the 'full' layout")
    return layout, world


def _shards(value, where: str) -> tuple[ShardEntry, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(where, f"must be a non-empty list of shards, got {value!r}")
    shards, total = [], 0
    for i, raw in enumerate(value):
        at = f"{where}[{i}]"
        _exact_keys(raw, frozenset({"path", "size", "sha256"}), at)
        path = _relative_path(raw["path"], at)
        size = raw["size"]
        if not is_int(size) or not 1 <= size <= MAX_SHARD_BYTES:
            raise _fail(f"{at}.size", f"must be an integer from 1 to {MAX_SHARD_BYTES} bytes (64 GiB), got {size!r}")
        if any(s.path == path for s in shards):
            raise _fail(at, f"duplicate shard path {path!r}")
        total += size
        shards.append(ShardEntry(path, size, _hex64(raw["sha256"], f"{at}.sha256")))
    if total > MAX_TOTAL_BYTES:
        raise _fail(where, f"total size {total} bytes exceeds 1 TiB")
    return tuple(shards)


def _coverage(value, chain: tuple[Stage, ...], layers: tuple[int, ...], experts: tuple[int, ...],
              where: str) -> dict[str, dict[int, tuple[int, ...]]]:
    labels = [s.label for s in chain]
    if not isinstance(value, dict) or sorted(value) != sorted(labels):
        raise _fail(where, f"keys must be the chain's labels {labels}, got "
                           f"{sorted(value) if isinstance(value, dict) else value!r}")
    out: dict[str, dict[int, tuple[int, ...]]] = {}
    for stage in chain:
        at, raw = f"{where}.{stage.label}", value[stage.label]
        if not isinstance(raw, dict) or not raw:
            raise _fail(at, f"must map layers (as strings) to expert lists, got {raw!r}")
        layer_map = {}
        for key, ids in raw.items():
            if not key.isdigit() or int(key) not in layers:
                raise _fail(at, f"layer {key!r} is not one of the selected layers {list(layers)}")
            got = _index_list(ids, f"{at}[{key}]")
            outside = sorted(set(got) - set(experts))
            if outside:
                raise _fail(f"{at}[{key}]", f"experts {outside} are not selected_experts")
            if stage.experts is not None and set(got) - set(stage.experts):
                raise _fail(f"{at}[{key}]", f"experts {sorted(set(got) - set(stage.experts))} are outside the "
                                            f"stage's declared experts")
            layer_map[int(key)] = tuple(sorted(got))
        if stage.experts is None and any(layer_map.get(layer) != tuple(sorted(experts)) for layer in layers):
            raise _fail(at, "stage declares experts 'all' but does not cover every selected expert of every "
                            "selected layer")
        parent = out.get(stage.parent)
        if parent is not None:
            for layer, ids in layer_map.items():
                extra = sorted(set(ids) - set(parent.get(layer, ())))
                if extra:
                    raise _fail(at, f"layer {layer} experts {extra} are not covered by parent stage "
                                    f"{stage.parent!r}: coverage is not parent-closed")
        out[stage.label] = layer_map
    return out


def _campaign(value, where: str) -> None:
    campaign = _exact_keys(value, CAMPAIGN_FIELDS, where)
    _hex64(campaign["recipe_sha256"], f"{where}.recipe_sha256")
    _hex64(campaign["encoder_sha256"], f"{where}.encoder_sha256", nullable=True)
    for key in ("base_model", "base_revision", "signer_pubkey"):
        if not isinstance(campaign[key], str):
            raise _fail(f"{where}.{key}", f"must be a string, got {campaign[key]!r}")
    if not is_int(campaign["block_size"]) or campaign["block_size"] < 1:
        raise _fail(f"{where}.block_size", f"must be a positive integer, got {campaign['block_size']!r}")
    if not isinstance(campaign["moe_layers"], list) or not all(is_int(v) and v >= 0 for v in campaign["moe_layers"]):
        raise _fail(f"{where}.moe_layers", f"must be a list of layer indices, got {campaign['moe_layers']!r}")


def _timestamp(value, where: str) -> None:
    ok = isinstance(value, str) and re.match(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$", value)
    if ok:
        try:
            ok = datetime.fromisoformat(value.replace("Z", "+00:00")).tzinfo is not None
        except ValueError:
            ok = False
    if not ok:
        raise _fail(where, f"must be an RFC 3339 timestamp with a timezone (e.g. 2026-12-04T12:00:00Z), got {value!r}")
