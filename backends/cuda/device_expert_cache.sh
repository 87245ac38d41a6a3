#!/usr/bin/env bash
# The expert cache on the GPU in one device call: build libdeepinfer_cuda.so, conformance of the MoE
# ops, the expert cache tests on cuda (bit-identical to the resident model, the device path's copy
# stream and events for real), then benchmarks/bench_expert_cache.py on the embedded model and on a
# random V2-Lite-shaped checkpoint with all 27 layers (31 GB bf16, written here; it does not fit a
# smaller GPU's budget of the run, which is the point): capacities 25-100%, LRU vs LFRU + prefetch,
# the H2D transfer bound measured in the same run, and cold start lazy vs eager.
# Everything it writes lands in $OUT (default backends/cuda/build).
#   backends/cuda/device_expert_cache.sh COMMIT
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
COMMIT="${1:-unknown}"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > /tmp/build.log 2>&1 \
  || { tail -60 /tmp/build.log; cp /tmp/build.log "$OUT/"; exit 1; }
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
status=0
echo "== conformance: moe ops"
python3 -m deepinfer.conformance "$LIB" --ops moe_router,moe_experts --no-out > "$OUT/conformance_moe.log" 2>&1 \
  || status=1
tail -6 "$OUT/conformance_moe.log"
echo "== expert cache tests on cuda"
DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB=$LIB python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_expert_cache.py -k test_bit_identical_device 2>&1 | tee "$OUT/expert_cache_tests_cuda.log" | tail -6 || status=1
echo "== benchmark: embedded model"
python3 benchmarks/bench_expert_cache.py --backend "$LIB" --commit "$COMMIT" --out-dir "$OUT" --tokens 256 \
  --cold-repeats 3 2>&1 | tail -40 || status=1
if [[ "${EC_V2LITE:-1}" == 1 ]]; then
  echo "== benchmark: V2-Lite shape, 27 layers"
  python3 benchmarks/_v2lite_random.py /tmp/v2lite27 --layers 27 > /dev/null || status=1
  python3 benchmarks/bench_expert_cache.py --backend "$LIB" --model /tmp/v2lite27 --commit "$COMMIT" \
    --out-dir "$OUT" --tokens "${EC_TOKENS:-96}" --warmup 16 --cold-repeats 2 2>&1 | tail -40 || status=1
fi
exit $status
