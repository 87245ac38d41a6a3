// rmsnorm and layernorm (1.3; its kernel is in norm.cuh, where tests/gpu_emu runs it on the CPU).
// Each works on strided views through the generic loaders; all math in f32.
#include "arg_checks.cuh"
#include "device.cuh"
#include "norm.cuh"
#include "pdl.cuh"
#include "vec8.cuh"

#include <algorithm>

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

// ---------------------------------------------------------------------------------------- rmsnorm
// One block per row; the row sum s lives in shared memory so residual_out may alias x or residual.
__global__ void k_rmsnorm(DTensor x, DTensor w, DTensor res, DTensor out, DTensor res_out, int64_t T, int64_t H,
                          float eps) {
    extern __shared__ float s[];
    __shared__ float red[MAX_WARPS];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        float ss = 0.f;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float v = load_f(x.dt, x.base, t * x.strides[0] + h);
            if (res.base) v += load_f(res.dt, res.base, t * res.strides[0] + h);
            s[h] = v;
            ss += v * v;
        }
        ss = block_sum(ss, red);  // also a barrier: every read of x and residual is done
        float r = rsqrtf(ss / (float)H + eps);
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float v = s[h];
            if (res_out.base) store_f(res_out.dt, res_out.base, t * res_out.strides[0] + h, v);
            store_f(out.dt, out.base, t * out.strides[0] + h, v * r * load_f(w.dt, w.base, h));
        }
        __syncthreads();
    }
}

// The fast path (every row contiguous and 16-byte aligned, one activation dtype AT, weight WT): a row's
// elements stay in registers, VPT vectors of 8 per thread, so x and residual are read once with
// 16-byte loads and the generic loaders' per-element dtype decode is gone. Same math as k_rmsnorm.
template <int AT, int WT, int VPT>
__global__ __launch_bounds__(1024) void k_rmsnorm_vec(DTensor x, DTensor w, DTensor res, DTensor out, DTensor res_out,
                                                      int64_t T, int H, float eps) {
    __shared__ float red[MAX_WARPS];
    const int nv = H / 8;
    // the weight into L2 before the wait (a hint only: the weight is read after it, since a caller may
    // pass one an earlier op wrote), then into registers once for every row of the block
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nv) prefetch_l2(w.base + ((int64_t)i * 8 << dt_lg(WT)));
    }
    pdl_wait();
    pdl_trigger();
    float wv[VPT][8];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nv) load8<WT>(w.base, i * 8, wv[j]);
    }
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        float v[VPT][8];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i >= nv) continue;
            load8<AT>(x.base, t * x.strides[0] + i * 8, v[j]);
            if (res.base) {
                float r8[8];
                load8<AT>(res.base, t * res.strides[0] + i * 8, r8);
#pragma unroll
                for (int k = 0; k < 8; ++k) v[j][k] += r8[k];
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) ss += v[j][k] * v[j][k];
        }
        ss = block_sum(ss, red);  // also a barrier: every read of x and residual is done
        const float r = rsqrtf(ss / (float)H + eps);
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i >= nv) continue;
            if (res_out.base) store8<AT>(res_out.base, t * res_out.strides[0] + i * 8, v[j]);
            float o[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) o[k] = v[j][k] * r * wv[j][k];
            store8<AT>(out.base, t * out.strides[0] + i * 8, o);
        }
    }
}

template <int AT, int WT>
static void launch_rmsnorm_vec(const DTensor& x, const DTensor& w, const DTensor& res, const DTensor& out,
                               const DTensor& ro, int64_t T, int H, float eps, cudaStream_t s) {
    const int nv = H / 8;
    const unsigned g = grid_for(T, 1, 65535);
    auto threads = [&](int vpt) { return (int)std::min<int64_t>(1024, ceil_div(ceil_div(nv, vpt), LANES) * LANES); };
    if (nv <= 1024) launch_pdl(k_rmsnorm_vec<AT, WT, 1>, g, threads(1), 0, s, x, w, res, out, ro, T, H, eps);
    else if (nv <= 2048) launch_pdl(k_rmsnorm_vec<AT, WT, 2>, g, threads(2), 0, s, x, w, res, out, ro, T, H, eps);
    else launch_pdl(k_rmsnorm_vec<AT, WT, 4>, g, threads(4), 0, s, x, w, res, out, ro, T, H, eps);
}

