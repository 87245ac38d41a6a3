// A portable block-wide sort for sample (sampling.cu) where CUB is not available: the HIP build,
// and CUDA with -DDI_NO_CUB. Kept apart from the op so tests/gpu_emu runs it on the CPU.
//
// sort_row_desc: a stable LSD radix sort of one row's (probability, index) pairs by probability,
// descending. That is the order cub::DeviceSegmentedRadixSort::SortPairsDescending gives: equal keys
// keep their order, and -0.0 sorts as +0.0. One block sorts one row, in SORT_PASSES passes of
// SORT_BITS bits, ping-ponging between (k0, v0) and (k1, v1). An even number of passes leaves the
// result in (k0, v0).
//
// A pass counts the row's digits, then places the pairs a tile of blockDim.x at a time, in order. A
// pair's place among the tile's pairs of its digit comes from one block-wide prefix sum over 16
// counters, packed as 16-bit fields into four 64-bit words; a tile has at most 1024 pairs, so no field
// overflows into the next.
#pragma once

#include "device.cuh"

namespace di {

constexpr int SORT_BITS = 4, SORT_DIGITS = 1 << SORT_BITS, SORT_PASSES = 32 / SORT_BITS, SORT_THREADS = 1024;
static_assert(SORT_PASSES % 2 == 0, "the result must end in the input buffers");

struct Cnt16 {
    unsigned long long w[4];  // digit d: bits [16 * (d % 4), +16) of w[d / 4]
};

// The radix key: ascending unsigned order of the result is descending float order.
__device__ __forceinline__ uint32_t sort_key(float f) {
    uint32_t u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0;                      // -0.0 as +0.0
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);   // float order as unsigned order
    return ~u;                                        // descending
}

__device__ __forceinline__ Cnt16 warp_scan_cnt(Cnt16 v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v.w[i] = warp_scan_incl(v.w[i]);
    return v;
}

// Field d of a packed counter set (d is a run-time value: selects keep the words in registers).
__device__ __forceinline__ int cnt_field(const Cnt16& c, int d) {
    unsigned long long word = c.w[0];
#pragma unroll
    for (int q = 1; q < 4; ++q) word = d / 4 == q ? c.w[q] : word;
    return (int)((word >> (16 * (d % 4))) & 0xffffu);
}

// Sorts one row of V pairs; every thread of the block calls it (blockDim.x a multiple of LANES, at
// most SORT_THREADS).
__device__ __noinline__ void sort_row_desc(float* k0, int* v0, float* k1, int* v1, int64_t V) {
    __shared__ int hist[SORT_DIGITS], base[SORT_DIGITS];
    __shared__ Cnt16 wsum[MAX_WARPS];
    const int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
    for (int pass = 0; pass < SORT_PASSES; ++pass) {
        const int shift = pass * SORT_BITS;
        const float* ks = pass & 1 ? k1 : k0;
        const int* vs = pass & 1 ? v1 : v0;
        float* kd = pass & 1 ? k0 : k1;
        int* vd = pass & 1 ? v0 : v1;
        __syncthreads();  // the previous pass (or caller) is done with hist, base and the buffers
        if (threadIdx.x < SORT_DIGITS) hist[threadIdx.x] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
            atomicAdd(&hist[(sort_key(ks[i]) >> shift) & (SORT_DIGITS - 1)], 1);
        __syncthreads();
        if (threadIdx.x == 0) {
            int run = 0;
            for (int d = 0; d < SORT_DIGITS; ++d) {
                base[d] = run;
                run += hist[d];
            }
        }
        __syncthreads();
        for (int64_t t0 = 0; t0 < V; t0 += blockDim.x) {
            const int64_t i = t0 + threadIdx.x;
            const bool ok = i < V;
            const float kv = ok ? ks[i] : 0.f;
            const int vv = ok ? vs[i] : 0;
            const int d = ok ? (int)((sort_key(kv) >> shift) & (SORT_DIGITS - 1)) : 0;
            Cnt16 one;
#pragma unroll
            for (int q = 0; q < 4; ++q) one.w[q] = (ok && d / 4 == q) ? 1ull << (16 * (d % 4)) : 0ull;
            Cnt16 inc = warp_scan_cnt(one);
            if (lane == LANES - 1) wsum[w] = inc;
            __syncthreads();
            if (w == 0) {  // the warps' totals, scanned by the first warp
                Cnt16 s;
#pragma unroll
                for (int q = 0; q < 4; ++q) s.w[q] = lane < nw ? wsum[lane].w[q] : 0ull;
                s = warp_scan_cnt(s);
                if (lane < nw) wsum[lane] = s;
            }
            __syncthreads();
            if (w > 0)
#pragma unroll
                for (int q = 0; q < 4; ++q) inc.w[q] += wsum[w - 1].w[q];
            if (ok) {
                const int64_t dst = base[d] + cnt_field(inc, d) - 1;  // inclusive count -> place
                kd[dst] = kv;
                vd[dst] = vv;
            }
            __syncthreads();  // every thread has read base[] and wsum[]
            if (threadIdx.x < SORT_DIGITS) base[threadIdx.x] += cnt_field(wsum[nw - 1], threadIdx.x);
            __syncthreads();
        }
    }
    __syncthreads();  // the result is complete before any thread reads it
}

}  // namespace di
