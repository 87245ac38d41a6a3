/* V4's compressed and sparse attention and V3.2's lightning indexer (ABI 1.3, abi/README.md
 * section 8): kv_compress, indexer_topk and sparse_attention.
 * Validation first (shapes, then the index values this library sees on the host: sequences,
 * lengths, block ids), never a read out of bounds; inputs converted to f32 rows; math in f32 (the
 * SIMD kernels of kernels*.c for the long dot products), f64 where it costs nothing; one rounding to
 * the output dtype at the end. Work is spread over rows (and, where one row is a big job, over heads
 * or entries) on the pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "op_rows.h"

/* token_seq[t] in [0, S) for every row */
static DI_Status check_token_seq(VC* v, const DI_Tensor* ts, int64_t T, int64_t S) {
    for (int64_t t = 0; t < T; t++) {
        int32_t s = ix1(ts, t);
        if (s < 0 || s >= S)
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: token_seq[%lld]=%d outside [0, S=%lld)", v->op,
                           (long long)t, s, (long long)S);
    }
    return DI_OK;
}

/* the block holding position p of sequence s must be a block of the cache being read */
static DI_Status check_block(VC* v, const DI_Tensor* bt, int64_t s, int64_t b, int64_t NB, const char* cache) {
    int32_t id = ixrow(bt, s)[b];
    if (id < 0 || id >= NB)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: block_table[%lld, %lld]=%d outside [0, %s.shape[0]=%lld)",
                       v->op, (long long)s, (long long)b, id, cache, (long long)NB);
    return DI_OK;
}

/* Block sizes and ratios of the 1.3 paged layouts are powers of two (README section 8): only then
 * does one divide the other, so that a compressed entry's slot always falls inside its block. */
static DI_Status check_pow2(VC* v, const char* name, int64_t x) {
    if (x < 1 || (x & (x - 1)))
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s=%lld must be a power of two", v->op, name, (long long)x);
    return DI_OK;
}

/* The paged entries of a per-layer compressed cache [NB, CB, D] (kv_compress's layout): entry e of a
 * sequence lives in the block of its window's last token pe = (e + 1) * ratio - 1, at slot
 * (pe % BS) / ratio, so CB = max(1, BS / ratio). */
static DI_Status check_entry_blocks(VC* v, const DI_Tensor* cache, const char* name, const char* bs_name, int64_t BS,
                                    int64_t ratio) {
    DI_Status st;
    if ((st = check_pow2(v, "ratio", ratio)) || (st = check_pow2(v, bs_name, BS))) return st;
    int64_t want = BS / ratio > 1 ? BS / ratio : 1;
    if (cache->shape[1] != want)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[1]=%lld, expected max(1, block size / ratio) = "
                       "max(1, %lld / %lld) = %lld", v->op, name, (long long)cache->shape[1], (long long)BS,
                       (long long)ratio, (long long)want);
    return DI_OK;
}

static inline const char* entry_row(const DI_Tensor* cache, int dt, const int32_t* bt, int64_t e, int64_t ratio,
                                    int64_t BS) {
    int64_t pe = (e + 1) * ratio - 1;
    return row3(cache, dt, bt[pe / BS], (pe % BS) / ratio);
}

/* ascending, duplicates removed: a position or entry listed twice counts once */
static int cmp_i32(const void* x, const void* y) {
    int32_t a = *(const int32_t*)x, b = *(const int32_t*)y;
    return (a > b) - (a < b);
}
static int64_t sort_unique(int32_t* v, int64_t n) {
    if (n <= 1) return n;
    qsort(v, (size_t)n, sizeof(int32_t), cmp_i32);
    int64_t m = 1;
    for (int64_t i = 1; i < n; i++)
        if (v[i] != v[m - 1]) v[m++] = v[i];
    return m;
}

/* ================================================================== kv_compress */
/* Only rows whose position closes a window do work: one task each. Per feature, a two-pass softmax
 * over the window's slots (max, then exp-weighted sums), reading the staged rows twice rather than
 * keeping 2 * ratio of them: the second read comes from cache and saves an exp per slot. */
