"""Open an EXL3 checkpoint folder: config.json summary, quantization_config.json sidecar, safetensors headers.

`load_checkpoint` collects *every* problem (format/validate.py) and raises one Exl3FormatError listing them unless
`strict=False`, in which case they are kept on the result for `inspect`.
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_exl3.format.checkpoint import Exl3Checkpoint
from sglang_exl3.format.constants import CONFIG_NAME, SIDECAR_NAME
from sglang_exl3.format.errors import Exl3FormatError, Problem
from sglang_exl3.format.safetensors_index import ShardError, scan_tensors
from sglang_exl3.format.validate import validate_checkpoint


def _read_json(path: Path, problems: list[Problem], fix: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON
        problems.append(Problem(f"cannot parse {path.name}: {e}", fix=fix))
        return None
    if not isinstance(data, dict):
        problems.append(Problem(f"{path.name} must hold a JSON object", fix=fix))
        return None
    return data


def _summary(config: dict | None) -> dict:
    """config.json's quantization_config block, or {} where there is none (its problems are validation's)."""
    block = (config or {}).get("quantization_config")
    return block if isinstance(block, dict) else {}


def load_checkpoint(path: str | Path, strict: bool = True) -> Exl3Checkpoint:
    """Read and validate an EXL3 checkpoint folder."""
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
    except ShardError as e:  # its message names the file, the tensor and the fix
        problems.append(Problem(str(e)))
        tensors = None
    except OSError as e:
        problems.append(Problem(f"cannot read the safetensors files: {e}", fix="check the folder's permissions"))
        tensors = None
    ckpt = Exl3Checkpoint(
        path=path,
        config=config or {},
        quantization_config=_summary(config),
        sidecar=sidecar,
        tensors=tensors or {},
        problems=problems,
    )
    if tensors is not None:  # a shard that cannot be read leaves nothing meaningful to check per module
        validate_checkpoint(ckpt)
    if strict and ckpt.problems:
        raise Exl3FormatError(ckpt.problems, source=f"EXL3 checkpoint {path}")
    return ckpt
