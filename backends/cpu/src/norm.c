/* The norms: rmsnorm (with the fused residual add) and layernorm (ABI 1.3, V4's indexer and
 * compressor). Math in f32 (layernorm's statistics in f64), one rounding to the output dtype at the
 * end; each row is read into an f32 buffer before its output is written, so out may alias x. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "op_rows.h"

/* ------------------------------------------------------------------ rmsnorm */
/* out = s * rsqrt(mean(s^2) + eps) * w over one f32 row (the sum of squares in f64); rmsnorm and the
 * fused mla_rope_cache_write (fused.c) share it, so their outputs have the same bits */
void rmsnorm_row(const float* s, const float* w, int64_t H, float eps, float* out) {
    double ss = 0.0;
    for (int64_t h = 0; h < H; h++) ss += (double)s[h] * s[h];
    float r = 1.0f / sqrtf((float)(ss / (double)(H ? H : 1)) + eps);
    for (int64_t h = 0; h < H; h++) out[h] = s[h] * r * w[h];
}

typedef struct {
    const DI_RMSNormArgs* a;
    int xd, wd, rd, od, rod, has_res, has_ro;
    int64_t H, per, T;
    const float* w;
    Scratch s;
} NormJob;

static void rmsnorm_task(void* arg, int64_t task, int worker) {
    const NormJob* j = (const NormJob*)arg;
    const DI_RMSNormArgs* a = j->a;
    float* sbuf = scratch_get(&j->s, worker, 0);
    float* rbuf = sbuf + j->H;
    int64_t t1 = (task + 1) * j->per < j->T ? (task + 1) * j->per : j->T;
    for (int64_t t = task * j->per; t < t1; t++) {
        load_row(j->xd, t_row(&a->x, j->xd, t), 0, j->H, sbuf);
        if (j->has_res) {
            load_row(j->rd, t_row(&a->residual, j->rd, t), 0, j->H, rbuf);
            for (int64_t h = 0; h < j->H; h++) sbuf[h] += rbuf[h];
        }
        if (j->has_ro) store_row(j->rod, t_row(&a->residual_out, j->rod, t), sbuf, j->H);
        rmsnorm_row(sbuf, j->w, j->H, a->eps, rbuf);
        store_row(j->od, t_row(&a->out, j->od, t), rbuf, j->H);
    }
}

