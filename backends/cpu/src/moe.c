/* Mixture of experts: moe_router (scores, group-limited top-k, the routed weights) and moe_experts
 * (the routed experts' SwiGLU MLPs on linear.c's engine: lin_f32_multi runs every expert's product
 * in one parallel region, lin_f32_serial one expert inside a task when experts are the tasks). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>

#include "di_cpu.h"

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

/* ------------------------------------------------------------------ moe_experts */
/* The descriptor of every (token, k) pair, pe[t * K + k] (-1: the pair is skipped), and count[e]
 * (zeroed by the caller) += the pairs of descriptor e. Without expert_map a pair uses descriptor
 * topk_ids[t, k]: ids outside [0, E) are skipped, and a routed expert that is not resident is
 * FAILED_PRECONDITION. With it (1.5: an expert cache's table, model expert id -> descriptor) a pair
 * uses expert_map[id] for ids in [0, M), other ids are skipped as without a map, and an entry that
 * names no resident descriptor (< 0, >= E, data NULL) skips the pair and flags it in misses instead:
 * the cache loads the expert and runs the step again. Every pair's misses element is written. */
static DI_Status moe_route(DI_Context* ctx, const DI_MoEExpertsArgs* a, int has_map, int64_t T, int64_t K,
                           int32_t* pe, int64_t* count) {
    int E = a->num_experts;
    const int32_t* ids = (const int32_t*)t_base(&a->topk_ids);
    int64_t ids_rs = a->topk_ids.strides[0];
    const int32_t* map = has_map ? (const int32_t*)t_base(&a->expert_map) : NULL;   /* stride 1 (rank 1) */
    int64_t M = has_map ? a->expert_map.shape[0] : 0;
    for (int64_t t = 0; t < T; t++) {
        int32_t* miss = has_map ? (int32_t*)t_row(&a->misses, DT_I32, t) : NULL;
        for (int64_t k = 0; k < K; k++) {
            int32_t id = ids[t * ids_rs + k], e = -1;
            if (has_map) {
                int mapped = id >= 0 && id < M;
                if (mapped) e = map[id];
                if (e < 0 || e >= E || !a->w_gate[e].data) e = -1;   /* partial residency is refused earlier */
                miss[k] = mapped && e < 0;
            } else if (id >= 0 && id < E) {
                if (!a->w_gate[id].data)
                    return di_fail(ctx, DI_FAILED_PRECONDITION, "moe_experts: expert %d not resident (token %lld)",
                                   id, (long long)t);
                e = id;
            }
            pe[t * K + k] = e;
            if (e >= 0) count[e]++;
        }
    }
    return DI_OK;
}

/* Descriptor e's (token, k) pairs become rows [off[e], off[e] + count[e]) of the gathered buffers,
 * in token order: its routing weight (rw) and its x row (xg); prow[t * K + k] is the row of pair
 * (t, k), -1 when it is skipped (pe: moe_route's descriptors). cur: E scratch. */
static void moe_gather(const DI_MoEExpertsArgs* a, const int32_t* pe, int64_t T, int64_t K, int64_t H,
                       const int64_t* off, int64_t* cur, float* rw, float* xg, int64_t* prow) {
    int E = a->num_experts, xd = dt_id(a->x.dtype);
    const float* tw = (const float*)t_base(&a->topk_weights);
    int64_t w_rs = a->topk_weights.strides[0];
    for (int e = 0; e < E; e++) cur[e] = off[e];
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = pe[t * K + k];
            prow[t * K + k] = -1;
            if (e < 0) continue;
            int64_t r = cur[e]++;
            prow[t * K + k] = r;
            rw[r] = tw[t * w_rs + k];
            load_row(xd, t_row(&a->x, xd, t), 0, H, xg + r * H);
        }
}

/* out[t] = sum over k of rw * yb of pair (t, k) (+ out[t] when accumulating), summed in k order: the
 * result depends on the routing, never on how experts are numbered, so an expert cache that renames
 * experts to its slots computes the same bits (abi/README.md section 8). acc is [T, H] zeroed scratch */
static DI_Status moe_combine(DI_Context* ctx, const DI_MoEExpertsArgs* a, int64_t T, int64_t K, int64_t H,
                             const int64_t* prow, const float* rw, const float* yb, float* acc) {
    int od = dt_id(a->out.dtype);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t r = prow[t * K + k];
            if (r >= 0) kernels()->axpy(rw[r], yb + r * H, acc + t * H, H);
        }
    float* tmp = di_malloc((size_t)(H ? H : 1) * sizeof(float));
    if (!tmp) return DI_OOM(ctx, "moe_experts");
    for (int64_t t = 0; t < T; t++) {
        float* ar = acc + t * H;
        if (a->accumulate) {
            load_row(od, t_row(&a->out, od, t), 0, H, tmp);
            for (int64_t h = 0; h < H; h++) ar[h] += tmp[h];
        }
        store_row(od, t_row(&a->out, od, t), ar, H);
    }
    free(tmp);
    return DI_OK;
}

