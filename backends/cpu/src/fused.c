/* Fused ops (ABI 1.6). mla_rope_cache_write: MLA's prologue in one pass per token (the latent's
 * rmsnorm, k_pe's and q's rope, the cache row and kv_out), through the same row math as rmsnorm
 * (norm.c) and rope (rope.c), so its outputs have the bits of those ops followed by mla_cache_write.
 * Each token's kv row is read into f32 buffers before anything of that token is written, which is
 * what makes kv_out == kv safe. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "op_rows.h"

typedef struct {
    const DI_MLARopeCacheWriteArgs* a;
    int qd, kd, cd, od, has_out;
    int64_t H, Dq, Dc, Dr, NB, BS;
    const float* w;        /* norm_weight in f32 */
    const double* inv;     /* rope frequencies [Dr / 2] */
    Scratch s;
} FusedJob;

static void mla_rope_cache_write_task(void* arg, int64_t t, int worker) {
    const FusedJob* j = (const FusedJob*)arg;
    const DI_MLARopeCacheWriteArgs* a = j->a;
    const int64_t Dc = j->Dc, Dr = j->Dr, W = Dc + Dr, half = Dr / 2;
    float* in = scratch_get(&j->s, worker, 0);   /* kv[t] as read */
    float* row = in + W;                          /* [normed latent, rotated k_pe]: what the cache gets */
    float* c = row + W;
    float* s = c + half;
    float* qr = s + half;
    load_row(j->kd, t_row(&a->kv, j->kd, t), 0, W, in);
    rmsnorm_row(in, j->w, Dc, a->eps, row);
    rope_cos_sin((double)ix1(&a->positions, t), j->inv, half, a->attn_factor, c, s);
    memcpy(row + Dc, in + Dc, (size_t)Dr * sizeof(float));
    rope_rotate(row + Dc, c, s, Dr, a->interleaved);
    if (j->has_out) store_row(j->od, t_row(&a->kv_out, j->od, t), row, W);
    int64_t slot = ix1(&a->slots, t);
    if (slot >= 0 && slot < j->NB * j->BS) store_row(j->cd, t_row2(&a->cache, j->cd, slot / j->BS, slot % j->BS), row, W);
    for (int64_t h = 0; h < j->H; h++) {
        char* p = t_at(&a->q, j->qd, t * a->q.strides[0] + h * a->q.strides[1] + (j->Dq - Dr));
        load_row(j->qd, p, 0, Dr, qr);
        rope_rotate(qr, c, s, Dr, a->interleaved);
        store_row(j->qd, p, qr, Dr);
    }
}

DI_Status op_mla_rope_cache_write(DI_Context* ctx, const DI_MLARopeCacheWriteArgs* a, int query) {
    const char* op = "mla_rope_cache_write";
    VC v = {ctx, op, query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->q, "q", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->kv, "kv", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->norm_weight, "norm_weight", 1, 1, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->positions, "positions", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->slots, "slots", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->cache, "cache", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->q.shape[0], Dq = a->q.shape[2], W = a->kv.shape[1], Dc = a->norm_weight.shape[0], Dr = W - Dc;
    if ((st = check_dim(&v, &a->kv, "kv", 0, T))) return st;
    if ((st = check_dim(&v, &a->positions, "positions", 0, T))) return st;
    if ((st = check_dim(&v, &a->slots, "slots", 0, T))) return st;
    if ((st = check_dim(&v, &a->cache, "cache", 2, W))) return st;
    int has_out = tensor_present(&v, &a->kv_out);
    if (has_out) {
        if ((st = check_tensor(&v, &a->kv_out, "kv_out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
        if ((st = check_same_shape(&v, &a->kv, "kv", &a->kv_out, "kv_out"))) return st;
    }
    if (Dr < 0 || Dr % 2)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: Dr = kv.shape[1] - norm_weight.shape[0] = %lld must be even "
                       "and >= 0", op, (long long)Dr);
    if (Dq < Dr)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: q.shape[2]=%lld < Dr=%lld", op, (long long)Dq, (long long)Dr);
    if (!isfinite(a->eps) || a->eps < 0.0f)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: eps=%g must be finite and >= 0", op, (double)a->eps);
    if ((st = rope_check_params(ctx, op, a->interleaved, a->scaling, a->theta, a->factor, a->original_max_position,
                                a->beta_fast, a->beta_slow)))
        return st;
    if (query || !T) return DI_OK;
    FusedJob j;
    memset(&j, 0, sizeof j);
    j.a = a;
    j.qd = dt_id(a->q.dtype); j.kd = dt_id(a->kv.dtype); j.cd = dt_id(a->cache.dtype);
    j.od = has_out ? dt_id(a->kv_out.dtype) : 0;
    j.has_out = has_out;
    j.H = a->q.shape[1]; j.Dq = Dq; j.Dc = Dc; j.Dr = Dr;
    j.NB = a->cache.shape[0]; j.BS = a->cache.shape[1];
    float* w = di_malloc((size_t)(Dc + 1) * sizeof(float));
    double* inv = di_malloc((size_t)(Dr / 2 + 1) * sizeof(double));
    if (!w || !inv || !scratch_init(&j.s, ctx, 2 * W + 2 * Dr)) {
        free(w); free(inv);
        return DI_OOM(ctx, op);
    }
    load_row(dt_id(a->norm_weight.dtype), t_base(&a->norm_weight), 0, Dc, w);
    rope_inv_freq(Dr, a->scaling, a->theta, a->factor, a->original_max_position, a->beta_fast, a->beta_slow, inv);
    j.w = w; j.inv = inv;
    pool_run(ctx->pool, T, mla_rope_cache_write_task, &j, T * (4 * W + j.H * Dr * 8));
    free(w); free(inv);
    free(j.s.mem);
    return DI_OK;
}
