/* linear and moe_experts.
 *
 * One engine, lin_f32, computes Y = X @ dequant(W)^T for f32 activations and any weight format:
 *  - small M (decode, M <= 8): a fused "row dot" kernel per weight dtype reads the stored weights
 *    (f32, bf16, f16, int8, int4, uint4, e4m3, e2m1), converts them in registers and applies one
 *    scale per column block; zero points are folded in afterwards as -sum(z * s * sum(x_block)).
 *    The weights are read once, which is what makes int4 decode faster than f32: it is
 *    memory-bound and int4 moves 8x fewer bytes.
 *  - otherwise (prefill, or a layout the fused kernels do not cover): rows of W are dequantized
 *    into a per-worker f32 tile with the same code as the dequantize op, then a register-blocked
 *    dot-product GEMM runs over the tile.
 * Work is split over output columns (rows of W), so each weight byte is read by one thread.
 *
 * int8-quantized activations with int8 or symmetric int4 weights take the integer path
 * (lin_int): exact int32 dot products over each run of K that shares one x scale and one w
 * scale, scaled in the epilogue. Any other activation-quantized x is dequantized to f32 first.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "di_cpu.h"

#define TILE_N 16
#define FUSED_MAX_M 8

static const uint32_t k_wdts = DTM(DT_F32) | DTM(DT_BF16) | DTM(DT_F16) | DTM(DT_I8) | DTM(DT_U8) | DTM(DT_I4) |
                               DTM(DT_U4) | DTM(DT_E4M3) | DTM(DT_E2M1);

DI_Status check_weight(VC* v, const DI_Tensor* w, const char* name, int64_t N, int64_t K) {
    DI_Status st = check_tensor(v, w, name, 2, 2, k_wdts, 1);
    if (st) return st;
    int dt = dt_id(w->dtype);
    if (!w->quant && dt != DT_F32 && dt != DT_BF16 && dt != DT_F16)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s is %s without a quantization descriptor; plain weights "
                       "are f32, bf16 or f16", v->op, name, dt_name(dt));
    if (N >= 0 && w->shape[0] != N)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[0]=%lld, expected %lld", v->op, name,
                       (long long)w->shape[0], (long long)N);
    if (K >= 0 && w->shape[1] != K)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[1]=%lld, expected %lld", v->op, name,
                       (long long)w->shape[1], (long long)K);
    return DI_OK;
}

/* ------------------------------------------------------------------ float-activation engine */
typedef struct {
    const float* X;
    int64_t      ldx, M, K, N;
    float*       Y;
    int64_t      ldy;
    QMat         m;
    const Kernels* k;
    rowdot_fn    fused;
    int64_t      rows_per_task;
    const float* xsum;   /* [M, ncb] block sums of x, for zero points */
    float*       scratch;
    int64_t      scratch_per_worker;
} LinJob;

static const char* w_row(const QMat* m, int64_t n) {
    int b = dt_bits(m->dt);
    return m->base + (b == 4 ? n * m->rs / 2 : n * m->rs * (b / 8));
}

