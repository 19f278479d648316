"""Write a checkpoint's tensors as safetensors shards (one file, or N files plus the HF index)."""

from __future__ import annotations

import json
from pathlib import Path


def save_shards(out: Path, shards: list[dict]) -> list[str]:
    """Write `shards` (lists of name -> torch tensor) to `out`; returns the file names written."""
    from safetensors.torch import save_file

    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
        for t_name, t in shard.items():
            weight_map[t_name] = name
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


class ShardPacker:
    """Collects tensors into shards of at most `max_bytes` (a group added together stays together)."""

    def __init__(self, max_bytes: int = 4 << 30):
        self.max_bytes = max_bytes
        self.shards: list[dict] = [{}]
        self._size = 0

    def add(self, tensors: dict) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._size and self._size + nbytes > self.max_bytes:
            self.shards.append({})
            self._size = 0
        self.shards[-1].update(tensors)
        self._size += nbytes

    def save(self, out: Path) -> list[str]:
        return save_shards(out, self.shards)


def marker_tensor(codebook):
    """The codebook's marker as exllamav3 stores it (`.mcg` / `.mul1`): its 32-bit multiplier in an int32 0-d
    tensor; None for 3INST, which has no marker."""
    import torch

    from sglang_exl3.format.constants import MARKER_VALUES

    if not codebook.marker:
        return None
    value = MARKER_VALUES[codebook.marker]
    return torch.tensor(value - (1 << 32) if value >= 1 << 31 else value, dtype=torch.int32)


def storage_entry(tensors: dict, bits: float | None, codebook=None) -> dict:
    """One module's `tensor_storage` entry in exllamav3's sidecar: every stored tensor's shape, bytes and dtype, and
    for an EXL3 module its format, bitrate and codebook multiplier."""
    from sglang_exl3.format.constants import MARKER_VALUES

    entry: dict = {"stored_tensors": {
        name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
        for name, t in tensors.items()}}
    if bits is not None:
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = int(bits) if float(bits).is_integer() else bits
        if codebook.marker:
            entry[f"{codebook.marker}_multiplier"] = MARKER_VALUES[codebook.marker]
    return entry
