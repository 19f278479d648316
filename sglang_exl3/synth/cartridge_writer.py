"""Write an `fq-cartridge-adapter/3` expert cartridge for an `exl3-msrt-base/1` base (seeds.md §1.6): residual
trellises of random MCG codes, one float32 scale per (stage, expert, projection), and the closed manifest with the
base's compatibility digests and every shard's size and SHA-256. The reference's producer
(progressive-tensors `fq_assemble_lora.py`) encodes real residuals and is not available here; random codes decode
to unit-variance weights like a real residual's, so a stage of scale s perturbs each expert weight by about 1/s of
its magnitude: enough to move the logprobs measurably, and to test every rule of the format and the swap.

`full` writes one rank0 artefact that each TP rank slices at load; `rank-sharded` writes each rank's slice of the
same full residual (gate/up on the output axis, down on the input axis), so both layouts serve identical weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_exl3.format import msrt_base
from sglang_exl3.format.cartridge_manifest import AXIS_BY_PROJECTION, CONSTANTS, MANIFEST_NAME
from sglang_exl3.format.msrt_fingerprint import EXPERT_TENSOR
from sglang_exl3.format.safetensors_index import scan_tensors


@dataclass(frozen=True)
class StageSpec:
    label: str
    k: int
    scale: float = 16.0
    experts: tuple[int, ...] | None = None  # None: every selected expert ("all")


def _base_shapes(base_dir: Path) -> dict[tuple[int, int, str], tuple[int, int]]:
    """(layer, expert, projection) -> the trellis's (in/16, out/16) tiles, from the base's rank0 tensors."""
    out = {}
    for name, info in scan_tensors(base_dir).items():
        m = EXPERT_TENSOR.match(name)
        if m and m.group(4) == "trellis":
            out[(int(m.group(1)), int(m.group(2)), m.group(3))] = info.shape[:2]
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _rank_slice(t: torch.Tensor, projection: str, rank: int, world: int) -> torch.Tensor:
    axis = 1 if AXIS_BY_PROJECTION[projection] == "output" else 0
    step = t.shape[axis] // world
    return t.narrow(axis, rank * step, step).contiguous()


def write_cartridge(base_dir: str | Path, out_dir: str | Path, stages: list[StageSpec],
                    layers: list[int] | None = None, experts: list[int] | None = None, layout: str = "full",
                    world_size: int = 1, seed: int = 0, assembly: str = "synthetic") -> Path:
    base, out = Path(base_dir), Path(out_dir)
    tail = json.loads((base / "config.json").read_text())["hybrid_tr3_tail"]
    spec = msrt_base.parse(tail)  # the base must be a valid exl3-msrt-base/1
    shapes = _base_shapes(base)
    layers = sorted(layers if layers is not None else spec.coverage)
    experts = sorted(experts if experts is not None else range(spec.experts_per_layer))
    world = world_size if layout == "rank-sharded" else 1
    gen = torch.Generator().manual_seed(seed)
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    coverage, chain, parent = {}, [], f"base-k{spec.bits}"
    for st in stages:
        ids = sorted(st.experts) if st.experts is not None else experts
        coverage[st.label] = {str(layer): ids for layer in layers}
        chain.append({"label": st.label, "k": st.k, "parent": parent,
                      "experts": "all" if st.experts is None else ids})
        parent = st.label
        for layer in layers:
            for e in ids:
                for proj in AXIS_BY_PROJECTION:
                    rows, cols = shapes[(layer, e, proj)]
                    full = torch.randint(-32768, 32768, (rows, cols, 16 * st.k), generator=gen, dtype=torch.int32)
                    full = full.to(torch.int16)
                    for r in range(world):
                        key = f"model.layers.{layer}.mlp.experts.{e}.{proj}.rank{r}"
                        per_rank[r][f"{key}.trellis_{st.label}"] = (_rank_slice(full, proj, r, world) if world > 1
                                                                    else full)
                        per_rank[r][f"{key}.scale_{st.label}"] = torch.tensor(st.scale, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=False)
    shards = []
    for r, tensors in enumerate(per_rank):
        name = f"cartridge-rank{r}.safetensors"
        save_file(tensors, str(out / name))
        shards.append({"path": name, "size": (out / name).stat().st_size, "sha256": _sha256(out / name)})
    by_layer = tail["compatibility_by_layer"]
    manifest = {
        **CONSTANTS, "assembly": assembly,
        "base": {"label": f"base-k{spec.bits}", "k": spec.bits, "compatibility_sha256": tail["compatibility_sha256"],
                 "compatibility_by_layer": {str(layer): by_layer[str(layer)] for layer in layers}},
        "chain": chain,
        "tensor_parallel": {"layout": layout, "world_size": world, "ranks": list(range(world)),
                            "axis_by_projection": dict(AXIS_BY_PROJECTION)},
        "shards": shards, "num_tensors": sum(len(t) for t in per_rank),
        "selected_experts": experts, "selected_layers": layers, "coverage": coverage,
        "producer_verified_signer": None,
        "campaign": {"recipe_sha256": hashlib.sha256(f"random residual seed {seed}".encode()).hexdigest(),
                     "base_model": str(base.name), "base_revision": "local", "encoder_sha256": None,
                     "signer_pubkey": "", "block_size": 1, "moe_layers": layers},
        "source_assembly": {"path": "source.json", "sha256": hashlib.sha256(json.dumps(chain).encode()).hexdigest()},
        "tool_version": "sglang-exl3 write-cartridge", "created_utc": "2026-01-01T00:00:00Z"}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return out
