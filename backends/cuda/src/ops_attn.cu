// mla_prefill and mla_decode.
//
// Both use one warp per key: the lanes hold the query (dims lane, lane+32, ...) in registers, a warp
// reduction gives the score, and each warp keeps its own online-softmax state, merged at the end.
// mla_decode absorbs kv_b_proj: q_lat = q_nope @ W_uk (kernel 1), attention over the latent cache
// split across position chunks (kernel 2, flash-decoding style), then merge of the chunks and
// out = W_uv @ o_lat (kernel 3).
#include "device.cuh"

using namespace di;

constexpr int ATT_MAXQ = 24;   // query dims per lane: Dq <= 768
constexpr int ATT_MAXV = 16;   // value dims per lane: Dv <= 512
constexpr int ATT_DEC_MAXQ = 18;  // decode: latent + rope dims per lane, Dc + Dr <= 576 (DeepSeek: 512 + 64)

// ---------------------------------------------------------------------------------------- prefill
template <int NQ, int NV>
__global__ __launch_bounds__(128) void k_mla_prefill(DTensor q, DTensor kv, DTensor kpe, DTensor cu, DTensor out,
                                                     int64_t T, int64_t H, int64_t S, int Dn, int Dr, int Dv,
                                                     float scale) {
    __shared__ float sm_m[4], sm_l[4];
    __shared__ float sm_o[4][NV * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int Dq = Dn + Dr;
    for (int64_t bi = blockIdx.x; bi < T * H; bi += gridDim.x) {
        const int64_t i = bi / H, h = bi % H;
        // the sequence of token i: largest s with cu[s] <= i
        int64_t lo = 0, hi = S;  // invariant cu[lo] <= i < cu[hi] when i is in range
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (load_i(cu.dt, cu.base, mid * cu.strides[0]) <= i) lo = mid;
            else hi = mid;
        }
        int64_t start = 0, endx = 0;
        if (S >= 1) {
            start = load_i(cu.dt, cu.base, lo * cu.strides[0]);
            endx = load_i(cu.dt, cu.base, (lo + 1) * cu.strides[0]);
        }
        bool valid = start <= i && i < endx && start >= 0;

        float qr[NQ];
        const int64_t qo = i * q.strides[0] + h * q.strides[1];
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
            int d = lane + 32 * r;
            qr[r] = d < Dq ? load_f(q.dt, q.base, qo + d) : 0.f;
        }
        float m = -INFINITY, l = 0.f, acc[NV];
#pragma unroll
        for (int r = 0; r < NV; ++r) acc[r] = 0.f;
        if (valid) {
            for (int64_t j = start + warp; j <= i; j += 4) {
                const int64_t ko = j * kv.strides[0] + h * kv.strides[1], po = j * kpe.strides[0];
                float dot = 0.f;
#pragma unroll
                for (int r = 0; r < NQ; ++r) {
                    int d = lane + 32 * r;
                    if (d < Dn) dot += qr[r] * load_f(kv.dt, kv.base, ko + d);
                    else if (d < Dq) dot += qr[r] * load_f(kpe.dt, kpe.base, po + d - Dn);
                }
                float sc = warp_sum(dot) * scale;
                float mn = fmaxf(m, sc), corr = expf(m - mn), pj = expf(sc - mn);
                l = l * corr + pj;
#pragma unroll
                for (int r = 0; r < NV; ++r) {
                    int d = lane + 32 * r;
                    if (d < Dv) acc[r] = acc[r] * corr + pj * load_f(kv.dt, kv.base, ko + Dn + d);
                }
                m = mn;
            }
        }
        if (lane == 0) {
            sm_m[warp] = m;
            sm_l[warp] = l;
        }
#pragma unroll
        for (int r = 0; r < NV; ++r) {
            int d = lane + 32 * r;
            if (d < Dv) sm_o[warp][d] = acc[r];
        }
        __syncthreads();
        float M = fmaxf(fmaxf(sm_m[0], sm_m[1]), fmaxf(sm_m[2], sm_m[3]));
        float wgt[4], L = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            wgt[w] = sm_m[w] == -INFINITY ? 0.f : expf(sm_m[w] - M);
            L += sm_l[w] * wgt[w];
        }
        const int64_t oo = i * out.strides[0] + h * out.strides[1];
        for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < 4; ++w) o += sm_o[w][d] * wgt[w];
            store_f(out.dt, out.base, oo + d, L > 0.f ? o / L : 0.f);
        }
        __syncthreads();
    }
}

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

