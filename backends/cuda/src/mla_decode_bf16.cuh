// mla_decode's fast path for bf16 weights and cache (the DeepSeek shapes: Dn 128, Dr 64, Dc 512, Dv 128).
// attention.cu includes this after its generic kernels and picks it when mla_decode_bf16_ok() holds.
// Three kernels instead of the generic four, every weight and cache row read with 16- or 4-byte loads:
//   qlat      qf[t, h] = [q_nope[t, h] @ W_uk[h] (Dc), q_pe[t, h] (Dr)]. A block owns one head, 64
//             latent columns and up to 8 tokens: lane % 8 holds 8 columns, the 32 (warp, lane / 8) row
//             groups stride over Dn, so each thread has Dn / 32 independent 16-byte loads in flight.
//   attn      the generic kernel's flash-decoding split (same chunks, same partial states), each lane
//             reading pairs of bf16 cache elements (2 lane + 64 j), and the next position's row loaded
//             before the current one is used.
//   merge_uv  the chunk merge fused into out[t, h] = W_uv[h] @ o_lat[t, h]: a block owns one head, 16
//             value rows and up to 8 tokens; it merges its tokens' chunks into shared memory itself (a
//             few KB from L2), so o_lat never goes through memory and one launch is saved.
#pragma once

#include "mla_decode.cuh"
#include "pdl.cuh"
#include "vec8.cuh"

namespace di {

constexpr int MLAF_TT = 8;          // tokens per qlat / merge_uv block
constexpr int MLAF_COLS = 64;       // latent columns per qlat block
constexpr int MLAF_MAXDN = 256;     // q_nope dims the qlat block keeps in shared memory
constexpr int MLAF_MAXDC = 512;     // latent dims merge_uv keeps per token
constexpr int MLAF_UV_ROWS = 16;    // value rows per merge_uv block (2 per warp)
constexpr int MLAF_NP = 9;          // bf16 pairs per lane in attn: Dc + Dr <= 576
constexpr int MLAF_MAX_SPLITS = 512;

__device__ __forceinline__ float bf16_at(const char* base, int64_t e) {
    return bf16_to_f(reinterpret_cast<const uint16_t*>(base)[e]);
}

template <int TT>
__global__ __launch_bounds__(256) void k_mla_qlat_bf16(DTensor q, DTensor w, float* qf, DecodeDims d) {
    __shared__ float qs[TT][MLAF_MAXDN];
    __shared__ float red[8][TT][MLAF_COLS];
    const int warp = warp_id(), lane = lane_id();
    const int64_t h = blockIdx.x, c0 = (int64_t)blockIdx.y * MLAF_COLS, t0 = (int64_t)blockIdx.z * TT;
    // this block's W_uk rows (128 bytes of each: MLAF_COLS bf16) into L2 before the wait: no kernel writes them
    for (int k = threadIdx.x; k < d.Dn; k += blockDim.x)
        prefetch_l2(w.base + ((h * (int64_t)(d.Dn + d.Dv) + k) * w.strides[0] + c0) * 2);
    pdl_wait();
    pdl_trigger();
    const int Dk = d.Dc + d.Dr;
    const int nt = (int)min((int64_t)TT, d.T - t0);
    for (int i = threadIdx.x; i < TT * d.Dn; i += blockDim.x) {
        const int t = i / d.Dn, k = i % d.Dn;
        qs[t][k] = t < nt ? bf16_at(q.base, (t0 + t) * q.strides[0] + h * q.strides[1] + k) : 0.f;
    }
    __syncthreads();
    const int cv = lane & 7, kr = warp * 4 + (lane >> 3);
    float acc[TT][8];
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t][i] = 0.f;
    const int64_t wrow0 = h * (int64_t)(d.Dn + d.Dv);
    const int64_t col = c0 + cv * 8;
#pragma unroll 4
    for (int k = kr; k < d.Dn; k += 32) {
        float w8[8];
        load8<DT_BF16>(w.base, (wrow0 + k) * w.strides[0] + col, w8);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            const float qv = qs[t][k];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[t][i] += qv * w8[i];
        }
    }
    // the four row groups of a warp hold lanes l, l ^ 8, l ^ 16, l ^ 24
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[t][i] += shfl_xor(acc[t][i], 8);
            acc[t][i] += shfl_xor(acc[t][i], 16);
        }
    if (lane < 8) {
#pragma unroll
        for (int t = 0; t < TT; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i) red[warp][t][cv * 8 + i] = acc[t][i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nt * MLAF_COLS; i += blockDim.x) {
        const int t = i / MLAF_COLS, c = i % MLAF_COLS;
        float s = 0.f;
#pragma unroll
        for (int wp = 0; wp < 8; ++wp) s += red[wp][t][c];
        qf[((t0 + t) * d.H + h) * Dk + c0 + c] = s;
    }
    if (blockIdx.y == 0) {   // the rope part is q's own
        for (int i = threadIdx.x; i < nt * d.Dr; i += blockDim.x) {
            const int t = i / d.Dr, r = i % d.Dr;
            qf[((t0 + t) * d.H + h) * Dk + d.Dc + r] =
                bf16_at(q.base, (t0 + t) * q.strides[0] + h * q.strides[1] + d.Dn + r);
        }
    }
}

