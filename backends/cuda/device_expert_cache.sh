#!/usr/bin/env bash
# The expert cache on the GPU, in two device calls of under 10 minutes each (each builds the library
# if this machine has not yet). Everything it writes lands in $OUT (default backends/cuda/build).
#
#   backends/cuda/device_expert_cache.sh COMMIT nano
#       conformance of the MoE ops; the expert cache tests on cuda (bit-identical to the resident
#       model with and without graphs: the copy stream, events and pinned buffers for real);
#       benchmarks/bench_expert_cache.py on the embedded model (policies, decode against the H2D
#       transfer bound, cold start).
#   Env: EC_NANO_ARGS (nano's benchmark options, default "--tokens 256 --cold-repeats 3"); for v2lite
#   EC_TOKENS (64), EC_COLD (cold-start runs, 2), EC_CAPACITIES ("0.25 0.5 0.75 1.0"), EC_TIMEOUT (480),
#   EC_SOURCE (disk; host: every expert in pinned host memory, misses copied at the H2D rate).
#   backends/cuda/device_expert_cache.sh COMMIT v2lite
#       a random V2-Lite-shaped checkpoint with all 27 layers (31 GB bf16, written here), then the
#       same benchmark on it: capacities 25/50/75/100%, LRU vs LFRU + prefetch, the H2D bound measured
#       in the same run, and cold start (process start to first token) lazy against eager (measured
#       first, so a run cut short keeps it; rows are written as they come).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
COMMIT="${1:-unknown}"
PART="${2:-nano}"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
if [[ ! -f "$LIB" ]]; then
  DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > /tmp/build.log 2>&1 \
    || { tail -60 /tmp/build.log; cp /tmp/build.log "$OUT/"; exit 1; }
fi
status=0
case "$PART" in
  nano)
    echo "== conformance: moe ops"
    python3 -m deepinfer.conformance "$LIB" --ops moe_router,moe_experts --no-out > "$OUT/conformance_moe.log" 2>&1 \
      || status=1
    tail -6 "$OUT/conformance_moe.log"
    echo "== expert cache tests on cuda"
    DEEPINFER_CUDA_LIB=$LIB python3 -m pytest -q -x -p no:cacheprovider tests/test_expert_cache.py \
      tests/test_expert_cache_v4.py -k "test_bit_identical_device or test_pause_free_on_device" 2>&1 | tee "$OUT/expert_cache_tests_cuda.log" | tail -6 || status=1
    echo "== benchmark: embedded model"
    python3 benchmarks/bench_expert_cache.py --backend "$LIB" --commit "$COMMIT" --out-dir "$OUT" \
      ${EC_NANO_ARGS:---tokens 256 --cold-repeats 3} 2>&1 | tee "$OUT/bench_nano.log" | tail -45 || status=1
    ;;
  v2lite)
    echo "== a random V2-Lite shape, 27 layers"
    python3 benchmarks/_v2lite_random.py /tmp/v2lite27 --layers 27 --jobs 0 > /dev/null || exit 1
    sync     # the checkpoint's write-back would otherwise compete with the reads the benchmark times
    echo "== benchmark: V2-Lite shape"
    timeout "${EC_TIMEOUT:-480}" python3 benchmarks/bench_expert_cache.py --backend "$LIB" --model /tmp/v2lite27 \
      --commit "$COMMIT" --out-dir "$OUT" --tokens "${EC_TOKENS:-64}" --warmup 16 --cold-repeats "${EC_COLD:-2}" \
      --capacities ${EC_CAPACITIES:-0.25 0.5 0.75 1.0} --configs lru lfru+prefetch --source "${EC_SOURCE:-disk}" 2>&1 | tee "$OUT/bench_v2lite.log" \
      | tail -40 || status=1
    ;;
  *) echo "part must be nano or v2lite, not $PART"; exit 2 ;;
esac
exit $status
