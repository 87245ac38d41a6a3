/* linear, and the engine moe_experts (moe.c) runs its experts on.
 *
 * One engine, lin_f32, computes Y = X @ dequant(W)^T for f32 activations and any weight format:
 *  - small M (decode, M <= 8): a fused "row dot" kernel per weight dtype reads the stored weights
 *    (f32, bf16, f16, int8, int4, uint4, e4m3, e2m1), converts them in registers and applies one
 *    scale per column block; zero points are folded in afterwards as -sum(z * s * sum(x_block)).
 *    The weights are read once, which is what makes int4 decode faster than f32: it is
 *    memory-bound and int4 moves 8x fewer bytes. Four weight rows go through a kernel at a time
 *    against every x row (the rowdot4 family; M > 1, several tokens of one sequence being
 *    verified, takes the rowdot4x twins), and each x row is summed the way M = 1 sums it: a row's
 *    result does not depend on M, so a step of M draft tokens computes bit for bit the logits of
 *    M one-token steps.
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
#include <stdatomic.h>

#include "di_cpu.h"

#define TILE_N 32      /* rows of W dequantized per GEMM tile */

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
    rowdot4_fn   f4;     /* the four-row kernel (M = 1: rowdot4, _nib or _bf16dp; M > 1 its rowdot4x
                          * twin, which sums each row as it does), else NULL */
    float*       xp;     /* 4-bit weights: each x row reordered for rowdot4(x)_nib, K values a row
                          * (owned), else NULL */
    uint16_t*    xs;     /* plain bf16 weights: each x row split for rowdot4(x)_bf16dp, 3 * K values
                          * a row (owned), else NULL */
    float*       scratch;
    int64_t      scratch_per_worker;
} LinJob;

/* x copies the four-row kernels read 64 bytes at a time: on a cache-line boundary, or loads
 * straddle two lines (measured on Zen 4: rowdot4_bf16dp 7% slower with xs 16 bytes off a line) */
static void* alloc_lines(size_t n) {
    void* p = NULL;
    return posix_memalign(&p, 64, n ? n : 1) ? NULL : p;
}

static const char* w_row(const QMat* m, int64_t n) {
    int b = dt_bits(m->dt);
    return m->base + (b == 4 ? n * m->rs / 2 : n * m->rs * (b / 8));
}

static void lin_task(void* arg, int64_t task, int worker) {
    const LinJob* j = (const LinJob*)arg;
    int64_t n0 = task * j->rows_per_task, n1 = n0 + j->rows_per_task < j->N ? n0 + j->rows_per_task : j->N;
    float* scr = j->scratch + (size_t)worker * (size_t)j->scratch_per_worker;
    const QMat* m = &j->m;
    if (j->f4) {
        /* four rows at a time against every x row; each keeps the scales of its row block. The
         * last N % 4 rows of the task go through the row kernel, whose rows are independent too,
         * so a row's result is the same for any M (and any split, per being a multiple of 4). */
        float* sr[4];
        const float* sp[4] = {NULL, NULL, NULL, NULL};
        int64_t rbq[4] = {-1, -1, -1, -1};
        for (int q = 0; q < 4; q++) sr[q] = scr + q * (m->ncb + 1);
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
            RowDot4 a;
            a.x = j->X;
            a.K = j->K;
            a.bc = m->quant ? m->bc : j->K + 1;
            for (int q = 0; q < 4; q++) {
                a.w[q] = w_row(m, n + q);
                a.s[q] = NULL;
                if (m->quant) {
                    int64_t rb = (n + q) / m->br;
                    if (rb != rbq[q]) { sp[q] = qmat_scales(m, rb, sr[q]); rbq[q] = rb; }
                    a.s[q] = sp[q];
                }
            }
            a.xp = j->xp;
            a.xs = j->xs;
            a.pf = n + 8 <= n1 ? (const char*)w_row(m, n + 4) - (const char*)a.w[0] : 0;
            a.mr = (int)j->M;
            a.ldx = j->ldx;
            a.ldy = j->ldy;
            j->f4(&a, j->Y + n);
        }
        for (; n < n1; n++) {
            RowDot a;
            a.w = w_row(m, n);
            a.K = j->K;
            a.bc = m->quant ? m->bc : j->K + 1;
            a.s = m->quant ? qmat_scales(m, n / m->br, sr[0]) : NULL;
            for (int64_t m0 = 0; m0 < j->M; m0 += 4) {
                a.mr = (int)(j->M - m0 < 4 ? j->M - m0 : 4);
                for (int i = 0; i < a.mr; i++) a.x[i] = j->X + (m0 + i) * j->ldx;
                float y[4];
                j->fused(&a, y);
                for (int i = 0; i < a.mr; i++) j->Y[(m0 + i) * j->ldy + n] = y[i];
            }
        }
        return;
    }
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

