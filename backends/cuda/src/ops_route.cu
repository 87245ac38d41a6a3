// moe_router and sample.
//
// sample sorts each row's probabilities and scans their running sum. On CUDA that is CUB's segmented
// radix sort and BlockScan. The HIP build has no CUB (Debian's HIP 5.2 ships no hipCUB/rocPRIM), so
// it uses the portable block radix sort and block scan below, which give the same order (stable,
// descending) and the same prefix sums up to double rounding. -DDI_NO_CUB selects them on CUDA too,
// so the NVIDIA device can certify the portable path (backends/hip/README.md).
#if !defined(__HIP__) && !defined(__HIP_PLATFORM_AMD__) && !defined(DI_NO_CUB)
#define DI_SAMPLE_CUB 1
#define DI_GPU_NEED_CUB
#else
#define DI_SAMPLE_CUB 0
#endif
#include "gpu_runtime.cuh"

#include "device.cuh"
#if !DI_SAMPLE_CUB
#include "sort_rows.cuh"
#endif

using namespace di;

// (value, index) order of both ops: larger value first, ties to the lower index.
__device__ __forceinline__ bool better(float v1, int i1, float v2, int i2) {
    return v1 > v2 || (v1 == v2 && i1 < i2);
}

// Block-wide best (value, index); redv and redi need MAX_WARPS elements of shared memory each.
__device__ void block_best(float& v, int& i, float* redv, int* redi) {
    const int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) {
        float v2 = shfl_xor(v, o);
        int i2 = shfl_xor(i, o);
        if (better(v2, i2, v, i)) { v = v2; i = i2; }
    }
    __syncthreads();
    if (lane == 0) { redv[w] = v; redi[w] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < nw; ++k)
            if (better(redv[k], redi[k], redv[0], redi[0])) { redv[0] = redv[k]; redi[0] = redi[k]; }
    }
    __syncthreads();
    v = redv[0];
    i = redi[0];
    __syncthreads();
}

// ---------------------------------------------------------------------------------------- moe_router
struct RouterP {
    int64_t T;
    int32_t E, K, scoring, G, topk_group, group_score, norm;
    float   rsf;
};

__global__ __launch_bounds__(256) void k_router(DTensor logits, DTensor bias, DTensor ids, DTensor wts, RouterP p) {
    extern __shared__ float sm[];
    float* scores = sm;
    float* sel = sm + p.E;
    float* gsc = sm + 2 * p.E;                   // G group scores
    int* taken = reinterpret_cast<int*>(sm + 2 * p.E + p.G);
    __shared__ float redv[MAX_WARPS];
    __shared__ int redi[MAX_WARPS];
    __shared__ int chosen[64];
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
            for (int e = threadIdx.x; e < p.E; e += blockDim.x) scores[e] = 1.f / (1.f + expf(-scores[e]));
        }
        for (int e = threadIdx.x; e < p.E; e += blockDim.x)
            sel[e] = scores[e] + (bias.base ? load_f(bias.dt, bias.base, e) : 0.f);
        __syncthreads();
        if (p.G > 1) {
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
        for (int k = 0; k < p.K; ++k) {
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
            float sum = 0.f;
            for (int k = 0; k < p.K; ++k) sum += scores[chosen[k]];
            for (int k = 0; k < p.K; ++k) {
                float w = scores[chosen[k]];
                if (p.norm) w = w / (sum + 1e-20f);
                w *= p.rsf;
                reinterpret_cast<int32_t*>(ids.base)[t * ids.strides[0] + k] = chosen[k];
                store_f(wts.dt, wts.base, t * wts.strides[0] + k, w);
            }
        }
        __syncthreads();
    }
}

