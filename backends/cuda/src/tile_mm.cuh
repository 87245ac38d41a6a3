// The tiled SIMT f32 GEMM core (64x64x16) shared by linear's generic path and moe_experts'
// fallback: any M, any alignment, any block shape, through element loaders.
#pragma once

#include "device.cuh"

namespace di {

constexpr int TB = 64, TK = 16, TPAD = 4;

// acc[i][j] += sum_k A(ty*4+i, k) * B(tx*4+j, k) over K; la/lb return 0 outside the problem.
template <class LA, class LB>
__device__ __forceinline__ void tile_mm(LA la, LB lb, int64_t K, float (&acc)[4][4], float (*As)[TB + TPAD],
                                        float (*Bs)[TB + TPAD]) {
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (int64_t k0 = 0; k0 < K; k0 += TK) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int idx = tid + 256 * i, r = idx / TK, kk = idx % TK;
            bool kin = k0 + kk < K;
            As[kk][r] = kin ? la(r, k0 + kk) : 0.f;
            Bs[kk][r] = kin ? lb(r, k0 + kk) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TK; ++kk) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
}

}  // namespace di