// One cache row (position i of token t's list, sequence s) as bf16 pairs: lane holds elements
// 2 (lane + 32 j) and + 1. False for a hole in the block table (masked, never read).
__device__ __forceinline__ bool mla_row_bf16(const DTensor& cache, const DTensor& btab, const DecodeDims& d,
                                             int64_t s, int64_t t, int64_t i, int lane, uint32_t* kv) {
    const int64_t p = d.list ? d.list[t * d.K + i] : i;
    const int64_t blk = load_i(btab.dt, btab.base, s * btab.strides[0] + p / d.BS);
    if (blk < 0 || blk >= d.NB) return false;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(cache.base + (blk * cache.strides[0] + (p % d.BS) * cache.strides[1]) * 2);
    const int Dk = d.Dc + d.Dr;
#pragma unroll
    for (int j = 0; j < MLAF_NP; ++j) {
        const int k0 = 2 * (lane + LANES * j);
        kv[j] = k0 < Dk ? __ldg(row + k0 / 2) : 0u;
    }
    return true;
}

// partial[(t*H + h) * splits + split] = [m, l, o (Dc)], as k_mla_attn writes it.
__global__ __launch_bounds__(256) void k_mla_attn_bf16(const float* qf, DTensor cache, DTensor btab, DTensor seq,
                                                       DTensor kvl, float* part, DecodeDims d, float scale) {
    __shared__ float sm_m[8][MLA_HG], sm_l[8][MLA_HG];
    __shared__ float sm_o[8][2 * MLAF_NP * LANES];
    __shared__ float sm_q[MLA_HG][2 * MLAF_NP * LANES];
    pdl_wait();
    pdl_trigger();
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
    for (int i = threadIdx.x; i < MLA_HG * 2 * MLAF_NP * LANES; i += blockDim.x) {
        const int g = i / (2 * MLAF_NP * LANES), k = i % (2 * MLAF_NP * LANES);
        sm_q[g][k] = (g < ng && k < Dk) ? qf[(t * d.H + h0 + g) * Dk + k] : 0.f;
    }
    __syncthreads();
    float m[MLA_HG], l[MLA_HG], acc[MLA_HG][2 * MLAF_NP];
#pragma unroll
    for (int g = 0; g < MLA_HG; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int r = 0; r < 2 * MLAF_NP; ++r) acc[g][r] = 0.f;
    }
    uint32_t cur[MLAF_NP] = {}, nxt[MLAF_NP] = {};
    int64_t i = p0 + warp;
    bool have = i < p1 && mla_row_bf16(cache, btab, d, s, t, i, lane, cur);
    while (i < p1) {
        const int64_t in = i + 8;
        const bool hn = in < p1 && mla_row_bf16(cache, btab, d, s, t, in, lane, nxt);
        if (have) {
            float kvv[2 * MLAF_NP];
#pragma unroll
            for (int j = 0; j < MLAF_NP; ++j) {
                kvv[2 * j] = __uint_as_float(cur[j] << 16);
                kvv[2 * j + 1] = __uint_as_float(cur[j] & 0xffff0000u);
            }
#pragma unroll
            for (int g = 0; g < MLA_HG; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < MLAF_NP; ++j) {
                    const int k0 = 2 * (lane + LANES * j);
                    dot += sm_q[g][k0] * kvv[2 * j] + sm_q[g][k0 + 1] * kvv[2 * j + 1];
                }
                const float sc = warp_sum(dot) * scale;
                const float mn = fmaxf(m[g], sc), corr = expf(m[g] - mn), pj = expf(sc - mn);
                l[g] = l[g] * corr + pj;
#pragma unroll
                for (int j = 0; j < MLAF_NP; ++j) {
                    if (2 * (lane + LANES * j) < d.Dc) {   // Dc is even: both of the pair are latent
                        acc[g][2 * j] = acc[g][2 * j] * corr + pj * kvv[2 * j];
                        acc[g][2 * j + 1] = acc[g][2 * j + 1] * corr + pj * kvv[2 * j + 1];
                    }
                }
                m[g] = mn;
            }
        }