static void lin_task(void* arg, int64_t task, int worker) {
    const LinJob* j = (const LinJob*)arg;
    int64_t n0 = task * j->rows_per_task, n1 = n0 + j->rows_per_task < j->N ? n0 + j->rows_per_task : j->N;
    float* scr = j->scratch + (size_t)worker * (size_t)j->scratch_per_worker;
    const QMat* m = &j->m;
    if (j->fused) {
        float* srow = scr;
        float* zrow = scr + m->ncb;
        int64_t cur_rb = -1;
        for (int64_t n = n0; n < n1; n++) {
            RowDot a;
            a.w = w_row(m, n);
            a.K = j->K;
            a.bc = m->quant ? m->bc : j->K + 1;
            a.s = NULL;
            if (m->quant) {
                int64_t rb = n / m->br;
                if (rb != cur_rb) { qmat_scale_row(m, rb, srow, zrow); cur_rb = rb; }
                a.s = srow;
            }
            for (int64_t m0 = 0; m0 < j->M; m0 += 4) {
                a.mr = (int)(j->M - m0 < 4 ? j->M - m0 : 4);
                for (int i = 0; i < a.mr; i++) a.x[i] = j->X + (m0 + i) * j->ldx;
                float y[4];
                j->fused(&a, y);
                for (int i = 0; i < a.mr; i++) {
                    float v = y[i];
                    if (m->zbase) {
                        const float* xs = j->xsum + (m0 + i) * m->ncb;
                        float corr = 0.0f;
                        for (int64_t cb = 0; cb < m->ncb; cb++) corr += zrow[cb] * srow[cb] * xs[cb];
                        v -= corr;
                    }
                    j->Y[(m0 + i) * j->ldy + n] = v;
                }
            }
        }
        return;
    }
    for (int64_t t0 = n0; t0 < n1; t0 += TILE_N) {
        int nt = (int)(n1 - t0 < TILE_N ? n1 - t0 : TILE_N);
        for (int i = 0; i < nt; i++) qmat_dequant_row(m, t0 + i, scr + (size_t)i * (size_t)j->K);
        j->k->gemm_dot(j->X, j->ldx, (int)j->M, scr, j->K, nt, j->K, j->Y + t0, j->ldy);
    }
}

static int fused_ok(const QMat* m, rowdot_fn f, int64_t M) {
    if (!f || M > FUSED_MAX_M) return 0;
    if (m->quant && dt_bits(m->dt) == 4 && m->ncb > 1 && (m->bc & 1)) return 0;  /* blocks start mid-byte */
    return 1;
}

DI_Status lin_f32(DI_Context* ctx, const char* op, const float* X, int64_t ldx, int64_t M, const DI_Tensor* w,
                  float* Y, int64_t ldy) {
    LinJob j;
    memset(&j, 0, sizeof j);
    qmat_init(&j.m, w, 0);
    j.X = X; j.ldx = ldx; j.M = M; j.K = j.m.C; j.N = j.m.R; j.Y = Y; j.ldy = ldy;
    j.k = kernels();
    if (M == 0 || j.N == 0) return DI_OK;
    if (j.K == 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < j.N; n++) Y[i * ldy + n] = 0.0f;
        return DI_OK;
    }
    rowdot_fn f = j.k->rowdot[j.m.dt];
    j.fused = fused_ok(&j.m, f, M) ? f : NULL;
    float* xsum = NULL;
    if (j.fused && j.m.zbase) {
        xsum = di_malloc((size_t)M * (size_t)j.m.ncb * sizeof(float));
        if (!xsum) return DI_OOM(ctx, op);
        for (int64_t i = 0; i < M; i++)
            for (int64_t cb = 0; cb < j.m.ncb; cb++) {
                int64_t c0 = cb * j.m.bc, c1 = c0 + j.m.bc < j.K ? c0 + j.m.bc : j.K;
                float s = 0.0f;
                for (int64_t c = c0; c < c1; c++) s += X[i * ldx + c];
                xsum[i * j.m.ncb + cb] = s;
            }
        j.xsum = xsum;
    }
    int nw = pool_size(ctx->pool);
    j.scratch_per_worker = j.fused ? 2 * (j.m.ncb + 1) : (int64_t)TILE_N * j.K;
    j.scratch = di_malloc((size_t)nw * (size_t)j.scratch_per_worker * sizeof(float));
    if (!j.scratch) { free(xsum); return DI_OOM(ctx, op); }
    /* enough tasks to balance threads, few enough that each streams a long run of W */
    int64_t per = (j.N + (int64_t)nw * 4 - 1) / ((int64_t)nw * 4);
    if (j.fused) { if (per < 4) per = 4; }
    else per = (per + TILE_N - 1) / TILE_N * TILE_N;
    j.rows_per_task = per;
    pool_run(ctx->pool, (j.N + per - 1) / per, lin_task, &j);
    free(j.scratch);
    free(xsum);
    return DI_OK;
}

