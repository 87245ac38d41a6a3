/* The elementwise ops: embedding, add, mul, silu_mul and concat.
 * All math in f32 (double where a long sum would drift), one rounding to the output dtype at the
 * end. Inputs are read into f32 row buffers before any output of that row is written, which is what
 * makes the allowed aliasing (out == x, residual_out == residual) safe. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "op_rows.h"

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
