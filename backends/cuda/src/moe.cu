// moe_router (scores, group-limited top-k, routed weights), and
// moe_experts: out[t] (+)= sum_k w[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, k]; with
// swiglu_limit > 0 (1.3) gate = min(gate, limit) and up = clamp(up, -limit, limit) before the product.
//
// Two paths, one contract:
//  * tensor cores (moe_mma.cuh), for bf16 activations and the weight formats the engine stores
//    (bf16, fp8 e4m3 128x128, int8 per channel, int4 / uint4 group-wise with groups of 32k):
//    moe_align groups the routed pairs by expert on the device and cuts them into work items, then
//    one gate/up kernel (SiLU * up fused, h in bf16) and one down kernel run only on the routed
//    experts, and a fixed-order combine adds the k contributions of each token.
//  * a tiled SIMT f32 fallback for everything else (f32 / f16 activations, activation-quantized x,
//    f32 / f16 / fp4 weights, shapes off the 16-row / 64-byte grid): correct for any input.
// Nothing waits for the host when every expert is resident, so a call can be captured in a graph.
// With an expert cache's table (1.5: expert_map, misses) ids are model expert ids: each is mapped to
// a descriptor on the device, and a pair whose expert is not resident is skipped and flagged in
// misses instead of failing, so such a call never waits for the host either.
// Results do not depend on scheduling: every (pair, column) is computed by exactly one thread and
// summed over k in k order.
#include <vector>

#include "device.cuh"
#include "moe_mma_api.cuh"
#include "block_best.cuh"
#include "pdl.cuh"
#include "tile_mm.cuh"

using namespace di;

// ---------------------------------------------------------------------------------------- moe_router
struct RouterP {
    int64_t T, V;   // V: rows of hash_table (hash routing, 1.3)
    int32_t E, K, scoring, G, topk_group, group_score, norm;
    float   rsf;
    int32_t hash;   // 1: topk_ids[t] = hash_table[token_ids[t]], no selection
};

// The elementwise scores (softmax's exp(v - max) / sum needs the row's reductions: each kernel has its
// own), and a pick's weight from its score and the sum of the K picked scores: one statement of each
// for k_router and k_router_warp.
__device__ __forceinline__ float router_elem_score(int scoring, float v) {
    if (scoring == DI_SCORING_SIGMOID) return 1.f / (1.f + expf(-v));
    return sqrtf(v > 20.f ? v : log1pf(expf(v)));   // sqrt(softplus(v)); softplus(v) = v above 20 (torch's threshold)
}

__device__ __forceinline__ float router_weight(const RouterP& p, float score, float sum) {
    float w = score;
    if (p.norm) w = w / (sum + 1e-20f);
    return w * p.rsf;
}

__global__ __launch_bounds__(256) void k_router(DTensor logits, DTensor bias, DTensor ids, DTensor wts, DTensor tok,
                                                DTensor table, RouterP p) {
    extern __shared__ float sm[];
    float* scores = sm;
    float* sel = sm + p.E;
    float* gsc = sm + 2 * p.E;                   // G group scores
    int* taken = reinterpret_cast<int*>(sm + 2 * p.E + p.G);
    __shared__ float redv[MAX_WARPS];
    __shared__ int redi[MAX_WARPS];
    __shared__ int chosen[64];
    __shared__ int row_ok;
    __shared__ float red[MAX_WARPS];
    for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
        float mx = -INFINITY;
        for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
            float v = load_f(logits.dt, logits.base, t * logits.strides[0] + e);
            scores[e] = v;
            mx = fmaxf(mx, v);
            taken[e] = 0;
        }
        if (p.scoring == DI_SCORING_SOFTMAX) {
            mx = block_max(mx, red);
            float sum = 0.f;
            for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
                float v = expf(scores[e] - mx);
                scores[e] = v;
                sum += v;
            }
            sum = block_sum(sum, red);
            for (int e = threadIdx.x; e < p.E; e += blockDim.x) scores[e] = scores[e] / sum;
        } else {
            for (int e = threadIdx.x; e < p.E; e += blockDim.x) scores[e] = router_elem_score(p.scoring, scores[e]);
        }
        for (int e = threadIdx.x; e < p.E; e += blockDim.x)
            sel[e] = scores[e] + (bias.base ? load_f(bias.dt, bias.base, e) : 0.f);
        __syncthreads();
        if (p.hash) {
            // The table chooses, in table order. A token id outside the table or an entry that is no
            // expert cannot be reported from here without a sync: the row gets ids -1 and weights 0.
            if (threadIdx.x == 0) {
                const int64_t id = load_i(tok.dt, tok.base, t * tok.strides[0]);
                int ok = id >= 0 && id < p.V;
                for (int k = 0; k < p.K; ++k) {
                    const int64_t e = ok ? load_i(table.dt, table.base, id * table.strides[0] + k) : -1;
                    ok = ok && e >= 0 && e < p.E;
                    chosen[k] = (int)e;
                }
                row_ok = ok;
            }
            __syncthreads();
        } else if (p.G > 1) {
            const int gs = p.E / p.G;
            for (int g = threadIdx.x; g < p.G; g += blockDim.x) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int e = g * gs; e < (g + 1) * gs; ++e) {
                    float v = sel[e];
                    if (v > b1) { b2 = b1; b1 = v; }
                    else if (v > b2) b2 = v;
                }
                gsc[g] = p.group_score == DI_GROUP_SCORE_MAX ? b1 : b1 + b2;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                // keep the topk_group best groups; mark the rest with a score of NaN-free -inf sentinel
                for (int r = 0; r < p.topk_group; ++r) {
                    int bi = -1;
                    for (int g = 0; g < p.G; ++g) {
                        if (gsc[g] != gsc[g]) continue;  // already kept (NaN marks kept)
                        if (bi < 0 || better(gsc[g], g, gsc[bi], bi)) bi = g;
                    }
                    if (bi >= 0) gsc[bi] = __uint_as_float(0x7fc00000u);
                }
            }
            __syncthreads();
            for (int e = threadIdx.x; e < p.E; e += blockDim.x) {
                float gv = gsc[e / gs];
                if (gv == gv) sel[e] = -INFINITY;  // group not kept
            }
            __syncthreads();
        }
        for (int k = 0; k < p.K && !p.hash; ++k) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int e = threadIdx.x; e < p.E; e += blockDim.x)
                if (!taken[e] && better(sel[e], e, bv, bi)) { bv = sel[e]; bi = e; }
            block_best(bv, bi, redv, redi);
            if (threadIdx.x == 0) {
                chosen[k] = bi;
                if (bi >= 0 && bi < p.E) taken[bi] = 1;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            const bool ok = !p.hash || row_ok;
            float sum = 0.f;
            for (int k = 0; k < p.K && ok; ++k) sum += scores[chosen[k]];
            for (int k = 0; k < p.K; ++k) {
                const float w = router_weight(p, ok ? scores[chosen[k]] : 0.f, sum);
                reinterpret_cast<int32_t*>(ids.base)[t * ids.strides[0] + k] = ok ? chosen[k] : -1;
                store_f(wts.dt, wts.base, t * wts.strides[0] + k, ok ? w : 0.f);
            }
        }
        __syncthreads();
    }
}

