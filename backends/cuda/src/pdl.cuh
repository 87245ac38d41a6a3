// Programmatic dependent launch (sm_90): a kernel launched with launch_pdl may start while the kernel
// before it in the stream is still running; it must call pdl_wait() before it reads anything an earlier
// kernel wrote or writes anything an earlier kernel reads (every block, first thing, unless it only
// prefetches weights before). pdl_trigger() lets the next PDL kernel launch early. Both are no-ops on
// older GPUs, on AMD and for a plain launch; a captured graph keeps the programmatic edges, so a
// decode step's kernels overlap launch and prologue with their predecessor's tail.
// On by default since the H100 run of 2026-12-07 (conformance passes with it, decode B=1 3.84 -> 3.58 ms with
// the cluster reduce and the warp router); DEEPINFER_CUDA_PDL=0 turns it off (the kernels' waits stay in
// place; every launch is then a plain one).
#pragma once

#include "gpu_runtime.cuh"

#include <stdlib.h>
#include <string.h>

#include <utility>

namespace di {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !DI_GPU_AMD
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !DI_GPU_AMD
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// the L2 prefetch of a weight a kernel will read (no dependence on earlier kernels: it may precede pdl_wait)
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__) && !DI_GPU_AMD
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

#if !defined(DI_GPU_HOST_EMU)   // host launches (tests/gpu_emu runs the kernels alone)
// Whether the decode path switched by environment variable `name` is on: it is unless the variable is "0"
// (backends/cuda/README.md lists the switches). Callers keep the answer in a static: read once per process.
inline bool env_switch_on(const char* name) {
    const char* e = getenv(name);
    return !(e && !strcmp(e, "0"));
}

// whether launch_pdl adds the attribute: the current device is sm_90 or newer and it is not turned off
inline bool pdl_on() {
#if DI_GPU_AMD
    return false;
#else
    static const bool on = env_switch_on("DEEPINFER_CUDA_PDL");
    if (!on) return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        return false;
    return major >= 9;
#endif
}

// kernel<<<grid, block, smem, s>>>(args...) with the sm_90 launch attributes: programmatic stream
// serialization where pdl_on(), and thread-block clusters of (1, cluster_y, 1) when cluster_y > 1
// (the caller checked the GPU has them). Errors surface through cudaGetLastError as for <<<>>>.
template <class... P, class... A>
inline void launch_sm90(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, unsigned cluster_y,
                        A&&... args) {
#if DI_GPU_AMD
    (void)cluster_y;
    kernel<<<grid, block, smem, s>>>(std::forward<A>(args)...);
#else
    const bool pdl = pdl_on();
    if (!pdl && cluster_y <= 1) {
        kernel<<<grid, block, smem, s>>>(std::forward<A>(args)...);
        return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[2];
    unsigned n = 0;
    if (cluster_y > 1) {
        at[n].id = cudaLaunchAttributeClusterDimension;
        at[n].val.clusterDim.x = 1;
        at[n].val.clusterDim.y = cluster_y;
        at[n].val.clusterDim.z = 1;
        ++n;
    }
    if (pdl) {
        at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[n].val.programmaticStreamSerializationAllowed = 1;
        ++n;
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
    (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
#endif
}

// kernel<<<grid, block, smem, s>>>(args...), a programmatic dependent launch where pdl_on()
template <class... P, class... A>
inline void launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A&&... args) {
    launch_sm90(kernel, grid, block, smem, s, 1u, std::forward<A>(args)...);
}

#endif  // !DI_GPU_HOST_EMU

}  // namespace di
