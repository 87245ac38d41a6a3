// The ABI 1.3 ops of DeepSeek V4 and V3.2: hc_pre, hc_post, kv_compress, indexer_topk,
// sparse_attention and layernorm (abi/README.md section 8), and the index cleaning mla_decode shares.
// Host side only: validation, workspace, launches. The kernels are in v4_kernels.cuh (see there for
// their designs), where tests/gpu_emu runs them on the CPU.
//
// Everything goes onto the args' stream; no op reads a device value on the host, synchronizes or
// allocates beyond the Workspace contract of common.cuh, so each is capturable in a graph.
#include <math.h>

#include "v4_api.cuh"
#include "v4_kernels.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

namespace {

bool is_pow2(int64_t v) { return v >= 1 && (v & (v - 1)) == 0; }

// An optional argument: present when its data is set (in op_query also when it has a shape, since
// a query may leave data NULL); a present one is checked like a required one.
DI_Status take_opt(DI_Context* ctx, const OpMode* mode, const char* op, const char* name, const DI_Tensor& t, int ndim,
                   QTensor* v, bool* present) {
    *present = t.data != nullptr || (!mode->launch && t.ndim > 0);
    if (!*present) {
        memset(v, 0, sizeof(*v));
        return DI_OK;
    }
    return take_tensor(ctx, mode, op, name, t, ndim, 0, v);
}

DI_Status need_pow2(DI_Context* ctx, const char* op, const char* what, int64_t v) {
    if (is_pow2(v)) return DI_OK;
    return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s=%lld must be a power of two", op, what, (long long)v);
}

DI_Status need_finite(DI_Context* ctx, const char* op, const char* what, float v, bool nonneg) {
    if (isfinite(v) && (!nonneg || v >= 0.f)) return DI_OK;
    return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s=%g must be finite%s", op, what, v, nonneg ? " and >= 0" : "");
}

// [first byte, last byte + 1) that a view can touch (empty when a dimension is 0).
bool byte_span(const DTensor& t, uintptr_t* lo, uintptr_t* hi) {
    int64_t ext = 0;
    for (int d = 0; d < t.ndim; ++d) {
        if (t.shape[d] == 0) return false;
        ext += (t.shape[d] - 1) * t.strides[d];
    }
    const int64_t bits = dt_bits(t.dt);
    *lo = reinterpret_cast<uintptr_t>(t.base);
    *hi = *lo + (uintptr_t)(((ext + 1) * bits + 7) / 8);
    return true;
}

bool overlap(const DTensor& a, const DTensor& b) {
    uintptr_t alo, ahi, blo, bhi;
    if (!a.base || !b.base || !byte_span(a, &alo, &ahi) || !byte_span(b, &blo, &bhi)) return false;
    return alo < bhi && blo < ahi;
}

int64_t sm_count(const DI_Context* ctx) { return ctx->sm_count > 0 ? ctx->sm_count : 132; }

// dynamic shared memory above the default 48 KB must be asked for, per kernel
template <class K>
void allow_smem(K kernel, size_t bytes) {
    if (bytes > 48 * 1024) (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

}  // namespace

// ---------------------------------------------------------------------------------------- indices
int64_t di::clean_indices_max_k() {
    int64_t p = 1;   // the sort works on a power of two of 8-byte words in one block's shared memory
    while (p * 2 * 8 <= (int64_t)DYN_SMEM_MAX) p *= 2;
    return p;
}

uint64_t di::clean_indices_bytes(int64_t T, int64_t K) {
    return align256((uint64_t)(T * K) * 4) + align256((uint64_t)T * 4);
}

DI_Status di::launch_clean_indices(DI_Context* ctx, const char* op, const DTensor& idx, const DTensor& seq,
                                   const DTensor& kvl, int64_t S, int64_t cap, int ratio, char* ws, cudaStream_t s) {
    const int64_t T = idx.shape[0], K = idx.shape[1];
    int* list = reinterpret_cast<int*>(ws);
    int* cnt = reinterpret_cast<int*>(ws + align256((uint64_t)(T * K) * 4));
    if (T == 0) return DI_OK;
    if (K == 0) return cuda_status(ctx, cudaMemsetAsync(cnt, 0, (size_t)T * 4, s), "cleaning indices: cudaMemsetAsync");
    const CleanDims d{T, K, S, cap, ratio, pow2_at_least(K)};
    const size_t smem = (size_t)d.P * 8;
    allow_smem(k_clean_indices, smem);
    const int threads = (int)min64(1024, max64(LANES, d.P));
    k_clean_indices<<<grid_for(T, 1, 65535), threads, smem, s>>>(idx, seq, kvl, list, cnt, d);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- hc_pre
DI_Status op_hc_pre(DI_Context* ctx, const DI_HCPreArgs* a, OpMode* mode) {
    const char* op = "hc_pre";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_HCPreArgs"));
    QTensor x, fn, base, scale, out, post, comb;
    bool has_post, has_comb;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 3, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "fn", a->fn, 2, 0, &fn));
    DI_TRY(take_tensor(ctx, mode, op, "base", a->base, 1, 0, &base));
    DI_TRY(take_tensor(ctx, mode, op, "scale", a->scale, 1, 0, &scale));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_TRY(take_opt(ctx, mode, op, "post", a->post, 2, &post, &has_post));
    DI_TRY(take_opt(ctx, mode, op, "comb", a->comb, 3, &comb, &has_comb));
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "fn", fn.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "base", base.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "scale", scale.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    if (has_post) DI_NEED_DT(ctx, op, "post", post.q.dt, DT_F32);
    if (has_comb) DI_NEED_DT(ctx, op, "comb", comb.q.dt, DT_F32);
    const int64_t T = x.q.shape[0], N = x.q.shape[1], H = x.q.shape[2], M = fn.q.shape[0];
    if (N < 1 || H < 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: x.shape=[%lld, %lld, %lld] needs a stream and a feature", op,
                         (long long)T, (long long)N, (long long)H);
    DI_TRY(need_shape(ctx, op, "fn", fn.q, 1, N * H, "N * H"));
    const bool block = M == (2 + N) * N;
    if (!block && M != N)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: fn.shape[0]=%lld must be (2 + N) * N = %lld or N = %lld", op,
                         (long long)M, (long long)((2 + N) * N), (long long)N);
    DI_TRY(need_shape(ctx, op, "base", base.q, 0, M, "fn.shape[0]"));
    DI_TRY(need_shape(ctx, op, "scale", scale.q, 0, block ? 3 : 1, block ? "3 (a block)" : "1 (the head)"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, T, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, H, "x.shape[2]"));
    if (block) {
        if (!has_post || !has_comb)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s is required when fn.shape[0] = (2 + N) * N", op,
                             has_post ? "comb" : "post");
        DI_TRY(need_shape(ctx, op, "post", post.q, 0, T, "x.shape[0]"));
        DI_TRY(need_shape(ctx, op, "post", post.q, 1, N, "N"));
        DI_TRY(need_shape(ctx, op, "comb", comb.q, 0, T, "x.shape[0]"));
        DI_TRY(need_shape(ctx, op, "comb", comb.q, 1, N, "N"));
        DI_TRY(need_shape(ctx, op, "comb", comb.q, 2, N, "N"));
        if (a->sinkhorn_iters < 1)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: sinkhorn_iters=%d must be >= 1", op, a->sinkhorn_iters);
    } else if (has_post || has_comb) {
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s must be absent when fn.shape[0] = N (the head: pre only)", op,
                         has_post ? "post" : "comb");
    }
    DI_TRY(need_finite(ctx, op, "eps", a->eps, true));
    DI_TRY(need_finite(ctx, op, "hc_eps", a->hc_eps, true));
    if (N > HC_MAX_N)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld streams; this kernel takes at most %d", op, (long long)N,
                         HC_MAX_N);
    // Splits of the flattened row: enough blocks for two waves however few tokens there are, each
    // split at least 1024 columns (4 per thread) so that the partial sums stay a small part.
    HcDims d{};
    d.T = T;
    d.H = H;
    d.NH = N * H;
    d.N = (int)N;
    d.M = (int)M;
    d.iters = a->sinkhorn_iters;
    d.eps = a->eps;
    d.hc_eps = a->hc_eps;
    // 4 tokens a block share each fn load; a single token (decode at batch 1) takes the 1-token variant,
    // which reduces a quarter of the partial sums
    const int TT = M <= 24 && T > 1 ? 4 : 1;
    const int64_t tb = ceil_div(T, TT);
    int64_t splits = ceil_div(2 * sm_count(ctx), max64(tb, 1));
    splits = max64(1, min64(splits, min64(65535, ceil_div(d.NH, 1024))));
    d.chunk = ceil_div(d.NH, splits);
    d.splits = (int)ceil_div(d.NH, d.chunk);
    mode->workspace = align256((uint64_t)T * d.splits * (M + 1) * 4);
    if (!mode->launch || T == 0) return DI_OK;
    if (tb > (1ll << 31) - 1) return set_error(ctx, DI_UNIMPLEMENTED, "%s: T=%lld too large", op, (long long)T);
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    float* part = static_cast<float*>(ws.ptr);
    const dim3 grid((unsigned)tb, (unsigned)d.splits);
    if (TT == 4) k_hc_mix<24, 4><<<grid, HC_THREADS, 0, s>>>(x.q, fn.q, part, d);
    else if (M <= 24) k_hc_mix<24, 1><<<grid, HC_THREADS, 0, s>>>(x.q, fn.q, part, d);
    else k_hc_mix<(2 + HC_MAX_N) * HC_MAX_N, 1><<<grid, HC_THREADS, 0, s>>>(x.q, fn.q, part, d);
    DI_Status st = launch_status(ctx, op);
    if (st == DI_OK) {
        const unsigned g = grid_for(T, 1, 65535);
        switch (d.N) {
#define DI_HC_FINISH(n) \
    case n: k_hc_finish<n><<<g, HC_THREADS, 0, s>>>(x.q, base.q, scale.q, part, out.q, post.q, comb.q, d); break;
            DI_HC_STREAMS(DI_HC_FINISH)
#undef DI_HC_FINISH
            default: break;   // N <= HC_MAX_N was checked
        }
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}

