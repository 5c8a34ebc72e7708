#!/usr/bin/env bash
# Compile every GPU kernel for sm_80 and sm_90 as the runtime compiles it, without a GPU
# (docs/cpu-twins.md): csrc/*.cu through cupy's NVRTC call with the loader's options, and every
# registered Triton kernel through Triton's compiler on the venv's Triton (the newest supported)
# and on the oldest supported one, installed beside the venv in $OVERLAP_CACHE_DIR (where
# tests/test_gpu_compile.py finds it again). Needs the test extra (cupy, NVRTC). nvcc_check.sh
# stays: it adds warnings as errors, which NVRTC does not check.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
oldest=$(sed -n 's/^OLDEST_TRITON = "\([0-9.]*\)".*/\1/p' tests/test_gpu_compile.py)
[ -n "$oldest" ] || { echo "gpu-compile: no OLDEST_TRITON in tests/test_gpu_compile.py"; exit 1; }
cache=${OVERLAP_CACHE_DIR:-$HOME/.cache/overlap}
old_triton="$cache/triton-$oldest"
if [ ! -f "$old_triton/triton/__init__.py" ]; then
  mkdir -p "$cache"
  staging=$(mktemp -d "$old_triton.XXXX")
  python -m pip install --quiet --no-deps --target "$staging" "triton==$oldest"
  mv "$staging" "$old_triton" 2>/dev/null || rm -rf "$staging"  # a concurrent install won
fi
t1=$(date +%s)
python -m overlap.kernels.compile_check --nvrtc --arch 80,90
# The two Triton releases side by side, one per core; each prints its lines when done.
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python -m overlap.kernels.compile_check --triton --arch 80,90 > "$out/newest" 2>&1 & newest=$!
PYTHONPATH="$old_triton${PYTHONPATH:+:$PYTHONPATH}" \
  python -m overlap.kernels.compile_check --triton --arch 80,90 > "$out/oldest" 2>&1 & older=$!
rc=0
wait "$newest" || rc=1
wait "$older" || rc=1
grep -v "UserWarning\|warn_once" "$out/newest" "$out/oldest" | sed 's/^[^:]*://'
echo "gpu-compile: $([ $rc = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - t0 ))s" \
  "(installing triton $oldest: $(( t1 - t0 ))s)"
exit $rc
