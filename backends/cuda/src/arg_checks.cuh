// Host-side argument checks that the op files of ABI 1.3 (hyper.cu, sparse.cu, norm.cu's layernorm)
// share: optional tensors, powers of two, finite scalars, overlapping views, and the dynamic shared
// memory opt-in. Inline, so each op file that includes this header may use any subset.
#pragma once

#include <math.h>

#include "common.cuh"

namespace di {

inline bool is_pow2(int64_t v) { return v >= 1 && (v & (v - 1)) == 0; }

// An optional argument: present when its data is set (in op_query also when it has a shape, since
// a query may leave data NULL); a present one is checked like a required one.
inline DI_Status take_opt(DI_Context* ctx, const OpMode* mode, const char* op, const char* name, const DI_Tensor& t, int ndim,
                          QTensor* v, bool* present) {
    *present = t.data != nullptr || (!mode->launch && t.ndim > 0);
    if (!*present) {
        memset(v, 0, sizeof(*v));
        return DI_OK;
    }
    return take_tensor(ctx, mode, op, name, t, ndim, 0, v);
}

inline DI_Status need_pow2(DI_Context* ctx, const char* op, const char* what, int64_t v) {
    if (is_pow2(v)) return DI_OK;
    return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s=%lld must be a power of two", op, what, (long long)v);
}

inline DI_Status need_finite(DI_Context* ctx, const char* op, const char* what, float v, bool nonneg) {
    if (isfinite(v) && (!nonneg || v >= 0.f)) return DI_OK;
    return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s=%g must be finite%s", op, what, v, nonneg ? " and >= 0" : "");
}

// [first byte, last byte + 1) that a view can touch (empty when a dimension is 0).
inline bool byte_span(const DTensor& t, uintptr_t* lo, uintptr_t* hi) {
    int64_t ext = 0;
    for (int d = 0; d < t.ndim; ++d) {
        if (t.shape[d] == 0) return false;
        ext += (t.shape[d] - 1) * t.strides[d];
    }
    const int64_t bits = dt_bits(t.dt);
    *lo = reinterpret_cast<uintptr_t>(t.base);
    *hi = *lo + (uintptr_t)(((ext + 1) * bits + 7) / 8);
    return true;
}

inline bool overlap(const DTensor& a, const DTensor& b) {
    uintptr_t alo, ahi, blo, bhi;
    if (!a.base || !b.base || !byte_span(a, &alo, &ahi) || !byte_span(b, &blo, &bhi)) return false;
    return alo < bhi && blo < ahi;
}

inline int64_t sm_count(const DI_Context* ctx) { return ctx->sm_count > 0 ? ctx->sm_count : 132; }

// dynamic shared memory above the default 48 KB must be asked for, per kernel
template <class K>
inline void allow_smem(K kernel, size_t bytes) {
    if (bytes > 48 * 1024) (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

}  // namespace di