// ---------------------------------------------------------------------------------------- hc_post
DI_Status op_hc_post(DI_Context* ctx, const DI_HCPostArgs* a, OpMode* mode) {
    const char* op = "hc_post";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_HCPostArgs"));
    QTensor x, y, post, comb, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 3, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "y", a->y, 2, 0, &y));
    DI_TRY(take_tensor(ctx, mode, op, "post", a->post, 2, 0, &post));
    DI_TRY(take_tensor(ctx, mode, op, "comb", a->comb, 3, 0, &comb));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 3, 0, &out));
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "y", y.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "post", post.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "comb", comb.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    const int64_t T = x.q.shape[0], N = x.q.shape[1], H = x.q.shape[2];
    DI_TRY(need_shape(ctx, op, "y", y.q, 0, T, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "y", y.q, 1, H, "x.shape[2]"));
    DI_TRY(need_shape(ctx, op, "post", post.q, 0, T, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "post", post.q, 1, N, "x.shape[1]"));
    DI_TRY(need_shape(ctx, op, "comb", comb.q, 0, T, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "comb", comb.q, 1, N, "x.shape[1]"));
    DI_TRY(need_shape(ctx, op, "comb", comb.q, 2, N, "x.shape[1]"));
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    // every output stream reads every input stream of its feature: writing in place would clobber
    // x[t, j, h] before the other streams read it
    if (overlap(x.q, out.q)) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out overlaps x", op);
    if (N > HC_MAX_N)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld streams; this kernel takes at most %d", op, (long long)N,
                         HC_MAX_N);
    if (!mode->launch || T * N * H == 0) return DI_OK;
    const int64_t hchunks = ceil_div(H, 256);
    k_hc_post<<<grid_for(T * hchunks, 1, 1 << 20), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, y.q, post.q, comb.q,
                                                                                          out.q, T, H, (int)N, hchunks);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- kv_compress
