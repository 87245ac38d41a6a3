// rmsnorm and layernorm (1.3; its kernel is in norm.cuh, where tests/gpu_emu runs it on the CPU).
// Each works on strided views through the generic loaders; all math in f32.
#include "arg_checks.cuh"
#include "device.cuh"
#include "norm.cuh"

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
    if (smem > 48 * 1024)
        (void)cudaFuncSetAttribute(k_rmsnorm, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    k_rmsnorm<<<grid_for(T, 1, 65535), 512, smem, (cudaStream_t)a->header.stream>>>(x.q, w.q, res.q, out.q, ro.q, T, H,
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
