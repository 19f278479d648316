"""Build, on this CPU machine, the SGLang JIT modules the GPU benchmarks' anchors load, so that the GPU machine loads
them from a carried cache instead of compiling them with its device time (SGLang 0.5.17 compiles each on first
use: minutes of nvcc apiece).

  CUDA_HOME=/usr/local/cuda .venv/bin/python scripts/prebuild_jit.py [--out .marlin]

Then carry the folder and set TVM_FFI_CACHE_DIR to it on the GPU machine (docs/gpu.md). The modules, for sm_90a
(what an H200 resolves to):
  - gptq_marlin (fp16): `benchmarks/kernels.py --marlin`, SGLang's GPTQ-Marlin int4 linear;
  - moe_wna16_marlin (bf16, no EP, no bias), moe_align_single_token, activation (bf16): `benchmarks/moe.py
    --marlin`, SGLang's `fused_marlin_moe`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".marlin"), help="the cache folder to carry")
    ap.add_argument("--only", help="comma-separated module names (default: all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["TVM_FFI_CACHE_DIR"] = str(args.out.resolve())
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")  # the link step looks for libcudart there

    import torch
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

    def modules():
        from sglang.kernels.ops.activation.activation import activation_module
        from sglang.kernels.ops.moe.moe_align_single_token import _jit_align_single_token_module
        from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module
        from sglang.kernels.ops.quantization.gptq_marlin import _jit_gptq_marlin_module

        return {"gptq_marlin": lambda: _jit_gptq_marlin_module(torch.float16),
                "moe_wna16_marlin": lambda: _jit_moe_wna16_marlin_module(torch.bfloat16, False, False),
                "moe_align_single_token": _jit_align_single_token_module,
                "activation": lambda: activation_module(torch.bfloat16)}

    with override_jit_cuda_arch(9, 0):
        todo = modules()
        names = args.only.split(",") if args.only else list(todo)
        unknown = sorted(set(names) - set(todo))
        if unknown:
            print(f"unknown modules {unknown}; known: {sorted(todo)}", file=sys.stderr)
            return 2
        for name in names:
            t0 = time.time()
            todo[name]()
            print(f"{name}: ready in {time.time() - t0:.0f} s (built, or found in the cache)", flush=True)
    print(f"carry {args.out} and set TVM_FFI_CACHE_DIR to it on the GPU machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