// rows of at most 4 * 1024 vectors of 8 (H <= 32768), every tensor row-contiguous and aligned, x,
// residual, out and residual_out of one dtype
static bool rmsnorm_vec_ok(const QTensor& x, const QTensor& w, const QTensor& res, const QTensor& out,
                           const QTensor& ro) {
    const int dt = x.q.dt;
    if (!vec8_rows(x.q) || !vec8_rows(w.q) || !vec8_rows(out.q) || out.q.dt != dt) return false;
    if (res.q.base && (!vec8_rows(res.q) || res.q.dt != dt)) return false;
    if (ro.q.base && (!vec8_rows(ro.q) || ro.q.dt != dt)) return false;
    return x.q.shape[1] <= 4 * 1024 * 8;
}

DI_Status op_rmsnorm(DI_Context* ctx, const DI_RMSNormArgs* a, OpMode* mode) {
    const char* op = "rmsnorm";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_RMSNormArgs"));
    QTensor x, w, res, out, ro;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "weight", a->weight, 1, 0, &w));
    DI_TRY(take_tensor(ctx, mode, op, "residual", a->residual, 2, T_OPTIONAL, &res));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_TRY(take_tensor(ctx, mode, op, "residual_out", a->residual_out, 2, T_OPTIONAL, &ro));
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "weight", w.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    if (res.q.base) {
        DI_NEED_DT(ctx, op, "residual", res.q.dt, FLOATS);
        DI_TRY(same_shape(ctx, op, "x", x.q, "residual", res.q));
    }
    if (ro.q.base) {
        DI_NEED_DT(ctx, op, "residual_out", ro.q.dt, FLOATS);
        DI_TRY(same_shape(ctx, op, "x", x.q, "residual_out", ro.q));
    }
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_shape(ctx, op, "weight", w.q, 0, x.q.shape[1], "x.shape[1]"));
    int64_t T = x.q.shape[0], H = x.q.shape[1];
    size_t smem = (size_t)H * sizeof(float);
    if (smem > DYN_SMEM_MAX)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: hidden size %lld exceeds this kernel's limit (%zu)", op,
                         (long long)H, DYN_SMEM_MAX / sizeof(float));
    if (!mode->launch || T == 0 || H == 0) return DI_OK;
    cudaStream_t st = (cudaStream_t)a->header.stream;
    if (rmsnorm_vec_ok(x, w, res, out, ro)) {
        const bool wb = w.q.dt == DT_BF16;
        if (x.q.dt == DT_BF16) {
            if (wb) launch_rmsnorm_vec<DT_BF16, DT_BF16>(x.q, w.q, res.q, out.q, ro.q, T, (int)H, a->eps, st);
            else launch_rmsnorm_vec<DT_BF16, DT_F32>(x.q, w.q, res.q, out.q, ro.q, T, (int)H, a->eps, st);
        } else {
            if (wb) launch_rmsnorm_vec<DT_F32, DT_BF16>(x.q, w.q, res.q, out.q, ro.q, T, (int)H, a->eps, st);
            else launch_rmsnorm_vec<DT_F32, DT_F32>(x.q, w.q, res.q, out.q, ro.q, T, (int)H, a->eps, st);
        }
        return launch_status(ctx, op);
    }
    if (smem > 48 * 1024)
        (void)cudaFuncSetAttribute(k_rmsnorm, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    k_rmsnorm<<<grid_for(T, 1, 65535), 512, smem, st>>>(x.q, w.q, res.q, out.q, ro.q, T, H,
                                                                                 a->eps);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- layernorm
DI_Status op_layernorm(DI_Context* ctx, const DI_LayerNormArgs* a, OpMode* mode) {
    const char* op = "layernorm";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_LayerNormArgs"));
    QTensor x, w, b, out;
    bool has_bias;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "weight", a->weight, 1, 0, &w));
    DI_TRY(take_opt(ctx, mode, op, "bias", a->bias, 1, &b, &has_bias));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "weight", w.q.dt, FLOATS);
    if (has_bias) DI_NEED_DT(ctx, op, "bias", b.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    const int64_t T = x.q.shape[0], H = x.q.shape[1];
    DI_TRY(need_shape(ctx, op, "weight", w.q, 0, H, "x.shape[1]"));
    if (has_bias) DI_TRY(need_shape(ctx, op, "bias", b.q, 0, H, "x.shape[1]"));
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_finite(ctx, op, "eps", a->eps, true));
    if (!mode->launch || T == 0 || H == 0) return DI_OK;
    k_layernorm<<<grid_for(T, 1, 65535), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, w.q, b.q, out.q, T, H, a->eps);
    return launch_status(ctx, op);
}
