#!/usr/bin/env bash
# Builds libdeepinfer_cuda.so with nvcc alone (no CMake): the CI compile check and the device build.
#   backends/cuda/build.sh [OUT_DIR]            (default: backends/cuda/build)
# Env: NVCC (default nvcc), DI_CUDA_ARCHS (default "90a 80"; "80" also embeds compute_80 PTX),
#      JOBS (parallel compiles, default nproc), DI_CUDA_SANITIZE=1 (exact reads for compute-sanitizer),
#      DI_CUDA_NO_CUB=1 (sample's portable sort and scan instead of CUB: what the HIP build runs,
#      certified here on NVIDIA; backends/hip/README.md),
#      CUTLASS_INCLUDE (CUTLASS headers; default: those of the installed nvidia-cutlass wheel).
# The sm_90a GEMM (src/gemm_sm90_*.cu) needs CUTLASS and 90a in DI_CUDA_ARCHS; without either it
# compiles to stubs and linear uses its other paths.
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
[[ "${DI_CUDA_NO_CUB:-0}" == 1 ]] && EXTRA+=(-DDI_NO_CUB)
# CUTLASS: the nvidia-cutlass wheel ships the headers under cutlass_library/source/include
CUTLASS_INCLUDE="${CUTLASS_INCLUDE:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null || true)}"
HAVE_CUTLASS=0
if [[ " $ARCHS " == *" 90a "* && -n "$CUTLASS_INCLUDE" && -f "$CUTLASS_INCLUDE/cutlass/cutlass.h" ]]; then
  HAVE_CUTLASS=1
  echo "build.sh: sm_90a GEMM with CUTLASS from $CUTLASS_INCLUDE"
else
  echo "build.sh: no CUTLASS headers (pip install nvidia-cutlass) or no 90a arch: sm_90a GEMM not built"
fi
EXTRA+=(-DDI_HAVE_CUTLASS=$HAVE_CUTLASS)

BASE=(-std=c++17 -O3 ${EXTRA[@]+"${EXTRA[@]}"} -Xcompiler=-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Wno-unused-parameter
      -Werror=all-warnings -I"$ROOT/abi")
FLAGS=("${BASE[@]}" "${GENCODE[@]}")

for src in "$HERE"/src/*.cu; do
  obj="$OUT/obj/$(basename "${src%.cu}").o"
  rm -f "$obj"   # an object left from an earlier build must not stand in for a failed compile
  case "$(basename "$src")" in
    gemm_sm90_*.cu)  # CUTLASS kernels: sm_90a only (wgmma / TMA), its headers as system headers
      if (( HAVE_CUTLASS )); then
        # NDEBUG: a device assert is a call, and a call inside the mainloop serializes wgmma (ptxas C7510)
        "$NVCC" "${BASE[@]}" -DNDEBUG --expt-relaxed-constexpr -isystem "$CUTLASS_INCLUDE" \
            -gencode=arch=compute_90a,code=sm_90a -c "$src" -o "$obj" &
      else
        "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" &
      fi ;;
    *) "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" & ;;
  esac
  while (( $(jobs -rp | wc -l) >= JOBS )); do sleep 0.2; done
done
wait
# A compile's success is its object: `wait PID` cannot be used here, since `jobs` above already
# reaps finished compiles and bash then answers "not a child of this shell" for them.
fail=0
for src in "$HERE"/src/*.cu; do
  [[ -s "$OUT/obj/$(basename "${src%.cu}").o" ]] || { echo "build.sh: $(basename "$src") did not compile" >&2; fail=1; }
done
(( fail == 0 )) || { echo "build.sh: compilation failed" >&2; exit 1; }

# static cudart: the library needs only the driver at run time (no libcudart.so, no torch)
"$NVCC" -shared "${GENCODE[@]}" -cudart=static -o "$OUT/libdeepinfer_cuda.so" "$OUT"/obj/*.o -Xlinker=--no-undefined
echo "built $OUT/libdeepinfer_cuda.so"