// The common case in one warp per token, without a barrier: no grouping, no hash table, E <= 256.
// Lane l holds experts l + 32 j in registers; the K picks are warp argmaxes carrying the pick's
// score. Same math and order as k_router (ties to the lower index; the k weights summed in k order).
constexpr int ROUTER_WARP_MAXE = 256;

// the default (certified on H100, 2026-12-07); DEEPINFER_CUDA_ROUTER_WARP=0 takes k_router instead
static bool router_warp_on() {
    static const bool on = env_switch_on("DEEPINFER_CUDA_ROUTER_WARP");
    return on;
}
constexpr int ROUTER_WARP_J = ROUTER_WARP_MAXE / LANES;

__global__ __launch_bounds__(128) void k_router_warp(DTensor logits, DTensor bias, DTensor ids, DTensor wts, RouterP p) {
    pdl_wait();
    pdl_trigger();
    const int lane = lane_id();
    const int64_t t = (int64_t)blockIdx.x * 4 + warp_id();
    if (t >= p.T) return;
    float sc[ROUTER_WARP_J], sel[ROUTER_WARP_J];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTER_WARP_J; ++j) {
        const int e = lane + LANES * j;
        sc[j] = e < p.E ? load_f(logits.dt, logits.base, t * logits.strides[0] + e) : -INFINITY;
        mx = fmaxf(mx, sc[j]);
    }
    if (p.scoring == DI_SCORING_SOFTMAX) {
        mx = warp_max(mx);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < ROUTER_WARP_J; ++j) {
            sc[j] = lane + LANES * j < p.E ? expf(sc[j] - mx) : 0.f;
            sum += sc[j];
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int j = 0; j < ROUTER_WARP_J; ++j) sc[j] = sc[j] / sum;
    } else {
#pragma unroll
        for (int j = 0; j < ROUTER_WARP_J; ++j) sc[j] = router_elem_score(p.scoring, sc[j]);
    }
#pragma unroll
    for (int j = 0; j < ROUTER_WARP_J; ++j) {
        const int e = lane + LANES * j;
        sel[j] = sc[j] + (bias.base && e < p.E ? load_f(bias.dt, bias.base, e) : 0.f);
    }
    uint32_t taken = 0;   // bit j: expert lane + LANES * j picked
    int chosen[64];
    float picked[64];
    float sum = 0.f;
    for (int k = 0; k < p.K; ++k) {
        float bv = -INFINITY, bs = 0.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTER_WARP_J; ++j) {
            const int e = lane + LANES * j;
            if (e < p.E && !(taken >> j & 1u) && better(sel[j], e, bv, bi)) { bv = sel[j]; bi = e; bs = sc[j]; }
        }
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) {
            const float v2 = shfl_xor(bv, o), s2 = shfl_xor(bs, o);
            const int i2 = shfl_xor(bi, o);
            if (better(v2, i2, bv, bi)) { bv = v2; bi = i2; bs = s2; }
        }
        if (bi >= 0 && bi < p.E && bi % LANES == lane) taken |= 1u << (bi / LANES);
        chosen[k] = bi;
        picked[k] = bs;
        sum += bs;
    }
    if (lane == 0) {
        for (int k = 0; k < p.K; ++k) {
            reinterpret_cast<int32_t*>(ids.base)[t * ids.strides[0] + k] = chosen[k];
            store_f(wts.dt, wts.base, t * wts.strides[0] + k, router_weight(p, picked[k], sum));
        }
    }
}

