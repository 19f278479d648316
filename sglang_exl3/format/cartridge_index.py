"""The tensors of a staged cartridge, indexed and checked against its manifest (seeds.md §1.6) from the safetensors
headers alone (the scales' 4 bytes excepted): every key is a stage's trellis or its fp32 scale, each trellis has its
scale and each scale its trellis, the observed coverage, layers, experts and tensor count are what the manifest
declares, every (stage, layer, expert) holds all three projections on every rank, and a rank-sharded cartridge has
the same topology and the same scales on every rank. Shapes against the live layers are checked when a layer
materialises (layers/cartridge.py).

Format layer: no torch, no SGLang.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from sglang_exl3.format.cartridge_manifest import LABEL, CartridgeError, CartridgeManifest
from sglang_exl3.format.safetensors_index import ShardError, TensorInfo, read_header

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_KEY = (r"^(?P<layer>.+\.experts)\.(?P<expert>[0-9]+)\.(?P<projection>gate_proj|up_proj|down_proj)"
        r"\.rank(?P<rank>[0-9]+)\.{kind}_(?P<label>.+)$")
TRELLIS_KEY = re.compile(_KEY.format(kind="trellis"))
SCALE_KEY = re.compile(_KEY.format(kind="scale"))
CANONICAL_LAYER = re.compile(r"^model\.layers\.([0-9]+)\.mlp\.experts$")
_LAYER_SEGMENT = re.compile(r"(?:^|\.)layers\.([0-9]+)(?=\.|$)")


def live_layer_index(name: str) -> int:
    """The layer index of a live experts module from its single numeric `layers.<idx>` segment, so that wrapped names
    (`language_model.model.layers.3.mlp.experts`) match the manifest's canonical ones."""
    found = _LAYER_SEGMENT.findall(name)
    if len(found) != 1:
        raise CartridgeError(f"{name}: cannot match a cartridge layer by name: expected one numeric 'layers.<idx>' "
                             f"segment, found {len(found)}")
    return int(found[0])


@dataclass(frozen=True)
class StageTensor:
    """One (stage, layer, expert, projection, rank) residual: its trellis and its scale."""

    trellis: TensorInfo
    scale: float
    k: int


@dataclass
class CartridgeIndex:
    manifest: CartridgeManifest
    tensors: dict[tuple[str, int, int, str, int], StageTensor]  # (label, layer, expert, projection, rank)

    def ranks(self) -> list[int]:
        return sorted({key[4] for key in self.tensors})

    def layer(self, layer: int, rank: int) -> dict[tuple[str, int, str], StageTensor]:
        """(label, expert, projection) -> residual of one layer at one stored rank."""
        return {(lb, e, p): t for (lb, lay, e, p, r), t in self.tensors.items() if lay == layer and r == rank}


