#!/usr/bin/env bash
# Builds libdeepinfer_cuda.so with nvcc alone (no CMake): the CI compile check and the device build.
#   backends/cuda/build.sh [OUT_DIR]            (default: backends/cuda/build)
# Env: NVCC (default nvcc), DI_CUDA_ARCHS (default "90a 80"; "80" also embeds compute_80 PTX),
#      JOBS (parallel compiles, default nproc), DI_CUDA_SANITIZE=1 (exact reads for compute-sanitizer).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${1:-$HERE/build}"
NVCC="${NVCC:-nvcc}"
ARCHS="${DI_CUDA_ARCHS:-90a 80}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$OUT/obj"

GENCODE=()
for a in $ARCHS; do
  GENCODE+=("-gencode=arch=compute_${a},code=sm_${a}")
  # the generic build also carries PTX so newer GPUs can JIT it
  [[ "$a" == 80 ]] && GENCODE+=("-gencode=arch=compute_80,code=compute_80")
done

EXTRA=()
# DI_CUDA_SANITIZE=1: exact-size element reads so compute-sanitizer memcheck runs clean (src/device.cuh)
[[ "${DI_CUDA_SANITIZE:-0}" == 1 ]] && EXTRA+=(-DDI_EXACT_LOADS -lineinfo)
FLAGS=(-std=c++17 -O3 ${EXTRA[@]+"${EXTRA[@]}"} -Xcompiler=-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Wno-unused-parameter
       -Werror=all-warnings -I"$ROOT/abi" "${GENCODE[@]}")

pids=()
for src in "$HERE"/src/*.cu; do
  obj="$OUT/obj/$(basename "${src%.cu}").o"
  "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" &
  pids+=($!)
  while (( $(jobs -rp | wc -l) >= JOBS )); do sleep 0.2; done
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
(( fail == 0 )) || { echo "build.sh: compilation failed" >&2; exit 1; }

# static cudart: the library needs only the driver at run time (no libcudart.so, no torch)
"$NVCC" -shared "${GENCODE[@]}" -cudart=static -o "$OUT/libdeepinfer_cuda.so" "$OUT"/obj/*.o -Xlinker=--no-undefined
echo "built $OUT/libdeepinfer_cuda.so"
