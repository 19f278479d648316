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
from sglang_exl3.format.safetensors_index import scan_tensors
from sglang_exl3.format.validate import validate_checkpoint


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