DI_Status op_moe_router(DI_Context* ctx, const DI_MoERouterArgs* a, OpMode* mode) {
    const char* op = "moe_router";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MoERouterArgs"));
    QTensor lg, bias, ids, wts, tok, table;
    DI_TRY(take_tensor(ctx, mode, op, "logits", a->logits, 2, 0, &lg));
    DI_TRY(take_tensor(ctx, mode, op, "bias", a->bias, 1, T_OPTIONAL, &bias));
    DI_TRY(take_tensor(ctx, mode, op, "topk_ids", a->topk_ids, 2, 0, &ids));
    DI_TRY(take_tensor(ctx, mode, op, "topk_weights", a->topk_weights, 2, 0, &wts));
    DI_NEED_DT(ctx, op, "logits", lg.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "topk_ids", ids.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "topk_weights", wts.q.dt, DT_F32);
    RouterP p{};
    p.T = lg.q.shape[0];
    const int64_t E = lg.q.shape[1], K = ids.q.shape[1];
    if (bias.q.base) {
        DI_NEED_DT(ctx, op, "bias", bias.q.dt, DT_F32);
        DI_TRY(need_shape(ctx, op, "bias", bias.q, 0, E, "logits.shape[1]"));
    }
    DI_TRY(need_shape(ctx, op, "topk_ids", ids.q, 0, p.T, "logits.shape[0]"));
    DI_TRY(same_shape(ctx, op, "topk_ids", ids.q, "topk_weights", wts.q));
    // hash routing (1.3): token_ids and hash_table together (both absent for an older caller: api.cu
    // zeroes the fields it does not know); present in op_query also when data is NULL but a shape is set
    const bool has_tok = a->token_ids.data || (!mode->launch && a->token_ids.ndim > 0);
    const bool has_table = a->hash_table.data || (!mode->launch && a->hash_table.ndim > 0);
    if (has_tok != has_table)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: hash routing needs token_ids and hash_table together (%s without %s)",
                         op, has_tok ? "token_ids" : "hash_table", has_tok ? "hash_table" : "token_ids");
    if (has_tok) {
        DI_TRY(take_tensor(ctx, mode, op, "token_ids", a->token_ids, 1, 0, &tok));
        DI_TRY(take_tensor(ctx, mode, op, "hash_table", a->hash_table, 2, 0, &table));
        DI_NEED_DT(ctx, op, "token_ids", tok.q.dt, DT_I32);
        DI_NEED_DT(ctx, op, "hash_table", table.q.dt, DT_I32);
        DI_TRY(need_shape(ctx, op, "token_ids", tok.q, 0, p.T, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "hash_table", table.q, 1, K, "topk_ids.shape[1]"));
        p.hash = 1;
        p.V = table.q.shape[0];
    } else {
        memset(&tok, 0, sizeof(tok));
        memset(&table, 0, sizeof(table));
    }
    if (a->scoring != DI_SCORING_SOFTMAX && a->scoring != DI_SCORING_SIGMOID && a->scoring != DI_SCORING_SQRTSOFTPLUS)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: scoring=%d is not a known DI_Scoring", op, a->scoring);
    if (a->group_score != DI_GROUP_SCORE_MAX && a->group_score != DI_GROUP_SCORE_SUM_TOP2)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: group_score=%d is not a known DI_GroupScore", op, a->group_score);
    if (E < 1 || E > 8192)
        return set_error(ctx, E < 1 ? DI_INVALID_ARGUMENT : DI_UNIMPLEMENTED, "%s: E=%lld out of range [1, 8192]", op,
                         (long long)E);
    // (a hash table may name an expert twice, so K > E is a selection's limit only)
    if (K < 1 || K > 64 || (K > E && !p.hash))
        return set_error(ctx, K > 64 ? DI_UNIMPLEMENTED : DI_INVALID_ARGUMENT, "%s: K=%lld must be in [1, min(E, 64)]",
                         op, (long long)K);
    // n_group 0 (a zero-filled struct) and 1 both mean no grouping, as in the reference
    const int G = a->n_group < 1 ? 1 : a->n_group;
    if (a->n_group < 0) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: n_group=%d is negative", op, a->n_group);
    if (E % G) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: E=%lld is not divisible by n_group=%d", op, (long long)E, G);
    if (G > 1 && (a->topk_group < 1 || a->topk_group > G))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: topk_group=%d must be in [1, n_group=%d]", op, a->topk_group, G);
    if (G > 1 && a->group_score == DI_GROUP_SCORE_SUM_TOP2 && E / G < 2)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: SUM_TOP2 needs at least 2 experts per group", op);
    p.E = (int)E;
    p.K = (int)K;
    p.scoring = a->scoring;
    p.G = G;
    p.topk_group = a->topk_group;
    p.group_score = a->group_score;
    p.norm = a->norm_topk_prob ? 1 : 0;
    p.rsf = a->routed_scaling_factor;
    const size_t smem = (size_t)(3 * E + G) * 4;
    if (smem > DYN_SMEM_MAX)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld experts need %zu bytes of shared memory, over this GPU "
                         "kernel's %zu", op, (long long)E, smem, DYN_SMEM_MAX);
    if (!mode->launch || p.T == 0) return DI_OK;
    if (!p.hash && G == 1 && E <= ROUTER_WARP_MAXE && router_warp_on()) {
        launch_pdl(k_router_warp, grid_for(p.T, 4, 1 << 30), 128, 0, (cudaStream_t)a->header.stream, lg.q, bias.q,
                   ids.q, wts.q, p);
        return launch_status(ctx, op);
    }
    if (smem > 48 * 1024) (void)cudaFuncSetAttribute(k_router, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    k_router<<<grid_for(p.T, 1, 65535), 256, smem, (cudaStream_t)a->header.stream>>>(lg.q, bias.q, ids.q, wts.q, tok.q,
                                                                                     table.q, p);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- SIMT fallback
constexpr int MOE_CHUNK = 32;        // experts per launch (their pointers travel as kernel params)
constexpr int MOE_WINDOW = 8192;     // routed pairs gathered per pass (shared memory list)

struct ExpertPtrs {
    char* q[MOE_CHUNK];
    char* s[MOE_CHUNK];
    char* z[MOE_CHUNK];
};

__device__ __forceinline__ QTensor with_ptrs(QTensor t, const ExpertPtrs& p, int i) {
    t.q.base = p.q[i];
    t.s.base = p.s[i];
    t.z.base = p.z[i];
    return t;
}

// Gathers into list the pairs p in [w0, w1) routed to expert e; returns their number.
__device__ int gather_pairs(DTensor ids, int64_t Ktop, int64_t e, int64_t w0, int64_t w1, int* list, int* cnt) {
    if (threadIdx.x == 0) *cnt = 0;
    __syncthreads();
    for (int64_t p = w0 + threadIdx.x; p < w1; p += blockDim.x) {
        int64_t t = p / Ktop, k = p % Ktop;
        if (load_i(ids.dt, ids.base, t * ids.strides[0] + k) == e) list[atomicAdd(cnt, 1)] = (int)(p - w0);
    }
    __syncthreads();
    return *cnt;
}

// Phase 1: h[p, :] = silu(gate_e x[t]) * (up_e x[t]) for every pair p = (t, k) routed to e (gate
// and up clipped first when limit > 0: V4's clipped SwiGLU, 1.3).
__global__ __launch_bounds__(256) void k_moe_up(const __grid_constant__ QTensor x, DTensor ids, const QTensor wg0, ExpertPtrs gp, const QTensor wu0,
                                                ExpertPtrs up, int e0, int64_t P, int64_t Ktop, int64_t I, int64_t H,
                                                float* h, float limit) {
    extern __shared__ int list[];
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD], Bu[TK][TB + TPAD];
    __shared__ int cnt;
    const int bi = blockIdx.x;
    if (!gp.q[bi] || !up.q[bi]) return;
    const QTensor wg = with_ptrs(wg0, gp, bi), wu = with_ptrs(wu0, up, bi);
    const int64_t e = e0 + bi, n0 = (int64_t)blockIdx.y * TB;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (int64_t w0 = 0; w0 < P; w0 += MOE_WINDOW) {
        int n = gather_pairs(ids, Ktop, e, w0, min(P, w0 + MOE_WINDOW), list, &cnt);
        for (int j0 = 0; j0 < n; j0 += TB) {
            float ag[4][4] = {}, au[4][4] = {};
            for (int64_t k0 = 0; k0 < H; k0 += TK) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int idx = tid + 256 * i, r = idx / TK, kk = idx % TK;
                    int64_t k = k0 + kk;
                    bool kin = k < H;
                    int64_t t = j0 + r < n ? (w0 + list[j0 + r]) / Ktop : -1;
                    As[kk][r] = (kin && t >= 0) ? qload(x, 0, t, k) : 0.f;
                    bool nin = kin && n0 + r < I;
                    Bs[kk][r] = nin ? qload(wg, 0, n0 + r, k) : 0.f;
                    Bu[kk][r] = nin ? qload(wu, 0, n0 + r, k) : 0.f;
                }
                __syncthreads();
#pragma unroll
                for (int kk = 0; kk < TK; ++kk) {
                    float av[4], gv[4], uv[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i];
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) {
                        gv[jj] = Bs[kk][tx * 4 + jj];
                        uv[jj] = Bu[kk][tx * 4 + jj];
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i)
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj) {
                            ag[i][jj] += av[i] * gv[jj];
                            au[i][jj] += av[i] * uv[jj];
                        }
                }
                __syncthreads();
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = ty * 4 + i;
                if (j0 + r >= n) continue;
                int64_t p = w0 + list[j0 + r];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    int64_t c = n0 + tx * 4 + jj;
                    if (c >= I) continue;
                    float g = ag[i][jj], u = au[i][jj];
                    if (limit > 0.f) {
                        g = fminf(g, limit);
                        u = fminf(fmaxf(u, -limit), limit);
                    }
                    h[p * I + c] = g / (1.f + expf(-g)) * u;
                }
            }
        }
        __syncthreads();
    }
}

