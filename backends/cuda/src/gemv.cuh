// The GEMV kernel of linear (M <= 8), templated on the weight format. Each format is instantiated in
// its own translation unit (gemv_<fmt>.cu) so the heavy unrolled bodies compile in parallel.
#pragma once

#define DI_GPU_NEED_FP8  // decode(WF_FP8) uses the cuda_fp8.h conversion intrinsics on NVIDIA
#include "gpu_runtime.cuh"

#include "device.cuh"
#include "gemv_api.cuh"

namespace di {


template <int F> struct Fmt;
template <> struct Fmt<WF_BF16> { static constexpr int EPV = 8, SUB = 8; };
template <> struct Fmt<WF_F16> { static constexpr int EPV = 8, SUB = 8; };
template <> struct Fmt<WF_F32> { static constexpr int EPV = 4, SUB = 4; };
template <> struct Fmt<WF_FP8> { static constexpr int EPV = 16, SUB = 8; };
template <> struct Fmt<WF_I8> { static constexpr int EPV = 16, SUB = 8; };
template <> struct Fmt<WF_I4> { static constexpr int EPV = 32, SUB = 8; };
template <> struct Fmt<WF_U4> { static constexpr int EPV = 32, SUB = 8; };
template <> struct Fmt<WF_FP4> { static constexpr int EPV = 32, SUB = 8; };

// Decode sub-vector j (Fmt<F>::SUB elements) of a 16-byte weight vector.
template <int F>
__device__ __forceinline__ void decode(const uint4& v, int j, float* f, const float* lut) {
    const uint32_t wd[4] = {v.x, v.y, v.z, v.w};
    if constexpr (F == WF_BF16) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(wd[i] << 16);
            f[2 * i + 1] = __uint_as_float(wd[i] & 0xffff0000u);
        }
    } else if constexpr (F == WF_F16) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __half2float(__ushort_as_half((unsigned short)(wd[i] & 0xffffu)));
            f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(wd[i] >> 16)));
        }
    } else if constexpr (F == WF_F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(wd[i]);
    } else if constexpr (F == WF_FP8) {
#if DI_GPU_AMD
        // AMD: CDNA2 has no fp8 conversions and CDNA3's decode the FNUZ variant (bias 8, 0x80 = NaN),
        // not the OCP e4m3fn stored here, so decode in software; every e4m3 value is exact in f32.
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = e4m3_to_f((wd[2 * j + i / 4] >> (8 * (i % 4))) & 0xffu);
#else
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            uint32_t word = wd[2 * j + w];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(word >> (16 * h)), __NV_E4M3);
                float2 p = __half22float2(__half2(r));
                f[4 * w + 2 * h] = p.x;
                f[4 * w + 2 * h + 1] = p.y;
            }
        }
#endif
    } else if constexpr (F == WF_I8) {
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            uint32_t word = wd[2 * j + w];
#pragma unroll
            for (int b = 0; b < 4; ++b)  // 2^23 + (byte ^ 0x80) as a float, minus 2^23 + 128: no I2F
                f[4 * w + b] = __uint_as_float(0x4B000000u | (((word >> (8 * b)) & 0xffu) ^ 0x80u)) - 8388736.f;
        }
    } else if constexpr (F == WF_I4) {
        uint32_t word = wd[j];
#pragma unroll
        for (int i = 0; i < 8; ++i)  // 2^23 + (nibble ^ 8) as a float, minus 2^23 + 8
            f[i] = __uint_as_float(0x4B000000u | (((word >> (4 * i)) & 15u) ^ 8u)) - 8388616.f;
    } else if constexpr (F == WF_U4) {
        uint32_t word = wd[j];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = __uint_as_float(0x4B000000u | ((word >> (4 * i)) & 15u)) - 8388608.f;
    } else {  // WF_FP4
        uint32_t word = wd[j];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = lut[(word >> (4 * i)) & 15u];
    }
}

