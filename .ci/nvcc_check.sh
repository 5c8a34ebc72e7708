#!/usr/bin/env bash
# Compile-check every csrc/*.cu for Hopper (sm_90a) and Ampere (sm_80), warnings as errors.
# The kernels are not run here (no GPU); their arithmetic is shared with the C++ CPU extension
# through csrc/*.cuh, which the tests do run.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then
  echo "nvcc-check: nvcc not found; skipping the CUDA compile check"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
n=0
for cu in csrc/*.cu; do
  [ -e "$cu" ] || continue
  for arch in sm_90a sm_80; do
    "$NVCC" -std=c++17 -arch="$arch" -Icsrc -c "$cu" -o "$out/$(basename "$cu" .cu)_$arch.o" \
      -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
    n=$((n + 1))
  done
  echo "nvcc-check: $cu OK (sm_90a, sm_80)"
done
echo "nvcc-check: $n compilations passed with $("$NVCC" --version | tail -1)"
