#!/usr/bin/env bash
# On the GPU machine (carry the kernel library; SGLANG_EXL3_KERNEL_LIB defaults to .kbuild): ncu (--set full) of the
# decode MoE's two launches at m = 1 on the Qwen3-30B-A3B layer (128 experts of 2048 x 768, top-8, 4 bits MCG):
# where the ~27 µs go (benchmarks/results/moe-decode-h200.md). Summary lands in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD SGLANG_EXL3_KERNEL_LIB=${SGLANG_EXL3_KERNEL_LIB:-$PWD/.kbuild/libexl3_trellis.so}
cat >/tmp/moe_decode_prof.py <<'PY'
import torch
from sglang_exl3.format import Codebook
from sglang_exl3.kernels import dense
from sglang_exl3.kernels import moe_ops
from sglang_exl3.kernels import moe_tables
g = torch.Generator().manual_seed(1)
banks = []
for k, n in ((2048, 768), (2048, 768), (768, 2048)):
    t = [dense.prepare(torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16).cuda())
         for _ in range(128)]
    banks.append(moe_tables.make_expert_bank(t, [(torch.randn(k, generator=g) * .05).half().cuda() for _ in t],
                                     [(torch.randn(n, generator=g) * .05).half().cuda() for _ in t], Codebook.MCG))
x = torch.randn(1, 2048, generator=g).bfloat16().cuda()
counters = moe_ops.decode_counters(8, 1, 2048, 768, "cuda")
w = torch.softmax(torch.randn(8, generator=g), -1).cuda()
for i in range(4):
    ids = torch.randperm(128, generator=g)[:8].to(torch.int32).cuda()
    if i == 3:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    moe_ops.moe_decode(x, ids, w, *banks, 8, False, counters, out_dtype=torch.bfloat16)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
PY
timeout 180 ncu --clock-control none --profile-from-start off --set full --import-source yes -o /tmp/md \
  python3 /tmp/moe_decode_prof.py 2>&1 | tail -2
ncu -i /tmp/md.ncu-rep --page details --csv >/tmp/md-details.csv
ncu -i /tmp/md.ncu-rep --page source --csv --print-source sass >/tmp/md-source.csv 2>/dev/null
python3 experiments/ncu_summary.py /tmp/md-details.csv /tmp/md-source.csv --out "$OUT/moe-decode-ncu-h200.md" \
  --title "ncu: decode MoE at m = 1 (gate/up launch, then down launch), Qwen3-30B-A3B layer, 4 bits MCG" >/dev/null
grep -E "^## |Duration|DRAM Throughput|Issue Slots|Achieved Active|Eligible|Waves|^\| [a-z_]+ \| [0-9]+ \| [0-9.]+%" \
  "$OUT/moe-decode-ncu-h200.md" | head -60
