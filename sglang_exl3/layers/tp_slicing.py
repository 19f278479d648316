"""Tensor-parallel slices of one EXL3 matrix (no SGLang import; pure tensor indexing).

EXL3's Hadamard transforms are block-diagonal with 128-wide blocks on both sides, so a slice
commutes with them exactly when it starts on a 128 boundary; each rank then applies its own
input/output rotations (exllamav3's `tp_import` discipline). A slice whose logical size is not a
multiple of 128 is allowed only when it runs to the end of the matrix (the padding region).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.format.constants import ALIGN, padded


class Exl3SliceError(ValueError):
    pass


@dataclass(frozen=True)
class Exl3Slice:
    """What one rank keeps of a matrix: logical [start, start+size) along K (rows) or N (columns)."""

    start: int
    size: int
    total: int  # logical size of the whole dimension

    def packed_range(self, packed: int, what: str) -> tuple[int, int]:
        if self.start == 0 and self.size >= self.total:
            return 0, packed
        end = self.start + self.size
        if self.start % ALIGN or (self.size % ALIGN and end < self.total):
            raise Exl3SliceError(
                f"{what} [{self.start}, {end}) of {self.total} is not 128-aligned; EXL3's Hadamard blocks "
                "are 128 wide, so every tensor-parallel cut must fall on a multiple of 128. Choose a TP size "
                "that keeps each shard a multiple of 128 (or expert parallelism for MoE layers)")
        return self.start, min(packed, padded(end))


def slice_columns(trellis: torch.Tensor, svh: torch.Tensor, cut: Exl3Slice, name: str):
    """Column-parallel: trellis[:, n0/16 : n1/16], svh[n0:n1]."""
    n0, n1 = cut.packed_range(trellis.shape[1] * 16, f"{name}: output slice")
    return trellis[:, n0 // 16 : n1 // 16], svh[n0:n1]


def slice_rows(trellis: torch.Tensor, suh: torch.Tensor, cut: Exl3Slice, name: str):
    """Row-parallel: trellis[k0/16 : k1/16], suh[k0:k1]."""
    k0, k1 = cut.packed_range(trellis.shape[0] * 16, f"{name}: input slice")
    return trellis[k0 // 16 : k1 // 16], suh[k0:k1]
