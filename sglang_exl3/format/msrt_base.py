"""The closed `exl3-msrt-base/1` profile of `hybrid_tr3_tail` (shared/reference/seeds.md §1.3): the base that expert
cartridges are built against. Its routed experts are stored full-rank (`.rank0` only) and every key is fixed, so any
key the profile does not define is an error. It loads as a rank-sliced spec of tp = 1 whose `.rank0` tensors every
TP rank reads and slices at load (128-element units, gate/up on the output axis, down on the input axis, as
exllamav3's per-expert MoE is sliced); each layer's experts are verified against the per-layer digest before slicing
(layers/moe.py), so a server proves the base it serves is the one its cartridges were encoded for.

Format layer: no torch, no SGLang.
"""

from __future__ import annotations

import re

from sglang_exl3.format.json_values import is_int
from sglang_exl3.format.msrt_fingerprint import MCG_MULTIPLIER, root_digest
from sglang_exl3.format.rank_sliced import ALLOWED_BITS, TENSOR_SCHEMA, RankSlicedError, RankSlicedSpec, is_layer_range

PROFILE = "exl3-msrt-base/1"
KEYS = {"format", "runtime_profile", "bits", "codebook", "moe_layers", "moe_layer_coverage", "tensor_schema",
        "tensor_parallel", "mcg_multiplier", "compatibility_sha256", "compatibility_by_layer", "experts_per_layer"}
TENSOR_PARALLEL = {"storage_layout": "full-rank", "storage_world_size": 1, "storage_ranks": [0],
                   "runtime_partitioning": "slice-full-rank", "slice_alignment": 128,
                   "axis_by_projection": {"gate_proj": "output", "up_proj": "output", "down_proj": "input"}}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def claims(meta: dict) -> bool:
    return isinstance(meta, dict) and "runtime_profile" in meta


def parse(meta: dict) -> RankSlicedSpec:
    """Validate the profile (RankSlicedError naming the key) and return the rank-sliced spec it loads as (tp = 1)."""
    where = f"hybrid_tr3_tail (closed {PROFILE})"
    if meta.get("runtime_profile") != PROFILE:
        raise RankSlicedError(f"hybrid_tr3_tail.runtime_profile {meta.get('runtime_profile')!r} is not supported; "
                              f"the only runtime profile is {PROFILE!r}")
    unknown, missing = sorted(set(meta) - KEYS), sorted(KEYS - set(meta))
    if unknown or missing:
        raise RankSlicedError(f"{where}: " + "; ".join(
            ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else [])))
    bits = meta["bits"]
    if (not isinstance(bits, (int, float)) or isinstance(bits, bool) or float(bits) != int(bits)
            or int(bits) not in ALLOWED_BITS):
        raise RankSlicedError(f"{where}: bits must be an integral K in {ALLOWED_BITS}, got {bits!r}")
    k = int(bits)
    fixed = {"format": "exl3-trellis", "codebook": "mcg", "tensor_schema": TENSOR_SCHEMA,
             "mcg_multiplier": MCG_MULTIPLIER, "tensor_parallel": TENSOR_PARALLEL}
    for key, want in fixed.items():
        if meta[key] != want:
            raise RankSlicedError(f"{where}: {key} must be {want!r}, got {meta[key]!r}")
    layers, coverage, experts = meta["moe_layers"], meta["moe_layer_coverage"], meta["experts_per_layer"]
    if not is_layer_range(layers):
        raise RankSlicedError(f"{where}: moe_layers must be [first, last] with 0 <= first <= last, got {layers!r}")
    if (not isinstance(coverage, list) or not coverage or not all(is_int(x) for x in coverage)
            or coverage != sorted(set(coverage)) or coverage[0] != layers[0] or coverage[-1] != layers[1]):
        raise RankSlicedError(f"{where}: moe_layer_coverage must be the sorted layers from {layers[0]} to "
                              f"{layers[1]} that hold experts, got {coverage!r}")
    if not is_int(experts) or experts <= 0:
        raise RankSlicedError(f"{where}: experts_per_layer must be a positive integer, got {experts!r}")
    by_layer, root = meta["compatibility_by_layer"], meta["compatibility_sha256"]
    digests_ok = isinstance(by_layer, dict) and all(isinstance(v, str) and _HEX64.match(v) for v in by_layer.values())
    if not digests_ok or sorted(by_layer, key=lambda s: int(s) if s.isdigit() else -1) != [str(x) for x in coverage]:
        raise RankSlicedError(f"{where}: compatibility_by_layer must map every covered layer "
                              f"({coverage[0]}..{coverage[-1]}) as a string to a lowercase SHA-256 hex digest")
    if not isinstance(root, str) or root_digest(k, {int(x): v for x, v in by_layer.items()}) != root:
        raise RankSlicedError(f"{where}: compatibility_sha256 {root!r} does not match its compatibility_by_layer map")
    return RankSlicedSpec(bits=k, experts_per_layer=experts, moe_layers=(layers[0], layers[1]), tp=1,
                          coverage=tuple(coverage), profile=PROFILE, compatibility_sha256=root,
                          compatibility_by_layer={int(x): v for x, v in by_layer.items()})
