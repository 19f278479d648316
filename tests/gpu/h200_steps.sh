#!/usr/bin/env bash
# The GPU steps (docs/gpu.md), run on the warm machine; several steps may share one `run` call:
#   bash tests/gpu/h200_steps.sh STEP [STEP ...]
# kernels   carry .kbuild [.devbundle/a1] kernel tests (torch only); unpacks bundle part a1 when carried
# oneab     carry .kbuild                 experiments/one_launch_ab.py, torch only ($ONEAB_ARGS); then
#                                         experiments/ring_ab.py when $RING_ARGS is set
# rotab     carry .kbuild                 experiments/rotation_ab.py, torch only ($ROTAB_ARGS): the rotation launches' two
#                                         forms, alone and inside the whole linear, beside bf16
# wgab      carry .kbuild                 experiments/wgmma_ab.py, torch only ($WGAB_ARGS): the x ring on wgmma against the
#                                         mma.sync ring, today's dispatch and bf16, single linears and groups
# site1     carry .devbundle/a1           unpack bundle part a1 (the tree + a1 + .kbuild exceed one call's 64 MiB)
# site2     carry .devbundle/a2           unpack bundle part a2
# sglang    carry .devbundle/b .kbuild    stage SGLang, install the package; exllamav3's extension from
#           [.exl3so]                     .exl3so/exllamav3_ext.so.xz when carried, else built in the background
#                                         (EXL3_EXT_BUILD=0: no build, for calls that do not need exllamav3)
# moetests                                MoE layer tests (routed, dense slab + fused_experts) vs the codec; every
#                                         layer of the rank-sliced / Qwen3-MoE / Mixtral models on the GPU vs its twin
# moebench  [carry .marlin]               benchmarks/moe.py --bits $MOE_BITS with exllamav3's column
#                                         (MOEBENCH_ARGS=--marlin adds SGLang's Marlin int4 MoE, prebuilt in .marlin)
# kernbench carry .marlin                 benchmarks/kernels.py --marlin on $KERNBENCH_SHAPES (default 2: 4096x14336),
#                                         then experiments/ring_ab.py when $RING_ARGS is set (may be empty)
# kold      carry .kold                 install the build a kernel refactor is checked against (scripts/old_build.sh)
# bitid-old / bitid-new                  tests/gpu/bit_identity.py: dense and MoE outputs of the old and this build on
#                                         the same inputs (record each, then compare: bit for bit)
# parity-dense / parity-moe1              serving parity of the exllamav3-made dense Llama / Qwen3-MoE alone
# parity-moe / parity-rs / parity-r7 / parity-hybrid / parity-pw / parity-moe-pw   serving parity (PARITY_BACKEND: our
#                                         kernels by default): exllamav3-made Qwen3-MoE and Mixtral; a rank-sliced
#                                         fixture; an R7 fixture; GLM-4.5 / DeepSeek-V3 hybrids (shared experts); a dense
#                                         Llama / Qwen3-MoE with piecewise prefill graphs
# embedding                               benchmarks/embedding.py: int8 / int6 embedding tables served ($EMBED_ARGS)
# spec                                    tests/gpu/spec_lossless.py: speculative decoding on an EXL3 target is lossless
#                                         (NGRAM, EAGLE, STANDALONE; $SPEC_ARGS, e.g. --algorithms EAGLE)
# spec-nextn                              tests/gpu/spec_lossless.py --algorithms NEXTN on DeepSeek-V3 / GLM-4.5 hybrids
#                                         whose last layer is written as the NextN layer ($NEXTN_ARCHS)
# spec-qwen35                             tests/gpu/spec_lossless.py --algorithms NEXTN on tiny Qwen3.5 / Qwen3.5-MoE VL models
#                                         (Gated DeltaNet) with their MTP blocks, converted by exllamav3 (--mtp_bits 4); the
#                                         writer's fixtures too with QWEN35_TARGETS="writer writer-moe"
# parity-qwen35                           serving parity of the converted targets against their twins (after spec-qwen35)
# spec-train  carry .spectexts            benchmarks/spec_models.py: train the target, the small draft and the EAGLE3 head
#                                         on the carried corpus into /tmp/specmodels ($SPEC_TRAIN_ARGS)
# spec-convert                            exllamav3's converter: target and small draft to 4 bpw; the target's bf16 twin
# spec-bench                              benchmarks/spec_decode.py on /tmp/specmodels ($SPEC_BENCH_ARGS, e.g. --only ...)
# e2e                                     benchmarks/e2e.py, Llama-3-8B shape, EXL3 $E2E_BITS against its bf16 twin
#                                         ($E2E_ARGS: more flags, e.g. --variant SGLANG_EXL3_DEV_FUSED_MAX_M=32)
# load                                    benchmarks/load.py: dense and MoE servers under sglang.benchmark.serving at
#                                         concurrency 64 with aborted streams and over-context prompts ($LOAD_ARGS)
# encode                                  benchmarks/encode.py: encoder speed; online vs exllamav3's calibrated 4 bpw on
#                                         the spec-train target (after spec-train and spec-convert; $ENCODE_ARGS)
# cartridges                              benchmarks/cartridges.py: cartridges loaded / deactivated under SGLang's load
#                                         generator with injected faults, per SGLANG_EXL3_CARTRIDGES mode ($CART_ARGS)
# e2e-moe                                 benchmarks/e2e.py on a Qwen3-30B-A3B-shaped EXL3 model (4 bpw) against a bf16
#                                         twin of random weights (--twin weightless: ~61 GB would not fit the disk)
# Each step leaves $OUT/STEP.tgz (STEP-$STEP_TAG.tgz with STEP_TAG set: the same step twice in one call, e.g.
# moebench on two shapes) with its logs and JSON, and prints a summary; stale servers are stopped first.
# Measured (fresh H200, 2026-12-02): site1/site2 ~3 s each; sglang ~5 s with the prebuilt extension; moebench
# ~50 s per bitrate (6 m values); one parity checkpoint ~3.5 min for the first server of a machine (SGLang's JIT
# and MoE prefill-graph capture: ~95 s to ready), ~2.5 min after. Budget every call under its 600 s limit.
set -uo pipefail
rm -rf /tmp/gpuout
export PYTHONUNBUFFERED=1
# The kernel library is loaded into every server process, so SGLANG_EXL3_KERNEL_LIB must name a file that only its
# owner can write, with no symlink on the way (sglang_exl3/native_paths.py): install the carried build there.
if [ -z "${SGLANG_EXL3_KERNEL_LIB:-}" ] && [ -f .kbuild/libexl3_trellis.so ]; then
  install -d -m 755 /opt/sglang-exl3 && install -m 644 .kbuild/libexl3_trellis.so /opt/sglang-exl3/
