#!/usr/bin/env bash
# Certify the CUDA backend on a machine with an NVIDIA GPU: build libdeepinfer_cuda.so, run the
# conformance suite (ABI checks, every claimed op and format against the reference, bit-exact
# dequantization, streams and graph capture) and print its summary; then the decode benchmarks.
#
#   backends/cuda/certify.sh [--quick|--thorough] [--no-bench]
# Env: DI_CUDA_LIB=path (skip the build and certify that library), OUT (where the certificate and
#      logs go, default backends/cuda/build), anything build.sh reads.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUTDIR="${OUT:-$HERE/build}"
mkdir -p "$OUTDIR"
PROFILE=()
BENCH=1
for a in "$@"; do
  case "$a" in
    --quick|--thorough) PROFILE=("$a") ;;
    --no-bench) BENCH=0 ;;
    *) echo "certify.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

LIB="${DI_CUDA_LIB:-}"
if [[ -z "$LIB" ]]; then
  t0=$(date +%s)
  "$HERE/build.sh" "$OUTDIR" || { echo "certify.sh: build failed" >&2; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  LIB="$OUTDIR/libdeepinfer_cuda.so"
fi
# the library must need nothing but the driver and the C/C++ runtime
if ldd "$LIB" | grep -E -i "torch|python|libcudart" ; then
  echo "certify.sh: $LIB links torch, python or a shared cudart" >&2
  exit 1
fi

export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}"
status=0
python3 -m deepinfer.conformance "$LIB" ${PROFILE[@]+"${PROFILE[@]}"} --out "$OUTDIR/conformance-cuda.json" -v \
  > "$OUTDIR/conformance.log" 2>&1 || status=1
cat "$OUTDIR/conformance.log"

if [[ $BENCH -eq 1 ]]; then
  python3 "$HERE/bench.py" "$LIB" 2>&1 | tee "$OUTDIR/bench.log" || status=1
fi
exit $status
