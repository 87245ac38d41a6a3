/* The small ops: embedding, rmsnorm, rope, add, mul, silu_mul, concat, mla_cache_write,
 * moe_router, sample and spec_verify. All math in f32 (double where a long sum would drift), one rounding to
 * the output dtype at the end. Inputs are read into f32 row buffers before any output of that
 * row is written, which is what makes the allowed aliasing (out == x, residual_out == residual)
 * safe. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "di_cpu.h"

/* element offset of row r of t, rows being every dim but the last */
static int64_t row_off(const DI_Tensor* t, int64_t r) {
    int64_t off = 0;
    for (int i = t->ndim - 2; i >= 0; i--) {
        int64_t n = t->shape[i];
        off += (r % n) * t->strides[i];
        r /= n;
    }
    return off;
}
static int64_t n_rows(const DI_Tensor* t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim - 1; i++) n *= t->shape[i];
    return n;
}
static int64_t n_cols(const DI_Tensor* t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static char* row_ptr(const DI_Tensor* t, int dt, int64_t r) { return t_at(t, dt, row_off(t, r)); }

/* scratch: nw buffers of n floats each */
typedef struct { float* mem; size_t per; } Scratch;
static int scratch_init(Scratch* s, DI_Context* ctx, int64_t n) {
    s->per = (size_t)(n > 0 ? n : 1);
    s->mem = di_malloc((size_t)pool_size(ctx->pool) * s->per * sizeof(float));
    return s->mem != NULL;
}
static float* scratch_get(const Scratch* s, int worker, int i) { return s->mem + (size_t)worker * s->per + (size_t)i; }

/* tasks of `per` rows out of `rows` */
static int64_t chunks(int64_t rows, int64_t cols, int64_t* per) {
    int64_t p = cols >= 8192 ? 1 : 8192 / (cols ? cols : 1);
    if (p < 1) p = 1;
    *per = p;
    return (rows + p - 1) / p;
}

/* ------------------------------------------------------------------ embedding */
DI_Status op_embedding(DI_Context* ctx, const DI_EmbeddingArgs* a, int query) {
    VC v = {ctx, "embedding", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->ids, "ids", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->table, "table", 2, 2, DTM_FLOAT_ACT | DTM(DT_F16), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->ids.shape[0], V = a->table.shape[0], H = a->table.shape[1];
    if ((st = check_dim(&v, &a->out, "out", 0, T))) return st;
    if ((st = check_dim(&v, &a->out, "out", 1, H))) return st;
    if (query) return DI_OK;
    int td = dt_id(a->table.dtype), od = dt_id(a->out.dtype);
    const int32_t* ids = (const int32_t*)t_base(&a->ids);
    float* buf = td == od ? NULL : di_malloc((size_t)(H ? H : 1) * sizeof(float));
    if (td != od && !buf) return DI_OOM(ctx, "embedding");
    size_t rb = (size_t)H * (size_t)(dt_bits(od) / 8);
    for (int64_t t = 0; t < T; t++) {
        int32_t id = ids[t * a->ids.strides[0]];
        char* o = t_row(&a->out, od, t);
        if (id < 0 || id >= V) { memset(o, 0, rb); continue; }
        const char* src = t_row(&a->table, td, id);
        if (td == od) memcpy(o, src, rb);
        else { load_row(td, src, 0, H, buf); store_row(od, o, buf, H); }
    }
    free(buf);
    return DI_OK;
}

/* ------------------------------------------------------------------ rmsnorm */
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
        double ss = 0.0;
        for (int64_t h = 0; h < j->H; h++) ss += (double)sbuf[h] * sbuf[h];
        float r = 1.0f / sqrtf((float)(ss / (double)(j->H ? j->H : 1)) + a->eps);
        if (j->has_ro) store_row(j->rod, t_row(&a->residual_out, j->rod, t), sbuf, j->H);
        for (int64_t h = 0; h < j->H; h++) rbuf[h] = sbuf[h] * r * j->w[h];
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

/* ------------------------------------------------------------------ elementwise (add, mul, silu_mul) */
enum { EW_ADD, EW_MUL, EW_SILU_MUL };
typedef struct {
    const DI_Tensor *a, *b, *out;
    int ad, bd, od, kind;
    int64_t C, rows, per;
    float limit;   /* silu_mul: clipped SwiGLU when > 0 */
    Scratch s;
} EwJob;

static void ew_task(void* arg, int64_t task, int worker) {
    const EwJob* j = (const EwJob*)arg;
    float* x = scratch_get(&j->s, worker, 0);
    float* y = x + j->C;
    int64_t r1 = (task + 1) * j->per < j->rows ? (task + 1) * j->per : j->rows;
    for (int64_t r = task * j->per; r < r1; r++) {
        load_row(j->ad, row_ptr(j->a, j->ad, r), 0, j->C, x);
        load_row(j->bd, row_ptr(j->b, j->bd, r), 0, j->C, y);
        switch (j->kind) {
        case EW_ADD: for (int64_t c = 0; c < j->C; c++) x[c] += y[c]; break;
        case EW_MUL: for (int64_t c = 0; c < j->C; c++) x[c] *= y[c]; break;
        default:
            for (int64_t c = 0; c < j->C; c++) x[c] = di_swiglu(x[c], y[c], j->limit);
        }
        store_row(j->od, row_ptr(j->out, j->od, r), x, j->C);
    }
}

static DI_Status ew_run(DI_Context* ctx, VC* v, const DI_Tensor* a, const char* an, const DI_Tensor* b,
                        const char* bn, const DI_Tensor* out, int kind, int nlo, int nhi, float limit) {
    DI_Status st;
    if ((st = check_tensor(v, a, an, nlo, nhi, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(v, b, bn, nlo, nhi, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(v, a, an, b, bn))) return st;
    if ((st = check_tensor(v, out, "out", nlo, nhi, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(v, a, an, out, "out"))) return st;
    if (v->query) return DI_OK;
    EwJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.b = b; j.out = out; j.kind = kind; j.limit = limit;
    j.ad = dt_id(a->dtype); j.bd = dt_id(b->dtype); j.od = dt_id(out->dtype);
    j.C = n_cols(a);
    j.rows = n_rows(a);
    if (!j.rows || !j.C) return DI_OK;
    if (!scratch_init(&j.s, ctx, 2 * j.C)) return DI_OOM(ctx, v->op);
    pool_run(ctx->pool, chunks(j.rows, j.C, &j.per), ew_task, &j, j.rows * j.C);
    free(j.s.mem);
    return DI_OK;
}

DI_Status op_add(DI_Context* ctx, const DI_BinaryArgs* a, int query) {
    VC v = {ctx, "add", query};
    return ew_run(ctx, &v, &a->a, "a", &a->b, "b", &a->out, EW_ADD, 0, DI_MAX_DIMS, 0.0f);
}
DI_Status op_mul(DI_Context* ctx, const DI_BinaryArgs* a, int query) {
    VC v = {ctx, "mul", query};
    return ew_run(ctx, &v, &a->a, "a", &a->b, "b", &a->out, EW_MUL, 0, DI_MAX_DIMS, 0.0f);
}
DI_Status op_silu_mul(DI_Context* ctx, const DI_SiluMulArgs* a, int query) {
    VC v = {ctx, "silu_mul", query};
    /* limit (1.3) is 0 for an older caller (its struct ends before it) */
    if (!(a->limit >= 0.0f) || isinf(a->limit))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "silu_mul: limit=%g, expected finite and >= 0 (0: no clipping)",
                       (double)a->limit);
    return ew_run(ctx, &v, &a->gate, "gate", &a->up, "up", &a->out, EW_SILU_MUL, 2, 2, a->limit);
}

/* ------------------------------------------------------------------ concat */
DI_Status op_concat(DI_Context* ctx, const DI_ConcatArgs* a, int query) {
    VC v = {ctx, "concat", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->a, "a", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->b, "b", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->a.shape[0], A = a->a.shape[1], B = a->b.shape[1];
    if ((st = check_dim(&v, &a->b, "b", 0, T))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T))) return st;
    if ((st = check_dim(&v, &a->out, "out", 1, A + B))) return st;
    if (query) return DI_OK;
    int ad = dt_id(a->a.dtype), bd = dt_id(a->b.dtype), od = dt_id(a->out.dtype);
    float* buf = di_malloc((size_t)(A + B + 1) * sizeof(float));
    if (!buf) return DI_OOM(ctx, "concat");
    for (int64_t t = 0; t < T; t++) {
        load_row(ad, t_row(&a->a, ad, t), 0, A, buf);
        load_row(bd, t_row(&a->b, bd, t), 0, B, buf + A);
        store_row(od, t_row(&a->out, od, t), buf, A + B);
    }
    free(buf);
    return DI_OK;
}

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

static void rope_task(void* arg, int64_t t, int worker) {
    const RopeJob* j = (const RopeJob*)arg;
    const DI_RopeArgs* a = j->a;
    int64_t half = j->D / 2;
    float* c = scratch_get(&j->s, worker, 0);
    float* s = c + half;
    float* row = s + half;
    double p = (double)j->pos[t * j->pos_stride];
    for (int64_t i = 0; i < half; i++) {
        /* f64 angles: large positions lose whole radians' worth of bits in f32 (the reference
         * computes the exact value in f64 too) */
        double ang = p * j->inv[i];
        c[i] = (float)(cos(ang) * (double)a->attn_factor);
        s[i] = (float)(sin(ang) * (double)a->attn_factor);
    }
    for (int64_t h = 0; h < j->H; h++) {
        int64_t xo = t * a->x.strides[0] + (a->x.ndim == 3 ? h * a->x.strides[1] : 0);
        int64_t oo = t * a->out.strides[0] + (a->out.ndim == 3 ? h * a->out.strides[1] : 0);
        load_row(j->xd, t_at(&a->x, j->xd, xo), 0, j->D, row);
        for (int64_t i = 0; i < half; i++) {
            int64_t iu = j->inter ? 2 * i : i, iv = j->inter ? 2 * i + 1 : i + half;
            float u = row[iu], vv = row[iv];
            row[iu] = u * c[i] - vv * s[i];
            row[iv] = vv * c[i] + u * s[i];
        }
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
    if (a->interleaved != 0 && a->interleaved != 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "rope: interleaved=%d, expected 0 or 1", a->interleaved);
    if (a->scaling != DI_ROPE_NONE && a->scaling != DI_ROPE_YARN)
        return di_fail(ctx, DI_UNIMPLEMENTED, "rope: scaling=%d is not implemented (0 none, 1 yarn)", a->scaling);
    if (!(a->theta > 0.0f) || !isfinite(a->theta))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "rope: theta=%g must be positive", (double)a->theta);
    if (a->scaling == DI_ROPE_YARN && (!(a->factor > 0.0f) || a->original_max_position <= 0 ||
                                       !(a->beta_fast > 0.0f) || !(a->beta_slow > 0.0f)))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "rope: yarn needs factor > 0, original_max_position > 0 and "
                       "beta_fast, beta_slow > 0 (got %g, %d, %g, %g)", (double)a->factor,
                       a->original_max_position, (double)a->beta_fast, (double)a->beta_slow);
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
    double th = a->theta, low = 0, high = 0;
    if (a->scaling == DI_ROPE_YARN) {
        double omp = a->original_max_position;
        double dl = D * log(omp / (2 * M_PI * a->beta_fast)) / (2 * log(th));
        double dh = D * log(omp / (2 * M_PI * a->beta_slow)) / (2 * log(th));
        low = floor(dl); high = ceil(dh);
        if (low < 0) low = 0;
        if (low > D - 1) low = (double)(D - 1);
        if (high < 0) high = 0;
        if (high > D - 1) high = (double)(D - 1);
        if (low == high) high += 0.001;
    }
    for (int64_t i = 0; i < half; i++) {
        double f = pow(th, -2.0 * (double)i / (double)D);
        if (a->scaling == DI_ROPE_YARN) {
            double r = ((double)i - low) / (high - low);
            r = r < 0 ? 0 : r > 1 ? 1 : r;
            f = f / a->factor * r + f * (1 - r);
        }
        inv[i] = f;
    }
    j.inv = inv;
    pool_run(ctx->pool, j.T, rope_task, &j, j.T * j.H * j.D * 8);
    free(inv);
    free(j.s.mem);
    return DI_OK;
}

/* ------------------------------------------------------------------ mla_cache_write */
DI_Status op_mla_cache_write(DI_Context* ctx, const DI_MLACacheWriteArgs* a, int query) {
    VC v = {ctx, "mla_cache_write", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->latent, "latent", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->k_pe, "k_pe", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->slots, "slots", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->cache, "cache", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->latent.shape[0], Dc = a->latent.shape[1], Dr = a->k_pe.shape[1];
    if ((st = check_dim(&v, &a->k_pe, "k_pe", 0, T))) return st;
    if ((st = check_dim(&v, &a->slots, "slots", 0, T))) return st;
    if ((st = check_dim(&v, &a->cache, "cache", 2, Dc + Dr))) return st;
    if (query) return DI_OK;
    int64_t NB = a->cache.shape[0], BS = a->cache.shape[1];
    const int32_t* slots = (const int32_t*)t_base(&a->slots);
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slots[t * a->slots.strides[0]];
        if (s >= NB * BS)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_cache_write: slots[%lld]=%lld >= NB*BS=%lld", (long long)t,
                           (long long)s, (long long)(NB * BS));
    }
    int ld = dt_id(a->latent.dtype), kd = dt_id(a->k_pe.dtype), cd = dt_id(a->cache.dtype);
    float* buf = di_malloc((size_t)(Dc + Dr + 1) * sizeof(float));
    if (!buf) return DI_OOM(ctx, "mla_cache_write");
    for (int64_t t = 0; t < T; t++) {
        int64_t s = slots[t * a->slots.strides[0]];
        if (s < 0) continue;
        load_row(ld, t_row(&a->latent, ld, t), 0, Dc, buf);
        load_row(kd, t_row(&a->k_pe, kd, t), 0, Dr, buf + Dc);
        store_row(cd, t_row2(&a->cache, cd, s / BS, s % BS), buf, Dc + Dr);
    }
    free(buf);
    return DI_OK;
}

/* ------------------------------------------------------------------ moe_router */
DI_Status op_moe_router(DI_Context* ctx, const DI_MoERouterArgs* a, int query) {
    VC v = {ctx, "moe_router", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->logits, "logits", 2, 2, DTM(DT_F32), 0))) return st;
    int64_t T = a->logits.shape[0], E = a->logits.shape[1];
    int has_bias = tensor_present(&v, &a->bias);
    if (has_bias) {
        if ((st = check_tensor(&v, &a->bias, "bias", 1, 1, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(&v, &a->bias, "bias", 0, E))) return st;
    }
    if ((st = check_tensor(&v, &a->topk_ids, "topk_ids", 2, 2, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->topk_weights, "topk_weights", 2, 2, DTM(DT_F32), 0))) return st;
    if ((st = check_dim(&v, &a->topk_ids, "topk_ids", 0, T))) return st;
    if ((st = check_same_shape(&v, &a->topk_ids, "topk_ids", &a->topk_weights, "topk_weights"))) return st;
    int64_t K = a->topk_ids.shape[1];
    /* hash routing (1.3): both tensors or neither; absent for an older caller */
    int has_tid = tensor_present(&v, &a->token_ids), has_ht = tensor_present(&v, &a->hash_table);
    if (has_tid != has_ht)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: %s is present without %s (hash routing takes both)",
                       has_tid ? "token_ids" : "hash_table", has_tid ? "hash_table" : "token_ids");
    int hashed = has_tid;
    if (hashed) {
        if ((st = check_tensor(&v, &a->token_ids, "token_ids", 1, 1, DTM(DT_I32), 0))) return st;
        if ((st = check_dim(&v, &a->token_ids, "token_ids", 0, T))) return st;
        if ((st = check_tensor(&v, &a->hash_table, "hash_table", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_dim(&v, &a->hash_table, "hash_table", 1, K))) return st;
    }
    if (a->scoring != DI_SCORING_SOFTMAX && a->scoring != DI_SCORING_SIGMOID && a->scoring != DI_SCORING_SQRTSOFTPLUS)
        return di_fail(ctx, DI_UNIMPLEMENTED, "moe_router: scoring=%d is not implemented (0 softmax, 1 sigmoid, "
                       "2 sqrtsoftplus)", a->scoring);
    if (a->n_group < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: n_group=%d is negative (0 or 1: no grouping)",
                       a->n_group);
    /* group settings are checked as always; hash routing selects nothing, so it does not use them */
    int G = a->n_group > 1 ? a->n_group : 1;
    if (G > 1) {
        if (a->group_score != DI_GROUP_SCORE_MAX && a->group_score != DI_GROUP_SCORE_SUM_TOP2)
            return di_fail(ctx, DI_UNIMPLEMENTED, "moe_router: group_score=%d is not implemented", a->group_score);
        if (E % G)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: E=%lld experts do not split into n_group=%d "
                           "equal groups", (long long)E, G);
        if (a->topk_group < 1 || a->topk_group > G)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: topk_group=%d, expected 1..n_group=%d",
                           a->topk_group, G);
        if (a->group_score == DI_GROUP_SCORE_SUM_TOP2 && E / G < 2)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: SUM_TOP2 needs at least 2 experts per group, got "
                           "%lld", (long long)(E / G));
    }
    int64_t eligible = G > 1 ? (int64_t)a->topk_group * (E / G) : E;
    if (!hashed && K > eligible)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: top-k K=%lld > %lld experts eligible for selection",
                       (long long)K, (long long)eligible);
    if (a->norm_topk_prob != 0 && a->norm_topk_prob != 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: norm_topk_prob=%d, expected 0 or 1",
                       a->norm_topk_prob);
    if (query) return DI_OK;
    if (hashed) {   /* ids and table entries are on the host: out of range is INVALID_ARGUMENT */
        int64_t V = a->hash_table.shape[0];
        for (int64_t t = 0; t < T; t++) {
            int32_t id = ((const int32_t*)t_base(&a->token_ids))[t * a->token_ids.strides[0]];
            if (id < 0 || id >= V)
                return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: token_ids[%lld]=%d outside [0, V=%lld) of "
                               "hash_table", (long long)t, id, (long long)V);
            const int32_t* hr = (const int32_t*)t_row(&a->hash_table, DT_I32, id);
            for (int64_t k = 0; k < K; k++)
                if (hr[k] < 0 || hr[k] >= E)
                    return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_router: hash_table[%d, %lld]=%d outside [0, E=%lld)",
                                   id, (long long)k, hr[k], (long long)E);
        }
    }
    float* sc = di_malloc((size_t)(2 * E + G + 1) * sizeof(float));
    if (!sc) return DI_OOM(ctx, "moe_router");
    float* sel = sc + E;
    float* gs = sel + E;
    const float* bias = has_bias ? (const float*)t_base(&a->bias) : NULL;
    int64_t bst = has_bias ? a->bias.strides[0] : 0;
    int64_t gsz = G > 1 ? E / G : E;
    for (int64_t t = 0; t < T; t++) {
        const float* lg = (const float*)t_row(&a->logits, DT_F32, t);
        if (a->scoring == DI_SCORING_SOFTMAX) {
            float mx = -INFINITY;
            for (int64_t e = 0; e < E; e++) mx = fmaxf(mx, lg[e]);
            float sum = 0.0f;
            for (int64_t e = 0; e < E; e++) { sc[e] = expf(lg[e] - mx); sum += sc[e]; }
            for (int64_t e = 0; e < E; e++) sc[e] /= sum;
        } else if (a->scoring == DI_SCORING_SIGMOID) {
            for (int64_t e = 0; e < E; e++) sc[e] = 1.0f / (1.0f + expf(-lg[e]));
        } else {
            /* V4: sqrt(softplus(v)), softplus = v itself above 20 (torch's threshold); in f64 and
             * rounded once, so the score is the correctly rounded value selection ties are judged on */
            for (int64_t e = 0; e < E; e++) {
                double x = lg[e];
                sc[e] = (float)sqrt(x > 20.0 ? x : log1p(exp(x)));
            }
        }
        int32_t* oid = (int32_t*)t_row(&a->topk_ids, DT_I32, t);
        float* ow = (float*)t_row(&a->topk_weights, DT_F32, t);
        if (hashed) {   /* the token's experts in table order; no selection */
            int32_t id = ((const int32_t*)t_base(&a->token_ids))[t * a->token_ids.strides[0]];
            const int32_t* hr = (const int32_t*)t_row(&a->hash_table, DT_I32, id);
            for (int64_t k = 0; k < K; k++) {
                oid[k] = hr[k];
                ow[k] = sc[hr[k]];
            }
        } else {
            for (int64_t e = 0; e < E; e++) sel[e] = bias ? sc[e] + bias[e * bst] : sc[e];
            if (G > 1) {
                for (int g = 0; g < G; g++) {
                    const float* s = sel + g * gsz;
                    float m1 = -INFINITY, m2 = -INFINITY;
                    for (int64_t i = 0; i < gsz; i++) {
                        if (s[i] > m1) { m2 = m1; m1 = s[i]; }
                        else if (s[i] > m2) m2 = s[i];
                    }
                    gs[g] = a->group_score == DI_GROUP_SCORE_MAX ? m1 : (gsz >= 2 ? m1 + m2 : m1);
                }
                /* keep the topk_group best groups (ties to the lower group), mask the rest to -inf */
                unsigned char keep[1024];
                unsigned char* kp = G <= 1024 ? keep : malloc((size_t)G);
                if (!kp) { free(sc); return DI_OOM(ctx, "moe_router"); }
                memset(kp, 0, (size_t)G);
                for (int r = 0; r < a->topk_group; r++) {
                    int best = -1;
                    for (int g = 0; g < G; g++)
                        if (!kp[g] && (best < 0 || gs[g] > gs[best])) best = g;
                    kp[best] = 1;
                }
                for (int g = 0; g < G; g++)
                    if (!kp[g])
                        for (int64_t i = 0; i < gsz; i++) sel[g * gsz + i] = -INFINITY;
                if (kp != keep) free(kp);
            }
            /* K picks of the largest sel, ties to the lower index; picked experts are marked NaN-free
             * by tracking them in oid (K is small) */
            for (int64_t k = 0; k < K; k++) {
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++) {
                    int taken = 0;
                    for (int64_t q = 0; q < k; q++) if (oid[q] == e) { taken = 1; break; }
                    if (taken) continue;
                    if (best < 0 || sel[e] > sel[best]) best = e;
                }
                oid[k] = (int32_t)best;
                ow[k] = sc[best];
            }
        }
        if (a->norm_topk_prob) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += ow[k];
            for (int64_t k = 0; k < K; k++) ow[k] /= (sum + 1e-20f);
        }
        for (int64_t k = 0; k < K; k++) ow[k] *= a->routed_scaling_factor;
    }
    free(sc);
    return DI_OK;
}

