// mla_prefill and mla_decode (and mla_cache_write, at the end, which fills the cache they read).
//
// Both use one warp per key: the lanes hold the query (dims lane, lane + LANES, ...) in registers, a warp
// reduction gives the score, and each warp keeps its own online-softmax state, merged at the end.
// mla_decode absorbs kv_b_proj: q_lat = q_nope @ W_uk (kernel 1), attention over the latent cache
// split across position chunks (kernel 2, flash-decoding style), then merge of the chunks and
// out = W_uv @ o_lat (kernel 3).
#include <algorithm>

#include "device.cuh"
#include "mla_decode.cuh"
#include "sparse_api.cuh"

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
    __shared__ float sm_o[4][NV * LANES];
    const int warp = warp_id(), lane = lane_id();
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
            int d = lane + LANES * r;
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
                    int d = lane + LANES * r;
                    if (d < Dn) dot += qr[r] * load_f(kv.dt, kv.base, ko + d);
                    else if (d < Dq) dot += qr[r] * load_f(kpe.dt, kpe.base, po + d - Dn);
                }
                float sc = warp_sum(dot) * scale;
                float mn = fmaxf(m, sc), corr = expf(m - mn), pj = expf(sc - mn);
                l = l * corr + pj;
#pragma unroll
                for (int r = 0; r < NV; ++r) {
                    int d = lane + LANES * r;
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
            int d = lane + LANES * r;
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

// ------------------------------------------------------------------------------ prefill, tensor cores
// FlashAttention-2 on mma.sync m16n8k16 (bf16 in, f32 accumulate) for the DeepSeek head shape:
// Dn + Dr = 192 query/key dims (k = [k_nope | k_pe], k_pe shared by the heads), Dv = 128, all bf16
// with 16-byte aligned rows. A block owns 64 consecutive packed tokens of one head (16 per warp)
// and walks 64-key tiles from the first token's sequence start to its last token; each row masks
// keys outside [its sequence's start, itself], so tiles may straddle sequences and no per-step
// schedule is needed. S = Q K^T stays in registers; its C fragments are P's A fragments for P V.
// Other shapes or dtypes use k_mla_prefill above.
constexpr int FA_Q = 64, FA_K = 64, FA_DQ = 192, FA_DV = 128;
constexpr int FA_KS = FA_DQ + 8;    // K row stride in smem (bf16): +8 keeps the B-fragment reads conflict-free
constexpr int FA_VS = FA_K + 8;     // V^T row stride

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DI_FA_MMA 1
#endif

__device__ __forceinline__ void fa_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef DI_FA_MMA
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
    return (uint32_t)f_to_bf16(lo) | ((uint32_t)f_to_bf16(hi) << 16);
}

__device__ __forceinline__ int64_t fa_seq_start(const DTensor& cu, int64_t S, int64_t i) {
    int64_t lo = 0, hi = S;   // largest s with cu[s] <= i
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (load_i(cu.dt, cu.base, mid * cu.strides[0]) <= i) lo = mid;
        else hi = mid;
    }
    return load_i(cu.dt, cu.base, lo * cu.strides[0]);
}