DI_Status op_mla_prefill(DI_Context* ctx, const DI_MLAPrefillArgs* a, OpMode* mode) {
    const char* op = "mla_prefill";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MLAPrefillArgs"));
    QTensor q, kv, kpe, cu, out;
    DI_TRY(take_tensor(ctx, mode, op, "q", a->q, 3, 0, &q));
    DI_TRY(take_tensor(ctx, mode, op, "kv", a->kv, 3, 0, &kv));
    DI_TRY(take_tensor(ctx, mode, op, "k_pe", a->k_pe, 2, 0, &kpe));
    DI_TRY(take_tensor(ctx, mode, op, "cu_seqlens", a->cu_seqlens, 1, 0, &cu));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 3, 0, &out));
    DI_NEED_DT(ctx, op, "q", q.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "kv", kv.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "k_pe", kpe.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "cu_seqlens", cu.q.dt, DT_I32);
    const int64_t T = q.q.shape[0], H = q.q.shape[1], Dq = q.q.shape[2], Dv = out.q.shape[2];
    const int64_t Dn = kv.q.shape[2] - Dv, Dr = kpe.q.shape[1];
    DI_TRY(need_shape(ctx, op, "kv", kv.q, 0, T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "kv", kv.q, 1, H, "q.shape[1]"));
    DI_TRY(need_shape(ctx, op, "k_pe", kpe.q, 0, T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, H, "q.shape[1]"));
    if (Dn < 0)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: kv.shape[2]=%lld < out.shape[2]=Dv=%lld", op,
                         (long long)kv.q.shape[2], (long long)Dv);
    if (Dq != Dn + Dr)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: q.shape[2]=%lld != Dn + Dr = %lld + %lld", op, (long long)Dq,
                         (long long)Dn, (long long)Dr);
    if (cu.q.shape[0] < 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: cu_seqlens needs S + 1 >= 1 entries", op);
    if (Dq > 32 * ATT_MAXQ || Dv > 32 * ATT_MAXV)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: head dims Dn+Dr=%lld, Dv=%lld exceed this kernel's %d / %d", op,
                         (long long)Dq, (long long)Dv, 32 * ATT_MAXQ, 32 * ATT_MAXV);
    if (!mode->launch || T * H == 0) return DI_OK;
    const unsigned grid = grid_for(T * H, 1, 1 << 20);
    cudaStream_t s = (cudaStream_t)a->header.stream;
    const int64_t S = cu.q.shape[0] - 1;
    if (Dq <= 256 && Dv <= 128)
        k_mla_prefill<8, 4><<<grid, 128, 0, s>>>(q.q, kv.q, kpe.q, cu.q, out.q, T, H, S, (int)Dn, (int)Dr, (int)Dv, a->scale);
    else if (Dv <= 128)
        k_mla_prefill<ATT_MAXQ, 4><<<grid, 128, 0, s>>>(q.q, kv.q, kpe.q, cu.q, out.q, T, H, S, (int)Dn, (int)Dr, (int)Dv, a->scale);
    else if (Dq <= 256)
        k_mla_prefill<8, ATT_MAXV><<<grid, 128, 0, s>>>(q.q, kv.q, kpe.q, cu.q, out.q, T, H, S, (int)Dn, (int)Dr, (int)Dv, a->scale);
    else
        k_mla_prefill<ATT_MAXQ, ATT_MAXV><<<grid, 128, 0, s>>>(q.q, kv.q, kpe.q, cu.q, out.q, T, H, S, (int)Dn, (int)Dr, (int)Dv, a->scale);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- decode
struct DecodeDims {
    int64_t T, H, S, MB, NB, BS;
    int     Dn, Dr, Dv, Dc, splits, chunk;
};

