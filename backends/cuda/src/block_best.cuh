// The (value, index) order that moe_router and sample share (larger value first, ties to the lower
// index) and its block-wide reduction. moe.cu and sampling.cu (through sample_rows.cuh) both include
// it, so block_best is inline: one definition however many translation units use it.
#pragma once

#include "device.cuh"

namespace di {

// (value, index) order of sample and moe_router: larger value first, ties to the lower index.
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    return v1 > v2 || (v1 == v2 && i1 < i2);
}

// Block-wide best (value, index); redv and redi need MAX_WARPS elements of shared memory each.
__device__ inline void block_best(float& v, int& i, float* redv, int* redi) {
    const int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) {
        float v2 = shfl_xor(v, o);
        int i2 = shfl_xor(i, o);
        if (better(v2, i2, v, i)) { v = v2; i = i2; }
    }
    __syncthreads();
    if (lane == 0) { redv[w] = v; redi[w] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < nw; ++k)
            if (better(redv[k], redi[k], redv[0], redi[0])) { redv[0] = redv[k]; redi[0] = redi[k]; }
    }
    __syncthreads();
    v = redv[0];
    i = redi[0];
    __syncthreads();
}

}  // namespace di