def _scale_bytes(scales) -> dict[str, bytes]:
    """The raw bytes of every scale tensor, each shard opened once (a cartridge holds one scale per trellis)."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in scales:
        by_file.setdefault(info.file, []).append(info)
    out = {}
    for path, infos in by_file.items():
        with open(path, "rb") as f:
            for info in sorted(infos, key=lambda i: i.begin):
                f.seek(info.begin)
                out[info.name] = f.read(info.nbytes)
    return out


def _scale(info: TensorInfo, raw: bytes) -> float:
    if info.dtype != "F32" or info.shape != ():
        raise CartridgeError(f"{info.file.name}, {info.name}: an MSRT cartridge scale must be a float32 0-d scalar, "
                             f"got {info.dtype} {list(info.shape)}")
    (value,) = struct.unpack("<f", raw)
    try:
        inverse = struct.unpack("<f", struct.pack("<f", 1.0 / value))[0] if value > 0 else math.inf
    except (OverflowError, ZeroDivisionError):
        inverse = math.inf
    if not math.isfinite(value) or value <= 0 or not math.isfinite(inverse):
        raise CartridgeError(f"{info.file.name}, {info.name}: scale {value!r} must be finite and > 0 with a finite "
                             "float32 inverse")
    return value


def _trellis_k(info: TensorInfo, declared: int) -> int:
    if info.dtype != "I16" or len(info.shape) != 3 or info.shape[2] % 16:
        raise CartridgeError(f"{info.file.name}, {info.name}: an MSRT cartridge trellis must be int16 "
                             f"[in/16, out/16, 16*K], got {info.dtype} {list(info.shape)}")
    k = info.shape[2] // 16
    if k != declared:
        raise CartridgeError(f"{info.file.name}, {info.name}: the trellis declares K{k}, but its stage's chain "
                             f"entry has k={declared}")
    return k


def index_cartridge(manifest: CartridgeManifest, files: list[Path]) -> CartridgeIndex:
    """Index the staged shards (in manifest order) and check them against the manifest."""
    infos: dict[str, TensorInfo] = {}
    for path in files:
        try:
            header = read_header(path)
        except ShardError as e:
            raise CartridgeError(f"cartridge shard {e}") from None
        for name, info in header.items():
            if name in infos:
                raise CartridgeError(f"MSRT cartridge key {name} appears in two shards ({infos[name].file.name}, "
                                     f"{path.name})")
            infos[name] = info
    if len(infos) != manifest.num_tensors:
        raise CartridgeError(f"the cartridge holds {len(infos)} tensors, its manifest num_tensors says "
                             f"{manifest.num_tensors}")
    trellises, scales = {}, {}
    for name, info in infos.items():
        m = TRELLIS_KEY.match(name) or SCALE_KEY.match(name)
        if m is None or not LABEL.match(m["label"]):
            raise CartridgeError(f"Malformed MSRT cartridge key {name!r} ({info.file.name}): expected "
                                 "model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.rank{r}.{trellis,scale}_{stage}")
        layer = CANONICAL_LAYER.match(m["layer"])
        if layer is None:
            raise CartridgeError(f"MSRT cartridge key {name!r}: the layer name {m['layer']!r} is not canonical "
                                 "(model.layers.{L}.mlp.experts)")
        key = (m["label"], int(layer.group(1)), int(m["expert"]), m["projection"], int(m["rank"]))
        (trellises if m.re is TRELLIS_KEY else scales)[key] = info
    for key, info in scales.items():
        if key not in trellises:
            raise CartridgeError(f"Orphaned MSRT cartridge scale {info.name} ({info.file.name}): no trellis")
    labels = {s.label: s for s in manifest.chain}
    raw = _scale_bytes(scales.values())
    tensors = {}
    for key, info in trellises.items():
        if key not in scales:
            raise CartridgeError(f"MSRT cartridge trellis {info.name} ({info.file.name}) has no scalar scale "
                                 "companion")
        if key[0] not in labels:
            raise CartridgeError(f"MSRT cartridge key {info.name}: stage {key[0]!r} is not in the manifest's chain "
                                 f"{list(labels)}")
        tensors[key] = StageTensor(info, _scale(scales[key], raw[scales[key].name]), _trellis_k(info, labels[key[0]].k))
    _check_coverage(manifest, tensors)
    _check_ranks(manifest, tensors)
    return CartridgeIndex(manifest, tensors)


def _check_coverage(manifest: CartridgeManifest, tensors: dict) -> None:
    observed: dict[str, dict[int, set[int]]] = {}
    projections: dict[tuple[str, int, int, int], set[str]] = {}
    for label, layer, expert, projection, rank in tensors:
        observed.setdefault(label, {}).setdefault(layer, set()).add(expert)
        projections.setdefault((label, layer, expert, rank), set()).add(projection)
    for (label, layer, expert, rank), got in sorted(projections.items()):
        if len(got) != len(PROJECTIONS):
            missing = [p for p in PROJECTIONS if p not in got]
            raise CartridgeError(f"Incomplete MSRT cartridge: stage {label!r} layer {layer} expert {expert} rank "
                                 f"{rank} lacks {missing} (every expert of a stage needs gate, up and down)")
    declared = {label: {layer: set(ids) for layer, ids in layers.items()}
                for label, layers in manifest.coverage.items()}
    if observed != declared:
        diff = sorted(lb for lb in set(observed) | set(declared) if observed.get(lb) != declared.get(lb))
        raise CartridgeError(f"the cartridge's tensors do not match its manifest coverage for stage(s) {diff}: "
                             f"observed {_show(observed, diff)}, declared {_show(declared, diff)}")
    layers = {layer for lm in observed.values() for layer in lm}
    experts = {e for lm in observed.values() for ids in lm.values() for e in ids}
    if layers != set(manifest.selected_layers) or experts != set(manifest.selected_experts):
        raise CartridgeError(f"the cartridge's tensors cover layers {sorted(layers)} and experts {sorted(experts)}, "
                             f"its manifest selects layers {sorted(manifest.selected_layers)} and experts "
                             f"{sorted(manifest.selected_experts)}")


def _show(coverage: dict, labels: list[str]) -> dict:
    return {lb: {layer: sorted(ids) for layer, ids in sorted(coverage.get(lb, {}).items())} for lb in labels}


def _check_ranks(manifest: CartridgeManifest, tensors: dict) -> None:
    ranks = sorted({key[4] for key in tensors})
    if ranks != list(range(manifest.world_size)):
        raise CartridgeError(f"the cartridge's tensors hold ranks {ranks}, its manifest ({manifest.layout}, "
                             f"world_size {manifest.world_size}) declares {list(range(manifest.world_size))}")
    topology = {r: {key[:4] for key in tensors if key[4] == r} for r in ranks}
    if any(topology[r] != topology[0] for r in ranks):
        raise CartridgeError("inconsistent stage topology: the ranks of a rank-sharded cartridge hold different "
                             "(stage, layer, expert, projection) sets")
    for key, t in tensors.items():
        first = tensors[(*key[:4], 0)]
        if t.scale != first.scale:
            raise CartridgeError(f"MSRT cartridge scales differ across TP ranks: {t.trellis.name} has scale "
                                 f"{t.scale!r}, rank 0 {first.scale!r}")
