// The one place the backend sources get their GPU runtime headers from. nvcc sees the CUDA headers;
// hipcc building for AMD sees backends/hip/hip_compat.h instead, which maps the cuda* names these
// sources use onto HIP. That lets a later HIP build reuse these kernels unchanged,
// the way llama.cpp shares ggml-cuda through vendors/hip.h. Do not include a vendor header directly
// from another file in this folder: it would bypass the mapping.
//
// Two parts are opt-in because only one or two translation units use them and they cost compile time
// (cub alone adds seconds to every TU) or, on HIP 5.2, do not exist at all:
//   #define DI_GPU_NEED_FP8 before the include: <cuda_fp8.h> (hardware e4m3 -> half conversions)
//   #define DI_GPU_NEED_CUB before the include: <cub/cub.cuh> (BlockScan, segmented radix sort)
//
// Deliberately no #pragma once: the base part and each opt-in part have their own guard, so a file
// that asks for fp8 still gets it when an earlier header already pulled in the base part.

#if defined(DI_GPU_HOST_EMU)

// tests/gpu_emu: device code compiled for the CPU, one emulated block of threads at a time, so the
// lane helpers and the portable sort run in CI; the test passes the emulation header's name.
#include DI_GPU_HOST_EMU

// hipcc/clang predefines __HIP__ in HIP mode; __HIP_PLATFORM_AMD__ only appears once a HIP header
// has been included (hip_common.h), i.e. not yet at this point unless the build passes it with -D.
#elif defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)

#include "../../hip/hip_compat.h"

#else  // CUDA

#ifndef DI_GPU_RUNTIME_BASE_
#define DI_GPU_RUNTIME_BASE_
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define DI_GPU_AMD 0      // the vendor, for the few host decisions that differ (device type, tensor-core paths)
#define DI_WARP_SIZE 32   // lanes per hardware warp

// Cross-lane exchange inside groups of `width` lanes (a power of two dividing the hardware warp). All
// lanes of the group take part, as every call site in this folder guarantees; device.cuh wraps these
// for the kernels (di::shfl_xor, di::shfl_up) with the kernels' group width.
template <class T>
__device__ __forceinline__ T di_shfl_xor(T v, int lane_mask, int width) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
}
template <class T>
__device__ __forceinline__ T di_shfl_up(T v, unsigned delta, int width) {
    return __shfl_up_sync(0xffffffffu, v, delta, width);
}
#endif  // DI_GPU_RUNTIME_BASE_

#if defined(DI_GPU_NEED_FP8) && !defined(DI_GPU_RUNTIME_FP8_)
#define DI_GPU_RUNTIME_FP8_
#include <cuda_fp8.h>
#endif

#if defined(DI_GPU_NEED_CUB) && !defined(DI_GPU_RUNTIME_CUB_)
#define DI_GPU_RUNTIME_CUB_
#include <cub/cub.cuh>
#endif

#endif  // vendor
