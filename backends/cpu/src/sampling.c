/* Sampling: sample (temperature, top-k, top-p, a counter-based draw per row) and spec_verify
 * (speculative decoding's accept / resample rule over a draft's tokens), on one set of
 * distribution helpers, so a verified token is drawn the way sample draws it. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "di_cpu.h"

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
#define AT2(t, type, i, j) (((type*)t_base(&(t)))[(i) * (t).strides[0] + (j) * (t).strides[1]])

/* ------------------------------------------------------------------ 1.7's controls of sample
 * Row b's logits adjusted in f32 (README section 8): logit bias added, then each token of the history
 * divided (positive) or multiplied by the repetition penalty, count * frequency and then presence
 * subtracted from each token of the output, and the mask's banned tokens set to -inf. Each token's
 * adjustment depends only on that token, so they run token by token. cnt: V int32 of scratch of which
 * only the history's entries are zeroed and read (a row costs O(L) there, not O(V)): the low 30 bits
 * count the output's occurrences, bit 30 says "in the prompt". */
#define SEEN_IN_PROMPT (1 << 30)

static int has_controls(const DI_SampleArgs* a) { return a->history.data || a->bias_ids.data || a->token_mask.data; }

/* 1: some token is left; 0: the controls banned every one */
static int control_row(const DI_SampleArgs* a, int64_t b, int64_t V, float* x, int32_t* cnt) {
    if (a->bias_ids.data) {
        for (int64_t n = 0; n < a->bias_ids.shape[1]; n++) {
            int32_t t = AT2(a->bias_ids, const int32_t, b, n);
            if (t >= 0 && t < V) x[t] += AT2(a->bias, const float, b, n);
        }
    }
    if (a->history.data) {
        const int64_t L = a->history.shape[1];
        const int64_t pl = AT(a->prompt_lens, const int32_t, b);
        const float rep = AT2(a->penalties, const float, b, 0), freq = AT2(a->penalties, const float, b, 1),
                    pres = AT2(a->penalties, const float, b, 2);
        for (int64_t i = 0; i < L; i++) {
            int32_t t = AT2(a->history, const int32_t, b, i);
            if (t >= 0 && t < V) cnt[t] = 0;
        }
        for (int64_t i = 0; i < L; i++) {
            int32_t t = AT2(a->history, const int32_t, b, i);
            if (t < 0 || t >= V) continue;
            if (i < pl) cnt[t] |= SEEN_IN_PROMPT;
            else cnt[t]++;
        }
        for (int64_t i = 0; i < L; i++) {
            int32_t t = AT2(a->history, const int32_t, b, i);
            if (t < 0 || t >= V || !cnt[t]) continue;
            const int32_t c = cnt[t] & (SEEN_IN_PROMPT - 1);
            cnt[t] = 0;                       /* a token's adjustment is made once */
            float v = x[t];
            if (rep != 1.0f) v = v > 0.0f ? v / rep : v * rep;
            if (c > 0) {
                const float m = (float)c * freq;
                v = v - m;
                v = v - pres;
            }
            x[t] = v;
        }
    }
    if (a->token_mask.data) {
        for (int64_t i = 0; i < V; i++)
            if (!((uint32_t)AT2(a->token_mask, const int32_t, b, i >> 5) >> (i & 31) & 1u)) x[i] = -INFINITY;
    }
    int any = 0;
    for (int64_t i = 0; i < V; i++) any |= x[i] > -INFINITY;
    return any;
}

/* the controls' shapes, groups and values (bias NaN / +inf, penalties not finite or repetition <= 0,
 * prompt_lens outside [0, L]) */
