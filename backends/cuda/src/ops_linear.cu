// linear.
//
// linear has two paths:
//  * GEMV (M <= 8): the decode hot path. One warp streams 4 weight rows with 16-byte loads and
//    decodes them in registers (bf16, f16, f32, fp8 e4m3, int8, int4, uint4, fp4 e2m1, block
//    scales and zeros per 8 elements); the activations, dequantized to f32 whatever their format
//    (int8 / fp8 activation quantization included), sit in shared memory. Accumulation is f32.
//  * a tiled SIMT GEMM (64x64x16, f32) over generic dequantizing loaders for everything else:
//    any M, any alignment, any block shape.
#include <vector>

#include "device.cuh"
#include "gemv_api.cuh"

using namespace di;

#include "tile_mm.cuh"

__global__ __launch_bounds__(256) void k_gemm_tiled(const __grid_constant__ QTensor x, const __grid_constant__ QTensor w, DTensor bias, DTensor out, int64_t M,
                                                    int64_t N, int64_t K) {
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD];
    const int64_t m0 = (int64_t)blockIdx.y * TB, n0 = (int64_t)blockIdx.x * TB;
    float acc[4][4] = {};
    auto la = [&](int r, int64_t k) { return m0 + r < M ? qload(x, 0, m0 + r, k) : 0.f; };
    auto lb = [&](int r, int64_t k) { return n0 + r < N ? qload(w, 0, n0 + r, k) : 0.f; };
    tile_mm(la, lb, K, acc, As, Bs);
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
    bool gemv = M <= 8 && gemv_ok(w, K, mode->launch);
    if (!gemv && M > 8 && (w.mode || x.mode)) mode->support = DI_SUPPORT_SLOW;  // SIMT dequantizing GEMM
    int64_t kper = K;
    const int splits = gemv ? gemv_splits(N, K, ctx->sm_count, &kper) : 1;
    if (splits > 1) mode->workspace = align256((uint64_t)splits * M * N * 4);
    if (!mode->launch || M == 0 || N == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;
    if (gemv && splits > 1) {
        Workspace ws;
        DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
        float* part = static_cast<float*>(ws.ptr);
        launch_gemv(x, w, bias.q, out.q, (int)M, N, K, s, splits, kper, part);
        DI_Status st = launch_status(ctx, op);
        if (st == DI_OK) {
            k_gemv_reduce<<<grid_for(M * N, 256), 256, 0, s>>>(part, splits, M, N, bias.q, out.q);
            st = launch_status(ctx, op);
        }
        ws.release();
        return st;
    }
    if (gemv) {
        launch_gemv(x, w, bias.q, out.q, (int)M, N, K, s, 1, K, nullptr);
    } else {
        if (ceil_div(M, TB) > 65535)
            return set_error(ctx, DI_UNIMPLEMENTED, "%s: M=%lld is too large for one launch", op, (long long)M);
        dim3 grid((unsigned)ceil_div(N, TB), (unsigned)ceil_div(M, TB));
        k_gemm_tiled<<<grid, 256, 0, s>>>(x, w, bias.q, out.q, M, N, K);
    }
    return launch_status(ctx, op);
}