DI_Status op_moe_router(DI_Context* ctx, const DI_MoERouterArgs* a, OpMode* mode) {
    const char* op = "moe_router";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MoERouterArgs"));
    QTensor lg, bias, ids, wts;
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
    if (a->scoring != DI_SCORING_SOFTMAX && a->scoring != DI_SCORING_SIGMOID)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: scoring=%d is not a known DI_Scoring", op, a->scoring);
    if (a->group_score != DI_GROUP_SCORE_MAX && a->group_score != DI_GROUP_SCORE_SUM_TOP2)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: group_score=%d is not a known DI_GroupScore", op, a->group_score);
    if (E < 1 || E > 8192)
        return set_error(ctx, E < 1 ? DI_INVALID_ARGUMENT : DI_UNIMPLEMENTED, "%s: E=%lld out of range [1, 8192]", op,
                         (long long)E);
    if (K < 1 || K > 64 || K > E)
        return set_error(ctx, K > 64 ? DI_UNIMPLEMENTED : DI_INVALID_ARGUMENT, "%s: K=%lld must be in [1, min(E, 64)]",
                         op, (long long)K);
    const int G = a->n_group < 1 ? 1 : a->n_group;
    if (a->n_group < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: n_group=%d must be >= 1", op, a->n_group);
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
    if (smem > 48 * 1024) (void)cudaFuncSetAttribute(k_router, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    k_router<<<grid_for(p.T, 1, 65535), 256, smem, (cudaStream_t)a->header.stream>>>(lg.q, bias.q, ids.q, wts.q, p);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- sample
struct SampleP {
    int64_t B, V;
};

// p = softmax(logits / temperature) per row, with the index as the sort payload.
__global__ __launch_bounds__(1024) void k_sample_probs(DTensor lg, DTensor temp, float* keys, int* vals, int* offs,
                                                       SampleP p) {
    __shared__ float red[MAX_WARPS];
    for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
        if (threadIdx.x == 0) {
            offs[b] = (int)(b * p.V);
            if (b == p.B - 1) offs[p.B] = (int)(p.B * p.V);
        }
        const float T = load_f(temp.dt, temp.base, b * temp.strides[0]);
        const int64_t ro = b * lg.strides[0];
        float* kr = keys + b * p.V;
        int* vr = vals + b * p.V;
        if (!(T > 0.f)) {  // greedy row: the sort only has to be harmless
            for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x) { kr[i] = 0.f; vr[i] = (int)i; }
            continue;
        }
        float mx = -INFINITY;
        for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x) mx = fmaxf(mx, load_f(lg.dt, lg.base, ro + i) / T);
        mx = block_max(mx, red);
        float sum = 0.f;
        for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x) {
            float e = expf(load_f(lg.dt, lg.base, ro + i) / T - mx);
            kr[i] = e;
            vr[i] = (int)i;
            sum += e;
        }
        sum = block_sum(sum, red);
        for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x) kr[i] = kr[i] / sum;
        __syncthreads();
    }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// First index i < limit (in chunks of the block) whose inclusive running sum satisfies cmp; -1 if none.
// total receives the sum over [0, limit) when nothing matched earlier.
template <class Cmp>
__device__ int64_t scan_find(const float* ps, int64_t limit, Cmp cmp, double* sum_before_out) {
#if DI_SAMPLE_CUB
    typedef cub::BlockScan<double, 1024> Scan;
    __shared__ typename Scan::TempStorage tmp;
#else
    __shared__ double scan_red[MAX_WARPS];
#endif
    __shared__ int found;
    __shared__ double carry;
    if (threadIdx.x == 0) { found = 0x7fffffff; carry = 0.0; }
    __syncthreads();
    for (int64_t c0 = 0; c0 < limit; c0 += blockDim.x) {
        int64_t i = c0 + threadIdx.x;
        double v = i < limit ? (double)ps[i] : 0.0, inc, total;
#if DI_SAMPLE_CUB
        Scan(tmp).InclusiveSum(v, inc, total);
#else
        inc = block_scan_incl(v, &total, scan_red);
#endif
        double cum = carry + inc;
        if (i < limit && cmp(cum)) atomicMin(&found, (int)threadIdx.x);
        __syncthreads();
        if (found != 0x7fffffff) {
            int64_t r = c0 + found;
            __syncthreads();
            return r;
        }
        if (threadIdx.x == 0) carry += total;
        __syncthreads();
    }
    if (sum_before_out) *sum_before_out = carry;
    return -1;
}

