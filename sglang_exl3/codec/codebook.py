"""The three EXL3 codebooks: a 16-bit trellis state -> one fp16 weight value.

3INST (no marker, QTIP's code), MCG (`.mcg` marker) and MUL1 (`.mul1` marker) follow
exllamav3's `codebook.cuh`. Every sum below is exact in fp32, so one fp16 rounding of the fp32
result equals the fused fp16 instruction the CUDA code uses (`__hadd`, `__hfma`).
"""

from __future__ import annotations

from functools import cache

import torch

from sglang_exl3.format.constants import MCG_MULTIPLIER, MUL1_MULTIPLIER, Codebook

_INST3_MUL = 89226354
_INST3_ADD = 64248484
_FP16_MASK = 0x8FFF8FFF
_FP16_XOR = 0x3B603B60
_MUL1_K_INV = 0x1EEE  # fp16 bit pattern, 887/131072
_MUL1_K_BIAS = 0xC931  # fp16 bit pattern, -10.3828125


def _bits_to_f16(bits: torch.Tensor) -> torch.Tensor:
    """int64 values 0..65535 -> fp16 tensor with those bit patterns."""
    v = bits & 0xFFFF
    return (v - ((v >> 15) << 16)).to(torch.int16).view(torch.float16)


def _compute(states: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    x = states.to(torch.int64) & 0xFFFF
    if codebook == Codebook.MUL1:
        x = (x * MUL1_MULTIPLIER) & 0xFFFFFFFF
        byte_sum = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        k_inv = _bits_to_f16(torch.tensor(_MUL1_K_INV)).float()
        k_bias = _bits_to_f16(torch.tensor(_MUL1_K_BIAS)).float()
        return ((1024 + byte_sum).float() * k_inv + k_bias).half()
    if codebook == Codebook.MCG:
        x = (x * MCG_MULTIPLIER) & 0xFFFFFFFF
    else:
        x = (x * _INST3_MUL + _INST3_ADD) & 0xFFFFFFFF
    x = (x & _FP16_MASK) ^ _FP16_XOR
    return (_bits_to_f16(x).float() + _bits_to_f16(x >> 16).float()).half()


@cache
def _table_cpu(codebook: Codebook) -> torch.Tensor:
    return _compute(torch.arange(65536), codebook)


_DEVICE_TABLES: dict[tuple[Codebook, str], torch.Tensor] = {}


def codebook_table(codebook: Codebook, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 65,536 decoded values of a codebook (fp16), indexed by state.

    Cached per device: after the first call on a device no host-to-device copy happens, so
    decoding inside CUDA-graph capture is safe once a warm-up call has run.
    """
    key = (Codebook(codebook), str(torch.device(device)))
    table = _DEVICE_TABLES.get(key)
    if table is None:
        table = _DEVICE_TABLES[key] = _table_cpu(key[0]).to(device)
    return table


def decode_states(states: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """Decode 16-bit states (any integer dtype, any shape) to fp16 by table lookup."""
    table = codebook_table(codebook, states.device)
    return table[states.to(torch.int64) & 0xFFFF]