/* Sets j up for Y = X @ dequant(w)^T in about `tasks` pool tasks (nothing runs yet). A job with
 * nothing to do gets N = 0 (K = 0 writes its zeros here). */
static DI_Status lin_prepare(DI_Context* ctx, const char* op, LinJob* j, const float* X, int64_t ldx, int64_t M,
                             const DI_Tensor* w, float* Y, int64_t ldy, int64_t tasks) {
    memset(j, 0, sizeof *j);
    qmat_init(&j->m, w, 0);
    j->X = X; j->ldx = ldx; j->M = M; j->K = j->m.C; j->N = j->m.R; j->Y = Y; j->ldy = ldy;
    j->k = kernels();
    if (M == 0 || j->N == 0) { j->N = 0; return DI_OK; }
    if (j->K == 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < j->N; n++) Y[i * ldy + n] = 0.0f;
        j->N = 0;
        return DI_OK;
    }
    rowdot_fn f = j->k->rowdot[j->m.dt];
    j->fused = fused_ok(&j->m, f, M) ? f : NULL;
    float* xsum = NULL;
    if (j->fused && j->m.zbase) {
        xsum = di_malloc((size_t)M * (size_t)j->m.ncb * sizeof(float));
        if (!xsum) return DI_OOM(ctx, op);
        for (int64_t i = 0; i < M; i++)
            for (int64_t cb = 0; cb < j->m.ncb; cb++) {
                int64_t c0 = cb * j->m.bc, c1 = c0 + j->m.bc < j->K ? c0 + j->m.bc : j->K;
                float s = 0.0f;
                for (int64_t c = c0; c < c1; c++) s += X[i * ldx + c];
                xsum[i * j->m.ncb + cb] = s;
            }
        j->xsum = xsum;
    }
    /* the four-row kernel: 4-bit weights through the value table (x reordered), plain bf16
     * weights on bf16 dot products (x split), else rowdot4 */
    const Kernels* K = j->k;
    int dt = j->m.dt;
    int four = j->fused && K->rowdot4[dt] && !j->m.zbase;
    int nib = four && K->rowdot4_nib[dt] && (j->m.bc >= j->K || j->m.bc % 32 == 0);
    int bdp = four && dt == DT_BF16 && !j->m.quant && K->rowdot4_bf16dp && j->N >= 4;
    if (four && M == 1) j->f4 = nib ? K->rowdot4_nib[dt] : bdp ? K->rowdot4_bf16dp : K->rowdot4[dt];
    if (four && M > 1) j->f4 = nib ? K->rowdot4x_nib[dt] : bdp ? K->rowdot4x_bf16dp : K->rowdot4x[dt];
    if (!j->f4) nib = bdp = 0;
    if (nib) {
        /* each 32-element chunk: its even elements, then its odd ones (the nibbles' order) */
        j->xp = alloc_lines((size_t)(j->K * M) * sizeof(float));
        if (!j->xp) { free(xsum); j->xsum = NULL; return DI_OOM(ctx, op); }
        for (int64_t i = 0; i < M; i++) {
            const float* x = X + i * ldx;
            float* xp = j->xp + j->K * i;
            int64_t k = 0;
            for (; k + 32 <= j->K; k += 32)
                for (int e = 0; e < 16; e++) {
                    xp[k + e] = x[k + 2 * e];
                    xp[k + 16 + e] = x[k + 2 * e + 1];
                }
            for (; k < j->K; k++) xp[k] = x[k];
        }
    }
    if (bdp) {
        j->xs = alloc_lines((size_t)(3 * j->K * M) * sizeof(uint16_t));
        if (!j->xs) { free(xsum); j->xsum = NULL; free(j->xp); j->xp = NULL; return DI_OOM(ctx, op); }
        for (int64_t i = 0; i < M; i++) K->split_bf16x3(X + i * ldx, j->K, j->xs + 3 * j->K * i);
    }
    int nw = pool_size(ctx->pool);
    j->scratch_per_worker = j->fused ? 4 * (j->m.ncb + 1) : (int64_t)TILE_N * j->K;
    j->scratch = di_malloc((size_t)nw * (size_t)j->scratch_per_worker * sizeof(float));
    if (!j->scratch) {
        free(xsum); j->xsum = NULL; free(j->xp); j->xp = NULL; free(j->xs); j->xs = NULL;
        return DI_OOM(ctx, op);
    }
    /* enough tasks to balance threads, few enough that each streams a long run of W */
    if (tasks < 1) tasks = 1;
    int64_t per = (j->N + tasks - 1) / tasks;
    /* whole groups of four rows: every row then goes through the same kernel whatever the split
     * (rowdot4 kernels for rows below N - N % 4), so its result does not depend on the task count */
    if (j->fused) per = (per + 3) / 4 * 4;
    else per = (per + TILE_N - 1) / TILE_N * TILE_N;
    j->rows_per_task = per;
    return DI_OK;
}

