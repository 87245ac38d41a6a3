#!/usr/bin/env bash
# DeepSeek V4 / V3.2 (ABI 1.3) on the GPU, in one device call of under 10 minutes. Everything it writes
# lands in $OUT (default backends/cuda/build).
#
#   backends/cuda/device_v4.sh
#       1. builds libdeepinfer_cuda.so for sm_90a unless this machine already has a build of exactly
#          these sources (the build directory is named after a hash of backends/cuda/src and abi/, so
#          a library left in /tmp by an earlier call for other sources is never reused);
#       2. conformance against the reference backend of the 1.3 ops and of the ops 1.3 extended:
#          hc_pre, hc_post, kv_compress, indexer_topk, sparse_attention, layernorm, mla_decode
#          (indices), moe_router (hash routing, sqrtsoftplus), moe_experts (swiglu_limit), silu_mul
#          (limit), rope (negative positions);
#       3. tests/test_model_v4.py on cuda (the MTP head included);
#       4. V3.2's model tests on cuda, and both families' MTP speculative decoding and V4's expert
#          cache (tests/test_speculative.py, tests/test_expert_cache_v4.py).
#   Env: V4_OPS (the conformance op list), V4_LIB (use this library instead of building one),
#        V4_BENCH=1 (also backends/cuda/bench_v4.py: timings at V4 shapes), V4_SAN_LIB (a sanitizer build to
#        use for V4_MEMCHECK), V4_MEMCHECK=1 (also build with exact loads, DI_CUDA_SANITIZE,
#        and run the new ops' conformance under compute-sanitizer memcheck: out-of-bounds reads of
#        paged caches and index lists show up there).
# Exit status 0 when every step passed.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
# a bare device image lacks cffi (the runtime's ABI binding): install it from carried wheels (.whl/)
python3 -c "import cffi" 2>/dev/null || { [[ -d .whl ]] && python3 -m pip install -q --no-index --find-links .whl cffi; } \
  || echo "   cffi is missing and no .whl/ holds it: carry its wheel (python3 -m pip download cffi ...)"
OPS="${V4_OPS:-hc_pre,hc_post,kv_compress,indexer_topk,sparse_attention,layernorm,mla_decode,moe_router,moe_experts,silu_mul,rope}"

# build (or reuse a build of these very sources)
build() {   # build DIR [env...]
  local dir="$1"; shift
  if [[ -f "$dir/libdeepinfer_cuda.so" ]]; then echo "== reusing $dir/libdeepinfer_cuda.so"; return 0; fi
  echo "== building $dir"
  local t0=$SECONDS
  env DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$@" "$HERE/build.sh" "$dir" > "$OUT/build_v4.log" 2>&1 \
    || { tail -60 "$OUT/build_v4.log"; rm -f "$dir/libdeepinfer_cuda.so"; return 1; }
  echo "   built in $((SECONDS - t0)) s"
}
SRC_HASH="$(cat "$HERE"/src/* "$ROOT"/abi/*.h | sha1sum | cut -c1-12)"
if [[ -n "${V4_LIB:-}" ]]; then   # a library built elsewhere from these sources (e.g. carried to the device)
  LIB="$(realpath "$V4_LIB")"; echo "== using $LIB"
else
  DIR="/tmp/di_cuda_v4_$SRC_HASH"
  build "$DIR" || exit 1
  LIB="$DIR/libdeepinfer_cuda.so"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/   GPU: /'

status=0
echo "== conformance: $OPS"
timeout 300 python3 -m deepinfer.conformance "$LIB" --ops "$OPS" --no-out > "$OUT/conformance_v4.log" 2>&1 || status=1
# the verdicts and every failure (the full log is in $OUT)
grep -E "^L[0-3] |FAIL|ERROR|Traceback" "$OUT/conformance_v4.log" | head -60
tail -1 "$OUT/conformance_v4.log"

echo "== tests/test_model_v4.py on cuda"
if [[ -f tests/test_model_v4.py ]]; then
  # DEEPINFER_TEST_BACKENDS=cuda: the model tests' backend fixture runs on the library (tests/conftest.py)
  DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB=$LIB timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_model_v4.py -k cuda 2>&1 \
    | tee "$OUT/model_v4_cuda.log" | tail -15
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
else
  echo "   tests/test_model_v4.py is not in this tree: skipped"; status=1
fi

echo "== V3.2 (oracle and published structure), and V3.2 / V4 speculative decoding and expert cache on cuda"
# test_model_oracle / test_hub_configs -k v32: V3.2's logits, greedy text and MTP head against
# transformers; test_speculative -k family: greedy identity and rollback with both families' MTP
# layers; test_expert_cache_v4 -k device: V4's streamed experts bit-identical, graphs and eager
DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB=$LIB timeout 360 python3 -m pytest -q -p no:cacheprovider \
  tests/test_model_oracle.py tests/test_hub_configs.py tests/test_speculative.py tests/test_expert_cache_v4.py \
  -k "(v32 and cuda) or (family and cuda) or test_bit_identical_device" 2>&1 \
  | tee "$OUT/families_cuda.log" | tail -15
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

if [[ "${V4_BENCH:-0}" == 1 ]]; then
  echo "== bench_v4.py"
  timeout 300 python3 "$HERE/bench_v4.py" "$LIB" --json "$OUT/bench_v4.json" 2>&1 | tee "$OUT/bench_v4.log" | tail -30
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi

if [[ "${V4_MEMCHECK:-0}" == 1 ]]; then
  SDIR="/tmp/di_cuda_v4_san_$SRC_HASH"
  [[ -n "${V4_SAN_LIB:-}" ]] && SLIB="$(realpath "$V4_SAN_LIB")" || { build "$SDIR" DI_CUDA_SANITIZE=1 && SLIB="$SDIR/libdeepinfer_cuda.so"; }
  if [[ -f "${SLIB:-}" ]] && command -v compute-sanitizer >/dev/null 2>&1; then
    echo "== compute-sanitizer memcheck: the 1.3 ops' conformance"
    timeout 420 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 86 \
      python3 -m deepinfer.conformance "$SLIB" --level L1 \
      --ops hc_pre,hc_post,kv_compress,indexer_topk,sparse_attention,layernorm,mla_decode --no-out \
      > "$OUT/memcheck_v4.log" 2>&1 || status=1
    grep -E "Invalid|ERROR SUMMARY|out of bounds" "$OUT/memcheck_v4.log" | head -20
    tail -3 "$OUT/memcheck_v4.log"
  else
    echo "   memcheck skipped (sanitizer build failed or compute-sanitizer not found)"; status=1
  fi
fi
exit $status
