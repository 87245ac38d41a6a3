// sample and spec_verify.
//
// sample sorts each row's probabilities and scans their running sum; spec_verify does the same for
// the target's rows and the draft's (both through the row functions of sample_rows.cuh). On CUDA that is CUB's segmented
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
#include "sample_rows.cuh"
#if !DI_SAMPLE_CUB
#include "sort_rows.cuh"
#endif

using namespace di;

// ---------------------------------------------------------------------------------------- sample
// The row bodies (sample_rows.cuh) in grid-stride loops, one block per row.
__global__ __launch_bounds__(1024) void k_sample_probs(DTensor lg, DTensor lg2, DTensor temp, float* keys, int* vals,
                                                       int* offs, SampleP p) {
    __shared__ float red[MAX_WARPS];
    for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) probs_row(lg, lg2, temp, keys, vals, offs, p, r, red);
}

// 1.7's controls: row r's adjusted logits into adj (+ r * V), dead[r] = 1 where no token is left.
__global__ __launch_bounds__(1024) void k_sample_controls(DTensor lg, SampleControls c, float* adj, int* cnt,
                                                          int* dead, int64_t B, int64_t V) {
    __shared__ int flag;
    for (int64_t r = blockIdx.x; r < B; r += gridDim.x) {
        const int left = control_row(lg, r * lg.strides[0], c, r, V, adj + r * V, cnt ? cnt + r * V : nullptr, &flag);
        if (threadIdx.x == 0) dead[r] = !left;
    }
}

__global__ __launch_bounds__(1024) void k_sample_pick(DTensor lg, DTensor temp, DTensor topk, DTensor topp,
                                                      DTensor seeds, const float* ks, const int* vs, DTensor out,
                                                      DTensor probs, SampleP p) {
    for (int64_t b = blockIdx.x; b < p.R; b += gridDim.x)
        sample_pick_row(lg, temp, topk, topp, seeds, ks, vs, out, probs, p, b);
}

__global__ __launch_bounds__(1024) void k_verify_pick(DTensor lg, DTensor ids, DTensor temp, DTensor topk,
                                                      DTensor topp, DTensor seeds, const float* ks, const int* vs,
                                                      float* dense, DTensor out, DTensor acc, int has_draft,
                                                      SampleP p) {
    for (int64_t t = blockIdx.x; t < p.nt; t += gridDim.x)
        verify_pick_row(lg, ids, temp, topk, topp, seeds, ks, vs, dense, out, acc, has_draft, p, t);
}

#if DI_SAMPLE_CUB
static uint64_t sample_temp_bytes(int64_t R, int64_t V) {
    size_t bytes = 0;
    cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, bytes, (const float*)nullptr, (float*)nullptr,
                                                       (const int*)nullptr, (int*)nullptr, (int)(R * V), (int)R,
                                                       (const int*)nullptr, (const int*)nullptr, 0, 32, nullptr);
    return bytes;
}
#else
static uint64_t sample_temp_bytes(int64_t, int64_t) { return 0; }

__global__ __launch_bounds__(SORT_THREADS) void k_sort_rows(DTensor temp, float* k0, int* v0, float* k1, int* v1,
                                                            SampleP p) {
    for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) {
        if (!(load_f(temp.dt, temp.base, (r % p.nt) * temp.strides[0]) > 0.f)) continue;  // greedy: no order needed
        sort_row_desc(k0 + r * p.V, v0 + r * p.V, k1 + r * p.V, v1 + r * p.V, p.V);
    }
}
#endif

// The workspace of R sorted rows of V: keys, values, their sort buffers, the segment offsets, the
// sort's scratch, then `extra` bytes for the op.
struct SortLayout {
    uint64_t keys, keys2, vals, vals2, offs, tmp, extra, total;
    SortLayout(int64_t R, int64_t V, uint64_t extra_bytes) {
        const uint64_t n = (uint64_t)(R * V);
        keys = 0;
        keys2 = align256(n * 4);
        vals = keys2 + align256(n * 4);
        vals2 = vals + align256(n * 4);
        offs = vals2 + align256(n * 4);
        tmp = offs + align256((uint64_t)(2 * R) * 4);   // begin[R], end[R]
        extra = tmp + align256(R > 0 ? sample_temp_bytes(R, V) : 0);
        total = extra + align256(extra_bytes);
    }
};

