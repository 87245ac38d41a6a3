/* Hyper-connections (ABI 1.3, DeepSeek V4; abi/README.md section 8): hc_pre mixes the residual
 * streams into one layer input, hc_post writes the layer output back into the streams.
 * Validation first (shapes, then the index values this library sees on the host: sequences,
 * lengths, block ids), never a read out of bounds; inputs converted to f32 rows; math in f32 (the
 * SIMD kernels of kernels*.c for the long dot products), f64 where it costs nothing; one rounding to
 * the output dtype at the end. Work is spread over rows (and, where one row is a big job, over heads
 * or entries) on the pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "op_rows.h"

/* ================================================================== hc_pre */
/* Phase 1 (mix = fn @ rmsnorm(x[t])): tasks of up to HC_RB rows against a chunk of fn's M rows, one
 * register-blocked dot-product call each; a decode step (T = 1) splits M so the 24 long dot products
 * of a layer do not all run on one thread. Phase 2, per row: the M mixing values become pre, post and
 * comb (f64: 2 + N + N*N numbers, nothing to save in f32), and the streams collapse into out. */
#define HC_RB 4
typedef struct {
    const DI_HCPreArgs* a;
    int xd, od, block;
    int64_t T, N, H, M, NH, mchunk, nmc;
    float* mix;          /* [T, M] */
    char* scratch;
    size_t per;          /* bytes per worker */
    const Kernels* k;
} HCPreJob;

/* the N streams of row t as one f32 row of N * H */
static void hc_load_streams(const DI_Tensor* x, int xd, int64_t t, int64_t N, int64_t H, float* f) {
    for (int64_t n = 0; n < N; n++) load_row(xd, row3(x, xd, t, n), 0, H, f + n * H);
}

static void hc_mix_task(void* arg, int64_t task, int worker) {
    const HCPreJob* j = (const HCPreJob*)arg;
    int64_t rb = task / j->nmc, mc = task % j->nmc, NH = j->NH;
    int64_t t0 = rb * HC_RB, nr = j->T - t0 < HC_RB ? j->T - t0 : HC_RB;
    int64_t m0 = mc * j->mchunk, nm = j->M - m0 < j->mchunk ? j->M - m0 : j->mchunk;
    float* f = (float*)(j->scratch + (size_t)worker * j->per);
    for (int64_t r = 0; r < nr; r++) {
        float* fr = f + r * NH;
        hc_load_streams(&j->a->x, j->xd, t0 + r, j->N, j->H, fr);
        /* sum of squares on the dot kernel: a serial f64 sum of N * H terms (~28K in V4) costs more than
         * the M dot products that follow; f32 over 16 lanes is ~1e-7 relative here */
        float ss;
        j->k->dot_rows(fr, fr, NH, 1, NH, &ss);
        float rs = 1.0f / sqrtf(ss / (float)NH + j->a->eps);
        for (int64_t i = 0; i < NH; i++) fr[i] *= rs;
    }
    const DI_Tensor* fn = &j->a->fn;
    j->k->gemm_dot(f, NH, (int)nr, (const float*)t_base(fn) + m0 * fn->strides[0], fn->strides[0], (int)nm, NH,
                   j->mix + t0 * j->M + m0, j->M);
}

static inline double sigmoid_d(double z) { return 1.0 / (1.0 + exp(-z)); }