static DI_Status check_sample_controls(VC* v, const DI_SampleArgs* a, int64_t B, int64_t V) {
    DI_Status st;
    const int hist = tensor_present(v, &a->history), pls = tensor_present(v, &a->prompt_lens),
              pen = tensor_present(v, &a->penalties), bids = tensor_present(v, &a->bias_ids),
              bias = tensor_present(v, &a->bias), mask = tensor_present(v, &a->token_mask);
    if (hist != pls || hist != pen)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "sample: history, prompt_lens and penalties go together (all "
                       "present or all absent)");
    if (bids != bias)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "sample: bias_ids and bias go together (both present or both absent)");
    if (hist) {
        if ((st = check_tensor(v, &a->history, "history", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_tensor(v, &a->prompt_lens, "prompt_lens", 1, 1, DTM(DT_I32), 0))) return st;
        if ((st = check_tensor(v, &a->penalties, "penalties", 2, 2, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(v, &a->history, "history", 0, B))) return st;
        if ((st = check_dim(v, &a->prompt_lens, "prompt_lens", 0, B))) return st;
        if ((st = check_dim(v, &a->penalties, "penalties", 0, B))) return st;
        if ((st = check_dim(v, &a->penalties, "penalties", 1, 3))) return st;
    }
    if (bids) {
        if ((st = check_tensor(v, &a->bias_ids, "bias_ids", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_tensor(v, &a->bias, "bias", 2, 2, DTM(DT_F32), 0))) return st;
        if ((st = check_dim(v, &a->bias_ids, "bias_ids", 0, B))) return st;
        if ((st = check_dim(v, &a->bias, "bias", 0, B))) return st;
        if ((st = check_dim(v, &a->bias, "bias", 1, a->bias_ids.shape[1]))) return st;
    }
    if (mask) {
        if ((st = check_tensor(v, &a->token_mask, "token_mask", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_dim(v, &a->token_mask, "token_mask", 0, B))) return st;
        if ((st = check_dim(v, &a->token_mask, "token_mask", 1, (V + 31) / 32))) return st;
    }
    if (v->query) return DI_OK;
    for (int64_t b = 0; b < B && hist; b++) {
        const int32_t pl = AT(a->prompt_lens, const int32_t, b);
        if (pl < 0 || pl > a->history.shape[1])
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "sample: prompt_lens[%lld]=%d is outside [0, L=%lld]",
                           (long long)b, pl, (long long)a->history.shape[1]);
        const float r = AT2(a->penalties, const float, b, 0), f = AT2(a->penalties, const float, b, 1),
                    p = AT2(a->penalties, const float, b, 2);
        if (!isfinite(r) || !isfinite(f) || !isfinite(p) || !(r > 0.0f))
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "sample: penalties[%lld]=[%g, %g, %g]: each must be finite "
                           "and the repetition penalty (column 0) > 0", (long long)b, r, f, p);
    }
    for (int64_t b = 0; b < B && bids; b++)
        for (int64_t n = 0; n < a->bias.shape[1]; n++) {
            const float x = AT2(a->bias, const float, b, n);
            if (isnan(x) || x == INFINITY)
                return di_fail(v->ctx, DI_INVALID_ARGUMENT, "sample: bias[%lld, %lld] is %s (finite values or -inf "
                               "only)", (long long)b, (long long)n, isnan(x) ? "NaN" : "+inf");
        }
    return DI_OK;
}

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
    if (has_controls(a)) {
        /* the adjusted row and its counts sit where spec_verify keeps its dense rows (unused here) */
        float* x = (float*)(mem + (size_t)j->V * 2 * sizeof(PI));
        memcpy(x, lg, (size_t)j->V * sizeof(float));
        if (!control_row(a, b, j->V, x, (int32_t*)(x + j->V))) {
            AT(a->out, int32_t, b) = -1;      /* every token banned: no draw */
            if (want_prob) AT(a->probs, float, b) = 0.0f;
            return;
        }
        lg = x;
    }
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
    if ((st = check_sample_controls(&v, a, B, V))) return st;
    if (query) return DI_OK;
    if ((st = check_top_k(&v, &a->top_k, B))) return st;
    if ((st = check_logit_values(&v, &a->logits, "logits", NULL))) return st;
    SampleJob j = {a, NULL, V, NULL, sample_scratch_per(V)};
    if ((rows_need_scratch(&a->temperature, &a->probs, B) || (B > 0 && has_controls(a))) &&
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