#pragma unroll
        for (int j = 0; j < MLAF_NP; ++j) cur[j] = nxt[j];
        have = hn;
        i = in;
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
        for (int j = 0; j < MLAF_NP; ++j) {
            const int k0 = 2 * (lane + LANES * j);
            if (k0 < d.Dc) {
                sm_o[warp][k0] = acc[g][2 * j];
                sm_o[warp][k0 + 1] = acc[g][2 * j + 1];
            }
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

// out[t, h, j] = sum_c W_uv[h][j, c] * o_lat[t, h, c], o_lat merged here from the chunks' states
template <int TT>
__global__ __launch_bounds__(256) void k_mla_merge_uv_bf16(const float* part, DTensor seq, DTensor kvl, DTensor w,
                                                           DTensor out, DecodeDims d) {
    __shared__ __align__(16) float ol[TT][MLAF_MAXDC];
    __shared__ float wgt[TT][MLAF_MAX_SPLITS];
    __shared__ float inv[TT];
    __shared__ int nact[TT];
    const int warp = warp_id(), lane = lane_id();
    const int64_t h = blockIdx.x, t0 = (int64_t)blockIdx.z * TT;
    {   // this block's W_uv rows into L2 before the wait (no kernel writes them): 128-byte lines
        const int64_t lines = (int64_t)d.Dc * 2 / 128;
        for (int64_t i = threadIdx.x; i < MLAF_UV_ROWS * lines; i += blockDim.x) {
            const int64_t j = (int64_t)blockIdx.y * MLAF_UV_ROWS + i / lines;
            if (j < d.Dv)
                prefetch_l2(w.base + ((h * (int64_t)(d.Dn + d.Dv) + d.Dn + j) * w.strides[0] + (i % lines) * 64) * 2);
        }
    }
    pdl_wait();
    pdl_trigger();
    const int nt = (int)min((int64_t)TT, d.T - t0);
    const int64_t stride = d.Dc + 2;
    // warp t: the merge weights of token t's active chunks
    for (int t = warp; t < nt; t += 8) {
        int64_t s;
        const int64_t len = decode_len(seq, kvl, d, t0 + t, &s);
        const int64_t chunk = decode_chunk(len, d.splits);
        const int active = (int)max((int64_t)1, min((int64_t)d.splits, ceil_div(len, chunk)));
        const float* src = part + ((t0 + t) * d.H + h) * d.splits * stride;
        float M = -INFINITY;
        for (int sp = lane; sp < active; sp += LANES) M = fmaxf(M, src[sp * stride]);
        M = warp_max(M);
        float L = 0.f;
        for (int sp = lane; sp < active; sp += LANES) {
            const float ms = src[sp * stride];
            const float wv = ms == -INFINITY ? 0.f : expf(ms - M);
            wgt[t][sp] = wv;
            L += src[sp * stride + 1] * wv;
        }
        L = warp_sum(L);
        if (lane == 0) {
            inv[t] = L > 0.f ? 1.f / L : 0.f;
            nact[t] = active;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nt * d.Dc; i += blockDim.x) {
        const int t = i / d.Dc, c = i % d.Dc;
        const float* src = part + ((t0 + t) * d.H + h) * d.splits * stride + 2 + c;
        const int n = nact[t];
        float o = 0.f;
        int sp = 0;
        for (; sp + 4 <= n; sp += 4) {   // four loads in flight; the sum keeps chunk order
            const float a0 = src[sp * stride], a1 = src[(sp + 1) * stride];
            const float a2 = src[(sp + 2) * stride], a3 = src[(sp + 3) * stride];
            o += a0 * wgt[t][sp];
            o += a1 * wgt[t][sp + 1];
            o += a2 * wgt[t][sp + 2];
            o += a3 * wgt[t][sp + 3];
        }
        for (; sp < n; ++sp) o += src[sp * stride] * wgt[t][sp];
        ol[t][c] = o * inv[t];
    }
    __syncthreads();
#pragma unroll
    for (int jj = 0; jj < MLAF_UV_ROWS / 8; ++jj) {
        const int64_t j = (int64_t)blockIdx.y * MLAF_UV_ROWS + warp * (MLAF_UV_ROWS / 8) + jj;
        if (j >= d.Dv) break;
        const int64_t ro = (h * (int64_t)(d.Dn + d.Dv) + d.Dn + j) * w.strides[0];
        float acc[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[t] = 0.f;
        for (int c = lane * 8; c < d.Dc; c += LANES * 8) {
            float w8[8];
            load8<DT_BF16>(w.base, ro + c, w8);
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                const float4 a = *reinterpret_cast<const float4*>(&ol[t][c]);
                const float4 b = *reinterpret_cast<const float4*>(&ol[t][c + 4]);
                acc[t] += w8[0] * a.x + w8[1] * a.y + w8[2] * a.z + w8[3] * a.w + w8[4] * b.x + w8[5] * b.y +
                          w8[6] * b.z + w8[7] * b.w;
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t >= nt) break;
            const float v = warp_sum(acc[t]);
            if (lane == 0) store_f(out.dt, out.base, (t0 + t) * out.strides[0] + h * out.strides[1] + j, v);
        }
    }
}

// The shapes and layouts the fast path takes (host side); the generic kernels take everything else.
inline bool mla_decode_bf16_ok(const DTensor& q, const DTensor& w, const DTensor& cache, const DecodeDims& d) {
    if (q.dt != DT_BF16 || w.dt != DT_BF16 || cache.dt != DT_BF16) return false;
    if (q.strides[2] != 1 || cache.strides[2] != 1 || cache.strides[1] % 2 || cache.strides[0] % 2) return false;
    if (reinterpret_cast<uintptr_t>(cache.base) % 4) return false;
    if (!vec8_rows(w)) return false;
    if (d.Dn % 32 || d.Dn > MLAF_MAXDN || d.Dc % MLAF_COLS || d.Dc > MLAF_MAXDC || d.Dr % 2) return false;
    if (d.Dc + d.Dr > 2 * MLAF_NP * LANES || d.splits > MLAF_MAX_SPLITS) return false;
    return true;
}

}  // namespace di