fi
export SGLANG_EXL3_KERNEL_LIB=${SGLANG_EXL3_KERNEL_LIB:-/opt/sglang-exl3/libexl3_trellis.so}
mkdir -p /tmp/site /tmp/exl3so

site_env() {  # what .devbundle/*/stage.sh exports, for calls that no longer carry the bundle
  export PYTHONPATH=/tmp/exl3so:/tmp/site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS:-16}
  export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # SGLang's JIT modules prebuilt by scripts/prebuild_jit.py (Marlin anchors), when the call carries them
  if [ -d .marlin ]; then export TVM_FFI_CACHE_DIR=$PWD/.marlin; fi
}

deep_gemm_stub() {  # for the speculative steps, which run with PYTHONPATH+=/tmp/stubs and SGLANG_ENABLE_JIT_DEEPGEMM=0
  # SGLang 0.5.17's EAGLE graph capture imports its DeepSeek sparse-attention backend, which imports deep_gemm at
  # module level (used only inside DeepSeek paths); the bundle has no deep_gemm, so an empty module stands in and
  # SGLang is told not to use it
  mkdir -p /tmp/stubs/deep_gemm &&
    echo '"""Stand-in: only imported by SGLang paths these steps never run."""' >/tmp/stubs/deep_gemm/__init__.py
}

