// linear and moe_experts.
//
// linear has two paths:
//  * GEMV (M <= 8): the decode hot path. One warp streams 4 weight rows with 16-byte loads and
//    decodes them in registers (bf16, f16, f32, fp8 e4m3, int8, int4, uint4, fp4 e2m1, block
//    scales and zeros per 8 elements); the activations, dequantized to f32 whatever their format
//    (int8 / fp8 activation quantization included), sit in shared memory. Accumulation is f32.
//  * a tiled SIMT GEMM (64x64x16, f32) over generic dequantizing loaders for everything else:
//    any M, any alignment, any block shape.
// moe_experts gathers the tokens routed to each expert on the device (no host round trip) and runs
// the same tiled kernel on them: gate/up (+ silu*mul) into a workspace, then down, then a fixed-
// order weighted sum per token, so results do not depend on scheduling.
#include <vector>

#include "device.cuh"
#include "gemv_api.cuh"

using namespace di;

// ---------------------------------------------------------------------------------------- tile core
namespace {

constexpr int TB = 64, TK = 16, TPAD = 4;

// acc[i][j] += sum_k A(ty*4+i, k) * B(tx*4+j, k) over K; la/lb return 0 outside the problem.
template <class LA, class LB>
__device__ __forceinline__ void tile_mm(LA la, LB lb, int64_t K, float (&acc)[4][4], float (*As)[TB + TPAD],
                                        float (*Bs)[TB + TPAD]) {
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (int64_t k0 = 0; k0 < K; k0 += TK) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int idx = tid + 256 * i, r = idx / TK, kk = idx % TK;
            bool kin = k0 + kk < K;
            As[kk][r] = kin ? la(r, k0 + kk) : 0.f;
            Bs[kk][r] = kin ? lb(r, k0 + kk) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TK; ++kk) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
}

}  // namespace

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
#define WEIGHT_DTYPES DT_F32, DT_BF16, DT_F16, DT_E4M3, DT_E5M2, DT_I8, DT_I4, DT_U4, DT_E2M1

