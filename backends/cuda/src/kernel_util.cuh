// Device helpers of the hyper, norm and sparse kernels (hyper.cuh, norm.cuh, sparse.cuh): integer
// min / max, the paged-cache lookups, the bitonic sort and top-k selection, and dynamic shared memory.
//
// Nothing here reads a device value on the host or allocates: every per-row length, block-table
// entry and index is read on the device, and a bad one (a hole in the block table, a sequence id
// outside it, a kv_len past the table) is skipped or clamped, never read out of bounds, because a
// device library cannot report it without a sync (abi/README.md section 8).
#pragma once

#include "device.cuh"
#include "tile_mm.cuh"

// Dynamic shared memory. The emulation has no per-launch shared memory, so it hands out one buffer
// (host_emu.h), which is all one emulated block needs.
#if defined(DI_GPU_HOST_EMU)
#define DI_DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(di_emu::dyn_smem())
#else
#define DI_DYN_SMEM(T, name)                       \
    extern __shared__ uint64_t di_v4_dyn_smem_[];  \
    T* name = reinterpret_cast<T*>(di_v4_dyn_smem_)
#endif

namespace di {

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int pow2_at_least(int64_t n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}
__device__ __forceinline__ float sigmoidf_(float v) { return 1.f / (1.f + expf(-v)); }

// ---------------------------------------------------------------------------------------- paging
// Physical block of logical block b of sequence s, or -1 for a hole: past the table's MB columns, or
// an entry outside [0, nb). Callers skip holes.
__device__ __forceinline__ int64_t page_of(const DTensor& btab, int64_t s, int64_t b, int64_t nb) {
    if (b < 0 || b >= btab.shape[1]) return -1;
    const int64_t blk = load_i(btab.dt, btab.base, s * btab.strides[0] + b);
    return blk >= 0 && blk < nb ? blk : -1;
}

// kv_len[t] clamped to [0, cap] (cap: the positions the block table can hold), and the row's
// sequence in *s_out; a row whose token_seq is no row of the table sees nothing.
__device__ __forceinline__ int64_t row_len(const DTensor& seq, const DTensor& kvl, int64_t t, int64_t S, int64_t cap,
                                           int64_t* s_out) {
    const int64_t s = load_i(seq.dt, seq.base, t * seq.strides[0]);
    int64_t len = load_i(kvl.dt, kvl.base, t * kvl.strides[0]);
    if (s < 0 || s >= S || len < 0) len = 0;
    *s_out = s;
    return min64(len, cap);
}

// ---------------------------------------------------------------------------------------- sorting
// Ascending bitonic sort of a[0, n) in shared memory, n a power of two. Every thread of the block
// calls it; it begins and ends with a barrier, so the caller may fill a[] just before and read it
// just after.
__device__ __forceinline__ void bitonic_sort_u64(uint64_t* a, int n) {
    __syncthreads();
    for (int k = 2; k <= n; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const uint64_t x = a[i], y = a[l];
                    if ((x > y) == ((i & k) == 0)) {   // ascending where bit k of i is 0
                        a[i] = y;
                        a[l] = x;
                    }
                }
            }
            __syncthreads();
        }
}

// Radix key of a score: ascending unsigned order is descending score order (-0 ranks as +0, NaN
// first, as torch.topk ranks it largest).
__device__ __forceinline__ uint32_t desc_key(float f) {
    uint32_t u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}

struct SelectSmem {
    int hist[256];
    int digit, rem, count;
    int red[MAX_WARPS];
};

// The `want` smallest composite keys (key(i) << 32 | i) over i < n: the smallest keys, ties to the
// lower i (every composite is distinct). Written to sel[0, want) in no particular order.
// An MSB-first radix select (4 passes of 8 bits over key()) finds the want-th smallest key value kth
// and how many of its copies belong to the set; a last pass in index order takes every key below kth
// and, numbered by a block scan, the first copies of kth. key() is evaluated again in each pass (it
// reads global memory, and staging n keys would need n words of shared memory). Every thread calls
// it; it ends with a barrier.
template <class KeyF>
__device__ void select_smallest(KeyF key, int64_t n, int want, uint64_t* sel, SelectSmem& sm) {
    if (want <= 0) {
        __syncthreads();
        return;
    }
    if (n <= want) {   // all of them
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sel[i] = ((uint64_t)key(i) << 32) | (uint64_t)i;
        __syncthreads();
        return;
    }
    uint32_t prefix = 0, mask = 0;
    int rem = want;   // how many of the keys matching prefix on mask are still to be taken
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) sm.hist[b] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const uint32_t k = key(i);
            if ((k & mask) == prefix) atomicAdd(&sm.hist[(k >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0, b = 0;
            for (; b < 255 && cum + sm.hist[b] < rem; ++b) cum += sm.hist[b];
            sm.digit = b;
            sm.rem = rem - cum;
        }
        __syncthreads();
        prefix |= (uint32_t)sm.digit << shift;
        mask |= 255u << shift;
        rem = sm.rem;
        __syncthreads();   // the next pass rewrites hist, digit and rem
    }
    if (threadIdx.x == 0) sm.count = 0;   // published by the first barrier of block_scan_incl
    int eq_before = 0;
    for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
        const int64_t i = i0 + threadIdx.x;
        const uint32_t k = i < n ? key(i) : 0xffffffffu;
        const bool eq = i < n && k == prefix;
        int total;
        const int rank = block_scan_incl(eq ? 1 : 0, &total, sm.red);
        if (i < n && (k < prefix || (eq && eq_before + rank <= rem)))
            sel[atomicAdd(&sm.count, 1)] = ((uint64_t)k << 32) | (uint64_t)i;
        eq_before += total;
    }
    __syncthreads();
}

}  // namespace di