__global__ __launch_bounds__(128) void k_mla_prefill_tc(DTensor q, DTensor kv, DTensor kpe, DTensor cu, DTensor out,
                                                        int64_t T, int64_t S, float scale_log2) {
    __shared__ __align__(16) uint16_t ks[FA_K * FA_KS];    // Q tile first, then each K tile
    __shared__ __align__(16) uint16_t vt[FA_DV * FA_VS];   // V tile, transposed: vt[dv][key]
    const int warp = warp_id(), lane = lane_id(), g = lane >> 2, c4 = lane & 3;
    const int64_t h = blockIdx.y, i0 = (int64_t)blockIdx.x * FA_Q;
    if (i0 >= T) return;
    const char* qb = q.base;
    // Q tile -> smem -> A fragments (12 k-steps of 16 dims)
    for (int u = threadIdx.x; u < FA_Q * (FA_DQ / 8); u += blockDim.x) {
        const int r = u / (FA_DQ / 8), c = (u % (FA_DQ / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (i0 + r < T) v = *reinterpret_cast<const uint4*>(qb + 2 * ((i0 + r) * q.strides[0] + h * q.strides[1] + c));
        *reinterpret_cast<uint4*>(&ks[r * FA_KS + c]) = v;
    }
    __syncthreads();
    uint32_t qa[FA_DQ / 16][4];
    const int rw = warp * 16;
#pragma unroll
    for (int k = 0; k < FA_DQ / 16; ++k) {
        const int col = k * 16 + 2 * c4;
        qa[k][0] = *reinterpret_cast<const uint32_t*>(&ks[(rw + g) * FA_KS + col]);
        qa[k][1] = *reinterpret_cast<const uint32_t*>(&ks[(rw + g + 8) * FA_KS + col]);
        qa[k][2] = *reinterpret_cast<const uint32_t*>(&ks[(rw + g) * FA_KS + col + 8]);
        qa[k][3] = *reinterpret_cast<const uint32_t*>(&ks[(rw + g + 8) * FA_KS + col + 8]);
    }
    // this thread's two rows, their sequence starts, and the block's key range
    const int64_t ra = i0 + rw + g, rb = ra + 8;
    const int64_t sa = ra < T ? fa_seq_start(cu, S, ra) : T, sb = rb < T ? fa_seq_start(cu, S, rb) : T;
    const int64_t kbeg = fa_seq_start(cu, S, i0), kend = min(T, i0 + FA_Q);
    float o[FA_DV / 8][4];
#pragma unroll
    for (int n = 0; n < FA_DV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.f, lb = 0.f;
    for (int64_t j0 = kbeg; j0 < kend; j0 += FA_K) {
        __syncthreads();   // the previous tile (or the Q tile) is no longer read
        for (int u = threadIdx.x; u < FA_K * (FA_DQ / 8); u += blockDim.x) {
            const int r = u / (FA_DQ / 8), c = (u % (FA_DQ / 8)) * 8;
            const int64_t j = j0 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (j < kend) {
                const int dn = FA_DQ - 64;
                const char* src = c < dn ? kv.base + 2 * (j * kv.strides[0] + h * kv.strides[1] + c)
                                         : kpe.base + 2 * (j * kpe.strides[0] + (c - dn));
                v = *reinterpret_cast<const uint4*>(src);
            }
            *reinterpret_cast<uint4*>(&ks[r * FA_KS + c]) = v;
        }
        for (int u = threadIdx.x; u < FA_K * (FA_DV / 8); u += blockDim.x) {
            const int r = u / (FA_DV / 8), c = (u % (FA_DV / 8)) * 8;
            const int64_t j = j0 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (j < kend)
                v = *reinterpret_cast<const uint4*>(kv.base + 2 * (j * kv.strides[0] + h * kv.strides[1] + (FA_DQ - 64) + c));
            const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
            for (int x = 0; x < 8; ++x) vt[(c + x) * FA_VS + r] = e[x];
        }
        __syncthreads();
        // S = Q K^T for 16 rows x 64 keys per warp
        float sc[FA_K / 8][4];
#pragma unroll
        for (int n = 0; n < FA_K / 8; ++n) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
            for (int k = 0; k < FA_DQ / 16; ++k) {
                const uint16_t* kr = &ks[(n * 8 + g) * FA_KS + k * 16 + 2 * c4];
                fa_mma(sc[n], qa[k], *reinterpret_cast<const uint32_t*>(kr), *reinterpret_cast<const uint32_t*>(kr + 8));
            }
        }
        // mask (own sequence, causal), scale, online softmax per row
        float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
        for (int n = 0; n < FA_K / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int64_t j = j0 + n * 8 + 2 * c4 + e;
                sc[n][e] = (j >= sa && j <= ra && j < kend) ? sc[n][e] * scale_log2 : -INFINITY;
                sc[n][2 + e] = (j >= sb && j <= rb && j < kend) ? sc[n][2 + e] * scale_log2 : -INFINITY;
                mxa = fmaxf(mxa, sc[n][e]);
                mxb = fmaxf(mxb, sc[n][2 + e]);
            }
        }
        mxa = fmaxf(mxa, shfl_xor(mxa, 1));
        mxa = fmaxf(mxa, shfl_xor(mxa, 2));
        mxb = fmaxf(mxb, shfl_xor(mxb, 1));
        mxb = fmaxf(mxb, shfl_xor(mxb, 2));
        const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
        const float ua = na == -INFINITY ? 0.f : na, ub = nb == -INFINITY ? 0.f : nb;
        const float ca = exp2f(ma - ua), cb = exp2f(mb - ub);   // exp2(-inf) = 0 on the first tile
        ma = na;
        mb = nb;
        la *= ca;
        lb *= cb;
#pragma unroll
        for (int n = 0; n < FA_DV / 8; ++n) {
            o[n][0] *= ca;
            o[n][1] *= ca;
            o[n][2] *= cb;
            o[n][3] *= cb;
        }
        uint32_t pa[FA_K / 16][4];
#pragma unroll
        for (int n = 0; n < FA_K / 8; ++n) {
            const float p0 = exp2f(sc[n][0] - ua), p1 = exp2f(sc[n][1] - ua);
            const float p2 = exp2f(sc[n][2] - ub), p3 = exp2f(sc[n][3] - ub);
            la += p0 + p1;
            lb += p2 + p3;
            pa[n / 2][(n & 1) * 2 + 0] = fa_pack(p0, p1);
            pa[n / 2][(n & 1) * 2 + 1] = fa_pack(p2, p3);
        }
        // O += P V
#pragma unroll
        for (int n = 0; n < FA_DV / 8; ++n) {
#pragma unroll
            for (int k = 0; k < FA_K / 16; ++k) {
                const uint16_t* vr = &vt[(n * 8 + g) * FA_VS + k * 16 + 2 * c4];
                fa_mma(o[n], pa[k], *reinterpret_cast<const uint32_t*>(vr), *reinterpret_cast<const uint32_t*>(vr + 8));
            }
        }
    }
    la += shfl_xor(la, 1);
    la += shfl_xor(la, 2);
    lb += shfl_xor(lb, 1);
    lb += shfl_xor(lb, 2);
    const float ia = la > 0.f ? 1.f / la : 0.f, ib = lb > 0.f ? 1.f / lb : 0.f;
#pragma unroll
    for (int n = 0; n < FA_DV / 8; ++n) {
        const int dv = n * 8 + 2 * c4;
        if (ra < T) {
            store_f(out.dt, out.base, ra * out.strides[0] + h * out.strides[1] + dv, o[n][0] * ia);
            store_f(out.dt, out.base, ra * out.strides[0] + h * out.strides[1] + dv + 1, o[n][1] * ia);
        }
        if (rb < T) {
            store_f(out.dt, out.base, rb * out.strides[0] + h * out.strides[1] + dv, o[n][2] * ib);
            store_f(out.dt, out.base, rb * out.strides[0] + h * out.strides[1] + dv + 1, o[n][3] * ib);
        }
    }
}

// the tensor-core kernel's preconditions: an NVIDIA GPU of sm_80 or newer (its mma.sync is PTX; AMD
// runs k_mla_prefill), its head shape, bf16 operands, 16-byte aligned rows
static bool prefill_tc_ok(const DI_Context* ctx, const QTensor& q, const QTensor& kv, const QTensor& kpe,
                          int64_t Dn, int64_t Dr, int64_t Dv) {
    if (DI_GPU_AMD || ctx->prop.major < 8 || Dn + Dr != FA_DQ || Dr != 64 || Dv != FA_DV) return false;
    if (q.q.dt != DT_BF16 || kv.q.dt != DT_BF16 || kpe.q.dt != DT_BF16) return false;
    auto al = [](const DTensor& t, int lead) {
        if (reinterpret_cast<uintptr_t>(t.base) % 16) return false;
        for (int d = 0; d < lead; ++d)
            if (t.strides[d] % 8) return false;
        return true;
    };
    return al(q.q, 2) && al(kv.q, 2) && al(kpe.q, 1);
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
    if (Dq > LANES * ATT_MAXQ || Dv > LANES * ATT_MAXV)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: head dims Dn+Dr=%lld, Dv=%lld exceed this kernel's %d / %d", op,
                         (long long)Dq, (long long)Dv, LANES * ATT_MAXQ, LANES * ATT_MAXV);
    if (!mode->launch || T * H == 0) return DI_OK;
    const unsigned grid = grid_for(T * H, 1, 1 << 20);
    cudaStream_t s = (cudaStream_t)a->header.stream;
    const int64_t S = cu.q.shape[0] - 1;
    if (prefill_tc_ok(ctx, q, kv, kpe, Dn, Dr, Dv) && getenv("DEEPINFER_CUDA_PREFILL_SCALAR") == nullptr) {
        if (H > 65535) return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld heads", op, (long long)H);
        dim3 g((unsigned)ceil_div(T, FA_Q), (unsigned)H);
        k_mla_prefill_tc<<<g, 128, 0, s>>>(q.q, kv.q, kpe.q, cu.q, out.q, T, S, a->scale * 1.4426950408889634f);
        return launch_status(ctx, op);
    }
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
// The generic path: four kernels per call (bf16 weights and cache take the three of
// mla_decode_bf16.cuh), each shaped so the absorbed weights are read once per step, not once per
// (token, head) (reading W_uk / W_uv per token and head was most of the op's time at batch 1 and
// made it L2-bound at batch 32):
//   qlat   qf[t, h] = [q_nope[t, h] @ W_uk[h] (Dc), q_pe[t, h] (Dr)]: a block owns one head, 64
//          latent columns and up to 16 tokens; its weight tile is read once for all of them.
//   attn   partial softmax states over position chunks (flash-decoding); the chunk length follows
//          each token's kv_len on the device, so a short context uses few chunks and a long one
//          fills the GPU, with the grid fixed (graph replay keeps it).
//   merge  o_lat[t, h] = LSE-weighted sum of the active chunks' states.
//   uv     out[t, h] = W_uv[h] @ o_lat[t, h]: a block owns one head, 16 value rows and up to 16
//          tokens.
// With `indices` (1.3, V3.2's sparse MLA) a fifth kernel runs first: launch_clean_indices (sparse.cu)
// turns each row into its distinct valid positions, ascending, and attn walks that list instead of
// [0, kv_len): a token's "length" is then its count of listed positions, and everything else
// (chunking, merge) is unchanged.
constexpr int MLA_TT = 16;        // tokens per qlat / uv block
constexpr int MLA_QCOLS = 64;     // latent columns per qlat block
constexpr int MLA_UV_ROWS = 16;   // value rows per uv block (2 per warp)

__global__ __launch_bounds__(256) void k_mla_qlat(DTensor q, DTensor w, float* qf, DecodeDims d, int tt) {
    extern __shared__ float qs[];                      // [tt][Dn] q_nope of the block's tokens
    __shared__ float red[4][MLA_TT][MLA_QCOLS];
    const int col = threadIdx.x & (MLA_QCOLS - 1), kq = threadIdx.x >> 6;   // 4 quarters of the k range
    const int64_t h = blockIdx.x, c = (int64_t)blockIdx.y * MLA_QCOLS + col, t0 = (int64_t)blockIdx.z * tt;
    const int Dk = d.Dc + d.Dr;
    const int nt = (int)min((int64_t)tt, d.T - t0);
    for (int i = threadIdx.x; i < tt * d.Dn; i += blockDim.x) {
        const int t = i / d.Dn, k = i % d.Dn;
        qs[i] = t < nt ? load_f(q.dt, q.base, (t0 + t) * q.strides[0] + h * q.strides[1] + k) : 0.f;
    }
    __syncthreads();
    float acc[MLA_TT];
#pragma unroll
    for (int t = 0; t < MLA_TT; ++t) acc[t] = 0.f;
    if (c < d.Dc) {
        const int64_t wrow = h * (int64_t)(d.Dn + d.Dv);
#pragma unroll 4
        for (int k = kq; k < d.Dn; k += 4) {
            const float wv = load_f(w.dt, w.base, (wrow + k) * w.strides[0] + c);
#pragma unroll
            for (int t = 0; t < MLA_TT; ++t)
                if (t < nt) acc[t] += qs[t * d.Dn + k] * wv;
        }
    }
#pragma unroll
    for (int t = 0; t < MLA_TT; ++t) red[kq][t][col] = acc[t];
    __syncthreads();
    for (int i = threadIdx.x; i < nt * MLA_QCOLS; i += blockDim.x) {
        const int t = i / MLA_QCOLS, cc = i % MLA_QCOLS;
        const int64_t cg = (int64_t)blockIdx.y * MLA_QCOLS + cc;
        if (cg < d.Dc) qf[((t0 + t) * d.H + h) * Dk + cg] = red[0][t][cc] + red[1][t][cc] + red[2][t][cc] + red[3][t][cc];
    }
    if (blockIdx.y == 0) {   // the rope part is q's own
        for (int i = threadIdx.x; i < nt * d.Dr; i += blockDim.x) {
            const int t = i / d.Dr, r = i % d.Dr;
            qf[((t0 + t) * d.H + h) * Dk + d.Dc + r] =
                load_f(q.dt, q.base, (t0 + t) * q.strides[0] + h * q.strides[1] + d.Dn + r);
        }
    }
}


template <int NQ>
__global__ __launch_bounds__(256) void k_mla_attn(const float* qf, DTensor cache, DTensor btab, DTensor seq,
                                                  DTensor kvl, float* part, DecodeDims d, float scale) {
    __shared__ float sm_m[8][MLA_HG], sm_l[8][MLA_HG];
    __shared__ float sm_o[8][NQ * LANES];
    __shared__ float sm_q[MLA_HG][NQ * LANES];
    const int warp = warp_id(), lane = lane_id();
    const int Dk = d.Dc + d.Dr;
    const int64_t groups = ceil_div(d.H, MLA_HG);
    const int64_t t = blockIdx.x / groups, h0 = (blockIdx.x % groups) * MLA_HG, split = blockIdx.y;
    const int ng = (int)min((int64_t)MLA_HG, d.H - h0);
    int64_t s;
    const int64_t len = decode_len(seq, kvl, d, t, &s);
    const int64_t chunk = decode_chunk(len, d.splits);
    const int64_t p0 = split * chunk, p1 = min(len, p0 + chunk);
    if (p0 >= len && split > 0) return;   // inactive chunk (chunk 0 always reports, even for len 0)
    for (int i = threadIdx.x; i < MLA_HG * NQ * LANES; i += blockDim.x) {
        int g = i / (NQ * LANES), k = i % (NQ * LANES);
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
    for (int64_t i = p0 + warp; i < p1; i += 8) {
        const int64_t p = d.list ? d.list[t * d.K + i] : i;   // the i-th attended position
        int64_t blk = load_i(btab.dt, btab.base, s * btab.strides[0] + p / d.BS);
        if (blk < 0 || blk >= d.NB) continue;  // a hole in the block table is masked, never read
        const int64_t ro = blk * cache.strides[0] + (p % d.BS) * cache.strides[1];
        float kvv[NQ];
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
            int k = lane + LANES * r;
            kvv[r] = k < Dk ? load_f(cache.dt, cache.base, ro + k) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < MLA_HG; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int r = 0; r < NQ; ++r) dot += sm_q[g][lane + LANES * r] * kvv[r];
            float sc = warp_sum(dot) * scale;
            float mn = fmaxf(m[g], sc), corr = expf(m[g] - mn), pj = expf(sc - mn);
            l[g] = l[g] * corr + pj;
#pragma unroll
            for (int r = 0; r < NQ; ++r)
                if (lane + LANES * r < d.Dc) acc[g][r] = acc[g][r] * corr + pj * kvv[r];
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
            int k = lane + LANES * r;
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

// ol[t, h] = the active chunks' states merged (0 for a token with no keys)
__global__ __launch_bounds__(128) void k_mla_merge(const float* part, DTensor seq, DTensor kvl, float* ol,
                                                   DecodeDims d) {
    __shared__ float wgt[1024];
    __shared__ float red[MAX_WARPS];
    const int64_t stride = d.Dc + 2;
    for (int64_t bi = blockIdx.x; bi < d.T * d.H; bi += gridDim.x) {
        const int64_t t = bi / d.H;
        int64_t s;
        const int64_t len = decode_len(seq, kvl, d, t, &s);
        const int64_t chunk = decode_chunk(len, d.splits);
        const int active = (int)max((int64_t)1, min((int64_t)d.splits, ceil_div(len, chunk)));
        const float* src = part + bi * d.splits * stride;
        float M = -INFINITY;
        for (int sp = threadIdx.x; sp < active; sp += blockDim.x) M = fmaxf(M, src[sp * stride]);
        M = block_max(M, red);
        float L = 0.f;
        for (int sp = threadIdx.x; sp < active; sp += blockDim.x) {
            const float ms = src[sp * stride];
            const float wv = ms == -INFINITY ? 0.f : expf(ms - M);
            if (sp < 1024) wgt[sp] = wv;
            L += src[sp * stride + 1] * wv;
        }
        L = block_sum(L, red);  // its barriers also publish wgt
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int c = threadIdx.x; c < d.Dc; c += blockDim.x) {
            float o = 0.f;
            for (int sp = 0; sp < active; ++sp) {
                const float wv = sp < 1024 ? wgt[sp] : (src[sp * stride] == -INFINITY ? 0.f : expf(src[sp * stride] - M));
                o += src[sp * stride + 2 + c] * wv;
            }
            ol[bi * d.Dc + c] = o * inv;
        }
        __syncthreads();
    }
}

// out[t, h, j] = sum_c W_uv[h][j, c] * ol[t, h, c]
__global__ __launch_bounds__(256) void k_mla_uv(const float* ol, DTensor w, DTensor out, DecodeDims d, int tt) {
    extern __shared__ float os[];                      // [tt][Dc]
    const int warp = warp_id(), lane = lane_id();
    const int64_t h = blockIdx.x, t0 = (int64_t)blockIdx.z * tt;
    const int nt = (int)min((int64_t)tt, d.T - t0);
    for (int i = threadIdx.x; i < nt * d.Dc; i += blockDim.x) {
        const int t = i / d.Dc, c = i % d.Dc;
        os[i] = ol[((t0 + t) * d.H + h) * d.Dc + c];
    }
    __syncthreads();
    for (int jj = 0; jj < MLA_UV_ROWS / 8; ++jj) {
        const int64_t j = (int64_t)blockIdx.y * MLA_UV_ROWS + warp * (MLA_UV_ROWS / 8) + jj;
        if (j >= d.Dv) break;
        const int64_t ro = (h * (int64_t)(d.Dn + d.Dv) + d.Dn + j) * w.strides[0];
        float acc[MLA_TT];
#pragma unroll
        for (int t = 0; t < MLA_TT; ++t) acc[t] = 0.f;
#pragma unroll 4
        for (int c = lane; c < d.Dc; c += LANES) {
            const float wv = load_f(w.dt, w.base, ro + c);
#pragma unroll
            for (int t = 0; t < MLA_TT; ++t)
                if (t < nt) acc[t] += wv * os[t * d.Dc + c];
        }
#pragma unroll
        for (int t = 0; t < MLA_TT; ++t) {
            if (t >= nt) break;
            const float v = warp_sum(acc[t]);
            if (lane == 0) store_f(out.dt, out.base, (t0 + t) * out.strides[0] + h * out.strides[1] + j, v);
        }
    }
}

#include "mla_decode_bf16.cuh"

// the fast path's three launches (mla_decode_bf16.cuh), TT tokens per qlat / merge_uv block
template <int TT>
static void launch_mla_decode_bf16(const QTensor& q, const QTensor& w, const QTensor& cache, const QTensor& btab,
                                   const QTensor& seq, const QTensor& kvl, const QTensor& out, float* qf, float* part,
                                   const DecodeDims& d, float scale, cudaStream_t s) {
    const unsigned tiles = (unsigned)ceil_div(d.T, TT);
    launch_pdl(k_mla_qlat_bf16<TT>, dim3((unsigned)d.H, (unsigned)(d.Dc / MLAF_COLS), tiles), 256, 0, s, q.q, w.q, qf, d);
    const dim3 grid((unsigned)(d.T * ceil_div(d.H, MLA_HG)), (unsigned)d.splits);
    launch_pdl(k_mla_attn_bf16, grid, 256, 0, s, (const float*)qf, cache.q, btab.q, seq.q, kvl.q, part, d, scale);
    launch_pdl(k_mla_merge_uv_bf16<TT>, dim3((unsigned)d.H, (unsigned)ceil_div(d.Dv, MLAF_UV_ROWS), tiles), 256, 0, s,
               (const float*)part, seq.q, kvl.q, w.q, out.q, d);
}

DI_Status op_mla_decode(DI_Context* ctx, const DI_MLADecodeArgs* a, OpMode* mode) {
    const char* op = "mla_decode";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MLADecodeArgs"));
    QTensor q, w, cache, btab, seq, kvl, out, idx;
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
    // indices (1.3): absent for an older caller (api.cu zeroes what it does not know); in op_query a
    // descriptor with a shape and no data counts as present
    const bool has_idx = a->indices.data || (!mode->launch && a->indices.ndim > 0);
    if (has_idx) {
        DI_TRY(take_tensor(ctx, mode, op, "indices", a->indices, 2, 0, &idx));
        DI_NEED_DT(ctx, op, "indices", idx.q.dt, DT_I32);
        DI_TRY(need_shape(ctx, op, "indices", idx.q, 0, d.T, "q.shape[0]"));
        d.K = idx.q.shape[1];
        if (d.K > clean_indices_max_k())
            return set_error(ctx, DI_UNIMPLEMENTED, "%s: indices has %lld columns, over the %lld this GPU's cleaning sorts",
                             op, (long long)d.K, (long long)clean_indices_max_k());
    }
    if (d.Dc + d.Dr > LANES * ATT_DEC_MAXQ)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: Dc + Dr = %d exceeds this kernel's %d", op, d.Dc + d.Dr,
                         LANES * ATT_DEC_MAXQ);
    // q_nope and o_lat tiles of at least one token must fit a block's shared memory
    if ((int64_t)d.Dn * 4 > 32 * 1024 || (int64_t)d.Dc * 4 > 48 * 1024)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: Dn=%d / Dc=%d too large for this kernel", op, d.Dn, d.Dc);
    // Splits: enough (token, head group, chunk) blocks for two waves at any batch; how many of them
    // work is decided on the device from kv_len (decode_chunk), so the grid never depends on it.
    const int64_t cap = has_idx ? std::min(d.MB * d.BS, d.K) : d.MB * d.BS, TH = d.T * d.H;
    const int64_t TG = d.T * ceil_div(d.H, MLA_HG);  // blocks per split
    const int64_t sms = ctx->sm_count > 0 ? ctx->sm_count : 132;
    int64_t splits = ceil_div(2 * sms, TG > 0 ? TG : 1);
    const int64_t max_useful = ceil_div(cap, MLA_MIN_CHUNK);
    if (splits > max_useful) splits = max_useful;
    if (splits < 1) splits = 1;
    d.splits = (int)splits;
    const uint64_t qf_bytes = align256((uint64_t)TH * (d.Dc + d.Dr) * 4);   // later reused for o_lat
    const uint64_t part_bytes = align256((uint64_t)TH * splits * (d.Dc + 2) * 4);
    const uint64_t clean_bytes = has_idx ? clean_indices_bytes(d.T, d.K) : 0;
    mode->workspace = qf_bytes + part_bytes + clean_bytes;
    if (!mode->launch || TH == 0 || d.Dv == 0) return DI_OK;
    if (TH > (1ll << 31) - 1 || d.H > 65535 * 8)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: T*H = %lld too large", op, (long long)TH);
    cudaStream_t s = (cudaStream_t)a->header.stream;
    Workspace ws;
    DI_TRY(ws.acquire(ctx, a->header, mode->workspace));
    float* qf = static_cast<float*>(ws.ptr);
    float* part = reinterpret_cast<float*>(static_cast<char*>(ws.ptr) + qf_bytes);
    char* clean = static_cast<char*>(ws.ptr) + qf_bytes + part_bytes;
    const int tt_q = (int)std::min<int64_t>(MLA_TT, std::max<int64_t>(1, (32 * 1024) / (std::max(d.Dn, 1) * 4)));
    const int tt_v = (int)std::min<int64_t>(MLA_TT, std::max<int64_t>(1, (48 * 1024) / (std::max(d.Dc, 1) * 4)));
    const size_t sm_q = (size_t)tt_q * std::max(d.Dn, 1) * 4, sm_v = (size_t)tt_v * std::max(d.Dc, 1) * 4;
    DI_Status st = DI_OK;
    if (has_idx) {
        st = launch_clean_indices(ctx, op, idx.q, seq.q, kvl.q, d.S, d.MB * d.BS, 1, clean, s);
        d.list = reinterpret_cast<const int*>(clean);
        d.cnt = reinterpret_cast<const int*>(clean + align256((uint64_t)(d.T * d.K) * 4));
    }
    if (st == DI_OK && mla_decode_bf16_ok(q.q, w.q, cache.q, d)) {
        if (d.T <= 1) launch_mla_decode_bf16<1>(q, w, cache, btab, seq, kvl, out, qf, part, d, a->scale, s);
        else if (d.T <= 2) launch_mla_decode_bf16<2>(q, w, cache, btab, seq, kvl, out, qf, part, d, a->scale, s);
        else if (d.T <= 4) launch_mla_decode_bf16<4>(q, w, cache, btab, seq, kvl, out, qf, part, d, a->scale, s);
        else launch_mla_decode_bf16<MLAF_TT>(q, w, cache, btab, seq, kvl, out, qf, part, d, a->scale, s);
        st = launch_status(ctx, op);
        ws.release();
        return st;
    }
    if (st == DI_OK) {
        dim3 gq((unsigned)d.H, (unsigned)ceil_div(d.Dc, MLA_QCOLS), (unsigned)ceil_div(d.T, tt_q));
        k_mla_qlat<<<gq, 256, sm_q, s>>>(q.q, w.q, qf, d, tt_q);
        st = launch_status(ctx, op);
    }
    if (st == DI_OK) {
        dim3 grid((unsigned)TG, (unsigned)splits);
        const int nq = (int)ceil_div(d.Dc + d.Dr, LANES);
        if (nq <= 4) k_mla_attn<4><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
        else if (nq <= 8) k_mla_attn<8><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
        else if (nq <= 12) k_mla_attn<12><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
        else k_mla_attn<18><<<grid, 256, 0, s>>>(qf, cache.q, btab.q, seq.q, kvl.q, part, d, a->scale);
        st = launch_status(ctx, op);
    }
    if (st == DI_OK) {
        k_mla_merge<<<grid_for(TH, 1, 1 << 20), 128, 0, s>>>(part, seq.q, kvl.q, qf, d);
        st = launch_status(ctx, op);
    }
    if (st == DI_OK) {
        dim3 gv((unsigned)d.H, (unsigned)ceil_div(d.Dv, MLA_UV_ROWS), (unsigned)ceil_div(d.T, tt_v));
        k_mla_uv<<<gv, 256, sm_v, s>>>(qf, w.q, out.q, d, tt_v);
        st = launch_status(ctx, op);
    }
    ws.release();
    return st;
}

// ---------------------------------------------------------------------------------------- mla_cache_write
__global__ void k_cache_write(DTensor lat, DTensor kpe, DTensor slots, DTensor cache, int64_t T, int64_t Dc,
                              int64_t Dr) {
    int64_t NB = cache.shape[0], BS = cache.shape[1];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        int64_t slot = load_i(slots.dt, slots.base, t * slots.strides[0]);
        if (slot < 0 || slot >= NB * BS) continue;  // never write out of bounds
        int64_t base = (slot / BS) * cache.strides[0] + (slot % BS) * cache.strides[1];
        for (int64_t d = threadIdx.x; d < Dc + Dr; d += blockDim.x) {
            float v = d < Dc ? load_f(lat.dt, lat.base, t * lat.strides[0] + d)
                             : load_f(kpe.dt, kpe.base, t * kpe.strides[0] + d - Dc);
            store_f(cache.dt, cache.base, base + d, v);
        }
    }
}