// qf[t, h] = [q_nope @ W_uk[h] (Dc), q_pe (Dr)] in f32
__global__ void k_mla_qlat(DTensor q, DTensor w, float* qf, DecodeDims d) {
    extern __shared__ float qn[];
    const int Dk = d.Dc + d.Dr;
    for (int64_t bi = blockIdx.x; bi < d.T * d.H; bi += gridDim.x) {
        const int64_t t = bi / d.H, h = bi % d.H, qo = t * q.strides[0] + h * q.strides[1];
        for (int i = threadIdx.x; i < d.Dn; i += blockDim.x) qn[i] = load_f(q.dt, q.base, qo + i);
        __syncthreads();
        float* dst = qf + bi * Dk;
        const int64_t wrow = h * (int64_t)(d.Dn + d.Dv);
        for (int c = threadIdx.x; c < d.Dc; c += blockDim.x) {
            float acc = 0.f;
#pragma unroll 16
            for (int i = 0; i < d.Dn; ++i) acc += qn[i] * load_f(w.dt, w.base, (wrow + i) * w.strides[0] + c);
            dst[c] = acc;
        }
        for (int r = threadIdx.x; r < d.Dr; r += blockDim.x) dst[d.Dc + r] = load_f(q.dt, q.base, qo + d.Dn + r);
        __syncthreads();
    }
}

__device__ __forceinline__ int64_t decode_len(const DTensor& seq, const DTensor& kvl, const DecodeDims& d, int64_t t,
                                              int64_t* s_out) {
    int64_t s = load_i(seq.dt, seq.base, t * seq.strides[0]);
    int64_t len = load_i(kvl.dt, kvl.base, t * kvl.strides[0]);
    if (s < 0 || s >= d.S) len = 0;
    if (len < 0) len = 0;
    if (len > d.MB * d.BS) len = d.MB * d.BS;  // never index past the block table
    *s_out = s;
    return len;
}

// partial[(t*H + h) * splits + split] = [m, l, o (Dc)] over the positions of one chunk.
// A block serves MLA_HG heads of one token, so each latent row read from the cache is used by all of
// them (the heads share the cache: reading it once per head made decode L2-bound). One warp per
// position; each warp keeps an online-softmax state per head; the 8 warps merge at the end.
constexpr int MLA_HG = 4;

template <int NQ>
__global__ __launch_bounds__(256) void k_mla_attn(const float* qf, DTensor cache, DTensor btab, DTensor seq,
                                                  DTensor kvl, float* part, DecodeDims d, float scale) {
    __shared__ float sm_m[8][MLA_HG], sm_l[8][MLA_HG];
    __shared__ float sm_o[8][NQ * 32];
    __shared__ float sm_q[MLA_HG][NQ * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int Dk = d.Dc + d.Dr;
    const int64_t groups = ceil_div(d.H, MLA_HG);
    const int64_t t = blockIdx.x / groups, h0 = (blockIdx.x % groups) * MLA_HG, split = blockIdx.y;
    const int ng = (int)min((int64_t)MLA_HG, d.H - h0);
    int64_t s;
    const int64_t len = decode_len(seq, kvl, d, t, &s);
    const int64_t p0 = split * (int64_t)d.chunk, p1 = min(len, p0 + (int64_t)d.chunk);
    for (int i = threadIdx.x; i < MLA_HG * NQ * 32; i += blockDim.x) {
        int g = i / (NQ * 32), k = i % (NQ * 32);
        sm_q[g][k] = (g < ng && k < Dk) ? qf[(t * d.H + h0 + g) * Dk + k] : 0.f;
    }
    __syncthreads();
    float m[MLA_HG], l[MLA_HG], acc[MLA_HG][NQ];
#pragma unroll
    for (int g = 0; g < MLA_HG; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int r = 0; r < NQ; ++r) acc[g][r] = 0.f;
    }
    for (int64_t p = p0 + warp; p < p1; p += 8) {
        int64_t blk = load_i(btab.dt, btab.base, s * btab.strides[0] + p / d.BS);
        if (blk < 0 || blk >= d.NB) continue;  // a hole in the block table is masked, never read
        const int64_t ro = blk * cache.strides[0] + (p % d.BS) * cache.strides[1];
        float kvv[NQ];
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
            int k = lane + 32 * r;
            kvv[r] = k < Dk ? load_f(cache.dt, cache.base, ro + k) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < MLA_HG; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int r = 0; r < NQ; ++r) dot += sm_q[g][lane + 32 * r] * kvv[r];
            float sc = warp_sum(dot) * scale;
            float mn = fmaxf(m[g], sc), corr = expf(m[g] - mn), pj = expf(sc - mn);
            l[g] = l[g] * corr + pj;
#pragma unroll
            for (int r = 0; r < NQ; ++r)
                if (lane + 32 * r < d.Dc) acc[g][r] = acc[g][r] * corr + pj * kvv[r];
            m[g] = mn;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < MLA_HG; ++g) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < MLA_HG; ++g) {
        __syncthreads();
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
            int k = lane + 32 * r;
            if (k < d.Dc) sm_o[warp][k] = acc[g][r];
        }
        __syncthreads();
        if (g >= ng) continue;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < 8; ++w) M = fmaxf(M, sm_m[w][g]);
        float wgt[8], L = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            wgt[w] = sm_m[w][g] == -INFINITY ? 0.f : expf(sm_m[w][g] - M);
            L += sm_l[w][g] * wgt[w];
        }
        float* dst = part + ((t * d.H + h0 + g) * d.splits + split) * (int64_t)(d.Dc + 2);
        if (threadIdx.x == 0) {
            dst[0] = M;
            dst[1] = L;
        }
        for (int k = threadIdx.x; k < d.Dc; k += blockDim.x) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < 8; ++w) o += sm_o[w][k] * wgt[w];
            dst[2 + k] = o;
        }
    }
}

