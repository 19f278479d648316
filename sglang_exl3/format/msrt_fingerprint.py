"""Compatibility fingerprints of an `exl3-msrt-base/1` base (shared/reference/seeds.md §1.3), byte-exact with the
reference's: a cartridge is built against one base, and these digests are how a server proves that the base it
loaded is that base, layer by layer, whatever its TP layout (`.rank0` is not part of a tensor's logical name).

- a tensor record: logical name, dtype label, shape, SHA-256 of the raw little-endian bytes;
- a layer digest: SHA-256 of the canonical JSON of {schema, k, layer, records sorted by name};
- the root: SHA-256 of the canonical JSON of {schema, k, layers: {str(layer): digest}}.

K is the integer bitrate (2, not 2.0: the digest hashes its JSON spelling).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # format/ imports no torch: tensors arrive from the caller
    import torch

LAYER_SCHEMA = "fq-msrt-base-layer-compatibility/1"
ROOT_SCHEMA = "fq-msrt-base-compatibility/2"
MCG_MULTIPLIER = 3417055213  # stored as the int32 with the same bytes: -877912083
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("trellis", "suh", "svh", "mcg")
_DTYPES = {"torch.float16": "F16", "torch.float32": "F32", "torch.int16": "I16", "torch.int32": "I32"}
EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)(?:\.rank0)?\.(\w+)$")


class FingerprintError(ValueError):
    """A base tensor or digest that does not satisfy the profile; the message names it."""


def logical_name(name: str) -> str:
    return name.replace(".rank0.", ".")


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def tensor_record(name: str, tensor: torch.Tensor) -> dict:
    label = _DTYPES.get(str(tensor.dtype))
    if label is None:
        raise FingerprintError(f"{name}: dtype {tensor.dtype} has no fingerprint label (F16, F32, I16, I32)")
    raw = tensor.detach().cpu().contiguous().numpy().tobytes()  # little-endian on the hosts this runs on
    return {"name": logical_name(name), "dtype": label, "shape": list(tensor.shape),
            "sha256": hashlib.sha256(raw).hexdigest()}


def check_expert_tensor(name: str, tensor: torch.Tensor, k: int) -> re.Match:
    """The producer's rules for one routed-expert tensor of the base; its name's (layer, expert, projection, part)."""
    m = EXPERT_TENSOR.match(name)
    part = m.group(4) if m else None
    if m is None or m.group(3) not in PROJECTIONS or part not in PARTS:
        raise FingerprintError(f"{name}: not a routed-expert tensor of the base "
                               "(model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.rank0.{trellis,suh,svh,mcg})")
    dtype = _DTYPES.get(str(tensor.dtype))
    if part == "trellis" and (dtype != "I16" or tensor.dim() != 3 or tensor.shape[2] != 16 * k):
        raise FingerprintError(f"{name}: trellis must be int16 [in/16, out/16, {16 * k}] at K={k}, "
                               f"got {tensor.dtype} {list(tensor.shape)}")
    if part in ("suh", "svh") and (dtype != "F16" or tensor.dim() != 1):
        raise FingerprintError(f"{name}: {part} must be a 1-D float16 vector, got {tensor.dtype} {list(tensor.shape)}")
    if part == "mcg" and (dtype != "I32" or tensor.numel() != 1
                          or int(tensor) & 0xFFFFFFFF != MCG_MULTIPLIER):
        raise FingerprintError(f"{name}: mcg must be the int32 scalar of the MCG multiplier {MCG_MULTIPLIER}")
    return m


def layer_digest(k: int, layer: int, tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest of one layer's routed experts. Every expert must hold all 3 projections x 4 parts, with suh and svh
    matching the trellis (in = 16 x dim 0, out = 16 x dim 1)."""
    experts: dict[int, dict[tuple[str, str], torch.Tensor]] = {}
    for name, t in tensors.items():
        m = check_expert_tensor(name, t, k)
        if int(m.group(1)) != layer:
            raise FingerprintError(f"{name}: belongs to layer {m.group(1)}, not {layer}")
        experts.setdefault(int(m.group(2)), {})[(m.group(3), m.group(4))] = t
    if not experts:
        raise FingerprintError(f"layer {layer}: no routed-expert tensors")
    for e, parts in sorted(experts.items()):
        missing = [f"{p}.{q}" for p in PROJECTIONS for q in PARTS if (p, q) not in parts]
        if missing:
            raise FingerprintError(f"layer {layer} expert {e}: missing {missing}")
        for p in PROJECTIONS:
            rows, cols = parts[(p, "trellis")].shape[:2]
            for q, want in (("suh", rows * 16), ("svh", cols * 16)):
                if parts[(p, q)].shape[0] != want:
                    raise FingerprintError(f"layer {layer} expert {e} {p}.{q}: {parts[(p, q)].shape[0]} entries, "
                                           f"the trellis needs {want}")
    records = sorted((tensor_record(n, t) for n, t in tensors.items()), key=lambda r: r["name"])
    body = {"schema": LAYER_SCHEMA, "k": int(k), "layer": int(layer), "tensors": records}
    return hashlib.sha256(canonical(body)).hexdigest()


def root_digest(k: int, by_layer: Mapping[int, str]) -> str:
    layers = {str(layer): by_layer[layer] for layer in sorted(by_layer, key=int)}
    return hashlib.sha256(canonical({"schema": ROOT_SCHEMA, "k": int(k), "layers": layers})).hexdigest()


def verify(k: int, root: str, by_layer: Mapping[int | str, str], loaded: Mapping[int, Mapping[str, torch.Tensor]]):
    """The base a server loaded against the digests its config carries: the root must be the recomputation of the
    per-layer map, and every loaded layer must reproduce its digest."""
    stated = {int(layer): digest for layer, digest in by_layer.items()}
    if root_digest(k, stated) != root:
        raise FingerprintError(f"compatibility_sha256 {root} does not match its compatibility_by_layer map")
    for layer, tensors in sorted(loaded.items()):
        if layer not in stated:
            raise FingerprintError(f"layer {layer} is loaded but has no entry in compatibility_by_layer")
        got = layer_digest(k, layer, tensors)
        if got != stated[layer]:
            raise FingerprintError(f"layer {layer}: the loaded base tensors do not match compatibility digest "
                                   f"{stated[layer]} (recomputed {got})")
