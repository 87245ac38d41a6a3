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
// gpu_runtime.cuh includes it on every include of its own (that file has no #pragma once, for its
// CUDA opt-in parts); the guard below makes the repeats free.

#ifndef DI_HIP_COMPAT_BASE_
#define DI_HIP_COMPAT_BASE_

#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#ifndef HIP_VERSION_MAJOR
#error "hip_compat.h: HIP_VERSION_MAJOR is not defined; hip/hip_version.h is missing from this HIP install"
#endif

// ---- wavefronts --------------------------------------------------------------------------------
// AMD CDNA GPUs (gfx90a = MI200, gfx94x = MI300) run 64-lane wavefronts; NVIDIA warps have 32 lanes.
// The kernels cooperate in groups of di::LANES = 32 lanes on both vendors (device.cuh says why and
// how): on CDNA a wavefront holds two groups, and every cross-lane exchange goes through the two
// functions below with the group's width, so it never crosses into the other half. HIP implements a
// width-w shuffle as ds_bpermute confined to the lane's aligned w-lane segment (amd_warp_functions.h).
//
// Host code needs the width for launch geometry too, and the host pass has no wavefront macro, so
// the value is fixed to 64 for the supported CDNA targets; a wave32 device pass (RDNA) would then
// disagree with the host, hence the #error.
#if defined(__HIP_PLATFORM_AMD__)
#define DI_GPU_AMD 1
#define DI_WARP_SIZE 64
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64
#error "hip_compat.h: this device pass targets a wave32 GPU (RDNA?) but DI_WARP_SIZE is 64 on the host. The HIP build supports CDNA only: --offload-arch=gfx90a;gfx942 (or gfx940)."
#endif
#else
#error "hip_compat.h: only the AMD platform is supported (HIP_PLATFORM=amd); on NVIDIA build backends/cuda with nvcc."
#endif

// HIP 5.2 has no *_sync shuffles (they arrived, with 64-bit masks, in ROCm 6.2), and a wavefront
// executes in lockstep, so the CUDA mask has no counterpart: every call site passes all lanes.
template <class T>
__device__ inline T di_shfl_xor(T v, int lane_mask, int width) {
    return __shfl_xor(v, lane_mask, width);
}
template <class T>
__device__ inline T di_shfl_up(T v, unsigned delta, int width) {
    return __shfl_up(v, delta, width);
}

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

// ---- sm_90 launches: thread-block clusters (linear_mma.cuh) and programmatic dependent launch
// (pdl.cuh) sit in NVIDIA-only branches; these names exist so the shared sources stay one text, and
// a HIP build that reached them would fail to compile, not misbehave.
#define cudaLaunchConfig_t                                 di_nvidia_only_cudaLaunchConfig_t
#define cudaLaunchAttribute                                di_nvidia_only_cudaLaunchAttribute
#define cudaLaunchAttributeClusterDimension                di_nvidia_only_cluster_dimension
#define cudaLaunchAttributeProgrammaticStreamSerialization di_nvidia_only_programmatic_serialization
#define cudaLaunchKernelEx                                 di_nvidia_only_cudaLaunchKernelEx

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

// DI_GPU_NEED_FP8 and DI_GPU_NEED_CUB (gpu_runtime.cuh's opt-in parts) add nothing on AMD: gemv.cuh
// decodes e4m3 in software there (CDNA3's fp8 is the FNUZ variant, not the OCP e4m3fn the ABI
// stores), and sampling.cu uses its portable sort and scan instead of CUB (Debian's HIP 5.2 ships no
// hipCUB/rocPRIM).
