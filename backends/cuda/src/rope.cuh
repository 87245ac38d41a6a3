// The rotary frequencies that rope (rope.cu) and mla_rope_cache_write (mla_rope_cache_write.cu) share:
// the angle of pair j in f64 (YaRN's ramp between the inverse frequencies included), and on the host
// the checks of the rope arguments and the ramp's ends. One statement, so the fused op's rotation is
// rope's term for term.
#pragma once

#include "device.cuh"

namespace di {

struct RopeFreq {
    int64_t D;        // the rotated width (pairs: D / 2)
    int32_t yarn, pad_;
    double  theta, factor, low, high, attn;
};

// the inverse frequency of pair j (YaRN's ramp applied): depends on nothing a kernel before wrote
__device__ __forceinline__ double rope_inv_freq(const RopeFreq& f, int64_t j) {
    double inv = pow(f.theta, -2.0 * (double)j / (double)f.D);
    if (f.yarn) {
        double ramp = ((double)j - f.low) / (f.high - f.low);
        ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
        inv = inv / f.factor * ramp + inv * (1.0 - ramp);
    }
    return inv;
}

// cos and sin (times attn_factor) of the pair of inverse frequency inv at position pos
__device__ __forceinline__ void rope_cos_sin_at(const RopeFreq& f, double inv, double pos, float* c, float* s) {
    const double ang = pos * inv;
    *c = (float)(cos(ang) * f.attn);
    *s = (float)(sin(ang) * f.attn);
}

// cos and sin (times attn_factor) of pair j at position pos
__device__ __forceinline__ void rope_cos_sin(const RopeFreq& f, int64_t j, double pos, float* c, float* s) {
    rope_cos_sin_at(f, rope_inv_freq(f, j), pos, c, s);
}

#if !defined(DI_GPU_HOST_EMU)
// The frequencies of a D-wide rotation from the rope fields of an op's args (DI_RopeArgs' meaning),
// checked: a known scaling, theta > 0 (and finite when finite_theta), YaRN's parameters > 0.
inline DI_Status rope_freq(DI_Context* ctx, const char* op, int64_t D, int32_t scaling, float theta, float factor,
                           int32_t original_max_position, float beta_fast, float beta_slow, float attn_factor,
                           bool finite_theta, RopeFreq* f) {
    if (scaling != DI_ROPE_NONE && scaling != DI_ROPE_YARN)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: scaling=%d is not a known DI_RopeScaling", op, scaling);
    if (!(theta > 0.f) || (finite_theta && !isfinite(theta)))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: theta=%g must be > 0", op, theta);
    *f = RopeFreq{};
    f->D = D;
    f->theta = theta;
    f->attn = attn_factor;
    if (scaling == DI_ROPE_YARN) {
        if (!(factor > 0.f) || original_max_position <= 0 || !(beta_fast > 0.f) || !(beta_slow > 0.f))
            return set_error(ctx, DI_INVALID_ARGUMENT,
                             "%s: yarn needs factor, original_max_position, beta_fast and beta_slow > 0", op);
        const double PI = 3.14159265358979323846;
        auto dim = [&](double b) {
            return (double)D * log((double)original_max_position / (2.0 * PI * b)) / (2.0 * log((double)theta));
        };
        double lo = floor(dim(beta_fast)), hi = ceil(dim(beta_slow));
        lo = lo < 0 ? 0 : (lo > D - 1 ? D - 1 : lo);
        hi = hi < 0 ? 0 : (hi > D - 1 ? D - 1 : hi);
        if (lo == hi) hi += 0.001;
        f->yarn = 1;
        f->factor = factor;
        f->low = lo;
        f->high = hi;
    }
    return DI_OK;
}
#endif

}  // namespace di
