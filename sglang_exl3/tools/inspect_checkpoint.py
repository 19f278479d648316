"""`python -m sglang_exl3 inspect CKPT`: what an EXL3 checkpoint holds and everything wrong with it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from sglang_exl3.format import Exl3FormatError, load_checkpoint


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def inspect_checkpoint(path: str | Path, as_json: bool = False, verbose: bool = False) -> tuple[str, int]:
    """Return (report text, exit code): 0 when valid, 1 when any problem was found."""
    try:
        ckpt = load_checkpoint(path, strict=False)
    except Exl3FormatError as e:
        return str(e), 1
    modules = ckpt.modules
    weights = sum(m.in_features * m.out_features for m in modules.values())
    bits = sum(m.bits * m.in_features * m.out_features for m in modules.values())
    plain = ckpt.plain_tensor_names()
    summary = {
        "path": str(ckpt.path),
        "architecture": ckpt.architecture,
        "quantization_config": ckpt.quantization_config,
        "exl3_modules": len(modules),
        "exl3_bits_per_weight": round(bits / weights, 4) if weights else None,
        "bits_histogram": {str(k): v for k, v in sorted(Counter(m.bits for m in modules.values()).items())},
        "codebooks": dict(Counter(m.codebook.label for m in modules.values())),
        "exl3_bytes": sum(m.nbytes for m in modules.values()),
        "plain_tensors": len(plain),
        "plain_bytes": sum(ckpt.tensors[n].nbytes for n in plain),
        "modules": {k: {"bits": m.bits, "codebook": m.codebook.label, "in": m.in_features,
                        "out": m.out_features, "bytes": m.nbytes, "legacy_signs": m.legacy_signs,
                        "bias": m.has_bias} for k, m in modules.items()},
        "problems": [str(p) for p in ckpt.problems],
    }
    code = 1 if ckpt.problems else 0
    if as_json:
        return json.dumps(summary, indent=2), code
    qc = ckpt.quantization_config
    lines = [
        f"checkpoint    {ckpt.path}",
        f"architecture  {ckpt.architecture}",
        f"exllamav3     {qc.get('version', '?')}  target bits {qc.get('bits', '?')}  head bits "
        f"{qc.get('head_bits', '?')}  codebook {qc.get('codebook', '(none: 3inst)')}",
        f"EXL3 modules  {len(modules)}  ({_mib(summary['exl3_bytes'])}, "
        f"{summary['exl3_bits_per_weight']} bits/weight over {weights:,} weights)",
        f"bits          {summary['bits_histogram']}",
        f"codebooks     {summary['codebooks']}",
        f"plain tensors {len(plain)}  ({_mib(summary['plain_bytes'])})",
    ]
    if verbose or len(modules) <= 64:
        lines.append("")
        lines.append(f"{'module':<60} {'bits':>5} {'cb':>6} {'in x out':>15} {'size':>12}")
        for key, m in modules.items():
            lines.append(f"{key:<60} {m.bits:>5} {m.codebook.label:>6} "
                         f"{f'{m.in_features}x{m.out_features}':>15} {_mib(m.nbytes):>12}")
    lines.append("")
    if ckpt.problems:
        lines.append(f"PROBLEMS ({len(ckpt.problems)}):")
        lines.extend(f"  - {p}" for p in ckpt.problems)
    else:
        lines.append("no problems found")
    return "\n".join(lines), code
