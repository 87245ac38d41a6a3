/* rope: rotary position embedding of each row's rope features, angles in double.
 * All math in f32 (double where a long sum would drift), one rounding to the output dtype at the
 * end. Inputs are read into f32 row buffers before any output of that row is written, which is what
 * makes the allowed aliasing (out == x, residual_out == residual) safe. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "op_rows.h"

/* ------------------------------------------------------------------ rope */
typedef struct {
    const DI_RopeArgs* a;
    int xd, od, inter;
    int64_t T, H, D;
    const double* inv;
    const int32_t* pos;
    int64_t pos_stride;
    Scratch s;
} RopeJob;

/* The pieces of rope that the fused mla_rope_cache_write (fused.c) shares, so both compute the
 * same bits: the parameter checks, the frequencies, one position's cos / sin and one row's rotation. */
DI_Status rope_check_params(DI_Context* ctx, const char* op, int32_t interleaved, int32_t scaling, float theta,
                            float factor, int32_t original_max_position, float beta_fast, float beta_slow) {
    if (interleaved != 0 && interleaved != 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: interleaved=%d, expected 0 or 1", op, interleaved);
    if (scaling != DI_ROPE_NONE && scaling != DI_ROPE_YARN)
        return di_fail(ctx, DI_UNIMPLEMENTED, "%s: scaling=%d is not implemented (0 none, 1 yarn)", op, scaling);
    if (!(theta > 0.0f) || !isfinite(theta))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: theta=%g must be positive", op, (double)theta);
    if (scaling == DI_ROPE_YARN && (!(factor > 0.0f) || original_max_position <= 0 || !(beta_fast > 0.0f) ||
                                    !(beta_slow > 0.0f)))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: yarn needs factor > 0, original_max_position > 0 and "
                       "beta_fast, beta_slow > 0 (got %g, %d, %g, %g)", op, (double)factor, original_max_position,
                       (double)beta_fast, (double)beta_slow);
    return DI_OK;
}

void rope_inv_freq(int64_t D, int32_t scaling, float theta, float factor, int32_t original_max_position,
                   float beta_fast, float beta_slow, double* inv) {
    int64_t half = D / 2;
    double th = theta, low = 0, high = 0;
    if (scaling == DI_ROPE_YARN) {
        double omp = original_max_position;
        double dl = D * log(omp / (2 * M_PI * beta_fast)) / (2 * log(th));
        double dh = D * log(omp / (2 * M_PI * beta_slow)) / (2 * log(th));
        low = floor(dl); high = ceil(dh);
        if (low < 0) low = 0;
        if (low > D - 1) low = (double)(D - 1);
        if (high < 0) high = 0;
        if (high > D - 1) high = (double)(D - 1);
        if (low == high) high += 0.001;
    }
    for (int64_t i = 0; i < half; i++) {
        double f = pow(th, -2.0 * (double)i / (double)D);
        if (scaling == DI_ROPE_YARN) {
            double r = ((double)i - low) / (high - low);
            r = r < 0 ? 0 : r > 1 ? 1 : r;
            f = f / factor * r + f * (1 - r);
        }
        inv[i] = f;
    }
}

void rope_cos_sin(double pos, const double* inv, int64_t half, float attn_factor, float* c, float* s) {
    for (int64_t i = 0; i < half; i++) {
        /* f64 angles: large positions lose whole radians' worth of bits in f32 (the reference
         * computes the exact value in f64 too) */
        double ang = pos * inv[i];
        c[i] = (float)(cos(ang) * (double)attn_factor);
        s[i] = (float)(sin(ang) * (double)attn_factor);
    }
}

void rope_rotate(float* row, const float* c, const float* s, int64_t D, int inter) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        int64_t iu = inter ? 2 * i : i, iv = inter ? 2 * i + 1 : i + half;
        float u = row[iu], vv = row[iv];
        row[iu] = u * c[i] - vv * s[i];
        row[iv] = vv * c[i] + u * s[i];
    }
}

static void rope_task(void* arg, int64_t t, int worker) {
    const RopeJob* j = (const RopeJob*)arg;
    const DI_RopeArgs* a = j->a;
    int64_t half = j->D / 2;
    float* c = scratch_get(&j->s, worker, 0);
    float* s = c + half;
    float* row = s + half;
    rope_cos_sin((double)j->pos[t * j->pos_stride], j->inv, half, a->attn_factor, c, s);
    for (int64_t h = 0; h < j->H; h++) {
        int64_t xo = t * a->x.strides[0] + (a->x.ndim == 3 ? h * a->x.strides[1] : 0);
        int64_t oo = t * a->out.strides[0] + (a->out.ndim == 3 ? h * a->out.strides[1] : 0);
        load_row(j->xd, t_at(&a->x, j->xd, xo), 0, j->D, row);
        rope_rotate(row, c, s, j->D, j->inter);
        store_row(j->od, t_at(&a->out, j->od, oo), row, j->D);
    }
}

DI_Status op_rope(DI_Context* ctx, const DI_RopeArgs* a, int query) {
    VC v = {ctx, "rope", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 2, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->positions, "positions", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_dim(&v, &a->positions, "positions", 0, a->x.shape[0]))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    int64_t D = a->x.shape[a->x.ndim - 1];
    if (D % 2) return di_fail(ctx, DI_INVALID_ARGUMENT, "rope: the rotated dim D=%lld must be even", (long long)D);
    if ((st = rope_check_params(ctx, "rope", a->interleaved, a->scaling, a->theta, a->factor,
                                a->original_max_position, a->beta_fast, a->beta_slow)))
        return st;
    if (query) return DI_OK;
    RopeJob j;
    memset(&j, 0, sizeof j);
    j.a = a;
    j.xd = dt_id(a->x.dtype); j.od = dt_id(a->out.dtype);
    j.inter = a->interleaved;
    j.T = a->x.shape[0]; j.H = a->x.ndim == 3 ? a->x.shape[1] : 1; j.D = D;
    j.pos = (const int32_t*)t_base(&a->positions);
    j.pos_stride = a->positions.strides[0];
    if (!j.T || !D) return DI_OK;
    int64_t half = D / 2;
    double* inv = di_malloc((size_t)half * sizeof(double));
    if (!inv || !scratch_init(&j.s, ctx, 2 * half + D)) { free(inv); return DI_OOM(ctx, "rope"); }
    rope_inv_freq(D, a->scaling, a->theta, a->factor, a->original_max_position, a->beta_fast, a->beta_slow, inv);
    j.inv = inv;
    pool_run(ctx->pool, j.T, rope_task, &j, j.T * j.H * j.D * 8);
    free(inv);
    free(j.s.mem);
    return DI_OK;
}
