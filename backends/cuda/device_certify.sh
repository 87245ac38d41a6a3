#!/usr/bin/env bash
# The whole certification of the CUDA backend in one device call: build, conformance (L0-L3, the
# certificate), the model-versus-oracle tests on cuda, and the embedded model's greedy tokens on
# cuda against the CPU backend. Everything it writes lands in $OUT (default backends/cuda/build).
#   backends/cuda/device_certify.sh
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
status=0
DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
CUDA_LIB=/tmp/di_cuda/libdeepinfer_cuda.so
cmake -S "$ROOT" -B /tmp/di_cpu -DCMAKE_BUILD_TYPE=Release > /dev/null && cmake --build /tmp/di_cpu -j16 > /dev/null \
  || { echo "CPU backend build failed"; status=1; }
CPU_LIB=/tmp/di_cpu/backends/cpu/libdeepinfer_cpu.so
DI_CUDA_LIB=$CUDA_LIB OUT="$OUT" "$HERE/certify.sh" --no-bench || status=1
"$HERE/model_checks.sh" cuda "$CUDA_LIB" "$CPU_LIB" "$OUT" || status=1
exit $status