/* ------------------------------------------------------------------ integer engine (W8A8 / W4A8) */
typedef struct {
    const int8_t* xq;   /* [M, K] int8 rows (ldx) */
    int64_t       ldx, M, K, N;
    const float*  sx;   /* x scales per (m, x block) */
    int64_t       xbr, xncb;
    QMat          m;    /* weights */
    int64_t       nseg;
    const int64_t* seg; /* seg[i] = start of segment i; seg[nseg] = K */
    const int64_t *seg_xb, *seg_wb;  /* x and w column block of each segment */
    float*        Y;
    int64_t       ldy;
    int64_t       xbc, rows_per_task;
    int8_t*       scratch;
    int64_t       scratch_per_worker;
    const Kernels* k;
} IntJob;

static void int_task(void* arg, int64_t task, int worker) {
    const IntJob* j = (const IntJob*)arg;
    int64_t n0 = task * j->rows_per_task, n1 = n0 + j->rows_per_task < j->N ? n0 + j->rows_per_task : j->N;
    int8_t* wbuf = j->scratch + (size_t)worker * (size_t)j->scratch_per_worker;
    float* srow = (float*)(wbuf + ((j->K + 63) & ~(int64_t)63));
    float* segscale = srow + j->m.ncb + 16;
    const QMat* m = &j->m;
    int64_t cur_rb = -1;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t* wr;
        if (m->dt == DT_I8) {
            wr = (const int8_t*)(m->base + n * m->rs);
        } else {
            const uint8_t* p = (const uint8_t*)(m->base + n * m->rs / 2);
            j->k->unpack_i4(p, j->K & ~(int64_t)1, wbuf, 1);
            if (j->K & 1) { int v = p[j->K >> 1] & 15; wbuf[j->K - 1] = (int8_t)(v >= 8 ? v - 16 : v); }
            wr = wbuf;
        }
        int64_t rb = n / m->br;
        if (rb != cur_rb) { qmat_scale_row(m, rb, srow, NULL); cur_rb = rb; }
        for (int64_t i = 0; i < j->M; i++) {
            const int8_t* xr = j->xq + i * j->ldx;
            const float* sx = j->sx + (i / j->xbr) * j->xncb;
            for (int64_t s = 0; s < j->nseg; s++) segscale[s] = sx[j->seg_xb[s]] * srow[j->seg_wb[s]];
            j->Y[i * j->ldy + n] = j->k->dot_i8_seg(xr, wr, j->seg, j->nseg, segscale);
        }
    }
}

static int int_path_ok(const DI_Tensor* x, const DI_Tensor* w) {
    int xd = dt_id(x->dtype), wd = dt_id(w->dtype);
    if (xd != DT_I8 || !x->quant || x->quant->zeros.data) return 0;
    if (!w->quant || w->quant->zeros.data) return 0;
    return wd == DT_I8 || wd == DT_I4;
}

