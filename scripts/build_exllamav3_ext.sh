#!/usr/bin/env bash
# Builds exllamav3's compiled extension for sm_90 on this (GPU-less) machine into .exl3so/exllamav3_ext.so.xz,
# which the GPU steps unpack instead of compiling it there (~6 min of a device call; here ~31 min on 2 cores).
# Needs .venv (scripts/setup.sh), nvcc and bundle part b (../shared/device/make-bundle.sh: exllamav3's sources).
# torch's CUDA headers include cusparse.h, which the toolkit here lacks and the pip wheel nvidia/cu13 carries:
# CPATH points the compilers there.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.devbundle/b/exllamav3.tar.xz
[ -f "$bundle" ] || { echo "build_exllamav3_ext: $bundle missing (run ../shared/device/make-bundle.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xJf "$bundle" -C "$work"
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CPATH="$site/nvidia/cu13/include${CPATH:+:$CPATH}" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-2} \
  TORCH_EXTENSIONS_DIR="$work/ext" PYTHONPATH="$work" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
  .venv/bin/python -c 'import exllamav3.ext'
mkdir -p .exl3so
xz -9 -T2 -c "$work/ext/exllamav3_ext/exllamav3_ext.so" >.exl3so/exllamav3_ext.so.xz
ls -l .exl3so/exllamav3_ext.so.xz
