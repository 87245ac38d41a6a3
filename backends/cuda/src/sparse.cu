// kv_compress, indexer_topk and sparse_attention (ABI 1.3, abi/README.md section 8): V4's compressed
// and sparse attention and V3.2's lightning indexer, and the index cleaning mla_decode shares
// (sparse_api.cuh).
//
// Host side only: validation, workspace, launches; the kernels are in sparse.cuh (see there for their
// designs), where tests/gpu_emu runs them on the CPU. Everything goes onto the args' stream; no op
// reads a device value on the host, synchronizes or allocates beyond the Workspace contract of
// common.cuh, so each is capturable in a graph.
#include "arg_checks.cuh"
#include "sparse_api.cuh"
#include "sparse.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

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