static DI_Status lin_int(DI_Context* ctx, const DI_Tensor* x, const DI_Tensor* w, float* Y, int64_t ldy) {
    IntJob j;
    memset(&j, 0, sizeof j);
    QMat xm;
    qmat_init(&xm, x, 0);
    qmat_init(&j.m, w, 0);
    j.k = kernels();
    j.xq = (const int8_t*)xm.base;
    j.ldx = xm.rs;
    j.M = xm.R; j.K = xm.C; j.N = j.m.R; j.Y = Y; j.ldy = ldy;
    j.xbr = xm.br; j.xbc = xm.bc; j.xncb = xm.ncb;
    if (j.M == 0 || j.N == 0) return DI_OK;
    /* segments: maximal runs of K inside one x block and one w block */
    int64_t maxseg = xm.ncb + j.m.ncb + 1;
    int64_t* seg = malloc((size_t)(3 * maxseg + 1) * sizeof(int64_t));
    float* sx = di_malloc((size_t)xm.nrb * (size_t)xm.ncb * sizeof(float));
    int nw = pool_size(ctx->pool);
    j.scratch_per_worker = ((j.K + 63) & ~(int64_t)63) + (j.m.ncb + 16 + maxseg + 16) * (int64_t)sizeof(float);
    j.scratch = di_malloc((size_t)nw * (size_t)j.scratch_per_worker);
    if (!seg || !sx || !j.scratch) {
        free(seg); free(sx); free(j.scratch);
        return DI_OOM(ctx, "linear");
    }
    int64_t ns = 0, k0 = 0;
    while (k0 < j.K) {
        seg[ns++] = k0;
        int64_t a = (k0 / xm.bc + 1) * xm.bc, b = (k0 / j.m.bc + 1) * j.m.bc;
        k0 = a < b ? a : b;
        if (k0 > j.K) k0 = j.K;
    }
    seg[ns] = j.K;
    int64_t* seg_xb = seg + maxseg + 1;
    int64_t* seg_wb = seg_xb + maxseg;
    for (int64_t s = 0; s < ns; s++) {
        seg_xb[s] = seg[s] / xm.bc;
        seg_wb[s] = seg[s] / j.m.bc;
    }
    j.seg = seg;
    j.seg_xb = seg_xb;
    j.seg_wb = seg_wb;
    j.nseg = ns;
    for (int64_t rb = 0; rb < xm.nrb; rb++) qmat_scale_row(&xm, rb, sx + rb * xm.ncb, NULL);
    j.sx = sx;
    int64_t per = (j.N + (int64_t)nw * 4 - 1) / ((int64_t)nw * 4);
    if (per < 4) per = 4;
    j.rows_per_task = per;
    pool_run(ctx->pool, (j.N + per - 1) / per, int_task, &j);
    free(seg); free(sx); free(j.scratch);
    return DI_OK;
}

/* ------------------------------------------------------------------ the linear op */
/* x as f32 rows: borrowed when already f32 and plain, else converted into *owned */
static DI_Status x_as_f32(DI_Context* ctx, const char* op, const DI_Tensor* x, const float** X, int64_t* ldx,
                          float** owned) {
    *owned = NULL;
    int xd = dt_id(x->dtype);
    if (xd == DT_F32 && !x->quant) {
        *X = (const float*)t_base(x);
        *ldx = x->strides[0];
        return DI_OK;
    }
    QMat xm;
    qmat_init(&xm, x, 0);
    float* buf = di_malloc((size_t)xm.R * (size_t)xm.C * sizeof(float));
    if (!buf) return DI_OOM(ctx, op);
    for (int64_t r = 0; r < xm.R; r++) qmat_dequant_row(&xm, r, buf + r * xm.C);
    *owned = buf;
    *X = buf;
    *ldx = xm.C;
    return DI_OK;
}

