// A host emulation of the few GPU runtime pieces that backends/cuda/src/device.cuh, sort_rows.cuh,
// sample_rows.cuh and the hyper / norm / sparse kernels use, so their block-level algorithms (lane groups, shuffles,
// scans, the portable sort) and the ABI 1.3 kernels run on a CPU in CI. gpu_runtime.cuh includes it
// when the test build defines DI_GPU_HOST_EMU="host_emu.h".
//
// A block is blockDim.x std::threads. __syncthreads is a barrier over all of them. A shuffle is an
// exchange through memory between two barriers of the calling thread's group of DI_WARP_SIZE lanes,
// with the width rule CUDA and HIP share: a lane whose source falls outside its aligned width-lane
// segment gets its own value. Shared memory is `static`: one emulated block runs at a time.
#pragma once

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

#define DI_GPU_AMD 0
#define DI_WARP_SIZE 32

typedef int cudaError_t;
enum { cudaSuccess = 0 };
typedef void* cudaStream_t;
struct cudaDeviceProp {
    int  major, minor, multiProcessorCount;
    char name[256];
};

namespace di_emu {

struct Dim3 {
    unsigned x, y, z;
};
inline thread_local Dim3 thread_idx{0, 0, 0};
inline Dim3 block_dim{1, 1, 1}, block_idx{0, 0, 0}, grid_dim{1, 1, 1};

constexpr int MAX_THREADS = 1024;
inline pthread_barrier_t block_bar;
inline pthread_barrier_t warp_bar[MAX_THREADS / DI_WARP_SIZE];
inline unsigned char xbuf[MAX_THREADS][8];

template <class T>
inline T exchange(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "one 8-byte slot per lane");
    const unsigned t = thread_idx.x, w = t / DI_WARP_SIZE;
    memcpy(xbuf[t], &v, sizeof(T));
    pthread_barrier_wait(&warp_bar[w]);
    T r;
    memcpy(&r, xbuf[w * DI_WARP_SIZE + src_lane], sizeof(T));
    pthread_barrier_wait(&warp_bar[w]);  // nobody overwrites a slot before every lane has read it
    return r;
}

// Runs body() as one block of `threads` threads (a multiple of DI_WARP_SIZE, at most 1024).
inline void run_block(unsigned threads, const std::function<void()>& body) {
    if (threads == 0 || threads > (unsigned)MAX_THREADS || threads % DI_WARP_SIZE)
        throw std::invalid_argument("run_block: threads must be a multiple of DI_WARP_SIZE, at most 1024");
    block_dim = {threads, 1, 1};
    pthread_barrier_init(&block_bar, nullptr, threads);
    for (unsigned w = 0; w < threads / DI_WARP_SIZE; ++w) pthread_barrier_init(&warp_bar[w], nullptr, DI_WARP_SIZE);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t)
        pool.emplace_back([t, &body] {
            thread_idx = {t, 0, 0};
            body();
        });
    for (auto& th : pool) th.join();
    pthread_barrier_destroy(&block_bar);
    for (unsigned w = 0; w < threads / DI_WARP_SIZE; ++w) pthread_barrier_destroy(&warp_bar[w]);
}

// Dynamic shared memory of the one block that runs (kernel_util.cuh's DI_DYN_SMEM): 256 KB, more
// than any GPU gives a block, so a launch the library would make always fits.
inline std::vector<uint64_t> dyn_smem_buf(1 << 15);
inline void* dyn_smem() { return dyn_smem_buf.data(); }

}  // namespace di_emu

#define threadIdx (di_emu::thread_idx)
#define blockDim (di_emu::block_dim)
#define blockIdx (di_emu::block_idx)
#define gridDim (di_emu::grid_dim)

inline void __syncthreads() { pthread_barrier_wait(&di_emu::block_bar); }

template <class T>
inline T di_shfl_xor(T v, int lane_mask, int width) {
    const int self = (int)(threadIdx.x % DI_WARP_SIZE);
    int src = self ^ lane_mask;
    if (src >= ((self + width) & ~(width - 1))) src = self;
    return di_emu::exchange(v, src);
}
template <class T>
inline T di_shfl_up(T v, unsigned delta, int width) {
    const int self = (int)(threadIdx.x % DI_WARP_SIZE);
    int src = self - (int)delta;
    if (src < (self & ~(width - 1))) src = self;
    return di_emu::exchange(v, src);
}

inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
// IEEE single operations, rounded to nearest (the test build has no FMA contraction: x86-64 without -mfma)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int atomicMin(int* p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
inline int atomicMax(int* p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
inline float __uint_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
struct __half {
    uint16_t bits;
};
inline __half __float2half_rn(float f) {
    _Float16 h = (_Float16)f;
    __half r;
    memcpy(&r.bits, &h, 2);
    return r;
}
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
using std::max;   // the device min / max overloads
using std::min;
// the vector types and the read-only load of the 16-byte paths (vec8.cuh, mla_decode_bf16.cuh)
struct __attribute__((aligned(16))) uint4 {
    uint32_t x, y, z, w;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
template <class T>
inline T __ldg(const T* p) { return *p; }
