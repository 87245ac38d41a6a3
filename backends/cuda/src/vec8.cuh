// Eight elements at a time: one 16-byte load of bf16 (two of f32), decoded to f32, and back. The
// fast paths of the small decode kernels (rmsnorm, mla_decode) use these where a row is contiguous
// and 16-byte aligned; everything else goes through the generic element loaders of device.cuh.
#pragma once

#include "device.cuh"

namespace di {

// Whether t's rows (the last dim) can be read eight elements at a time: unit inner stride, f32 or
// bf16, 16-byte aligned base and row starts, a row length divisible by 8.
inline bool vec8_rows(const DTensor& t) {
    if (t.dt != DT_BF16 && t.dt != DT_F32) return false;
    const int last = t.ndim - 1;
    if (last < 0 || t.strides[last] != 1 || t.shape[last] % 8) return false;
    if (reinterpret_cast<uintptr_t>(t.base) % 16) return false;
    for (int d = 0; d < last; ++d)
        if (t.shape[d] > 1 && t.strides[d] % 8) return false;
    return true;
}

template <int DT>
__device__ __forceinline__ void load8(const char* base, int64_t e, float* f) {
    if constexpr (DT == DT_BF16) {
        const uint4 v = *reinterpret_cast<const uint4*>(base + e * 2);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else {
        const float4 a = *reinterpret_cast<const float4*>(base + e * 4);
        const float4 b = *reinterpret_cast<const float4*>(base + e * 4 + 16);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
        f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
}

template <int DT>
__device__ __forceinline__ void store8(char* base, int64_t e, const float* f) {
    if constexpr (DT == DT_BF16) {
        uint4 v;
        v.x = (uint32_t)f_to_bf16(f[0]) | ((uint32_t)f_to_bf16(f[1]) << 16);
        v.y = (uint32_t)f_to_bf16(f[2]) | ((uint32_t)f_to_bf16(f[3]) << 16);
        v.z = (uint32_t)f_to_bf16(f[4]) | ((uint32_t)f_to_bf16(f[5]) << 16);
        v.w = (uint32_t)f_to_bf16(f[6]) | ((uint32_t)f_to_bf16(f[7]) << 16);
        *reinterpret_cast<uint4*>(base + e * 2) = v;
    } else {
        *reinterpret_cast<float4*>(base + e * 4) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4*>(base + e * 4 + 16) = make_float4(f[4], f[5], f[6], f[7]);
    }
}

}  // namespace di
