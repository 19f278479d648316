#!/usr/bin/env bash
# The build a kernel refactor is checked against (tests/gpu/bit_identity.py, the `kold` GPU step): the kernel library
# and the package of COMMIT, built here for sm_90 into .kold/ (git-ignored through .git/info/exclude), ready to carry.
# Usage: bash scripts/old_build.sh COMMIT        (the whole library: ~13-20 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: scripts/old_build.sh COMMIT}
grep -qx '/.kold/' .git/info/exclude 2>/dev/null || echo '/.kold/' >> .git/info/exclude
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"' EXIT
git worktree add --detach "$tree" "$commit" >/dev/null
mkdir -p .kold
PYTHONPATH=$tree .venv/bin/python -m sglang_exl3 build-kernels --arch 90 --out "$PWD/.kold/libexl3_trellis.so"
xz -9 -T2 -f .kold/libexl3_trellis.so
tar -C "$tree" -cJf .kold/pkg.tar.xz --exclude=__pycache__ sglang_exl3
echo "$commit" > .kold/COMMIT
ls -la .kold