static DI_Status check_weight(DI_Context* ctx, const char* op, const char* name, const QTensor& w) {
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
        DI_NEED_DT(ctx, op, "x", x.q.dt, DT_F32, DT_BF16, DT_F16);
    } else {
        DI_NEED_DT(ctx, op, "x (activation-quantized)", x.q.dt, DT_I8, DT_E4M3);
        if (x.mode == 2)
            return set_error(ctx, DI_UNIMPLEMENTED, "%s: asymmetric activation quantization (x zeros) is not supported", op);
    }
    DI_TRY(check_weight(ctx, op, "w", w));
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_F32, DT_BF16, DT_F16);
    const int64_t M = x.q.shape[0], K = x.q.shape[1], N = w.q.shape[0];
    DI_TRY(need_shape(ctx, op, "w", w.q, 1, K, "x.shape[1]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, M, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, N, "w.shape[0]"));
    if (bias.q.base || (!mode->launch && a->bias.ndim == 1)) {
        DI_NEED_DT(ctx, op, "bias", bias.q.dt, DT_F32, DT_BF16, DT_F16);
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

// ---------------------------------------------------------------------------------------- moe_experts
constexpr int MOE_CHUNK = 32;        // experts per launch (their pointers travel as kernel params)
constexpr int MOE_WINDOW = 8192;     // routed pairs gathered per pass (shared memory list)

struct ExpertPtrs {
    char* q[MOE_CHUNK];
    char* s[MOE_CHUNK];
    char* z[MOE_CHUNK];
};

__device__ __forceinline__ QTensor with_ptrs(QTensor t, const ExpertPtrs& p, int i) {
    t.q.base = p.q[i];
    t.s.base = p.s[i];
    t.z.base = p.z[i];
    return t;
}

// Gathers into list the pairs p in [w0, w1) routed to expert e; returns their number.
__device__ int gather_pairs(DTensor ids, int64_t Ktop, int64_t e, int64_t w0, int64_t w1, int* list, int* cnt) {
    if (threadIdx.x == 0) *cnt = 0;
    __syncthreads();
    for (int64_t p = w0 + threadIdx.x; p < w1; p += blockDim.x) {
        int64_t t = p / Ktop, k = p % Ktop;
        if (load_i(ids.dt, ids.base, t * ids.strides[0] + k) == e) list[atomicAdd(cnt, 1)] = (int)(p - w0);
    }
    __syncthreads();
    return *cnt;
}

// Phase 1: h[p, :] = silu(gate_e x[t]) * (up_e x[t]) for every pair p = (t, k) routed to e.
__global__ __launch_bounds__(256) void k_moe_up(const __grid_constant__ QTensor x, DTensor ids, const QTensor wg0, ExpertPtrs gp, const QTensor wu0,
                                                ExpertPtrs up, int e0, int64_t P, int64_t Ktop, int64_t I, int64_t H,
                                                float* h) {
    extern __shared__ int list[];
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD], Bu[TK][TB + TPAD];
    __shared__ int cnt;
    const int bi = blockIdx.x;
    if (!gp.q[bi] || !up.q[bi]) return;
    const QTensor wg = with_ptrs(wg0, gp, bi), wu = with_ptrs(wu0, up, bi);
    const int64_t e = e0 + bi, n0 = (int64_t)blockIdx.y * TB;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (int64_t w0 = 0; w0 < P; w0 += MOE_WINDOW) {
        int n = gather_pairs(ids, Ktop, e, w0, min(P, w0 + MOE_WINDOW), list, &cnt);
        for (int j0 = 0; j0 < n; j0 += TB) {
            float ag[4][4] = {}, au[4][4] = {};
            for (int64_t k0 = 0; k0 < H; k0 += TK) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int idx = tid + 256 * i, r = idx / TK, kk = idx % TK;
                    int64_t k = k0 + kk;
                    bool kin = k < H;
                    int64_t t = j0 + r < n ? (w0 + list[j0 + r]) / Ktop : -1;
                    As[kk][r] = (kin && t >= 0) ? qload(x, 0, t, k) : 0.f;
                    bool nin = kin && n0 + r < I;
                    Bs[kk][r] = nin ? qload(wg, 0, n0 + r, k) : 0.f;
                    Bu[kk][r] = nin ? qload(wu, 0, n0 + r, k) : 0.f;
                }
                __syncthreads();
#pragma unroll
                for (int kk = 0; kk < TK; ++kk) {
                    float av[4], gv[4], uv[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i];
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) {
                        gv[jj] = Bs[kk][tx * 4 + jj];
                        uv[jj] = Bu[kk][tx * 4 + jj];
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i)
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj) {
                            ag[i][jj] += av[i] * gv[jj];
                            au[i][jj] += av[i] * uv[jj];
                        }
                }
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = ty * 4 + i;
                if (j0 + r >= n) continue;
                int64_t p = w0 + list[j0 + r];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    int64_t c = n0 + tx * 4 + jj;
                    if (c >= I) continue;
                    float g = ag[i][jj];
                    h[p * I + c] = g / (1.f + expf(-g)) * au[i][jj];
                }
            }
        }
        __syncthreads();
    }
}

// Phase 2: y[p, :] = down_e h[p, :].
__global__ __launch_bounds__(256) void k_moe_down(const float* h, DTensor ids, QTensor wd0, ExpertPtrs dp, int e0,
                                                  int64_t P, int64_t Ktop, int64_t I, int64_t H, float* y) {
    extern __shared__ int list[];
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD];
    __shared__ int cnt;
    const int bi = blockIdx.x;
    if (!dp.q[bi]) return;
    const QTensor wd = with_ptrs(wd0, dp, bi);
    const int64_t e = e0 + bi, n0 = (int64_t)blockIdx.y * TB;
    for (int64_t w0 = 0; w0 < P; w0 += MOE_WINDOW) {
        int n = gather_pairs(ids, Ktop, e, w0, min(P, w0 + MOE_WINDOW), list, &cnt);
        for (int j0 = 0; j0 < n; j0 += TB) {
            float acc[4][4] = {};
            auto la = [&](int r, int64_t k) {
                return j0 + r < n ? h[(w0 + list[j0 + r]) * I + k] : 0.f;
            };
            auto lb = [&](int r, int64_t k) { return n0 + r < H ? qload(wd, 0, n0 + r, k) : 0.f; };
            tile_mm(la, lb, I, acc, As, Bs);
            const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = ty * 4 + i;
                if (j0 + r >= n) continue;
                int64_t p = w0 + list[j0 + r];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    int64_t c = n0 + tx * 4 + jj;
                    if (c < H) y[p * H + c] = acc[i][jj];
                }
            }
        }
        __syncthreads();
    }
}