static void hc_weights_task(void* arg, int64_t t, int worker) {
    const HCPreJob* j = (const HCPreJob*)arg;
    const DI_HCPreArgs* a = j->a;
    int64_t N = j->N, H = j->H;
    char* mem = j->scratch + (size_t)worker * j->per;
    double* c = (double*)mem;              /* [N, N] */
    double* col = c + N * N;               /* [N] */
    float* pre = (float*)(col + N);        /* [N] */
    float* acc = pre + N;                  /* [H] */
    float* xr = acc + H;                   /* [H] */
    const float* mx = j->mix + t * j->M;
    const double he = a->hc_eps;
    double sc0 = fx1(&a->scale, 0);
    for (int64_t n = 0; n < N; n++)
        pre[n] = (float)(sigmoid_d((double)mx[n] * sc0 + (double)fx1(&a->base, n)) + he);
    if (j->block) {
        double sc1 = fx1(&a->scale, 1), sc2 = fx1(&a->scale, 2);
        float* post = (float*)t_row(&a->post, DT_F32, t);
        for (int64_t n = 0; n < N; n++)
            post[n] = (float)(2.0 * sigmoid_d((double)mx[N + n] * sc1 + (double)fx1(&a->base, N + n)));
        /* comb: a softmax over j for each row i, + hc_eps, then Sinkhorn-Knopp (columns first) */
        for (int64_t i = 0; i < N; i++) {
            double* ci = c + i * N, m = -INFINITY, s = 0.0;
            for (int64_t q = 0; q < N; q++) {
                int64_t m_ = 2 * N + i * N + q;
                ci[q] = (double)mx[m_] * sc2 + (double)fx1(&a->base, m_);
                if (ci[q] > m) m = ci[q];
            }
            for (int64_t q = 0; q < N; q++) { ci[q] = exp(ci[q] - m); s += ci[q]; }
            for (int64_t q = 0; q < N; q++) ci[q] = ci[q] / s + he;
        }
        for (int32_t it = 0; it < a->sinkhorn_iters; it++) {
            if (it > 0)   /* rows, then columns again */
                for (int64_t i = 0; i < N; i++) {
                    double s = 0.0;
                    for (int64_t q = 0; q < N; q++) s += c[i * N + q];
                    for (int64_t q = 0; q < N; q++) c[i * N + q] /= s + he;
                }
            for (int64_t q = 0; q < N; q++) {
                double s = 0.0;
                for (int64_t i = 0; i < N; i++) s += c[i * N + q];
                col[q] = s + he;
            }
            for (int64_t i = 0; i < N; i++)
                for (int64_t q = 0; q < N; q++) c[i * N + q] /= col[q];
        }
        for (int64_t i = 0; i < N; i++) {
            float* cr = (float*)t_row2(&a->comb, DT_F32, t, i);
            for (int64_t q = 0; q < N; q++) cr[q] = (float)c[i * N + q];
        }
    }
    /* out = sum_n pre[n] * x[t, n] in f32, streams in order, rounded once */
    for (int64_t h = 0; h < H; h++) acc[h] = 0.0f;
    for (int64_t n = 0; n < N; n++) {
        load_row(j->xd, row3(&a->x, j->xd, t, n), 0, H, xr);
        for (int64_t h = 0; h < H; h++) acc[h] += pre[n] * xr[h];
    }
    store_row(j->od, t_row(&a->out, j->od, t), acc, H);
}

DI_Status op_hc_pre(DI_Context* ctx, const DI_HCPreArgs* a, int query) {
    VC v = {ctx, "hc_pre", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->fn, "fn", 2, 2, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->base, "base", 1, 1, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->scale, "scale", 1, 1, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->x.shape[0], N = a->x.shape[1], H = a->x.shape[2], M = a->fn.shape[0];
    if (N < 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: x.shape[1]=N=%lld streams, expected >= 1", (long long)N);
    int block = M == (2 + N) * N;
    if (!block && M != N)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: fn.shape[0]=M=%lld, expected (2 + N) * N = %lld (a block) "
                       "or N = %lld (the head)", (long long)M, (long long)((2 + N) * N), (long long)N);
    if ((st = check_dim(&v, &a->fn, "fn", 1, N * H))) return st;
    if ((st = check_dim(&v, &a->base, "base", 0, M))) return st;
    if ((st = check_dim(&v, &a->scale, "scale", 0, block ? 3 : 1))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T)) || (st = check_dim(&v, &a->out, "out", 1, H))) return st;
    int has_post = tensor_present(&v, &a->post), has_comb = tensor_present(&v, &a->comb);
    if (block) {
        if (!has_post || !has_comb)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: %s is required when M = (2 + N) * N = %lld",
                           !has_post ? "post" : "comb", (long long)M);
        if ((st = check_tensor(&v, &a->post, "post", 2, 2, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(&v, &a->post, "post", 0, T)) || (st = check_dim(&v, &a->post, "post", 1, N))) return st;
        if ((st = check_tensor(&v, &a->comb, "comb", 3, 3, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(&v, &a->comb, "comb", 0, T)) || (st = check_dim(&v, &a->comb, "comb", 1, N)) ||
            (st = check_dim(&v, &a->comb, "comb", 2, N)))
            return st;
        if (a->sinkhorn_iters < 1)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: sinkhorn_iters=%d, expected >= 1", a->sinkhorn_iters);
    } else if (has_post || has_comb) {
        return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: %s must be absent when M = N = %lld (the head has only pre)",
                       has_post ? "post" : "comb", (long long)N);
    }
    if (!isfinite(a->eps) || a->eps < 0.0f)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: eps=%g must be finite and >= 0", (double)a->eps);
    if (!isfinite(a->hc_eps) || a->hc_eps < 0.0f)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_pre: hc_eps=%g must be finite and >= 0", (double)a->hc_eps);
    if (query || T == 0) return DI_OK;
    HCPreJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.T = T; j.N = N; j.H = H; j.M = M; j.NH = N * H; j.block = block;
    j.xd = dt_id(a->x.dtype); j.od = dt_id(a->out.dtype);
    j.k = kernels();
    int nw = pool_size(ctx->pool);
    int64_t nrb = (T + HC_RB - 1) / HC_RB;
    /* few rows: split fn's rows (4 at a time, the kernel's register block) so every worker gets some */
    j.mchunk = M;
    if (nrb < nw) {
        int64_t want = (nw + nrb - 1) / nrb, mc = (M + want - 1) / want;
        j.mchunk = mc < 4 ? 4 : (mc + 3) / 4 * 4;
        if (j.mchunk > M) j.mchunk = M;
    }
    j.nmc = (M + j.mchunk - 1) / j.mchunk;
    size_t p1 = (size_t)HC_RB * (size_t)j.NH * sizeof(float);
    size_t p2 = (size_t)(N * N + N) * sizeof(double) + (size_t)(N + 2 * H) * sizeof(float);
    j.per = ((p1 > p2 ? p1 : p2) + 63) & ~(size_t)63;
    j.mix = di_malloc((size_t)(T * M) * sizeof(float));
    j.scratch = di_malloc((size_t)nw * j.per);
    if (!j.mix || !j.scratch) { free(j.mix); free(j.scratch); return DI_OOM(ctx, "hc_pre"); }
    pool_run(ctx->pool, nrb * j.nmc, hc_mix_task, &j, T * M * j.NH);
    pool_run(ctx->pool, T, hc_weights_task, &j, T * (N * H + N * N * 4 * (int64_t)a->sinkhorn_iters));
    free(j.mix);
    free(j.scratch);
    return DI_OK;
}

