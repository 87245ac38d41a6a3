/* MLA attention: mla_cache_write (the latent and rope key rows into the paged cache), mla_prefill
 * (un-absorbed, causal within each packed sequence) and mla_decode (absorbed kv_b over the paged
 * latent cache; with indices, 1.3, over the listed positions only).
 * Softmax is the two-pass max/exp form in f32; dot products go through the same gemm_dot kernel as
 * linear so they use SIMD where available. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "di_cpu.h"

static void softmax_inplace(float* s, int64_t n) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = fmaxf(mx, s[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) { s[i] = expf(s[i] - mx); sum += s[i]; }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) s[i] *= inv;
}

/* a [rows, cols] strided (3-d [T, H, D] viewed as rows t*H+h) converted to contiguous f32 */
static float* to_f32_3d(const DI_Tensor* t) {
    int dt = dt_id(t->dtype);
    int64_t A = t->shape[0], B = t->ndim == 3 ? t->shape[1] : 1, D = t->shape[t->ndim - 1];
    float* buf = di_malloc((size_t)(A * B * D) * sizeof(float));
    if (!buf) return NULL;
    for (int64_t i = 0; i < A; i++)
        for (int64_t j = 0; j < B; j++) {
            int64_t off = i * t->strides[0] + (t->ndim == 3 ? j * t->strides[1] : 0);
            load_row(dt, t_at(t, dt, off), 0, D, buf + (i * B + j) * D);
        }
    return buf;
}

/* ------------------------------------------------------------------ prefill */
#define PF_QB 4  /* query rows per task: one 4 x 4 register block of the dot-product kernel */
typedef struct {
    const DI_MLAPrefillArgs* a;
    const float *q, *kv, *kpe;
    const int64_t* start;  /* first token of each token's sequence */
    const int64_t* qblk;   /* first token of each query block (blocks never cross sequences) */
    const int64_t* qend;   /* one past its last token */
    int64_t T, H, Dn, Dr, Dv;
    int od;
    float scale;
    float* scratch;
    int64_t per_worker;
    const Kernels* k;
} PrefillJob;

static void prefill_task(void* arg, int64_t task, int worker) {
    const PrefillJob* j = (const PrefillJob*)arg;
    int64_t i0 = j->qblk[task], i1 = j->qend[task], st = j->start[i0], H = j->H;
    int64_t Dq = j->Dn + j->Dr, Dkv = j->Dn + j->Dv, n = i1 - st;  /* keys st .. i1-1 */
    int mq = (int)(i1 - i0);
    float* sc = j->scratch + (size_t)worker * (size_t)j->per_worker;
    float* tmp = sc + PF_QB * j->T;
    float* o = tmp + PF_QB * j->T;
    const DI_Tensor* out = &j->a->out;
    for (int64_t h = 0; h < H; h++) {
        const float* qb = j->q + (i0 * H + h) * Dq;
        /* scores of all mq queries against keys up to the last one; causal masking below */
        j->k->gemm_dot(qb, H * Dq, mq, j->kv + (st * H + h) * Dkv, H * Dkv, (int)n, j->Dn, sc, n);
        if (j->Dr) {
            j->k->gemm_dot(qb + j->Dn, H * Dq, mq, j->kpe + st * j->Dr, j->Dr, (int)n, j->Dr, tmp, n);
            for (int64_t x = 0; x < mq * n; x++) sc[x] += tmp[x];
        }
        for (int r = 0; r < mq; r++) {
            int64_t i = i0 + r, len = i - st + 1;
            float* srow = sc + r * n;
            for (int64_t p = 0; p < len; p++) srow[p] *= j->scale;
            softmax_inplace(srow, len);
            for (int64_t d = 0; d < j->Dv; d++) o[d] = 0.0f;
            for (int64_t p = 0; p < len; p++) j->k->axpy(srow[p], j->kv + ((st + p) * H + h) * Dkv + j->Dn, o, j->Dv);
            store_row(j->od, t_row2(out, j->od, i, h), o, j->Dv);
        }
    }
}