typedef struct {
    const DI_KVCompressArgs* a;
    int sd, od;
    int64_t W, D, BS, ratio;
    const int64_t* rows;   /* the closing rows */
    float* scratch;        /* per worker: 5 * D floats */
} KVCJob;

/* slot of window w: its token q, where its value and gate logit start in the staged row, and the
 * position_bias row and column offset; 0 when the slot is absent (window 0's first half) */
static int kvc_slot(const KVCJob* j, int64_t w, int64_t slot, int64_t* q, int64_t* vo, int64_t* go, int64_t* bi,
                    int64_t* bo) {
    int64_t r = j->ratio;
    if (!j->a->overlap) {
        *q = w * r + slot; *vo = 0; *go = j->W; *bi = slot; *bo = 0;
        return 1;
    }
    if (slot < r) {
        if (w == 0) return 0;
        *q = (w - 1) * r + slot; *vo = 0; *go = j->W; *bi = slot; *bo = 0;
    } else {
        *q = w * r + slot - r; *vo = j->D; *go = j->W + j->D; *bi = slot - r; *bo = j->D;
    }
    return 1;
}

static void kvc_task(void* arg, int64_t i, int worker) {
    const KVCJob* j = (const KVCJob*)arg;
    const DI_KVCompressArgs* a = j->a;
    int64_t t = j->rows[i], D = j->D, p = ix1(&a->positions, t);
    int64_t w = (p + 1) / j->ratio - 1, nslot = a->overlap ? 2 * j->ratio : j->ratio;
    const int32_t* bt = ixrow(&a->block_table, ix1(&a->token_seq, t));
    float* m = j->scratch + (size_t)worker * (size_t)(5 * D);
    float* den = m + D;
    float* num = den + D;
    float* lg = num + D;
    float* val = lg + D;
    for (int64_t d = 0; d < D; d++) { m[d] = -INFINITY; den[d] = 0.0f; num[d] = 0.0f; }
    const float* pb = (const float*)t_base(&a->position_bias);
    int64_t pbs = a->position_bias.strides[0];
    for (int pass = 0; pass < 2; pass++)
        for (int64_t s = 0; s < nslot; s++) {
            int64_t q, vo, go, bi, bo;
            if (!kvc_slot(j, w, s, &q, &vo, &go, &bi, &bo)) continue;
            const char* row = row3(&a->staged, j->sd, bt[q / j->BS], q % j->BS);
            const float* bias = pb + bi * pbs + bo;
            load_row(j->sd, row, go, D, lg);
            if (pass == 0) {
                for (int64_t d = 0; d < D; d++) {
                    float l = lg[d] + bias[d];
                    if (l > m[d]) m[d] = l;
                }
            } else {
                load_row(j->sd, row, vo, D, val);
                for (int64_t d = 0; d < D; d++) {
                    float e = expf(lg[d] + bias[d] - m[d]);
                    den[d] += e;
                    num[d] += e * val[d];
                }
            }
        }
    for (int64_t d = 0; d < D; d++) num[d] /= den[d];
    store_row(j->od, t_row(&a->out, j->od, t), num, D);
}