/* ================================================================== hc_post */
typedef struct {
    const DI_HCPostArgs* a;
    int xd, yd, od;
    int64_t T, N, H, per;
    float* scratch;   /* per worker: x rows [N, H], y [H], one output row [H] */
} HCPostJob;

static void hc_post_task(void* arg, int64_t task, int worker) {
    const HCPostJob* j = (const HCPostJob*)arg;
    const DI_HCPostArgs* a = j->a;
    int64_t N = j->N, H = j->H, t1 = (task + 1) * j->per < j->T ? (task + 1) * j->per : j->T;
    float* xr = j->scratch + (size_t)worker * (size_t)((N + 2) * H);
    float* y = xr + N * H;
    float* o = y + H;
    for (int64_t t = task * j->per; t < t1; t++) {
        hc_load_streams(&a->x, j->xd, t, N, H, xr);
        load_row(j->yd, t_row(&a->y, j->yd, t), 0, H, y);
        const float* post = (const float*)t_row(&a->post, DT_F32, t);
        for (int64_t k = 0; k < N; k++) {
            float pk = post[k];
            for (int64_t h = 0; h < H; h++) o[h] = pk * y[h];
            for (int64_t q = 0; q < N; q++) {   /* stream q of the input feeds stream k: comb[t, q, k] */
                float c = ((const float*)t_row2(&a->comb, DT_F32, t, q))[k];
                const float* xq = xr + q * H;
                for (int64_t h = 0; h < H; h++) o[h] += c * xq[h];
            }
            store_row(j->od, row3(&a->out, j->od, t, k), o, H);
        }
    }
}

/* first and one-past-last byte a 3-d view spans (empty views span nothing) */
static void span3(const DI_Tensor* t, int dt, uintptr_t* lo, uintptr_t* hi) {
    int64_t last = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) { *lo = *hi = 0; return; }
        last += (t->shape[i] - 1) * t->strides[i];
    }
    *lo = (uintptr_t)t_base(t);
    *hi = (uintptr_t)t_at(t, dt, last) + (uintptr_t)(dt_bits(dt) / 8);
}

DI_Status op_hc_post(DI_Context* ctx, const DI_HCPostArgs* a, int query) {
    VC v = {ctx, "hc_post", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->y, "y", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->post, "post", 2, 2, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->comb, "comb", 3, 3, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->x.shape[0], N = a->x.shape[1], H = a->x.shape[2];
    if ((st = check_dim(&v, &a->y, "y", 0, T)) || (st = check_dim(&v, &a->y, "y", 1, H))) return st;
    if ((st = check_dim(&v, &a->post, "post", 0, T)) || (st = check_dim(&v, &a->post, "post", 1, N))) return st;
    if ((st = check_dim(&v, &a->comb, "comb", 0, T)) || (st = check_dim(&v, &a->comb, "comb", 1, N)) ||
        (st = check_dim(&v, &a->comb, "comb", 2, N)))
        return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if (query) return DI_OK;
    if (T == 0 || N == 0 || H == 0) return DI_OK;
    int xd = dt_id(a->x.dtype), od = dt_id(a->out.dtype);
    uintptr_t xl, xh, ol, oh;
    span3(&a->x, xd, &xl, &xh);
    span3(&a->out, od, &ol, &oh);
    if (xl < oh && ol < xh)   /* the README forbids it: a row's streams are read after others are written */
        return di_fail(ctx, DI_INVALID_ARGUMENT, "hc_post: out overlaps x (out must be a separate buffer)");
    HCPostJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.T = T; j.N = N; j.H = H;
    j.xd = xd; j.yd = dt_id(a->y.dtype); j.od = od;
    j.scratch = di_malloc((size_t)pool_size(ctx->pool) * (size_t)((N + 2) * H) * sizeof(float));
    if (!j.scratch) return DI_OOM(ctx, "hc_post");
    pool_run(ctx->pool, row_chunks(T, N * H, &j.per), hc_post_task, &j, T * N * N * H);
    free(j.scratch);
    return DI_OK;
}
