"""One fused EXL3 GEMM call per codebook at 4096 x 14336, 4 bits, m = 1: the target for `ncu`.

  ncu --clock-control none --kernel-name regex:gemm_kernel --section SpeedOfLight ... python experiments/profile_gemm.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense  # noqa: E402


def main() -> None:
    k, n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096, int(sys.argv[2]) if len(sys.argv) > 2 else 14336
    bits = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    trellis = dense.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), dtype=torch.int16,
                                          device="cuda"))
    suh = torch.randn(k, device="cuda").half()
    svh = torch.randn(n, device="cuda").half()
    x = torch.randn(1, k, device="cuda").half()
    for cb in (Codebook.MCG, Codebook.MUL1):
        dense.exl3_linear(x, trellis, suh, svh, cb, path="fused")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
