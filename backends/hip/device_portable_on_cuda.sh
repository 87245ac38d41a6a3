#!/usr/bin/env bash
# Certifies, on an NVIDIA GPU, the code paths that exist for the HIP build but that CUDA normally
# skips: sample's portable block radix sort and block scan (sampling.cu without CUB). Builds
# libdeepinfer_cuda.so with DI_CUDA_NO_CUB=1 and runs the conformance suite on it; sample's cases
# (drawn shapes, ties, top-k/top-p, seeds) compare every token with the reference. One device call:
#   backends/hip/device_portable_on_cuda.sh        (results in $OUT, default backends/hip/build)
# It is the CUDA device runner's recipe portable: backends/cuda/device.sh portable.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/build}" exec "$HERE/../cuda/device.sh" portable "$@"
