#!/usr/bin/env bash
# linear on the GPU in one device call: build (sm_90a, with the CUTLASS GEMM), the linear conformance
# cases (default and thorough profiles), the kernel benchmark against the bounds and peers measured
# in the same run, and the per-op profile of an end-to-end prefill.
#   backends/cuda/device_linear.sh COMMIT [bench args...]     (writes into $OUT, default backends/cuda/build)
# Env: BENCH_BUDGET_S (seconds the kernel benchmark may start new shapes in, default 330),
#      SKIP_BUILD=1 (reuse /tmp/di_cuda on a warm machine), SKIP_PROFILE=1, PROFILE_ARGS (extra
#      arguments of bench_gpu_prefill_profile.py).
# The full certification (every op, L0-L3) is device_certify.sh.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
COMMIT="${1:-unknown}"; shift || true
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
status=0
t0=$(date +%s)
if [[ "${SKIP_BUILD:-0}" != 1 || ! -f /tmp/di_cuda/libdeepinfer_cuda.so ]]; then
  DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > /tmp/di_build.log 2>&1 \
    || { tail -50 /tmp/di_build.log; exit 1; }
  grep "build.sh:" /tmp/di_build.log
fi
echo "build: $(( $(date +%s) - t0 )) s"
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
echo "== conformance, linear (L1, default and thorough)"
for prof in "" --thorough; do
  python3 -m deepinfer.conformance "$LIB" --ops linear --level L1 --no-out -v $prof > "$OUT/conformance_linear${prof:+_thorough}.log" 2>&1 || status=1
  grep -E "FAIL|ERROR|RESULT|^L1" "$OUT/conformance_linear${prof:+_thorough}.log" | head -30
done
echo "== kernel benchmark ($(( $(date +%s) - t0 )) s)"
python3 "$ROOT/benchmarks/bench_gpu_linear.py" "$LIB" --commit "$COMMIT" --out "$OUT/gpu_linear.json" \
  --budget-s "${BENCH_BUDGET_S:-330}" "$@" 2>&1 | tee "$OUT/bench_linear.log" | grep -v "^$" || status=1
if [[ "${SKIP_PROFILE:-0}" != 1 && -f "$ROOT/benchmarks/bench_gpu_prefill_profile.py" ]]; then
  echo "== end-to-end prefill profile ($(( $(date +%s) - t0 )) s)"
  python3 "$ROOT/benchmarks/bench_gpu_prefill_profile.py" "$LIB" --commit "$COMMIT" --out "$OUT/prefill_profile.json" \
    ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/prefill_profile.log" | tail -60 || status=1
fi
echo "total: $(( $(date +%s) - t0 )) s"
exit $status