/* Decode: a few tokens per expert. One task per active expert runs its gate, up, SiLU and down
 * on one thread, so a layer is one parallel region and no matrix is split into tiny pieces. */
typedef struct {
    DI_Context*              ctx;
    const DI_MoEExpertsArgs* a;
    const int32_t*           act;     /* active expert ids */
    const int64_t*           off;     /* first gathered row of each expert */
    const int64_t*           count;
    const float*             xg;      /* gathered x rows [total, H] */
    float*                   yb;      /* expert outputs [total, H] */
    float*                   hb;      /* per worker: gate and up rows [2, FUSED_MAX_M, I] */
    int64_t                  H, I;
    _Atomic int              st;
} ExpertJob;

static void expert_task(void* arg, int64_t t, int worker) {
    ExpertJob* j = (ExpertJob*)arg;
    int e = j->act[t];
    int64_t n = j->count[e], H = j->H, I = j->I;
    const float* x = j->xg + j->off[e] * H;
    float* g = j->hb + (size_t)worker * 2 * FUSED_MAX_M * (size_t)I;
    float* u = g + FUSED_MAX_M * I;
    DI_Status st = lin_f32_serial(j->ctx, "moe_experts", x, H, n, &j->a->w_gate[e], g, I);
    if (!st) st = lin_f32_serial(j->ctx, "moe_experts", x, H, n, &j->a->w_up[e], u, I);
    if (!st) {
        for (int64_t i = 0; i < n * I; i++) g[i] = di_swiglu(g[i], u[i], j->a->swiglu_limit);
        st = lin_f32_serial(j->ctx, "moe_experts", g, I, n, &j->a->w_down[e], j->yb + j->off[e] * H, H);
    }
    if (st) atomic_store(&j->st, (int)st);
}

