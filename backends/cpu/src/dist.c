/* The local halves of MoE expert parallelism (ABI 1.4, abi/README.md section 9): moe_dispatch packs
 * each token into the slot of every rank that holds one of its experts, before an all_to_all;
 * moe_combine sums the expert outputs that the returning all_to_all brought back. The collectives
 * themselves are in comm_mpi.c.
 *
 * Semantics are backends/reference/dist.py's. moe_dispatch moves bytes and integers only (exact);
 * moe_combine sums in f32 in rank order where the reference uses f64, and rounds once. */
#include <stdlib.h>
#include <string.h>

#include "di_cpu.h"

static inline const int32_t* irow(const DI_Tensor* t, int64_t r) { return (const int32_t*)t_base(t) + r * t->strides[0]; }
static inline int32_t* irow_w(const DI_Tensor* t, int64_t r) { return (int32_t*)t_base(t) + r * t->strides[0]; }
static inline float* frow2(const DI_Tensor* t, int64_t i, int64_t j) {
    return (float*)t_base(t) + i * t->strides[0] + j * t->strides[1];
}
static inline int32_t* irow2(const DI_Tensor* t, int64_t i, int64_t j) {
    return (int32_t*)t_base(t) + i * t->strides[0] + j * t->strides[1];
}

/* ================================================================== moe_dispatch */
static DI_Status dispatch_check(VC* v, const DI_MoEDispatchArgs* a) {
    DI_Status st;
    const DI_Tensor* x = &a->x;
    int64_t T = x->shape[0], H = x->shape[1], K = a->topk_ids.shape[1];
    int64_t N = a->send_x.shape[0], C = a->send_x.shape[1];
    if (a->experts_per_rank < 1)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: experts_per_rank=%d must be >= 1", v->op, a->experts_per_rank);
    if (N < 1) return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: send_x.shape[0] (ranks) must be >= 1", v->op);
    if ((st = check_dim(v, &a->topk_ids, "topk_ids", 0, T))) return st;
    if ((st = check_same_shape(v, &a->topk_ids, "topk_ids", &a->topk_weights, "topk_weights"))) return st;
    if (C < T)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: send_x.shape[1]=%lld < x.shape[0]=%lld: a slot must hold "
                       "every token", v->op, (long long)C, (long long)T);
    if ((st = check_dim(v, &a->send_x, "send_x", 2, H))) return st;
    if (dt_id(a->send_x.dtype) != dt_id(x->dtype))
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: send_x.dtype=%s != x.dtype=%s", v->op,
                       dt_name(dt_id(a->send_x.dtype)), dt_name(dt_id(x->dtype)));
    const int64_t idshape[3] = {N, C, K};
    for (int d = 0; d < 3; d++) {
        if ((st = check_dim(v, &a->send_ids, "send_ids", d, idshape[d]))) return st;
        if ((st = check_dim(v, &a->send_weights, "send_weights", d, idshape[d]))) return st;
    }
    if ((st = check_dim(v, &a->send_counts, "send_counts", 0, N))) return st;
    if ((st = check_dim(v, &a->route, "route", 0, T)) || (st = check_dim(v, &a->route, "route", 1, N))) return st;
    return DI_OK;
}

/* Every row of send_ids / send_weights is written (-1 / 0 past the count, as the spec says); send_x
 * rows past the count are left alone (unspecified), so only the rows that travel are copied. */
static void dispatch_clear(const DI_MoEDispatchArgs* a, int64_t N, int64_t C, int64_t K) {
    for (int64_t p = 0; p < N; p++) {
        for (int64_t j = 0; j < C; j++) {
            int32_t* ids = irow2(&a->send_ids, p, j);
            float* w = frow2(&a->send_weights, p, j);
            for (int64_t k = 0; k < K; k++) {
                ids[k] = -1;
                w[k] = 0.0f;
            }
        }
        ((int32_t*)t_base(&a->send_counts))[p * a->send_counts.strides[0]] = 0;
    }
}

