// Device code of kv_compress, indexer_topk and sparse_attention (ABI 1.3, V4 / V3.2), and of the
// index cleaning that sparse_attention and mla_decode run on their `indices`. The host side is sparse.cu, the only translation unit
// that includes this header (its __global__ functions have external linkage); tests/gpu_emu includes
// it too and runs these very kernels on the CPU, one emulated block at a time.
#pragma once

#include "kernel_util.cuh"

namespace di {

// ---------------------------------------------------------------------------------------- indices
// sparse_attention's and mla_decode's `indices` rows, cleaned once so the attention kernels never
// look at a bad or repeated entry: row t keeps the distinct entries in [0, limit) ascending (limit =
// kv_len[t] / ratio), in list[t, 0 .. cnt[t]). Ascending order also walks the cache in address
// order. One block per row; a[] is d.P words of dynamic shared memory.
struct CleanDims {
    int64_t T, K, S, cap;
    int32_t ratio, P;   // P: the power of two >= K that the sort works on
};

__global__ __launch_bounds__(1024) void k_clean_indices(DTensor idx, DTensor seq, DTensor kvl, int* list, int* cnt,
                                                        CleanDims d) {
    DI_DYN_SMEM(uint64_t, a);
    __shared__ int red[MAX_WARPS];
    const uint64_t NONE = ~0ull;   // invalid entries sort last
    for (int64_t t = blockIdx.x; t < d.T; t += gridDim.x) {
        int64_t s;
        const int64_t lim = row_len(seq, kvl, t, d.S, d.cap, &s) / d.ratio;
        for (int i = threadIdx.x; i < d.P; i += blockDim.x) {
            const int64_t v = i < d.K ? load_i(idx.dt, idx.base, t * idx.strides[0] + i) : -1;
            a[i] = v >= 0 && v < lim ? (uint64_t)v : NONE;
        }
        bitonic_sort_u64(a, d.P);
        int kept = 0;
        for (int64_t i0 = 0; i0 < d.K; i0 += blockDim.x) {
            const int64_t i = i0 + threadIdx.x;
            const bool keep = i < d.K && a[i] != NONE && (i == 0 || a[i] != a[i - 1]);
            int total;
            const int rank = block_scan_incl(keep ? 1 : 0, &total, red);
            if (keep) list[t * d.K + kept + rank - 1] = (int)a[i];
            kept += total;
        }
        if (threadIdx.x == 0) cnt[t] = kept;
        __syncthreads();   // a[] is refilled for the next row
    }
}

// ---------------------------------------------------------------------------------------- kv_compress
// One thread per (row, feature): rows whose position does not close a window write zeros; a closing
// row's feature is an online softmax over its ratio (overlap 0) or 2 * ratio (overlap 1) slots, read
// straight from the paged staging cache (adjacent features are adjacent addresses: coalesced).
struct CompressDims {
    int64_t T, D, W, S, NB, BS;
    int32_t ratio, overlap;
};

__device__ __forceinline__ float kv_compress_feature(const DTensor& st, const DTensor& pb, const DTensor& btab,
                                                     const DTensor& seq, const DTensor& pos, const CompressDims& d,
                                                     int64_t t, int64_t f) {
    const int64_t p = load_i(pos.dt, pos.base, t * pos.strides[0]);
    const int64_t s = load_i(seq.dt, seq.base, t * seq.strides[0]);
    if (s < 0 || s >= d.S || p < 0 || (p + 1) % d.ratio != 0) return 0.f;
    const int64_t w = (p + 1) / d.ratio - 1;
    float m = -INFINITY, l = 0.f, acc = 0.f;
    // half 0 (overlap only): window w - 1, first halves (columns f, bias f); half 1: window w, second
    // halves with overlap (columns D + f) or the whole row without (columns f)
    for (int half = d.overlap ? 0 : 1; half < 2; ++half) {
        const int64_t win = half == 0 ? w - 1 : w;
        if (win < 0) continue;   // window 0 has no previous window: those slots are absent
        const int64_t col = d.overlap && half == 1 ? d.D + f : f;
        for (int i = 0; i < d.ratio; ++i) {
            const int64_t q = win * d.ratio + i;
            const int64_t blk = page_of(btab, s, q / d.BS, d.NB);
            if (blk < 0) continue;
            const int64_t row = blk * st.strides[0] + (q % d.BS) * st.strides[1];
            const float logit = load_f(st.dt, st.base, row + d.W + col) + load_f(pb.dt, pb.base, i * pb.strides[0] + col);
            const float mn = fmaxf(m, logit);
            if (mn == -INFINITY) continue;   // only -inf so far: nothing to weigh
            const float corr = expf(m - mn), pj = expf(logit - mn);
            l = l * corr + pj;
            acc = acc * corr + pj * load_f(st.dt, st.base, row + col);
            m = mn;
        }
    }
    return l > 0.f ? acc / l : 0.f;
}

__global__ __launch_bounds__(256) void k_kv_compress(DTensor st, DTensor pb, DTensor btab, DTensor seq, DTensor pos,
                                                     DTensor out, CompressDims d) {
    const int64_t n = d.T * d.D;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / d.D, f = i % d.D;
        store_f(out.dt, out.base, t * out.strides[0] + f, kv_compress_feature(st, pb, btab, seq, pos, d, t, f));
    }
}