constexpr int GEMV_RPW = 4;            // weight rows per warp
constexpr int GEMV_WARPS = 8;          // warps per block
constexpr int GEMV_XS_FLOATS = 8192;   // shared f32 activations per block (32 KB)

template <int F, int MT>
__global__ __launch_bounds__(256) void k_gemv(const __grid_constant__ QTensor x, const __grid_constant__ QTensor w, DTensor bias, DTensor out, int M, int64_t N,
                                              int64_t K, int bcs, int64_t kper, float* part) {
    constexpr int EPV = Fmt<F>::EPV, SUB = Fmt<F>::SUB, NSUB = EPV / SUB, KC = GEMV_XS_FLOATS / MT;
    __shared__ __align__(16) float xs[GEMV_XS_FLOATS];
    __shared__ float lut[16];
    const int warp = warp_id(), lane = lane_id();
    if (threadIdx.x < 16) lut[threadIdx.x] = e2m1_to_f(threadIdx.x);
    const int64_t n0 = ((int64_t)blockIdx.x * GEMV_WARPS + warp) * GEMV_RPW;
    const int bits = (F == WF_F32) ? 32 : (F == WF_BF16 || F == WF_F16) ? 16 : (F == WF_FP8 || F == WF_I8) ? 8 : 4;
    const char* rowp[GEMV_RPW];
    const char* srow[GEMV_RPW];  // the row's scales (and zeros): divisions by the block happen once here
    const char* zrow[GEMV_RPW];
    const int sl = dt_lg(w.s.dt), zl = dt_lg(w.z.dt);
#pragma unroll
    for (int r = 0; r < GEMV_RPW; ++r) {
        int64_t n = n0 + r < N ? n0 + r : N - 1;  // clamped rows are computed and dropped
        rowp[r] = w.q.base + n * w.q.strides[0] * bits / 8;
        srow[r] = w.mode ? w.s.base + (((n / w.br) * w.s.strides[0]) << sl) : nullptr;
        zrow[r] = w.mode == 2 ? w.z.base + (((n / w.br) * w.z.strides[0]) << zl) : nullptr;
    }
    float acc[GEMV_RPW][MT];
#pragma unroll
    for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;

    // split-K: this block's columns [ks, ke); kper is a multiple of every format's vector width
    const int64_t ks = (int64_t)blockIdx.y * kper, ke = min(K, ks + kper);
    for (int64_t kc = ks; kc < ke; kc += KC) {
        const int kn = (int)min((int64_t)KC, ke - kc);
        __syncthreads();
        if (x.mode == 0) {  // plain activations: independent loads, unrolled so they overlap
#pragma unroll 4
            for (int i = threadIdx.x; i < MT * KC; i += blockDim.x) {
                int m = i / KC, k = i % KC;
                xs[i] = (m < M && k < kn) ? load_f(x.q.dt, x.q.base, m * x.q.strides[0] + kc + k) : 0.f;
            }
        } else {
            for (int i = threadIdx.x; i < MT * kn; i += blockDim.x) {
                int m = i / kn, k = i % kn;
                xs[m * KC + k] = m < M ? qload_inline(x, 0, m, kc + k) : 0.f;
            }
        }
        __syncthreads();
        // the next vectors are loaded before the current ones are used: two iterations in flight
        uint4 wn[GEMV_RPW];
        if (lane * EPV < kn) {
#pragma unroll
            for (int r = 0; r < GEMV_RPW; ++r)
                wn[r] = __ldg(reinterpret_cast<const uint4*>(rowp[r] + (kc + lane * EPV) * bits / 8));
        }
        for (int kb = lane * EPV; kb < kn; kb += LANES * EPV) {
            uint4 wv[GEMV_RPW];
#pragma unroll
            for (int r = 0; r < GEMV_RPW; ++r) wv[r] = wn[r];
            if (kb + LANES * EPV < kn) {
#pragma unroll
                for (int r = 0; r < GEMV_RPW; ++r)
                    wn[r] = __ldg(reinterpret_cast<const uint4*>(rowp[r] + (kc + kb + LANES * EPV) * bits / 8));
            }
#pragma unroll
            for (int j = 0; j < NSUB; ++j) {
                const int kk = kb + j * SUB;
                float wf[GEMV_RPW][SUB];
                float sc[GEMV_RPW], zr[GEMV_RPW];
#pragma unroll
                for (int r = 0; r < GEMV_RPW; ++r) {
                    decode<F>(wv[r], j, wf[r], lut);
                    sc[r] = 1.f;
                    zr[r] = 0.f;
                    if (w.mode) {
                        const uint32_t kq = (uint32_t)(kc + kk);
                        const uint32_t g = bcs >= 0 ? kq >> bcs : kq / (uint32_t)w.bc;
                        sc[r] = load_f(w.s.dt, srow[r], g);
                        if (w.mode == 2) zr[r] = load_f(w.z.dt, zrow[r], g);
                    }
                }
                if (w.mode == 2) {
#pragma unroll
                    for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
                        for (int i = 0; i < SUB; ++i) wf[r][i] -= zr[r];
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    float xv[SUB];
                    const float4* xp = reinterpret_cast<const float4*>(&xs[m * KC + kk]);
#pragma unroll
                    for (int q = 0; q < SUB / 4; ++q) {
                        float4 t = xp[q];
                        xv[4 * q] = t.x;
                        xv[4 * q + 1] = t.y;
                        xv[4 * q + 2] = t.z;
                        xv[4 * q + 3] = t.w;
                    }
#pragma unroll
                    for (int r = 0; r < GEMV_RPW; ++r) {
                        float d = 0.f;
#pragma unroll
                        for (int i = 0; i < SUB; ++i) d += wf[r][i] * xv[i];
                        acc[r][m] += d * sc[r];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_RPW; ++r) {
        const int64_t n = n0 + r;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float v = warp_sum(acc[r][m]);
            if (lane == 0 && n < N && m < M) {
                if (part) {
                    part[((int64_t)blockIdx.y * M + m) * N + n] = v;
                } else {
                    if (bias.base) v += load_f(bias.dt, bias.base, n);
                    store_f(out.dt, out.base, (int64_t)m * out.strides[0] + n, v);
                }
            }
        }
    }
}


template <int F>
void launch_gemv_f(const QTensor& x, const QTensor& w, const DTensor& bias, const DTensor& out, int M, int64_t N,
                   int64_t K, cudaStream_t s, int splits, int64_t kper, float* part) {
    dim3 grid((unsigned)ceil_div(N, GEMV_WARPS * GEMV_RPW), (unsigned)splits);
    // scale group of column k: k >> bcs when the block width is a power of two (or spans K)
    int bcs = -1;
    if (w.mode) {
        if (w.bc >= K) bcs = 31;
        else if ((w.bc & (w.bc - 1)) == 0) for (bcs = 0; (int64_t(1) << bcs) < w.bc; ++bcs) {}
    }
    if (M <= 1) k_gemv<F, 1><<<grid, 256, 0, s>>>(x, w, bias, out, M, N, K, bcs, kper, part);
    else if (M <= 2) k_gemv<F, 2><<<grid, 256, 0, s>>>(x, w, bias, out, M, N, K, bcs, kper, part);
    else if (M <= 4) k_gemv<F, 4><<<grid, 256, 0, s>>>(x, w, bias, out, M, N, K, bcs, kper, part);
    else k_gemv<F, 8><<<grid, 256, 0, s>>>(x, w, bias, out, M, N, K, bcs, kper, part);
}

// one entry point per gemv_<fmt>.cu (declared in gemv_api.cuh)
#define DI_GEMV_INSTANTIATE(F, name)                                                                        \
    void launch_gemv_##name(const QTensor& x, const QTensor& w, const DTensor& bias, const DTensor& out, int M, \
                            int64_t N, int64_t K, cudaStream_t s, int splits, int64_t kper, float* part) {  \
        launch_gemv_f<F>(x, w, bias, out, M, N, K, s, splits, kper, part);                                  \
    }

}  // namespace di