static void lin_release(LinJob* j) {
    free(j->scratch);
    free((void*)j->xsum);
    free(j->xp);
    free(j->xs);
    j->scratch = NULL;
    j->xsum = NULL;
    j->xp = NULL;
    j->xs = NULL;
}

static int64_t lin_ntasks(const LinJob* j) { return j->N ? (j->N + j->rows_per_task - 1) / j->rows_per_task : 0; }

DI_Status lin_f32(DI_Context* ctx, const char* op, const float* X, int64_t ldx, int64_t M, const DI_Tensor* w,
                  float* Y, int64_t ldy) {
    LinJob j;
    DI_Status st = lin_prepare(ctx, op, &j, X, ldx, M, w, Y, ldy, (int64_t)pool_size(ctx->pool) * 4);
    if (st) return st;
    pool_run(ctx->pool, lin_ntasks(&j), lin_task, &j, M * j.N * j.K);
    lin_release(&j);
    return DI_OK;
}

/* Y = X @ W^T on the calling thread only (inside another job's task: the pool takes one job at a time) */
DI_Status lin_f32_serial(DI_Context* ctx, const char* op, const float* X, int64_t ldx, int64_t M,
                         const DI_Tensor* w, float* Y, int64_t ldy) {
    LinJob j;
    DI_Status st = lin_prepare(ctx, op, &j, X, ldx, M, w, Y, ldy, 1);
    if (st) return st;
    if (j.N) {
        j.rows_per_task = j.N;
        lin_task(&j, 0, 0);   /* this job's scratch is its own: worker slot 0 is free */
    }
    lin_release(&j);
    return DI_OK;
}

/* Several independent products in one parallel region (the experts of a MoE layer): one wake-up
 * of the pool instead of one per matrix, and threads balance across matrices. */
typedef struct {
    LinJob*  jobs;
    int64_t* first;   /* first[i]: the first task of job i; first[n]: the total */
    int      n;
} MultiJob;

static void multi_task(void* arg, int64_t task, int worker) {
    const MultiJob* mj = (const MultiJob*)arg;
    int lo = 0, hi = mj->n - 1;
    while (lo < hi) {   /* the job whose task range holds `task` */
        int mid = (lo + hi + 1) / 2;
        if (mj->first[mid] <= task) lo = mid; else hi = mid - 1;
    }
    lin_task(&mj->jobs[lo], task - mj->first[lo], worker);
}

