// linear's weight-streaming tensor-core path (linear_mma.cuh): the entry points linear.cu calls,
// one per weight format, each instantiated in its own linear_mma_<fmt>.cu.
#pragma once

#include "moe_mma_api.cuh"

namespace di {

// Work shapes. Decode (M <= 8 / M <= 16): a block of 4 warps owns 32 weight rows and splits K
// between its warps, 8 / 16 tokens per weight fragment. Batch (M > 16): each warp owns 32 rows,
// 64 tokens per fragment (32 for the k-step-scaled formats), blockIdx.z walks the token tiles.
enum LinShape { LIN_DECODE8, LIN_DECODE16, LIN_BATCH };
inline LinShape lin_shape(int64_t M) { return M <= 8 ? LIN_DECODE8 : M <= 16 ? LIN_DECODE16 : LIN_BATCH; }
inline int lin_rows_per_block(LinShape sh) { return sh == LIN_BATCH ? 128 : 32; }
inline int lin_warps_per_k(LinShape sh) { return sh == LIN_BATCH ? 1 : 4; }
inline int lin_tokens_per_block(LinShape sh, int f) {
    return sh == LIN_DECODE8 ? 8 : sh == LIN_DECODE16 ? 16 : moe_needs_narrow_prefill(f) ? 32 : 64;
}

// The weight: its layout and its three bases (values, scales, zeros).
struct LinWeight {
    MoeMat      m;
    const char* q;
    const char* s;
    const char* z;
};

// out[t, n] = sum_k x[t, k] w[n, k] (+ bias[n]) for t < M. x: bf16 rows of x_rs bytes, 16-byte
// aligned. splits > 1: block y takes the k-steps y, y + splits, ... and writes f32 partials
// part[y, t, n] instead (reduced by the caller in a fixed order); or, with cluster (a decode
// shape, 2 <= splits <= LIN_MAX_CLUSTER, sm_90), the blocks of a tile reduce in a cluster and
// write out themselves (part unused).
constexpr int LIN_MAX_CLUSTER = 8;   // the portable cluster size
#define DI_LINEAR_MMA_DECL(name)                                                                              \
    void launch_linear_mma_##name(LinShape sh, const LinWeight& w, const char* x, int64_t x_rs, int64_t M,   \
                                  int splits, float* part, bool cluster, const DTensor& bias, const DTensor& out, \
                                  cudaStream_t s);
DI_LINEAR_MMA_DECL(bf16)
DI_LINEAR_MMA_DECL(fp8)
DI_LINEAR_MMA_DECL(i8)
DI_LINEAR_MMA_DECL(i4)
DI_LINEAR_MMA_DECL(i4g64)
DI_LINEAR_MMA_DECL(i4g32)
DI_LINEAR_MMA_DECL(u4)
#undef DI_LINEAR_MMA_DECL

}  // namespace di