// Phase 3: out[t] (+)= sum_k w[t, k] * y[t*K + k] over valid, resident experts, in k order.
__global__ void k_moe_combine(const float* y, DTensor ids, DTensor tw, const uint8_t* resident, int64_t E,
                              int64_t T, int64_t Ktop, int64_t H, DTensor out, int accumulate) {
    int64_t n = T * H;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / H, c = i % H;
        float acc = 0.f;
        for (int64_t k = 0; k < Ktop; ++k) {
            int64_t e = load_i(ids.dt, ids.base, t * ids.strides[0] + k);
            if (e < 0 || e >= E || !resident[e]) continue;
            acc += load_f(tw.dt, tw.base, t * tw.strides[0] + k) * y[(t * Ktop + k) * H + c];
        }
        int64_t o = t * out.strides[0] + c;
        if (accumulate) acc += load_f(out.dt, out.base, o);
        store_f(out.dt, out.base, o, acc);
    }
}

static bool same_layout(const DI_Tensor& a, const DI_Tensor& b) {
    if (a.ndim != b.ndim || a.dtype.code != b.dtype.code || a.dtype.bits != b.dtype.bits) return false;
    for (int d = 0; d < a.ndim; ++d)
        if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
    if (!a.quant != !b.quant) return false;
    if (a.quant) {
        const DI_Quant &p = *a.quant, &q = *b.quant;
        if (p.block_rows != q.block_rows || p.block_cols != q.block_cols) return false;
        if (!same_layout(p.scales, q.scales)) return false;
        if (!p.zeros.data != !q.zeros.data) return false;
        if (p.zeros.data && !same_layout(p.zeros, q.zeros)) return false;
    }
    return true;
}