// Phase 2: y[p, :] = down_e h[p, :].
__global__ __launch_bounds__(256) void k_moe_down(const float* h, DTensor ids, QTensor wd0, ExpertPtrs dp, int e0,
                                                  int64_t P, int64_t Ktop, int64_t I, int64_t H, float* y) {
    extern __shared__ int list[];
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD];
    __shared__ int cnt;
    const int bi = blockIdx.x;
    if (!dp.q[bi]) return;
    const QTensor wd = with_ptrs(wd0, dp, bi);
    const int64_t e = e0 + bi, n0 = (int64_t)blockIdx.y * TB;
    for (int64_t w0 = 0; w0 < P; w0 += MOE_WINDOW) {
        int n = gather_pairs(ids, Ktop, e, w0, min(P, w0 + MOE_WINDOW), list, &cnt);
        for (int j0 = 0; j0 < n; j0 += TB) {
            float acc[4][4] = {};
            auto la = [&](int r, int64_t k) {
                return j0 + r < n ? h[(w0 + list[j0 + r]) * I + k] : 0.f;
            };
            auto lb = [&](int r, int64_t k) { return n0 + r < H ? qload(wd, 0, n0 + r, k) : 0.f; };
            tile_mm(la, lb, I, acc, As, Bs);
            const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = ty * 4 + i;
                if (j0 + r >= n) continue;
                int64_t p = w0 + list[j0 + r];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    int64_t c = n0 + tx * 4 + jj;
                    if (c < H) y[p * H + c] = acc[i][jj];
                }
            }
        }
        __syncthreads();
    }
}

// The direct plan of one token's decode (moe_mma_api.cuh) is the default; DEEPINFER_CUDA_MOE_DIRECT=0 runs
// moe_align and moe_combine instead (the same bits)
[[maybe_unused]] static bool moe_direct_on() {
    static const bool on = env_switch_on("DEEPINFER_CUDA_MOE_DIRECT");
    return on;
}

// ---------------------------------------------------------------------------------------- routing plan
// Groups the pairs routed to resident experts by expert: sorted[] (expert-major), one work item per
// BN pairs of an expert, pair_ok[p] for the combine. One block: E <= MOE_MAX_E <= blockDim.
constexpr int ALIGN_THREADS = 1024;

// 1.5: an expert cache's table. map == NULL: ids name descriptors directly.
struct ExpertMap {
    const int32_t* map;   // [M] model expert id -> descriptor (< 0: not resident)
    int64_t M;
    int32_t* misses;      // [T, K] with row stride ms: 1 = the pair was skipped, its expert not resident
    int64_t ms;
};

// The descriptor pair p uses (-1: none); *miss = its id named an expert of the map that is not resident.
__device__ __forceinline__ int64_t pair_expert(DTensor ids, int64_t p, int64_t Ktop, const ExpertMap& m,
                                               bool* inside) {
    const int64_t id = load_i(ids.dt, ids.base, (p / Ktop) * ids.strides[0] + p % Ktop);
    if (!m.map) {
        *inside = false;
        return id;
    }
    *inside = id >= 0 && id < m.M;
    return *inside ? (int64_t)m.map[id] : -1;
}

__global__ __launch_bounds__(ALIGN_THREADS) void k_moe_align(DTensor ids, int64_t T, int Ktop, int E, ResidentMask res,
                                                            ExpertMap emap, int BN, int max_items, int* sorted,
                                                            int4* items, int* n_items, uint8_t* pair_ok) {
    __shared__ int cnt[MOE_MAX_E], fill[MOE_MAX_E], off[MOE_MAX_E], ioff[MOE_MAX_E];
    __shared__ int scan_red[MAX_WARPS];
    pdl_wait();
    pdl_trigger();
    const int tid = threadIdx.x;
    const int64_t P = T * Ktop;
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = fill[e] = 0;
    __syncthreads();
    for (int64_t p = tid; p < P; p += blockDim.x) {
        bool inside;
        const int64_t e = pair_expert(ids, p, Ktop, emap, &inside);
        const bool ok = res.has(e, E);
        pair_ok[p] = ok;
        if (ok) atomicAdd(&cnt[e], 1);
        if (emap.map) emap.misses[(p / Ktop) * emap.ms + p % Ktop] = inside && !ok;
    }
    __syncthreads();
    // exclusive scans of the pair counts and of the items per expert (thread e holds expert e)
    const int v = tid < E ? cnt[tid] : 0, it = (v + BN - 1) / BN;
    int total_v, total_i;
    const int sv = block_scan_incl(v, &total_v, scan_red);
    const int si = block_scan_incl(it, &total_i, scan_red);
    if (tid < E) {
        off[tid] = sv - v;
        ioff[tid] = si - it;
        for (int i = 0; i < it; ++i) {
            const int j = ioff[tid] + i;
            if (j < max_items) items[j] = make_int4(tid, off[tid] + i * BN, min(BN, v - i * BN), 0);
        }
    }
    if (tid == 0) *n_items = min(total_i, max_items);
    __syncthreads();
    for (int64_t p = tid; p < P; p += blockDim.x) {
        if (!pair_ok[p]) continue;
        bool inside;
        const int e = (int)pair_expert(ids, p, Ktop, emap, &inside);
        sorted[off[e] + atomicAdd(&fill[e], 1)] = (int)p;
    }
}

// ---------------------------------------------------------------------------------------- combine
// out[t] (+)= sum_k w[t, k] * y[t*K + k] over the pairs that ran, in k order. ok: per pair
// (per_pair) or per expert.
__global__ void k_moe_combine(const float* y, DTensor ids, DTensor tw, const uint8_t* ok, int per_pair, int64_t E,
                              int64_t T, int64_t Ktop, int64_t H, DTensor out, int accumulate) {
    pdl_wait();
    pdl_trigger();
    int64_t n = T * H;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / H, c = i % H;
        float acc = 0.f;
        for (int64_t k = 0; k < Ktop; ++k) {
            if (per_pair) {
                if (!ok[t * Ktop + k]) continue;
            } else {
                int64_t e = load_i(ids.dt, ids.base, t * ids.strides[0] + k);
                if (e < 0 || e >= E || !ok[e]) continue;
            }
            acc += load_f(tw.dt, tw.base, t * tw.strides[0] + k) * y[(t * Ktop + k) * H + c];
        }
        int64_t o = t * out.strides[0] + c;
        if (accumulate) acc += load_f(out.dt, out.base, o);
        store_f(out.dt, out.base, o, acc);
    }
}

// SIMT path with a map: ids translated to descriptors once (-1: skipped), misses written.
__global__ void k_moe_map_ids(DTensor ids, int64_t P, int64_t Ktop, int64_t E, const uint8_t* resident, ExpertMap m,
                              int32_t* mapped) {
    for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < P; p += (int64_t)gridDim.x * blockDim.x) {
        bool inside;
        const int64_t e = pair_expert(ids, p, Ktop, m, &inside);
        const bool ok = e >= 0 && e < E && resident[e];
        mapped[p] = ok ? (int32_t)e : -1;
        m.misses[(p / Ktop) * m.ms + p % Ktop] = inside && !ok;
    }
}