DI_Status op_kv_compress(DI_Context* ctx, const DI_KVCompressArgs* a, OpMode* mode) {
    const char* op = "kv_compress";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_KVCompressArgs"));
    QTensor st, pb, btab, seq, pos, out;
    DI_TRY(take_tensor(ctx, mode, op, "staged", a->staged, 3, 0, &st));
    DI_TRY(take_tensor(ctx, mode, op, "position_bias", a->position_bias, 2, 0, &pb));
    DI_TRY(take_tensor(ctx, mode, op, "block_table", a->block_table, 2, 0, &btab));
    DI_TRY(take_tensor(ctx, mode, op, "token_seq", a->token_seq, 1, 0, &seq));
    DI_TRY(take_tensor(ctx, mode, op, "positions", a->positions, 1, 0, &pos));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "staged", st.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "position_bias", pb.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "block_table", btab.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "token_seq", seq.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "positions", pos.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    CompressDims d{};
    d.NB = st.q.shape[0];
    d.BS = st.q.shape[1];
    d.S = btab.q.shape[0];
    d.T = pos.q.shape[0];
    const int64_t W2 = st.q.shape[2];
    DI_TRY(need_pow2(ctx, op, "ratio", a->ratio));
    DI_TRY(need_pow2(ctx, op, "staged.shape[1] (the block size)", d.BS));
    if (a->overlap != 0 && a->overlap != 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: overlap=%d must be 0 or 1", op, a->overlap);
    if (W2 % 2)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: staged.shape[2]=%lld must be even (W values, W gate logits)", op,
                         (long long)W2);
    d.W = W2 / 2;
    if (a->overlap && d.W % 2)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: with overlap 1, W=%lld must be even (two series of W / 2)", op,
                         (long long)d.W);
    d.D = a->overlap ? d.W / 2 : d.W;
    d.ratio = a->ratio;
    d.overlap = a->overlap;
    DI_TRY(need_shape(ctx, op, "position_bias", pb.q, 0, a->ratio, "ratio"));
    DI_TRY(need_shape(ctx, op, "position_bias", pb.q, 1, d.W, "W = staged.shape[2] / 2"));
    DI_TRY(need_shape(ctx, op, "token_seq", seq.q, 0, d.T, "positions.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, d.T, "positions.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, d.D, a->overlap ? "W / 2" : "W"));
    if (!mode->launch || d.T * d.D == 0) return DI_OK;
    k_kv_compress<<<grid_for(d.T * d.D, 256), 256, 0, (cudaStream_t)a->header.stream>>>(st.q, pb.q, btab.q, seq.q,
                                                                                       pos.q, out.q, d);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- indexer_topk