// softmax and sort of p.R rows into the workspace w; *sk, *sv: where the sorted rows end up.
static DI_Status sort_rows(DI_Context* ctx, const char* op, cudaStream_t s, const DTensor& lg, const DTensor& lg2,
                           const DTensor& temp, char* w, const SortLayout& L, const SampleP& p, const float** sk,
                           const int** sv) {
    float* keys = reinterpret_cast<float*>(w + L.keys);
    float* keys2 = reinterpret_cast<float*>(w + L.keys2);
    int* vals = reinterpret_cast<int*>(w + L.vals);
    int* vals2 = reinterpret_cast<int*>(w + L.vals2);
    int* offs = reinterpret_cast<int*>(w + L.offs);
    k_sample_probs<<<grid_for(p.R, 1, 65535), 1024, 0, s>>>(lg, lg2, temp, keys, vals, offs, p);
    DI_TRY(launch_status(ctx, op));
#if DI_SAMPLE_CUB
    size_t tb = (size_t)(L.extra - L.tmp);
    cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
        w + L.tmp, tb, keys, keys2, vals, vals2, (int)(p.R * p.V), (int)p.R, offs, offs + p.R, 0, 32, s);
    DI_TRY(cuda_status(ctx, e, "segmented sort"));
    *sk = keys2;
    *sv = vals2;
#else
    k_sort_rows<<<grid_for(p.R, 1, 65535), SORT_THREADS, 0, s>>>(temp, keys, vals, keys2, vals2, p);
    DI_TRY(launch_status(ctx, op));
    *sk = keys;  // an even number of passes ends where it started
    *sv = vals;
#endif
    return DI_OK;
}

// the per-row controls of sample and spec_verify: dtypes and shapes against n rows
static DI_Status take_controls(DI_Context* ctx, OpMode* mode, const char* op, const DI_Tensor& t_temp,
                               const DI_Tensor& t_topk, const DI_Tensor& t_topp, const DI_Tensor& t_seeds, int64_t n,
                               QTensor* temp, QTensor* topk, QTensor* topp, QTensor* seeds) {
    DI_TRY(take_tensor(ctx, mode, op, "temperature", t_temp, 1, 0, temp));
    DI_TRY(take_tensor(ctx, mode, op, "top_k", t_topk, 1, 0, topk));
    DI_TRY(take_tensor(ctx, mode, op, "top_p", t_topp, 1, 0, topp));
    DI_TRY(take_tensor(ctx, mode, op, "seeds", t_seeds, 1, 0, seeds));
    DI_NEED_DT(ctx, op, "temperature", temp->q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "top_k", topk->q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "top_p", topp->q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "seeds", seeds->q.dt, DT_U64);
    DI_TRY(need_shape(ctx, op, "temperature", temp->q, 0, n, "logits.shape[0]"));
    DI_TRY(need_shape(ctx, op, "top_k", topk->q, 0, n, "logits.shape[0]"));
    DI_TRY(need_shape(ctx, op, "top_p", topp->q, 0, n, "logits.shape[0]"));
    return need_shape(ctx, op, "seeds", seeds->q, 0, n, "logits.shape[0]");
}

// whether the caller passed an optional tensor (op_query: data may be NULL, ndim says)
static bool given(const DI_Tensor& t) { return t.data != nullptr || t.ndim > 0; }

// whether the caller passed any of 1.7's controls
static bool has_sample_controls(const DI_SampleArgs* a) {
    return given(a->history) || given(a->prompt_lens) || given(a->penalties) || given(a->bias_ids) ||
           given(a->bias) || given(a->token_mask);
}

// a contiguous [R, V] f32 matrix at p
static DTensor dense_rows(float* p, int64_t R, int64_t V) {
    DTensor t;
    memset(&t, 0, sizeof t);
    t.base = reinterpret_cast<char*>(p);
    t.dt = DT_F32;
    t.ndim = 2;
    t.shape[0] = R;
    t.shape[1] = V;
    t.strides[0] = V;
    t.strides[1] = 1;
    return t;
}