DI_Status op_mla_prefill(DI_Context* ctx, const DI_MLAPrefillArgs* a, int query) {
    VC v = {ctx, "mla_prefill", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->q, "q", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->kv, "kv", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->k_pe, "k_pe", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->cu_seqlens, "cu_seqlens", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->q.shape[0], H = a->q.shape[1], Dv = a->out.shape[2], Dn = a->kv.shape[2] - Dv;
    if (Dn < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_prefill: kv.shape[2]=%lld < out.shape[2]=Dv=%lld",
                       (long long)a->kv.shape[2], (long long)Dv);
    int64_t Dr = a->q.shape[2] - Dn;
    if (Dr < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_prefill: q.shape[2]=%lld < Dn=%lld (kv.shape[2] - Dv)",
                       (long long)a->q.shape[2], (long long)Dn);
    if ((st = check_dim(&v, &a->kv, "kv", 0, T)) || (st = check_dim(&v, &a->kv, "kv", 1, H))) return st;
    if ((st = check_dim(&v, &a->k_pe, "k_pe", 0, T)) || (st = check_dim(&v, &a->k_pe, "k_pe", 1, Dr))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T)) || (st = check_dim(&v, &a->out, "out", 1, H))) return st;
    if (a->cu_seqlens.shape[0] < 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_prefill: cu_seqlens needs S + 1 >= 1 entries");
    if (query) return DI_OK;
    const int32_t* cu = (const int32_t*)t_base(&a->cu_seqlens);
    int64_t cs = a->cu_seqlens.strides[0], S = a->cu_seqlens.shape[0] - 1;
    if (cu[0] != 0 || cu[S * cs] != T)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_prefill: cu_seqlens must start at 0 and end at T=%lld "
                       "(got %d .. %d)", (long long)T, cu[0], cu[S * cs]);
    for (int64_t s = 0; s < S; s++)
        if (cu[(s + 1) * cs] < cu[s * cs])
            return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_prefill: cu_seqlens decreases at %lld", (long long)s);
    if (T == 0 || H == 0) return DI_OK;
    PrefillJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.T = T; j.H = H; j.Dn = Dn; j.Dr = Dr; j.Dv = Dv; j.scale = a->scale;
    j.od = dt_id(a->out.dtype);
    j.k = kernels();
    int64_t* start = di_malloc((size_t)T * 3 * sizeof(int64_t));
    float *q = to_f32_3d(&a->q), *kv = to_f32_3d(&a->kv), *kpe = to_f32_3d(&a->k_pe);
    int nw = pool_size(ctx->pool);
    j.per_worker = 2 * PF_QB * T + Dv + 16;
    j.scratch = di_malloc((size_t)nw * (size_t)j.per_worker * sizeof(float));
    if (!start || !q || !kv || !kpe || !j.scratch) {
        free(start); free(q); free(kv); free(kpe); free(j.scratch);
        return DI_OOM(ctx, "mla_prefill");
    }
    int64_t* qblk = start + T;
    int64_t* qend = qblk + T;
    int64_t nblk = 0;
    for (int64_t s = 0; s < S; s++) {
        int64_t b = cu[s * cs], e = cu[(s + 1) * cs];
        for (int64_t t = b; t < e; t++) start[t] = b;
        for (int64_t t = b; t < e; t += PF_QB) {
            qblk[nblk] = t;
            qend[nblk++] = t + PF_QB < e ? t + PF_QB : e;
        }
    }
    j.q = q; j.kv = kv; j.kpe = kpe; j.start = start; j.qblk = qblk; j.qend = qend;
    pool_run(ctx->pool, nblk, prefill_task, &j, INT64_MAX);
    free(start); free(q); free(kv); free(kpe); free(j.scratch);
    return DI_OK;
}

/* ------------------------------------------------------------------ decode */
#define DEC_CHUNK 64
/* Consecutive tokens of one sequence (the draft tokens a speculative step verifies) go through a
 * task together, up to this many: the absorbed projections' bf16 rows are then decoded once for
 * all of them. Each token's arithmetic stays what it is alone, so its output does not depend on
 * the others. */
#define DEC_GROUP 8
static int cmp_pos(const void* x, const void* y) {
    int32_t a = *(const int32_t*)x, b = *(const int32_t*)y;
    return (a > b) - (a < b);
}
typedef struct {
    const DI_MLADecodeArgs* a;
    int64_t T, H, Dn, Dr, Dv, Dc, BS, hb, nhb;
    const int64_t* g0;     /* g0[g]: first token of group g; g0[ng]: T */
    int64_t ng;
    int qd, wd, cd, od;
    int sparse;            /* indices present (V3.2): each token attends its listed positions only */
    int64_t KI;            /* indices.shape[1] */
    float scale;
    const Kernels* k;
    DI_Status oom;
} DecodeJob;

