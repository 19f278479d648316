"""A cartridge base's identity, proven at load: each MoE layer's experts, as loaded and before any TP slicing, must
reproduce the per-layer compatibility digest of the checkpoint's `exl3-msrt-base/1` profile (seeds.md §1.3). The
digest is TP-invariant, so every rank proves the same identity; a cartridge is later accepted only for layers whose
verified digest it names."""

from __future__ import annotations

import torch

from sglang_exl3.format.cartridge_index import live_layer_index
from sglang_exl3.format.msrt_fingerprint import FingerprintError, layer_digest
from sglang_exl3.format.rank_sliced import ROLE_PROJECTIONS

_PROJECTION = dict(ROLE_PROJECTIONS)


def verify_base_layer(loaded: dict[tuple[int, str], dict[str, torch.Tensor]], prefix: str, k: int,
                      digest: str) -> int:
    """Recompute the layer digest from the loaded (expert, role) -> {part: tensor} map; the layer index on success."""
    layer = live_layer_index(prefix)
    tensors = {f"model.layers.{layer}.mlp.experts.{e}.{_PROJECTION[role]}.{part}": t
               for (e, role), parts in loaded.items() for part, t in parts.items()}
    got = layer_digest(k, layer, tensors)
    if got != digest:
        raise FingerprintError(f"EXL3 MoE {prefix}: the loaded base tensors do not match compatibility digest "
                               f"{digest} of layer {layer} (recomputed {got}); the checkpoint's experts were changed "
                               "after its exl3-msrt-base/1 profile was written")
    return layer