DI_Status op_linear(DI_Context* ctx, const DI_LinearArgs* a, int query) {
    VC v = {ctx, "linear", query};
    DI_Status st;
    uint32_t xmask = DTM_FLOAT_ACT | DTM(DT_I8) | DTM(DT_E4M3);
    if ((st = check_tensor(&v, &a->x, "x", 2, 2, xmask, 1))) return st;
    int xd = dt_id(a->x.dtype);
    if (!(DTM_FLOAT_ACT & DTM(xd)) && !a->x.quant)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "linear: x is %s without a quantization descriptor (activation "
                       "quantization needs scales)", dt_name(xd));
    if ((st = check_tensor(&v, &a->w, "w", 2, 2, k_wdts, 1))) return st;
    if (a->w.shape[1] != a->x.shape[1])
        return di_fail(ctx, DI_INVALID_ARGUMENT, "linear: w.shape[1]=%lld != x.shape[1]=%lld",
                       (long long)a->w.shape[1], (long long)a->x.shape[1]);
    if ((st = check_weight(&v, &a->w, "w", -1, -1))) return st;
    int64_t M = a->x.shape[0], N = a->w.shape[0];
    int has_bias = tensor_present(&v, &a->bias);
    if (has_bias) {
        if ((st = check_tensor(&v, &a->bias, "bias", 1, 1, DTM_FLOAT_ACT, 0))) return st;
        if ((st = check_dim(&v, &a->bias, "bias", 0, N))) return st;
    }
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, M))) return st;
    if ((st = check_dim(&v, &a->out, "out", 1, N))) return st;
    if (query) {
        /* quantized weights without a SIMD kernel on this CPU are dequantized row by row in
         * scalar code: correct, but slower than plain bf16 weights would be */
        int wd = dt_id(a->w.dtype);
        if (a->w.quant && !kernels()->rowdot[wd] && !int_path_ok(&a->x, &a->w)) return DI_QUERY_SLOW;
        return DI_OK;
    }

    int od = dt_id(a->out.dtype);
    int direct = od == DT_F32 && !has_bias;
    float* Y = direct ? (float*)t_base(&a->out) : di_malloc((size_t)M * (size_t)N * sizeof(float));
    int64_t ldy = direct ? a->out.strides[0] : N;
    if (!Y) return DI_OOM(ctx, "linear");
    if (int_path_ok(&a->x, &a->w)) {
        st = lin_int(ctx, &a->x, &a->w, Y, ldy);
    } else {
        const float* X = NULL;
        int64_t ldx = 0;
        float* owned = NULL;
        st = x_as_f32(ctx, "linear", &a->x, &X, &ldx, &owned);
        if (!st) st = lin_f32(ctx, "linear", X, ldx, M, &a->w, Y, ldy);
        free(owned);
    }
    if (!st && !direct) {
        float* b = NULL;
        if (has_bias) {
            b = di_malloc((size_t)N * sizeof(float));
            if (!b) st = DI_OOM(ctx, "linear");
            else load_row(dt_id(a->bias.dtype), t_base(&a->bias), 0, N, b);
        }
        if (!st)
            for (int64_t i = 0; i < M; i++) {
                float* yr = Y + i * N;
                if (b) for (int64_t n = 0; n < N; n++) yr[n] += b[n];
                store_row(od, t_row(&a->out, od, i), yr, N);
            }
        free(b);
    }
    if (!direct) free(Y);
    return st;
}