stop_servers() {
  pkill -f sglang.launch_server 2>/dev/null && sleep 5
  pkill -9 -f sglang.launch_server 2>/dev/null
  true
}

parity() {  # NAME ARGS...: one serve_parity run into $work/NAME
  local name=$1
  shift
  stop_servers
  timeout "${PARITY_TIMEOUT:-420}" python3 tests/gpu/serve_parity.py "$work/$name" --backend "${PARITY_BACKEND:-cuda}" ${PARITY_EXTRA:+"--extra=$PARITY_EXTRA"} "$@" 2>&1 |
    tee "$work/$name.txt" | grep -v "^wrote" | tail -8
}

run_step() {
  work=/tmp/gpuout/$1${STEP_TAG:+-$STEP_TAG}  # STEP_TAG: a second run of a step in one call keeps its own tgz
  mkdir -p "$work"
  case $1 in
  kernels)
    if [ -f .devbundle/a1/site1.tar.xz ]; then tar -xJf .devbundle/a1/site1.tar.xz -C /tmp/site; fi
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$work/gpu.txt"
    PYTHONPATH=$PWD timeout "${KERNELS_TIMEOUT:-400}" python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_trellis.py \
      tests/gpu/test_codec_cuda.py tests/gpu/test_encode_cuda.py -s 2>&1 | tee "$work/pytest.txt" | tail -20
    ;;
  oneab)  # experiments/one_launch_ab.py: the one-launch linear at 4 / 8 warps, PDL on / off, against three launches
    PYTHONPATH=$PWD timeout "${ONEAB_TIMEOUT:-400}" python3 experiments/one_launch_ab.py ${ONEAB_ARGS:-} 2>&1 |
      tee "$work/oneab.txt" | grep -v "^{" | tail -6
    if [ -n "${RING_ARGS+x}" ]; then  # experiments/ring_ab.py, torch only (e.g. --shapes '' for the groups alone)
      PYTHONPATH=$PWD timeout "${RING_TIMEOUT:-300}" python3 experiments/ring_ab.py ${RING_ARGS} 2>&1 |
        tee "$work/ring.txt" | grep -v "^{" | tail -6
    fi
    cp benchmarks/results/one-launch-ab* benchmarks/results/ring-ab* "$work/" 2>/dev/null
    ;;
  rotab)  # experiments/rotation_ab.py: one warp against eight threads per 128-block, alone and in the linear
    PYTHONPATH=$PWD timeout "${ROTAB_TIMEOUT:-300}" python3 experiments/rotation_ab.py ${ROTAB_ARGS:-} 2>&1 |
      tee "$work/rotab.txt" | grep -v "^{" | tail -6
    cp benchmarks/results/rotation-ab* "$work/" 2>/dev/null
    ;;
  wgab)  # experiments/wgmma_ab.py: the x ring on wgmma against the mma.sync ring, today's dispatch and bf16
    PYTHONPATH=$PWD timeout "${WGAB_TIMEOUT:-300}" python3 experiments/wgmma_ab.py ${WGAB_ARGS:-} 2>&1 |
      tee "$work/wgab.txt" | grep -v "^{" | tail -6
    cp benchmarks/results/wgmma-ab* "$work/" 2>/dev/null
    ;;
  site1) tar -xJf .devbundle/a1/site1.tar.xz -C /tmp/site && echo "site1 unpacked" ;;
  site2) tar -xJf .devbundle/a2/site2.tar.xz -C /tmp/site && touch /tmp/site/.part_a && echo "site2 unpacked" ;;
  sglang)
    source .devbundle/b/stage.sh
    site_env
    pip install -q --no-deps --no-build-isolation --no-index . >"$work/pip.txt" 2>&1 || cat "$work/pip.txt"
    if [ -f .exl3so/exllamav3_ext.so.xz ]; then
      xz -dc .exl3so/exllamav3_ext.so.xz >/tmp/exl3so/exllamav3_ext.so && echo "exllamav3_ext: prebuilt"
    elif [ "${EXL3_EXT_BUILD:-1}" = 1 ]; then  # ~6 min, while other steps run (EXL3_EXT_BUILD=0: not needed)
      setsid nohup bash -c 'MAX_JOBS=8 python3 -c "import exllamav3" >/tmp/exl3build.log 2>&1; echo "exit $?" >>/tmp/exl3build.log' \
        >/dev/null 2>&1 &
    fi
    ;;
  moetests)
    site_env
    timeout "${MOETESTS_TIMEOUT:-540}" python3 -m pytest -q -rfE -p no:cacheprovider --durations=5 \
      tests/gpu/test_moe_cuda.py tests/test_model_vs_twin.py 2>&1 | tee "$work/pytest-moe.txt" | tail -15
    ;;
  moebench)
    site_env
    ckpt=(--ckpt-dir /tmp/moeck)
    if [ -f /tmp/exl3build.log ]; then  # the sglang step started exllamav3's build: wait for it
      for _ in $(seq 60); do grep -q "^exit" /tmp/exl3build.log && break; sleep 5; done
    elif [ ! -f /tmp/exl3so/exllamav3_ext.so ]; then  # EXL3_EXT_BUILD=0: importing exllamav3 would build it (~6 min)
      ckpt=()
      echo "moebench: no exllamav3 extension: random experts, no exllamav3 column"
    fi
    case " ${MOEBENCH_ARGS:-} " in *" --shape mixtral"*) ckpt=() ;; esac  # its checkpoints: Qwen3-30B-A3B only
    timeout "${MOEBENCH_TIMEOUT:-400}" python3 benchmarks/moe.py "${ckpt[@]}" --bits "${MOE_BITS:-4}" \
      ${MOEBENCH_ARGS:-} \
      2>&1 | tee "$work/moe.txt" | grep -v "^ROW" | tail -14
    cp benchmarks/results/moe-* "$work/" 2>/dev/null
    ;;
  moeprof)  # experiments/moe_profile.py: the MoE layer's kernels one by one, ours and bf16 ($MOEPROF_ARGS)
    site_env
    timeout "${MOEPROF_TIMEOUT:-300}" python3 experiments/moe_profile.py ${MOEPROF_ARGS:-} 2>&1 |
      tee "$work/moeprof.txt" | grep -v "^|" | tail -12
    cp benchmarks/results/moe-profile-* "$work/" 2>/dev/null
    ;;
  kernbench)  # dense linear anchors: benchmarks/kernels.py with SGLang's GPTQ-Marlin (needs .marlin; $KERNBENCH_SHAPES,
    # one or two shapes per call), then experiments/ring_ab.py ($RING_ARGS); logs and results kept in the step's tgz
    site_env
    timeout "${KERNBENCH_TIMEOUT:-300}" python3 benchmarks/kernels.py --marlin --shapes "${KERNBENCH_SHAPES:-2}" \
      --bits 4 --ms 1,8,16,32,64,128,256 --name kernels-marlin 2>&1 | tee "$work/kernels.txt" | grep -v "^ROW" | tail -14
    if [ -n "${RING_ARGS+x}" ]; then
      timeout "${RING_TIMEOUT:-300}" python3 experiments/ring_ab.py ${RING_ARGS} 2>&1 | tee "$work/ring.txt" |
        grep -v "^{" | tail -14
    fi
    cp benchmarks/results/kernels-marlin* benchmarks/results/ring-ab* "$work/" 2>/dev/null
    ;;
  kold)  # the build a kernel refactor is checked against: its library and package (carry .kold, made by
    # `scripts/old_build.sh`), installed beside the current one
    install -d -m 755 /opt/sglang-exl3-old/pkg
    xz -dc .kold/libexl3_trellis.so.xz >/tmp/libold.so && install -m 644 /tmp/libold.so /opt/sglang-exl3-old/
    tar -xJf .kold/pkg.tar.xz -C /opt/sglang-exl3-old/pkg && echo "old build installed"
    ;;
  bitid-old)  # tests/gpu/bit_identity.py record with the old build (after kold)
    PYTHONPATH=/opt/sglang-exl3-old/pkg SGLANG_EXL3_KERNEL_LIB=/opt/sglang-exl3-old/libexl3_trellis.so \
      timeout "${BITID_TIMEOUT:-300}" python3 tests/gpu/bit_identity.py record /tmp/bitid-old.safetensors 2>&1 |
      tee "$work/record.txt" | tail -3
    ;;
  bitid-new)  # the same with this checkout's build, then the comparison with bitid-old's record (same machine)
    PYTHONPATH=$PWD timeout "${BITID_TIMEOUT:-300}" python3 tests/gpu/bit_identity.py record \
      /tmp/bitid-new.safetensors 2>&1 | tee "$work/record.txt" | tail -3
    PYTHONPATH=$PWD python3 tests/gpu/bit_identity.py compare /tmp/bitid-old.safetensors /tmp/bitid-new.safetensors \
      >"$work/compare.json"
    echo "compare exit $?"
    head -c 1500 "$work/compare.json"
    ;;
  parity-dense)
    site_env
    parity dense --ckpt tiny-llama-mul1-4bpw
    ;;
  parity-moe1)  # the exllamav3-made Qwen3-MoE alone (parity-moe: with the Mixtral too)
    site_env
    parity moe1 --ckpt tiny-qwen3moe-mul1-4bpw
    ;;
  parity-moe)
    site_env
    parity moe --ckpt tiny-qwen3moe-mul1-4bpw --ckpt tiny-mixtral-mcg-3bpw
    ;;
  parity-mixtral)
    site_env
    parity mixtral --ckpt tiny-mixtral-mcg-3bpw
    ;;
  parity-rs)
    site_env
    python3 -m sglang_exl3 write-fixture /tmp/rs-qwen3moe-mcg-3bpw --arch qwen3_moe --codebook mcg --bits 3 \
      --rank-sliced-tp 1 --rotation-layout shared_h_v1 >"$work/write.txt" 2>&1 || cat "$work/write.txt"
    parity rs --ckpt /tmp/rs-qwen3moe-mcg-3bpw
    ;;
  parity-r7)  # R7 routed experts: per-projection K3/K4/K5 (gate and up of two bitrates), shared rotations, modelopt label
    site_env
    python3 -m sglang_exl3 write-fixture /tmp/r7-qwen3moe --arch qwen3_moe --codebook mcg --bits 4 --r7 \
      >"$work/write.txt" 2>&1 || cat "$work/write.txt"
    parity r7 --ckpt /tmp/r7-qwen3moe
    ;;
  embedding)  # benchmarks/embedding.py: int8 / int6 tables on a Llama-3-8B-shaped model ($EMBED_ARGS)
    site_env
    stop_servers
    timeout "${EMBED_TIMEOUT:-560}" python3 benchmarks/embedding.py --workdir /tmp/embed ${EMBED_ARGS:-} 2>&1 |
      tee "$work/embedding.txt" | grep -v "^ROW" | tail -20
    cp benchmarks/results/embedding-h[0-9]*.* /tmp/embed/*.log "$work/" 2>/dev/null
    ;;
  spec-nextn)  # the NextN layer stored in the checkpoint, served as SGLang's NEXTN draft (same stand-ins as spec)
    site_env
    stop_servers
    deep_gemm_stub
    for arch in ${NEXTN_ARCHS:-deepseek_v3 glm4_moe}; do
      rm -rf "/tmp/nextn-$arch"
      python3 -c "from sglang_exl3.synth.hf_models import make_random_hf_model as m; \
from sglang_exl3.synth.rank_sliced_writer import write_hybrid_from_hf as w; \
from sglang_exl3.synth.nextn_writer import write_nextn_from_last_layer as n; \
n(w(m('$arch', '/tmp/nextn-$arch/plain', num_hidden_layers=3, hidden_size=512), '/tmp/nextn-$arch/full'), '/tmp/nextn-$arch/mtp')" \
        >"$work/write-$arch.txt" 2>&1 || cat "$work/write-$arch.txt"
      SGLANG_ENABLE_JIT_DEEPGEMM=0 PYTHONPATH=$PYTHONPATH:/tmp/stubs timeout "${SPEC_TIMEOUT:-280}" \
        python3 tests/gpu/spec_lossless.py "$work/$arch" --target "/tmp/nextn-$arch/mtp" --algorithms NEXTN 2>&1 |
        tee "$work/spec-$arch.txt" | tail -4
    done
    ;;
  spec-qwen35)  # Qwen3.5's MTP block served as SGLang's NEXTN draft (Qwen3_5ForCausalLMMTP), EXL3 fc included
    site_env
    stop_servers
    deep_gemm_stub
    rm -rf /tmp/q35 && mkdir -p /tmp/q35
    # the VL architecture: exllamav3 writes the MTP block only for it (qwen3_5-serving-h200: the text one drops it)
    python3 -c "from sglang_exl3.synth.hf_models import make_qwen3_5_source as s; s('/tmp/q35/src', vl=True); \
s('/tmp/q35/src-moe', moe=True, vl=True); from sglang_exl3.synth.exl3_writer import write_exl3_checkpoint as w; \
w('/tmp/q35/writer', 'qwen3_5', mtp_bits=4); w('/tmp/q35/writer-moe', 'qwen3_5_moe', mtp_bits=4)" \
      >"$work/write.txt" 2>&1 || tail -5 "$work/write.txt"
    for m in "" -moe; do
      timeout 240 python3 -m exllamav3.conversion.convert_model -i "/tmp/q35/src$m" -o "/tmp/q35/exllamav3$m" \
        -w "/tmp/q35/work$m" -b 4.0 -hb 6 -cb mul1 -cr 32 -cc 512 --mtp_bits 4 >"$work/convert$m.txt" 2>&1
      echo "convert$m: exit $?"; tail -2 "$work/convert$m.txt"
      cp "/tmp/q35/exllamav3$m/config.json" "$work/exllamav3$m-config.json" 2>/dev/null
    done
    for t in ${QWEN35_TARGETS:-exllamav3 exllamav3-moe}; do
      SGLANG_ENABLE_JIT_DEEPGEMM=0 PYTHONPATH=$PYTHONPATH:/tmp/stubs timeout "${SPEC_TIMEOUT:-250}" \
        python3 tests/gpu/spec_lossless.py "$work/$t" --target "/tmp/q35/$t" --algorithms NEXTN 2>&1 |
        tee "$work/spec-$t.txt" | tail -4
    done
    ;;
  parity-qwen35)  # serving parity of the Qwen3.5 targets spec-qwen35 wrote (run after it, same machine)
    site_env
    parity qwen35 ${QWEN35_PARITY:---ckpt /tmp/q35/exllamav3 --ckpt /tmp/q35/exllamav3-moe}
    ;;
  spec-train)
    site_env
    rm -rf /tmp/spectexts && mkdir -p /tmp/spectexts && tar -xJf .spectexts/texts.tar.xz -C /tmp/spectexts
    timeout "${SPEC_TRAIN_TIMEOUT:-540}" python3 benchmarks/spec_models.py /tmp/spectexts /tmp/specmodels \
      ${SPEC_TRAIN_ARGS:-} 2>&1 | tee "$work/train.txt" | grep -v "^  step" | tail -12
    cp /tmp/specmodels/train.json /tmp/specmodels/prompts.json /tmp/specmodels/speed-bench.jsonl "$work/" 2>/dev/null
    ;;
  spec-convert)  # exllamav3's own converter (calibrated), 4 bpw, 6-bit head, mul1; the dequantized bf16 twin
    site_env
    for m in target small; do
      rm -rf "/tmp/specmodels/$m-exl3" "/tmp/specwork-$m"
      timeout 300 python3 -m exllamav3.conversion.convert_model -i "/tmp/specmodels/$m" -o "/tmp/specmodels/$m-exl3" \
        -w "/tmp/specwork-$m" -b 4.0 -hb 6 -cb mul1 -cr 64 -cc 1024 >"$work/convert-$m.txt" 2>&1
      echo "convert $m: exit $? $(du -sh "/tmp/specmodels/$m-exl3" | cut -f1)"
      python3 -m sglang_exl3 inspect "/tmp/specmodels/$m-exl3" >"$work/inspect-$m.txt" 2>&1 && sed -n 3,6p "$work/inspect-$m.txt"
    done
    rm -rf /tmp/specmodels/target-bf16
    python3 -m sglang_exl3 dequantize /tmp/specmodels/target-exl3 /tmp/specmodels/target-bf16 --dtype bfloat16 \
      --device cuda --quiet >"$work/dequantize.txt" 2>&1 && echo "twin written" || tail -5 "$work/dequantize.txt"
    ;;
  spec-bench)
    site_env
    stop_servers
    deep_gemm_stub
    SGLANG_ENABLE_JIT_DEEPGEMM=0 PYTHONPATH=$PYTHONPATH:/tmp/stubs timeout "${SPEC_BENCH_TIMEOUT:-560}" \
      python3 benchmarks/spec_decode.py /tmp/specmodels ${SPEC_BENCH_ARGS:-} 2>&1 | tee "$work/bench.txt" |
      grep -v "^ROW" | tail -40
    cp benchmarks/results/spec-decode-h[0-9]*.* /tmp/specbench/*.log /tmp/specbench/*.jsonl "$work/" 2>/dev/null
    ;;
  spec)  # tests/gpu/spec_lossless.py: NGRAM, EAGLE (random BF16 draft), STANDALONE on the exllamav3-made tiny Llama
    site_env
    stop_servers
    deep_gemm_stub
    SGLANG_ENABLE_JIT_DEEPGEMM=0 PYTHONPATH=$PYTHONPATH:/tmp/stubs timeout "${SPEC_TIMEOUT:-560}" python3 tests/gpu/spec_lossless.py "$work" --target tests/data/exllamav3/tiny-llama-mul1-4bpw \
      ${SPEC_ARGS:-} 2>&1 | tee "$work/spec.txt" | tail -12
    ;;
  parity-hybrid)  # GLM-4.5 and DeepSeek-V3 shaped hybrids (rank-sliced EXL3 experts, BF16 rest, shared experts)
    site_env
    local ckpts=()
    for arch in ${HYBRID_ARCHS:-glm4_moe deepseek_v3}; do
      ckpts+=(--ckpt "/tmp/hybrid-$arch")
      python3 -c "from sglang_exl3.synth.hf_models import make_random_hf_model as m; \
from sglang_exl3.synth.rank_sliced_writer import write_hybrid_from_hf as w; \
w(m('$arch', '/tmp/hf-$arch'), '/tmp/hybrid-$arch')" >"$work/write-$arch.txt" 2>&1 || cat "$work/write-$arch.txt"
    done
    parity hybrid "${ckpts[@]}"
    ;;
  parity-moe-pw)  # the MoE prefill plans (sorted tiles, rotated slab) inside piecewise prefill graphs
    site_env
    parity moe-pw --ckpt tiny-qwen3moe-mul1-4bpw --extra="--cuda-graph-backend-prefill tc_piecewise"
    grep -ho "cuda_graph_backend_prefill='[^']*'" "$work"/moe-pw/server-*-exl3.log | head -1
    ;;
  parity-pw)
    site_env
    parity pw --ckpt tiny-llama-mul1-4bpw --extra="--cuda-graph-backend-prefill tc_piecewise"
    grep -ho "cuda_graph_backend_prefill='[^']*'" "$work"/pw/server-*-exl3.log | head -1
    ;;
  e2e)  # Llama-3-8B-shaped EXL3 ($E2E_BITS, 4 by default) against its bf16 twin
    site_env
    stop_servers
    touch "$work/.started"
    timeout "${E2E_TIMEOUT:-540}" python3 benchmarks/e2e.py --bits "${E2E_BITS:-4}" --backend cuda --workdir /tmp/e2e \
      ${E2E_ARGS:-} 2>&1 | tee "$work/e2e.txt" | tail -20
    # every results file this run wrote (its --shape names them e2e-<shape>-*), and the servers' logs
    find benchmarks/results -name 'e2e*' -newer "$work/.started" -exec cp {} "$work/" \;
    cp /tmp/e2e/e2e-server-*.log "$work/" 2>/dev/null
    ;;
  load)
    site_env
    stop_servers
    timeout "${LOAD_TIMEOUT:-540}" python3 benchmarks/load.py --workdir /tmp/load ${LOAD_ARGS:-} 2>&1 |
      tee "$work/load.txt" | grep -v "^ROW" | tail -20
    cp benchmarks/results/load-h[0-9]*.* /tmp/load/*.log "$work/" 2>/dev/null
    ;;
  encode)  # benchmarks/encode.py: encoder tiles/s, a Llama-3-8B layer, and online vs exllamav3's calibrated 4 bpw on
    # the spec-train target (needs spec-train and spec-convert on the same machine; $ENCODE_ARGS)
    site_env
    timeout "${ENCODE_TIMEOUT:-540}" python3 benchmarks/encode.py --bf16 /tmp/specmodels/target \
      --offline /tmp/specmodels/target-exl3 --texts /tmp/spectexts ${ENCODE_ARGS:-} 2>&1 | tee "$work/encode.txt" |
      tail -20
    cp benchmarks/results/encode-h[0-9]*.* "$work/" 2>/dev/null
    ;;
  cartridges)  # benchmarks/cartridges.py: expert cartridges swapped under load with faults ($CART_ARGS, e.g. --modes)
    site_env
    stop_servers
    [ "${CART_PYTEST:-1}" = 1 ] && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cartridge_cuda.py \
      2>&1 | tee "$work/pytest-cartridge.txt" | tail -8
    timeout "${CART_TIMEOUT:-440}" python3 benchmarks/cartridges.py --workdir /tmp/cartridges ${CART_ARGS:-} 2>&1 |
      tee "$work/cartridges.txt" | grep -v "^ROW" | tail -25
    cp benchmarks/results/cartridges-h[0-9]*.* /tmp/cartridges/*.log "$work/" 2>/dev/null
    ;;
  e2e-moe)
    site_env
    stop_servers
    timeout "${E2E_TIMEOUT:-540}" python3 benchmarks/e2e.py --shape qwen3-30b-a3b --bits 4 --backend cuda \
      --twin weightless --workdir /tmp/e2e ${E2E_ARGS:-} 2>&1 | tee "$work/e2e.txt" | tail -20
    cp benchmarks/results/e2e-qwen3-30b-a3b-* "$work/" 2>/dev/null
    ;;
  *)
    echo "unknown step $1" >&2
    return 2
    ;;
  esac
}

pack_all() {
  stop_servers
  for d in /tmp/gpuout/*/; do
    [ -d "$d" ] && tar -czf "$OUT/$(basename "$d").tgz" -C /tmp/gpuout "$(basename "$d")"
  done
}
trap pack_all EXIT TERM INT

for step in "$@"; do
  echo "== $step ($(date +%T))"
  run_step "$step"
done
