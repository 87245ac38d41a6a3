// linear.
//
// Paths, chosen per call from the weight format, M and alignment (the first that applies):
//  * tensor cores, weights streamed (linear_mma.cuh), for bf16 activations and the formats the
//    engine stores (bf16, fp8 e4m3 128x128, int8 per channel, int4 group-wise g32/64/128,
//    uint4 with zeros): M <= 16 always, larger M where the sm_90a GEMM below does not apply. The
//    weights are read once per 8 / 16 tokens and decoded in registers; split-K across blocks
//    when the rows alone cannot fill the GPU.
//  * sm_90a GEMM (wgmma + TMA, CUTLASS; gemm_sm90.cuh) for M > 16 and bf16 activations: bf16
//    weights directly; quantized weights for M >= DQ_MIN_M (256) after dequantizing a chunk of rows to
//    bf16 in the workspace (the dequantization then costs a few percent of the GEMM).
//  * sm_90a W8A8 GEMM (int8 tensor cores, CUTLASS) for M > 8 with per-token int8 activations, per-
//    channel int8 weights and f32 scales, bf16 out: the scales are applied in the epilogue.
//  * sm_90a fp8 GEMM (fp8 tensor cores, CUTLASS blockwise) for e4m3 x (1 x 128 scales) with e4m3
//    128 x 128 weights, bf16 out: the scales are promoted per 128-column block in f32.
//  * GEMV (M <= 8, gemv.cuh): f32 activations, activation-quantized x (W8A8 / W4A8), f16 / f32 /
//    fp4 weights. One warp streams 4 weight rows and decodes them in f32.
//  * a tiled SIMT GEMM (64x64x16, f32) over generic dequantizing loaders for everything else:
//    any M, any alignment, any block shape.
// DEEPINFER_CUDA_LINEAR=gemv|mma|gemm|simt forces a path where it applies (benchmarks and
// diagnosis); anything else, or unset, is the automatic choice.
#include <vector>

#include "device.cuh"
#include "gemm_sm90_api.cuh"
#include "gemv_api.cuh"
#include "linear_mma_api.cuh"
#include "pdl.cuh"

using namespace di;

#include "tile_mm.cuh"

// Split K (blockIdx.z): block z takes columns [z * kper, (z + 1) * kper) and, with part set, writes
// f32 partials part[z, m, n] that k_gemv_reduce sums in a fixed order. Few output tiles (the MoE
// router: N = 64) would otherwise leave all but one or two SMs idle.
__global__ __launch_bounds__(256) void k_gemm_tiled(const __grid_constant__ QTensor x, const __grid_constant__ QTensor w, DTensor bias, DTensor out, int64_t M,
                                                    int64_t N, int64_t K, int64_t kper, float* part) {
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD];
    const int64_t m0 = (int64_t)blockIdx.y * TB, n0 = (int64_t)blockIdx.x * TB;
    const int64_t k0 = (int64_t)blockIdx.z * kper, kn = min(kper, K - k0);
    float acc[4][4] = {};
    auto la = [&](int r, int64_t k) { return m0 + r < M ? qload(x, 0, m0 + r, k0 + k) : 0.f; };
    auto lb = [&](int r, int64_t k) { return n0 + r < N ? qload(w, 0, n0 + r, k0 + k) : 0.f; };
    tile_mm(la, lb, kn, acc, As, Bs);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int64_t m = m0 + ty * 4 + i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int64_t n = n0 + tx * 4 + j;
            if (n >= N) continue;
            float v = acc[i][j];
            if (part) {
                part[((int64_t)blockIdx.z * M + m) * N + n] = v;
                continue;
            }
            if (bias.base) v += load_f(bias.dt, bias.base, n);
            store_f(out.dt, out.base, m * out.strides[0] + n, v);
        }
    }
}