/* ------------------------------------------------------------------ sample and spec_verify */
static uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* u = (splitmix64(seed) >> 11) * 2^-53, in [0, 1) */
static double uniform01(uint64_t seed) { return (double)(splitmix64(seed) >> 11) * 0x1p-53; }

/* spec_verify's second draw uses seed + this (mod 2^64) */
#define SPEC_SEED_STEP 0x9E3779B97F4A7C15ull

typedef struct { float p; int32_t i; } PI;
static int cmp_pi(const void* x, const void* y) {
    const PI *a = (const PI*)x, *b = (const PI*)y;
    if (a->p > b->p) return -1;
    if (a->p < b->p) return 1;
    return (a->i > b->i) - (a->i < b->i);
}

/* argmax of a row (lowest index on ties); *prob (if not NULL) = its softmax probability at
 * temperature 1, the model's own confidence (buf: V floats of scratch) */
static int32_t row_argmax(const float* lg, int64_t V, float* prob, float* buf) {
    /* the largest value (a loop the compiler vectorizes; rows hold no NaN), then its first index */
    float mx = lg[0];
    for (int64_t i = 1; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
    int32_t tok = 0;
    while (lg[tok] != mx) tok++;
    if (prob) {
        memcpy(buf, lg, (size_t)V * sizeof(float));
        kernels()->softmax(buf, V, 1.0f);
        *prob = buf[tok];
    }
    return tok;
}

/*
 * The distribution `sample` draws a row from (temperature T > 0), shared by sample and spec_verify
 * so the two can never disagree. Draw order is softmax probability descending, ties to the lower
 * index; the kept set is a prefix of it (top_k, then the shortest prefix reaching top_p).
 *
 * Sorting all V tokens (a 129K vocabulary) would cost far more than the step, so only a head is
 * sorted: the tokens with p >= t, t starting 2^12 below the largest p. Every token outside the head
 * is less likely than every token in it, so the head holds the kept set as soon as it reaches
 * top_k tokens or top_p mass; otherwise t drops 2^12-fold and the head grows (at worst to all V).
 * With neither top_k nor top_p (keep = V), the head grows only when a draw runs past it.
 */
typedef struct {
    float*  p;       /* [V] softmax(logits / T) (f32) */
    PI*     pi;      /* pi[0..n): the head, in draw order */
    int64_t V, n;
    int64_t keep;    /* the kept set is draw order's first keep tokens (keep <= n, or keep = V) */
    double  ksum;    /* their probability mass */
    float   t;       /* the head holds every token with p >= t */
} Dist;

static void dist_grow(Dist* d) {
    d->t = d->t > 1e-30f ? d->t * 0x1p-12f : 0.0f;
    int64_t n = 0;
    for (int64_t i = 0; i < d->V; i++)
        if (d->p[i] >= d->t) { d->pi[n].p = d->p[i]; d->pi[n].i = (int32_t)i; n++; }
    qsort(d->pi, (size_t)n, sizeof(PI), cmp_pi);
    d->n = n;
}

/* p = softmax(lg / T) into buf, the head, and the kept set */
static void dist_init(Dist* d, const float* lg, int64_t V, float T, int32_t k, float p_top, PI* pi, float* buf) {
    memcpy(buf, lg, (size_t)V * sizeof(float));
    kernels()->softmax(buf, V, 1.0f / T);
    float mx = 0.0f;
    for (int64_t i = 0; i < V; i++) mx = fmaxf(mx, buf[i]);
    d->p = buf; d->pi = pi; d->V = V;
    d->t = mx * 0x1p12f;    /* dist_grow divides first */
    dist_grow(d);
    int64_t lim = k > 0 && k < V ? k : V;
    if (lim == V && !(p_top < 1.0f)) {     /* everything kept: no order needed to know the set */
        double s = 0.0;
        for (int64_t i = 0; i < V; i++) s += buf[i];
        d->keep = V;
        d->ksum = s;
        return;
    }
    for (;;) {
        double run = 0.0;
        int64_t m = 0;
        int done = 0;
        while (m < d->n && m < lim) {
            run += d->pi[m].p;
            m++;
            if (run >= (double)p_top) { done = 1; break; }
        }
        if (done || m == lim || d->n == V) {   /* decided inside the head (or the head is everything) */
            d->keep = m;
            d->ksum = run;
            return;
        }
        dist_grow(d);
    }
}

/* the token sample draws with `seed`, and its probability in the kept set */
static int32_t dist_draw(Dist* d, uint64_t seed, float* prob) {
    double target = uniform01(seed) * d->ksum;
    for (;;) {
        double acc = 0.0;
        int64_t lim = d->keep < d->n ? d->keep : d->n;
        for (int64_t i = 0; i < lim; i++) {
            acc += d->pi[i].p;
            if (acc > target) {
                if (prob) *prob = (float)(d->pi[i].p / d->ksum);
                return d->pi[i].i;
            }
        }
        if (lim == d->keep || d->n == d->V) {  /* rounding ran out: the last kept token */
            if (prob) *prob = (float)(d->pi[lim - 1].p / d->ksum);
            return d->pi[lim - 1].i;
        }
        dist_grow(d);                          /* keep = V and the draw ran past the head */
    }
}

/* NaN or +inf anywhere, or a row that is all -inf: INVALID_ARGUMENT (rows where `use` is not NULL
 * and use[r] is 0 are skipped) */
static DI_Status check_logit_values(VC* v, const DI_Tensor* t, const char* name, const uint8_t* use) {
    int64_t R = t->shape[0], V = t->shape[1];
    for (int64_t r = 0; r < R; r++) {
        if (use && !use[r]) continue;
        const float* lg = (const float*)t_row(t, DT_F32, r);
        /* the common case in one vectorizable pass: every value below +inf (NaN fails too), one above -inf */
        int bad = 0, any = V == 0;
        for (int64_t i = 0; i < V; i++) {
            bad |= !(lg[i] < INFINITY);
            any |= lg[i] > -INFINITY;
        }
        if (!bad && any) continue;
        int64_t finite = 0;
        for (int64_t i = 0; i < V; i++) {
            if (isnan(lg[i]) || lg[i] == INFINITY)
                return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s[%lld, %lld] is %s", v->op, name, (long long)r,
                               (long long)i, isnan(lg[i]) ? "NaN" : "+inf");
            finite += lg[i] != -INFINITY;
        }
        if (V > 0 && !finite)
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: row %lld of %s is all -inf", v->op, (long long)r, name);
    }
    return DI_OK;
}