/* ------------------------------------------------------------------ moe_experts */
DI_Status op_moe_experts(DI_Context* ctx, const DI_MoEExpertsArgs* a, int query) {
    VC v = {ctx, "moe_experts", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->x.shape[0], H = a->x.shape[1];
    if ((st = check_tensor(&v, &a->topk_ids, "topk_ids", 2, 2, DTM(DT_I32), 0))) return st;
    if ((st = check_dim(&v, &a->topk_ids, "topk_ids", 0, T))) return st;
    int64_t K = a->topk_ids.shape[1];
    if ((st = check_tensor(&v, &a->topk_weights, "topk_weights", 2, 2, DTM(DT_F32), 0))) return st;
    if ((st = check_same_shape(&v, &a->topk_ids, "topk_ids", &a->topk_weights, "topk_weights"))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if (a->num_experts < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: num_experts=%d is negative", a->num_experts);
    if (a->accumulate != 0 && a->accumulate != 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: accumulate=%d, expected 0 or 1", a->accumulate);
    int E = a->num_experts;
    if (E > 0 && (!a->w_gate || !a->w_up || !a->w_down))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: w_%s is NULL with num_experts=%d",
                       !a->w_gate ? "gate" : !a->w_up ? "up" : "down", E);
    int64_t I = -1;
    for (int e = 0; e < E; e++) {
        const DI_Tensor *g = &a->w_gate[e], *u = &a->w_up[e], *d = &a->w_down[e];
        int rg = g->data != NULL, ru = u->data != NULL, rd = d->data != NULL;
        if (!query && (rg != ru || ru != rd))
            return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: expert %d is partly resident (gate %d, up %d, "
                           "down %d)", e, rg, ru, rd);
        if (!rg && !(query && g->ndim > 0)) continue;
        char n1[32], n2[32], n3[32];
        snprintf(n1, sizeof n1, "w_gate[%d]", e);
        snprintf(n2, sizeof n2, "w_up[%d]", e);
        snprintf(n3, sizeof n3, "w_down[%d]", e);
        if ((st = check_tensor(&v, g, n1, 2, 2, k_wdts, 1))) return st;
        if (I < 0) I = g->shape[0];
        if ((st = check_weight(&v, g, n1, I, H))) return st;
        if ((st = check_weight(&v, u, n2, I, H))) return st;
        if ((st = check_weight(&v, d, n3, H, I))) return st;
    }
    if (query) return DI_OK;

    const int32_t* ids = (const int32_t*)t_base(&a->topk_ids);
    int64_t ids_rs = a->topk_ids.strides[0], w_rs = a->topk_weights.strides[0];
    const float* tw = (const float*)t_base(&a->topk_weights);
    /* group (token, k) pairs by expert; check residency before any work */
    int64_t* count = calloc((size_t)E + 1, sizeof(int64_t));
    if (!count) return DI_OOM(ctx, "moe_experts");
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = ids[t * ids_rs + k];
            if (e < 0 || e >= E) continue;
            if (!a->w_gate[e].data) {
                free(count);
                return di_fail(ctx, DI_FAILED_PRECONDITION, "moe_experts: expert %d not resident (token %lld)", e,
                               (long long)t);
            }
            count[e]++;
        }
    int64_t maxn = 0, total = 0;
    for (int e = 0; e < E; e++) { total += count[e]; if (count[e] > maxn) maxn = count[e]; }
    int od = dt_id(a->out.dtype), xd = dt_id(a->x.dtype);
    float* acc = calloc((size_t)(T * H > 0 ? T * H : 1), sizeof(float));
    float* xg = di_malloc((size_t)(maxn * H) * sizeof(float));
    float* gb = di_malloc((size_t)(maxn * (I > 0 ? I : 1)) * sizeof(float));
    float* ub = di_malloc((size_t)(maxn * (I > 0 ? I : 1)) * sizeof(float));
    float* yb = di_malloc((size_t)(maxn * H) * sizeof(float));
    int64_t* rows = di_malloc((size_t)(maxn ? maxn : 1) * sizeof(int64_t));
    float* rw = di_malloc((size_t)(maxn ? maxn : 1) * sizeof(float));
    st = DI_OK;
    if (!acc || !xg || !gb || !ub || !yb || !rows || !rw) st = DI_OOM(ctx, "moe_experts");
    for (int e = 0; e < E && !st && total; e++) {
        if (!count[e]) continue;
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < K; k++)
                if (ids[t * ids_rs + k] == e) {
                    rows[n] = t;
                    rw[n] = tw[t * w_rs + k];
                    load_row(xd, t_row(&a->x, xd, t), 0, H, xg + n * H);
                    n++;
                }
        if ((st = lin_f32(ctx, "moe_experts", xg, H, n, &a->w_gate[e], gb, I))) break;
        if ((st = lin_f32(ctx, "moe_experts", xg, H, n, &a->w_up[e], ub, I))) break;
        for (int64_t i = 0; i < n * I; i++) {
            float g = gb[i];
            gb[i] = g / (1.0f + expf(-g)) * ub[i];
        }
        if ((st = lin_f32(ctx, "moe_experts", gb, I, n, &a->w_down[e], yb, H))) break;
        for (int64_t r = 0; r < n; r++) {
            float* dst = acc + rows[r] * H;
            const float* src = yb + r * H;
            kernels()->axpy(rw[r], src, dst, H);
        }
    }
    if (!st) {
        float* tmp = di_malloc((size_t)(H ? H : 1) * sizeof(float));
        if (!tmp) st = DI_OOM(ctx, "moe_experts");
        for (int64_t t = 0; t < T && !st; t++) {
            float* ar = acc + t * H;
            if (a->accumulate) {
                load_row(od, t_row(&a->out, od, t), 0, H, tmp);
                for (int64_t h = 0; h < H; h++) ar[h] += tmp[h];
            }
            store_row(od, t_row(&a->out, od, t), ar, H);
        }
        free(tmp);
    }
    free(count); free(acc); free(xg); free(gb); free(ub); free(yb); free(rows); free(rw);
    return st;
}
