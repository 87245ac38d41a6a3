// Large-M GEMM on Hopper tensor cores (wgmma + TMA, warp-specialized), built from CUTLASS 3's
// collective builders in gemm_sm90_<out>.cu. linear uses it for M > 16 with bf16 activations:
// bf16 weights directly, quantized weights after a chunked dequantization to bf16.
//
// D[M, N] = A[M, K] . B[N, K]^T, A and B bf16 with unit stride along K, f32 accumulation, D in
// bf16 or f32 with unit stride along N. TMA needs 16-byte aligned bases and leading dimensions.
//
// The CUTLASS headers come from the nvidia-cutlass wheel (build.sh finds them); a build without
// them (or a HIP build) compiles gemm_sm90_available() to false and linear keeps its other paths.
#pragma once

#include "common.cuh"

namespace di {

struct GemmBF16 {
    const void* a;  int64_t lda;  // activations [M, K], elements between rows
    const void* b;  int64_t ldb;  // weights [N, K]
    void*       d;  int64_t ldd;  // output [M, N]
    int         M, N, K;
    int         d_f32;            // 1: D is f32, 0: bf16
};

// W8A8: D[M, N] (bf16) = (Aq[M, K] . Bq[N, K]^T) * sa[m] * sb[n], Aq / Bq int8, exact int32
// accumulation, the two per-row scales (f32, contiguous) applied to the f32 value in the epilogue.
struct GemmI8 {
    const void*  a;  int64_t lda;  // int8 activations [M, K]
    const void*  b;  int64_t ldb;  // int8 weights [N, K]
    const float* sa;               // [M] per-token scales
    const float* sb;               // [N] per-channel scales
    void*        d;  int64_t ldd;  // bf16 output [M, N]
    int          M, N, K;
};
bool        gemm_sm90_i8_fits(const GemmI8& g);         // alignment rules and CUTLASS's can_implement
bool        gemm_sm90_i8_supported(const GemmI8& g);
size_t      gemm_sm90_i8_workspace(const GemmI8& g, int sm_count);
cudaError_t gemm_sm90_i8_run(const GemmI8& g, void* ws, int sm_count, cudaStream_t s, const char** why);

// fp8 x fp8 block-scaled (DeepSeek V3's recipe): D[M, N] (bf16) = sum over 128-column blocks kb of
// (Aq[:, kb] . Bq[:, kb]^T) * sa[m, kb] * sb[n / 128, kb], Aq / Bq e4m3, the per-block scales
// promoted into the f32 accumulator after each block (DeepGEMM's scheme). sa_mn: the x scales
// transposed to [K / 128, M] (CUTLASS reads them M-major); sb: [N / 128, K / 128] dense.
struct GemmFP8 {
    const void*  a;  int64_t lda;  // e4m3 activations [M, K]
    const void*  b;  int64_t ldb;  // e4m3 weights [N, K]
    const float* sa_mn;            // [K / 128, M]
    const float* sb;               // [N / 128, K / 128]
    void*        d;  int64_t ldd;  // bf16 output [M, N]
    int          M, N, K;
};
bool        gemm_sm90_fp8_fits(const GemmFP8& g);       // alignment rules and CUTLASS's can_implement
bool        gemm_sm90_fp8_supported(const GemmFP8& g);  // CUTLASS's can_implement alone
size_t      gemm_sm90_fp8_workspace(const GemmFP8& g, int sm_count);
cudaError_t gemm_sm90_fp8_run(const GemmFP8& g, void* ws, int sm_count, cudaStream_t s, const char** why);

// Compiled in (CUTLASS present, sm_90a in the build) and the device is sm_90.
bool gemm_sm90_available(const DI_Context* ctx);
// The problem meets TMA's alignment rules.
bool gemm_sm90_fits(const GemmBF16& g);
// Workspace bytes for this problem (0 for most; stream-K partials for small M).
size_t gemm_sm90_workspace(const GemmBF16& g, int sm_count);
// Launches on s; returns cudaSuccess or the error, with a reason in why (may be NULL).
cudaError_t gemm_sm90_run(const GemmBF16& g, void* ws, size_t ws_bytes, int sm_count, cudaStream_t s,
                          const char** why);

// Per output dtype (gemm_sm90_bf16out.cu, gemm_sm90_f32out.cu); the functions above dispatch.
size_t      gemm_sm90_workspace_bf16out(const GemmBF16& g, int sm_count);
cudaError_t gemm_sm90_run_bf16out(const GemmBF16& g, void* ws, int sm_count, cudaStream_t s, const char** why);
size_t      gemm_sm90_workspace_f32out(const GemmBF16& g, int sm_count);
cudaError_t gemm_sm90_run_f32out(const GemmBF16& g, void* ws, int sm_count, cudaStream_t s, const char** why);

}  // namespace di
