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

// hipcc/clang predefines __HIP__ in HIP mode; __HIP_PLATFORM_AMD__ only appears once a HIP header
// has been included (hip_common.h), i.e. not yet at this point unless the build passes it with -D.
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)

#include "../../hip/hip_compat.h"

#else  // CUDA

#ifndef DI_GPU_RUNTIME_BASE_
#define DI_GPU_RUNTIME_BASE_
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// Lanes per warp. The CUDA kernels are written for 32 (see backends/hip/hip_compat.h for what that
// means on AMD); new code that depends on the width should say DI_WARP_SIZE so the HIP audit finds it.
#define DI_WARP_SIZE 32
#endif  // DI_GPU_RUNTIME_BASE_

#if defined(DI_GPU_NEED_FP8) && !defined(DI_GPU_RUNTIME_FP8_)
#define DI_GPU_RUNTIME_FP8_
#include <cuda_fp8.h>
#endif

#if defined(DI_GPU_NEED_CUB) && !defined(DI_GPU_RUNTIME_CUB_)
#define DI_GPU_RUNTIME_CUB_
#include <cub/cub.cuh>
#endif

#endif  // __HIP_PLATFORM_AMD__
