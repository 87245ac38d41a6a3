// CUDA -> HIP name mapping for the shared kernels in backends/cuda/src. Included only through
// backends/cuda/src/gpu_runtime.cuh when hipcc defines __HIP_PLATFORM_AMD__; nothing else should
// include it. The pattern follows llama.cpp's ggml-cuda/vendors/hip.h: keep one source tree written
// against the CUDA names and rename them here, so a kernel fix lands on both vendors at once.
//
// Target: HIP 5.2 (what `apt-get install hipcc` gives on Debian bookworm) and newer ROCm. Where 5.2
// and ROCm 6 differ the version is tested explicitly. What HIP cannot provide stops the build with an
// #error naming the file that has to change, rather than failing deep inside a kernel.
//
// Coverage: every cuda* identifier used in backends/cuda/src must be #defined below;
// backends/hip/check_compat.sh checks that and fails when a new call is added without a mapping.
//
// Like gpu_runtime.cuh this file has no #pragma once: the base part is guarded on its own and the
// opt-in parts (DI_GPU_NEED_FP8, DI_GPU_NEED_CUB) are evaluated on every include.

#ifndef DI_HIP_COMPAT_BASE_
#define DI_HIP_COMPAT_BASE_

#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#ifndef HIP_VERSION_MAJOR
#error "hip_compat.h: HIP_VERSION_MAJOR is not defined; hip/hip_version.h is missing from this HIP install"
#endif

// ==================================================================================================
//  WARP SIZE -- READ THIS BEFORE TURNING THE HIP BUILD ON
// ==================================================================================================
// AMD CDNA GPUs (gfx90a = MI200, gfx942 = MI300) run 64-lane wavefronts; NVIDIA warps have 32 lanes.
// The CUDA kernels in backends/cuda/src still ASSUME 32 LANES: `threadIdx.x & 31`, `threadIdx.x >> 5`,
// xor-shuffle loops starting at offset 16, per-warp scratch arrays `red[32]`, `lane + 32 * r`
// striding, GEMV_WARPS / launch geometry computed from 32 (device.cuh, gemv.cuh, ops_attn.cu,
// ops_quant.cu, ops_route.cu, ops_basic.cu, ops_linear.cu).
//
// The shuffle mapping below keeps those kernels in "logical 32-lane warps" (width 32: a 64-lane
// wavefront acts as two independent halves), which is what their indexing expects. That is believed
// to give correct results for the xor reductions, but it is NOT verified on hardware, wastes half
// of each cross-lane step, and any code relying on warp-wide behaviour beyond xor shuffles (ballot,
// activemask, __syncwarp, warp-level cub) would break. Every such kernel must be audited and either
// confirmed or rewritten in terms of DI_WARP_SIZE before the HIP build is enabled.
//
// Host code needs the width for launch geometry too, and the host pass has no wavefront macro, so
// the value is fixed to 64 for the supported CDNA targets; a wave32 device pass (RDNA) would then
// disagree with the host, hence the #error.
#if defined(__HIP_PLATFORM_AMD__)
#define DI_WARP_SIZE 64
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64
#error "hip_compat.h: this device pass targets a wave32 GPU (RDNA?) but DI_WARP_SIZE is 64 on the host. The HIP build supports CDNA only: --offload-arch=gfx90a;gfx942."
#endif
#else
#define DI_WARP_SIZE 32  // HIP on the NVIDIA platform: real CUDA warps
#endif

// HIP 5.2 has no *_sync shuffles (they arrived, 64-bit-mask only, in ROCm 6.2). The 32-bit CUDA mask
// is dropped: a wavefront executes in lockstep, and every call site passes the full mask anyway.
// Width 32 keeps the shuffle inside the 32-lane half that `threadIdx.x & 31` indexes (see above).
#define __shfl_xor_sync(mask, v, lane) __shfl_xor((v), (lane), 32)

// __grid_constant__ only lets CUDA take a kernel parameter's address without a local copy; HIP
// kernel arguments already live in read-only kernarg memory, so dropping it changes nothing.
#define __grid_constant__

// ---- types ---------------------------------------------------------------------------------------
#define cudaError_t                hipError_t
#define cudaStream_t               hipStream_t
#define cudaDeviceProp             hipDeviceProp_t
#define cudaGraph_t                hipGraph_t
#define cudaGraphExec_t            hipGraphExec_t
#define cudaMemcpyKind             hipMemcpyKind
#define cudaStreamCaptureStatus    hipStreamCaptureStatus