__global__ __launch_bounds__(1024) void k_sample_pick(DTensor lg, DTensor temp, DTensor topk, DTensor topp,
                                                      DTensor seeds, const float* ks, const int* vs, DTensor out,
                                                      SampleP p) {
    __shared__ float redv[MAX_WARPS];
    __shared__ int redi[MAX_WARPS];
    __shared__ double kept_sum;
    for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
        const float T = load_f(temp.dt, temp.base, b * temp.strides[0]);
        int32_t* o = reinterpret_cast<int32_t*>(out.base) + b * out.strides[0];
        if (!(T > 0.f)) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x) {
                float v = load_f(lg.dt, lg.base, b * lg.strides[0] + i);
                if (better(v, (int)i, bv, bi)) { bv = v; bi = (int)i; }
            }
            block_best(bv, bi, redv, redi);
            if (threadIdx.x == 0) *o = bi == 0x7fffffff ? 0 : bi;
            __syncthreads();
            continue;
        }
        const float* ps = ks + b * p.V;
        const int* is = vs + b * p.V;
        int64_t k = load_i(topk.dt, topk.base, b * topk.strides[0]);
        int64_t kk = (k > 0 && k < p.V) ? k : p.V;
        const float tp = load_f(topp.dt, topp.base, b * topp.strides[0]);
        int64_t n_keep = kk;
        {
            int64_t f = scan_find(ps, kk, [&](double cum) { return cum >= (double)tp; }, nullptr);
            if (f >= 0) n_keep = f + 1;
        }
        // sum of the kept probabilities, then the draw
        double tot = 0.0;
        scan_find(ps, n_keep, [](double) { return false; }, &tot);
        if (threadIdx.x == 0) kept_sum = tot;
        __syncthreads();
        const uint64_t seed = (uint64_t)load_i(seeds.dt, seeds.base, b * seeds.strides[0]);
        const double u = (double)(splitmix64(seed) >> 11) * (1.0 / 9007199254740992.0);
        const double target = u * kept_sum;
        int64_t f = scan_find(ps, n_keep, [&](double cum) { return cum > target; }, nullptr);
        if (f < 0) f = n_keep - 1;
        if (threadIdx.x == 0) *o = is[f];
        __syncthreads();
    }
}

#if DI_SAMPLE_CUB
static uint64_t sample_temp_bytes(int64_t B, int64_t V) {
    size_t bytes = 0;
    cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, bytes, (const float*)nullptr, (float*)nullptr,
                                                       (const int*)nullptr, (int*)nullptr, (int)(B * V), (int)B,
                                                       (const int*)nullptr, (const int*)nullptr, 0, 32, nullptr);
    return bytes;
}
#else
static uint64_t sample_temp_bytes(int64_t, int64_t) { return 0; }

__global__ __launch_bounds__(SORT_THREADS) void k_sort_rows(DTensor temp, float* k0, int* v0, float* k1, int* v1,
                                                            SampleP p) {
    for (int64_t b = blockIdx.x; b < p.B; b += gridDim.x) {
        if (!(load_f(temp.dt, temp.base, b * temp.strides[0]) > 0.f)) continue;  // greedy: no order needed
        sort_row_desc(k0 + b * p.V, v0 + b * p.V, k1 + b * p.V, v1 + b * p.V, p.V);
    }
}
#endif

