"""EXL3 GEMM kernels on real model shapes: ours (CUDA), exllamav3's exl3_gemm, bf16 cuBLAS, SGLang's GPTQ-Marlin
int4 (group 128: what a Hopper user serves at 4 bits today), HBM roofline.

Every time is a CUDA-graph replay median (benchmarks.common.graph_us), measured side by side in one run;
each call in a graph reads its own copy of the weights, with enough copies to exceed the 50 MB L2.
"ours" is exl3_linear's own dispatch for that m (the x ring, the wgmma ring or the x-slice GEMM up to the
crossover, else reconstruct + cuBLAS); the plain fused GEMM and the large-m path are also timed forced where they
apply (`ours_fused_us` bypasses the rings), to choose the crossover from data. Marlin's column needs SGLang and
its JIT-compiled module (~8 min of nvcc on first use; docs/gpu.md says how to carry a prebuilt one).

  python benchmarks/kernels.py [--quick] [--shapes 0,1] [--bits 2,4] [--ms 1,16] [--ext-path DIR] [--tune]
  python benchmarks/kernels.py --merge a.json b.json ...   (one table from runs split over calls)

Writes benchmarks/results/kernels-<gpu>.{json,md,png} (suffixed for --quick / --shapes runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth, graph_us, header, pyplot, write_results  # noqa: E402
from sglang_exl3.format import Codebook  # noqa: E402

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (5120, 27648), (4096, 151936)]
MS = [1, 2, 4, 8, 16, 32, 64, 256, 2048]
BITS = [2, 3, 4, 5, 6, 8]
CODEBOOKS = [Codebook.MUL1, Codebook.MCG, Codebook.INST3]
ROTATE_BYTES = 150 << 20  # weights touched per graph: 3x the H200's 50 MB L2
EXLLAMAV3_GEMM_MAX_M = 144  # exllamav3 switches from exl3_gemm to reconstruct + cuBLAS above this
COLUMNS = ["k", "n", "m", "bits", "codebook", "ours_us", "exllamav3_us", "bf16_us", "marlin_us", "roofline_us",
           "ours_pct_roofline", "speedup_vs_exllamav3", "ours_fused_us", "ours_reconstruct_us", "ours_one_launch_us"]


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


def _copies(nbytes: int) -> int:
    return max(2, min(96, math.ceil(ROTATE_BYTES / nbytes)))


class Weights:
    """Random trellis copies for one (shape, bits), shared by every m and codebook."""

    def __init__(self, k: int, n: int, bits: int):
        self.t_bytes = k * n * bits // 8
        self.copies = _copies(self.t_bytes)
        from sglang_exl3.kernels.dense import prepare

        self.trellis = [torch.randint(-32768, 32768, (k // 16, n // 16, bits * 16), dtype=torch.int16,
                                      device="cuda") for _ in range(self.copies)]
        self.tiles = [prepare(t) for t in self.trellis]  # our kernels' layout (same bytes, transposed tiles)
        self.suh = (torch.randn(k, device="cuda") * 0.05).half()
        self.svh = (torch.randn(n, device="cuda") * 0.05).half()
        self._one_launch: dict = {}

    def one_launch(self, cb: Codebook) -> list:
        """Each copy's one-launch form (table and counters; None where the shape cannot take it), made on first use."""
        from sglang_exl3.kernels.groups import make_one_launch

        if cb not in self._one_launch:
            self._one_launch[cb] = [make_one_launch([t], [self.suh], [self.svh], cb) for t in self.tiles]
        return self._one_launch[cb]