DI_Status op_moe_dispatch(DI_Context* ctx, const DI_MoEDispatchArgs* a, int query) {
    VC v = {ctx, "moe_dispatch", query};
    DI_Status st = dispatch_check(&v, a);
    if (st || query) return st;
    int64_t T = a->x.shape[0], H = a->x.shape[1], K = a->topk_ids.shape[1];
    int64_t N = a->send_x.shape[0], C = a->send_x.shape[1], Er = a->experts_per_rank;
    int xd = dt_id(a->x.dtype);
    size_t row_bytes = (size_t)H * (size_t)(dt_bits(xd) / 8);
    dispatch_clear(a, N, C, K);
    int32_t* counts = (int32_t*)t_base(&a->send_counts);
    int64_t cs = a->send_counts.strides[0];
    /* tokens in order, so each slot's rows are in token order; a running count per rank is the row */
    for (int64_t t = 0; t < T; t++) {
        const int32_t* ids = irow(&a->topk_ids, t);
        const float* wts = (const float*)t_base(&a->topk_weights) + t * a->topk_weights.strides[0];
        int32_t* rt = irow_w(&a->route, t);
        for (int64_t p = 0; p < N; p++) rt[p] = -1;
        for (int64_t k = 0; k < K; k++) {
            int64_t e = ids[k];
            if (e < 0 || e >= N * Er) continue;    /* no rank holds it: skipped */
            int64_t p = e / Er;
            if (rt[p] < 0) {                      /* the token's first expert on rank p: its row */
                int32_t j = counts[p * cs]++;
                rt[p] = j;
                memcpy(t_row2(&a->send_x, xd, p, j), t_row(&a->x, xd, t), row_bytes);
            }
            irow2(&a->send_ids, p, rt[p])[k] = (int32_t)(e - p * Er);
            frow2(&a->send_weights, p, rt[p])[k] = wts[k];
        }
    }
    return DI_OK;
}

/* ================================================================== moe_combine */
typedef struct {
    const DI_MoECombineArgs* a;
    int bd, od;
    int64_t T, N, H, per;
    float* scratch;    /* 2 * H floats per worker: the sum and one loaded row */
} CombineJob;

static void combine_task(void* arg, int64_t task, int worker) {
    const CombineJob* j = (const CombineJob*)arg;
    const DI_MoECombineArgs* a = j->a;
    float* y = j->scratch + (size_t)worker * 2 * (size_t)j->H;
    float* r = y + j->H;
    int64_t t1 = (task + 1) * j->per < j->T ? (task + 1) * j->per : j->T, H = j->H;
    for (int64_t t = task * j->per; t < t1; t++) {
        if (a->accumulate) load_row(j->od, t_row(&a->out, j->od, t), 0, H, y);
        else memset(y, 0, (size_t)H * sizeof(float));
        const int32_t* rt = irow(&a->route, t);
        for (int64_t p = 0; p < j->N; p++) {       /* rank order: the same sum on every backend run */
            if (rt[p] < 0) continue;
            load_row(j->bd, t_row2(&a->back, j->bd, p, rt[p]), 0, H, r);
            for (int64_t h = 0; h < H; h++) y[h] += r[h];
        }
        store_row(j->od, t_row(&a->out, j->od, t), y, H);
    }
}

DI_Status op_moe_combine(DI_Context* ctx, const DI_MoECombineArgs* a, int query) {
    VC v = {ctx, "moe_combine", query};
    DI_Status st;
    int64_t N = a->back.shape[0], C = a->back.shape[1], H = a->back.shape[2], T = a->out.shape[0];
    if ((st = check_dim(&v, &a->out, "out", 1, H))) return st;
    if ((st = check_dim(&v, &a->route, "route", 0, T)) || (st = check_dim(&v, &a->route, "route", 1, N))) return st;
    if (query) return DI_OK;
    /* the routes are host values: checked before any row is read, so a bad one reads nothing */
    for (int64_t t = 0; t < T; t++) {
        const int32_t* rt = irow(&a->route, t);
        for (int64_t p = 0; p < N; p++)
            if (rt[p] < -1 || rt[p] >= C)
                return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_combine: route[%lld, %lld]=%d must be -1 or a row in "
                               "[0, C=%lld)", (long long)t, (long long)p, rt[p], (long long)C);
    }
    if (T == 0 || H == 0) return DI_OK;
    CombineJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.T = T; j.N = N; j.H = H;
    j.bd = dt_id(a->back.dtype); j.od = dt_id(a->out.dtype);
    j.scratch = di_malloc((size_t)pool_size(ctx->pool) * 2 * (size_t)H * sizeof(float));
    if (!j.scratch) return DI_OOM(ctx, "moe_combine");
    int64_t p = H >= 8192 ? 1 : 8192 / H;
    j.per = p < 1 ? 1 : p;
    pool_run(ctx->pool, (T + j.per - 1) / j.per, combine_task, &j, T * H * (N + 1));
    free(j.scratch);
    return DI_OK;
}
