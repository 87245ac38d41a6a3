// hc_pre and hc_post (ABI 1.3, abi/README.md section 8): V4's hyper-connections.
//
// Host side only: validation, workspace, launches; the kernels are in hyper.cuh (see there for their
// designs), where tests/gpu_emu runs them on the CPU. Everything goes onto the args' stream; no op
// reads a device value on the host, synchronizes or allocates beyond the Workspace contract of
// common.cuh, so each is capturable in a graph.
#include "arg_checks.cuh"
#include "hyper.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

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
