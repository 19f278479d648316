"""An EXL3 checkpoint as data: config.json, the quantization_config.json sidecar, the safetensors headers, and
one validated record per EXL3 linear. Reading and validating it is `format.load.load_checkpoint`; this module
holds only the records, so that the validator and the rank-sliced rules can build them without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sglang_exl3.format.constants import Codebook
from sglang_exl3.format.errors import Problem
from sglang_exl3.format.safetensors_index import TensorInfo


@dataclass(frozen=True)
class Exl3ModuleRecord:
    """A validated EXL3 linear: its tensors and what they mean."""

    key: str
    tensors: dict[str, TensorInfo]  # suffix ("trellis", "suh", ...) -> header info
    bits: float | int
    codebook: Codebook
    in_features: int  # packed K (multiple of 128)
    out_features: int  # packed N (multiple of 128)

    @property
    def legacy_signs(self) -> bool:
        return "su" in self.tensors

    @property
    def has_bias(self) -> bool:
        return "bias" in self.tensors

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class Exl3Checkpoint:
    path: Path
    config: dict
    quantization_config: dict  # the summary in config.json
    sidecar: dict | None  # quantization_config.json, if present
    tensors: dict[str, TensorInfo]
    modules: dict[str, Exl3ModuleRecord] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    _open_files: dict = field(default_factory=dict, repr=False)  # (file, device) -> safe_open handle

    @property
    def tensor_storage(self) -> dict:
        """The sidecar's per-module map ({} when absent or malformed: validation reports that)."""
        storage = (self.sidecar or {}).get("tensor_storage")
        return storage if isinstance(storage, dict) else {}

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        return str(archs[0]) if isinstance(archs, list) and archs else "?"

    def plain_tensor_names(self) -> list[str]:
        """Tensors that belong to no EXL3 module (embeddings, norms, routers, unquantized heads)."""
        owned = {t.name for m in self.modules.values() for t in m.tensors.values()}
        return sorted(n for n in self.tensors if n not in owned)

    def load_tensor(self, name: str, device: str = "cpu"):
        """One tensor; each shard is opened (and its header parsed) once per device, not per tensor."""
        from safetensors import safe_open

        key = (self.tensors[name].file, device)
        handle = self._open_files.get(key)
        if handle is None:
            handle = self._open_files[key] = safe_open(str(key[0]), framework="pt", device=device)
        return handle.get_tensor(name)

    def load_module(self, key: str, device: str = "cpu") -> dict:
        """Tensors of one EXL3 module, keyed by suffix (markers omitted: see record.codebook)."""
        record = self.modules[key]
        return {
            suffix: self.load_tensor(info.name, device)
            for suffix, info in record.tensors.items()
            if suffix not in ("mcg", "mul1")
        }
