"""Same-input EXL3 groups (q/k/v, gate/up) on Llama-3-8B shapes: one grouped launch per stage vs one
fused call per source, side by side in one run (CUDA-graph replay medians, weights rotated past the L2).

  python experiments/group.py [--bits 4] [--codebook mcg]

Writes benchmarks/results/group-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402

GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336))}
MS = [1, 2, 4, 8, 16, 32]
ROTATE_BYTES = 150 << 20
COLUMNS = ["group", "k", "widths", "m", "bits", "codebook", "separate_us", "grouped_us", "speedup"]


def bench_group(name: str, k: int, widths: tuple[int, ...], bits: int, cb: Codebook) -> list[dict]:
    from sglang_exl3.kernels import dense, groups
    nbytes = k * sum(widths) * bits // 8
    copies = max(2, min(48, -(-ROTATE_BYTES // nbytes)))
    sets = []
    for _ in range(copies):
        tiles = [dense.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), dtype=torch.int16,
                                          device="cuda")) for n in widths]
        suh = [(torch.randn(k, device="cuda") * 0.05).half() for _ in widths]
        svh = [(torch.randn(n, device="cuda") * 0.05).half() for n in widths]
        sets.append((tiles, suh, svh, groups.make_group(tiles, suh, svh, cb)))
    rows = []
    for m in MS:
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]

        def separate(i, xs=xs):
            tiles, suh, svh, _ = sets[i % copies]
            return torch.cat([dense.exl3_linear(xs[i % 4], t, s, v, cb, path="fused")
                              for t, s, v in zip(tiles, suh, svh, strict=True)], dim=1)

        def grouped(i, xs=xs):
            return groups.group_linear(xs[i % 4], sets[i % copies][3])

        torch.testing.assert_close(separate(0), grouped(0), rtol=0, atol=0)
        sep, grp = graph_us(separate, copies, calls=copies), graph_us(grouped, copies, calls=copies)
        rows.append({"group": name, "k": k, "widths": "+".join(map(str, widths)), "m": m, "bits": bits,
                     "codebook": cb.label, "separate_us": sep, "grouped_us": grp, "speedup": sep / grp})
        print("ROW", rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebook", default="mcg", choices=[c.label for c in Codebook])
    args = ap.parse_args()
    cb = next(c for c in Codebook if c.label == args.codebook)
    rows = []
    for name, (k, widths) in GROUPS.items():
        rows += bench_group(name, k, widths, args.bits, cb)
        torch.cuda.empty_cache()
    write_results("group", header(sys.argv), rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
