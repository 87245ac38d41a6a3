// rope, on strided views through the generic loaders; math in f32, angles in f64.
#include "device.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

// ---------------------------------------------------------------------------------------- rope
struct RopeP {
    int64_t T, H, D;
    int32_t interleaved, yarn;
    double  theta, factor, low, high, attn;
};

__global__ void k_rope(DTensor x, DTensor pos, DTensor out, RopeP p) {
    int64_t half = p.D / 2, n = p.T * p.H * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = i % half, th = i / half, h = th % p.H, t = th / p.H;
        double inv = pow(p.theta, -2.0 * (double)j / (double)p.D);
        if (p.yarn) {
            double ramp = ((double)j - p.low) / (p.high - p.low);
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            inv = inv / p.factor * ramp + inv * (1.0 - ramp);
        }
        double ang = (double)load_i(pos.dt, pos.base, t * pos.strides[0]) * inv;
        float c = (float)(cos(ang) * p.attn), s = (float)(sin(ang) * p.attn);
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
    if (a->scaling != DI_ROPE_NONE && a->scaling != DI_ROPE_YARN)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: scaling=%d is not a known DI_RopeScaling", op, a->scaling);
    if (!(a->theta > 0.f)) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: theta=%g must be > 0", op, a->theta);
    RopeP p{};
    p.T = x.q.shape[0];
    p.H = x.q.ndim == 3 ? x.q.shape[1] : 1;
    p.D = D;
    p.interleaved = a->interleaved ? 1 : 0;
    p.theta = a->theta;
    p.attn = a->attn_factor;
    if (a->scaling == DI_ROPE_YARN) {
        if (!(a->factor > 0.f) || a->original_max_position <= 0 || !(a->beta_fast > 0.f) || !(a->beta_slow > 0.f))
            return set_error(ctx, DI_INVALID_ARGUMENT,
                             "%s: yarn needs factor, original_max_position, beta_fast and beta_slow > 0", op);
        const double PI = 3.14159265358979323846;
        auto dim = [&](double b) {
            return (double)D * log((double)a->original_max_position / (2.0 * PI * b)) / (2.0 * log((double)a->theta));
        };
        double lo = floor(dim(a->beta_fast)), hi = ceil(dim(a->beta_slow));
        lo = lo < 0 ? 0 : (lo > D - 1 ? D - 1 : lo);
        hi = hi < 0 ? 0 : (hi > D - 1 ? D - 1 : hi);
        if (lo == hi) hi += 0.001;
        p.yarn = 1;
        p.factor = a->factor;
        p.low = lo;
        p.high = hi;
    }
    if (!mode->launch) return DI_OK;
    int64_t n = p.T * p.H * (D / 2);
    if (n == 0) return DI_OK;
    k_rope<<<grid_for(n, 256), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, pos.q, out.q, p);
    return launch_status(ctx, op);
}
