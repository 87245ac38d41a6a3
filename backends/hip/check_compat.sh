#!/usr/bin/env bash
# Static check that the CUDA sources stay shareable with the HIP build (no GPU or hipcc needed):
#   1. every cuda* runtime identifier used in backends/cuda/src has a #define in hip_compat.h;
#   2. only gpu_runtime.cuh includes vendor runtime headers directly;
#   3. no kernel depends on the hardware warp width: no raw shuffles, votes or lane masks outside
#      gpu_runtime.cuh, and no lane arithmetic written with 32 (device.cuh: say LANES, lane_id(),
#      warp_id()). Exempt: the mma.sync kernels, which are NVIDIA-only (DI_HAVE_MOE_MMA is 0 on AMD)
#      and whose fragment layout is the 32-lane warp by definition.
# Exit 1 with the offending names/lines otherwise. Run: backends/hip/check_compat.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$HERE/../cuda/src"
COMPAT="$HERE/hip_compat.h"
fail=0

# Line comments are stripped first so prose that mentions an API does not demand a mapping.
used=$(sed 's://.*$::' "$SRC"/*.cu "$SRC"/*.cuh | grep -o '\bcuda[A-Z][A-Za-z0-9_]*' | sort -u)
defined=$(grep -oE '^[[:space:]]*#[[:space:]]*define[[:space:]]+cuda[A-Za-z0-9_]+' "$COMPAT" \
          | awk '{print $NF}' | sort -u)
missing=$(comm -23 <(echo "$used") <(echo "$defined"))
if [[ -n "$missing" ]]; then
    echo "check_compat: cuda names used in backends/cuda/src without a mapping in backends/hip/hip_compat.h:" >&2
    echo "$missing" | sed 's/^/  /' >&2
    fail=1
fi

direct=$(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*<(cuda_|cub/|hip/|hipcub/|cuda\.h)' \
         "$SRC"/*.cu "$SRC"/*.cuh | grep -v '/gpu_runtime\.cuh:' || true)
if [[ -n "$direct" ]]; then
    echo "check_compat: vendor headers must come through gpu_runtime.cuh, found direct includes:" >&2
    echo "$direct" | sed 's/^/  /' >&2
    fail=1
fi

MMA_ONLY='/(moe_mma|linear_mma)\.cuh:'
warpisms=$(grep -nE '__shfl|__ballot|__activemask|__syncwarp|__match_(any|all)|__(any|all|uni)_sync|__reduce_[a-z]+_sync' \
           "$SRC"/*.cu "$SRC"/*.cuh | grep -v '/gpu_runtime\.cuh:' | grep -vE ':[0-9]+:\s*//' || true)
lanes32=$(grep -nE '(threadIdx\.x|\btid)\s*(&\s*31|>>\s*5|%\s*32|/\s*32)\b|\blane\s*==\s*31\b|\blane\s*\+\s*32\b' \
          "$SRC"/*.cu "$SRC"/*.cuh | grep -vE "$MMA_ONLY" | grep -vE ':[0-9]+:\s*//' || true)
if [[ -n "$warpisms$lanes32" ]]; then
    echo "check_compat: code that assumes a 32-lane hardware warp (AMD wavefronts have 64 lanes); use di::shfl_xor," >&2
    echo "  di::shfl_up, lane_id(), warp_id() and LANES from device.cuh:" >&2
    printf '%s\n' "$warpisms" "$lanes32" | sed '/^$/d; s/^/  /' >&2
    fail=1
fi

(( fail == 0 )) && echo "check_compat: OK ($(echo "$used" | wc -l) cuda names mapped, includes centralised, no warp-width assumptions)"
exit $fail
