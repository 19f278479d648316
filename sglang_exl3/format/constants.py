"""Constants of the EXL3 format that every layer shares (markers, codebooks, file names)."""

from __future__ import annotations

import enum

MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
MARKER_VALUES = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}

SIDECAR_NAME = "quantization_config.json"
CONFIG_NAME = "config.json"
ALIGN = 128  # EXL3 pads in/out features to multiples of 128 (Hadamard block size)


def padded(n: int) -> int:
    """n rounded up to whole 128-element blocks, as EXL3 stores in and out features."""
    return -(-n // ALIGN) * ALIGN


INTEGER_BITS = range(1, 9)
HALF_BITS = (1.5, 2.5, 3.5)  # MUL1 only

# Tensor suffixes an EXL3 linear may carry.
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")

EMPTY_STORAGE_MESSAGE = (
    "EXL3 requires quantization_config.json with a non-empty tensor_storage map. For "
    "branch-indexed Hugging Face repos, download/serve an actual bpw revision rather than main."
)


class Codebook(enum.IntEnum):
    """Codebook ids as exllamav3's kernels number them (`cb` template argument)."""

    INST3 = 0
    MCG = 1
    MUL1 = 2

    @property
    def label(self) -> str:
        return ("3inst", "mcg", "mul1")[self]

    @property
    def marker(self) -> str | None:
        """Suffix of the marker tensor that selects this codebook (None: no marker)."""
        return (None, "mcg", "mul1")[self]

    @classmethod
    def from_label(cls, label: str) -> Codebook:
        for cb in cls:
            if cb.label == label.lower():
                return cb
        raise ValueError(f"unknown EXL3 codebook {label!r}; expected one of 3inst, mcg, mul1")

    @classmethod
    def from_markers(cls, mcg: bool, mul1: bool) -> Codebook:
        if mcg and mul1:
            raise ValueError("both mcg and mul1 markers present")
        return cls.MCG if mcg else cls.MUL1 if mul1 else cls.INST3