// ---------------------------------------------------------------------------------------- indexer_topk
// Scores: per row t, S[h, e] = q[t, h] . key_e is a small GEMM (NI x n x Di), done as 64 x 64 SIMT
// tiles (tile_mm.cuh) of heads x entries; the epilogue folds relu, weights[t, h] and the sum over
// heads, so a block writes 64 finished scores to the workspace. Top-k: one block per row selects
// the K best in shared memory (select_smallest, then a bitonic sort of the K winners by (score
// descending, entry ascending): the ABI's tie rule, exactly).
struct IndexerDims {
    int64_t T, NI, Di, S, NB, CB, bs, cap, maxN, K;
    int32_t ratio, P;
    float   scale;
    int32_t pad_;
};

__global__ __launch_bounds__(256) void k_index_scores(DTensor q, DTensor w, DTensor keys, DTensor btab, DTensor seq,
                                                      DTensor kvl, float* scores, IndexerDims d) {
    __shared__ float As[TK][TB + TPAD], Bs[TK][TB + TPAD];
    __shared__ int64_t koff[TB];
    __shared__ float red[16][TB + 1];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int64_t e0 = (int64_t)blockIdx.x * TB;
    for (int64_t t = blockIdx.y; t < d.T; t += gridDim.y) {
        int64_t s;
        const int64_t n = row_len(seq, kvl, t, d.S, d.cap, &s) / d.ratio;
        if (e0 >= n) continue;   // the same for the whole block
        if (tid < TB) {
            const int64_t e = e0 + tid;
            int64_t o = -1;   // an entry in a hole of the block table has the key 0 (score 0)
            if (e < n) {
                const int64_t pe = (e + 1) * d.ratio - 1, slot = (pe % d.bs) / d.ratio;
                const int64_t blk = page_of(btab, s, pe / d.bs, d.NB);
                if (blk >= 0 && slot < d.CB) o = blk * keys.strides[0] + slot * keys.strides[1];
            }
            koff[tid] = o;
        }
        __syncthreads();
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        const int64_t qrow = t * q.strides[0];
        for (int64_t h0 = 0; h0 < d.NI; h0 += TB) {
            float acc[4][4] = {};
            auto la = [&](int r, int64_t k) {
                return h0 + r < d.NI ? load_f(q.dt, q.base, qrow + (h0 + r) * q.strides[1] + k) : 0.f;
            };
            auto lb = [&](int r, int64_t k) {
                const int64_t o = koff[r];
                return o >= 0 ? load_f(keys.dt, keys.base, o + k) : 0.f;
            };
            tile_mm(la, lb, d.Di, acc, As, Bs);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int64_t h = h0 + ty * 4 + i;
                const float wv = h < d.NI ? load_f(w.dt, w.base, t * w.strides[0] + h) : 0.f;
#pragma unroll
                for (int j = 0; j < 4; ++j) part[j] += wv * fmaxf(acc[i][j], 0.f);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) red[ty][tx * 4 + j] = part[j];
        __syncthreads();
        if (tid < TB && e0 + tid < n) {
            float sum = 0.f;
            for (int yy = 0; yy < 16; ++yy) sum += red[yy][tid];
            scores[t * d.maxN + e0 + tid] = d.scale * sum;
        }
        __syncthreads();   // koff and red are rewritten for the next row
    }
}

