#!/usr/bin/env bash
# The whole certification of libdeepinfer_hip.so on a machine with an AMD Instinct GPU (MI200 or
# MI300) and ROCm, in one command from the repository root:
#   backends/hip/certify.sh
# It builds the library (build.sh), runs the conformance suite (L0-L3: ABI behaviour, every claimed
# op and weight format against the NumPy reference, bit-exact dequantization, streams, events and
# graph capture) into a certificate, runs the model-versus-transformers oracle tests on the hip
# backend, and compares the embedded model's greedy tokens on hip with the CPU backend's.
# Everything lands in $OUT (default backends/hip/build). Exit status 0 only if every part passed.
# Env: DI_HIP_LIB=path (certify that library instead of building), DI_HIP_ARCHS, JOBS (see build.sh).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}"
status=0

command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showproductname || true

LIB="${DI_HIP_LIB:-}"
if [[ -z "$LIB" ]]; then
  "$HERE/build.sh" "$OUT" > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  LIB="$OUT/libdeepinfer_hip.so"
fi
echo "== the loader's view: the library must be usable, on a rocm device"
python3 - "$LIB" <<'PY' || { echo "certify.sh: the loader rejects $LIB, nothing else can run"; exit 1; }
import sys
from pathlib import Path
from deepinfer import loader
c = loader.probe_isolated(Path(sys.argv[1]))
print(c.summary())
sys.exit(0 if c.ok and c.device == "rocm" else 1)
PY

cmake -S "$ROOT" -B "$OUT/cpu" -DCMAKE_BUILD_TYPE=Release > /dev/null && cmake --build "$OUT/cpu" -j > /dev/null \
  || { echo "CPU backend build failed"; status=1; }
CPU_LIB="$OUT/cpu/backends/cpu/libdeepinfer_cpu.so"

echo "== conformance"
python3 -m deepinfer.conformance "$LIB" --out "$OUT/conformance-hip.json" --force -v > "$OUT/conformance.log" 2>&1 \
  || status=1
tail -40 "$OUT/conformance.log"

"$ROOT/backends/cuda/model_checks.sh" hip "$LIB" "$CPU_LIB" "$OUT" || status=1
echo "certify.sh: $([[ $status -eq 0 ]] && echo PASSED || echo FAILED) (logs and certificate in $OUT)"
exit $status