/* Cache rows p0 .. p0 + n - 1 of a sequence: in place for an f32 cache (the caller's steps never
 * cross a block), else their first `width` values converted into chunk (row stride Dc + Dr). */
static const float* cache_rows(const DecodeJob* j, const int32_t* bt, int64_t p0, int n, int64_t width,
                               float* chunk) {
    const DI_Tensor* c = &j->a->cache;
    if (j->cd == DT_F32) return (const float*)t_row2(c, j->cd, bt[p0 / j->BS], 0);
    for (int r = 0; r < n; r++) {
        int64_t p = p0 + r;
        load_row(j->cd, t_row2(c, j->cd, bt[p / j->BS], p % j->BS), 0, width, chunk + r * (j->Dc + j->Dr));
    }
    return chunk;
}

/* The positions token t attends with indices (V3.2's sparse MLA): the listed p with 0 <= p < L,
 * ascending, each once (a position listed twice counts once); returns how many. */
static int64_t listed_positions(const DI_MLADecodeArgs* a, int64_t t, int64_t KI, int64_t L, int32_t* pos) {
    const int32_t* li = (const int32_t*)t_row(&a->indices, DT_I32, t);
    int64_t n = 0;
    for (int64_t i = 0; i < KI; i++)
        if (li[i] >= 0 && li[i] < L) pos[n++] = li[i];
    if (n > 1) {
        qsort(pos, (size_t)n, sizeof(int32_t), cmp_pos);
        int64_t m = 1;
        for (int64_t i = 1; i < n; i++)
            if (pos[i] != pos[m - 1]) pos[m++] = pos[i];
        n = m;
    }
    return n;
}

/* rows pos[0 .. n) of a sequence, their first `width` values converted into chunk (row stride Dc + Dr) */
static const float* listed_rows(const DecodeJob* j, const int32_t* bt, const int32_t* pos, int n, int64_t width,
                                float* chunk) {
    const DI_Tensor* c = &j->a->cache;
    for (int r = 0; r < n; r++)
        load_row(j->cd, t_row2(c, j->cd, bt[pos[r] / j->BS], pos[r] % j->BS), 0, width, chunk + r * (j->Dc + j->Dr));
    return chunk;
}