DI_Status op_indexer_topk(DI_Context* ctx, const DI_IndexerTopkArgs* a, OpMode* mode) {
    const char* op = "indexer_topk";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_IndexerTopkArgs"));
    QTensor q, w, keys, btab, seq, kvl, out;
    DI_TRY(take_tensor(ctx, mode, op, "q", a->q, 3, 0, &q));
    DI_TRY(take_tensor(ctx, mode, op, "weights", a->weights, 2, 0, &w));
    DI_TRY(take_tensor(ctx, mode, op, "keys", a->keys, 3, 0, &keys));
    DI_TRY(take_tensor(ctx, mode, op, "block_table", a->block_table, 2, 0, &btab));
    DI_TRY(take_tensor(ctx, mode, op, "token_seq", a->token_seq, 1, 0, &seq));
    DI_TRY(take_tensor(ctx, mode, op, "kv_len", a->kv_len, 1, 0, &kvl));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "q", q.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "weights", w.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "keys", keys.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "block_table", btab.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "token_seq", seq.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "kv_len", kvl.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_I32);
    IndexerDims d{};
    d.T = q.q.shape[0];
    d.NI = q.q.shape[1];
    d.Di = q.q.shape[2];
    d.NB = keys.q.shape[0];
    d.CB = keys.q.shape[1];
    d.S = btab.q.shape[0];
    d.K = out.q.shape[1];
    d.bs = a->block_size;
    d.ratio = a->ratio;
    d.scale = a->scale;
    DI_TRY(need_pow2(ctx, op, "ratio", a->ratio));
    DI_TRY(need_pow2(ctx, op, "block_size", a->block_size));
    DI_TRY(need_shape(ctx, op, "weights", w.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "weights", w.q, 1, d.NI, "q.shape[1]"));
    DI_TRY(need_shape(ctx, op, "keys", keys.q, 2, d.Di, "q.shape[2]"));
    DI_TRY(need_shape(ctx, op, "keys", keys.q, 1, max64(1, d.bs / d.ratio), "max(1, block_size / ratio)"));
    DI_TRY(need_shape(ctx, op, "token_seq", seq.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "kv_len", kvl.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_finite(ctx, op, "scale", a->scale, false));
    if (d.K > clean_indices_max_k())
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: K=%lld exceeds the %lld this GPU's top-k selection holds", op,
                         (long long)d.K, (long long)clean_indices_max_k());
    d.P = pow2_at_least(d.K);
    d.cap = btab.q.shape[1] * d.bs;
    d.maxN = d.cap / d.ratio;
    mode->workspace = align256((uint64_t)(d.T * d.maxN) * 4);   // the scores of every visible entry
    if (!mode->launch || d.T == 0 || d.K == 0) return DI_OK;
    if (ceil_div(d.maxN, TB) > (1ll << 31) - 1)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld entries per row too many", op, (long long)d.maxN);
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    float* scores = static_cast<float*>(ws.ptr);
    DI_Status st = DI_OK;
    if (d.maxN > 0) {
        const dim3 g((unsigned)ceil_div(d.maxN, TB), (unsigned)min64(d.T, 65535));
        k_index_scores<<<g, 256, 0, s>>>(q.q, w.q, keys.q, btab.q, seq.q, kvl.q, scores, d);
        st = launch_status(ctx, op);
    }
    if (st == DI_OK) {
        const size_t smem = (size_t)d.P * 8;
        allow_smem(k_index_topk, smem);
        k_index_topk<<<grid_for(d.T, 1, 65535), 512, smem, s>>>(scores, seq.q, kvl.q, out.q, d);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}

