"""The two forms of the Hadamard-128 rotation launches side by side: one warp per 128-block (shuffle butterflies)
against eight threads per 128-block (registers and a shared-memory transpose), which give the same bits.

Rows of kind `had_in` (bf16 x, as a bf16 model's linears get it), `had_out_fp16` (one fp16 split: the output of
reconstruct + cuBLAS at large m) and `had_out_fp32x4` (four fp32 split-K partials: the decode GEMM's) time one
launch; rows of kind `linear` time the whole EXL3 linear as dispatched (`exl3_linear`, 4 bits MCG, weight copies
larger than L2) beside bf16 cuBLAS on the same shape, and rows of kind `group` a gate/up-like group of two
4096 x 14336 sources at decode sizes (`group_linear`). Every octet result is checked bit for bit against the warp
form. `auto_us` is the size-based choice the product makes (OCTET_MIN_ITEMS, never over fp32 partials). CUDA-graph
replay throughout.

  python experiments/rotation_ab.py [--cols 4096,14336] [--rows 1,8,64,256,2048,8192]
      [--shapes 4096x14336,14336x4096] [--linear-ms 16,64,256,2048] [--group-ms 16,64,128]

Writes benchmarks/results/rotation-ab-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from experiments.xs_ab import _weights  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import dense, groups  # noqa: E402

FORMS = ("warp", "octet", "auto")
COLUMNS = ["kind", "k", "n", "m", "warp_us", "octet_us", "octet_speedup", "auto_us", "bf16_us", "warp_vs_bf16",
           "octet_vs_bf16", "auto_vs_bf16"]


def _by_form(fn, rotations: int = 1) -> dict[str, float]:
    """Each form's time for fn(i) (i cycling over `rotations` inputs), after checking that every form gives the warp
    form's bits."""
    outs = {}
    for form in FORMS:
        with dense.pinned_had_form(form):
            outs[form] = fn(0).clone()
    for form in FORMS[1:]:
        if not torch.equal(outs["warp"].view(torch.int16), outs[form].view(torch.int16)):
            raise AssertionError(f"the {form} rotation form differs from the warp form")
    times = {}
    for form in FORMS:
        with dense.pinned_had_form(form):
            times[form] = graph_us(fn, rotations)
    return times


def _row(kind: str, k: int, n: int, m: int, times: dict[str, float], bf16_us: float | None = None) -> dict:
    row = {"kind": kind, "k": k, "n": n, "m": m, "warp_us": times["warp"], "octet_us": times["octet"],
           "octet_speedup": round(times["warp"] / times["octet"], 3), "auto_us": times["auto"]}
    if bf16_us is not None:
        row |= {"bf16_us": bf16_us, **{f"{f}_vs_bf16": round(times[f] / bf16_us, 3) for f in FORMS}}
    print(row, flush=True)
    return row


def rotation_rows(cols: list[int], rows: list[int]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    out = []
    for n in cols:
        scale = (randn(n) * 0.1).half()
        for m in rows:
            x = randn(m, n).to(torch.bfloat16)
            out.append(_row("had_in", n, n, m, _by_form(lambda i, x=x, s=scale: dense.had_in(x, s))))
            acc16 = (randn(1, m, n) * 30).half()
            out.append(_row("had_out_fp16", n, n, m, _by_form(lambda i, a=acc16, s=scale: dense.had_out(a, s))))
            acc32 = randn(4, m, n) * 30
            out.append(_row("had_out_fp32x4", n, n, m, _by_form(lambda i, a=acc32, s=scale: dense.had_out(a, s))))
    return out


def linear_rows(shapes: list[tuple[int, int]], ms: list[int]) -> list[dict]:
    out = []
    for k, n in shapes:
        copies, tiles, suh, svh, gen = _weights(k, n, 4)
        w_bf16 = dense.reconstruct(tiles[0], Codebook.MCG).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            def linear(i: int, x=x, tiles=tiles, suh=suh, svh=svh) -> torch.Tensor:
                return dense.exl3_linear(x, tiles[i % len(tiles)], suh, svh, Codebook.MCG)

            times = _by_form(linear, copies)
            bf16_us = graph_us(lambda i, x=x, w=w_bf16: x @ w)
            out.append(_row("linear", k, n, m, times, bf16_us))
    return out


def group_rows(k: int, n: int, ms: list[int]) -> list[dict]:
    """A gate/up-like group (two k x n sources) as served at decode sizes: input rotation, GEMM, output rotation."""
    copies, tiles, suh, svh, gen = _weights(k, n, 4)
    groups = [groups.make_group([tiles[i], tiles[(i + 1) % copies]], [suh, suh], [svh, svh], Codebook.MCG)
              for i in range(copies)]
    out = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
        times = _by_form(lambda i, x=x: groups.group_linear(x, groups[i % len(groups)]), copies)
        out.append(_row("group", k, 2 * n, m, times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cols", default="4096,14336")
    ap.add_argument("--rows", default="1,8,64,256,2048,8192")
    ap.add_argument("--shapes", default="4096x14336,14336x4096")
    ap.add_argument("--linear-ms", default="16,64,256,2048")
    ap.add_argument("--group-ms", default="16,64,128")
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    rows = rotation_rows(ints(args.cols), ints(args.rows))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    rows += linear_rows(shapes, ints(args.linear_ms))
    rows += group_rows(4096, 14336, ints(args.group_ms))
    path = write_results("rotation-ab", header(sys.argv), rows, COLUMNS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