// ---------------------------------------------------------------------------------------- host side
static bool same_layout(const DI_Tensor& a, const DI_Tensor& b) {
    if (a.ndim != b.ndim || a.dtype.code != b.dtype.code || a.dtype.bits != b.dtype.bits) return false;
    for (int d = 0; d < a.ndim; ++d)
        if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
    if (!a.quant != !b.quant) return false;
    if (a.quant) {
        const DI_Quant &p = *a.quant, &q = *b.quant;
        if (p.block_rows != q.block_rows || p.block_cols != q.block_cols) return false;
        if (!same_layout(p.scales, q.scales)) return false;
        if (!p.zeros.data != !q.zeros.data) return false;
        if (p.zeros.data && !same_layout(p.zeros, q.zeros)) return false;
    }
    return true;
}

// The tensor-core format of a weight family [N, K] (every expert shares w's layout), or -1.
int di::mma_format(const QTensor& w) {
    const int64_t N = w.q.shape[0], K = w.q.shape[1];
    int f = -1;
    if (w.mode == 0 && w.q.dt == DT_BF16) f = MW_BF16;
    else if (w.mode == 1 && w.q.dt == DT_E4M3 && w.br == 128 && w.bc == 128) f = MW_FP8;
    else if (w.mode == 1 && w.q.dt == DT_I8 && w.br == 1 && w.bc == K) f = MW_I8;
    // int4: the widest k-step that divides both the group and K (g128 with K = 10944: 64-column steps)
    else if (w.mode == 1 && w.q.dt == DT_I4 && w.br == 1 && w.bc % 128 == 0 && K % 128 == 0) f = MW_I4;
    else if (w.mode == 1 && w.q.dt == DT_I4 && w.br == 1 && w.bc % 64 == 0 && K % 64 == 0) f = MW_I4G64;
    else if (w.mode == 1 && w.q.dt == DT_I4 && w.br == 1 && w.bc % 32 == 0) f = MW_I4G32;
    else if (w.mode == 2 && w.q.dt == DT_U4 && w.br == 1 && w.bc % 32 == 0 && w.z.dt != DT_E4M3) f = MW_U4;
    if (f < 0) return -1;
    if (N <= 0 || K <= 0 || N % 16 != 0 || K % moe_kstep_cols(f) != 0) return -1;
    return f;
}

int64_t di::row_bytes(const QTensor& w) {
    const int dt = w.q.dt;
    if (dt_is_packed(dt)) return w.q.strides[0] / 2;
    return w.q.strides[0] * (dt == DT_BF16 || dt == DT_F16 ? 2 : dt == DT_F32 ? 4 : 1);
}

MoeMat di::mat_of(const QTensor& w) {
    MoeMat m{};
    m.N = w.q.shape[0];
    m.K = w.q.shape[1];
    m.ld = row_bytes(w);
    m.s_dt = w.s.dt;
    m.z_dt = w.z.dt;
    if (w.mode) { m.s_rs = w.s.strides[0]; m.s_cs = w.s.strides[1]; }
    if (w.mode == 2) { m.z_rs = w.z.strides[0]; m.z_cs = w.z.strides[1]; }
    m.br = (int32_t)w.br;
    m.bc = (int32_t)w.bc;
    m.bc_shift = -1;
    for (int b = 0; b < 31; ++b)
        if ((int64_t(1) << b) == w.bc) m.bc_shift = b;
    return m;
}

