// Device-side element access: decode any ABI dtype to f32, encode f32 to the storable ones, and
// read a block-quantized element as its real value. Kept free of vendor intrinsics beyond the
// basics so a HIP build can share it through a compat header.
#pragma once

#include "gpu_runtime.cuh"
#include <math.h>
#include <stdint.h>

#include "common.cuh"

namespace di {

__device__ __forceinline__ float bf16_to_f(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN.
__device__ __forceinline__ uint16_t f_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

__device__ __forceinline__ float f16_to_f(uint16_t h) {
    uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = (float)m * 5.9604644775390625e-08f;  // 2^-24
    else if (e == 31) v = m ? __uint_as_float(0x7fc00000u) : __uint_as_float(0x7f800000u);
    else v = __uint_as_float(((e + 112u) << 23) | (m << 13));
    return s ? -v : v;
}

// Generic minifloat encoder (no inf): round to nearest even, saturating at maxv. Returns the
// magnitude code; the caller ORs in the sign bit. Exact: every scaling is by a power of two.
__device__ __forceinline__ uint32_t enc_minifloat(float a, int mbits, int bias, float maxv) {
    a = fminf(a, maxv);
    if (!(a > 0.f)) return 0;
    int E;
    frexpf(a, &E);
    int e = E - 1;  // floor(log2 a)
    const int emin = 1 - bias;
    if (e < emin) {
        float q = rintf(ldexpf(a, mbits - emin));
        return (uint32_t)q;  // q == 2^mbits is the smallest normal, which this code also is
    }
    float q = rintf(ldexpf(a, mbits - e));
    if (q >= (float)(2 << mbits)) { q = (float)(1 << mbits); e++; }
    return (uint32_t)((e + bias) << mbits) | ((uint32_t)q - (1u << mbits));
}

__device__ __forceinline__ uint8_t f_to_e4m3(float f) {
    if (f != f) return 0x7f;
    uint32_t s = signbit(f) ? 0x80u : 0u;
    return uint8_t(s | enc_minifloat(fabsf(f), 3, 7, 448.f));
}
__device__ __forceinline__ uint8_t f_to_e5m2(float f) {
    if (f != f) return 0x7f;
    uint32_t s = signbit(f) ? 0x80u : 0u;
    return uint8_t(s | enc_minifloat(fabsf(f), 2, 15, 57344.f));
}
__device__ __forceinline__ uint8_t f_to_e2m1(float f) {  // 4-bit code
    if (f != f) return 0x7;
    uint32_t s = signbit(f) ? 0x8u : 0u;
    return uint8_t(s | enc_minifloat(fabsf(f), 1, 1, 6.f));
}
// power-of-two scale, rounded up (callers only store scales that are already powers of two)
__device__ __forceinline__ uint8_t f_to_e8m0(float f) {
    if (!(f > 0.f)) return 0;
    int E;
    float m = frexpf(f, &E);  // f = m * 2^E, m in [0.5, 1)
    int e = (m == 0.5f) ? E - 1 : E;
    e += 127;
    if (e < 0) e = 0;
    if (e > 254) e = 254;
    return uint8_t(e);
}

__device__ __forceinline__ float e4m3_to_f(uint32_t b) {
    uint32_t e = (b >> 3) & 15, m = b & 7;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    if ((b & 0x7f) == 0x7f) v = __uint_as_float(0x7fc00000u);
    return (b & 0x80) ? -v : v;
}
__device__ __forceinline__ float e5m2_to_f(uint32_t b) {
    uint32_t e = (b >> 2) & 31, m = b & 3;
    float v;
    if (e == 31) v = m ? __uint_as_float(0x7fc00000u) : __uint_as_float(0x7f800000u);
    else v = e ? __uint_as_float(((e + 112u) << 23) | (m << 21)) : (float)m * 1.52587890625e-05f;
    return (b & 0x80) ? -v : v;
}
__device__ __forceinline__ float e8m0_to_f(uint32_t b) {
    if (b == 255) return __uint_as_float(0x7fc00000u);
    if (b == 0) return 5.877471754111438e-39f;  // 2^-127, subnormal in f32
    return __uint_as_float(b << 23);
}
__device__ __forceinline__ float e2m1_to_f(uint32_t c) {
    uint32_t e = (c >> 1) & 3, m = c & 1;
    float v = e ? (float)(2 + m) * (float)(1 << e) * 0.25f : (float)m * 0.5f;
    return (c & 8) ? -v : v;
}

// log2 of the element size in bytes (-1: 4-bit packed).
__device__ __forceinline__ int dt_lg(int dt) {
    return (dt == DT_F32 || dt == DT_I32) ? 2
         : (dt == DT_F16 || dt == DT_BF16) ? 1
         : (dt == DT_E2M1 || dt == DT_I4 || dt == DT_U4) ? -1
         : (dt == DT_I64 || dt == DT_U64) ? 3 : 0;
}

// Element e (in elements from base) of any dtype, as f32.
// The load is one unconditional aligned 32-bit read and the dtype only selects the decoding: loads
// inside a switch on the dtype serialise (each waits for the branch), which made every generic loop
// latency-bound. The aligned word holding the element never crosses a page (pages and allocation
// starts are word-aligned), but for the last element of an allocation whose size is not a multiple
// of 4 it reads up to 3 bytes past the requested size, which compute-sanitizer memcheck reports;
// DI_EXACT_LOADS gives exact reads for such runs. 64-bit integers give their low word (index tensors
// use load_i).
__device__ __forceinline__ float load_f(int dt, const char* base, int64_t e) {
    const int lg = dt_lg(dt);
    const uintptr_t a = reinterpret_cast<uintptr_t>(base) + (lg >= 0 ? (uint64_t)e << lg : (uint64_t)e >> 1);
#ifdef DI_EXACT_LOADS
    // sanitizer builds (build.sh with DI_CUDA_SANITIZE=1): read exactly the element's bytes, so
    // compute-sanitizer memcheck sees no read past a tiny allocation; slower generic loops
    uint32_t w;
    if (lg >= 2) w = *reinterpret_cast<const uint32_t*>(a);
    else if (lg == 1) w = *reinterpret_cast<const uint16_t*>(a);
    else w = *reinterpret_cast<const uint8_t*>(a);
    uint32_t raw = w;
#else
    const uint32_t w = *reinterpret_cast<const uint32_t*>(a & ~uintptr_t(3));
    uint32_t raw = w >> ((a & 3) * 8);
#endif
    if (lg < 0) raw >>= (e & 1) * 4;
    switch (dt) {
        case DT_F32: return __uint_as_float(w);
        case DT_F16: return f16_to_f(raw & 0xffffu);
        case DT_BF16: return __uint_as_float(raw << 16);
        case DT_E4M3: return e4m3_to_f(raw & 0xffu);
        case DT_E5M2: return e5m2_to_f(raw & 0xffu);
        case DT_E8M0: return e8m0_to_f(raw & 0xffu);
        case DT_E2M1: return e2m1_to_f(raw & 15u);
        case DT_I4: return (float)(((int32_t)(raw << 28)) >> 28);
        case DT_U4: return (float)(raw & 15u);
        case DT_I8: return (float)(int8_t)(raw & 0xffu);
        case DT_U8: return (float)(raw & 0xffu);
        case DT_I32: case DT_I64: return (float)(int32_t)w;
        case DT_U64: return (float)w;
        default: return 0.f;
    }
}

// Store f32 into a float dtype (f32, f16, bf16, e4m3, e5m2); callers validated the dtype.
__device__ __forceinline__ void store_f(int dt, char* base, int64_t e, float v) {
    switch (dt) {
        case DT_F32: reinterpret_cast<float*>(base)[e] = v; break;
        case DT_F16: reinterpret_cast<uint16_t*>(base)[e] = __half_as_ushort(__float2half_rn(v)); break;
        case DT_BF16: reinterpret_cast<uint16_t*>(base)[e] = f_to_bf16(v); break;
        case DT_E4M3: reinterpret_cast<uint8_t*>(base)[e] = f_to_e4m3(v); break;
        case DT_E5M2: reinterpret_cast<uint8_t*>(base)[e] = f_to_e5m2(v); break;
        default: break;
    }
}

__device__ __forceinline__ int64_t load_i(int dt, const char* base, int64_t e) {
    switch (dt) {
        case DT_I32: return reinterpret_cast<const int32_t*>(base)[e];
        case DT_I64: return reinterpret_cast<const int64_t*>(base)[e];
        case DT_U64: return (int64_t)reinterpret_cast<const uint64_t*>(base)[e];
        case DT_I8: return reinterpret_cast<const int8_t*>(base)[e];
        case DT_U8: return reinterpret_cast<const uint8_t*>(base)[e];
        default: return (int64_t)load_f(dt, base, e);
    }
}

// Element offsets of the leading (batch) index L over dims [0, ndim-2) of t.
__device__ __forceinline__ int64_t lead_offset(const DTensor& t, int64_t L) {
    int64_t off = 0;
    for (int d = t.ndim - 3; d >= 0; --d) {
        int64_t n = t.shape[d];
        off += (L % n) * t.strides[d];
        L /= n;
    }
    return off;
}

// Offset of (r, c) within the last two dims; a 1-d tensor is one row.
__device__ __forceinline__ int64_t rc_offset(const DTensor& t, int64_t r, int64_t c) {
    return (t.ndim >= 2 ? r * t.strides[t.ndim - 2] : 0) + c;
}

// Real value of element (L, r, c) of a possibly quantized tensor. qload is the out-of-line copy: the
// generic paths call it from many unrolled sites and inlining each multiplies compile time.
__device__ __forceinline__ float qload_inline(const QTensor& t, int64_t L, int64_t r, int64_t c) {
    int64_t oq = (t.q.ndim > 2 ? lead_offset(t.q, L) : 0) + rc_offset(t.q, r, c);
    float v = load_f(t.q.dt, t.q.base, oq);
    if (t.mode) {
        int64_t rb = r / t.br, cb = c / t.bc;
        int64_t os = (t.s.ndim > 2 ? lead_offset(t.s, L) : 0) + rc_offset(t.s, rb, cb);
        float s = load_f(t.s.dt, t.s.base, os);
        if (t.mode == 2) {
            int64_t oz = (t.z.ndim > 2 ? lead_offset(t.z, L) : 0) + rc_offset(t.z, rb, cb);
            v = v - load_f(t.z.dt, t.z.base, oz);
        }
        v = v * s;
    }
    return v;
}

[[maybe_unused]] static __device__ __noinline__ float qload(const QTensor& t, int64_t L, int64_t r, int64_t c) {
    return qload_inline(t, L, r, c);
}

// ---------------------------------------------------------------------------------------- lanes
// The kernels cooperate in groups of LANES = 32 threads, called warps throughout: a thread's lane is
// threadIdx.x % LANES, per-lane strides are LANES elements, per-warp scratch is indexed by
// threadIdx.x / LANES, and reductions and scans run over the LANES lanes of one group. On NVIDIA that
// is the hardware warp. On AMD CDNA a wavefront has DI_WARP_SIZE = 64 lanes and holds two groups side
// by side; the exchanges below confine themselves to their group (width LANES), so a kernel's lane
// arithmetic means the same on both vendors. The price on AMD is one extra step in the cross-warp
// part of a block reduction, which is small next to the loads it follows.
//
// Kernels must not use anything that depends on the hardware width (raw shuffles, 32-bit lane masks,
// ballot, activemask, match): they exchange through shfl_xor / shfl_up here, and
// backends/hip/check_compat.sh fails the build check on raw ones.
constexpr int LANES = 32;
constexpr int MAX_WARPS = 1024 / LANES;  // warps of the largest block: per-warp scratch arrays
static_assert(DI_WARP_SIZE % LANES == 0, "a hardware warp must hold whole lane groups");

__device__ __forceinline__ int lane_id() { return threadIdx.x % LANES; }
__device__ __forceinline__ int warp_id() { return threadIdx.x / LANES; }

template <class T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
    return di_shfl_xor(v, lane_mask, LANES);
}
template <class T>
__device__ __forceinline__ T shfl_up(T v, unsigned delta) {
    return di_shfl_up(v, delta, LANES);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += shfl_xor(v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v = fmaxf(v, shfl_xor(v, o));
    return v;
}

// Inclusive prefix sum over the lanes of a warp.
template <class T>
__device__ __forceinline__ T warp_scan_incl(T v) {
    const int lane = lane_id();
#pragma unroll
    for (int d = 1; d < LANES; d *= 2) {
        const T a = shfl_up(v, d);
        if (lane >= d) v += a;
    }
    return v;
}

// Block-wide sum / max for blockDim.x a multiple of LANES (<= 1024); red needs MAX_WARPS floats of smem.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = (threadIdx.x < (unsigned)nw) ? red[threadIdx.x] : 0.f;
    if (w == 0) v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    return red[0];
}
__device__ __forceinline__ float block_max(float v, float* red) {
    int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = (threadIdx.x < (unsigned)nw) ? red[threadIdx.x] : -INFINITY;
    if (w == 0) v = warp_max(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    return red[0];
}

// Block-wide inclusive prefix sum in thread order, and the block's total, for blockDim.x a multiple of
// LANES (<= 1024); red needs MAX_WARPS elements of smem. Every thread must call it.
template <class T>
__device__ __forceinline__ T block_scan_incl(T v, T* total, T* red) {
    const int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
    v = warp_scan_incl(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane == LANES - 1) red[w] = v;
    __syncthreads();
    if (w == 0) {
        T s = lane < nw ? red[lane] : T(0);
        s = warp_scan_incl(s);
        if (lane < nw) red[lane] = s;
    }
    __syncthreads();
    if (w > 0) v += red[w - 1];
    *total = red[nw - 1];
    return v;
}

}  // namespace di
