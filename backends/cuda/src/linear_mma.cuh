// linear on tensor cores with the weights streamed straight from global memory into registers: the
// k-step machinery of moe_experts (moe_mma.cuh: 16-byte loads per lane, decode in registers,
// mma.sync m16n8k16 bf16 with f32 accumulation, scales applied exactly in f32) applied to one
// matrix. The decode shapes are memory-bound: every weight byte is read once per 8 or 16 tokens,
// and the mma does in one instruction what the GEMV did in 64 FMAs, so the quantized formats read
// fewer bytes and run faster than bf16 instead of slower.
#pragma once

#include "linear_mma_api.cuh"
#include "moe_mma.cuh"

#if DI_HAVE_MOE_MMA
#include <cooperative_groups.h>
namespace di {
namespace lin {

using namespace moe;

// CL (sm_90): the split-K blocks of an output tile form one thread-block cluster (1, splits, 1);
// each leaves its sums in shared memory and block 0 of the cluster adds them, in split order (the
// order k_gemv_reduce adds partials: the same bits), through distributed shared memory. No
// partials go through global memory and no reduce kernel follows.
template <int F, int NT, int KS, bool CL>
__global__ __launch_bounds__(128, NT == 1 ? decode_min_blocks<F>() : NT == 2 ? 4 : 1) void k_linear(
    const LinWeight wt, const char* x, int64_t x_rs, int M, int splits, float* part, DTensor bias, DTensor out) {
    __shared__ float red[KS > 1 ? (KS - 1) * 2 * NT * 4 * 32 : 1];
    __shared__ float cbuf[CL ? 2 * NT * 4 * 32 : 1];
    (void)cbuf;
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t N = wt.m.N;
    const int64_t r0 = KS > 1 ? (int64_t)blockIdx.x * 32 : ((int64_t)blockIdx.x * 4 + w) * 32;
    const int t0 = blockIdx.z * 8 * NT;
    const MoeMat m[2] = {wt.m, wt.m};
    ASrc a[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        a[i].r = r0 + 16 * i + g;
        a[i].q = wt.q + a[i].r * wt.m.ld;
        a[i].s = wt.s;
        a[i].z = wt.z;
        a[i].ok = r0 + 16 * i < N;
        src_rows(a[i], wt.m);
    }
    const char* brow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int t = t0 + n * 8 + g;
        brow[n] = t < M ? x + (int64_t)t * x_rs : nullptr;
    }
    float acc[2][NT][4] = {};
    {   // the weights never depend on an earlier kernel: ask L2 for this warp's first k-steps before
        // waiting for the activations (pdl.cuh), so the stream starts during the previous kernel's tail
        constexpr int QS = 4 * Fmt<F>::EPL, BITS = Fmt<F>::BITS;
        const int nsteps = (int)(wt.m.K / QS), stride = KS * splits;
        if (c == 0) {
            int n = 0;
            for (int st = (int)blockIdx.y * KS + (KS > 1 ? w : 0); st < nsteps && n < 8; st += stride, ++n) {
                const int64_t kb = (int64_t)st * QS * BITS / 8;
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (a[i].ok) prefetch_l2(a[i].q + 8 * h * wt.m.ld + kb);
            }
        }
    }
    pdl_wait();
    pdl_trigger();
    // k-steps interleave over the block's warps and then over the split-K blocks
    kloop<F, NT, 2>(m, a, brow, c, (int)blockIdx.y * KS + (KS > 1 ? w : 0), KS * splits, acc);
    reduce_warps<NT, KS>(acc, red);
    if constexpr (CL) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
        constexpr int V = 2 * NT * 4;
        float* f = &acc[0][0][0];
        if (w == 0) {
#pragma unroll
            for (int v = 0; v < V; ++v) cbuf[v * 32 + lane] = f[v];
        }
        cl.sync();
        if (blockIdx.y == 0 && w == 0) {
#pragma unroll
            for (int v = 0; v < V; ++v) f[v] = 0.f;
            for (int r = 0; r < splits; ++r) {
                const float* rb = cl.map_shared_rank(cbuf, r);
#pragma unroll
                for (int v = 0; v < V; ++v) f[v] += rb[v * 32 + lane];
            }
        }
        cl.sync();   // every block's cbuf stays until block 0 has read it
        if (blockIdx.y != 0 || w != 0) return;
        part = nullptr;
#else
        __trap();    // the host launches CL only on sm_90 and newer
#endif
    } else if (KS > 1 && w != 0) {
        return;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!a[i].ok) continue;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = t0 + n * 8 + 2 * c + (e & 1);
                if (t >= M) continue;
                const int64_t row = r0 + 16 * i + g + (e >> 1) * 8;
                float v = acc[i][n][e];
                if (part) {
                    part[((int64_t)blockIdx.y * M + t) * N + row] = v;
                } else {
                    if (bias.base) v += load_f(bias.dt, bias.base, row);
                    store_f(out.dt, out.base, (int64_t)t * out.strides[0] + row, v);
                }
            }
    }
}

template <int F>
void launch(LinShape sh, const LinWeight& w, const char* x, int64_t x_rs, int64_t M, int splits, float* part,
            bool cluster, const DTensor& bias, const DTensor& out, cudaStream_t s) {
    const unsigned gx = (unsigned)ceil_div(w.m.N, lin_rows_per_block(sh));
    const unsigned gz = (unsigned)ceil_div(M, lin_tokens_per_block(sh, F));
    const dim3 grid(gx, (unsigned)splits, gz);
    // cluster: the split-K blocks of a tile as clusters of (1, splits, 1), no partials
    if (cluster && sh == LIN_DECODE8) {
        launch_sm90(k_linear<F, 1, 4, true>, grid, 128, 0, s, (unsigned)splits, w, x, x_rs, (int)M, splits,
                    (float*)nullptr, bias, out);
    } else if (cluster && sh == LIN_DECODE16) {
        launch_sm90(k_linear<F, 2, 4, true>, grid, 128, 0, s, (unsigned)splits, w, x, x_rs, (int)M, splits,
                    (float*)nullptr, bias, out);
    } else if (sh == LIN_DECODE8) {
        launch_pdl(k_linear<F, 1, 4, false>, grid, 128, 0, s, w, x, x_rs, (int)M, splits, part, bias, out);
    } else if (sh == LIN_DECODE16) {
        launch_pdl(k_linear<F, 2, 4, false>, grid, 128, 0, s, w, x, x_rs, (int)M, splits, part, bias, out);
    } else if constexpr (moe_needs_narrow_prefill(F)) {
        k_linear<F, 4, 1, false><<<grid, 128, 0, s>>>(w, x, x_rs, (int)M, splits, part, bias, out);
    } else {
        k_linear<F, 8, 1, false><<<grid, 128, 0, s>>>(w, x, x_rs, (int)M, splits, part, bias, out);
    }
}

}  // namespace lin
}  // namespace di

#define DI_LINEAR_MMA_DEFINE(name, F)                                                                        \
    namespace di {                                                                                           \
    void launch_linear_mma_##name(LinShape sh, const LinWeight& w, const char* x, int64_t x_rs, int64_t M,  \
                                  int splits, float* part, bool cluster, const DTensor& bias,                \
                                  const DTensor& out, cudaStream_t s) {                                      \
        lin::launch<F>(sh, w, x, x_rs, M, splits, part, cluster, bias, out, s);                              \
    }                                                                                                        \
    }
#else
#define DI_LINEAR_MMA_DEFINE(name, F)
#endif