// ---- enum values / flags -------------------------------------------------------------------------
#define cudaSuccess                                 hipSuccess
#define cudaErrorMemoryAllocation                   hipErrorOutOfMemory
#define cudaDevAttrComputeCapabilityMajor           hipDeviceAttributeComputeCapabilityMajor
#define cudaDevAttrComputeCapabilityMinor           hipDeviceAttributeComputeCapabilityMinor
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaMemcpyDeviceToDevice                    hipMemcpyDeviceToDevice
#define cudaMemcpyDeviceToHost                      hipMemcpyDeviceToHost
#define cudaMemcpyHostToDevice                      hipMemcpyHostToDevice
#define cudaStreamNonBlocking                       hipStreamNonBlocking
#define cudaStreamCaptureModeRelaxed                hipStreamCaptureModeRelaxed
#define cudaStreamCaptureStatusNone                 hipStreamCaptureStatusNone

// ---- device, errors ------------------------------------------------------------------------------
#define cudaGetDevice              hipGetDevice
#define cudaSetDevice              hipSetDevice
#define cudaGetDeviceCount         hipGetDeviceCount
#define cudaGetDeviceProperties    hipGetDeviceProperties
#define cudaDeviceGetAttribute     hipDeviceGetAttribute
#define cudaGetErrorName           hipGetErrorName
#define cudaGetErrorString         hipGetErrorString
#define cudaGetLastError           hipGetLastError
#define cudaMemGetInfo             hipMemGetInfo

// hipFuncSetAttribute takes `const void*` and, unlike the CUDA runtime, has no template overload
// accepting a kernel function pointer; C++ has no implicit function-pointer -> void* conversion.
#define cudaFuncSetAttribute(func, attr, value) \
    hipFuncSetAttribute(reinterpret_cast<const void*>(func), (attr), (value))

// ---- memory --------------------------------------------------------------------------------------
#define cudaMalloc                 hipMalloc
#define cudaFree                   hipFree
#define cudaMallocAsync            hipMallocAsync
#define cudaFreeAsync              hipFreeAsync
#define cudaMemcpyAsync            hipMemcpyAsync
#define cudaMemcpy2DAsync          hipMemcpy2DAsync
#define cudaMemsetAsync            hipMemsetAsync

// ---- events, pinned and registered host memory (ABI 1.1) --------------------------------------------
#define cudaEvent_t                          hipEvent_t
#define cudaEventCreateWithFlags             hipEventCreateWithFlags
#define cudaEventDisableTiming               hipEventDisableTiming
#define cudaEventDestroy                     hipEventDestroy
#define cudaEventRecord                      hipEventRecord
#define cudaEventQuery                       hipEventQuery
#define cudaEventSynchronize                 hipEventSynchronize
#define cudaStreamWaitEvent                  hipStreamWaitEvent
#define cudaErrorNotReady                    hipErrorNotReady
#define cudaErrorInvalidValue                hipErrorInvalidValue
#define cudaErrorNotSupported hipErrorNotSupported
#define cudaHostAlloc                        hipHostMalloc
#define cudaHostAllocPortable                hipHostMallocPortable
#define cudaFreeHost                         hipHostFree
#define cudaHostRegister                     hipHostRegister
#define cudaHostRegisterPortable             hipHostRegisterPortable
#ifdef hipHostRegisterReadOnly   // ROCm 6
#define cudaHostRegisterReadOnly             hipHostRegisterReadOnly
#else                            // HIP 5.2 cannot register a read-only mapping: the retry is a plain one
#define cudaHostRegisterReadOnly             0x0
#endif
#define cudaHostUnregister                   hipHostUnregister
#define cudaErrorHostMemoryAlreadyRegistered hipErrorHostMemoryAlreadyRegistered
#define cudaErrorHostMemoryNotRegistered     hipErrorHostMemoryNotRegistered

