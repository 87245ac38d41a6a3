#!/usr/bin/env bash
# Certifies, on an NVIDIA GPU, the code paths that exist for the HIP build but that CUDA normally
# skips: sample's portable block radix sort and block scan (sampling.cu without CUB). Builds
# libdeepinfer_cuda.so with DI_CUDA_NO_CUB=1 and runs the conformance suite on it; sample's cases
# (drawn shapes, ties, top-k/top-p, seeds) compare every token with the reference. One device call:
#   backends/hip/device_portable_on_cuda.sh        (results in $OUT, default backends/hip/build)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}"
DI_CUDA_NO_CUB=1 DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$ROOT/backends/cuda/build.sh" /tmp/di_cuda_nocub \
  > "$OUT/build_nocub.log" 2>&1 || { tail -50 "$OUT/build_nocub.log"; exit 1; }
python3 -m deepinfer.conformance /tmp/di_cuda_nocub/libdeepinfer_cuda.so --out "$OUT/conformance-cuda-nocub.json" \
  --force -v > "$OUT/conformance_nocub.log" 2>&1
status=$?
grep -iE 'sample|passed|failed' "$OUT/conformance_nocub.log" | tail -30
exit $status
