// Entry points of the GEMV kernels (gemv.cuh), one per weight format, each in its own gemv_<fmt>.cu.
#pragma once

#include "common.cuh"

namespace di {

enum WF { WF_BF16, WF_F16, WF_F32, WF_FP8, WF_I8, WF_I4, WF_U4, WF_FP4 };

#define DI_GEMV_DECL(name)                                                                                  \
    void launch_gemv_##name(const QTensor& x, const QTensor& w, const DTensor& bias, const DTensor& out, int M, \
                            int64_t N, int64_t K, cudaStream_t s, int splits, int64_t kper, float* part);
DI_GEMV_DECL(bf16)
DI_GEMV_DECL(f16)
DI_GEMV_DECL(f32)
DI_GEMV_DECL(fp8)
DI_GEMV_DECL(i8)
DI_GEMV_DECL(i4)
DI_GEMV_DECL(u4)
DI_GEMV_DECL(fp4)
#undef DI_GEMV_DECL

}  // namespace di