// ---- streams, graphs -----------------------------------------------------------------------------
#define cudaStreamCreateWithFlags  hipStreamCreateWithFlags
#define cudaStreamDestroy          hipStreamDestroy
#define cudaStreamSynchronize      hipStreamSynchronize
#define cudaStreamBeginCapture     hipStreamBeginCapture
#define cudaStreamEndCapture       hipStreamEndCapture
#define cudaStreamIsCapturing      hipStreamIsCapturing
#define cudaGraphLaunch            hipGraphLaunch
#define cudaGraphDestroy           hipGraphDestroy
#define cudaGraphExecDestroy       hipGraphExecDestroy
// CUDA 12's cudaGraphInstantiate(exec, graph, flags) is hipGraphInstantiateWithFlags; HIP's own
// hipGraphInstantiate keeps the old 5-argument (error node, log buffer) form.
#define cudaGraphInstantiate       hipGraphInstantiateWithFlags

// ---- pointer attributes --------------------------------------------------------------------------
// common.cu reads `attr.type` and compares it with cudaMemoryType{Host,Device,Managed}.
#if HIP_VERSION_MAJOR >= 6
#define cudaPointerAttributes      hipPointerAttribute_t
#define cudaPointerGetAttributes   hipPointerGetAttributes
#define cudaMemoryTypeHost         hipMemoryTypeHost
#define cudaMemoryTypeDevice       hipMemoryTypeDevice
#define cudaMemoryTypeManaged      hipMemoryTypeManaged
#else
// HIP 5.x names the field `memoryType`, has no hipMemoryTypeManaged (managed memory is only flagged
// by `isManaged`), so a small adapter presents the CUDA shape. The managed code is outside the
// hipMemoryType range so it can never equal a real memory type.
struct di_hip_pointer_attributes {
    int   type;
    int   device;
    void* devicePointer;
    void* hostPointer;
};
static constexpr int di_hip_memory_type_managed = 0x100;
static inline hipError_t di_hip_pointer_get_attributes(di_hip_pointer_attributes* out, const void* ptr) {
    hipPointerAttribute_t a;
    hipError_t e = hipPointerGetAttributes(&a, ptr);
    if (e != hipSuccess) return e;
    out->type = a.isManaged ? di_hip_memory_type_managed : (int)a.memoryType;
    out->device = a.device;
    out->devicePointer = a.devicePointer;
    out->hostPointer = a.hostPointer;
    return e;
}
#define cudaPointerAttributes      di_hip_pointer_attributes
#define cudaPointerGetAttributes   di_hip_pointer_get_attributes
#define cudaMemoryTypeHost         hipMemoryTypeHost
#define cudaMemoryTypeDevice       hipMemoryTypeDevice
#define cudaMemoryTypeManaged      di_hip_memory_type_managed
#endif

#endif  // DI_HIP_COMPAT_BASE_

// ---- opt-in: fp8 (DI_GPU_NEED_FP8) ---------------------------------------------------------------
#if defined(DI_GPU_NEED_FP8) && !defined(DI_HIP_COMPAT_FP8_)
#define DI_HIP_COMPAT_FP8_
// HIP 5.2 has no counterpart of cuda_fp8.h. Even ROCm 6's hip_fp8.h would not be a drop-in: gfx942's
// native fp8 is the FNUZ variant (bias 8, 0x80 = NaN), not the OCP e4m3fn the ABI stores, and its
// intrinsics have other names. So the HIP build needs a software e4m3 path.
#error "HIP build: backends/cuda/src/gemv.cuh decode<WF_FP8> uses cuda_fp8.h (__nv_cvt_fp8x2_to_halfraw2, __nv_fp8x2_storage_t, __NV_E4M3), which HIP 5.2 lacks. Give it a software e4m3 path under #ifdef __HIP_PLATFORM_AMD__ (di::e4m3_to_f in device.cuh already decodes OCP e4m3) before enabling the HIP build."
#endif

// ---- opt-in: cub (DI_GPU_NEED_CUB) ---------------------------------------------------------------
#if defined(DI_GPU_NEED_CUB) && !defined(DI_HIP_COMPAT_CUB_)
#define DI_HIP_COMPAT_CUB_
#if defined(__has_include)
#if !__has_include(<hipcub/hipcub.hpp>)
#error "HIP build: backends/cuda/src/ops_route.cu (moe_router, sample: cub::BlockScan, cub::DeviceSegmentedRadixSort) needs hipCUB + rocPRIM, which Debian's hipcc package does not ship. Install ROCm's hipcub-dev and rocprim-dev (or pass -I to their include dirs)."
#endif
#endif
#include <hipcub/hipcub.hpp>
namespace cub = hipcub;
#endif