// merge the chunks, then out[t, h] = W_uv[h] @ o_lat
__global__ __launch_bounds__(256) void k_mla_out(const float* part, DTensor w, DTensor out, DecodeDims d) {
    extern __shared__ float ol[];          // Dc merged latent values, then splits weights
    __shared__ float red[32];
    float* wgt = ol + d.Dc;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int64_t stride = d.Dc + 2;
    for (int64_t bi = blockIdx.x; bi < d.T * d.H; bi += gridDim.x) {
        const int64_t t = bi / d.H, h = bi % d.H;
        const float* src = part + bi * d.splits * stride;
        float M = -INFINITY;
        for (int sp = threadIdx.x; sp < d.splits; sp += blockDim.x) M = fmaxf(M, src[sp * stride]);
        M = block_max(M, red);
        float L = 0.f;
        for (int sp = threadIdx.x; sp < d.splits; sp += blockDim.x) {
            float ms = src[sp * stride];
            float wv = ms == -INFINITY ? 0.f : expf(ms - M);
            wgt[sp] = wv;
            L += src[sp * stride + 1] * wv;
        }
        L = block_sum(L, red);  // its barriers also publish wgt
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int c = threadIdx.x; c < d.Dc; c += blockDim.x) {
            float o = 0.f;
#pragma unroll 8
            for (int sp = 0; sp < d.splits; ++sp) o += src[sp * stride + 2 + c] * wgt[sp];
            ol[c] = o * inv;
        }
        __syncthreads();
        const int64_t wrow = h * (int64_t)(d.Dn + d.Dv) + d.Dn;
        const int64_t oo = t * out.strides[0] + h * out.strides[1];
        for (int j = warp; j < d.Dv; j += nw) {
            const int64_t ro = (wrow + j) * w.strides[0];
            float acc = 0.f;
#pragma unroll 16
            for (int c = lane; c < d.Dc; c += 32) acc += load_f(w.dt, w.base, ro + c) * ol[c];
            acc = warp_sum(acc);
            if (lane == 0) store_f(out.dt, out.base, oo + j, acc);
        }
        __syncthreads();
    }
}

