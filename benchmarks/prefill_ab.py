"""Large-m EXL3 linear: reconstruct + cuBLAS (the prefill path) vs the Triton decode-in-the-GEMM kernel vs bf16.

Issue 4's third target is m >= 256 within 1.25x of bf16 cuBLAS on the dequantized weight. Reconstruct + cuBLAS
writes and re-reads an fp16 W_hat each call (1.4-2.4x in benchmarks/results/kernels-h200.md);
`triton_trellis.triton_gemm_tiles` decodes each weight block once per BLOCK_M rows straight into `tl.dot`. Side by
side, CUDA-graph replay over several weight copies (more than L2), the whole linear (both Hadamard rotations
included) for every Triton config tried, and the GEMM alone. Outputs are checked against the reconstruct path first.

  python benchmarks/prefill_ab.py [--shapes 4096x14336,14336x4096] [--ms 256,2048] [--bits 4] [--slices 128,16]

Writes benchmarks/results/prefill-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_us, header, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402
from sglang_exl3.kernels import cuda_trellis as ck  # noqa: E402
from sglang_exl3.kernels.triton_trellis import triton_gemm_tiles  # noqa: E402

# (block_m, block_n, block_k, num_warps, num_stages)
# (Triton compiles one kernel per config, input width and bitrate: ~10 s each, so the sweep is kept short)
CONFIGS = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (256, 128, 64, 8, 2), (128, 256, 64, 8, 2)]
COLUMNS = ["k", "n", "m", "bits", "codebook", "reconstruct_us", "reconstruct_staged_us", "triton_us",
           "triton_config", "bf16_us", "triton_gemm_only_us", "triton_vs_bf16", "reconstruct_vs_bf16"]
COPIES = 3


def _case(k: int, n: int, m: int, bits: int, cb: Codebook):
    """COPIES random trellis copies (more than L2 between them), rotations, x, and the bf16 operands."""
    gen = torch.Generator().manual_seed(k + n + m + bits)
    tiles = [ck.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), generator=gen,
                                      dtype=torch.int16).cuda()) for _ in range(COPIES)]
    suh = (torch.randn(k, generator=gen) * 0.1).half().cuda()
    svh = (torch.randn(n, generator=gen) * 0.1).half().cuda()
    x = torch.randn(m, k, generator=gen).half().cuda()
    return tiles, suh, svh, x, [ck.reconstruct(t, cb).bfloat16() for t in tiles], x.bfloat16()


def bench_case(k: int, n: int, m: int, bits: int, cb: Codebook, configs=CONFIGS) -> dict:
    tiles, suh, svh, x, w_bf16, xb = _case(k, n, m, bits, cb)

    def triton_linear(i: int, cfg) -> torch.Tensor:
        bm, bn, bk, warps, stages = cfg
        acc = triton_gemm_tiles(ck.had_in(x, suh), tiles[i % COPIES], cb, bm, bn, bk, warps, stages)
        return ck.had_out(acc.unsqueeze(0), svh)

    want = ck.exl3_linear(x, tiles[0], suh, svh, cb, path="reconstruct").float()
    row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label,
           "reconstruct_us": graph_us(lambda i: ck.exl3_linear(x, tiles[i % COPIES], suh, svh, cb,
                                                               path="reconstruct"), COPIES),
           "reconstruct_staged_us": graph_us(lambda i: ck.exl3_linear(x, tiles[i % COPIES], suh, svh, cb,
                                                                      path="reconstruct_staged"), COPIES),
           "bf16_us": graph_us(lambda i: xb @ w_bf16[i % COPIES], COPIES)}
    best = None
    for cfg in configs:
        if n % cfg[1] or k % cfg[2]:
            continue
        try:
            got = triton_linear(0, cfg).float()
        except Exception as e:  # a config this GPU cannot compile (shared memory): skip it, say so
            print(f"{k}x{n} m={m} config {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            continue
        rel = float((got - want).norm() / want.norm())
        if not rel < 2e-3:
            raise AssertionError(f"{k}x{n} m={m} {bits} bits {cb.label} config {cfg}: rel {rel:.3g} vs reconstruct")
        us = graph_us(lambda i, c=cfg: triton_linear(i, c), COPIES)
        print("CONFIG", k, n, m, bits, cfg, f"{us:.1f}", flush=True)
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is not None:
        bm, bn, bk, warps, stages = best[1]
        xh = ck.had_in(x, suh)
        row.update(triton_us=best[0], triton_config="x".join(map(str, best[1])),
                   triton_gemm_only_us=graph_us(lambda i: triton_gemm_tiles(xh, tiles[i % COPIES], cb, bm, bn, bk,
                                                                            warps, stages), COPIES),
                   triton_vs_bf16=best[0] / row["bf16_us"])
    row["reconstruct_vs_bf16"] = row["reconstruct_us"] / row["bf16_us"]
    return row


def bench_slices(k: int, n: int, m: int, bits: int, cb: Codebook, slices_mb: list[int]) -> dict:
    """The reconstruct path with W_hat reconstructed in column slices of each size: a slice small enough to stay
    in L2 between the reconstruct that writes it and the cuBLAS GEMM that reads it skips its HBM round trip."""
    tiles, suh, svh, x, w_bf16, xb = _case(k, n, m, bits, cb)
    row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label,
           "bf16_us": graph_us(lambda i: xb @ w_bf16[i % COPIES], COPIES)}
    default = ck.RECONSTRUCT_SLICE_BYTES
    want = ck.exl3_linear(x, tiles[0], suh, svh, cb, path="reconstruct").float()
    try:
        for mb in slices_mb:
            ck.RECONSTRUCT_SLICE_BYTES = mb << 20
            got = ck.exl3_linear(x, tiles[0], suh, svh, cb, path="reconstruct").float()
            if not torch.equal(got, want):  # same columns, same cuBLAS shape per column: expected identical
                print(f"{k}x{n} m={m} slice {mb} MB: rel {float((got - want).norm() / want.norm()):.2e}",
                      file=sys.stderr)
            us = graph_us(lambda i: ck.exl3_linear(x, tiles[i % COPIES], suh, svh, cb, path="reconstruct"), COPIES)
            row[f"slice{mb}mb_us"] = us
            row[f"slice{mb}mb_vs_bf16"] = us / row["bf16_us"]
    finally:
        ck.RECONSTRUCT_SLICE_BYTES = default
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x14336,14336x4096")
    ap.add_argument("--ms", default="256,2048")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--slices", default=None, help="comma-separated W_hat slice sizes in MB: time only the "
                                                   "reconstruct path per slice size (prefill-slices table)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton kernel (its configs compile slowly)")
    args = ap.parse_args()
    configs = [] if args.no_triton else CONFIGS
    slices = [int(v) for v in args.slices.split(",")] if args.slices else None
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for bits in (int(b) for b in args.bits.split(",")):
            for m in (int(v) for v in args.ms.split(",")):
                rows.append(bench_slices(k, n, m, bits, Codebook.MCG, slices) if slices else
                            bench_case(k, n, m, bits, Codebook.MCG, configs))
                print("ROW", rows[-1], flush=True)
                torch.cuda.empty_cache()
    if slices:
        cols = ["k", "n", "m", "bits", "codebook", "bf16_us"]
        for mb in slices:
            cols += [f"slice{mb}mb_us", f"slice{mb}mb_vs_bf16"]
        write_results("prefill-slices", header(["python"] + sys.argv), rows, cols)
    else:
        write_results("prefill", header(["python"] + sys.argv), rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
