#!/usr/bin/env bash
# Certify the CUDA backend on a machine with an NVIDIA GPU: build libdeepinfer_cuda.so, run the
# conformance suite (ABI checks, every claimed op and format against the reference, bit-exact
# dequantization, streams and graph capture) and print its summary; then the decode benchmarks.
#
#   backends/cuda/certify.sh [--quick|--thorough] [--no-bench]
# Env: DI_CUDA_LIB=path (skip the build and certify that library), OUT (where the library, the
#      certificate and logs go, default backends/cuda/build), anything build.sh reads.
# The steps after the build are backends/cuda/device.sh's recipe certify (without its model checks);
# in one device call, run that recipe instead: backends/cuda/device.sh certify.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTDIR="${OUT:-$HERE/build}"
mkdir -p "$OUTDIR"
ARGS=(--no-models --bench)
for a in "$@"; do
  case "$a" in
    --quick|--thorough) ARGS+=("$a") ;;
    --no-bench) ARGS+=(--no-bench) ;;
    *) echo "certify.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

LIB="${DI_CUDA_LIB:-}"
if [[ -z "$LIB" ]]; then
  t0=$(date +%s)
  "$HERE/build.sh" "$OUTDIR" || { echo "certify.sh: build failed" >&2; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  LIB="$OUTDIR/libdeepinfer_cuda.so"
fi
OUT="$OUTDIR" DI_CUDA_LIB="$LIB" exec "$HERE/device.sh" certify "${ARGS[@]}"