DI_Status op_sample(DI_Context* ctx, const DI_SampleArgs* a, OpMode* mode) {
    const char* op = "sample";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_SampleArgs"));
    QTensor lg, temp, topk, topp, seeds, out;
    DI_TRY(take_tensor(ctx, mode, op, "logits", a->logits, 2, 0, &lg));
    DI_TRY(take_tensor(ctx, mode, op, "temperature", a->temperature, 1, 0, &temp));
    DI_TRY(take_tensor(ctx, mode, op, "top_k", a->top_k, 1, 0, &topk));
    DI_TRY(take_tensor(ctx, mode, op, "top_p", a->top_p, 1, 0, &topp));
    DI_TRY(take_tensor(ctx, mode, op, "seeds", a->seeds, 1, 0, &seeds));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 1, 0, &out));
    DI_NEED_DT(ctx, op, "logits", lg.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "temperature", temp.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "top_k", topk.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "top_p", topp.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "seeds", seeds.q.dt, DT_U64);
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_I32);
    SampleP p{lg.q.shape[0], lg.q.shape[1]};
    DI_TRY(need_shape(ctx, op, "temperature", temp.q, 0, p.B, "logits.shape[0]"));
    DI_TRY(need_shape(ctx, op, "top_k", topk.q, 0, p.B, "logits.shape[0]"));
    DI_TRY(need_shape(ctx, op, "top_p", topp.q, 0, p.B, "logits.shape[0]"));
    DI_TRY(need_shape(ctx, op, "seeds", seeds.q, 0, p.B, "logits.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, p.B, "logits.shape[0]"));
    if (p.V < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: vocabulary size V=0", op);
    if (p.B * p.V >= (1ll << 31))
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: B*V=%lld exceeds 2^31", op, (long long)(p.B * p.V));
    const uint64_t n = (uint64_t)(p.B * p.V);
    const uint64_t sort_bytes = p.B > 0 ? sample_temp_bytes(p.B, p.V) : 0;
    const uint64_t o_keys = 0, o_keys2 = align256(n * 4), o_vals = o_keys2 + align256(n * 4),
                   o_vals2 = o_vals + align256(n * 4), o_offs = o_vals2 + align256(n * 4),
                   o_tmp = o_offs + align256((uint64_t)(p.B + 1) * 4);
    mode->workspace = o_tmp + align256(sort_bytes);
    if (!mode->launch || p.B == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    char* w = static_cast<char*>(ws.ptr);
    float* keys = reinterpret_cast<float*>(w + o_keys);
    float* keys2 = reinterpret_cast<float*>(w + o_keys2);
    int* vals = reinterpret_cast<int*>(w + o_vals);
    int* vals2 = reinterpret_cast<int*>(w + o_vals2);
    int* offs = reinterpret_cast<int*>(w + o_offs);
    DI_Status st = DI_OK;
    k_sample_probs<<<grid_for(p.B, 1, 65535), 1024, 0, s>>>(lg.q, temp.q, keys, vals, offs, p);
    st = launch_status(ctx, op);
#if DI_SAMPLE_CUB
    if (st == DI_OK) {
        size_t tb = sort_bytes;
        cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
            w + o_tmp, tb, keys, keys2, vals, vals2, (int)n, (int)p.B, offs, offs + 1, 0, 32, s);
        st = cuda_status(ctx, e, "sample: segmented sort");
    }
    const float* sorted_k = keys2;
    const int* sorted_v = vals2;
#else
    if (st == DI_OK) {
        k_sort_rows<<<grid_for(p.B, 1, 65535), SORT_THREADS, 0, s>>>(temp.q, keys, vals, keys2, vals2, p);
        st = launch_status(ctx, op);
    }
    const float* sorted_k = keys;  // an even number of passes ends where it started
    const int* sorted_v = vals;
#endif
    if (st == DI_OK) {
        k_sample_pick<<<grid_for(p.B, 1, 65535), 1024, 0, s>>>(lg.q, temp.q, topk.q, topp.q, seeds.q, sorted_k,
                                                              sorted_v, out.q, p);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}