DI_Status op_kv_compress(DI_Context* ctx, const DI_KVCompressArgs* a, int query) {
    VC v = {ctx, "kv_compress", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->staged, "staged", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->position_bias, "position_bias", 2, 2, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->block_table, "block_table", 2, 2, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->token_seq, "token_seq", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->positions, "positions", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_pow2(&v, "ratio", a->ratio))) return st;
    if ((st = check_pow2(&v, "staged.shape[1] (the block size)", a->staged.shape[1]))) return st;
    if (a->overlap != 0 && a->overlap != 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "kv_compress: overlap=%d, expected 0 or 1", a->overlap);
    int64_t T = a->token_seq.shape[0], W2 = a->staged.shape[2], W = W2 / 2, D = a->overlap ? W / 2 : W;
    if (W2 % 2 || (a->overlap && W % 2))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "kv_compress: staged.shape[2]=%lld must be 2W with W%s even",
                       (long long)W2, a->overlap ? " (overlap 1: W / 2 features)" : "");
    if ((st = check_dim(&v, &a->position_bias, "position_bias", 0, a->ratio)) ||
        (st = check_dim(&v, &a->position_bias, "position_bias", 1, W)))
        return st;
    if ((st = check_dim(&v, &a->positions, "positions", 0, T))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T)) || (st = check_dim(&v, &a->out, "out", 1, D))) return st;
    if (query) return DI_OK;
    int64_t NB = a->staged.shape[0], BS = a->staged.shape[1], S = a->block_table.shape[0],
            MB = a->block_table.shape[1], r = a->ratio;
    if ((st = check_token_seq(&v, &a->token_seq, T, S))) return st;
    int64_t nclose = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t p = ix1(&a->positions, t), s = ix1(&a->token_seq, t);
        if (p < 0 || p >= MB * BS)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "kv_compress: positions[%lld]=%lld outside [0, MB*BS=%lld)",
                           (long long)t, (long long)p, (long long)(MB * BS));
        if ((p + 1) % r) continue;
        int64_t w = (p + 1) / r - 1, first = a->overlap && w > 0 ? (w - 1) * r : w * r;
        for (int64_t b = first / BS; b <= p / BS; b++)
            if ((st = check_block(&v, &a->block_table, s, b, NB, "staged"))) return st;
        nclose++;
    }
    int od = dt_id(a->out.dtype);
    size_t rowb = (size_t)D * (size_t)(dt_bits(od) / 8);
    int64_t* rows = di_malloc((size_t)(nclose + 1) * sizeof(int64_t));
    if (!rows) return DI_OOM(ctx, "kv_compress");
    nclose = 0;
    for (int64_t t = 0; t < T; t++) {
        if ((ix1(&a->positions, t) + 1) % r == 0) rows[nclose++] = t;
        else memset(t_row(&a->out, od, t), 0, rowb);   /* +0.0 in f32 and bf16 */
    }
    if (nclose && D) {
        KVCJob j = {a, dt_id(a->staged.dtype), od, W, D, BS, r, rows, NULL};
        j.scratch = di_malloc((size_t)pool_size(ctx->pool) * (size_t)(5 * D) * sizeof(float));
        if (!j.scratch) { free(rows); return DI_OOM(ctx, "kv_compress"); }
        pool_run(ctx->pool, nclose, kvc_task, &j, nclose * r * (a->overlap ? 2 : 1) * D * 8);
        free(j.scratch);
    }
    free(rows);
    return DI_OK;
}

/* ================================================================== indexer_topk */
/* Phase 1 scores the visible entries, in tasks of a row and up to IX_CHUNK entries (a decode step's
 * one row over a long context still spreads over the pool): the NI query heads against a gathered
 * f32 block of keys through the dot-product kernel, then the weighted ReLU sum over heads (f32).
 * Phase 2 selects per row: a bounded heap of the K best (descending score, ties to the lower entry)
 * in one pass over the entries, then a sort of those K. Rows are done in batches whose scores fit
 * IX_SCORES floats. */
#define IX_CHUNK 512
#define IX_KEYS 64                /* keys gathered per kernel call */
#define IX_SCORES (1 << 22)       /* score floats a batch holds (16 MiB) */
typedef struct {
    const DI_IndexerTopkArgs* a;
    int qd, kd;
    int64_t NI, Di, K, ratio, bs;
    const int64_t* trow;          /* task: row, first entry, end entry, score offset */
    const int64_t* te0;
    const int64_t* te1;
    const int64_t* soff;          /* per row of the batch: offset of its scores */
    int64_t r0;                   /* first row of the batch */
    float* scores;
    char* scratch;
    size_t per;
    const Kernels* k;
} IXJob;

