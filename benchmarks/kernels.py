"""EXL3 GEMM kernels on real model shapes: ours (Triton), exllamav3's exl3_gemm, bf16 cuBLAS, HBM roofline.

One run on the GPU machine; writes benchmarks/results/kernels-<gpu>.{json,md,png}.
Weights rotate over enough copies to exceed L2 (an H200 has 50 MB), activations too.

  python benchmarks/kernels.py [--quick] [--ext-path DIR]   (needs CUDA; exllamav3 column only with its extension)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth, header, median_us, write_results  # noqa: E402
from sglang_exl3.codec.hadamard import had_r_128  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (5120, 27648), (4096, 151936)]
MS = [1, 2, 4, 8, 16, 32, 64, 256, 2048]
BITS = [2, 3, 4, 5, 6, 8]
CODEBOOKS = [Codebook.MUL1, Codebook.MCG, Codebook.INST3]
L2_BYTES = 256 << 20  # rotate over at least this many bytes of weights


def _exllamav3_ext(path: str | None):
    try:
        if path:
            sys.path.insert(0, path)
            import exllamav3_ext
        else:
            from exllamav3.ext import exllamav3_ext
        return exllamav3_ext
    except Exception as e:  # noqa: BLE001
        print(f"exllamav3 column skipped: {e}", file=sys.stderr)
        return None


def bench_shape(k: int, n: int, m: int, bits: int, cb: Codebook, bw: float, ext) -> dict:
    from sglang_exl3.kernels.triton_trellis import triton_gemm_rotated

    words = bits * 16
    t_bytes = k * n * bits // 8
    copies = max(1, min(16, L2_BYTES // max(1, t_bytes)))
    trellis = [torch.randint(-32768, 32768, (k // 16, n // 16, words), dtype=torch.int16, device="cuda")
               for _ in range(copies)]
    suh = (torch.randn(k, device="cuda") * 0.05).half()
    svh = (torch.randn(n, device="cuda") * 0.05).half()
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
    row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label}

    def ours(i):
        xh = had_r_128(xs[i % 4], pre_scale=suh)
        acc = triton_gemm_rotated(xh, trellis[i % copies], cb)
        return had_r_128(acc, post_scale=svh, out_dtype=torch.float16)

    row["ours_us"] = median_us(ours, rotations=copies * 4)
    if ext is not None:
        outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(2)]
        had = [torch.empty_like(x) for x in xs]

        def theirs(i):
            ext.exl3_gemm(xs[i % 4], trellis[i % copies], outs[i % 2], suh, had[i % 4], svh, -1,
                          cb == Codebook.MCG, cb == Codebook.MUL1, 0)

        row["exllamav3_us"] = median_us(theirs, rotations=copies * 4)
    w_copies = max(1, min(4, L2_BYTES // (k * n * 2)))
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(w_copies)]
    xb = [x.bfloat16() for x in xs]
    row["bf16_us"] = median_us(lambda i: xb[i % 4] @ ws[i % w_copies], rotations=w_copies * 4)
    row["roofline_us"] = (t_bytes + m * k * 2 + m * n * 2) / bw * 1e6
    for name in ("ours_us", "exllamav3_us"):
        if name in row:
            row[name.replace("_us", "_pct_roofline")] = 100 * row["roofline_us"] / row[name]
    torch.cuda.empty_cache()
    return row


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sel = [r for r in rows if r["k"] == 4096 and r["n"] == 14336 and r["bits"] == 4]
    fig, ax = plt.subplots(figsize=(7, 4))
    for cb in sorted({r["codebook"] for r in sel}):
        rs = sorted((r for r in sel if r["codebook"] == cb), key=lambda r: r["m"])
        ax.plot([r["m"] for r in rs], [r["ours_us"] for r in rs], "o-", label=f"ours {cb}")
        if rs and "exllamav3_us" in rs[0]:
            ax.plot([r["m"] for r in rs], [r["exllamav3_us"] for r in rs], "s--", label=f"exllamav3 {cb}")
    rs = sorted((r for r in sel if r["codebook"] == "mul1"), key=lambda r: r["m"])
    ax.plot([r["m"] for r in rs], [r["bf16_us"] for r in rs], "k:", label="bf16 cuBLAS")
    ax.plot([r["m"] for r in rs], [r["roofline_us"] for r in rs], "g-.", label="HBM roofline (4 bpw)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows m")
    ax.set_ylabel("µs")
    ax.set_title("4096 x 14336, 4 bits")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape family, m <= 16, 2 and 4 bits")
    ap.add_argument("--ext-path", default=None, help="folder holding a built exllamav3_ext")
    ap.add_argument("--shapes", default=None, help="comma-separated indexes into SHAPES (split a run over calls)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    head = header(sys.argv)
    bw = copy_bandwidth()
    head["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    ext = _exllamav3_ext(args.ext_path)
    shapes, ms, bits_list = (SHAPES[:3], [1, 4, 16], [2, 4]) if args.quick else (SHAPES, MS, BITS)
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows = []
    for k, n in shapes:
        for m in ms:
            for bits in bits_list:
                for cb in CODEBOOKS:
                    rows.append(bench_shape(k, n, m, bits, cb, bw, ext))
                    r = rows[-1]
                    print(f"{k}x{n} m={m} K={bits} {cb.label}: ours {r['ours_us']:.1f} exl3 "
                          f"{r.get('exllamav3_us', float('nan')):.1f} bf16 {r['bf16_us']:.1f} roof "
                          f"{r['roofline_us']:.1f} us", flush=True)
    cols = ["k", "n", "m", "bits", "codebook", "ours_us", "exllamav3_us", "bf16_us", "roofline_us",
            "ours_pct_roofline"]
    tag = "kernels" if not (args.quick or args.shapes) else f"kernels-{'quick' if args.quick else args.shapes}"
    path = write_results(tag, head, rows, cols)
    plot(rows, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