// ---------------------------------------------------------------------------------------- sparse_attention
DI_Status op_sparse_attention(DI_Context* ctx, const DI_SparseAttentionArgs* a, OpMode* mode) {
    const char* op = "sparse_attention";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_SparseAttentionArgs"));
    QTensor q, kv, cc, idx, sinks, btab, seq, kvl, out;
    bool has_comp, has_idx, has_sinks;
    DI_TRY(take_tensor(ctx, mode, op, "q", a->q, 3, 0, &q));
    DI_TRY(take_tensor(ctx, mode, op, "kv_cache", a->kv_cache, 3, 0, &kv));
    DI_TRY(take_opt(ctx, mode, op, "comp_cache", a->comp_cache, 3, &cc, &has_comp));
    DI_TRY(take_opt(ctx, mode, op, "indices", a->indices, 2, &idx, &has_idx));
    DI_TRY(take_opt(ctx, mode, op, "sinks", a->sinks, 1, &sinks, &has_sinks));
    DI_TRY(take_tensor(ctx, mode, op, "block_table", a->block_table, 2, 0, &btab));
    DI_TRY(take_tensor(ctx, mode, op, "token_seq", a->token_seq, 1, 0, &seq));
    DI_TRY(take_tensor(ctx, mode, op, "kv_len", a->kv_len, 1, 0, &kvl));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 3, 0, &out));
    DI_NEED_DT(ctx, op, "q", q.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "kv_cache", kv.q.dt, FLOATS);
    if (has_comp) DI_NEED_DT(ctx, op, "comp_cache", cc.q.dt, FLOATS);
    if (has_idx) DI_NEED_DT(ctx, op, "indices", idx.q.dt, DT_I32);
    if (has_sinks) DI_NEED_DT(ctx, op, "sinks", sinks.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "block_table", btab.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "token_seq", seq.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "kv_len", kvl.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    SparseDims d{};
    d.T = q.q.shape[0];
    d.NH = q.q.shape[1];
    d.D = (int)q.q.shape[2];
    d.NB = kv.q.shape[0];
    d.BS = kv.q.shape[1];
    d.S = btab.q.shape[0];
    d.MB = btab.q.shape[1];
    DI_TRY(need_shape(ctx, op, "kv_cache", kv.q, 2, d.D, "q.shape[2]"));
    DI_TRY(need_shape(ctx, op, "token_seq", seq.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "kv_len", kvl.q, 0, d.T, "q.shape[0]"));
    DI_TRY(same_shape(ctx, op, "q", q.q, "out", out.q));
    if (a->window < 0)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: window=%d is negative (0 means all positions)", op, a->window);
    DI_TRY(need_finite(ctx, op, "scale", a->scale, false));
    if (has_comp) {
        DI_TRY(need_pow2(ctx, op, "ratio", a->ratio));
        DI_TRY(need_pow2(ctx, op, "kv_cache.shape[1] (the block size)", d.BS));
        DI_TRY(need_shape(ctx, op, "comp_cache", cc.q, 1, max64(1, d.BS / a->ratio), "max(1, block size / ratio)"));
        DI_TRY(need_shape(ctx, op, "comp_cache", cc.q, 2, d.D, "q.shape[2]"));
        if (has_idx) DI_TRY(need_shape(ctx, op, "indices", idx.q, 0, d.T, "q.shape[0]"));
        d.NBc = cc.q.shape[0];
        d.CB = cc.q.shape[1];
        d.ratio = a->ratio;
        d.has_comp = 1;
        d.has_idx = has_idx ? 1 : 0;
        d.K = has_idx ? idx.q.shape[1] : 0;
    } else {
        if (has_idx)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: indices name compressed entries; they need comp_cache", op);
        d.ratio = 1;
    }
    if (has_sinks) DI_TRY(need_shape(ctx, op, "sinks", sinks.q, 0, d.NH, "q.shape[1]"));
    if (d.D > 16 * LANES)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: head dim D=%d exceeds this kernel's %d", op, d.D, 16 * LANES);
    if (d.K > clean_indices_max_k())
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: indices has %lld columns, over the %lld this GPU's cleaning sorts",
                         op, (long long)d.K, (long long)clean_indices_max_k());
    d.window = a->window;
    d.scale = a->scale;
    // Splits: enough (token, head group, chunk) blocks for two waves; which of them work is decided
    // on the device from each row's key count (sparse_chunk), so the grid never depends on it.
    const int64_t cap = d.MB * d.BS;
    const int64_t max_n = (d.window > 0 ? min64(d.window, cap) : cap) +
                          (has_comp ? (has_idx ? d.K : cap / d.ratio) : 0);
    const int64_t TG = d.T * ceil_div(d.NH, (int64_t)SP_HG);
    int64_t splits = ceil_div(2 * sm_count(ctx), max64(TG, 1));
    splits = max64(1, min64(splits, min64(SP_MAX_SPLITS, ceil_div(max_n, SP_MIN_CHUNK))));
    d.splits = (int)splits;
    const uint64_t clean = has_idx ? clean_indices_bytes(d.T, d.K) : 0;
    mode->workspace = clean + align256((uint64_t)(d.T * d.NH * splits) * (d.D + 2) * 4);
    if (!mode->launch || d.T * d.NH == 0 || d.D == 0) return DI_OK;
    if (TG > (1ll << 31) - 1) return set_error(ctx, DI_UNIMPLEMENTED, "%s: T*NH=%lld too large", op, (long long)TG);
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    char* w = static_cast<char*>(ws.ptr);
    const int* list = reinterpret_cast<const int*>(w);
    const int* cnt = reinterpret_cast<const int*>(w + align256((uint64_t)(d.T * d.K) * 4));
    float* part = reinterpret_cast<float*>(w + clean);
    DI_Status st = DI_OK;
    if (has_idx) st = launch_clean_indices(ctx, op, idx.q, seq.q, kvl.q, d.S, cap, d.ratio, w, s);
    if (st == DI_OK) {
        const dim3 grid((unsigned)TG, (unsigned)splits);
        const int64_t nq = ceil_div(d.D, LANES);
        if (nq <= 4) k_sparse_attn<4><<<grid, SP_WARPS * LANES, 0, s>>>(q.q, kv.q, cc.q, btab.q, seq.q, kvl.q, list, cnt, part, d);
        else if (nq <= 8) k_sparse_attn<8><<<grid, SP_WARPS * LANES, 0, s>>>(q.q, kv.q, cc.q, btab.q, seq.q, kvl.q, list, cnt, part, d);
        else k_sparse_attn<16><<<grid, SP_WARPS * LANES, 0, s>>>(q.q, kv.q, cc.q, btab.q, seq.q, kvl.q, list, cnt, part, d);
        st = launch_status(ctx, op);
    }
    if (st == DI_OK) {
        k_sparse_merge<<<grid_for(d.T * d.NH, 1, 1 << 20), 128, 0, s>>>(part, seq.q, kvl.q, cnt, sinks.q, out.q, d);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}

// ---------------------------------------------------------------------------------------- layernorm
DI_Status op_layernorm(DI_Context* ctx, const DI_LayerNormArgs* a, OpMode* mode) {
    const char* op = "layernorm";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_LayerNormArgs"));
    QTensor x, w, b, out;
    bool has_bias;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "weight", a->weight, 1, 0, &w));
    DI_TRY(take_opt(ctx, mode, op, "bias", a->bias, 1, &b, &has_bias));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "weight", w.q.dt, FLOATS);
    if (has_bias) DI_NEED_DT(ctx, op, "bias", b.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    const int64_t T = x.q.shape[0], H = x.q.shape[1];
    DI_TRY(need_shape(ctx, op, "weight", w.q, 0, H, "x.shape[1]"));
    if (has_bias) DI_TRY(need_shape(ctx, op, "bias", b.q, 0, H, "x.shape[1]"));
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_finite(ctx, op, "eps", a->eps, true));
    if (!mode->launch || T == 0 || H == 0) return DI_OK;
    k_layernorm<<<grid_for(T, 1, 65535), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, w.q, b.q, out.q, T, H, a->eps);
    return launch_status(ctx, op);
}