static void ix_score_task(void* arg, int64_t task, int worker) {
    const IXJob* j = (const IXJob*)arg;
    const DI_IndexerTopkArgs* a = j->a;
    int64_t t = j->trow[task], e0 = j->te0[task], e1 = j->te1[task], NI = j->NI, Di = j->Di;
    float* ssum = (float*)(j->scratch + (size_t)worker * j->per);     /* [IX_KEYS] */
    float* qf = (float*)(ssum + IX_KEYS);                             /* [NI, Di] */
    float* kb = qf + NI * Di;                                         /* [IX_KEYS, Di] */
    float* dots = kb + IX_KEYS * Di;                                  /* [NI, IX_KEYS] */
    for (int64_t h = 0; h < NI; h++) load_row(j->qd, row3(&a->q, j->qd, t, h), 0, Di, qf + h * Di);
    const float* w = (const float*)t_row(&a->weights, DT_F32, t);
    const int32_t* bt = ixrow(&a->block_table, ix1(&a->token_seq, t));
    float* sc = j->scores + j->soff[t - j->r0];
    for (int64_t c0 = e0; c0 < e1; c0 += IX_KEYS) {
        int n = (int)(e1 - c0 < IX_KEYS ? e1 - c0 : IX_KEYS);
        for (int r = 0; r < n; r++) load_row(j->kd, entry_row(&a->keys, j->kd, bt, c0 + r, j->ratio, j->bs), 0, Di,
                                             kb + r * Di);
        j->k->gemm_dot(qf, Di, (int)NI, kb, Di, n, Di, dots, IX_KEYS);
        /* the head sum in f32 (the README's "f32 or better"; conformance allows for f32 accumulation
         * of the dots and of this sum), heads outer so that it runs on the axpy kernel */
        for (int r = 0; r < n; r++) ssum[r] = 0.0f;
        for (int64_t h = 0; h < NI; h++) {
            float* dh = dots + h * IX_KEYS;
            for (int r = 0; r < n; r++) dh[r] = dh[r] > 0.0f ? dh[r] : 0.0f;
            j->k->axpy(w[h], dh, ssum, n);
        }
        for (int r = 0; r < n; r++) {
            float v = ssum[r] * a->scale;
            sc[c0 + r] = isnan(v) ? -INFINITY : v;   /* NaN ranks last (a total order for the selection) */
        }
    }
}

typedef struct { float s; int32_t e; } SE;
/* the selection order: score descending, ties to the lower entry */
static inline int se_better(SE x, SE y) { return x.s > y.s || (x.s == y.s && x.e < y.e); }
static int cmp_se(const void* x, const void* y) {
    SE a = *(const SE*)x, b = *(const SE*)y;
    return se_better(a, b) ? -1 : se_better(b, a) ? 1 : 0;
}
/* heap with the worst kept entry at the root */
static void se_sift(SE* h, int64_t n, int64_t i) {
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && se_better(h[c], h[c + 1])) c++;   /* the worse child */
        if (!se_better(h[i], h[c])) return;
        SE tmp = h[i]; h[i] = h[c]; h[c] = tmp;
        i = c;
    }
}

static void ix_select_task(void* arg, int64_t i, int worker) {
    const IXJob* j = (const IXJob*)arg;
    const DI_IndexerTopkArgs* a = j->a;
    int64_t t = j->r0 + i, n = ix1(&a->kv_len, t) / j->ratio, K = j->K;
    SE* h = (SE*)(j->scratch + (size_t)worker * j->per);
    const float* sc = j->scores + j->soff[i];
    int64_t m = n < K ? n : K;
    for (int64_t e = 0; e < m; e++) { h[e].s = sc[e]; h[e].e = (int32_t)e; }
    if (n > K && K > 0) {
        for (int64_t q = K / 2 - 1; q >= 0; q--) se_sift(h, K, q);
        for (int64_t e = K; e < n; e++) {
            SE c = {sc[e], (int32_t)e};
            if (se_better(c, h[0])) { h[0] = c; se_sift(h, K, 0); }
        }
    }
    qsort(h, (size_t)m, sizeof(SE), cmp_se);
    int32_t* out = (int32_t*)t_row(&a->out, DT_I32, t);
    for (int64_t q = 0; q < m; q++) out[q] = h[q].e;
    for (int64_t q = m; q < K; q++) out[q] = -1;
}

