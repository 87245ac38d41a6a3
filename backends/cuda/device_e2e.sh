#!/usr/bin/env bash
# One device call: build libdeepinfer_cuda.so, check the attention ops and graph capture
# (conformance), the model against transformers on cuda (graph-captured decode steps), then the
# end-to-end benchmark. Everything it writes lands in $OUT (default backends/cuda/build).
#   backends/cuda/device_e2e.sh COMMIT [bench_gpu_e2e.py options...]
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
COMMIT="${1:-unknown}"; shift || true
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > /tmp/build.log 2>&1 \
  || { tail -60 /tmp/build.log; cp /tmp/build.log "$OUT/"; exit 1; }
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
status=0
echo "== conformance: attention ops, L3 streams and graphs"
python3 -m deepinfer.conformance "$LIB" --ops "${E2E_OPS:-mla_prefill,mla_decode,mla_cache_write,sample}" \
  --no-out > "$OUT/conformance_e2e.log" 2>&1 || status=1
tail -8 "$OUT/conformance_e2e.log"
if [[ "${E2E_ORACLE:-1}" == 1 ]]; then
  echo "== model-versus-oracle tests on cuda (decode steps graph-captured)"
  DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB=$LIB python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_model_oracle.py 2>&1 | tee "$OUT/model_oracle_cuda.log" | tail -6 || status=1
fi
echo "== end to end"
python3 benchmarks/bench_gpu_e2e.py "$LIB" --commit "$COMMIT" --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/e2e.log" \
  | grep -v "Writing model shards" || status=1
exit $status