namespace {

struct ExpertBases {
    char *q, *s, *z;
};

// Validated view of one call.
struct Call {
    QTensor x, ids, tw, out;
    int64_t T, H, Ktop, E, I;
    std::vector<uint8_t> resident;
    std::vector<ExpertBases> ptrs[3];   // gate, up, down of every resident expert
    int64_t n_resident = 0, first = -1;
    QTensor map{}, miss{};              // 1.5: expert_map [M] and misses [T, K] (mapped only)
    bool mapped = false;
};

ExpertMap map_of(const Call& c) {
    ExpertMap m{};
    if (!c.mapped) return m;
    m.map = reinterpret_cast<const int32_t*>(c.map.q.base);
    m.M = c.map.q.shape[0];
    m.misses = reinterpret_cast<int32_t*>(c.miss.q.base);
    m.ms = c.miss.q.strides[0];
    return m;
}

// One expert weight: validated under a fixed name first; the indexed name is formatted only for the
// message of a failure (formatting hundreds of names per call was most of the op's host time).
DI_Status take_expert(DI_Context* ctx, const OpMode* em, const char* which, int64_t e, const DI_Tensor& t,
                      QTensor* v) {
    if (take_tensor(ctx, em, "moe_experts", which, t, 2, T_ALLOW_Q, v) == DI_OK &&
        check_weight(ctx, "moe_experts", which, *v) == DI_OK)
        return DI_OK;
    char name[64];
    snprintf(name, sizeof(name), "%s[%lld]", which, (long long)e);
    DI_TRY(take_tensor(ctx, em, "moe_experts", name, t, 2, T_ALLOW_Q, v));
    return check_weight(ctx, "moe_experts", name, *v);
}

// aligned16 and fill_ptrs serve the tensor-core path only (unused where DI_HAVE_MOE_MMA is 0)
[[maybe_unused]] bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

typedef void (*GateUpFn)(MoeShape, int, const MoeMat&, const MoePtrs&, const MoeMat&, const MoePtrs&, MoePlan,
                         const char*, int64_t, int, float, uint16_t*, cudaStream_t);
typedef void (*DownFn)(MoeShape, int, const MoeMat&, const MoePtrs&, MoePlan, const uint16_t*, float*, cudaStream_t);

#if DI_HAVE_MOE_MMA
const GateUpFn kGateUp[MW_COUNT] = {launch_moe_gate_up_bf16, launch_moe_gate_up_fp8, launch_moe_gate_up_i8,
                                    launch_moe_gate_up_i4, launch_moe_gate_up_i4g64, launch_moe_gate_up_i4g32,
                                    launch_moe_gate_up_u4};
const DownFn kDown[MW_COUNT] = {launch_moe_down_bf16, launch_moe_down_fp8, launch_moe_down_i8,
                                launch_moe_down_i4, launch_moe_down_i4g64, launch_moe_down_i4g32,
                                launch_moe_down_u4};
#endif

// The plan of the tensor-core path, or fast = false with the reason (for debugging; the fallback
// is always correct).
struct MmaPlan {
    bool fast = false;
    int fg = -1, fd = -1;
    MoeMat mg{}, md{};  // gate's layout (up's is the same, same_layout checked) and down's
    MoeShape shape = MOE_DECODE;
    int bn = 8, max_items = 0;
};

MmaPlan plan_mma(DI_Context* ctx, const DI_MoEExpertsArgs* a, const Call& c, const OpMode* em) {
    MmaPlan pl;
#if DI_HAVE_MOE_MMA
    if (c.E > MOE_MAX_E || c.n_resident == 0 || c.x.mode != 0 || c.x.q.dt != DT_BF16) return pl;
    if (!aligned16(c.x.q.base) && em->launch) return pl;
    if ((c.x.q.strides[0] * 2) % 16 != 0) return pl;
    const int64_t e0 = c.first;
    for (int64_t e = 0; e < c.E; ++e) {
        if (!c.resident[(size_t)e]) continue;
        if (!same_layout(a->w_gate[e], a->w_gate[e0]) || !same_layout(a->w_up[e], a->w_gate[e0]) ||
            !same_layout(a->w_down[e], a->w_down[e0]))
            return pl;
        if (em->launch && (!aligned16(a->w_gate[e].data) || !aligned16(a->w_up[e].data) ||
                           !aligned16(a->w_down[e].data) || a->w_gate[e].byte_offset % 16 ||
                           a->w_up[e].byte_offset % 16 || a->w_down[e].byte_offset % 16))
            return pl;
    }
    QTensor g, d;
    if (take_tensor(ctx, em, "moe_experts", "w_gate", a->w_gate[e0], 2, T_ALLOW_Q, &g) != DI_OK) return pl;
    if (take_tensor(ctx, em, "moe_experts", "w_down", a->w_down[e0], 2, T_ALLOW_Q, &d) != DI_OK) return pl;
    pl.fg = mma_format(g);
    pl.fd = mma_format(d);
    if (pl.fg < 0 || pl.fd < 0 || row_bytes(g) % 16 || row_bytes(d) % 16) return pl;
    pl.mg = mat_of(g);
    pl.md = mat_of(d);
    const int64_t P = c.T * c.Ktop;
    if (P == 0) return pl;  // top-k of 0: nothing to route (the fallback writes the zeros / keeps out)
    const int64_t active = P < c.n_resident ? P : c.n_resident;
    // prefill shape once an expert gets 16 tokens on average
    pl.shape = active > 0 && P >= 16 * active ? MOE_PREFILL : MOE_DECODE;
    if (pl.shape == MOE_PREFILL && (moe_needs_narrow_prefill(pl.fg) || moe_needs_narrow_prefill(pl.fd)))
        pl.shape = MOE_PREFILL_NARROW;
    pl.bn = moe_tokens_per_item(pl.shape);
    const int64_t mi = active + P / pl.bn;
    if (mi > 65535) return pl;
    pl.max_items = (int)mi;
    pl.fast = true;
#endif
    return pl;
}

uint64_t mma_workspace(const Call& c, const MmaPlan& pl) {
    const uint64_t P = (uint64_t)(c.T * c.Ktop);
    return align256(P * c.I * 2) + align256(P * c.H * 4) + align256(P * 4) + align256((uint64_t)pl.max_items * 16) +
           align256(P) + align256((uint64_t)ceil_div(c.H, MOE_DOWN_DECODE_ROWS) * 4) + 256;
}

uint64_t simt_workspace(const Call& c) {
    const uint64_t P = (uint64_t)(c.T * c.Ktop);
    return align256(P * (uint64_t)c.I * 4) + align256(P * (uint64_t)c.H * 4) + align256((uint64_t)c.E) +
           (c.mapped ? align256(P * 4) : 0);
}

[[maybe_unused]] void fill_ptrs(const std::vector<ExpertBases>& b, const Call& c, MoePtrs* p) {
    memset(p, 0, sizeof(*p));
    for (int64_t e = 0; e < c.E; ++e) {
        if (!c.resident[(size_t)e]) continue;
        p->q[e] = b[(size_t)e].q;
        p->s[e] = b[(size_t)e].s;
        p->z[e] = b[(size_t)e].z;
    }
}

DI_Status run_mma(DI_Context* ctx, const DI_MoEExpertsArgs* a, const Call& c, const MmaPlan& pl, char* ws,
                  cudaStream_t s) {
#if DI_HAVE_MOE_MMA
    const char* op = "moe_experts";
    const int64_t P = c.T * c.Ktop;
    uint16_t* h = reinterpret_cast<uint16_t*>(ws);
    ws += align256((uint64_t)P * c.I * 2);
    float* y = reinterpret_cast<float*>(ws);
    ws += align256((uint64_t)P * c.H * 4);
    int* sorted = reinterpret_cast<int*>(ws);
    ws += align256((uint64_t)P * 4);
    int4* items = reinterpret_cast<int4*>(ws);
    ws += align256((uint64_t)pl.max_items * 16);
    uint8_t* pair_ok = reinterpret_cast<uint8_t*>(ws);
    ws += align256((uint64_t)P);
    int* tile_cnt = reinterpret_cast<int*>(ws);
    ws += align256((uint64_t)ceil_div(c.H, MOE_DOWN_DECODE_ROWS) * 4);
    int* n_items = reinterpret_cast<int*>(ws);

    ResidentMask res{};
    for (int64_t e = 0; e < c.E; ++e)
        if (c.resident[(size_t)e]) res.w[e >> 5] |= 1u << (e & 31);
    MoePlan plan{};
    plan.sorted = sorted;
    plan.items = items;
    plan.n_items = n_items;
    // one token without an expert map: the direct plan (moe_mma_api.cuh), two launches instead of four
    const bool direct = pl.shape == MOE_DECODE && c.T == 1 && !c.mapped && moe_direct_on();
    if (direct) {
        plan.direct = 1;
        plan.E = (int)c.E;
        plan.Ktop = (int)c.Ktop;
        plan.accumulate = a->accumulate ? 1 : 0;
        plan.n_tiles = (int)ceil_div(c.H, MOE_DOWN_DECODE_ROWS);
        plan.tile_cnt = tile_cnt;
        plan.ids = c.ids.q;
        plan.tw = c.tw.q;
        plan.out = c.out.q;
        plan.res = res;
    } else {
        launch_pdl(k_moe_align, 1, ALIGN_THREADS, 0, s, c.ids.q, c.T, (int)c.Ktop, (int)c.E, res, map_of(c), pl.bn,
                   pl.max_items, sorted, items, n_items, pair_ok);
        DI_TRY(launch_status(ctx, op));
    }
    const int n_items_max = direct ? (int)P : pl.max_items;
    // the pointer tables travel by value in the launches (static: 18 KB is too much for the stack
    // of a host thread that calls in from a small-stack runtime; one op at a time per thread)
    static thread_local MoePtrs pg, pu, pd;
    fill_ptrs(c.ptrs[0], c, &pg);
    fill_ptrs(c.ptrs[1], c, &pu);
    fill_ptrs(c.ptrs[2], c, &pd);
    kGateUp[pl.fg](pl.shape, n_items_max, pl.mg, pg, pl.mg, pu, plan, c.x.q.base, c.x.q.strides[0] * 2,
                   (int)c.Ktop, a->swiglu_limit, h, s);
    DI_TRY(launch_status(ctx, op));
    kDown[pl.fd](pl.shape, n_items_max, pl.md, pd, plan, h, y, s);
    DI_TRY(launch_status(ctx, op));
    if (direct) return DI_OK;
    launch_pdl(k_moe_combine, grid_for(c.T * c.H, 256), 256, 0, s, (const float*)y, c.ids.q, c.tw.q,
               (const uint8_t*)pair_ok, 1, c.E, c.T, c.Ktop, c.H, c.out.q, a->accumulate ? 1 : 0);
    return launch_status(ctx, op);
#else
    return set_error(ctx, DI_INTERNAL, "moe_experts: tensor-core path not built");
#endif
}

DI_Status run_simt(DI_Context* ctx, const DI_MoEExpertsArgs* a, const Call& c, const OpMode* em, char* wsb,
                   cudaStream_t s) {
    const char* op = "moe_experts";
    const int64_t T = c.T, H = c.H, Ktop = c.Ktop, E = c.E, I = c.I, P = T * Ktop;
    float* h = reinterpret_cast<float*>(wsb);
    float* y = reinterpret_cast<float*>(wsb + align256((uint64_t)P * I * 4));
    uint8_t* res_dev = reinterpret_cast<uint8_t*>(wsb + align256((uint64_t)P * I * 4) + align256((uint64_t)P * H * 4));
    DI_Status st = DI_OK;
    if (E > 0) {
        // resident flags travel through a stream-ordered set of tiny memsets (capturable, no host buffer)
        st = cuda_status(ctx, cudaMemsetAsync(res_dev, 0, (size_t)E, s), "moe_experts: cudaMemsetAsync");
        for (int64_t e = 0; e < E && st == DI_OK; ) {
            if (!c.resident[(size_t)e]) { ++e; continue; }
            int64_t e1 = e;
            while (e1 < E && c.resident[(size_t)e1]) ++e1;
            st = cuda_status(ctx, cudaMemsetAsync(res_dev + e, 1, (size_t)(e1 - e), s), "moe_experts: cudaMemsetAsync");
            e = e1;
        }
    }
    DTensor ids = c.ids.q;
    if (st == DI_OK && c.mapped && P > 0) {
        // the kernels below read descriptor ids: translate once (non-resident pairs become -1)
        int32_t* mapped = reinterpret_cast<int32_t*>(res_dev + align256((uint64_t)E));
        k_moe_map_ids<<<grid_for(P, 256), 256, 0, s>>>(c.ids.q, P, Ktop, E, res_dev, map_of(c), mapped);
        st = launch_status(ctx, op);
        ids.base = reinterpret_cast<char*>(mapped);
        ids.dt = DT_I32;
        ids.strides[0] = Ktop;
        ids.strides[1] = 1;
    }
    const size_t list_bytes = MOE_WINDOW * sizeof(int);
    if (st == DI_OK && P > 0 && I > 0 && H > 0) {
        (void)cudaFuncSetAttribute(k_moe_up, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)list_bytes);
        (void)cudaFuncSetAttribute(k_moe_down, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)list_bytes);
        // Groups of up to MOE_CHUNK consecutive experts that share one layout go in one launch.
        for (int phase = 0; phase < 2 && st == DI_OK; ++phase) {
            int64_t e = 0;
            while (e < E && st == DI_OK) {
                if (!c.resident[(size_t)e]) { ++e; continue; }
                const int64_t e0 = e;
                ExpertPtrs p1{}, p2{};
                QTensor t1, t2;
                const DI_Tensor* w1 = phase == 0 ? &a->w_gate[e0] : &a->w_down[e0];
                DI_TRY(take_tensor(ctx, em, op, "w", *w1, 2, T_ALLOW_Q, &t1));
                if (phase == 0) DI_TRY(take_tensor(ctx, em, op, "w_up", a->w_up[e0], 2, T_ALLOW_Q, &t2));
                int64_t cnt = 0;
                while (e < E && cnt < MOE_CHUNK) {
                    if (c.resident[(size_t)e]) {
                        const DI_Tensor* we = phase == 0 ? &a->w_gate[e] : &a->w_down[e];
                        if (!same_layout(*we, *w1)) break;
                        if (phase == 0 && !same_layout(a->w_up[e], a->w_up[e0])) break;
                        QTensor te;
                        DI_TRY(take_tensor(ctx, em, op, "w", *we, 2, T_ALLOW_Q, &te));
                        p1.q[cnt] = te.q.base; p1.s[cnt] = te.s.base; p1.z[cnt] = te.z.base;
                        if (phase == 0) {
                            DI_TRY(take_tensor(ctx, em, op, "w_up", a->w_up[e], 2, T_ALLOW_Q, &te));
                            p2.q[cnt] = te.q.base; p2.s[cnt] = te.s.base; p2.z[cnt] = te.z.base;
                        }
                    }
                    ++cnt;
                    ++e;
                }
                if (phase == 0) {
                    dim3 grid((unsigned)cnt, (unsigned)ceil_div(I, TB));
                    k_moe_up<<<grid, 256, list_bytes, s>>>(c.x, ids, t1, p1, t2, p2, (int)e0, P, Ktop, I, H, h,
                                                           a->swiglu_limit);
                } else {
                    dim3 grid((unsigned)cnt, (unsigned)ceil_div(H, TB));
                    k_moe_down<<<grid, 256, list_bytes, s>>>(h, ids, t1, p1, (int)e0, P, Ktop, I, H, y);
                }
                st = launch_status(ctx, op);
            }
        }
    }
    if (st == DI_OK && (P == 0 || I == 0))  // nothing routed anywhere: y is all zero
        st = cuda_status(ctx, cudaMemsetAsync(y, 0, (size_t)P * H * 4, s), "moe_experts: cudaMemsetAsync");
    if (st == DI_OK && T * H > 0) {
        k_moe_combine<<<grid_for(T * H, 256), 256, 0, s>>>(y, ids, c.tw.q, res_dev, 0, E, T, Ktop, H, c.out.q,
                                                           a->accumulate ? 1 : 0);
        st = launch_status(ctx, op);
    }
    return st;
}

}  // namespace