static int gemv_format(const QTensor& w) {
    switch (w.q.dt) {
        case DT_BF16: return w.mode == 0 ? WF_BF16 : -1;
        case DT_F16: return w.mode == 0 ? WF_F16 : -1;
        case DT_F32: return w.mode == 0 ? WF_F32 : -1;
        case DT_E4M3: return w.mode <= 1 ? WF_FP8 : -1;
        case DT_I8: return w.mode >= 1 ? WF_I8 : -1;
        case DT_I4: return w.mode >= 1 ? WF_I4 : -1;
        case DT_U4: return w.mode >= 1 ? WF_U4 : -1;
        case DT_E2M1: return w.mode == 1 ? WF_FP4 : -1;
        default: return -1;
    }
}

static int gemv_epv(int f) {
    switch (f) {
        case WF_BF16: case WF_F16: return 8;
        case WF_F32: return 4;
        case WF_FP8: case WF_I8: return 16;
        default: return 32;
    }
}

// Whether the vectorized GEMV can read w: 16-byte aligned rows, whole vectors, scale blocks that
// are whole sub-vectors of 8 and a scales tensor with 2 dims.
static bool gemv_ok(const QTensor& w, int64_t K, bool check_ptr) {
    int f = gemv_format(w);
    if (f < 0) return false;
    int epv = gemv_epv(f), bits = dt_bits(w.q.dt);
    if (K % epv) return false;
    if ((w.q.strides[0] * bits / 8) % 16) return false;
    if (check_ptr && (reinterpret_cast<uintptr_t>(w.q.base) % 16)) return false;
    if (w.mode && (w.bc % 8 || w.s.ndim != 2)) return false;
    return true;
}

