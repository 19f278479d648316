"""Checkpoints written by exllamav3's own converter (tests/data/exllamav3, see tests/oracle/README.md):
our reader and codec must reproduce exactly what exllamav3 computed at conversion time."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import DENSE_CKPTS, EXLLAMAV3_CKPTS, fp16_ulp_distance
from sglang_exl3.codec import dequantize_weight, reconstruct
from sglang_exl3.format import load_checkpoint


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def _oracle(ckpt):
    meta = json.loads((ckpt / "oracle" / "exllamav3_oracle.json").read_text())
    return meta, load_file(str(ckpt / "oracle" / "exllamav3_oracle.safetensors"))


def test_fixtures_cover_every_codebook_and_stay_small():
    cbs = set()
    for ckpt in EXLLAMAV3_CKPTS:
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file() and "oracle" not in f.parts)
        assert size < 5 * 2**20, (ckpt.name, size)
        cbs |= {m.codebook.label for m in load_checkpoint(ckpt).modules.values()}
    assert cbs == {"3inst", "mcg", "mul1"}


@pytest.mark.parametrize("ckpt", EXLLAMAV3_CKPTS, ids=lambda p: p.name)
def test_reconstruct_matches_exllamav3_bit_for_bit(ckpt):
    meta, _ = _oracle(ckpt)
    loaded = load_checkpoint(ckpt)
    assert set(loaded.modules) == set(meta["modules"])
    for key, record in loaded.modules.items():
        expected = meta["modules"][key]
        assert record.bits == expected["K"]
        assert (record.codebook.label == "mcg") == expected["mcg"]
        assert (record.codebook.label == "mul1") == expected["mul1"]
        w_hat = reconstruct(loaded.load_module(key)["trellis"], record.codebook)
        assert _sha(w_hat) == expected["w_hat_sha256"], key


@pytest.mark.parametrize("ckpt", EXLLAMAV3_CKPTS, ids=lambda p: p.name)
def test_full_weight_matches_get_weight_tensor(ckpt):
    """W = diag(suh) H W_hat H diag(svh): bit-identical to exllamav3's get_weight_tensor() on the H200."""
    meta, tensors = _oracle(ckpt)
    loaded = load_checkpoint(ckpt)
    for key, record in loaded.modules.items():
        t = loaded.load_module(key)
        w = dequantize_weight(t["trellis"], t["suh"], t["svh"], record.codebook)
        if f"{key}.weight" in tensors:
            assert fp16_ulp_distance(w, tensors[f"{key}.weight"]).max() == 0, key
        assert _sha(w) == meta["modules"][key]["weight_sha256"], key


@pytest.mark.parametrize("ckpt", DENSE_CKPTS[:1], ids=lambda p: p.name)
def test_ulp_check_is_sensitive(ckpt):
    _, tensors = _oracle(ckpt)
    key = "model.layers.0.mlp.down_proj"
    w = tensors[f"{key}.weight"].clone()
    w.view(torch.int16)[3, 5] += 3
    assert fp16_ulp_distance(w, tensors[f"{key}.weight"]).max() == 3
