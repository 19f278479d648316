#!/usr/bin/env bash
# One GPU session's steps, each one `run` call on the warm machine (NOTES.md "GPU procedure"):
#   bash tests/gpu/h200_session.sh STEP
# kernels   carry .devbundle/a1 .kbuild      unpack bundle part a1; kernel tests (torch only)
# site2     carry .devbundle/a2              unpack bundle part a2
# sglang    carry .devbundle/b .kbuild       stage SGLang, install the package, build exllamav3 in the
#                                            background; MoE layer tests; MoE serving parity
# more      carry .kbuild                    rank-sliced fixture parity; dense parity with piecewise prefill graphs
# moebench  carry .kbuild                    benchmarks/moe.py with exllamav3's column
# Each step leaves $OUT/STEP.tgz (logs and JSON) and prints a summary.
set -uo pipefail
step=$1
shift
export PYTHONUNBUFFERED=1
export SGLANG_EXL3_KERNEL_LIB=$PWD/.kbuild/libexl3_trellis.so
work=/tmp/gpuout/$step
mkdir -p "$work" /tmp/site

site_env() {  # what .devbundle/*/stage.sh exports, for calls that no longer carry the bundle
  export PYTHONPATH=/tmp/site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS:-16}
  export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

pack() {
  tar -czf "$OUT/$step.tgz" -C /tmp/gpuout "$step"
}
trap pack EXIT TERM INT

case $step in
kernels)
  tar -xJf .devbundle/a1/site1.tar.xz -C /tmp/site
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$work/gpu.txt"
  PYTHONPATH=$PWD python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_trellis.py \
    tests/gpu/test_codec_cuda.py 2>&1 | tee "$work/pytest.txt" | tail -40
  ;;
site2)
  tar -xJf .devbundle/a2/site2.tar.xz -C /tmp/site && touch /tmp/site/.part_a && echo "site2 unpacked"
  ;;
sglang)
  source .devbundle/b/stage.sh
  pip install -q --no-deps --no-build-isolation --no-index . >"$work/pip.txt" 2>&1 || cat "$work/pip.txt"
  # exllamav3's extension (~6 min) for the benchmark's exllamav3 column, while the servers run
  setsid nohup bash -c 'MAX_JOBS=8 python3 -c "import exllamav3" >/tmp/exl3build.log 2>&1; echo "exit $?" >>/tmp/exl3build.log' \
    >/dev/null 2>&1 &
  python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_moe_cuda.py 2>&1 | tee "$work/pytest-moe.txt" | tail -20
  timeout 470 python3 tests/gpu/serve_parity.py "$work/moe" --backend cuda --ckpt tiny-qwen3moe-mul1-4bpw \
    --ckpt tiny-mixtral-mcg-3bpw "$@" 2>&1 | tee "$work/serve-moe.txt" | tail -40
  ;;
more)
  site_env
  python3 -m sglang_exl3 write-fixture /tmp/rs-qwen3moe-mcg-3bpw --arch qwen3_moe --codebook mcg --bits 3 \
    --rank-sliced-tp 1 --rotation-layout shared_h_v1 >"$work/write.txt" 2>&1 || cat "$work/write.txt"
  timeout 250 python3 tests/gpu/serve_parity.py "$work/rs" --backend cuda --ckpt /tmp/rs-qwen3moe-mcg-3bpw 2>&1 |
    tee "$work/serve-rs.txt" | tail -25
  timeout 250 python3 tests/gpu/serve_parity.py "$work/pw" --backend cuda --ckpt tiny-llama-mul1-4bpw \
    --extra="--cuda-graph-backend-prefill tc_piecewise" 2>&1 | tee "$work/serve-pw.txt" | tail -25
  grep -ho "cuda_graph_backend_prefill[^,]*" "$work"/pw/server-*-exl3.log | head -2
  ;;
moebench)
  site_env
  for _ in $(seq 60); do grep -q "^exit" /tmp/exl3build.log 2>/dev/null && break; sleep 5; done
  tail -3 /tmp/exl3build.log
  timeout 500 python3 benchmarks/moe.py --ckpt-dir /tmp/moeck "$@" 2>&1 | tee "$work/moe.txt" | grep -v "^ROW" | tail -40
  cp benchmarks/results/moe-* "$work/" 2>/dev/null
  ;;
*)
  echo "unknown step $step" >&2
  exit 2
  ;;
esac