static void decode_task(void* arg, int64_t task, int worker) {
    (void)worker;
    DecodeJob* j = (DecodeJob*)arg;
    const DI_MLADecodeArgs* a = j->a;
    int64_t g = task / j->nhb, h0 = (task % j->nhb) * j->hb;
    int64_t nh = h0 + j->hb < j->H ? j->hb : j->H - h0;
    int64_t Dc = j->Dc, Dr = j->Dr, Dn = j->Dn, Dv = j->Dv, Dw = Dc + Dr;
    int64_t t0 = j->g0[g], nt = j->g0[g + 1] - t0;
    int32_t seq = ((const int32_t*)t_base(&a->token_seq))[t0 * a->token_seq.strides[0]];
    /* L[u]: how many keys token u attends, positions [0, L[u]), or with indices its L[u] listed ones */
    int64_t L[DEC_GROUP], Lmax = 0;
    for (int64_t u = 0; u < nt; u++) {
        L[u] = ((const int32_t*)t_base(&a->kv_len))[(t0 + u) * a->kv_len.strides[0]];
        if (j->sparse && L[u] > j->KI) L[u] = j->KI;   /* the bound for the scratch; counted below */
        if (L[u] > Lmax) Lmax = L[u];
    }
    size_t need = (size_t)(nt * nh * Dw + nt * nh * Lmax + DEC_CHUNK * Dw + nh * nt * Dc + nt * Dn + Dc + Dn + Dr +
                           nt * Dv + 16);
    float* mem = di_malloc(need * sizeof(float) + (j->sparse ? (size_t)(nt * j->KI) * sizeof(int32_t) : 0));
    if (!mem) { j->oom = 1; return; }
    int32_t* pos = (int32_t*)(mem + need);   /* sparse: [nt][KI] listed positions */
    if (j->sparse)
        for (int64_t u = 0; u < nt; u++) {
            int64_t len = ((const int32_t*)t_base(&a->kv_len))[(t0 + u) * a->kv_len.strides[0]];
            L[u] = listed_positions(a, t0 + u, j->KI, len, pos + u * j->KI);
        }
    /* per token and head [q_lat (Dc), q_pe (Dr)]: the layout of a cache row, so a score is one dot
     * product; o_lat per head and token, so a head's tokens are the x rows of one rowdot4x call */
    float* qcat = mem;                       /* [nt][nh][Dw] */
    float* sc = qcat + nt * nh * Dw;         /* [nt][nh][Lmax] */
    float* chunk = sc + nt * nh * Lmax;
    float* olat = chunk + DEC_CHUNK * Dw;    /* [nh][nt][Dc] */
    float* qn = olat + nh * nt * Dc;         /* [nt][Dn]: one head's q_nope of every token */
    float* wrow = qn + nt * Dn;
    float* qrow = wrow + Dc;
    float* o = qrow + Dn + Dr;               /* [nt][Dv] */
    const DI_Tensor* W = &a->wkv_b;
    const Kernels* K = j->k;
    /* q_lat[h] = q_nope[h] @ W_uk[h]: rows of W_uk scaled and summed (bf16 rows decoded in registers) */
    for (int64_t i = 0; i < nh; i++) {
        int64_t h = h0 + i;
        for (int64_t u = 0; u < nt; u++) {
            load_row(j->qd, t_row2(&a->q, j->qd, t0 + u, h), 0, Dn + Dr, qrow);
            float* ql = qcat + (u * nh + i) * Dw;
            memcpy(qn + u * Dn, qrow, (size_t)Dn * sizeof(float));
            memcpy(ql + Dc, qrow + Dn, (size_t)Dr * sizeof(float));
            for (int64_t c = 0; c < Dc; c++) ql[c] = 0.0f;
        }
        float* ql0 = qcat + i * Dw;
        int64_t ldq = nh * Dw, d = 0;
        if (j->wd == DT_BF16 && K->axpy4_bf16)
            for (; d + 4 <= Dn; d += 4) {
                const uint16_t* wr = (const uint16_t*)t_row(W, j->wd, h * (Dn + Dv) + d);
                if (nt > 1 && K->axpy4x_bf16) K->axpy4x_bf16(qn + d, Dn, (int)nt, wr, W->strides[0], ql0, ldq, Dc);
                else
                    for (int64_t u = 0; u < nt; u++) K->axpy4_bf16(qn + u * Dn + d, wr, W->strides[0], ql0 + u * ldq, Dc);
            }
        for (; d < Dn; d++) {
            const char* wr = t_row(W, j->wd, h * (Dn + Dv) + d);
            if (j->wd != DT_BF16 && j->wd != DT_F32) load_row(j->wd, wr, 0, Dc, wrow);
            for (int64_t u = 0; u < nt; u++) {
                float c = qn[u * Dn + d], *ql = ql0 + u * ldq;
                if (j->wd == DT_BF16) K->axpy_bf16(c, (const uint16_t*)wr, ql, Dc);
                else if (j->wd == DT_F32) K->axpy(c, (const float*)wr, ql, Dc);
                else K->axpy(c, wrow, ql, Dc);
            }
        }
    }
    const int32_t* bt = (const int32_t*)t_row(&a->block_table, DT_I32, seq);
    /* an f32 cache is read in place, one cache block at a time (its rows are contiguous);
     * other dtypes are converted DEC_CHUNK rows at a time */
    int64_t step = j->cd == DT_F32 ? j->BS : DEC_CHUNK, crs = j->cd == DT_F32 ? a->cache.strides[1] : Dw;
    /* pass 1: scores, one dot of [q_lat, q_pe] with each cache row [latent, k_pe]; each token
     * takes the rows below its own length, in the steps it takes alone */
    if (j->sparse)   /* every token its own rows: gathered, converted, DEC_CHUNK at a time */
        for (int64_t u = 0; u < nt; u++)
            for (int64_t p0 = 0; p0 < L[u]; p0 += DEC_CHUNK) {
                int n = (int)(L[u] - p0 < DEC_CHUNK ? L[u] - p0 : DEC_CHUNK);
                const float* rows = listed_rows(j, bt, pos + u * j->KI + p0, n, Dw, chunk);
                for (int64_t i = 0; i < nh; i++)
                    K->dot_rows(qcat + (u * nh + i) * Dw, rows, Dw, n, Dw, sc + (u * nh + i) * Lmax + p0);
            }
    for (int64_t p0 = 0; !j->sparse && p0 < Lmax; p0 += step) {
        const float* rows = cache_rows(j, bt, p0, (int)(Lmax - p0 < step ? Lmax - p0 : step), Dw, chunk);
        for (int64_t u = 0; u < nt; u++) {
            if (p0 >= L[u]) continue;
            int n = (int)(L[u] - p0 < step ? L[u] - p0 : step);
            for (int64_t i = 0; i < nh; i++)
                K->dot_rows(qcat + (u * nh + i) * Dw, rows, crs, n, Dw, sc + (u * nh + i) * Lmax + p0);
        }
    }
    for (int64_t u = 0; u < nt; u++)
        for (int64_t i = 0; i < nh; i++) {
            if (L[u]) K->softmax(sc + (u * nh + i) * Lmax, L[u], j->scale);
            for (int64_t c = 0; c < Dc; c++) olat[(i * nt + u) * Dc + c] = 0.0f;
        }
    /* pass 2: o_lat = softmax @ c */
    if (j->sparse)
        for (int64_t u = 0; u < nt; u++)
            for (int64_t p0 = 0; p0 < L[u]; p0 += DEC_CHUNK) {
                int n = (int)(L[u] - p0 < DEC_CHUNK ? L[u] - p0 : DEC_CHUNK);
                const float* rows = listed_rows(j, bt, pos + u * j->KI + p0, n, Dc, chunk);
                for (int64_t i = 0; i < nh; i++)
                    K->wsum_rows(sc + (u * nh + i) * Lmax + p0, rows, Dw, n, Dc, olat + (i * nt + u) * Dc);
            }
    for (int64_t p0 = 0; !j->sparse && p0 < Lmax; p0 += step) {
        const float* rows = cache_rows(j, bt, p0, (int)(Lmax - p0 < step ? Lmax - p0 : step), Dc, chunk);
        for (int64_t u = 0; u < nt; u++) {
            if (p0 >= L[u]) continue;
            int n = (int)(L[u] - p0 < step ? L[u] - p0 : step);
            for (int64_t i = 0; i < nh; i++)
                K->wsum_rows(sc + (u * nh + i) * Lmax + p0, rows, crs, n, Dc, olat + (i * nt + u) * Dc);
        }
    }
    /* out[h] = W_uv[h] @ o_lat[h]: a GEMV over W_uv's rows, four at a time where the kernels allow
     * (every token of the group in one call); a token of length 0 gets zeros */
    rowdot_fn f1 = K->rowdot[j->wd];
    rowdot4_fn f4 = nt > 1 ? K->rowdot4x[j->wd] : K->rowdot4[j->wd];
    for (int64_t i = 0; i < nh; i++) {
        int64_t h = h0 + i, d = 0;
        const float* ol0 = olat + i * nt * Dc;
        if (f4)
            for (; d + 4 <= Dv; d += 4) {
                RowDot4 r4 = {ol0, {0}, Dc, Dc + 1, {NULL, NULL, NULL, NULL}, NULL, 0, NULL, (int)nt, Dc, Dv};
                for (int q = 0; q < 4; q++) r4.w[q] = t_row(W, j->wd, h * (Dn + Dv) + Dn + d + q);
                f4(&r4, o + d);
            }
        for (; d < Dv; d++) {
            const char* wr = t_row(W, j->wd, h * (Dn + Dv) + Dn + d);
            if (!f1) load_row(j->wd, wr, 0, Dc, wrow);
            for (int64_t u = 0; u < nt; u++) {
                const float* ol = ol0 + u * Dc;
                if (f1) {
                    RowDot r1;
                    memset(&r1, 0, sizeof r1);
                    r1.x[0] = ol;
                    r1.mr = 1;
                    r1.w = wr;
                    r1.K = Dc;
                    r1.bc = Dc + 1;
                    f1(&r1, o + u * Dv + d);
                } else {
                    K->gemm_dot(ol, Dc, 1, wrow, Dc, 1, Dc, o + u * Dv + d, 1);
                }
            }
        }
        for (int64_t u = 0; u < nt; u++) {
            if (!L[u]) for (int64_t c = 0; c < Dv; c++) o[u * Dv + c] = 0.0f;
            store_row(j->od, t_row2(&a->out, j->od, t0 + u, h), o + u * Dv, Dv);
        }
    }
    free(mem);
}

