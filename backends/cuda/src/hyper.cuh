// Device code of hc_pre and hc_post (ABI 1.3, V4's hyper-connections). The host side is hyper.cu, the only translation unit
// that includes this header (its __global__ functions have external linkage); tests/gpu_emu includes
// it too and runs these very kernels on the CPU, one emulated block at a time.
#pragma once

#include "kernel_util.cuh"

namespace di {

// ---------------------------------------------------------------------------------------- hc_pre
// mix = fn @ x[t] (flattened) and sum(x[t]^2) in one pass over x, split over the flattened row so
// that a handful of tokens still fills the GPU (decode reads all of fn, 2.75 MB for V4, per call);
// then per token: the RMS factor, pre / post / comb (Sinkhorn in one thread: N*N <= 64 values) and
// out = sum_n pre[n] x[t, n].
struct HcDims {
    int64_t T, H, NH;   // NH = N * H, the flattened row
    int64_t chunk;      // columns of the flattened row per split
    int32_t N, M, splits, iters;
    float   eps, hc_eps;
};
constexpr int HC_THREADS = 256, HC_MAX_N = 8;

// part[(t * splits + split) * (M + 1) + m] = sum over the split's columns of fn[m, k] * x[t, k]
// (m < M), and at m = M the split's sum of squares. TT tokens per block share every fn load.
template <int MM, int TT>
__global__ __launch_bounds__(HC_THREADS) void k_hc_mix(DTensor x, DTensor fn, float* part, HcDims d) {
    __shared__ float red[HC_THREADS / LANES][TT * (MM + 1)];
    const int64_t t0 = (int64_t)blockIdx.x * TT;
    const int split = blockIdx.y;
    const int nt = (int)min64(TT, d.T - t0);
    const int64_t k0 = split * d.chunk, k1 = min64(d.NH, k0 + d.chunk);
    const float* f = reinterpret_cast<const float*>(fn.base);
    float acc[TT][MM + 1];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int m = 0; m <= MM; ++m) acc[tt][m] = 0.f;
    for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
        const int64_t n = k / d.H, h = k - n * d.H;
        float xv[TT];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            xv[tt] = tt < nt ? load_f(x.dt, x.base, (t0 + tt) * x.strides[0] + n * x.strides[1] + h) : 0.f;
            acc[tt][MM] += xv[tt] * xv[tt];
        }
        // a guard, not a break: a loop that can exit early is not unrolled by clang, and the
        // accumulators would then live in scratch memory on AMD
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            if (m < d.M) {
                const float w = f[m * fn.strides[0] + k];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) acc[tt][m] += w * xv[tt];
            }
        }
    }
    const int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int m = 0; m <= MM; ++m) {
            const float v = warp_sum(acc[tt][m]);
            if (lane == 0) red[w][tt * (MM + 1) + m] = v;
        }
    __syncthreads();
    for (int v = threadIdx.x; v < TT * (MM + 1); v += blockDim.x) {
        const int tt = v / (MM + 1), m = v % (MM + 1);
        if (tt >= nt || (m < MM && m >= d.M)) continue;
        float s = 0.f;
        for (int ww = 0; ww < nw; ++ww) s += red[ww][v];
        part[((t0 + tt) * d.splits + split) * (d.M + 1) + (m == MM ? d.M : m)] = s;
    }
}

// comb of one token: softmax over j of each row i of the logits z (row-major N x N), + hc_eps, then
// Sinkhorn-Knopp (columns, then rows and columns iters - 1 more times, hc_eps flooring each sum).
// One thread, N known at compile time so the matrix lives in registers: the iterations are a chain
// of dependent sums and divisions, and in local memory each step would wait on L1.
template <int N>
__device__ __forceinline__ void hc_comb(const float* z, float hc_eps, int iters, float* out) {
    float c[N * N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float mx = -INFINITY, s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) mx = fmaxf(mx, z[i * N + j]);
#pragma unroll
        for (int j = 0; j < N; ++j) {
            c[i * N + j] = expf(z[i * N + j] - mx);
            s += c[i * N + j];
        }
#pragma unroll
        for (int j = 0; j < N; ++j) c[i * N + j] = c[i * N + j] / s + hc_eps;
    }
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {   // rows (not before the first column pass)
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < N; ++j) s += c[i * N + j];
#pragma unroll
                for (int j = 0; j < N; ++j) c[i * N + j] /= s + hc_eps;
            }
        }
#pragma unroll
        for (int j = 0; j < N; ++j) {   // columns
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < N; ++i) s += c[i * N + j];
#pragma unroll
            for (int i = 0; i < N; ++i) c[i * N + j] /= s + hc_eps;
        }
    }
#pragma unroll
    for (int k = 0; k < N * N; ++k) out[k] = c[k];
}