DI_Status op_mla_cache_write(DI_Context* ctx, const DI_MLACacheWriteArgs* a, OpMode* mode) {
    const char* op = "mla_cache_write";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MLACacheWriteArgs"));
    QTensor lat, kpe, slots, cache;
    DI_TRY(take_tensor(ctx, mode, op, "latent", a->latent, 2, 0, &lat));
    DI_TRY(take_tensor(ctx, mode, op, "k_pe", a->k_pe, 2, 0, &kpe));
    DI_TRY(take_tensor(ctx, mode, op, "slots", a->slots, 1, 0, &slots));
    DI_TRY(take_tensor(ctx, mode, op, "cache", a->cache, 3, 0, &cache));
    DI_NEED_DT(ctx, op, "latent", lat.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "k_pe", kpe.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "slots", slots.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "cache", cache.q.dt, FLOATS);
    int64_t T = lat.q.shape[0], Dc = lat.q.shape[1], Dr = kpe.q.shape[1];
    DI_TRY(need_shape(ctx, op, "k_pe", kpe.q, 0, T, "latent.shape[0]"));
    DI_TRY(need_shape(ctx, op, "slots", slots.q, 0, T, "latent.shape[0]"));
    DI_TRY(need_shape(ctx, op, "cache", cache.q, 2, Dc + Dr, "Dc + Dr"));
    if (!mode->launch || T == 0) return DI_OK;
    k_cache_write<<<grid_for(T, 1, 65535), 256, 0, (cudaStream_t)a->header.stream>>>(lat.q, kpe.q, slots.q, cache.q, T,
                                                                                    Dc, Dr);
    return launch_status(ctx, op);
}