// 1.7's controls: each group all present or all absent, dtypes and shapes against B rows and V. The
// values are not inspected (a device library does not read them on the host).
static DI_Status take_sample_controls(DI_Context* ctx, OpMode* mode, const DI_SampleArgs* a, int64_t B, int64_t V,
                                      SampleControls* c) {
    const char* op = "sample";
    QTensor h, pl, pen, ids, bias, mask;
    DI_TRY(take_tensor(ctx, mode, op, "history", a->history, 2, T_OPTIONAL, &h));
    DI_TRY(take_tensor(ctx, mode, op, "prompt_lens", a->prompt_lens, 1, T_OPTIONAL, &pl));
    DI_TRY(take_tensor(ctx, mode, op, "penalties", a->penalties, 2, T_OPTIONAL, &pen));
    DI_TRY(take_tensor(ctx, mode, op, "bias_ids", a->bias_ids, 2, T_OPTIONAL, &ids));
    DI_TRY(take_tensor(ctx, mode, op, "bias", a->bias, 2, T_OPTIONAL, &bias));
    DI_TRY(take_tensor(ctx, mode, op, "token_mask", a->token_mask, 2, T_OPTIONAL, &mask));
    const bool gh = given(a->history), gp = given(a->prompt_lens), gn = given(a->penalties);
    if (gh != gp || gh != gn)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: history, prompt_lens and penalties go together (all present "
                         "or all absent)", op);
    if (given(a->bias_ids) != given(a->bias))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: bias_ids and bias go together (both present or both absent)",
                         op);
    memset(c, 0, sizeof *c);
    if (gh) {
        DI_NEED_DT(ctx, op, "history", h.q.dt, DT_I32);
        DI_NEED_DT(ctx, op, "prompt_lens", pl.q.dt, DT_I32);
        DI_NEED_DT(ctx, op, "penalties", pen.q.dt, DT_F32);
        DI_TRY(need_shape(ctx, op, "history", h.q, 0, B, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "prompt_lens", pl.q, 0, B, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "penalties", pen.q, 0, B, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "penalties", pen.q, 1, 3, "3 (repetition, frequency, presence)"));
        c->hist = h.q;
        c->plen = pl.q;
        c->pen = pen.q;
    }
    if (given(a->bias_ids)) {
        DI_NEED_DT(ctx, op, "bias_ids", ids.q.dt, DT_I32);
        DI_NEED_DT(ctx, op, "bias", bias.q.dt, DT_F32);
        DI_TRY(need_shape(ctx, op, "bias_ids", ids.q, 0, B, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "bias", bias.q, 0, B, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "bias", bias.q, 1, ids.q.shape[1], "bias_ids.shape[1]"));
        c->bids = ids.q;
        c->bias = bias.q;
    }
    if (given(a->token_mask)) {
        DI_NEED_DT(ctx, op, "token_mask", mask.q.dt, DT_I32);
        DI_TRY(need_shape(ctx, op, "token_mask", mask.q, 0, B, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "token_mask", mask.q, 1, (V + 31) / 32, "ceil(V / 32)"));
        c->mask = mask.q;
    }
    return DI_OK;
}