def _time_or_none(fn, rotations: int) -> float | None:
    try:
        return graph_us(fn, rotations=rotations, calls=rotations)
    except Exception as e:  # noqa: BLE001 - recorded as a missing value, with the reason printed
        print(f"  timing failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def bench_row(k, n, m, bits, cb, w: Weights, xs, ext, anchors: dict, bw) -> dict:
    from sglang_exl3.kernels import dense, dispatch, groups
    row = {"k": k, "n": n, "m": m, "bits": bits, "codebook": cb.label, **anchors}
    c = w.copies

    def ours(path):
        return lambda i: dense.exl3_linear(xs[i % 4], w.tiles[i % c], w.suh, w.svh, cb, path=path)

    if m <= dispatch.CROSSOVERS.fused_max_m:
        row["ours_fused_us"] = _time_or_none(ours("fused"), c)
    one = w.one_launch(cb) if m <= dispatch.CROSSOVERS.one_launch_max_rows else [None]
    if one[0] is not None and one[0].serves(m):  # SGLANG_EXL3_DEV_ONE_LAUNCH_MAX_M's path: the rotations folded in
        row["ours_one_launch_us"] = _time_or_none(
            lambda i: groups.one_launch_linear(xs[i % 4], one[i % c].group, one[i % c].counters), c)
    if m >= 16:  # the product's large-m path (exl3_linear's default above the crossover)
        row["ours_reconstruct_us"] = _time_or_none(ours("reconstruct_staged"), c)
    # the product's own choice (exl3_linear with no path: the x ring / wgmma ring / x-slice GEMM by m, the large-m
    # path above the crossover); the forced paths above bypass the ring, which once made ours_us read 91 µs at m = 64
    row["ours_us"] = _time_or_none(ours(None), c)
    if ext is not None:
        outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(2)]
        had = [torch.empty_like(x) for x in xs]
        mcg, mul1 = cb == Codebook.MCG, cb == Codebook.MUL1

        def theirs(i):
            if m <= EXLLAMAV3_GEMM_MAX_M:  # exllamav3's own dispatch: exl3_gemm for small m ...
                ext.exl3_gemm(xs[i % 4], w.trellis[i % c], outs[i % 2], w.suh, had[i % 4], w.svh, -1, mcg, mul1, 0)
            else:  # ... LinearEXL3.reconstruct_hgemm above 144 rows
                ext.had_r_128(xs[i % 4], had[i % 4], w.suh, None, 1.0)
                wt = torch.empty(k, n, dtype=torch.float16, device="cuda")
                ext.reconstruct(wt, w.trellis[i % c], bits, mcg, mul1)
                torch.matmul(had[i % 4], wt, out=outs[i % 2])
                ext.had_r_128(outs[i % 2], outs[i % 2], None, w.svh, 1.0)

        row["exllamav3_us"] = _time_or_none(theirs, c)
    row["roofline_us"] = (w.t_bytes + m * k * 2 + m * n * 2) / bw * 1e6
    if row.get("ours_us"):
        row["ours_pct_roofline"] = 100 * row["roofline_us"] / row["ours_us"]
        if row.get("exllamav3_us"):
            row["speedup_vs_exllamav3"] = row["exllamav3_us"] / row["ours_us"]
    return row


def bf16_time(k: int, n: int, m: int, xs) -> float | None:
    copies = _copies(k * n * 2)
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    xb = [x.bfloat16() for x in xs]
    return _time_or_none(lambda i: xb[i % 4] @ ws[i % copies], copies)