DI_Status lin_f32_multi(DI_Context* ctx, const char* op, const LinSpec* spec, int n) {
    if (n <= 0) return DI_OK;
    LinJob* jobs = calloc((size_t)n, sizeof(LinJob));
    int64_t* first = calloc((size_t)n + 1, sizeof(int64_t));
    if (!jobs || !first) { free(jobs); free(first); return DI_OOM(ctx, op); }
    int64_t rows = 0, amount = 0;
    for (int i = 0; i < n; i++) rows += spec[i].w->shape[0];
    int64_t target = (int64_t)pool_size(ctx->pool) * 4;
    DI_Status st = DI_OK;
    for (int i = 0; i < n && !st; i++) {
        int64_t N = spec[i].w->shape[0];
        int64_t tasks = rows ? (target * N + rows - 1) / rows : 1;
        st = lin_prepare(ctx, op, &jobs[i], spec[i].X, spec[i].ldx, spec[i].M, spec[i].w, spec[i].Y, spec[i].ldy, tasks);
        first[i + 1] = first[i] + (st ? 0 : lin_ntasks(&jobs[i]));
        amount += spec[i].M * jobs[i].N * jobs[i].K;
    }
    if (!st) {
        MultiJob mj = {jobs, first, n};
        pool_run(ctx->pool, first[n], multi_task, &mj, amount);
    }
    for (int i = 0; i < n; i++) lin_release(&jobs[i]);
    free(jobs);
    free(first);
    return st;
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

/* ------------------------------------------------------------------ VNNI integer rows */
typedef struct {
    const int8_t*  xp;      /* [M, K] x rows, int4 chunks reordered (see IDot) */
    const float*   sx;      /* x scales [M / xbr rows of blocks, xncb] */
    int64_t        xbr, xncb, M, K, N, nseg;
    const int64_t* seg_end; /* chunk index where segment s ends */
    const int64_t *seg_xb, *seg_wb;
    const int32_t* bias;    /* [M, nseg, lanes] */
    QMat           m;
    float*         Y;
    int64_t        ldy, rows_per_task;
    float*         scratch; /* per worker: w scales, then the IDot scales [IDOT_MAX_MR, nseg] */
    int64_t        scratch_per_worker;
    idot_fn        fn;
    idot4_fn       k4;      /* four rows at M = 1, or NULL */
} VnniJob;

static void vnni_task(void* arg, int64_t task, int worker) {
    const VnniJob* j = (const VnniJob*)arg;
    int64_t n0 = task * j->rows_per_task, n1 = n0 + j->rows_per_task < j->N ? n0 + j->rows_per_task : j->N;
    float* sw = j->scratch + (size_t)worker * (size_t)j->scratch_per_worker;
    float* sc = sw + j->m.ncb + 16;
    const QMat* m = &j->m;
    int64_t cur_rb = -1;
    int bits = dt_bits(m->dt);
    idot4_fn f4 = j->M == 1 ? j->k4 : NULL;
    if (f4) {
        /* decode: four weight rows share each x load; scales per row and segment */
        float* sw4 = sc + IDOT_MAX_MR * j->nseg;   /* [4][ncb] */
        int64_t n = n0;
        const float* sxr = j->sx;
        for (; n + 4 <= n1; n += 4) {
            IDot4 a;
            a.x = j->xp;
            a.nseg = j->nseg;
            a.seg_end = j->seg_end;
            a.bias = j->bias;
            for (int q = 0; q < 4; q++) {
                const float* swq = qmat_scales(m, (n + q) / m->br, sw4 + q * (m->ncb + 1));
                float* scq = sc + q * j->nseg;
                for (int64_t sg = 0; sg < j->nseg; sg++) scq[sg] = sxr[j->seg_xb[sg]] * swq[j->seg_wb[sg]];
                a.w[q] = m->base + (bits == 4 ? (n + q) * m->rs / 2 : (n + q) * m->rs);
                a.scale[q] = scq;
            }
            a.pf = n + 8 <= n1 ? 4 * (bits == 4 ? m->rs / 2 : m->rs) : 0;
            f4(&a, j->Y + n);
        }
        n0 = n;
    }
    const float* swr = sw;
    for (int64_t n = n0; n < n1; n++) {
        int64_t rb = n / m->br;
        if (rb != cur_rb) { swr = qmat_scales(m, rb, sw); cur_rb = rb; }
        IDot a;
        a.w = m->base + (bits == 4 ? n * m->rs / 2 : n * m->rs);
        a.nseg = j->nseg;
        a.seg_end = j->seg_end;
        for (int64_t m0 = 0; m0 < j->M; m0 += IDOT_MAX_MR) {
            a.mr = (int)(j->M - m0 < IDOT_MAX_MR ? j->M - m0 : IDOT_MAX_MR);
            for (int i = 0; i < a.mr; i++) {
                int64_t r = m0 + i;
                a.x[i] = j->xp + r * j->K;
                const float* sxr = j->sx + (r / j->xbr) * j->xncb;
                for (int64_t sg = 0; sg < j->nseg; sg++) sc[i * j->nseg + sg] = sxr[j->seg_xb[sg]] * swr[j->seg_wb[sg]];
            }
            a.bias = j->bias + m0 * j->nseg * (dt_bits(m->dt) == 4 ? 8 : 16);
            a.scale = sc;
            float y[IDOT_MAX_MR];
            j->fn(&a, y);
            for (int i = 0; i < a.mr; i++) j->Y[(m0 + i) * j->ldy + n] = y[i];
        }
    }
}

/* ------------------------------------------------------------------ AMX integer GEMM */
typedef struct {
    AmxIntJob a;
    char*     scratch;
    size_t    scratch_per_worker;
} AmxTask;

static void amx_task(void* arg, int64_t task, int worker) {
    const AmxTask* t = (const AmxTask*)arg;
    amx_int_strip(&t->a, task * 32, t->scratch + (size_t)worker * t->scratch_per_worker);
}

/* x rows from the VNNI job (natural element order), zero-padded to whole 32-row blocks */
static DI_Status lin_amx(DI_Context* ctx, const QMat* xm, const VnniJob* v) {
    AmxTask t;
    memset(&t, 0, sizeof t);
    int64_t Mp = (v->M + 31) / 32 * 32;
    int nw = pool_size(ctx->pool);
    int8_t* xpad = di_malloc((size_t)(Mp * v->K));
    t.scratch_per_worker = (amx_scratch_bytes(v->K, v->nseg, v->m.ncb) + 63) & ~(size_t)63;
    t.scratch = di_malloc((size_t)nw * t.scratch_per_worker + 64);
    if (!xpad || !t.scratch) {
        free(xpad);
        free(t.scratch);
        return DI_OOM(ctx, "linear");
    }
    for (int64_t r = 0; r < v->M; r++) memcpy(xpad + r * v->K, (const int8_t*)xm->base + r * xm->rs, (size_t)v->K);
    memset(xpad + v->M * v->K, 0, (size_t)((Mp - v->M) * v->K));
    t.a = (AmxIntJob){xpad, v->M, Mp, v->K, v->N, &v->m, v->nseg, v->seg_end, v->seg_xb, v->seg_wb, v->sx,
                      v->xbr, v->xncb, v->Y, v->ldy};
    pool_run(ctx->pool, (v->N + 31) / 32, amx_task, &t, v->M * v->N * v->K / 16);
    free(xpad);
    free(t.scratch);
    return DI_OK;
}

/* The VNNI kernels need K and every x / w block boundary on 64-element chunks. */
static int vnni_ok(const QMat* xm, const QMat* wm) {
    if (!kernels()->idot[wm->dt] || xm->C % 64) return 0;
    if ((xm->bc < xm->C && xm->bc % 64) || (wm->bc < wm->C && wm->bc % 64)) return 0;
    return 1;
}

static DI_Status lin_vnni(DI_Context* ctx, const QMat* xm, const QMat* wm, float* Y, int64_t ldy) {
    VnniJob j;
    memset(&j, 0, sizeof j);
    j.m = *wm;
    j.M = xm->R; j.K = xm->C; j.N = wm->R; j.Y = Y; j.ldy = ldy;
    j.xbr = xm->br; j.xncb = xm->ncb;
    j.fn = kernels()->idot[wm->dt];
    j.k4 = kernels()->idot4[wm->dt];
    int four = dt_bits(wm->dt) == 4;
    int64_t nch = j.K / 64, maxseg = xm->ncb + wm->ncb + 1;
    int nw = pool_size(ctx->pool);
    int8_t* xp = di_malloc((size_t)(j.M * j.K));
    int64_t* seg = di_malloc((size_t)(3 * maxseg) * sizeof(int64_t));
    float* sx = di_malloc((size_t)(xm->nrb * xm->ncb) * sizeof(float));
    int lanes = four ? 8 : 16;
    int32_t* bias = di_malloc((size_t)(j.M * maxseg * lanes) * sizeof(int32_t));
    j.scratch_per_worker = wm->ncb + 16 + (int64_t)IDOT_MAX_MR * maxseg + 4 * (wm->ncb + 1);
    j.scratch = di_malloc((size_t)nw * (size_t)j.scratch_per_worker * sizeof(float));
    DI_Status st = DI_OK;
    if (!xp || !seg || !sx || !bias || !j.scratch) { st = DI_OOM(ctx, "linear"); goto done; }
    /* segments: maximal runs of chunks inside one x block and one w block */
    int64_t* seg_xb = seg + maxseg;
    int64_t* seg_wb = seg_xb + maxseg;
    int64_t ns = 0;
    for (int64_t c = 0; c < nch; c++) {
        int64_t xb = c * 64 / xm->bc, wb = c * 64 / wm->bc;
        if (!ns || seg_xb[ns - 1] != xb || seg_wb[ns - 1] != wb) {
            seg_xb[ns] = xb;
            seg_wb[ns] = wb;
            ns++;
        }
        seg[ns - 1] = c + 1;
    }
    j.nseg = ns;
    j.seg_end = seg;
    j.seg_xb = seg_xb;
    j.seg_wb = seg_wb;
    /* x rows (int4: each chunk's even elements, then its odd ones) and the offset corrections */
    int32_t off = four ? 8 : 128;
    for (int64_t r = 0; r < j.M; r++) {
        const int8_t* src = (const int8_t*)xm->base + r * xm->rs;
        int8_t* dst = xp + r * j.K;
        if (four) {
            for (int64_t c = 0; c < nch; c++)
                for (int e = 0; e < 32; e++) {
                    dst[c * 64 + e] = src[c * 64 + 2 * e];
                    dst[c * 64 + 32 + e] = src[c * 64 + 2 * e + 1];
                }
        } else {
            memcpy(dst, src, (size_t)j.K);
        }
        /* lane l of the kernel sums bytes 4l..4l+3 of each 64-byte chunk (int8) or of each
         * 32-byte half of a reordered chunk (int4) */
        int64_t c = 0;
        for (int64_t sg = 0; sg < ns; sg++) {
            int32_t* b = bias + (r * ns + sg) * lanes;
            for (int l = 0; l < lanes; l++) b[l] = 0;
            for (; c < seg[sg]; c++)
                for (int e = 0; e < 64; e++) b[(e % (4 * lanes)) / 4] -= off * (int32_t)dst[c * 64 + e];
        }
    }
    j.xp = xp;
    j.bias = bias;
    for (int64_t rb = 0; rb < xm->nrb; rb++) qmat_scale_row(xm, rb, sx + rb * xm->ncb, NULL);
    j.sx = sx;
    if (kernels()->amx && j.M >= AMX_MIN_M) {
        st = lin_amx(ctx, xm, &j);
        goto done;
    }
    int64_t per = (j.N + (int64_t)nw * 4 - 1) / ((int64_t)nw * 4);
    if (per < 4) per = 4;
    j.rows_per_task = per;
    pool_run(ctx->pool, (j.N + per - 1) / per, vnni_task, &j, j.M * j.N * j.K / 4);
done:
    free(xp); free(seg); free(sx); free(bias); free(j.scratch);
    return st;
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
    if (vnni_ok(&xm, &j.m)) return lin_vnni(ctx, &xm, &j.m, Y, ldy);
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
    pool_run(ctx->pool, (j.N + per - 1) / per, int_task, &j, j.M * j.N * j.K);
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
    /* Integer dot products win for decode rows and for long K. Many rows at short K without AMX
     * (a small model's prefill) run faster as the f32 GEMM on exactly dequantized x and w: the same
     * product, rounded in f32 (measured on AVX-512 VNNI, M = 128: K = 128 0.4x, K = 256 0.7x, K = 2048
     * 2x the f32 GEMM's speed). */
    int64_t K = a->x.shape[1];
    int int_fast = !(M > FUSED_MAX_M && K <= 512 && !kernels()->amx);
    if (int_path_ok(&a->x, &a->w) && int_fast) {
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
