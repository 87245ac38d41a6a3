#!/usr/bin/env bash
# moe_experts on the GPU in one device call: build (sm_90a), the moe_experts conformance cases, the
# graph-capture test, and the kernel benchmark against the bounds and peers measured in the same run.
#   backends/cuda/device_moe.sh COMMIT [bench args...]     (writes into $OUT, default backends/cuda/build)
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
# SKIP_BUILD=1 reuses /tmp/di_cuda from an earlier call on the same (warm) machine
if [[ "${SKIP_BUILD:-0}" != 1 || ! -f /tmp/di_cuda/libdeepinfer_cuda.so ]]; then
  DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - t0 )) s"
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
echo "== conformance, moe_experts (L1)"
python3 -m deepinfer.conformance "$LIB" --ops moe_experts --level L1 --no-out -v > "$OUT/conformance_moe.log" 2>&1 || status=1
grep -E "FAIL|ERROR|error|RESULT|L1" "$OUT/conformance_moe.log" | head -40
echo "== moe_experts in a captured graph"
DEEPINFER_CUDA_LIB=$LIB python3 -m pytest -q -p no:cacheprovider tests/test_gpu_moe_experts_graph.py 2>&1 \
  | tee "$OUT/graph_test.log" | tail -15 || status=1
echo "== benchmark"
python3 "$ROOT/benchmarks/bench_gpu_kernels.py" "$LIB" --commit "$COMMIT" --out "$OUT/gpu_kernels.json" "$@" 2>&1 \
  | tee "$OUT/bench.log" || status=1
exit $status