def marlin_time(k: int, n: int, m: int, xs) -> float | None:
    """SGLang's GPTQ-Marlin int4 GEMM (uint4b8, group 128, no act-order) on random packed weights of the same shape:
    the kernel's work does not depend on the values. None where SGLang or its Marlin module is unavailable."""
    try:
        from sglang.srt.layers.quantization.marlin_utils import (
            apply_gptq_marlin_linear,
            marlin_make_empty_g_idx,
            marlin_make_workspace,
            scalar_types,
        )
    except Exception as e:  # noqa: BLE001
        print(f"marlin column skipped: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    dev = torch.device("cuda")
    copies = _copies(k * n // 2)
    qweights = [torch.randint(-2**31, 2**31 - 1, (k // 16, n * 2), dtype=torch.int32, device=dev)
                for _ in range(copies)]
    scales = (torch.rand(k // 128, n, device=dev) * 0.01 + 0.001).half()
    empty, workspace = marlin_make_empty_g_idx(dev), marlin_make_workspace(dev)

    def fn(i):
        return apply_gptq_marlin_linear(xs[i % 4], qweights[i % copies], scales, empty, empty, empty, workspace,
                                        scalar_types.uint4b8, n, k, True)

    return _time_or_none(fn, copies)


def _tune_one(k: int, n: int, bits: int, m: int, bw: float) -> list[dict]:
    from sglang_exl3.kernels import dense, dispatch
    w = Weights(k, n, bits)
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
    rows = []
    for wps in (8, 16, 20, 24, 32, 48, 64, 96):
        splits = dispatch.default_splits(k // 16, n // 16, xs[0].device, warps_per_sm=wps)

        def fn(i, s=splits):
            return dense.exl3_linear(xs[i % 4], w.tiles[i % w.copies], w.suh, w.svh, Codebook.MCG, splits=s,
                                  path="fused")

        rows.append({"k": k, "n": n, "bits": bits, "m": m, "warps_per_sm": wps, "splits": splits,
                     "us": _time_or_none(fn, w.copies), "roofline_us": w.t_bytes / bw * 1e6})
        print(rows[-1], flush=True)
    return rows


def tune(bw: float, ms: list[int]) -> list[dict]:
    """Split-K occupancy sweep (warps per SM the default split count aims for) at each m: m = 9-16 runs the
    two-row-group variant (86 registers: 20 resident warps per SM, not the 32 of m <= 8)."""
    rows = []
    for m in ms:
        for k, n in SHAPES[:5]:
            for bits in (2, 4, 6):
                rows += _tune_one(k, n, bits, m, bw)
                torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sel = [r for r in rows if r["k"] == 4096 and r["n"] == 14336 and r["bits"] == 4]
    if not sel:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for cb in sorted({r["codebook"] for r in sel}):
        rs = sorted((r for r in sel if r["codebook"] == cb), key=lambda r: r["m"])
        ax.plot([r["m"] for r in rs], [r.get("ours_us") for r in rs], "o-", label=f"ours {cb}")
        if any(r.get("exllamav3_us") for r in rs):
            ax.plot([r["m"] for r in rs], [r.get("exllamav3_us") for r in rs], "s--", label=f"exllamav3 {cb}")
    rs = sorted((r for r in sel if r["codebook"] == "mul1"), key=lambda r: r["m"])
    ax.plot([r["m"] for r in rs], [r["bf16_us"] for r in rs], "k:", label="bf16 cuBLAS")
    if any(r.get("marlin_us") for r in rs):
        ax.plot([r["m"] for r in rs], [r.get("marlin_us") for r in rs], "m^-", label="GPTQ-Marlin int4 (g128)")
    ax.plot([r["m"] for r in rs], [r["roofline_us"] for r in rs], "g-.", label="HBM roofline (4 bpw)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows m")
    ax.set_ylabel("µs per call (CUDA-graph replay)")
    ax.set_title("4096 x 14336, 4 bits: EXL3 GEMM on the H200")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def with_crossover(rows: list[dict], crossover: int) -> list[dict]:
    """Re-derive "ours" for another fused/reconstruct crossover from the two measured path columns."""
    for r in rows:
        ours = r.get("ours_fused_us") if r["m"] <= crossover else r.get("ours_reconstruct_us")
        if ours is None:
            continue
        r["ours_us"] = ours
        r["ours_pct_roofline"] = 100 * r["roofline_us"] / ours
        if r.get("exllamav3_us"):
            r["speedup_vs_exllamav3"] = r["exllamav3_us"] / ours
    return rows


def merge(paths: list[str], header_json: str | None = None, crossover: int | None = None) -> int:
    """Results JSON files, or logs of runs holding 'ROW {...}' lines (header from the first JSON or --header)."""
    parts, rows = [], []
    for p in paths:
        text = Path(p).read_text()
        if text.lstrip().startswith("{"):
            parts.append(json.loads(text))
            rows += parts[-1]["rows"]
        else:
            rows += [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
    head = dict(parts[0]["header"]) if parts else {}
    if header_json:
        head.update(json.loads(Path(header_json).read_text()))
    if parts:
        head["command"] = " + ".join(p["header"]["command"] for p in parts)
    seen, unique = set(), []
    for r in rows:
        key = (r["k"], r["n"], r["m"], r["bits"], r["codebook"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rows = unique
    if crossover is not None:
        rows = with_crossover(rows, crossover)
        head["fused_max_m"] = crossover
    out = write_results("kernels", head, rows, COLUMNS)
    plot(rows, out.with_suffix(".png"))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three shapes, m in 1/4/16/64, 2 and 4 bits")
    ap.add_argument("--ext-path", default=None, help="folder holding a built exllamav3_ext")
    ap.add_argument("--shapes", default=None, help="comma-separated indexes into SHAPES (split a run over calls)")
    ap.add_argument("--bits", default=None, help="comma-separated bitrates (default: all)")
    ap.add_argument("--ms", default=None, help="comma-separated row counts (default: all of MS)")
    ap.add_argument("--marlin", action="store_true", help="add SGLang's GPTQ-Marlin int4 (group 128) column")
    ap.add_argument("--name", default=None, help="results name (default: kernels, suffixed for partial runs)")
    ap.add_argument("--tune", action="store_true", help="split-K sweep instead of the table")
    ap.add_argument("--tune-ms", default="1", help="with --tune: comma-separated m (e.g. 1,16)")
    ap.add_argument("--merge", nargs="+", help="merge results (JSON, or logs with ROW lines) of split runs")
    ap.add_argument("--header", default=None, help="with --merge: JSON file of header fields")
    ap.add_argument("--crossover", type=int, default=None, help="with --merge: re-derive ours_us for this crossover")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.header, args.crossover)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from sglang_exl3.kernels import dispatch, library
    library.load_library(build=True)
    head = header(sys.argv)
    bw = copy_bandwidth()
    head["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    head["kernel_library"] = str(library.library_path())
    if args.tune:
        rows = tune(bw, [int(v) for v in args.tune_ms.split(",")])
        write_results("kernels-tune", head, rows, ["k", "n", "bits", "m", "warps_per_sm", "splits", "us",
                                                   "roofline_us"])
        return 0
    ext = _exllamav3_ext(args.ext_path)
    shapes, ms, bits_list = (SHAPES[:3], [1, 4, 16, 64], [2, 4]) if args.quick else (SHAPES, MS, BITS)
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.bits:
        bits_list = [int(b) for b in args.bits.split(",")]
    if args.ms:
        ms = [int(m) for m in args.ms.split(",")]
    fused_max_m = dispatch.fused_crossover_m()  # SGLANG_EXL3_DEV_FUSED_MAX_M, else the product's default
    head["fused_max_m"] = fused_max_m
    rows = []
    for k, n in shapes:
        anchors = {}
        for m in ms:
            xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
            anchors[m] = {"bf16_us": bf16_time(k, n, m, xs), "marlin_us": marlin_time(k, n, m, xs) if args.marlin
                          else None}
        for bits in bits_list:
            w = Weights(k, n, bits)
            for m in ms:
                xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
                for cb in CODEBOOKS:
                    r = bench_row(k, n, m, bits, cb, w, xs, ext, anchors[m], bw)
                    rows.append(r)
                    print("ROW " + json.dumps(r), flush=True)  # survives a run cut short (merge with --rows)
            del w
            torch.cuda.empty_cache()
    tag = "kernels" if not (args.quick or args.shapes or args.bits or args.ms) else \
        "kernels-" + ("quick" if args.quick else f"s{args.shapes or 'all'}-b{args.bits or 'all'}"
                      + (f"-m{args.ms}" if args.ms else "")).replace(",", "")
    path = write_results(args.name or tag, head, rows, COLUMNS)
    plot(rows, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