static void launch_gemv(const QTensor& x, const QTensor& w, const DTensor& bias, const DTensor& out, int M, int64_t N,
                        int64_t K, cudaStream_t s, int sp, int64_t kp, float* pt) {
    switch (gemv_format(w)) {
        case WF_BF16: launch_gemv_bf16(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        case WF_F16: launch_gemv_f16(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        case WF_F32: launch_gemv_f32(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        case WF_FP8: launch_gemv_fp8(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        case WF_I8: launch_gemv_i8(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        case WF_I4: launch_gemv_i4(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        case WF_U4: launch_gemv_u4(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
        default: launch_gemv_fp4(x, w, bias, out, M, N, K, s, sp, kp, pt); break;
    }
}

// Split K across blocks when the rows alone cannot fill the GPU (small N: kv_a, o_proj, experts).
static int gemv_splits(int64_t N, int64_t K, int sm_count, int64_t* kper) {
    const int64_t rows_blocks = ceil_div(N, 32), want = 2 * (int64_t)sm_count;
    int64_t splits = rows_blocks >= want ? 1 : ceil_div(want, rows_blocks);
    const int64_t max_splits = K / 1024;  // keep >= 1024 columns per split
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    *kper = ceil_div(ceil_div(K, splits), 1024) * 1024;
    return (int)ceil_div(K, *kper);
}

__global__ void k_gemv_reduce(const float* part, int splits, int64_t M, int64_t N, DTensor bias, DTensor out) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * N; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i / N, n = i % N;
        float v = 0.f;
        for (int sp = 0; sp < splits; ++sp) v += part[sp * M * N + i];  // fixed order: deterministic
        if (bias.base) v += load_f(bias.dt, bias.base, n);
        store_f(out.dt, out.base, m * out.strides[0] + n, v);
    }
}

// ---------------------------------------------------------------------------------------- path choice
enum LinPath { LP_MMA, LP_GEMM90, LP_GEMM90_DQ, LP_GEMM90_I8, LP_GEMM90_FP8, LP_GEMV, LP_SIMT };

// DEEPINFER_CUDA_LINEAR, read once: -1 (automatic) or the LinPath to prefer.
static int forced_path() {
    static const int f = [] {
        const char* e = getenv("DEEPINFER_CUDA_LINEAR");
        if (!e) return -1;
        if (!strcmp(e, "mma")) return (int)LP_MMA;
        if (!strcmp(e, "gemm")) return (int)LP_GEMM90;
        if (!strcmp(e, "gemv")) return (int)LP_GEMV;
        if (!strcmp(e, "simt")) return (int)LP_SIMT;
        return -1;
    }();
    return f;
}

// Quantized weights: dequantize + GEMM from here on. Below, the weight-streaming batch kernel: on
// the H200 it was 1.5-2x faster than dequantize + GEMM at M = 64 and 2-3x slower at M = 512
// (benchmarks/results/gpu_linear_20261203*.md), the dequantization of the whole weight costing
// about a cuBLAS bf16 GEMM of M = 64 on the same shape.
constexpr int64_t DQ_MIN_M = 256;
constexpr uint64_t DQ_CHUNK_BYTES = 64u << 20;  // bf16 rows dequantized per GEMM

static bool aligned16p(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// x as the streaming kernels read it: plain bf16, unit stride along K, 16-byte aligned rows (the
// tensor-core path only: unused where DI_HAVE_MOE_MMA is 0).
[[maybe_unused]] static bool bf16_rows(const QTensor& x, bool check_ptr) {
    if (x.mode || x.q.dt != DT_BF16 || x.q.strides[1] != 1 || (x.q.strides[0] * 2) % 16) return false;
    return !check_ptr || aligned16p(x.q.base);
}

static GemmBF16 gemm_problem(const QTensor& x, const void* wb, int64_t ldb, const DTensor& out, int64_t M,
                             int64_t N, int64_t K) {
    GemmBF16 g{};
    g.a = x.q.base;
    g.lda = x.q.strides[0];
    g.b = wb;
    g.ldb = ldb;
    g.d = out.base;
    g.ldd = out.strides[0];
    g.M = (int)M;
    g.N = (int)N;
    g.K = (int)K;
    g.d_f32 = out.dt == DT_F32;
    return g;
}

// The decode shapes' split-K blocks reduce in a cluster (sm_90; certified on H100, 2026-12-07);
// DEEPINFER_CUDA_LINEAR_CLUSTER=0 sends the partials through memory to the reduce kernel (the same bits).
static bool lin_cluster_on() {
    static const bool on = env_switch_on("DEEPINFER_CUDA_LINEAR_CLUSTER");
    return on;
}

// The fewest k-steps a warp of a split-K decode block runs (4). DEEPINFER_CUDA_LINEAR_MIN_STEPS=1..16
// sets it for a measurement: fewer steps mean more splits, more bytes in flight and shorter chains,
// against more partial sums to reduce.
static int64_t lin_min_steps() {
    static const int64_t v = [] {
        const char* e = getenv("DEEPINFER_CUDA_LINEAR_MIN_STEPS");
        const int n = e ? atoi(e) : 0;
        return (int64_t)(n >= 1 && n <= 16 ? n : 4);
    }();
    return v;
}

static int mma_splits(LinShape sh, int64_t N, int64_t K, int f, int sm_count) {
    if (sh == LIN_BATCH) return 1;
    const int64_t blocks = ceil_div(N, lin_rows_per_block(sh));
    const int64_t want = 8 * (int64_t)sm_count;  // about 1.5 waves of the 5-6 resident blocks per SM
    const int64_t steps_per_warp_min = lin_min_steps();
    const int64_t max_splits = K / moe_kstep_cols(f) / (lin_warps_per_k(sh) * steps_per_warp_min);
    int64_t sp = blocks >= want ? 1 : ceil_div(want, blocks);
    if (sp > max_splits) sp = max_splits;
    if (sp > 64) sp = 64;
    return sp < 1 ? 1 : (int)sp;
}

typedef void (*LinMmaFn)(LinShape, const LinWeight&, const char*, int64_t, int64_t, int, float*, bool,
                         const DTensor&, const DTensor&, cudaStream_t);
#if DI_HAVE_MOE_MMA
static const LinMmaFn kLinMma[MW_COUNT] = {launch_linear_mma_bf16, launch_linear_mma_fp8, launch_linear_mma_i8,
                                           launch_linear_mma_i4, launch_linear_mma_i4g64, launch_linear_mma_i4g32,
                                           launch_linear_mma_u4};
#endif

// Dequantizes rows [n0, n0 + rows) of w (a tensor-core format: 16-byte rows, K and the scale
// groups multiples of 32) into dst (bf16, rows x K, dense). One thread per 8 consecutive elements
// of a row, which never straddle a scale group: one scale (and zero) load, one 16-byte store.
template <int QDT>
__global__ void k_dequant_rows(const __grid_constant__ QTensor w, int64_t n0, int64_t rows, int64_t K, uint16_t* dst) {
    const int64_t per_row = K / 8, total = rows * per_row;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / per_row, k = (i % per_row) * 8, n = n0 + r;
        const int64_t sb = (n / w.br) * w.s.strides[0] + (k / w.bc) * w.s.strides[1];
        const float sc = load_f(w.s.dt, w.s.base, sb);
        const float zr = w.mode == 2 ? load_f(w.z.dt, w.z.base, (n / w.br) * w.z.strides[0] + (k / w.bc) * w.z.strides[1]) : 0.f;
        float f[8];
        if constexpr (QDT == DT_E4M3 || QDT == DT_I8) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(w.q.base + n * w.q.strides[0] + k));
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint32_t b = ((j < 4 ? v.x : v.y) >> (8 * (j & 3))) & 0xffu;
                f[j] = QDT == DT_E4M3 ? e4m3_to_f(b) : (float)(int8_t)b;
            }
        } else {  // 4-bit, element k in the low nibble of its byte
            const uint32_t v = __ldg(reinterpret_cast<const uint32_t*>(w.q.base + (n * w.q.strides[0] + k) / 2));
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int q = (v >> (4 * j)) & 15;
                f[j] = QDT == DT_I4 ? (float)((q ^ 8) - 8) : (float)q;
            }
        }
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            o[j] = (uint32_t)f_to_bf16((f[2 * j] - zr) * sc) | ((uint32_t)f_to_bf16((f[2 * j + 1] - zr) * sc) << 16);
        *reinterpret_cast<uint4*>(dst + r * K + k) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

static void launch_dequant_rows(const QTensor& w, int64_t n0, int64_t rows, int64_t K, uint16_t* dst, cudaStream_t s) {
    const unsigned grid = grid_for(rows * (K / 8), 256, 8 * 1024);
    switch (w.q.dt) {
        case DT_E4M3: k_dequant_rows<DT_E4M3><<<grid, 256, 0, s>>>(w, n0, rows, K, dst); break;
        case DT_I8: k_dequant_rows<DT_I8><<<grid, 256, 0, s>>>(w, n0, rows, K, dst); break;
        case DT_I4: k_dequant_rows<DT_I4><<<grid, 256, 0, s>>>(w, n0, rows, K, dst); break;
        default: k_dequant_rows<DT_U4><<<grid, 256, 0, s>>>(w, n0, rows, K, dst); break;
    }
}

// x's (1 x 128) scales [M, K / 128] (any strides, f32) -> dst [K / 128, M], the layout the fp8 GEMM reads.
__global__ void k_scales_mn(DTensor s, int64_t M, int64_t kb, float* dst) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * kb; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i % M, b = i / M;
        dst[i] = reinterpret_cast<const float*>(s.base)[m * s.strides[0] + b * s.strides[1]];
    }
}

__global__ void k_add_bias(DTensor bias, DTensor out, int64_t M, int64_t N) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * N; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i / N, n = i % N, o = m * out.strides[0] + n;
        store_f(out.dt, out.base, o, load_f(out.dt, out.base, o) + load_f(bias.dt, bias.base, n));
    }
}

