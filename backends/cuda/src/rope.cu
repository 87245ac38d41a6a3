// rope, on strided views through the generic loaders; math in f32, angles in f64.
#include "device.cuh"
#include "rope.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

// ---------------------------------------------------------------------------------------- rope
struct RopeP {
    int64_t  T, H;
    int32_t  interleaved, pad_;
    RopeFreq f;
};

__global__ void k_rope(DTensor x, DTensor pos, DTensor out, RopeP p) {
    int64_t half = p.f.D / 2, n = p.T * p.H * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = i % half, th = i / half, h = th % p.H, t = th / p.H;
        float c, s;
        rope_cos_sin(p.f, j, (double)load_i(pos.dt, pos.base, t * pos.strides[0]), &c, &s);
        int64_t xo = t * x.strides[0] + (x.ndim == 3 ? h * x.strides[1] : 0);
        int64_t oo = t * out.strides[0] + (out.ndim == 3 ? h * out.strides[1] : 0);
        int64_t i0 = p.interleaved ? 2 * j : j, i1 = p.interleaved ? 2 * j + 1 : j + half;
        float u = load_f(x.dt, x.base, xo + i0), v = load_f(x.dt, x.base, xo + i1);
        store_f(out.dt, out.base, oo + i0, u * c - v * s);
        store_f(out.dt, out.base, oo + i1, v * c + u * s);
    }
}

DI_Status op_rope(DI_Context* ctx, const DI_RopeArgs* a, OpMode* mode) {
    const char* op = "rope";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_RopeArgs"));
    QTensor x, pos, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, -1, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "positions", a->positions, 1, 0, &pos));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, -1, 0, &out));
    if (x.q.ndim != 2 && x.q.ndim != 3)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: x.ndim=%d, expected 2 ([T, D]) or 3 ([T, H, D])", op, x.q.ndim);
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "positions", pos.q.dt, DT_I32);
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_shape(ctx, op, "positions", pos.q, 0, x.q.shape[0], "x.shape[0]"));
    int64_t D = x.q.shape[x.q.ndim - 1];
    if (D % 2) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: rotary dim D=%lld is odd", op, (long long)D);
    RopeP p{};
    p.T = x.q.shape[0];
    p.H = x.q.ndim == 3 ? x.q.shape[1] : 1;
    p.interleaved = a->interleaved ? 1 : 0;
    DI_TRY(rope_freq(ctx, op, D, a->scaling, a->theta, a->factor, a->original_max_position, a->beta_fast,
                     a->beta_slow, a->attn_factor, false, &p.f));
    if (!mode->launch) return DI_OK;
    int64_t n = p.T * p.H * (D / 2);
    if (n == 0) return DI_OK;
    k_rope<<<grid_for(n, 256), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, pos.q, out.q, p);
    return launch_status(ctx, op);
}