DI_Status op_indexer_topk(DI_Context* ctx, const DI_IndexerTopkArgs* a, int query) {
    VC v = {ctx, "indexer_topk", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->q, "q", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->weights, "weights", 2, 2, DTM(DT_F32), 0))) return st;
    if ((st = check_tensor(&v, &a->keys, "keys", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->block_table, "block_table", 2, 2, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->token_seq, "token_seq", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->kv_len, "kv_len", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 2, 2, DTM(DT_I32), 0))) return st;
    int64_t T = a->q.shape[0], NI = a->q.shape[1], Di = a->q.shape[2], K = a->out.shape[1];
    if ((st = check_dim(&v, &a->weights, "weights", 0, T)) || (st = check_dim(&v, &a->weights, "weights", 1, NI)))
        return st;
    if ((st = check_dim(&v, &a->keys, "keys", 2, Di))) return st;
    if ((st = check_dim(&v, &a->token_seq, "token_seq", 0, T))) return st;
    if ((st = check_dim(&v, &a->kv_len, "kv_len", 0, T))) return st;
    if ((st = check_dim(&v, &a->out, "out", 0, T))) return st;
    if ((st = check_entry_blocks(&v, &a->keys, "keys", "block_size", a->block_size, a->ratio))) return st;
    if (!isfinite(a->scale))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "indexer_topk: scale=%g is not finite", (double)a->scale);
    if (K > INT32_MAX) return di_fail(ctx, DI_INVALID_ARGUMENT, "indexer_topk: K=%lld too large", (long long)K);
    if (query) return DI_OK;
    int64_t NB = a->keys.shape[0], S = a->block_table.shape[0], MB = a->block_table.shape[1], BS = a->block_size,
            r = a->ratio;
    if ((st = check_token_seq(&v, &a->token_seq, T, S))) return st;
    for (int64_t t = 0; t < T; t++) {
        int64_t L = ix1(&a->kv_len, t), s = ix1(&a->token_seq, t);
        if (L < 0 || L > MB * BS)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "indexer_topk: kv_len[%lld]=%lld outside [0, MB*block_size=%lld]",
                           (long long)t, (long long)L, (long long)(MB * BS));
        int64_t prev = -1;
        for (int64_t e = 0; e < L / r; e++) {   /* the blocks of every visible entry */
            int64_t b = ((e + 1) * r - 1) / BS;
            if (b != prev && (st = check_block(&v, &a->block_table, s, b, NB, "keys"))) return st;
            prev = b;
        }
    }
    if (T == 0 || K == 0) return DI_OK;
    IXJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.NI = NI; j.Di = Di; j.K = K; j.ratio = r; j.bs = BS;
    j.qd = dt_id(a->q.dtype); j.kd = dt_id(a->keys.dtype);
    j.k = kernels();
    int nw = pool_size(ctx->pool);
    size_t p1 = (size_t)(NI * Di + IX_KEYS * Di + NI * IX_KEYS + IX_KEYS) * sizeof(float),
           p2 = (size_t)K * sizeof(SE);
    j.per = ((p1 > p2 ? p1 : p2) + 63) & ~(size_t)63;
    j.scratch = di_malloc((size_t)nw * j.per);
    int64_t* soff = di_malloc((size_t)(T + 1) * sizeof(int64_t));
    if (!j.scratch || !soff) { free(j.scratch); free(soff); return DI_OOM(ctx, "indexer_topk"); }
    j.soff = soff;
    st = DI_OK;
    for (int64_t r0 = 0; r0 < T && !st;) {
        /* a batch of rows whose scores fit (at least one row) */
        int64_t r1 = r0, tot = 0, ntask = 0;
        while (r1 < T) {
            int64_t n = ix1(&a->kv_len, r1) / r;
            if (r1 > r0 && tot + n > IX_SCORES) break;
            soff[r1 - r0] = tot;
            tot += n;
            ntask += (n + IX_CHUNK - 1) / IX_CHUNK;
            r1++;
        }
        float* scores = di_malloc((size_t)(tot + 1) * sizeof(float));
        int64_t* tl = di_malloc((size_t)(3 * ntask + 1) * sizeof(int64_t));
        if (!scores || !tl) {
            free(scores); free(tl);
            st = DI_OOM(ctx, "indexer_topk");
            break;
        }
        int64_t nt = 0;
        for (int64_t t = r0; t < r1; t++)
            for (int64_t e = 0, n = ix1(&a->kv_len, t) / r; e < n; e += IX_CHUNK) {
                tl[nt] = t;
                tl[ntask + nt] = e;
                tl[2 * ntask + nt] = e + IX_CHUNK < n ? e + IX_CHUNK : n;
                nt++;
            }
        j.trow = tl; j.te0 = tl + ntask; j.te1 = tl + 2 * ntask; j.r0 = r0; j.scores = scores;
        pool_run(ctx->pool, ntask, ix_score_task, &j, tot * NI * Di);
        pool_run(ctx->pool, r1 - r0, ix_select_task, &j, tot * 4);
        free(scores);
        free(tl);
        r0 = r1;
    }
    free(soff);
    free(j.scratch);
    return st;
}

