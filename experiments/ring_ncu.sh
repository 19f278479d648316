#!/usr/bin/env bash
# On the GPU machine (carry the kernel library): ncu of the x-ring decode GEMM at 4096 x 14336, 4 bits MCG, for
# m = 16 and 64 at its best measured split count (3), mode 81 (8 warps per block, one trellis group per x chunk):
# where the time beyond the m = 1 cost goes
# (issue, stalls by reason, the SASS lines that stall). Summaries land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD SGLANG_EXL3_KERNEL_LIB=${SGLANG_EXL3_KERNEL_LIB:-$PWD/.kbuild/libexl3_trellis.so}
cat >/tmp/ring_prof.py <<'PY'
import sys
import torch
from sglang_exl3.format import Codebook
from sglang_exl3.kernels import dense as ck
k, n, m, splits, mode = 4096, 14336, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(m)
t = ck.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16).cuda())
xh = torch.randn(m, k, generator=g).half().cuda()
ck.gemm_rotated_partial(xh, t, Codebook.MCG, splits=splits, ring=mode)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
ck.gemm_rotated_partial(xh, t, Codebook.MCG, splits=splits, ring=mode)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
PY
for m in ${RING_NCU_MS:-64 16}; do
  timeout 200 ncu --clock-control none --profile-from-start off --set full --import-source yes \
    -o "/tmp/ring-$m" python3 /tmp/ring_prof.py "$m" "${RING_NCU_SPLITS:-3}" "${RING_NCU_MODE:-81}" 2>&1 | tail -1
  ncu -i "/tmp/ring-$m.ncu-rep" --page details --csv >"/tmp/ring-$m-details.csv"
  ncu -i "/tmp/ring-$m.ncu-rep" --page source --csv --print-source sass >"/tmp/ring-$m-sass.csv"
  python3 experiments/ncu_summary.py "/tmp/ring-$m-details.csv" "/tmp/ring-$m-sass.csv" --out "$OUT/ring-ncu-m$m.md" \
    --title "ncu: x-ring decode GEMM, m = $m, 4096 x 14336, 4 bits MCG, ${RING_NCU_SPLITS:-3} splits" >/dev/null
  head -60 "$OUT/ring-ncu-m$m.md"
done
