#!/usr/bin/env bash
# MTP speculative decoding on the GPU, in one device call of under 10 minutes (it builds the library
# if this machine has not yet). Everything it writes lands in $OUT (default backends/cuda/build).
#
#   backends/cuda/device_speculative.sh
#       conformance of sample (with probs) and spec_verify (ABI 1.2); tests/test_speculative.py on
#       cuda (greedy output identical with speculation on and off for 50 prompts, alone and mixed;
#       the sampled distribution; the cache after rollback); benchmarks/bench_speculative.py on the
#       embedded model: batch 1, 4, 16, greedy and temperature 0.7, off / K = 1, 2, 3 / auto.
#   Env: SPEC_BENCH_ARGS (more benchmark options, after the defaults: e.g. "--repeats 2").
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
if [[ ! -f "$LIB" ]]; then
  DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > /tmp/build.log 2>&1 \
    || { tail -60 /tmp/build.log; cp /tmp/build.log "$OUT/"; exit 1; }
fi
status=0
echo "== conformance: sample, spec_verify"
python3 -m deepinfer.conformance "$LIB" --ops sample,spec_verify --no-out > "$OUT/conformance_spec.log" 2>&1 || status=1
tail -6 "$OUT/conformance_spec.log"
echo "== speculative decoding tests on cuda"
DEEPINFER_CUDA_LIB=$LIB timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py -k cuda 2>&1 \
  | tee "$OUT/speculative_tests_cuda.log" | tail -6 || status=1
echo "== benchmark: embedded model"
timeout 300 python3 benchmarks/bench_speculative.py --backend "$LIB" --precision bf16 --out "$OUT" --repeats 3 \
  ${SPEC_BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_speculative.log" | tail -40 || status=1   # the log keeps the rows of a run cut short
exit $status
