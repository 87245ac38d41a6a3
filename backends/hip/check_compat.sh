#!/usr/bin/env bash
# Static check that the CUDA sources stay shareable with the HIP build (no GPU or hipcc needed):
#   1. every cuda* runtime identifier used in backends/cuda/src has a #define in hip_compat.h;
#   2. only gpu_runtime.cuh includes vendor runtime headers directly.
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

(( fail == 0 )) && echo "check_compat: OK ($(echo "$used" | wc -l) cuda names mapped, includes centralised)"
exit $fail