/* ================================================================== sparse_attention */
/* One task per (row, block of heads): the heads of a row share every key (MQA), so a task gathers
 * SA_CHUNK keys at a time into f32 (window positions first, then compressed entries), scores them
 * against all its heads with the dot-product kernel and folds them into an online softmax (running
 * max, denominator and weighted sum per head; the sink starts the max and the denominator). A row
 * never holds more than a chunk of scores, so window 0 over a long context needs no big buffer.
 * Few rows (decode) split the heads so the pool has work; many rows keep all heads in one task,
 * which reads each key once per row. */
#define SA_CHUNK 64
typedef struct {
    const DI_SparseAttentionArgs* a;
    int qd, kd, cd, od, comp, idx, sink;
    int64_t NH, D, BS, ratio, window, KI, hb, nhb;
    float scale;
    const Kernels* k;
    char* scratch;   /* per worker, sa_scratch bytes: a decode step's tasks are many and short, and a
                      * fresh allocation of this size per task would be an mmap with page faults */
    size_t per;
} SAJob;

static size_t sa_scratch(int64_t nh, int64_t D, int64_t KI) {
    size_t b = (size_t)(2 * nh * D + SA_CHUNK * D + nh * SA_CHUNK + 2 * nh) * sizeof(float) +
               (size_t)(KI + nh) * sizeof(int32_t);
    return (b + 63) & ~(size_t)63;
}