DI_Status op_rmsnorm(DI_Context* ctx, const DI_RMSNormArgs* a, int query) {
    VC v = {ctx, "rmsnorm", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->weight, "weight", 1, 1, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_dim(&v, &a->weight, "weight", 0, a->x.shape[1]))) return st;
    int has_res = tensor_present(&v, &a->residual), has_ro = tensor_present(&v, &a->residual_out);
    if (has_res) {
        if ((st = check_tensor(&v, &a->residual, "residual", 2, 2, DTM_FLOAT_ACT, 0))) return st;
        if ((st = check_same_shape(&v, &a->x, "x", &a->residual, "residual"))) return st;
    }
    if (has_ro) {
        if ((st = check_tensor(&v, &a->residual_out, "residual_out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
        if ((st = check_same_shape(&v, &a->x, "x", &a->residual_out, "residual_out"))) return st;
    }
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if (!isfinite(a->eps) || a->eps < 0.0f)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "rmsnorm: eps=%g must be finite and >= 0", (double)a->eps);
    if (query) return DI_OK;
    NormJob j;
    memset(&j, 0, sizeof j);
    j.a = a;
    j.xd = dt_id(a->x.dtype); j.wd = dt_id(a->weight.dtype); j.od = dt_id(a->out.dtype);
    j.rd = has_res ? dt_id(a->residual.dtype) : 0;
    j.rod = has_ro ? dt_id(a->residual_out.dtype) : 0;
    j.has_res = has_res; j.has_ro = has_ro;
    j.T = a->x.shape[0]; j.H = a->x.shape[1];
    float* w = di_malloc((size_t)(j.H ? j.H : 1) * sizeof(float));
    if (!w || !scratch_init(&j.s, ctx, 2 * j.H)) { free(w); return DI_OOM(ctx, "rmsnorm"); }
    load_row(j.wd, t_base(&a->weight), 0, j.H, w);
    j.w = w;
    int64_t nt = chunks(j.T, j.H, &j.per);
    pool_run(ctx->pool, nt, rmsnorm_task, &j, j.T * j.H * 4);
    free(w);
    free(j.s.mem);
    return DI_OK;
}

/* ================================================================== layernorm */
typedef struct {
    const DI_LayerNormArgs* a;
    int xd, od;
    int64_t T, H, per;
    const float *w, *b;   /* b NULL: no bias */
    float* scratch;       /* H floats per worker */
} LNJob;

static void layernorm_task(void* arg, int64_t task, int worker) {
    const LNJob* j = (const LNJob*)arg;
    float* r = j->scratch + (size_t)worker * (size_t)j->H;
    int64_t t1 = (task + 1) * j->per < j->T ? (task + 1) * j->per : j->T, H = j->H;
    for (int64_t t = task * j->per; t < t1; t++) {
        load_row(j->xd, t_row(&j->a->x, j->xd, t), 0, H, r);
        /* two passes in f64: the mean, then the population variance around it (no cancellation) */
        double s = 0.0;
        for (int64_t h = 0; h < H; h++) s += r[h];
        double mean = s / (double)H, ss = 0.0;
        for (int64_t h = 0; h < H; h++) ss += ((double)r[h] - mean) * ((double)r[h] - mean);
        float mf = (float)mean, rs = (float)(1.0 / sqrt(ss / (double)H + (double)j->a->eps));
        for (int64_t h = 0; h < H; h++) r[h] = (r[h] - mf) * rs * j->w[h];
        if (j->b)
            for (int64_t h = 0; h < H; h++) r[h] += j->b[h];
        store_row(j->od, t_row(&j->a->out, j->od, t), r, H);
    }
}

DI_Status op_layernorm(DI_Context* ctx, const DI_LayerNormArgs* a, int query) {
    VC v = {ctx, "layernorm", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->weight, "weight", 1, 1, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->x.shape[0], H = a->x.shape[1];
    if ((st = check_dim(&v, &a->weight, "weight", 0, H))) return st;
    int has_bias = tensor_present(&v, &a->bias);
    if (has_bias) {
        if ((st = check_tensor(&v, &a->bias, "bias", 1, 1, DTM_FLOAT_ACT, 0))) return st;
        if ((st = check_dim(&v, &a->bias, "bias", 0, H))) return st;
    }
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if (!isfinite(a->eps) || a->eps < 0.0f)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "layernorm: eps=%g must be finite and >= 0", (double)a->eps);
    if (query || T == 0 || H == 0) return DI_OK;
    LNJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.T = T; j.H = H;
    j.xd = dt_id(a->x.dtype); j.od = dt_id(a->out.dtype);
    float* wb = di_malloc((size_t)(2 * H) * sizeof(float));
    j.scratch = di_malloc((size_t)pool_size(ctx->pool) * (size_t)H * sizeof(float));
    if (!wb || !j.scratch) { free(wb); free(j.scratch); return DI_OOM(ctx, "layernorm"); }
    for (int64_t h = 0; h < H; h++) {
        wb[h] = ld_elem(t_base(&a->weight), dt_id(a->weight.dtype), h * a->weight.strides[0]);
        if (has_bias) wb[H + h] = ld_elem(t_base(&a->bias), dt_id(a->bias.dtype), h * a->bias.strides[0]);
    }
    j.w = wb;
    j.b = has_bias ? wb + H : NULL;
    pool_run(ctx->pool, row_chunks(T, H, &j.per), layernorm_task, &j, T * H * 4);
    free(wb);
    free(j.scratch);
    return DI_OK;
}
