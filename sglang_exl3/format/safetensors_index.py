"""Read safetensors headers directly: names, dtypes, shapes and offsets without loading data."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from sglang_exl3.format.json_values import is_int

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


# Bytes per element of the safetensors dtypes whose size a header can be checked against (others are checked for
# their offsets only).
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
RECOPY = "copy the file again from its source (an incomplete download or a damaged copy)"


class ShardError(ValueError):
    """A safetensors file that cannot be read as one: the message names the file (and the tensor) and the fix."""

    def __init__(self, path: Path, message: str, fix: str = RECOPY, tensor: str | None = None):
        self.path, self.tensor, self.fix = Path(path), tensor, fix
        where = f"{self.path.name}" + (f", tensor {tensor}" if tensor else "")
        super().__init__(f"{where}: {message} (fix: {fix})")


def _tensor_info(path: Path, name: str, h, base: int, data_bytes: int) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape of non-negative ints, offsets inside the data section that
    span exactly the bytes the dtype and shape need."""
    if not isinstance(h, dict):
        raise ShardError(path, f"header entry is {type(h).__name__}, not an object", tensor=name)
    dtype, shape, offsets = h.get("dtype"), h.get("shape"), h.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise ShardError(path, f"dtype {dtype!r} is not a safetensors dtype name", tensor=name)
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ShardError(path, f"shape {shape!r} is not a list of non-negative integers", tensor=name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ShardError(path, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end", tensor=name)
    begin, end = offsets
    if end > data_bytes:
        raise ShardError(path, f"the tensor's data ends at byte {base + end:,} but the file holds "
                         f"{base + data_bytes:,} bytes: the file is truncated", tensor=name)
    if dtype in DTYPE_SIZES:
        numel = 1
        for d in shape:
            numel *= d
        if (end - begin) != numel * DTYPE_SIZES[dtype]:
            raise ShardError(path, f"data_offsets span {end - begin} bytes, but {dtype} {shape} needs "
                             f"{numel * DTYPE_SIZES[dtype]}", tensor=name)
    return TensorInfo(name, dtype, tuple(shape), path, base + begin, base + end)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's header entry, checked against the file's size (a truncated file is named as such)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ShardError(path, f"holds {size} bytes, fewer than the 8-byte length of a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise ShardError(path, f"declares a {length:,}-byte header but holds {size:,} bytes: truncated or not a "
                             "safetensors file")
        text = f.read(length)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(path, f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ShardError(path, f"its header is {type(header).__name__}, not an object")
    base, out = 8 + length, {}
    for name, h in header.items():
        if name == "__metadata__":
            if not isinstance(h, dict):
                raise ShardError(path, "__metadata__ is not an object")
            continue
        out[name] = _tensor_info(path, name, h, base, size - base)
    return out


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards: those the index names (model.safetensors.index.json), else every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ShardError(index, f"cannot be read as a safetensors index ({e})", "regenerate or remove it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ShardError(index, "weight_map is not an object of tensor name -> file name", "regenerate or remove it")
    files = []
    for name in sorted(set(weight_map.values())):
        if not name or Path(name).name != name or name in (".", ".."):
            raise ShardError(index, f"names the file {name!r}, which is not a file beside it", "regenerate it")
        files.append(model_dir / name)
    return files


def scan_tensors(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of every shard. ShardError names the first unreadable, truncated or missing shard, or a tensor
    name that two shards both hold."""
    tensors: dict[str, TensorInfo] = {}
    for path in safetensors_files(model_dir):
        if not path.is_file():
            raise ShardError(path, "is listed in model.safetensors.index.json but missing",
                             "copy every shard of the checkpoint")
        for name, info in read_header(path).items():
            if name in tensors:
                raise ShardError(path, f"holds {name}, which {tensors[name].file.name} holds too",
                                 "remove the stray file; each tensor must live in one shard", tensor=name)
            tensors[name] = info
    return tensors
