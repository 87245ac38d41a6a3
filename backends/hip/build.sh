#!/usr/bin/env bash
# Builds libdeepinfer_hip.so for AMD Instinct GPUs from the CUDA backend's sources (backends/cuda/src,
# through hip_compat.h) with hipcc alone (no CMake): the CI compile check and the AMD machine's build.
#   backends/hip/build.sh [OUT_DIR]            (default: backends/hip/build)
# Env: HIPCC (default hipcc), DI_HIP_ARCHS (default "gfx90a gfx942": MI200 and MI300; when the compiler
#      does not know gfx942, as Debian's HIP 5.2 clang-15 does not, gfx940 is built in its place),
#      JOBS (parallel compiles, default nproc).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${1:-$HERE/build}"
HIPCC="${HIPCC:-hipcc}"
JOBS="${JOBS:-$(nproc)}"
# hipcc picks the NVIDIA platform when it finds nvcc; this build is for AMD
export HIP_PLATFORM=amd

command -v "$HIPCC" >/dev/null 2>&1 || {
  echo "build.sh: $HIPCC not found: install HIP (Debian/Ubuntu: apt-get install hipcc; or ROCm) or set HIPCC" >&2
  exit 1
}

# the targets this compiler can build
probe_src="$(mktemp --suffix=.hip)"
trap 'rm -f "$probe_src" "$probe_src.o"' EXIT
printf '#include <hip/hip_runtime.h>\n__global__ void k(int* p) { *p = 1; }\n' > "$probe_src"
knows() { "$HIPCC" -x hip --offload-arch="$1" -c "$probe_src" -o "$probe_src.o" >/dev/null 2>&1; }
ARCHS=()
for a in ${DI_HIP_ARCHS:-gfx90a gfx942}; do
  if knows "$a"; then ARCHS+=("$a")
  elif [[ "$a" == gfx942 ]] && knows gfx940; then
    echo "build.sh: this compiler does not know gfx942; building gfx940 (MI300's first target) instead"
    ARCHS+=(gfx940)
  else
    echo "build.sh: this compiler cannot build --offload-arch=$a" >&2
    exit 1
  fi
done
echo "build.sh: HIP $("$HIPCC" --version 2>/dev/null | sed -n 's/^HIP version: //p'), targets ${ARCHS[*]}"

mkdir -p "$OUT/obj"
OFFLOAD=()
for a in "${ARCHS[@]}"; do OFFLOAD+=("--offload-arch=$a"); done
# DI_HIP_TARGETS: the library's score() rejects a GPU it has no code object for, with a reason.
# -Wno-pass-failed: an unroll pragma clang cannot honour is a lost hint, not an error.
FLAGS=(-x hip -std=c++17 -O3 -fPIC -fvisibility=hidden "${OFFLOAD[@]}" "-DDI_HIP_TARGETS=\"${ARCHS[*]}\""
       -Wall -Wextra -Wno-unused-parameter -Wno-unused-command-line-argument -Wno-pass-failed -Werror -I"$ROOT/abi")

for src in "$ROOT"/backends/cuda/src/*.cu; do
  obj="$OUT/obj/$(basename "${src%.cu}").o"
  rm -f "$obj"   # an object left from an earlier build must not stand in for a failed compile
  "$HIPCC" "${FLAGS[@]}" -c "$src" -o "$obj" &
  while (( $(jobs -rp | wc -l) >= JOBS )); do sleep 0.2; done
done
wait
# A compile's success is its object (as in backends/cuda/build.sh: `wait PID` fails for compiles
# that `jobs` has already reaped).
fail=0
for src in "$ROOT"/backends/cuda/src/*.cu; do
  [[ -s "$OUT/obj/$(basename "${src%.cu}").o" ]] || { echo "build.sh: $(basename "$src") did not compile" >&2; fail=1; }
done
(( fail == 0 )) || { echo "build.sh: compilation failed" >&2; exit 1; }

# -ldl: RCCL is dlopen'ed at run time (backends/cuda/src/dist.cu), never linked; glibc before 2.34 keeps dlopen in libdl
"$HIPCC" -shared -fPIC "${OFFLOAD[@]}" -Wno-unused-command-line-argument -o "$OUT/libdeepinfer_hip.so" \
    "$OUT"/obj/*.o -Wl,--no-undefined -ldl
echo "built $OUT/libdeepinfer_hip.so"