/* the per-row controls both ops take, checked against B rows */
static DI_Status check_controls(VC* v, const DI_Tensor* temp, const DI_Tensor* tk, const DI_Tensor* tp,
                                const DI_Tensor* seeds, int64_t B) {
    DI_Status st;
    if ((st = check_tensor(v, temp, "temperature", 1, 1, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(v, tk, "top_k", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(v, tp, "top_p", 1, 1, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(v, seeds, "seeds", 1, 1, DTM(DT_U64) | DTM(DT_I64), 0))) return st;
    if ((st = check_dim(v, temp, "temperature", 0, B))) return st;
    if ((st = check_dim(v, tk, "top_k", 0, B))) return st;
    if ((st = check_dim(v, tp, "top_p", 0, B))) return st;
    return check_dim(v, seeds, "seeds", 0, B);
}

static DI_Status check_top_k(VC* v, const DI_Tensor* tk, int64_t B) {
    for (int64_t b = 0; b < B; b++) {
        int32_t k = ((const int32_t*)t_base(tk))[b * tk->strides[0]];
        if (k < 0) return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: top_k[%lld]=%d is negative (0 = off)", v->op,
                                  (long long)b, k);
    }
    return DI_OK;
}

#define AT(t, type, i) (((type*)t_base(&(t)))[(i) * (t).strides[0]])

static size_t scratch_float_offset(int64_t V);

/* one row per task; worker w owns scratch + w * per (PI entries for the target and the draft, then
 * two dense f64 rows) */
typedef struct {
    const DI_SampleArgs*     s;     /* sample, or */
    const DI_SpecVerifyArgs* sv;    /* spec_verify */
    int64_t V;
    char*   scratch;
    size_t  per;
} SampleJob;

static void sample_task(void* arg, int64_t b, int worker) {
    const SampleJob* j = (const SampleJob*)arg;
    const DI_SampleArgs* a = j->s;
    const float* lg = (const float*)t_row(&a->logits, DT_F32, b);
    float T = AT(a->temperature, const float, b), prob = 0.0f;
    int want_prob = a->probs.data != NULL;
    char* mem = j->scratch ? j->scratch + (size_t)worker * j->per : NULL;
    float* buf = mem ? (float*)(mem + scratch_float_offset(j->V)) : NULL;
    int32_t tok;
    if (!(T > 0.0f)) {
        tok = row_argmax(lg, j->V, want_prob ? &prob : NULL, buf);
    } else {
        Dist d;
        dist_init(&d, lg, j->V, T, AT(a->top_k, const int32_t, b), AT(a->top_p, const float, b), (PI*)mem, buf);
        tok = dist_draw(&d, AT(a->seeds, const uint64_t, b), &prob);
    }
    AT(a->out, int32_t, b) = tok;
    if (want_prob) AT(a->probs, float, b) = prob;
}

/* per worker: two heads (target and draft), two dense f64 rows, two f32 distributions */
static size_t scratch_float_offset(int64_t V) { return (size_t)V * (2 * sizeof(PI) + 2 * sizeof(double)); }

static size_t sample_scratch_per(int64_t V) {
    size_t per = scratch_float_offset(V) + (size_t)V * 2 * sizeof(float);
    return (per + 63) & ~(size_t)63;
}

/* The scratch of sample and spec_verify, kept per calling thread and grown only: a decode step
 * calls them every time, and a fresh allocation of this size is an mmap whose pages fault in on
 * every call (it cost more than the ops themselves). Released when the thread exits. */
static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;
typedef struct { char* p; size_t cap; } SampleScratch;
static void scratch_free(void* x) { free(((SampleScratch*)x)->p); free(x); }
static void scratch_key_init(void) { pthread_key_create(&g_scratch_key, scratch_free); }

static char* sample_scratch(size_t bytes) {
    pthread_once(&g_scratch_once, scratch_key_init);
    SampleScratch* s = (SampleScratch*)pthread_getspecific(g_scratch_key);
    if (!s) {
        if (!(s = (SampleScratch*)calloc(1, sizeof *s))) return NULL;
        pthread_setspecific(g_scratch_key, s);
    }
    if (s->cap < bytes) {
        free(s->p);
        s->p = di_malloc(bytes);
        s->cap = s->p ? bytes : 0;
    }
    return s->p;
}

/* rows that need scratch: sampled ones, and greedy ones that report a probability */
static int rows_need_scratch(const DI_Tensor* temp, const DI_Tensor* probs, int64_t B) {
    if (probs && probs->data) return B > 0;
    for (int64_t b = 0; b < B; b++)
        if (((const float*)t_base(temp))[b * temp->strides[0]] > 0.0f) return 1;
    return 0;
}

DI_Status op_sample(DI_Context* ctx, const DI_SampleArgs* a, int query) {
    VC v = {ctx, "sample", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->logits, "logits", 2, 2, DTM(DT_F32), 0))) return st;
    int64_t B = a->logits.shape[0], V = a->logits.shape[1];
    if ((st = check_controls(&v, &a->temperature, &a->top_k, &a->top_p, &a->seeds, B))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, B))) return st;
    if (tensor_present(&v, &a->probs)) {   /* 1.2; zero when the caller's struct ends before it */
        if ((st = check_tensor(&v, &a->probs, "probs", 1, 1, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(&v, &a->probs, "probs", 0, B))) return st;
    }
    if (B > 0 && V == 0) return di_fail(ctx, DI_INVALID_ARGUMENT, "sample: logits has V=0 columns");
    if (query) return DI_OK;
    if ((st = check_top_k(&v, &a->top_k, B))) return st;
    if ((st = check_logit_values(&v, &a->logits, "logits", NULL))) return st;
    SampleJob j = {a, NULL, V, NULL, sample_scratch_per(V)};
    if (rows_need_scratch(&a->temperature, &a->probs, B) &&
        !(j.scratch = sample_scratch((size_t)pool_size(ctx->pool) * j.per)))
        return DI_OOM(ctx, "sample");
    pool_run(ctx->pool, B, sample_task, &j, B * V * 16);
    return DI_OK;
}