__global__ __launch_bounds__(512) void k_index_topk(const float* scores, DTensor seq, DTensor kvl, DTensor out,
                                                    IndexerDims d) {
    DI_DYN_SMEM(uint64_t, sel);   // d.P words
    __shared__ SelectSmem sm;
    for (int64_t t = blockIdx.x; t < d.T; t += gridDim.x) {
        int64_t s;
        const int64_t n = row_len(seq, kvl, t, d.S, d.cap, &s) / d.ratio;
        const int want = (int)min64(d.K, n);
        const float* row = scores + t * d.maxN;
        select_smallest([&](int64_t i) { return desc_key(row[i]); }, n, want, sel, sm);
        const int P = pow2_at_least(want);
        for (int i = want + threadIdx.x; i < P; i += blockDim.x) sel[i] = ~0ull;
        bitonic_sort_u64(sel, P);
        int32_t* o = reinterpret_cast<int32_t*>(out.base) + t * out.strides[0];
        for (int64_t i = threadIdx.x; i < d.K; i += blockDim.x) o[i] = i < want ? (int32_t)(sel[i] & 0xffffffffu) : -1;
        __syncthreads();   // sel is refilled for the next row
    }
}

// ---------------------------------------------------------------------------------------- sparse_attention
// MQA over one shared key = value per position: the heads of a token read the same keys, so a block
// serves SP_HG heads of one token and each key it loads feeds all of them. One warp per key (the
// lanes hold D / LANES dims of it), an online softmax per head and warp, merged across the block's
// warps into a partial state per key chunk (flash-decoding: the chunks follow each row's key count
// on the device, with the grid fixed, so graph replay keeps working); k_sparse_merge combines the
// chunks and the sink. Row t's keys j < nwin are window positions lo + j; the rest are compressed
// entries: all visible ones in order, or the cleaned list of `indices` (k_clean_indices).
struct SparseDims {
    int64_t T, NH, S, MB, NB, BS, NBc, CB, K;   // K: columns of indices
    int32_t D, window, ratio, has_comp, has_idx, splits;   // has_idx 0: every visible entry
    float   scale;
    int32_t pad_;
};
constexpr int SP_HG = 4, SP_WARPS = 8, SP_MIN_CHUNK = 16, SP_MAX_SPLITS = 256;

struct SparseRow {
    int64_t s, L, lo, nwin, n;
};

__device__ __forceinline__ SparseRow sparse_row(const DTensor& seq, const DTensor& kvl, const int* cnt,
                                                const SparseDims& d, int64_t t) {
    SparseRow r;
    r.L = row_len(seq, kvl, t, d.S, d.MB * d.BS, &r.s);
    r.lo = d.window > 0 ? max64(0, r.L - d.window) : 0;
    r.nwin = r.L - r.lo;
    const int64_t nc = !d.has_comp ? 0 : d.has_idx ? cnt[t] : r.L / d.ratio;
    r.n = r.nwin + nc;
    return r;
}

