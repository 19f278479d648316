"""The fuzzing table: generated malformed inputs per surface (tests/fuzz_surfaces.py) and what each did. It lives
beside the generators it runs: the CI test (tests/test_fuzz.py) runs 1,000 cases per surface with them, this script
a larger run for the record.

  python tests/fuzz_table.py [--cases 10000] [--seed 0]     (CPU; ~2 minutes for 10,000 cases per surface)

Writes benchmarks/results/fuzz.{json,md}: per surface the cases run, how many loaded, how many raised the project's
own named error (and how many distinct kinds of it), and anything else (other exceptions, hangs, files written),
which must be zero.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import fuzz_surfaces  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

COLUMNS = ["surface", "cases", "loaded", "named_errors", "distinct_named_errors", "other_exceptions", "hangs",
           "wrote_files", "seconds"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0, help="0: hypothesis' derandomized run (the CI test's stream)")
    args = ap.parse_args()
    import hypothesis

    rows, examples = [], {}
    for surface in fuzz_surfaces.SURFACES:
        t0 = time.time()
        tally = fuzz_surfaces.fuzz(surface, args.cases, seed=args.seed)
        row = tally.row(surface)
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        examples[surface] = [{"count": n, "message": m} for m, n in tally.errors.most_common(8)]
        print(json.dumps({k: row[k] for k in COLUMNS}), flush=True)
    head = {"command": " ".join(["python", "tests/fuzz_table.py", *sys.argv[1:]]), "python": platform.python_version(),
            "hypothesis": hypothesis.__version__, "machine": "CPU", "case_timeout_s": fuzz_surfaces.CASE_SECONDS}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fuzz.json").write_text(json.dumps({"header": head, "rows": rows, "most_common_named_errors": examples},
                                                  indent=1))
    lines = ["# fuzz: generated malformed inputs per surface", "",
             f"`{head['command']}` — Python {head['python']}, hypothesis {head['hypothesis']}, "
             f"{fuzz_surfaces.CASE_SECONDS} s per case before it counts as a hang", "",
             "Each case must load or raise the project's own named error (`Exl3FormatError`, `RankSlicedError`, "
             "`KnobError`); `other_exceptions`, `hangs` and `wrote_files` must be 0.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "Most common named errors per surface (names and numbers blurred):", ""]
    for surface, top in examples.items():
        lines.append(f"- **{surface}**")
        lines += [f"  - {e['count']} x `{e['message']}`" for e in top[:5]]
    (RESULTS / "fuzz.md").write_text("\n".join(lines) + "\n")
    bad = sum(r["other_exceptions"] + r["hangs"] + r["wrote_files"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