/* spec_verify, one row (README section 8) */
static void verify_task(void* arg, int64_t t, int worker) {
    const SampleJob* j = (const SampleJob*)arg;
    const DI_SpecVerifyArgs* a = j->sv;
    const int64_t V = j->V;
    const float* lg = (const float*)t_row(&a->logits, DT_F32, t);
    float T = AT(a->temperature, const float, t);
    int32_t d = AT(a->draft_ids, const int32_t, t), k = AT(a->top_k, const int32_t, t);
    float top_p = AT(a->top_p, const float, t);
    uint64_t seed = AT(a->seeds, const uint64_t, t);
    int32_t tok, acc = 0;
    char* mem = j->scratch ? j->scratch + (size_t)worker * j->per : NULL;
    float* buf = mem ? (float*)(mem + scratch_float_offset(V)) : NULL;
    if (!(T > 0.0f)) {                        /* greedy: the argmax, accepted when it is the draft */
        tok = row_argmax(lg, V, NULL, buf);
        acc = d >= 0 && tok == d;
    } else {
        Dist pd;                              /* the target's distribution */
        dist_init(&pd, lg, V, T, k, top_p, (PI*)mem, buf);
        if (d < 0) {                          /* the bonus position: a plain draw */
            tok = dist_draw(&pd, seed, NULL);
        } else {
            PI* pj = (PI*)mem + V;            /* the draft's head */
            double* p = (double*)(pj + V);    /* dense target distribution */
            double* q = p + V;                /* dense draft distribution */
            for (int64_t x = 0; x < V; x++) p[x] = q[x] = 0.0;
            if (pd.keep == V) {
                for (int64_t x = 0; x < V; x++) p[x] = pd.p[x] / pd.ksum;
            } else {
                for (int64_t i = 0; i < pd.keep; i++) p[pd.pi[i].i] = pd.pi[i].p / pd.ksum;
            }
            if (a->draft_logits.data) {
                Dist qd;
                dist_init(&qd, (const float*)t_row(&a->draft_logits, DT_F32, t), V, T, k, top_p, pj, buf + V);
                if (qd.keep == V) {
                    for (int64_t x = 0; x < V; x++) q[x] = qd.p[x] / qd.ksum;
                } else {
                    for (int64_t i = 0; i < qd.keep; i++) q[qd.pi[i].i] = qd.pi[i].p / qd.ksum;
                }
            } else {
                q[d] = 1.0;                   /* greedy drafting: q is one-hot at the draft */
            }
            if (uniform01(seed) * q[d] < p[d]) {
                tok = d;
                acc = 1;
            } else {                          /* rejected: draw from r = max(p - q, 0), index order */
                double rsum = 0.0;
                for (int64_t x = 0; x < V; x++) rsum += p[x] > q[x] ? p[x] - q[x] : 0.0;
                uint64_t seed2 = seed + SPEC_SEED_STEP;
                if (rsum > 0.0) {
                    double target = uniform01(seed2) * rsum, run = 0.0;
                    tok = -1;
                    for (int64_t x = 0; x < V; x++) {
                        if (!(p[x] > q[x])) continue;
                        tok = (int32_t)x;     /* the last token with r > 0, should rounding run out */
                        run += p[x] - q[x];
                        if (run > target) break;
                    }
                } else {
                    tok = dist_draw(&pd, seed2, NULL);
                }
            }
        }
    }
    AT(a->out, int32_t, t) = tok;
    AT(a->accepted, int32_t, t) = acc;
}

