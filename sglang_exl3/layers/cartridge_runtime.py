"""One rank's expert-cartridge state for one model, in the steps of a swap (seeds.md F28), each of which either
completes or leaves the served weights as they were:

- `stage(path)`: validate the manifest, copy and hash the shards privately, index them (format/cartridge_staging.py).
  Runs while the server keeps serving.
- `prepare()`: check the staged cartridge against every selected live layer and fold its stages into new weights
  (layers/cartridge.py). Nothing live changes; a failure leaves nothing prepared.
- `commit()`: make the prepared weights the served ones (layers not selected by this cartridge serve the base).
- `deactivate()`: every layer serves the base again, bit-identical to before any cartridge.

Two modes (SGLANG_EXL3_CARTRIDGES). `recapture`: the base layers run their EXL3 kernels and a cartridge layer the
rotated forward on its folded weights, so a swap changes what the graphs must launch and is followed by a
recapture; the base tensors are never touched. `resident`: every base layer holds a dense slot at load and always
serves through it (the base's W_hat while no cartridge is active); a swap copies into the slot in place, so captured
graphs stay valid, and deactivation decodes the base back into it (decoding is exact, so the outputs are too).
- `discard()`: drop the staged copy and anything prepared.

Only the target model's layers take cartridges; a draft model (EAGLE / MTP) keeps its own weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sglang_exl3.format.cartridge_manifest import CartridgeError
from sglang_exl3.format.cartridge_staging import StagedCartridge, stage_cartridge
from sglang_exl3.layers.cartridge import LayerCartridge, prepare_layer, restore_base

logger = logging.getLogger(__name__)


def cartridge_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's EXL3 MoE layers that carry a verified cartridge base, by module name."""
    return {name: m for name, m in model.named_modules()
            if getattr(m, "exl3_experts", None) is not None and getattr(m, "exl3_base_digest", None) is not None
            and getattr(m, "exl3_role", "target") == "target"}


@dataclass
class CartridgeRuntime:
    model: torch.nn.Module
    mode: str = "recapture"  # or "resident"
    staged: StagedCartridge | None = None
    prepared: dict[str, LayerCartridge] | None = None
    active: str | None = None  # the active cartridge's assembly label
    layers: dict[str, torch.nn.Module] = field(init=False)

    def __post_init__(self):
        self.layers = cartridge_layers(self.model)
        if self.mode == "resident":
            missing = [n for n, m in self.layers.items() if getattr(m, "exl3_cartridge", None) is None]
            if missing:
                raise CartridgeError(f"resident cartridge slots were not allocated at load for {missing[:3]}; start "
                                     "the server with SGLANG_EXL3_CARTRIDGES=resident")

    def stage(self, path: str) -> int:
        """Stage a cartridge; the number of this rank's layers it selects."""
        if not self.layers:
            raise CartridgeError("this model has no EXL3 MoE layer with a verified exl3-msrt-base/1 base; cartridges "
                                 "need a base written by `python -m sglang_exl3 write-msrt-base`")
        self.discard()
        tp = {getattr(layer, "moe_tp_size", 1) for layer in self.layers.values()}
        staged = stage_cartridge(path, runtime_tp=max(tp))
        try:
            self._check_base(staged.manifest)
        except CartridgeError:
            staged.discard()
            raise
        self.staged = staged
        return sum(1 for name in self.layers if _selects(staged, name))

    def _check_base(self, manifest) -> None:
        """The manifest's base is the loaded one: the same root, and every selected layer in the verified per-layer
        map with the same digest (a selected layer this rank does not hold, e.g. an MTP layer on a target-only
        worker, is accepted on the map's word; the local ones are rechecked against their loaded tensors)."""
        root, by_layer = next(iter(self.layers.values())).exl3_base_identity
        if manifest.base_root != root:
            raise CartridgeError(f"EXL3 cartridge was encoded for a different base checkpoint: its base root is "
                                 f"{manifest.base_root}, the loaded base's {root}")
        wrong = [layer for layer in manifest.selected_layers if by_layer.get(layer) != manifest.base_by_layer[layer]]
        if wrong:
            raise CartridgeError(f"EXL3 cartridge was encoded for a different base checkpoint: layers {wrong} are "
                                 "missing from the loaded base's compatibility_by_layer or have other digests")

    def prepare(self) -> int:
        if self.staged is None:
            raise CartridgeError("no cartridge is staged on this rank")
        self.prepared = None
        prepared = {}
        for name, layer in self.layers.items():
            cart = prepare_layer(layer, name, self.staged.index)
            if cart is not None:
                prepared[name] = cart
        self.prepared = prepared
        return len(prepared)

    def commit(self, after_layer=None) -> int:
        """Serve the prepared cartridge. `after_layer(name)` runs after each layer switches (a fault injection
        point: a failure there leaves some layers switched, which `deactivate` undoes)."""
        if self.prepared is None:
            raise CartridgeError("no cartridge is prepared on this rank")
        self.active = self.staged.manifest.assembly if self.staged is not None else "cartridge"
        for name, layer in self.layers.items():
            new = self.prepared.get(name)
            if self.mode == "resident":
                slot = layer.exl3_cartridge
                if new is not None:
                    for dst, src in zip(slot.weights, new.weights, strict=True):
                        dst.copy_(src)
                elif slot.labels:
                    restore_base(layer, slot)
                slot.labels = new.labels if new is not None else ()
            else:
                layer.exl3_cartridge = new
            if after_layer is not None:
                after_layer(name)
        updated, self.prepared = sum(1 for m in self.layers.values() if _active(m)), None
        return updated

    def deactivate(self) -> int:
        updated = 0
        for layer in self.layers.values():
            if _active(layer):
                updated += 1
                if self.mode == "resident":
                    restore_base(layer, layer.exl3_cartridge)
                    layer.exl3_cartridge.labels = ()
            if self.mode != "resident":
                layer.exl3_cartridge = None
        self.active = None
        return updated

    def discard(self) -> None:
        self.prepared = None
        if self.staged is not None:
            staged, self.staged = self.staged, None
            staged.discard()

    def status(self) -> dict:
        return {"active": self.active is not None, "assembly": self.active,
                "layers": sorted(n for n, m in self.layers.items() if _active(m)), "mode": self.mode,
                "capable_layers": len(self.layers), "staged": self.staged is not None}


def _active(layer: torch.nn.Module) -> bool:
    cart = getattr(layer, "exl3_cartridge", None)
    return cart is not None and bool(cart.labels)


def _selects(staged: StagedCartridge, name: str) -> bool:
    from sglang_exl3.format.cartridge_index import live_layer_index

    return live_layer_index(name) in staged.manifest.selected_layers