static DI_Status moe_by_expert(DI_Context* ctx, const DI_MoEExpertsArgs* a, const int32_t* pe,
                               const int64_t* count, int64_t T, int64_t H, int64_t K, int64_t I) {
    int E = a->num_experts, nw = pool_size(ctx->pool);
    int64_t total = 0, nact = 0;
    for (int e = 0; e < E; e++) { total += count[e]; nact += count[e] > 0; }
    int64_t* off = di_malloc((size_t)(E + 1) * sizeof(int64_t));
    int64_t* cur = di_malloc((size_t)(E + 1) * sizeof(int64_t));
    int32_t* act = di_malloc((size_t)(nact + 1) * sizeof(int32_t));
    float* rw = di_malloc((size_t)(total + 1) * sizeof(float));
    float* xg = di_malloc((size_t)(total * H + 1) * sizeof(float));
    float* yb = di_malloc((size_t)(total * H + 1) * sizeof(float));
    float* hb = di_malloc((size_t)nw * 2 * FUSED_MAX_M * (size_t)(I > 0 ? I : 1) * sizeof(float));
    float* acc = calloc((size_t)(T * H > 0 ? T * H : 1), sizeof(float));
    int64_t* prow = di_malloc((size_t)(T * K + 1) * sizeof(int64_t));
    DI_Status st = DI_OK;
    if (!off || !cur || !act || !rw || !xg || !yb || !hb || !acc || !prow) st = DI_OOM(ctx, "moe_experts");
    if (!st) {
        int64_t o = 0, na = 0;
        for (int e = 0; e < E; e++) {
            off[e] = o;
            o += count[e];
            if (count[e]) act[na++] = e;
        }
        moe_gather(a, pe, T, K, H, off, cur, rw, xg, prow);
        ExpertJob j = {ctx, a, act, off, count, xg, yb, hb, H, I, 0};
        pool_run(ctx->pool, nact, expert_task, &j, total * 3 * H * I);
        st = (DI_Status)atomic_load(&j.st);
    }
    if (!st) st = moe_combine(ctx, a, T, K, H, prow, rw, yb, acc);
    free(off); free(cur); free(act); free(rw); free(xg); free(yb); free(hb); free(acc); free(prow);
    return st;
}

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
    /* swiglu_limit (1.3) is 0 for an older caller (its struct ends before it) */
    if (!(a->swiglu_limit >= 0.0f) || isinf(a->swiglu_limit))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: swiglu_limit=%g, expected finite and >= 0 "
                       "(0: no clipping)", (double)a->swiglu_limit);
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
    /* expert_map and misses (1.5): both or neither; absent for an older caller (its struct ends
     * before them). misses is required so that a skipped pair never goes unnoticed. */
    int has_map = tensor_present(&v, &a->expert_map), has_misses = tensor_present(&v, &a->misses);
    if (has_map && !has_misses)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: expert_map needs misses [T, K] int32: a pair whose "
                       "expert is not resident is skipped, and misses is how the caller learns its output is "
                       "incomplete");
    if (has_misses && !has_map)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "moe_experts: misses is written only with expert_map; pass both "
                       "or neither");
    if (has_map) {
        if ((st = check_tensor(&v, &a->expert_map, "expert_map", 1, 1, DTM(DT_I32), 0))) return st;
        if ((st = check_tensor(&v, &a->misses, "misses", 2, 2, DTM(DT_I32), 0))) return st;
        if ((st = check_dim(&v, &a->misses, "misses", 0, T)) || (st = check_dim(&v, &a->misses, "misses", 1, K)))
            return st;
    }
    if (query) return DI_OK;

    /* each pair's descriptor, grouped by descriptor; residency checked (or misses written) before
     * any work. The experts' products below see only descriptors: a map that renames experts to
     * other descriptors gives every pair the same rows, so the same bits (moe_combine sums in k order) */
    int64_t* count = calloc((size_t)E + 1, sizeof(int64_t));
    int32_t* pe = di_malloc((size_t)(T * K) * sizeof(int32_t));
    if (!count || !pe) { free(count); free(pe); return DI_OOM(ctx, "moe_experts"); }
    if ((st = moe_route(ctx, a, has_map, T, K, pe, count))) { free(count); free(pe); return st; }
    int64_t maxn = 0, nact0 = 0;
    for (int e = 0; e < E; e++) {
        if (count[e] > maxn) maxn = count[e];
        nact0 += count[e] > 0;
    }
    if (maxn <= FUSED_MAX_M && nact0 >= pool_size(ctx->pool)) {
        st = moe_by_expert(ctx, a, pe, count, T, H, K, I);
        free(count); free(pe);
        return st;
    }
    /* pairs grouped by expert: expert e's rows are [off[e], off[e] + count[e]) of the gathered
     * buffers; every expert's gate and up products then run in one parallel region, and every
     * down product in a second one */
    int64_t total = 0, nact = 0;
    int64_t* off = calloc((size_t)E + 1, sizeof(int64_t));
    if (!off) { free(count); free(pe); return DI_OOM(ctx, "moe_experts"); }
    for (int e = 0; e < E; e++) {
        off[e] = total;
        total += count[e];
        nact += count[e] > 0;
    }
    int64_t Ie = I > 0 ? I : 1;
    float* acc = calloc((size_t)(T * H > 0 ? T * H : 1), sizeof(float));
    float* xg = di_malloc((size_t)(total * H) * sizeof(float));
    float* gb = di_malloc((size_t)(total * Ie) * sizeof(float));
    float* ub = di_malloc((size_t)(total * Ie) * sizeof(float));
    float* yb = di_malloc((size_t)(total * H) * sizeof(float));
    float* rw = di_malloc((size_t)(total ? total : 1) * sizeof(float));
    int64_t* cur = di_malloc((size_t)(E ? E : 1) * sizeof(int64_t));
    LinSpec* spec = di_malloc((size_t)(2 * nact + 1) * sizeof(LinSpec));
    int64_t* prow = di_malloc((size_t)(T * K + 1) * sizeof(int64_t));
    st = DI_OK;
    if (!acc || !xg || !gb || !ub || !yb || !rw || !cur || !spec || !prow) st = DI_OOM(ctx, "moe_experts");
    if (!st && total) {
        moe_gather(a, pe, T, K, H, off, cur, rw, xg, prow);
        int ns = 0;
        for (int e = 0; e < E; e++) {
            if (!count[e]) continue;
            spec[ns++] = (LinSpec){xg + off[e] * H, H, count[e], &a->w_gate[e], gb + off[e] * I, I};
            spec[ns++] = (LinSpec){xg + off[e] * H, H, count[e], &a->w_up[e], ub + off[e] * I, I};
        }
        st = lin_f32_multi(ctx, "moe_experts", spec, ns);
        if (!st) {
            for (int64_t i = 0; i < total * I; i++) gb[i] = di_swiglu(gb[i], ub[i], a->swiglu_limit);
            ns = 0;
            for (int e = 0; e < E; e++)
                if (count[e]) spec[ns++] = (LinSpec){gb + off[e] * I, I, count[e], &a->w_down[e], yb + off[e] * H, H};
            st = lin_f32_multi(ctx, "moe_experts", spec, ns);
        }
    }
    if (!st && !total)
        for (int64_t i = 0; i < T * K; i++) prow[i] = -1;   /* nothing routed: moe_gather did not run */
    if (!st) st = moe_combine(ctx, a, T, K, H, prow, rw, yb, acc);
    free(count); free(pe); free(off); free(acc); free(xg); free(gb); free(ub); free(yb); free(rw); free(cur);
    free(spec); free(prow);
    return st;
}