static void sa_task(void* arg, int64_t task, int worker) {
    SAJob* j = (SAJob*)arg;
    const DI_SparseAttentionArgs* a = j->a;
    int64_t t = task / j->nhb, h0 = (task % j->nhb) * j->hb, D = j->D;
    int64_t nh = h0 + j->hb < j->NH ? j->hb : j->NH - h0;
    int64_t L = ix1(&a->kv_len, t);
    const int32_t* bt = ixrow(&a->block_table, ix1(&a->token_seq, t));
    int64_t w0 = j->window > 0 && L > j->window ? L - j->window : 0, nwin = L - w0;
    int64_t nvis = j->comp ? L / j->ratio : 0, ncomp = nvis;
    float* qf = (float*)(j->scratch + (size_t)worker * j->per);   /* [nh, D] */
    float* acc = qf + nh * D;           /* [nh, D] */
    float* kb = acc + nh * D;           /* [SA_CHUNK, D] */
    float* sc = kb + SA_CHUNK * D;      /* [nh, SA_CHUNK] */
    float* mx = sc + nh * SA_CHUNK;     /* running max per head */
    float* den = mx + nh;               /* running denominator per head */
    int* act = (int*)(den + nh);        /* the heads a chunk adds to */
    int32_t* ent = (int32_t*)(act + nh);
    if (j->idx) {   /* the listed entries that are visible, each once */
        const int32_t* li = ixrow(&a->indices, t);
        ncomp = 0;
        for (int64_t q = 0; q < j->KI; q++)
            if (li[q] >= 0 && li[q] < nvis) ent[ncomp++] = li[q];
        ncomp = sort_unique(ent, ncomp);
    }
    for (int64_t i = 0; i < nh; i++) {
        load_row(j->qd, row3(&a->q, j->qd, t, h0 + i), 0, D, qf + i * D);
        for (int64_t d = 0; d < D; d++) acc[i * D + d] = 0.0f;
        if (j->sink) { mx[i] = fx1(&a->sinks, h0 + i); den[i] = 1.0f; }   /* exp(sink - max) with max = sink */
        else { mx[i] = -INFINITY; den[i] = 0.0f; }
    }
    int64_t n = nwin + ncomp;
    for (int64_t c0 = 0; c0 < n; c0 += SA_CHUNK) {
        int c = (int)(n - c0 < SA_CHUNK ? n - c0 : SA_CHUNK);
        for (int r = 0; r < c; r++) {
            int64_t x = c0 + r;
            if (x < nwin) {
                int64_t p = w0 + x;
                load_row(j->kd, row3(&a->kv_cache, j->kd, bt[p / j->BS], p % j->BS), 0, D, kb + r * D);
            } else {
                int64_t e = j->idx ? ent[x - nwin] : x - nwin;
                load_row(j->cd, entry_row(&a->comp_cache, j->cd, bt, e, j->ratio, j->BS), 0, D, kb + r * D);
            }
        }
        j->k->gemm_dot(qf, D, (int)nh, kb, D, c, D, sc, SA_CHUNK);
        int na = 0;
        for (int64_t i = 0; i < nh; i++) {
            float* s = sc + i * SA_CHUNK;
            float cm = -INFINITY;
            for (int r = 0; r < c; r++) {
                s[r] *= j->scale;
                if (s[r] > cm) cm = s[r];
            }
            if (cm == -INFINITY) continue;   /* nothing this chunk can add */
            float m = mx[i] > cm ? mx[i] : cm;
            if (m > mx[i]) {                 /* a new max: rescale what was summed so far */
                float f = expf(mx[i] - m);
                den[i] *= f;
                for (int64_t d = 0; d < D; d++) acc[i * D + d] *= f;
                mx[i] = m;
            }
            float sum = 0.0f;
            for (int r = 0; r < c; r++) { s[r] = expf(s[r] - m); sum += s[r]; }
            den[i] += sum;
            act[na++] = (int)i;
        }
        /* acc[h] += p[h] @ keys: four heads per pass over the chunk where the kernels allow (the
         * weighted sum is the time of this op; the same bits either way) */
        int a0 = 0;
        if (j->k->wsum_rows4)
            for (; a0 + 4 <= na; a0 += 4) {
                const float* w4[4];
                float* acc4[4];
                for (int q = 0; q < 4; q++) { w4[q] = sc + act[a0 + q] * SA_CHUNK; acc4[q] = acc + act[a0 + q] * D; }
                j->k->wsum_rows4(w4, kb, D, c, D, acc4);
            }
        for (; a0 < na; a0++) j->k->wsum_rows(sc + act[a0] * SA_CHUNK, kb, D, c, D, acc + act[a0] * D);
    }
    for (int64_t i = 0; i < nh; i++) {
        float* o = acc + i * D;
        if (den[i] > 0.0f) {   /* 0: no key and no sink, a zero row */
            float inv = 1.0f / den[i];
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
        store_row(j->od, row3(&a->out, j->od, t, h0 + i), o, D);
    }
}

DI_Status op_sparse_attention(DI_Context* ctx, const DI_SparseAttentionArgs* a, int query) {
    VC v = {ctx, "sparse_attention", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->q, "q", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->kv_cache, "kv_cache", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_tensor(&v, &a->block_table, "block_table", 2, 2, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->token_seq, "token_seq", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->kv_len, "kv_len", 1, 1, DTM(DT_I32), 0))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 3, 3, DTM_FLOAT_ACT, 0))) return st;
    int64_t T = a->q.shape[0], NH = a->q.shape[1], D = a->q.shape[2], BS = a->kv_cache.shape[1];
    if ((st = check_dim(&v, &a->kv_cache, "kv_cache", 2, D))) return st;
    if ((st = check_dim(&v, &a->token_seq, "token_seq", 0, T))) return st;
    if ((st = check_dim(&v, &a->kv_len, "kv_len", 0, T))) return st;
    if ((st = check_same_shape(&v, &a->q, "q", &a->out, "out"))) return st;
    int comp = tensor_present(&v, &a->comp_cache), idx = tensor_present(&v, &a->indices),
        sink = tensor_present(&v, &a->sinks);
    if (comp) {
        if ((st = check_tensor(&v, &a->comp_cache, "comp_cache", 3, 3, DTM_FLOAT_ACT, 0))) return st;
        if ((st = check_dim(&v, &a->comp_cache, "comp_cache", 2, D))) return st;
        if ((st = check_entry_blocks(&v, &a->comp_cache, "comp_cache", "kv_cache.shape[1] (the block size)", BS,
                                     a->ratio)))
            return st;
    }
    if (idx) {
        if (!comp)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "sparse_attention: indices selects compressed entries; "
                           "comp_cache is absent");
        if ((st = check_tensor(&v, &a->indices, "indices", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_dim(&v, &a->indices, "indices", 0, T))) return st;
    }
    if (sink) {
        if ((st = check_tensor(&v, &a->sinks, "sinks", 1, 1, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(&v, &a->sinks, "sinks", 0, NH))) return st;
    }
    if (a->window < 0)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "sparse_attention: window=%d, expected >= 0 (0: all positions)",
                       a->window);
    if (!isfinite(a->scale))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "sparse_attention: scale=%g is not finite", (double)a->scale);
    if (query) return DI_OK;
    int64_t NB = a->kv_cache.shape[0], S = a->block_table.shape[0], MB = a->block_table.shape[1];
    int64_t NBc = comp ? a->comp_cache.shape[0] : 0, r = comp ? a->ratio : 1, KI = idx ? a->indices.shape[1] : 0;
    if ((st = check_token_seq(&v, &a->token_seq, T, S))) return st;
    int64_t work = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t L = ix1(&a->kv_len, t), s = ix1(&a->token_seq, t);
        if (L < 0 || L > MB * BS)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "sparse_attention: kv_len[%lld]=%lld outside [0, MB*BS=%lld]",
                           (long long)t, (long long)L, (long long)(MB * BS));
        int64_t w0 = a->window > 0 && L > a->window ? L - a->window : 0;
        for (int64_t b = w0 / (BS ? BS : 1); L > 0 && b <= (L - 1) / BS; b++)
            if ((st = check_block(&v, &a->block_table, s, b, NB, "kv_cache"))) return st;
        work += L - w0;
        if (!comp) continue;
        int64_t nvis = L / r;
        if (idx) {
            const int32_t* li = ixrow(&a->indices, t);
            for (int64_t q = 0; q < KI; q++)
                if (li[q] >= 0 && li[q] < nvis) {
                    if ((st = check_block(&v, &a->block_table, s, ((int64_t)(li[q] + 1) * r - 1) / BS, NBc,
                                          "comp_cache")))
                        return st;
                    work++;
                }
        } else {
            int64_t prev = -1;
            for (int64_t e = 0; e < nvis; e++) {
                int64_t b = ((e + 1) * r - 1) / BS;
                if (b != prev && (st = check_block(&v, &a->block_table, s, b, NBc, "comp_cache"))) return st;
                prev = b;
            }
            work += nvis;
        }
    }
    if (T == 0 || NH == 0) return DI_OK;
    SAJob j;
    memset(&j, 0, sizeof j);
    j.a = a; j.NH = NH; j.D = D; j.BS = BS; j.ratio = r; j.window = a->window; j.KI = KI; j.scale = a->scale;
    j.comp = comp; j.idx = idx; j.sink = sink;
    j.qd = dt_id(a->q.dtype); j.kd = dt_id(a->kv_cache.dtype); j.od = dt_id(a->out.dtype);
    j.cd = comp ? dt_id(a->comp_cache.dtype) : DT_F32;
    j.k = kernels();
    int64_t nw = pool_size(ctx->pool), nhb = (2 * nw + T - 1) / T;
    if (nhb < 1) nhb = 1;
    if (nhb > NH) nhb = NH;
    j.hb = (NH + nhb - 1) / nhb;
    j.nhb = (NH + j.hb - 1) / j.hb;
    j.per = sa_scratch(j.hb, D, KI);
    j.scratch = di_malloc((size_t)nw * j.per);
    if (!j.scratch) return DI_OOM(ctx, "sparse_attention");
    pool_run(ctx->pool, T * j.nhb, sa_task, &j, 2 * work * NH * D + T);
    free(j.scratch);
    return DI_OK;
}
