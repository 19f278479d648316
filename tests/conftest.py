"""Shared fixtures: committed exllamav3 checkpoints, fresh writer checkpoints, a mutation helper."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

DATA = Path(__file__).parent / "data"
EXLLAMAV3_CKPTS = sorted(p for p in (DATA / "exllamav3").iterdir() if p.is_dir())
DENSE_CKPTS = [p for p in EXLLAMAV3_CKPTS if "moe" not in p.name and "mixtral" not in p.name]


def changed(base: dict, **changes) -> dict:
    """A deep copy of `base` with keys set to new values, or removed where the value is None."""
    import copy

    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def pytest_collection_modifyitems(config, items):
    long_fuzz = "fuzz_long" in (config.getoption("-m") or "")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_long = pytest.mark.skip(reason="the long fuzzing run: pytest -m fuzz_long")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "fuzz_long" in item.keywords and not long_fuzz:
            item.add_marker(skip_long)


@pytest.fixture(scope="session")
def kernel_build(tmp_path_factory) -> tuple[Path, Path]:
    """Our kernel library compiled here for sm_90, once per test run, and the folder of its compiled units: the CPU
    tests call its host-side code and its argument checks, which are the same in the 4-bit-MCG development build
    (every unit, one variant of each templated family). The whole library is built by `build-kernels` before every
    GPU run."""
    from sglang_exl3.kernels import build

    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    root = tmp_path_factory.mktemp("lib")
    out, objects = root / "libexl3_trellis.so", root / "objects"
    build.build(out, "90", objects, dev=True)
    return out, objects


@pytest.fixture(scope="session")
def compiled_library(kernel_build) -> Path:
    return kernel_build[0]


@pytest.fixture(scope="session")
def golden() -> dict[str, torch.Tensor]:
    """exllamav3 1.6.5's own outputs recorded on the H200 (tests/oracle/record_exllamav3.py)."""
    return load_file(str(DATA / "exllamav3_golden.safetensors"))


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> Path:
    """A fresh one-layer EXL3 Llama in exllamav3's layout (random trellis, MUL1, 4 bits)."""
    from sglang_exl3.synth.exl3_writer import ModelDims, write_exl3_checkpoint

    dims = ModelDims(num_hidden_layers=1, vocab_size=512)
    return write_exl3_checkpoint(tmp_path / "ckpt", "llama", dims=dims, bits=4, codebook="mul1",
                                 with_tokenizer=False)


Mutation = Callable[[dict[str, torch.Tensor], dict, dict], None]


def mutate(ckpt: Path, fn: Mutation) -> Path:
    """Apply fn(tensors, sidecar, config) in place and write the checkpoint back."""
    shard = ckpt / "model.safetensors"
    tensors = load_file(str(shard))
    sidecar = json.loads((ckpt / "quantization_config.json").read_text())
    config = json.loads((ckpt / "config.json").read_text())
    fn(tensors, sidecar, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(shard))
    (ckpt / "quantization_config.json").write_text(json.dumps(sidecar))
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def fp16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in fp16 representable steps (0 = bit-identical, +0 == -0)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)

    return (ordered(a.half()) - ordered(b.half())).abs()