DI_Status op_moe_experts(DI_Context* ctx, const DI_MoEExpertsArgs* a, OpMode* mode) {
    const char* op = "moe_experts";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MoEExpertsArgs"));
    Call c;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, T_ALLOW_Q, &c.x));
    DI_TRY(take_tensor(ctx, mode, op, "topk_ids", a->topk_ids, 2, 0, &c.ids));
    DI_TRY(take_tensor(ctx, mode, op, "topk_weights", a->topk_weights, 2, 0, &c.tw));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &c.out));
    if (c.x.mode == 0) DI_NEED_DT(ctx, op, "x", c.x.q.dt, DT_F32, DT_BF16);
    else DI_NEED_DT(ctx, op, "x (activation-quantized)", c.x.q.dt, DT_I8, DT_E4M3);
    DI_NEED_DT(ctx, op, "topk_ids", c.ids.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "topk_weights", c.tw.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "out", c.out.q.dt, DT_F32, DT_BF16);
    c.T = c.x.q.shape[0];
    c.H = c.x.q.shape[1];
    c.Ktop = c.ids.q.shape[1];
    c.E = a->num_experts;
    const int64_t T = c.T, H = c.H, Ktop = c.Ktop, E = c.E;
    DI_TRY(need_shape(ctx, op, "topk_ids", c.ids.q, 0, T, "x.shape[0]"));
    DI_TRY(same_shape(ctx, op, "topk_ids", c.ids.q, "topk_weights", c.tw.q));
    DI_TRY(same_shape(ctx, op, "x", c.x.q, "out", c.out.q));
    if (E < 0) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: num_experts=%lld is negative", op, (long long)E);
    // swiglu_limit (1.3; zero for an older caller: api.cu zeroes the fields it does not know)
    if (!(isfinite(a->swiglu_limit) && a->swiglu_limit >= 0.f))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: swiglu_limit=%g must be finite and >= 0 (0 = no clipping)", op,
                         a->swiglu_limit);
    // expert_map and misses (1.5): absent for an older caller (api.cu zeroes what it does not know);
    // in op_query a descriptor with a shape counts as present
    const bool has_map = a->expert_map.data || (!mode->launch && a->expert_map.ndim > 0);
    const bool has_miss = a->misses.data || (!mode->launch && a->misses.ndim > 0);
    if (has_map != has_miss)
        return set_error(ctx, DI_INVALID_ARGUMENT,
                         has_map ? "%s: expert_map needs misses [T, K] int32: a pair whose expert is not resident is "
                                   "skipped, and misses is how the caller learns its output is incomplete"
                                 : "%s: misses is written only with expert_map; pass both or neither",
                         op);
    if (has_map) {
        DI_TRY(take_tensor(ctx, mode, op, "expert_map", a->expert_map, 1, 0, &c.map));
        DI_NEED_DT(ctx, op, "expert_map", c.map.q.dt, DT_I32);
        DI_TRY(take_tensor(ctx, mode, op, "misses", a->misses, 2, 0, &c.miss));
        DI_NEED_DT(ctx, op, "misses", c.miss.q.dt, DT_I32);
        DI_TRY(same_shape(ctx, op, "misses", c.miss.q, "topk_ids", c.ids.q));
        if (c.map.q.strides[0] != 1)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: expert_map must be contiguous (stride %lld)", op,
                             (long long)c.map.q.strides[0]);
        if (c.miss.q.shape[1] > 1 && c.miss.q.strides[1] != 1)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: misses rows must be contiguous (column stride %lld)", op,
                             (long long)c.miss.q.strides[1]);
        c.mapped = true;
    }
    if (E > 0 && (!a->w_gate || !a->w_up || !a->w_down))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: w_gate, w_up and w_down must point to num_experts descriptors", op);
    // Validate every resident expert (in query mode: every one that has a shape).
    OpMode em = *mode;  // expert weights: hundreds of descriptors, no per-pointer driver lookups
    em.check_ptrs = false;
    c.resident.assign((size_t)E, 0);
    for (auto& p : c.ptrs) p.assign((size_t)E, ExpertBases{});
    int64_t I = -1;
    for (int64_t e = 0; e < E; ++e) {
        const DI_Tensor *g = &a->w_gate[e], *u = &a->w_up[e], *d = &a->w_down[e];
        bool here = mode->launch ? (g->data && u->data && d->data) : (g->ndim == 2 && u->ndim == 2 && d->ndim == 2);
        if (mode->launch && !here && (g->data || u->data || d->data))
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: expert %lld is partly resident (some of gate/up/down NULL)",
                             op, (long long)e);
        if (!here) continue;
        QTensor tg, tu, td;
        DI_TRY(take_expert(ctx, &em, "w_gate", e, *g, &tg));
        DI_TRY(take_expert(ctx, &em, "w_up", e, *u, &tu));
        DI_TRY(take_expert(ctx, &em, "w_down", e, *d, &td));
        c.ptrs[0][(size_t)e] = {tg.q.base, tg.s.base, tg.z.base};
        c.ptrs[1][(size_t)e] = {tu.q.base, tu.s.base, tu.z.base};
        c.ptrs[2][(size_t)e] = {td.q.base, td.s.base, td.z.base};
        if (I < 0) I = tg.q.shape[0];
        if (tg.q.shape[0] != I || tu.q.shape[0] != I || td.q.shape[1] != I || tg.q.shape[1] != H ||
            tu.q.shape[1] != H || td.q.shape[0] != H)
            return set_error(ctx, DI_INVALID_ARGUMENT,
                             "%s: expert %lld has gate %lldx%lld, up %lldx%lld, down %lldx%lld; expected [I, %lld], "
                             "[I, %lld], [%lld, I] with one I for all experts",
                             op, (long long)e, (long long)tg.q.shape[0], (long long)tg.q.shape[1],
                             (long long)tu.q.shape[0], (long long)tu.q.shape[1], (long long)td.q.shape[0],
                             (long long)td.q.shape[1], (long long)H, (long long)H, (long long)H);
        c.resident[(size_t)e] = 1;
        c.n_resident++;
        if (c.first < 0) c.first = e;
    }
    c.I = I < 0 ? 0 : I;
    const int64_t P = T * Ktop;
    const MmaPlan pl = plan_mma(ctx, a, c, &em);
    clear_error(ctx);  // plan_mma only probes; a refusal there is not an error of the call
    mode->workspace = pl.fast ? mma_workspace(c, pl) : simt_workspace(c);
    if (!mode->launch || T == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;

    // A token routed to a non-resident expert is an error the caller must see; checking needs the
    // ids on the host, so only calls that have non-resident experts pay for that round trip. Calls
    // with every expert resident never wait for the host (and are capturable).
    if (c.n_resident < E && P > 0 && !c.mapped) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        DI_TRY(cuda_status(ctx, cudaStreamIsCapturing(s, &cs), "moe_experts: cudaStreamIsCapturing"));
        if (cs == cudaStreamCaptureStatusNone) {
            int bytes = c.ids.q.dt == DT_I64 ? 8 : 4;
            std::vector<char> host((size_t)(T * Ktop * bytes));
            DI_TRY(cuda_status(ctx,
                               cudaMemcpy2DAsync(host.data(), Ktop * bytes, c.ids.q.base, c.ids.q.strides[0] * bytes,
                                                 Ktop * bytes, T, cudaMemcpyDeviceToHost, s),
                               "moe_experts: reading topk_ids"));
            DI_TRY(cuda_status(ctx, cudaStreamSynchronize(s), "moe_experts: reading topk_ids"));
            for (int64_t p = 0; p < P; ++p) {
                int64_t e = bytes == 8 ? reinterpret_cast<int64_t*>(host.data())[p]
                                       : reinterpret_cast<int32_t*>(host.data())[p];
                if (e >= 0 && e < E && !c.resident[(size_t)e])
                    return set_error(ctx, DI_FAILED_PRECONDITION, "%s: expert %lld not resident (token %lld, k %lld)",
                                     op, (long long)e, (long long)(p / Ktop), (long long)(p % Ktop));
            }
        }
        // while capturing the check cannot run; non-resident experts then contribute nothing
    }

    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    char* wsb = static_cast<char*>(ws.ptr);
    DI_Status st = pl.fast ? run_mma(ctx, a, c, pl, wsb, s) : run_simt(ctx, a, c, &em, wsb, s);
    ws.release();
    return st;
}
