// Dispatch of the sm_90a GEMM (gemm_sm90_api.cuh): availability, alignment, output dtype. No
// CUTLASS here, so this TU stays cheap; the kernels live in gemm_sm90_<out>.cu.
#include "gemm_sm90_api.cuh"

namespace di {

bool gemm_sm90_available(const DI_Context* ctx) {
#if DI_HAVE_CUTLASS && !defined(__HIP__)
    return ctx->prop.major == 9 && ctx->prop.minor == 0;  // the kernels are built for sm_90a only
#else
    (void)ctx;
    return false;
#endif
}

// TMA: 16-byte aligned leading dimensions; CUTLASS's 8-element (A, B) and 16-byte (D) alignment.
bool gemm_sm90_fits(const GemmBF16& g) {
    const int d_align = g.d_f32 ? 4 : 8;
    return g.M > 0 && g.N > 0 && g.K > 0 && g.K % 8 == 0 && g.lda % 8 == 0 && g.ldb % 8 == 0 &&
           g.N % d_align == 0 && g.ldd % d_align == 0 && g.lda >= g.K && g.ldb >= g.K && g.ldd >= g.N;
}

bool gemm_sm90_i8_fits(const GemmI8& g) {  // 16-byte rows of int8 A / B, 8-element rows of bf16 D
    return g.M > 0 && g.N > 0 && g.K > 0 && g.K % 16 == 0 && g.lda % 16 == 0 && g.ldb % 16 == 0 && g.N % 8 == 0 &&
           g.ldd % 8 == 0 && g.lda >= g.K && g.ldb >= g.K && g.ldd >= g.N && gemm_sm90_i8_supported(g);
}

bool gemm_sm90_fp8_fits(const GemmFP8& g) {  // whole 128 x 128 weight blocks, 16-byte rows
    return g.M > 0 && g.N > 0 && g.K > 0 && g.K % 128 == 0 && g.N % 128 == 0 && g.lda % 16 == 0 &&
           g.ldb % 16 == 0 && g.ldd % 8 == 0 && g.lda >= g.K && g.ldb >= g.K && g.ldd >= g.N &&
           gemm_sm90_fp8_supported(g);
}

size_t gemm_sm90_workspace(const GemmBF16& g, int sm_count) {
    return g.d_f32 ? gemm_sm90_workspace_f32out(g, sm_count) : gemm_sm90_workspace_bf16out(g, sm_count);
}

cudaError_t gemm_sm90_run(const GemmBF16& g, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s,
                          const char** why) {
    if (gemm_sm90_workspace(g, sm_count) > ws_bytes) {
        if (why) *why = "workspace too small";
        return cudaErrorInvalidValue;
    }
    return g.d_f32 ? gemm_sm90_run_f32out(g, ws, sm_count, s, why) : gemm_sm90_run_bf16out(g, ws, sm_count, s, why);
}

}  // namespace di