// Chooses the path, sizes its workspace and (mode->launch) runs it.
static DI_Status run_linear(DI_Context* ctx, const DI_ArgsHeader& h, OpMode* mode, const QTensor& x, const QTensor& w,
                            const DTensor& bias, bool has_bias, const DTensor& out, int64_t M, int64_t N, int64_t K) {
    const char* op = "linear";
    const bool chk = mode->launch;
    int fm = -1;  // streaming tensor-core format
#if DI_HAVE_MOE_MMA
    if (bf16_rows(x, chk) && w.q.strides[1] == 1 && row_bytes(w) % 16 == 0 && (!chk || aligned16p(w.q.base)))
        fm = mma_format(w);
    // uint4 enters the mma as (u - z) * s rounded to bf16: within a bf16 result's tolerance, not an
    // f32 one, so an f32 output takes the exact paths
    if (fm == MW_U4 && out.dt == DT_F32) fm = -1;
#endif
    // The GEMMs store D and the bias is added after: with a bf16 output that would round twice, so
    // a bias with a bf16 output takes the paths that add it in f32 (DeepSeek's linears have none).
    const bool gemm_epilogue_ok = !(has_bias && out.dt == DT_BF16);
    const bool sm90 = gemm_epilogue_ok && gemm_sm90_available(ctx) && x.mode == 0 && x.q.dt == DT_BF16 && x.q.strides[1] == 1 &&
                      M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX;
    const bool w_bf16 = w.mode == 0 && w.q.dt == DT_BF16 && w.q.strides[1] == 1;
    GemmBF16 g = gemm_problem(x, w.q.base, w.q.strides[0], out, M, N, K);
    const bool gemm_ok = sm90 && gemm_sm90_fits(g) && (!chk || (aligned16p(g.a) && aligned16p(g.d)));
    const bool gemv = M <= 8 && gemv_ok(w, K, chk);

    // W8A8: per-token int8 x, per-channel int8 w, contiguous f32 scales, bf16 out
    GemmI8 gi{};
    bool i8_ok = false;
    if (gemm_epilogue_ok && gemm_sm90_available(ctx) && x.mode == 1 && x.q.dt == DT_I8 && w.mode == 1 && w.q.dt == DT_I8 &&
        x.br == 1 && x.bc >= K && w.br == 1 && w.bc >= K && x.s.dt == DT_F32 && w.s.dt == DT_F32 &&
        x.s.strides[0] == 1 && w.s.strides[0] == 1 && x.q.strides[1] == 1 && w.q.strides[1] == 1 &&
        out.dt == DT_BF16 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX) {
        gi = GemmI8{x.q.base, x.q.strides[0], w.q.base, w.q.strides[0], reinterpret_cast<const float*>(x.s.base),
                    reinterpret_cast<const float*>(w.s.base), out.base, out.strides[0], (int)M, (int)N, (int)K};
        i8_ok = gemm_sm90_i8_fits(gi) &&
                (!chk || (aligned16p(gi.a) && aligned16p(gi.b) && aligned16p(gi.d) && aligned16p(gi.sa) &&
                          aligned16p(gi.sb)));
    }

    // fp8 x fp8: (1, 128) activation scales, 128 x 128 weight blocks, f32 scales (the weight's dense)
    GemmFP8 gf{};
    bool fp8_ok = false;
    if (gemm_epilogue_ok && gemm_sm90_available(ctx) && x.mode == 1 && x.q.dt == DT_E4M3 && w.mode == 1 && w.q.dt == DT_E4M3 &&
        x.br == 1 && x.bc == 128 && w.br == 128 && w.bc == 128 && x.s.dt == DT_F32 && w.s.dt == DT_F32 &&
        w.s.strides[1] == 1 && w.s.strides[0] == K / 128 && x.q.strides[1] == 1 && w.q.strides[1] == 1 &&
        out.dt == DT_BF16 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX) {
        gf = GemmFP8{x.q.base, x.q.strides[0], w.q.base, w.q.strides[0], nullptr,
                     reinterpret_cast<const float*>(w.s.base), out.base, out.strides[0], (int)M, (int)N, (int)K};
        fp8_ok = gemm_sm90_fp8_fits(gf) &&
                 (!chk || (aligned16p(gf.a) && aligned16p(gf.b) && aligned16p(gf.d) && aligned16p(gf.sb)));
    }

    int path = LP_SIMT;
    if (fp8_ok) path = LP_GEMM90_FP8;
    else if (i8_ok) path = LP_GEMM90_I8;  // every M: one weight pass beats the f32 GEMV even at M = 1
    else if (M > 16 && gemm_ok && w_bf16 && (!chk || aligned16p(w.q.base))) path = LP_GEMM90;
    // the dequantized weights are rounded to bf16: only for a bf16 output (exact paths for f32)
    else if (M >= DQ_MIN_M && gemm_ok && fm >= 0 && out.dt == DT_BF16) path = LP_GEMM90_DQ;
    else if (fm >= 0) path = LP_MMA;
    else if (gemv) path = LP_GEMV;
    const int fp = forced_path();  // a forced path wins where it applies
    if (fp == LP_MMA && fm >= 0) path = LP_MMA;
    else if (fp == LP_GEMV && gemv) path = LP_GEMV;
    else if (fp == LP_SIMT) path = LP_SIMT;
    else if (fp == LP_GEMM90 && i8_ok) path = LP_GEMM90_I8;
    else if (fp == LP_GEMM90 && fp8_ok) path = LP_GEMM90_FP8;
    else if (fp == LP_GEMM90 && gemm_ok && w_bf16 && (!chk || aligned16p(w.q.base))) path = LP_GEMM90;
    else if (fp == LP_GEMM90 && gemm_ok && fm >= 0 && !w_bf16) path = LP_GEMM90_DQ;

    // ---- workspace
    const LinShape sh = lin_shape(M);
    int splits = 1;
    int64_t kper = K, dq_rows = 0;
    // decode shapes on sm_90: split-K blocks reduce in a thread-block cluster (no partials, no reduce kernel)
    bool cluster = false;
    if (path == LP_MMA) {
        splits = mma_splits(sh, N, K, fm, ctx->sm_count);
        cluster = splits > 1 && sh != LIN_BATCH && ctx->prop.major >= 9 && !DI_GPU_AMD && lin_cluster_on();
        if (cluster && splits > LIN_MAX_CLUSTER) splits = LIN_MAX_CLUSTER;
        if (splits > 1 && !cluster) mode->workspace = align256((uint64_t)splits * M * N * 4);
    } else if (path == LP_GEMM90) {
        mode->workspace = align256(gemm_sm90_workspace(g, ctx->sm_count));
    } else if (path == LP_GEMM90_I8) {
        mode->workspace = align256(gemm_sm90_i8_workspace(gi, ctx->sm_count));
    } else if (path == LP_GEMM90_FP8) {  // the x scales transposed to [K / 128, M], then the GEMM's
        mode->workspace = align256((uint64_t)M * (K / 128) * 4) + align256(gemm_sm90_fp8_workspace(gf, ctx->sm_count));
    } else if (path == LP_GEMM90_DQ) {
        dq_rows = (int64_t)(DQ_CHUNK_BYTES / (2 * (uint64_t)K)) / 256 * 256;
        if (dq_rows < 256) dq_rows = 256;
        if (dq_rows > N) dq_rows = N;
        GemmBF16 gc = g;
        gc.N = (int)dq_rows;
        mode->workspace = align256((uint64_t)dq_rows * K * 2) + align256(gemm_sm90_workspace(gc, ctx->sm_count));
    } else if (path == LP_GEMV) {
        splits = gemv_splits(N, K, ctx->sm_count, &kper);
        if (splits > 1) mode->workspace = align256((uint64_t)splits * M * N * 4);
    } else {  // SIMT: split K while the output tiles cannot fill the GPU
        if (M > 8 && (w.mode || x.mode)) mode->support = DI_SUPPORT_SLOW;  // SIMT dequantizing GEMM
        const int64_t tiles = ceil_div(N, TB) * ceil_div(M, TB);
        int64_t sp = (tiles == 0 || tiles >= 2 * ctx->sm_count) ? 1 : ceil_div(2 * ctx->sm_count, tiles);
        sp = min(sp, max((int64_t)1, K / 256));  // >= 256 columns per split
        sp = min(sp, (int64_t)64);
        if (sp > 1) {
            kper = ceil_div(ceil_div(K, sp), TK) * TK;
            splits = (int)ceil_div(K, kper);
        }
        if (splits > 1) mode->workspace = align256((uint64_t)splits * M * N * 4);
    }
    if (!mode->launch || M == 0 || N == 0) return DI_OK;

    cudaStream_t s = (cudaStream_t)h.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, h, mode->workspace));
    DI_Status st = DI_OK;
    const char* why = nullptr;
    if (path == LP_MMA) {
#if DI_HAVE_MOE_MMA
        LinWeight lw{mat_of(w), w.q.base, w.s.base, w.z.base};
        float* part = splits > 1 && !cluster ? static_cast<float*>(ws.ptr) : nullptr;
        kLinMma[fm](sh, lw, x.q.base, x.q.strides[0] * 2, M, splits, part, cluster, bias, out, s);
        st = launch_status(ctx, op);
        if (st == DI_OK && splits > 1 && !cluster) {
            k_gemv_reduce<<<grid_for(M * N, 256), 256, 0, s>>>(part, splits, M, N, bias, out);
            st = launch_status(ctx, op);
        }
#endif
    } else if (path == LP_GEMM90) {
        cudaError_t e = gemm_sm90_run(g, ws.ptr, mode->workspace, ctx->sm_count, s, &why);
        if (e != cudaSuccess) st = set_error(ctx, DI_INTERNAL, "%s: sm_90 GEMM failed: %s (%s)", op, why ? why : "",
                                             cudaGetErrorString(e));
    } else if (path == LP_GEMM90_I8) {
        cudaError_t e = gemm_sm90_i8_run(gi, ws.ptr, ctx->sm_count, s, &why);
        if (e != cudaSuccess) st = set_error(ctx, DI_INTERNAL, "%s: sm_90 W8A8 GEMM failed: %s (%s)", op,
                                             why ? why : "", cudaGetErrorString(e));
    } else if (path == LP_GEMM90_FP8) {
        float* sa = static_cast<float*>(ws.ptr);
        const int64_t kb = K / 128;
        k_scales_mn<<<grid_for(M * kb, 256), 256, 0, s>>>(x.s, M, kb, sa);
        st = launch_status(ctx, op);
        if (st == DI_OK) {
            gf.sa_mn = sa;
            char* gws = static_cast<char*>(ws.ptr) + align256((uint64_t)M * kb * 4);
            cudaError_t e = gemm_sm90_fp8_run(gf, gws, ctx->sm_count, s, &why);
            if (e != cudaSuccess) st = set_error(ctx, DI_INTERNAL, "%s: sm_90 fp8 GEMM failed: %s (%s)", op,
                                                 why ? why : "", cudaGetErrorString(e));
        }
    } else if (path == LP_GEMM90_DQ) {
        uint16_t* wb = static_cast<uint16_t*>(ws.ptr);
        char* gws = static_cast<char*>(ws.ptr) + align256((uint64_t)dq_rows * K * 2);
        for (int64_t n0 = 0; n0 < N && st == DI_OK; n0 += dq_rows) {
            const int64_t rows = min(dq_rows, N - n0);
            launch_dequant_rows(w, n0, rows, K, wb, s);
            st = launch_status(ctx, op);
            if (st != DI_OK) break;
            DTensor oc = out;
            oc.base += n0 * (dt_bits(out.dt) / 8);
            GemmBF16 gc = gemm_problem(x, wb, K, oc, M, rows, K);
            cudaError_t e = gemm_sm90_run(gc, gws, mode->workspace, ctx->sm_count, s, &why);
            if (e != cudaSuccess)
                st = set_error(ctx, DI_INTERNAL, "%s: sm_90 GEMM failed: %s (%s)", op, why ? why : "",
                               cudaGetErrorString(e));
        }
    } else if (path == LP_GEMV) {
        float* part = splits > 1 ? static_cast<float*>(ws.ptr) : nullptr;
        launch_gemv(x, w, bias, out, (int)M, N, K, s, splits, kper, part);
        st = launch_status(ctx, op);
        if (st == DI_OK && splits > 1) {
            k_gemv_reduce<<<grid_for(M * N, 256), 256, 0, s>>>(part, splits, M, N, bias, out);
            st = launch_status(ctx, op);
        }
    } else {
        if (ceil_div(M, TB) > 65535)
            st = set_error(ctx, DI_UNIMPLEMENTED, "%s: M=%lld is too large for one launch", op, (long long)M);
        else {
            float* part = splits > 1 ? static_cast<float*>(ws.ptr) : nullptr;
            dim3 grid((unsigned)ceil_div(N, TB), (unsigned)ceil_div(M, TB), (unsigned)splits);
            k_gemm_tiled<<<grid, 256, 0, s>>>(x, w, bias, out, M, N, K, kper, part);
            st = launch_status(ctx, op);
            if (st == DI_OK && splits > 1) {
                k_gemv_reduce<<<grid_for(M * N, 256), 256, 0, s>>>(part, splits, M, N, bias, out);
                st = launch_status(ctx, op);
            }
        }
    }
    // the GEMMs store D without the bias (DeepSeek's linears have none): it is added after
    const bool gemm_path = path == LP_GEMM90 || path == LP_GEMM90_DQ || path == LP_GEMM90_I8 || path == LP_GEMM90_FP8;
    if (gemm_path && st == DI_OK && bias.base) {
        k_add_bias<<<grid_for(M * N, 256), 256, 0, s>>>(bias, out, M, N);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}