DI_Status op_moe_experts(DI_Context* ctx, const DI_MoEExpertsArgs* a, OpMode* mode) {
    const char* op = "moe_experts";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MoEExpertsArgs"));
    QTensor x, ids, tw, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, T_ALLOW_Q, &x));
    DI_TRY(take_tensor(ctx, mode, op, "topk_ids", a->topk_ids, 2, 0, &ids));
    DI_TRY(take_tensor(ctx, mode, op, "topk_weights", a->topk_weights, 2, 0, &tw));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    if (x.mode == 0) DI_NEED_DT(ctx, op, "x", x.q.dt, DT_F32, DT_BF16, DT_F16);
    else DI_NEED_DT(ctx, op, "x (activation-quantized)", x.q.dt, DT_I8, DT_E4M3);
    DI_NEED_DT(ctx, op, "topk_ids", ids.q.dt, DT_I32, DT_I64);
    DI_NEED_DT(ctx, op, "topk_weights", tw.q.dt, DT_F32, DT_BF16, DT_F16);
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_F32, DT_BF16, DT_F16);
    const int64_t T = x.q.shape[0], H = x.q.shape[1], Ktop = ids.q.shape[1], E = a->num_experts;
    DI_TRY(need_shape(ctx, op, "topk_ids", ids.q, 0, T, "x.shape[0]"));
    DI_TRY(same_shape(ctx, op, "topk_ids", ids.q, "topk_weights", tw.q));
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    if (E < 0) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: num_experts=%lld is negative", op, (long long)E);
    if (E > 0 && (!a->w_gate || !a->w_up || !a->w_down))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: w_gate, w_up and w_down must point to num_experts descriptors", op);
    // Validate every resident expert (in query mode: every one that has a shape).
    OpMode em = *mode;  // expert weights: hundreds of descriptors, no per-pointer driver lookups
    em.check_ptrs = false;
    std::vector<uint8_t> resident((size_t)E, 0);
    int64_t I = -1, first = -1;
    char name[64];
    for (int64_t e = 0; e < E; ++e) {
        const DI_Tensor *g = &a->w_gate[e], *u = &a->w_up[e], *d = &a->w_down[e];
        bool here = mode->launch ? (g->data && u->data && d->data) : (g->ndim == 2 && u->ndim == 2 && d->ndim == 2);
        if (mode->launch && !here && (g->data || u->data || d->data))
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: expert %lld is partly resident (some of gate/up/down NULL)",
                             op, (long long)e);
        if (!here) continue;
        QTensor tg, tu, td;
        snprintf(name, sizeof(name), "w_gate[%lld]", (long long)e);
        DI_TRY(take_tensor(ctx, &em, op, name, *g, 2, T_ALLOW_Q, &tg));
        DI_TRY(check_weight(ctx, op, name, tg));
        snprintf(name, sizeof(name), "w_up[%lld]", (long long)e);
        DI_TRY(take_tensor(ctx, &em, op, name, *u, 2, T_ALLOW_Q, &tu));
        DI_TRY(check_weight(ctx, op, name, tu));
        snprintf(name, sizeof(name), "w_down[%lld]", (long long)e);
        DI_TRY(take_tensor(ctx, &em, op, name, *d, 2, T_ALLOW_Q, &td));
        DI_TRY(check_weight(ctx, op, name, td));
        if (I < 0) I = tg.q.shape[0];
        if (tg.q.shape[0] != I || tu.q.shape[0] != I || td.q.shape[1] != I || tg.q.shape[1] != H ||
            tu.q.shape[1] != H || td.q.shape[0] != H)
            return set_error(ctx, DI_INVALID_ARGUMENT,
                             "%s: expert %lld has gate %lldx%lld, up %lldx%lld, down %lldx%lld; expected [I, %lld], "
                             "[I, %lld], [%lld, I] with one I for all experts",
                             op, (long long)e, (long long)tg.q.shape[0], (long long)tg.q.shape[1],
                             (long long)tu.q.shape[0], (long long)tu.q.shape[1], (long long)td.q.shape[0],
                             (long long)td.q.shape[1], (long long)H, (long long)H, (long long)H);
        resident[(size_t)e] = 1;
        if (first < 0) first = e;
    }
    const int64_t P = T * Ktop;
    if (I < 0) I = 0;
    mode->workspace = align256((uint64_t)P * (uint64_t)I * 4) + align256((uint64_t)P * (uint64_t)H * 4) + align256((uint64_t)E);
    if (!mode->launch || T == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;

    // A token routed to a non-resident expert is an error the caller must see; checking needs the
    // ids on the host, so only calls that have non-resident experts pay for that round trip.
    bool all_resident = true;
    for (int64_t e = 0; e < E; ++e) all_resident &= resident[(size_t)e] != 0;
    if (!all_resident && P > 0) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        DI_TRY(cuda_status(ctx, cudaStreamIsCapturing(s, &cs), "moe_experts: cudaStreamIsCapturing"));
        if (cs == cudaStreamCaptureStatusNone) {
            int bytes = ids.q.dt == DT_I64 ? 8 : 4;
            std::vector<char> host((size_t)(T * Ktop * bytes));
            DI_TRY(cuda_status(ctx,
                               cudaMemcpy2DAsync(host.data(), Ktop * bytes, ids.q.base, ids.q.strides[0] * bytes,
                                                 Ktop * bytes, T, cudaMemcpyDeviceToHost, s),
                               "moe_experts: reading topk_ids"));
            DI_TRY(cuda_status(ctx, cudaStreamSynchronize(s), "moe_experts: reading topk_ids"));
            for (int64_t p = 0; p < P; ++p) {
                int64_t e = bytes == 8 ? reinterpret_cast<int64_t*>(host.data())[p]
                                       : reinterpret_cast<int32_t*>(host.data())[p];
                if (e >= 0 && e < E && !resident[(size_t)e])
                    return set_error(ctx, DI_FAILED_PRECONDITION, "%s: expert %lld not resident (token %lld, k %lld)",
                                     op, (long long)e, (long long)(p / Ktop), (long long)(p % Ktop));
            }
        }
        // while capturing the check cannot run; non-resident experts then contribute nothing
    }

    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    char* wsb = static_cast<char*>(ws.ptr);
    float* h = reinterpret_cast<float*>(wsb);
    float* y = reinterpret_cast<float*>(wsb + align256((uint64_t)P * I * 4));
    uint8_t* res_dev = reinterpret_cast<uint8_t*>(wsb + align256((uint64_t)P * I * 4) + align256((uint64_t)P * H * 4));
    DI_Status st = DI_OK;
    if (E > 0) {
        // resident flags travel through a stream-ordered set of tiny memsets (capturable, no host buffer)
        st = cuda_status(ctx, cudaMemsetAsync(res_dev, 0, (size_t)E, s), "moe_experts: cudaMemsetAsync");
        for (int64_t e = 0; e < E && st == DI_OK; ) {
            if (!resident[(size_t)e]) { ++e; continue; }
            int64_t e1 = e;
            while (e1 < E && resident[(size_t)e1]) ++e1;
            st = cuda_status(ctx, cudaMemsetAsync(res_dev + e, 1, (size_t)(e1 - e), s), "moe_experts: cudaMemsetAsync");
            e = e1;
        }
    }
    const size_t list_bytes = MOE_WINDOW * sizeof(int);
    if (st == DI_OK && P > 0 && I > 0 && H > 0) {
        cudaFuncSetAttribute(k_moe_up, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)list_bytes);
        cudaFuncSetAttribute(k_moe_down, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)list_bytes);
        // Groups of up to MOE_CHUNK consecutive experts that share one layout go in one launch.
        for (int phase = 0; phase < 2 && st == DI_OK; ++phase) {
            int64_t e = 0;
            while (e < E && st == DI_OK) {
                if (!resident[(size_t)e]) { ++e; continue; }
                const int64_t e0 = e;
                ExpertPtrs p1{}, p2{};
                QTensor t1, t2;
                const DI_Tensor* w1 = phase == 0 ? &a->w_gate[e0] : &a->w_down[e0];
                DI_TRY(take_tensor(ctx, &em, op, "w", *w1, 2, T_ALLOW_Q, &t1));
                if (phase == 0) DI_TRY(take_tensor(ctx, &em, op, "w_up", a->w_up[e0], 2, T_ALLOW_Q, &t2));
                int64_t cnt = 0;
                while (e < E && cnt < MOE_CHUNK) {
                    if (resident[(size_t)e]) {
                        const DI_Tensor* we = phase == 0 ? &a->w_gate[e] : &a->w_down[e];
                        if (!same_layout(*we, *w1)) break;
                        if (phase == 0 && !same_layout(a->w_up[e], a->w_up[e0])) break;
                        QTensor te;
                        DI_TRY(take_tensor(ctx, &em, op, "w", *we, 2, T_ALLOW_Q, &te));
                        p1.q[cnt] = te.q.base; p1.s[cnt] = te.s.base; p1.z[cnt] = te.z.base;
                        if (phase == 0) {
                            DI_TRY(take_tensor(ctx, &em, op, "w_up", a->w_up[e], 2, T_ALLOW_Q, &te));
                            p2.q[cnt] = te.q.base; p2.s[cnt] = te.s.base; p2.z[cnt] = te.z.base;
                        }
                    }
                    ++cnt;
                    ++e;
                }
                if (phase == 0) {
                    dim3 grid((unsigned)cnt, (unsigned)ceil_div(I, TB));
                    k_moe_up<<<grid, 256, list_bytes, s>>>(x, ids.q, t1, p1, t2, p2, (int)e0, P, Ktop, I, H, h);
                } else {
                    dim3 grid((unsigned)cnt, (unsigned)ceil_div(H, TB));
                    k_moe_down<<<grid, 256, list_bytes, s>>>(h, ids.q, t1, p1, (int)e0, P, Ktop, I, H, y);
                }
                st = launch_status(ctx, op);
            }
        }
    }
    if (st == DI_OK) {
        if (P == 0 || I == 0) {
            // nothing routed anywhere: y is all zero
            st = cuda_status(ctx, cudaMemsetAsync(y, 0, (size_t)P * H * 4, s), "moe_experts: cudaMemsetAsync");
        }
    }
    if (st == DI_OK && T * H > 0) {
        k_moe_combine<<<grid_for(T * H, 256), 256, 0, s>>>(y, ids.q, tw.q, res_dev, E, T, Ktop, H, out.q,
                                                           a->accumulate ? 1 : 0);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}