DI_Status op_mla_decode(DI_Context* ctx, const DI_MLADecodeArgs* a, int query) {
    VC v = {ctx, "mla_decode", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->q, "q", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->wkv_b, "wkv_b", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->cache, "cache", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->block_table, "block_table", 2, 2, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->token_seq, "token_seq", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->kv_len, "kv_len", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->q.shape[0], H = a->q.shape[1], Dc = a->wkv_b.shape[1], Dr = a->cache.shape[2] - Dc;
    int64_t Dn = a->q.shape[2] - Dr, Dv = a->out.shape[2];
    if (Dr < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_decode: cache.shape[2]=%lld < Dc=%lld (wkv_b.shape[1])",
                       (long long)a->cache.shape[2], (long long)Dc);
    if (Dn < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_decode: q.shape[2]=%lld < Dr=%lld", (long long)a->q.shape[2],
                       (long long)Dr);
    if ((st = check_dim(&v, &a->wkv_b, "wkv_b", 0, H * (Dn + Dv)))) return st;
    if ((st = check_dim(&v, &a->token_seq, "token_seq", 0, T))) return st;
    if ((st = check_dim(&v, &a->kv_len, "kv_len", 0, T))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T)) || (st = check_dim(&v, &a->out, "out", 1, H))) return st;
    int sparse = tensor_present(&v, &a->indices);   /* 1.3; absent for an older caller */
    if (sparse) {
        if ((st = check_tensor(&v, &a->indices, "indices", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_dim(&v, &a->indices, "indices", 0, T))) return st;
    }
    if (query) return DI_OK;
    int64_t NB = a->cache.shape[0], BS = a->cache.shape[1], S = a->block_table.shape[0],
            MB = a->block_table.shape[1], KI = sparse ? a->indices.shape[1] : 0;
    const int32_t* ts = (const int32_t*)t_base(&a->token_seq);
    const int32_t* kl = (const int32_t*)t_base(&a->kv_len);
    for (int64_t t = 0; t < T; t++) {
        int64_t s = ts[t * a->token_seq.strides[0]], L = kl[t * a->kv_len.strides[0]];
        if (s < 0 || s >= S)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_decode: token_seq[%lld]=%lld outside [0, S=%lld)",
                           (long long)t, (long long)s, (long long)S);
        if (L < 0 || L > MB * BS)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_decode: kv_len[%lld]=%lld outside [0, MB*BS=%lld]",
                           (long long)t, (long long)L, (long long)(MB * BS));
        const int32_t* bt = (const int32_t*)t_row(&a->block_table, DT_I32, s);
        /* every block below kv_len, with indices too (the reference's rule): the sparse path reads
         * only listed positions, but a bad table is the caller's bug either way */
        for (int64_t b = 0; b < (L + BS - 1) / (BS ? BS : 1); b++)
            if (bt[b] < 0 || bt[b] >= NB)
                return di_fail(ctx, DI_INVALID_ARGUMENT, "mla_decode: block_table[%lld, %lld]=%d outside [0, NB=%lld)",
                               (long long)s, (long long)b, bt[b], (long long)NB);
    }
    if (T == 0 || H == 0) return DI_OK;
    DecodeJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.T = T; j.H = H; j.Dn = Dn; j.Dr = Dr; j.Dv = Dv; j.Dc = Dc; j.BS = BS; j.scale = a->scale;
    j.qd = dt_id(a->q.dtype); j.wd = dt_id(a->wkv_b.dtype); j.cd = dt_id(a->cache.dtype); j.od = dt_id(a->out.dtype);
    j.sparse = sparse; j.KI = KI;
    j.k = kernels();
    int64_t* g0 = di_malloc((size_t)(T + 1) * sizeof(int64_t));
    if (!g0) return DI_OOM(ctx, "mla_decode");
    int64_t ng = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || ts[t * a->token_seq.strides[0]] != ts[(t - 1) * a->token_seq.strides[0]] ||
            t - g0[ng - 1] == DEC_GROUP)
            g0[ng++] = t;
    g0[ng] = T;
    j.g0 = g0;
    j.ng = ng;
    int nw = pool_size(ctx->pool);
    int64_t hb = (H + 2 * nw - 1) / (2 * nw);
    if (ng >= 2 * nw) hb = 16;
    j.hb = hb < 1 ? 1 : hb > 16 ? 16 : hb;
    j.nhb = (H + j.hb - 1) / j.hb;
    /* work: the latent keys each token reads, per head, plus the absorbed projections */
    int64_t keys = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t L = ((const int32_t*)t_base(&a->kv_len))[t * a->kv_len.strides[0]];
        keys += sparse && L > KI ? KI : L;
    }
    pool_run(ctx->pool, ng * j.nhb, decode_task, &j, (keys + T * (Dn + Dv)) * H * (Dc + Dr));
    free(g0);
    if (j.oom) return DI_OOM(ctx, "mla_decode");
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