// ---------------------------------------------------------------------------------------- linear
#define WEIGHT_DTYPES DT_F32, DT_BF16, DT_E4M3, DT_E5M2, DT_I8, DT_I4, DT_U4, DT_E2M1

DI_Status di::check_weight(DI_Context* ctx, const char* op, const char* name, const QTensor& w) {
    DI_NEED_DT(ctx, op, name, w.q.dt, WEIGHT_DTYPES);
    bool needs_q = dt_is_int(w.q.dt) || w.q.dt == DT_E2M1;
    if (needs_q && w.mode == 0)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %s of dtype %s needs a quant descriptor (scales)", op, name,
                         dt_name(w.q.dt));
    return DI_OK;
}

DI_Status op_linear(DI_Context* ctx, const DI_LinearArgs* a, OpMode* mode) {
    const char* op = "linear";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_LinearArgs"));
    QTensor x, w, bias, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, T_ALLOW_Q, &x));
    DI_TRY(take_tensor(ctx, mode, op, "w", a->w, 2, T_ALLOW_Q, &w));
    DI_TRY(take_tensor(ctx, mode, op, "bias", a->bias, 1, T_OPTIONAL, &bias));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    if (x.mode == 0) {
        DI_NEED_DT(ctx, op, "x", x.q.dt, DT_F32, DT_BF16);
    } else {
        DI_NEED_DT(ctx, op, "x (activation-quantized)", x.q.dt, DT_I8, DT_E4M3);
        if (x.mode == 2)
            return set_error(ctx, DI_UNIMPLEMENTED, "%s: asymmetric activation quantization (x zeros) is not supported", op);
    }
    DI_TRY(check_weight(ctx, op, "w", w));
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_F32, DT_BF16);
    const int64_t M = x.q.shape[0], K = x.q.shape[1], N = w.q.shape[0];
    DI_TRY(need_shape(ctx, op, "w", w.q, 1, K, "x.shape[1]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, M, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, N, "w.shape[0]"));
    if (bias.q.base || (!mode->launch && a->bias.ndim == 1)) {
        DI_NEED_DT(ctx, op, "bias", bias.q.dt, DT_F32, DT_BF16);
        DI_TRY(need_shape(ctx, op, "bias", bias.q, 0, N, "w.shape[0]"));
    }
    return run_linear(ctx, a->header, mode, x, w, bias.q, bias.q.base || a->bias.ndim == 1, out.q, M, N, K);
}
