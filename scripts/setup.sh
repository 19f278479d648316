#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the pinned CPU/CI stack (real sglang 0.5.17 on torch 2.11.0) and
# installs sglang-exl3 into it in editable mode.
# --no-deps everywhere: torch 2.11.0 pins nvidia-nccl-cu13==2.28.9, which the package registry does
# not serve; requirements/cpu-lock.txt resolves the whole set by hand (nccl 2.30.7 imports fine).
set -euo pipefail
cd "$(dirname "$0")/.."
py=""
for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python" /usr/bin/python3.12; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py=$(command -v "$cand"); break
  fi
done
if [ -z "$py" ] && command -v pyenv >/dev/null 2>&1; then
  v=$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | tail -1 || true)
  [ -n "$v" ] && py="$(pyenv root)/versions/$v/bin/python"
fi
[ -n "$py" ] || { echo "setup: Python 3.12 not found (install it, e.g. 'pyenv install 3.12')" >&2; exit 1; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps -r requirements/cpu-lock.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps --no-build-isolation -e .
.venv/bin/python -c 'import sglang, torch, sglang_exl3; print("setup ok: sglang", sglang.__version__, "torch", torch.__version__)'
