#!/usr/bin/env bash
# On the GPU machine (carry the kernel library; SGLANG_EXL3_KERNEL_LIB defaults to .kbuild): ncu of the large-m
# EXL3 linear (had_in, reconstruct + cuBLAS per W_hat column slice, had_out) at 4096 x 14336, 4 bits, next to the
# bf16 cuBLAS GEMM on the dequantized weight, for m = 256 / 2048 and W_hat slices of 128 MB (one slice) / 16 MB.
# One row per launch (--set basic): where the time over bf16 goes. Summaries land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD SGLANG_EXL3_KERNEL_LIB=${SGLANG_EXL3_KERNEL_LIB:-$PWD/.kbuild/libexl3_trellis.so}
cat >/tmp/prefill_prof.py <<'PY'
import sys
import torch
from sglang_exl3.format import Codebook
from sglang_exl3.kernels import cuda_trellis as ck
k, n, m, slice_mb = 4096, 14336, int(sys.argv[1]), int(sys.argv[2])
ck.RECONSTRUCT_SLICE_BYTES = slice_mb << 20
g = torch.Generator().manual_seed(m)
t = ck.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16).cuda())
suh, svh = (torch.randn(k, generator=g) * 0.1).half().cuda(), (torch.randn(n, generator=g) * 0.1).half().cuda()
x = torch.randn(m, k, generator=g).half().cuda()
w, xb = ck.reconstruct(t, Codebook.MCG).bfloat16(), x.bfloat16()
for _ in range(2):  # cuBLAS heuristics and workspaces settle before the profiled range
    ck.exl3_linear(x, t, suh, svh, Codebook.MCG, path="reconstruct")
    xb @ w
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
ck.exl3_linear(x, t, suh, svh, Codebook.MCG, path="reconstruct")
xb @ w
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
PY
for m in 256 2048; do
  for s in 128 16; do
    timeout 120 ncu --clock-control none --profile-from-start off --set basic -o "/tmp/pf-$m-$s" \
      python3 /tmp/prefill_prof.py "$m" "$s" 2>&1 | tail -1
    ncu -i "/tmp/pf-$m-$s.ncu-rep" --page details --csv >"$OUT/prefill-ncu-$m-$s.csv"
    python3 benchmarks/ncu_summary.py "$OUT/prefill-ncu-$m-$s.csv" --compact --out "$OUT/prefill-ncu-m$m-slice$s.md" \
      --title "ncu: large-m EXL3 linear, m = $m, 4096 x 14336, 4 bits MCG, W_hat slices of $s MB; last row: bf16" \
      >/dev/null && tail -n +3 "$OUT/prefill-ncu-m$m-slice$s.md"
  done
done
