"""`Exl3Shard`: one EXL3 source matrix as a layer holds it on its device, shared by the linear and MoE methods,
their kernels' glue and the output check. No SGLang import: it is plain tensors and the codebook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_exl3.format import Codebook


@dataclass
class Exl3Shard:
    """One source matrix, ready to run on this rank."""

    key: str
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: Codebook
    out_features: int  # logical columns this shard contributes on this rank
    w_hat: torch.Tensor | None = None
    kernel_layout: bool = False  # trellis is in our CUDA kernels' [N/16, K/16, words] layout

    @property
    def in_features(self) -> int:
        return self.trellis.shape[1 if self.kernel_layout else 0] * 16

    @property
    def launch_ready(self) -> bool:
        """Can share launches with other sources on our kernels: kernel layout, output width untrimmed and whole
        128-wide Hadamard blocks."""
        n = self.trellis.shape[0] * 16
        return self.kernel_layout and n == self.out_features and n % 128 == 0
