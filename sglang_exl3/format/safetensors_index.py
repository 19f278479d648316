"""Read safetensors headers directly: names, dtypes, shapes and offsets without loading data."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype codes -> torch dtype names (the strings exllamav3 writes in tensor_storage)
TORCH_DTYPE_NAMES = {
    "I16": "torch.int16", "I32": "torch.int32", "I64": "torch.int64", "I8": "torch.int8",
    "U8": "torch.uint8", "F16": "torch.float16", "BF16": "torch.bfloat16", "F32": "torch.float32",
    "F64": "torch.float64", "BOOL": "torch.bool", "U16": "torch.uint16", "U32": "torch.uint32",
    "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2",
}
FLOAT_CODES = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "I16", "F16"
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offsets of the data in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype_name(self) -> str:
        return TORCH_DTYPE_NAMES.get(self.dtype, self.dtype)

    def read_bytes(self) -> bytes:
        with open(self.file, "rb") as f:
            f.seek(self.begin)
            return f.read(self.nbytes)


def read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(length))
    base = 8 + length
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        b, e = h["data_offsets"]
        out[name] = TensorInfo(name, h["dtype"], tuple(h["shape"]), path, base + b, base + e)
    return out


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def scan_tensors(model_dir: Path) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for path in safetensors_files(model_dir):
        tensors.update(read_header(path))
    return tensors