DI_Status op_spec_verify(DI_Context* ctx, const DI_SpecVerifyArgs* a, int query) {
    VC v = {ctx, "spec_verify", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->logits, "logits", 2, 2, DTM(DT_F32), 0))) return st;
    int64_t T = a->logits.shape[0], V = a->logits.shape[1];
    int draft = tensor_present(&v, &a->draft_logits);
    if (draft) {
        if ((st = check_tensor(&v, &a->draft_logits, "draft_logits", 2, 2, DTM(DT_F32), 0))) return st;
        if (a->draft_logits.shape[0] != T || a->draft_logits.shape[1] != V)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "spec_verify: draft_logits.shape=[%lld, %lld] != logits.shape="
                           "[%lld, %lld]", (long long)a->draft_logits.shape[0], (long long)a->draft_logits.shape[1],
                           (long long)T, (long long)V);
    }
    if ((st = check_tensor(&v, &a->draft_ids, "draft_ids", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_dim(&v, &a->draft_ids, "draft_ids", 0, T))) return st;
    if ((st = check_controls(&v, &a->temperature, &a->top_k, &a->top_p, &a->seeds, T))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T))) return st;
    if ((st = check_tensor(&v, &a->accepted, "accepted", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_dim(&v, &a->accepted, "accepted", 0, T))) return st;
    if (T > 0 && V == 0) return di_fail(ctx, DI_INVALID_ARGUMENT, "spec_verify: logits has V=0 columns");
    if (query) return DI_OK;
    if ((st = check_top_k(&v, &a->top_k, T))) return st;
    uint8_t* judged = draft && T > 0 ? di_malloc((size_t)T) : NULL;   /* rows that read draft_logits */
    if (draft && T > 0 && !judged) return DI_OOM(ctx, "spec_verify");
    for (int64_t t = 0; t < T; t++) {
        int32_t d = AT(a->draft_ids, const int32_t, t);
        if (d >= V) {
            free(judged);
            return di_fail(ctx, DI_INVALID_ARGUMENT, "spec_verify: draft_ids[%lld]=%d >= V=%lld", (long long)t, d,
                           (long long)V);
        }
        if (judged) judged[t] = AT(a->temperature, const float, t) > 0.0f && d >= 0;
    }
    st = check_logit_values(&v, &a->logits, "logits", NULL);
    if (!st && judged) st = check_logit_values(&v, &a->draft_logits, "draft_logits", judged);
    free(judged);
    if (st) return st;
    SampleJob j = {NULL, a, V, NULL, sample_scratch_per(V)};
    if (rows_need_scratch(&a->temperature, NULL, T) &&
        !(j.scratch = sample_scratch((size_t)pool_size(ctx->pool) * j.per)))
        return DI_OOM(ctx, "spec_verify");
    pool_run(ctx->pool, T, verify_task, &j, T * V * 32);
    return DI_OK;
}
#undef AT