// Key j of row t: its element offset in kv_cache (*comp = false) or comp_cache (true), -1 in a hole.
__device__ __forceinline__ int64_t sparse_key(const SparseRow& r, int64_t j, int64_t t, const DTensor& btab,
                                              const DTensor& kv, const DTensor& cc, const int* list,
                                              const SparseDims& d, bool* comp) {
    if (j < r.nwin) {
        *comp = false;
        const int64_t p = r.lo + j, blk = page_of(btab, r.s, p / d.BS, d.NB);
        return blk < 0 ? -1 : blk * kv.strides[0] + (p % d.BS) * kv.strides[1];
    }
    *comp = true;
    const int64_t i = j - r.nwin, e = d.has_idx ? list[t * d.K + i] : i;
    const int64_t pe = (e + 1) * d.ratio - 1, slot = (pe % d.BS) / d.ratio;   // the entry's slot (kv_compress)
    const int64_t blk = page_of(btab, r.s, pe / d.BS, d.NBc);
    return blk < 0 || slot >= d.CB ? -1 : blk * cc.strides[0] + slot * cc.strides[1];
}

// keys per chunk for a row of n keys: the fixed number of splits shares them in multiples of
// SP_MIN_CHUNK; chunks at or past n are inactive (neither written nor merged)
__host__ __device__ __forceinline__ int64_t sparse_chunk(int64_t n, int splits) {
    const int64_t c = ceil_div(n, (int64_t)splits);
    return c < SP_MIN_CHUNK ? SP_MIN_CHUNK : ceil_div(c, SP_MIN_CHUNK) * SP_MIN_CHUNK;
}

// part[((t * NH + h) * splits + split) * (D + 2)] = [m, l, o (D)] over the keys of one chunk
template <int NQ>
__global__ __launch_bounds__(SP_WARPS * LANES) void k_sparse_attn(DTensor q, DTensor kv, DTensor cc, DTensor btab,
                                                                  DTensor seq, DTensor kvl, const int* list,
                                                                  const int* cnt, float* part, SparseDims d) {
    __shared__ float sm_m[SP_WARPS][SP_HG], sm_l[SP_WARPS][SP_HG];
    __shared__ float sm_o[SP_WARPS][NQ * LANES];
    __shared__ float sm_q[SP_HG][NQ * LANES];
    const int warp = warp_id(), lane = lane_id();
    const int64_t groups = ceil_div(d.NH, (int64_t)SP_HG);
    const int64_t t = blockIdx.x / groups, h0 = (blockIdx.x % groups) * SP_HG;
    const int split = blockIdx.y;
    const int ng = (int)min64(SP_HG, d.NH - h0);
    const SparseRow row = sparse_row(seq, kvl, cnt, d, t);
    const int64_t chunk = sparse_chunk(row.n, d.splits);
    const int64_t j0 = split * chunk, j1 = min64(row.n, j0 + chunk);
    if (j0 >= row.n && split > 0) return;   // inactive chunk (chunk 0 always reports, even for no keys)
    for (int i = threadIdx.x; i < SP_HG * NQ * LANES; i += blockDim.x) {
        const int g = i / (NQ * LANES), k = i % (NQ * LANES);
        sm_q[g][k] = g < ng && k < d.D ? load_f(q.dt, q.base, t * q.strides[0] + (h0 + g) * q.strides[1] + k) : 0.f;
    }
    __syncthreads();
    float m[SP_HG], l[SP_HG], acc[SP_HG][NQ];
#pragma unroll
    for (int g = 0; g < SP_HG; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int r = 0; r < NQ; ++r) acc[g][r] = 0.f;
    }
    for (int64_t j = j0 + warp; j < j1; j += SP_WARPS) {
        bool comp;
        const int64_t off = sparse_key(row, j, t, btab, kv, cc, list, d, &comp);
        if (off < 0) continue;   // a hole: the same for the whole warp
        // base and dtype by value: a reference to either parameter struct would copy both to the stack
        const char* src = comp ? cc.base : kv.base;
        const int sdt = comp ? cc.dt : kv.dt;
        float kvv[NQ];
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
            const int k = lane + LANES * r;
            kvv[r] = k < d.D ? load_f(sdt, src, off + k) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < SP_HG; ++g) {
            if (g < ng) {   // a guard, not a break (see k_hc_mix)
                float dot = 0.f;
#pragma unroll
                for (int r = 0; r < NQ; ++r) dot += sm_q[g][lane + LANES * r] * kvv[r];
                const float sc = warp_sum(dot) * d.scale;
                const float mn = fmaxf(m[g], sc), corr = expf(m[g] - mn), pj = expf(sc - mn);
                l[g] = l[g] * corr + pj;
#pragma unroll
                for (int r = 0; r < NQ; ++r) acc[g][r] = acc[g][r] * corr + pj * kvv[r];
                m[g] = mn;
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < SP_HG; ++g) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < SP_HG; ++g) {
        __syncthreads();
#pragma unroll
        for (int r = 0; r < NQ; ++r) {
            const int k = lane + LANES * r;
            if (k < d.D) sm_o[warp][k] = acc[g][r];
        }
        __syncthreads();
        if (g >= ng) continue;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < SP_WARPS; ++w) M = fmaxf(M, sm_m[w][g]);
        float wgt[SP_WARPS], L = 0.f;
