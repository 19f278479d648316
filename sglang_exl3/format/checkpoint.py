"""Open an EXL3 checkpoint: config.json summary, quantization_config.json sidecar, safetensors.

`load_checkpoint` collects *every* problem (see validate.py) and raises one Exl3FormatError
listing them unless `strict=False`, in which case they are kept on the result for `inspect`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sglang_exl3.format.constants import CONFIG_NAME, SIDECAR_NAME, Codebook
from sglang_exl3.format.errors import Exl3FormatError, Problem
from sglang_exl3.format.safetensors_index import TensorInfo, scan_tensors


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
        return (self.sidecar or {}).get("tensor_storage") or {}

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or ["?"]
        return archs[0]

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


def _read_json(path: Path, problems: list[Problem], fix: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        problems.append(Problem(f"cannot parse {path.name}: {e}", fix=fix))
        return None
    if not isinstance(data, dict):
        problems.append(Problem(f"{path.name} must hold a JSON object", fix=fix))
        return None
    return data


def load_checkpoint(path: str | Path, strict: bool = True) -> Exl3Checkpoint:
    """Read and validate an EXL3 checkpoint folder."""
    from sglang_exl3.format.validate import validate_checkpoint

    path = Path(path)
    problems: list[Problem] = []
    if not path.is_dir():
        raise Exl3FormatError([Problem(f"{path} is not a directory", fix="pass the checkpoint folder")])
    config = _read_json(path / CONFIG_NAME, problems, "re-export the checkpoint with exllamav3")
    if config is None and not problems:
        problems.append(Problem(f"{CONFIG_NAME} not found in {path}", fix="pass an exllamav3 output folder"))
    sidecar = _read_json(path / SIDECAR_NAME, problems, f"regenerate {SIDECAR_NAME} with exllamav3")
    try:
        tensors = scan_tensors(path)
    except (OSError, ValueError, KeyError) as e:
        problems.append(Problem(f"cannot read safetensors headers: {e}"))
        tensors = {}
    ckpt = Exl3Checkpoint(
        path=path,
        config=config or {},
        quantization_config=(config or {}).get("quantization_config") or {},
        sidecar=sidecar,
        tensors=tensors,
        problems=problems,
    )
    validate_checkpoint(ckpt)
    if strict and ckpt.problems:
        raise Exl3FormatError(ckpt.problems, source=f"EXL3 checkpoint {path}")
    return ckpt