DI_Status op_sample(DI_Context* ctx, const DI_SampleArgs* a, OpMode* mode) {
    const char* op = "sample";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_SampleArgs"));
    QTensor lg, temp, topk, topp, seeds, out, probs;
    DI_TRY(take_tensor(ctx, mode, op, "logits", a->logits, 2, 0, &lg));
    DI_NEED_DT(ctx, op, "logits", lg.q.dt, DT_F32);
    const int64_t B = lg.q.shape[0], V = lg.q.shape[1];
    DI_TRY(take_controls(ctx, mode, op, a->temperature, a->top_k, a->top_p, a->seeds, B, &temp, &topk, &topp,
                         &seeds));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 1, 0, &out));
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_I32);
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, B, "logits.shape[0]"));
    // probs (1.2): absent when data is NULL (always, for a 1.1 caller: api.cu zeroes what it does not know)
    DI_TRY(take_tensor(ctx, mode, op, "probs", a->probs, 1, T_OPTIONAL, &probs));
    if (given(a->probs)) {
        DI_NEED_DT(ctx, op, "probs", probs.q.dt, DT_F32);
        DI_TRY(need_shape(ctx, op, "probs", probs.q, 0, B, "logits.shape[0]"));
    }
    if (V < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: vocabulary size V=0", op);
    if (B * V >= (1ll << 31))
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: B*V=%lld exceeds 2^31", op, (long long)(B * V));
    SampleControls c;
    DI_TRY(take_sample_controls(ctx, mode, a, B, V, &c));
    const bool controlled = has_sample_controls(a);
    // with controls: the adjusted rows, the history's counts (with a history) and dead[B] after the sort's
    const uint64_t adj_bytes = align256((uint64_t)(B * V) * 4),
                   cnt_bytes = given(a->history) ? align256((uint64_t)(B * V) * 4) : 0;
    const SortLayout L(B, V, controlled ? adj_bytes + cnt_bytes + (uint64_t)B * 4 : 0);
    mode->workspace = L.total;
    if (!mode->launch || B == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    char* w = static_cast<char*>(ws.ptr);
    SampleP p{B, V, B};
    DTensor rows = lg.q;
    DI_Status st = DI_OK;
    if (controlled) {
        float* adj = reinterpret_cast<float*>(w + L.extra);
        int* cnt = cnt_bytes ? reinterpret_cast<int*>(w + L.extra + adj_bytes) : nullptr;
        int* dead = reinterpret_cast<int*>(w + L.extra + adj_bytes + cnt_bytes);
        k_sample_controls<<<grid_for(B, 1, 65535), 1024, 0, s>>>(lg.q, c, adj, cnt, dead, B, V);
        st = launch_status(ctx, op);
        rows = dense_rows(adj, B, V);
        p.dead = dead;
    }
    const float* sk = nullptr;
    const int* sv = nullptr;
    if (st == DI_OK) st = sort_rows(ctx, op, s, rows, rows, temp.q, w, L, p, &sk, &sv);
    if (st == DI_OK) {
        k_sample_pick<<<grid_for(B, 1, 65535), 1024, 0, s>>>(rows, temp.q, topk.q, topp.q, seeds.q, sk, sv, out.q,
                                                             probs.q, p);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}

DI_Status op_spec_verify(DI_Context* ctx, const DI_SpecVerifyArgs* a, OpMode* mode) {
    const char* op = "spec_verify";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_SpecVerifyArgs"));
    QTensor lg, dlg, ids, temp, topk, topp, seeds, out, acc;
    DI_TRY(take_tensor(ctx, mode, op, "logits", a->logits, 2, 0, &lg));
    DI_NEED_DT(ctx, op, "logits", lg.q.dt, DT_F32);
    const int64_t T = lg.q.shape[0], V = lg.q.shape[1];
    DI_TRY(take_tensor(ctx, mode, op, "draft_logits", a->draft_logits, 2, T_OPTIONAL, &dlg));
    const bool has_draft = given(a->draft_logits);
    if (has_draft) {
        DI_NEED_DT(ctx, op, "draft_logits", dlg.q.dt, DT_F32);
        DI_TRY(need_shape(ctx, op, "draft_logits", dlg.q, 0, T, "logits.shape[0]"));
        DI_TRY(need_shape(ctx, op, "draft_logits", dlg.q, 1, V, "logits.shape[1]"));
    }
    DI_TRY(take_tensor(ctx, mode, op, "draft_ids", a->draft_ids, 1, 0, &ids));
    DI_NEED_DT(ctx, op, "draft_ids", ids.q.dt, DT_I32);
    DI_TRY(need_shape(ctx, op, "draft_ids", ids.q, 0, T, "logits.shape[0]"));
    DI_TRY(take_controls(ctx, mode, op, a->temperature, a->top_k, a->top_p, a->seeds, T, &temp, &topk, &topp,
                         &seeds));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 1, 0, &out));
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_I32);
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, T, "logits.shape[0]"));
    DI_TRY(take_tensor(ctx, mode, op, "accepted", a->accepted, 1, 0, &acc));
    DI_NEED_DT(ctx, op, "accepted", acc.q.dt, DT_I32);
    DI_TRY(need_shape(ctx, op, "accepted", acc.q, 0, T, "logits.shape[0]"));
    if (V < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: vocabulary size V=0", op);
    const int64_t R = has_draft ? 2 * T : T;
    if (R * V >= (1ll << 31))
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld sorted rows of V=%lld exceed 2^31 elements", op,
                         (long long)R, (long long)V);
    const SampleP p{R, V, T};
    const SortLayout L(R, V, (uint64_t)(R * V) * sizeof(float));   // + the dense p (and q) rows
    mode->workspace = L.total;
    if (!mode->launch || T == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    char* w = static_cast<char*>(ws.ptr);
    const float* sk = nullptr;
    const int* sv = nullptr;
    DI_Status st = sort_rows(ctx, op, s, lg.q, has_draft ? dlg.q : lg.q, temp.q, w, L, p, &sk, &sv);
    if (st == DI_OK) {
        k_verify_pick<<<grid_for(T, 1, 65535), 1024, 0, s>>>(lg.q, ids.q, temp.q, topk.q, topp.q, seeds.q, sk, sv,
                                                             reinterpret_cast<float*>(w + L.extra), out.q, acc.q,
                                                             has_draft ? 1 : 0, p);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}