#pragma unroll
        for (int w = 0; w < SP_WARPS; ++w) {
            wgt[w] = sm_m[w][g] == -INFINITY ? 0.f : expf(sm_m[w][g] - M);
            L += sm_l[w][g] * wgt[w];
        }
        float* dst = part + ((t * d.NH + h0 + g) * d.splits + split) * (int64_t)(d.D + 2);
        if (threadIdx.x == 0) {
            dst[0] = M;
            dst[1] = L;
        }
        for (int k = threadIdx.x; k < d.D; k += blockDim.x) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < SP_WARPS; ++w) o += sm_o[w][k] * wgt[w];
            dst[2 + k] = o;
        }
    }
}

// out[t, h] = the active chunks' states merged, with the sink's exp(sink - max) in the denominator
// and no value; a row without keys is zero (with or without a sink).
__global__ __launch_bounds__(128) void k_sparse_merge(const float* part, DTensor seq, DTensor kvl, const int* cnt,
                                                      DTensor sinks, DTensor out, SparseDims d) {
    __shared__ float wgt[SP_MAX_SPLITS];
    __shared__ float red[MAX_WARPS];
    const int64_t stride = d.D + 2;
    for (int64_t bi = blockIdx.x; bi < d.T * d.NH; bi += gridDim.x) {
        const int64_t t = bi / d.NH, h = bi % d.NH;
        const SparseRow row = sparse_row(seq, kvl, cnt, d, t);
        const int64_t chunk = sparse_chunk(row.n, d.splits);
        const int active = (int)max64(1, min64(d.splits, ceil_div(row.n, chunk)));
        const float* src = part + bi * d.splits * stride;
        const float sink = sinks.base ? load_f(sinks.dt, sinks.base, h * sinks.strides[0]) : -INFINITY;
        float M = -INFINITY;
        for (int sp = threadIdx.x; sp < active; sp += blockDim.x) M = fmaxf(M, src[sp * stride]);
        M = fmaxf(block_max(M, red), sink);
        float L = 0.f;
        for (int sp = threadIdx.x; sp < active; sp += blockDim.x) {
            const float ms = src[sp * stride];
            const float wv = ms == -INFINITY ? 0.f : expf(ms - M);
            wgt[sp] = wv;
            L += src[sp * stride + 1] * wv;
        }
        L = block_sum(L, red);   // its barriers also publish wgt
        if (sink > -INFINITY) L += expf(sink - M);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int64_t k = threadIdx.x; k < d.D; k += blockDim.x) {
            float o = 0.f;
            for (int sp = 0; sp < active; ++sp) o += src[sp * stride + 2 + k] * wgt[sp];
            store_f(out.dt, out.base, t * out.strides[0] + h * out.strides[1] + k, o * inv);
        }
        __syncthreads();   // wgt is rewritten for the next row
    }
}

}  // namespace di
