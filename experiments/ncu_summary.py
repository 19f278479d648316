"""Summarise an ncu profile of the fused GEMM (`experiments/profile_gemm.py`) as a Markdown table.

On the GPU machine:
  ncu --clock-control none --kernel-name regex:gemm_kernel --launch-count 2 --set full --import-source yes \
      -o gemm python3 experiments/profile_gemm.py
  ncu -i gemm.ncu-rep --page details --csv > details.csv
  ncu -i gemm.ncu-rep --page source --csv --print-source sass > source_sass.csv
Here: python experiments/ncu_summary.py details.csv source_sass.csv --out benchmarks/results/gemm-ncu-h200.md

Why: issue 4 asks that a missed target be explained from a profile; the report itself (24 MB) does not travel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
from pathlib import Path

KEY_METRICS = ["Duration", "SM Frequency", "DRAM Throughput", "Memory Throughput", "Issue Slots Busy",
               "Executed Ipc Active", "Executed Instructions", "Warp Cycles Per Issued Instruction",
               "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "No Eligible", "Registers Per Thread",
               "Grid Size", "Waves Per SM", "Theoretical Occupancy", "Achieved Active Warps Per SM",
               "SM Active Cycles", "Elapsed Cycles", "L1/TEX Hit Rate", "L2 Hit Rate"]


def details_rows(path: Path) -> dict[str, list[dict[str, str]]]:
    """Metric rows per kernel launch ID."""
    by_id: dict[str, list[dict[str, str]]] = collections.defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            by_id[row["ID"]].append(row)
    return by_id


def source_sections(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, per-instruction rows) for each kernel in an `ncu --page source --csv` export."""
    lines = Path(path).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Address"')]
    out = []
    for j, s in enumerate(starts):
        end = starts[j + 1] - 1 if j + 1 < len(starts) else len(lines)
        name = next(csv.reader([lines[s - 1]]))[1] if s > 0 else "?"
        out.append((name, list(csv.DictReader(io.StringIO("\n".join(lines[s:end]))))))
    return out


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def stall_table(rows: list[dict[str, str]]) -> tuple[list[tuple[str, int]], list[tuple[str, str, int, str]]]:
    """Stall reasons summed over all instructions, and the instructions holding the most samples."""
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    totals = collections.Counter()
    for r in rows:
        for k in stalls:
            totals[k[6:]] += _int(r[k])
    hot = []
    for r in sorted(rows, key=lambda r: -_int(r["Warp Stall Sampling (All Samples)"]))[:8]:
        top = sorted(((_int(r[k]), k[6:]) for k in stalls), reverse=True)[:2]
        hot.append((r["Address"][-5:], r["Source"].strip(), _int(r["Warp Stall Sampling (All Samples)"]),
                    ", ".join(f"{k} {v}" for v, k in top if v)))
    return totals.most_common(), hot


TITLE = "ncu profile of the fused GEMM (m = 1, 4096 x 14336, 4 bits)"


COMPACT = ["Duration", "DRAM Throughput", "Compute (SM) Throughput", "Memory Throughput", "Grid Size",
           "Registers Per Thread"]


def compact_table(by_id: dict[str, list[dict[str, str]]]) -> list[str]:
    """One row per launch (a multi-kernel path's time split): name, then the COMPACT metrics."""
    out = ["| launch | kernel | " + " | ".join(COMPACT) + " |", "|---" * (len(COMPACT) + 2) + "|"]
    total = 0.0
    for launch_id, rows in sorted(by_id.items(), key=lambda kv: int(kv[0])):
        values = {r["Metric Name"]: (r["Metric Value"], r["Metric Unit"]) for r in rows}
        name = rows[0]["Kernel Name"].split("(")[0].replace("void ", "")[:60]
        cells = [f"{values[k][0]} {values[k][1]}".strip() if k in values else "" for k in COMPACT]
        dur, unit = values.get("Duration", ("0", "us"))
        total += float(dur.replace(",", "")) * (1e-3 if unit == "ns" else 1e3 if unit == "ms" else 1.0)
        out.append(f"| {launch_id} | `{name}` | " + " | ".join(cells) + " |")
    out += ["", f"Sum of durations: {total:.1f} us (kernels only; launch gaps not included)", ""]
    return out


def render(details: Path, source: Path | None, title: str = TITLE, compact: bool = False) -> str:
    by_id = details_rows(details)
    out = [f"# {title}", ""]
    if compact:
        return "\n".join(out + compact_table(by_id))
    sections = source_sections(source) if source else []
    for launch_id, rows in sorted(by_id.items()):
        kernel = rows[0]["Kernel Name"]
        out += [f"## launch {launch_id}: `{kernel}`", "", "| metric | unit | value |", "|---|---|---|"]
        seen = set()
        for r in rows:
            if r["Metric Name"] in KEY_METRICS and r["Metric Name"] not in seen:
                seen.add(r["Metric Name"])
                out.append(f"| {r['Metric Name']} | {r['Metric Unit']} | {r['Metric Value']} |")
        out.append("")
    for name, rows in sections:
        totals, hot = stall_table(rows)
        all_samples = sum(v for _, v in totals) or 1
        out += [f"## warp stall samples: `{name}`", "", "| reason | samples | share |", "|---|---|---|"]
        out += [f"| {k} | {v} | {100 * v / all_samples:.1f}% |" for k, v in totals if v]
        out += ["", "| address | SASS | samples | top reasons |", "|---|---|---|---|"]
        out += [f"| {a} | `{s}` | {n} | {why} |" for a, s, n, why in hot]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("details", type=Path)
    ap.add_argument("source", type=Path, nargs="?", help="the source page export (stall samples); optional")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default=TITLE, help="the table's heading (what was profiled)")
    ap.add_argument("--compact", action="store_true", help="one row per launch (e.g. a --set basic profile)")
    args = ap.parse_args()
    args.out.write_text(render(args.details, args.source, args.title, args.compact))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