DI_Status op_mla_decode(DI_Context* ctx, const DI_MLADecodeArgs* a, OpMode* mode) {
    const char* op = "mla_decode";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MLADecodeArgs"));
    QTensor q, w, cache, btab, seq, kvl, out;
    DI_TRY(take_tensor(ctx, mode, op, "q", a->q, 3, 0, &q));
    DI_TRY(take_tensor(ctx, mode, op, "wkv_b", a->wkv_b, 2, 0, &w));
    DI_TRY(take_tensor(ctx, mode, op, "cache", a->cache, 3, 0, &cache));
    DI_TRY(take_tensor(ctx, mode, op, "block_table", a->block_table, 2, 0, &btab));
    DI_TRY(take_tensor(ctx, mode, op, "token_seq", a->token_seq, 1, 0, &seq));
    DI_TRY(take_tensor(ctx, mode, op, "kv_len", a->kv_len, 1, 0, &kvl));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 3, 0, &out));
    DI_NEED_DT(ctx, op, "q", q.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "wkv_b", w.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "cache", cache.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "block_table", btab.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "token_seq", seq.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "kv_len", kvl.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DecodeDims d{};
    d.T = q.q.shape[0];
    d.H = q.q.shape[1];
    d.Dc = (int)w.q.shape[1];
    d.Dr = (int)(cache.q.shape[2] - d.Dc);
    d.Dn = (int)(q.q.shape[2] - d.Dr);
    d.Dv = (int)out.q.shape[2];
    d.NB = cache.q.shape[0];
    d.BS = cache.q.shape[1];
    d.S = btab.q.shape[0];
    d.MB = btab.q.shape[1];
    if (d.Dr < 0 || d.Dn < 0)
        return set_error(ctx, DI_INVALID_ARGUMENT,
                         "%s: cache.shape[2]=%lld, wkv_b.shape[1]=Dc=%d and q.shape[2]=%lld give Dr=%d, Dn=%d", op,
                         (long long)cache.q.shape[2], d.Dc, (long long)q.q.shape[2], d.Dr, d.Dn);
    DI_TRY(need_shape(ctx, op, "wkv_b", w.q, 0, d.H * (d.Dn + d.Dv), "H * (Dn + Dv)"));
    DI_TRY(need_shape(ctx, op, "token_seq", seq.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "kv_len", kvl.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, d.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, d.H, "q.shape[1]"));
    if (d.Dc + d.Dr > 32 * ATT_DEC_MAXQ)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: Dc + Dr = %d exceeds this kernel's %d", op, d.Dc + d.Dr,
                         32 * ATT_DEC_MAXQ);
    if (d.Dn > 12 * 1024 || d.Dc > 12 * 1024)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: Dn=%d / Dc=%d too large", op, d.Dn, d.Dc);
    // Split positions so that small batches still fill the GPU; the chunk count is fixed by the
    // block table's capacity (kv_len lives on the device), chunks past kv_len exit at once.
    const int64_t cap = d.MB * d.BS, TH = d.T * d.H;
    int64_t splits = ceil_div(cap, 64);
    const int64_t TG = d.T * ceil_div(d.H, MLA_HG);  // blocks per split
    int64_t max_splits = TG >= 4096 ? 1 : 4096 / (TG > 0 ? TG : 1);
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    if (splits > 65535) splits = 65535;
    d.splits = (int)splits;
    d.chunk = (int)(cap > 0 ? ceil_div(cap, splits) : 1);
    const uint64_t qf_bytes = align256((uint64_t)TH * (d.Dc + d.Dr) * 4);
    const uint64_t part_bytes = align256((uint64_t)TH * splits * (d.Dc + 2) * 4);
    mode->workspace = qf_bytes + part_bytes;
    if (!mode->launch || TH == 0 || d.Dv == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    float* qf = static_cast<float*>(ws.ptr);
    float* part = reinterpret_cast<float*>(static_cast<char*>(ws.ptr) + qf_bytes);
    size_t sm1 = (size_t)(d.Dn > 0 ? d.Dn : 1) * 4, sm3 = (size_t)(d.Dc + splits) * 4;
    if (sm1 > 48 * 1024) cudaFuncSetAttribute(k_mla_qlat, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm1);
    if (sm3 > 48 * 1024) cudaFuncSetAttribute(k_mla_out, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm3);
    DI_Status st = DI_OK;
    k_mla_qlat<<<grid_for(TH, 1, 1 << 20), 256, sm1, s>>>(q.q, w.q, qf, d);
    st = launch_status(ctx, op);
    if (st == DI_OK) {
        if (TH > (1ll << 31) - 1) st = set_error(ctx, DI_UNIMPLEMENTED, "%s: T*H too large", op);
        else {
            dim3 grid((unsigned)(d.T * ceil_div(d.H, MLA_HG)), (unsigned)splits);
            const int nq = (int)ceil_div(d.Dc + d.Dr, 32);
            if (nq <= 4) k_mla_attn<4><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
            else if (nq <= 8) k_mla_attn<8><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
            else if (nq <= 12) k_mla_attn<12><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
            else k_mla_attn<18><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
            st = launch_status(ctx, op);
        }
    }
    if (st == DI_OK) {
        k_mla_out<<<grid_for(TH, 1, 1 << 20), 256, sm3, s>>>(part, w.q, out.q, d);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}