// Per token: the partial sums of the splits, the RMS factor, then (all threads at once) the logits
// z[m] = mix[m] * r * scale[part of m] + base[m] with pre and post, then comb's Sinkhorn (one thread,
// hc_comb), and out = sum_n pre[n] x[t, n]. One block per token; N = the streams.
template <int N>
__global__ __launch_bounds__(HC_THREADS) void k_hc_finish(DTensor x, DTensor base, DTensor scale, const float* part,
                                                          DTensor out, DTensor post, DTensor comb, HcDims d) {
    constexpr int MB = (2 + N) * N;   // M of a block; the head has M = N
    __shared__ float mix[MB + 1];
    __shared__ float z[MB];           // pre [0, N) (finished), post [N, 2N), comb logits [2N, M)
    __shared__ float cm[N * N];
    for (int64_t t = blockIdx.x; t < d.T; t += gridDim.x) {
        for (int m = threadIdx.x; m <= d.M; m += blockDim.x) {
            float s = 0.f;
            for (int sp = 0; sp < d.splits; ++sp) s += part[(t * d.splits + sp) * (d.M + 1) + m];
            mix[m == d.M ? MB : m] = s;
        }
        __syncthreads();
        const float r = rsqrtf(mix[MB] / (float)d.NH + d.eps);
        for (int m = threadIdx.x; m < d.M; m += blockDim.x) {
            const int which = m < N ? 0 : m < 2 * N ? 1 : 2;   // pre, post, comb
            const float v = mix[m] * r * load_f(scale.dt, scale.base, which * scale.strides[0]) +
                            load_f(base.dt, base.base, m * base.strides[0]);
            if (which == 0) z[m] = sigmoidf_(v) + d.hc_eps;
            else if (which == 1) store_f(post.dt, post.base, t * post.strides[0] + (m - N), 2.f * sigmoidf_(v));
            else z[m] = v;
        }
        __syncthreads();
        if (d.M == MB) {   // a block: comb (the head, M = N, has pre only)
            if (threadIdx.x == 0) hc_comb<N>(z + 2 * N, d.hc_eps, d.iters, cm);
            __syncthreads();
            for (int k = threadIdx.x; k < N * N; k += blockDim.x)
                store_f(comb.dt, comb.base, t * comb.strides[0] + (k / N) * comb.strides[1] + k % N, cm[k]);
        }
        for (int64_t h = threadIdx.x; h < d.H; h += blockDim.x) {
            float o = 0.f;
#pragma unroll
            for (int n = 0; n < N; ++n) o += z[n] * load_f(x.dt, x.base, t * x.strides[0] + n * x.strides[1] + h);
            store_f(out.dt, out.base, t * out.strides[0] + h, o);
        }
        __syncthreads();   // mix, z and cm are rewritten for the next token
    }
}

// the stream counts k_hc_finish is instantiated for (1 .. HC_MAX_N): X(N) for each
#define DI_HC_STREAMS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)

// ---------------------------------------------------------------------------------------- hc_post
// out[t, k, h] = post[t, k] y[t, h] + sum_j comb[t, j, k] x[t, j, h]: a block per (token, 256
// features), post and comb of the token staged in shared memory, each thread all N outputs of one h.
__global__ __launch_bounds__(256) void k_hc_post(DTensor x, DTensor y, DTensor post, DTensor comb, DTensor out,
                                                 int64_t T, int64_t H, int N, int64_t hchunks) {
    __shared__ float pw[HC_MAX_N], cw[HC_MAX_N * HC_MAX_N];
    for (int64_t bi = blockIdx.x; bi < T * hchunks; bi += gridDim.x) {
        const int64_t t = bi / hchunks, h = (bi % hchunks) * blockDim.x + threadIdx.x;
        __syncthreads();   // the previous token's weights are no longer read
        for (int i = threadIdx.x; i < N * N; i += blockDim.x)
            cw[i] = load_f(comb.dt, comb.base, t * comb.strides[0] + (i / N) * comb.strides[1] + i % N);
        for (int i = threadIdx.x; i < N; i += blockDim.x) pw[i] = load_f(post.dt, post.base, t * post.strides[0] + i);
        __syncthreads();
        if (h >= H) continue;
        float xv[HC_MAX_N];
#pragma unroll
        for (int j = 0; j < HC_MAX_N; ++j)
            xv[j] = j < N ? load_f(x.dt, x.base, t * x.strides[0] + j * x.strides[1] + h) : 0.f;
        const float yv = load_f(y.dt, y.base, t * y.strides[0] + h);
        for (int k = 0; k < N; ++k) {
            float o = pw[k] * yv;
#pragma unroll
            for (int j = 0; j < HC_MAX_N; ++j)
                if (j < N) o += cw[j * N + k] * xv[j];
            store_f(out.dt, out.base, t * out.strides[0] + k * out.strides[1] + h, o);
        }
    }
}

}  // namespace di
