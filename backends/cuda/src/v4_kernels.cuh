// Device code of the ABI 1.3 ops (DeepSeek V4 and V3.2): hc_pre, hc_post, kv_compress,
// indexer_topk, sparse_attention, layernorm, and the index cleaning that sparse_attention and
// mla_decode run on their `indices`. The host side is ops_v4.cu, the only translation unit that
// includes this header (its __global__ functions have external linkage); tests/gpu_emu includes it
// too and runs these very kernels on the CPU, one emulated block at a time.
//
// Nothing here reads a device value on the host or allocates: every per-row length, block-table
// entry and index is read on the device, and a bad one (a hole in the block table, a sequence id
// outside it, a kv_len past the table) is skipped or clamped, never read out of bounds, because a
// device library cannot report it without a sync (abi/README.md section 8).
#pragma once

#include "device.cuh"
#include "tile_mm.cuh"

// Dynamic shared memory. The emulation has no per-launch shared memory, so it hands out one buffer
// (host_emu.h), which is all one emulated block needs.
#if defined(DI_GPU_HOST_EMU)
#define DI_DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(di_emu::dyn_smem())
#else
#define DI_DYN_SMEM(T, name)                       \
    extern __shared__ uint64_t di_v4_dyn_smem_[];  \
    T* name = reinterpret_cast<T*>(di_v4_dyn_smem_)
#endif

namespace di {

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int pow2_at_least(int64_t n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}
__device__ __forceinline__ float sigmoidf_(float v) { return 1.f / (1.f + expf(-v)); }

// ---------------------------------------------------------------------------------------- paging
// Physical block of logical block b of sequence s, or -1 for a hole: past the table's MB columns, or
// an entry outside [0, nb). Callers skip holes.
__device__ __forceinline__ int64_t page_of(const DTensor& btab, int64_t s, int64_t b, int64_t nb) {
    if (b < 0 || b >= btab.shape[1]) return -1;
    const int64_t blk = load_i(btab.dt, btab.base, s * btab.strides[0] + b);
    return blk >= 0 && blk < nb ? blk : -1;
}

// kv_len[t] clamped to [0, cap] (cap: the positions the block table can hold), and the row's
// sequence in *s_out; a row whose token_seq is no row of the table sees nothing.
__device__ __forceinline__ int64_t row_len(const DTensor& seq, const DTensor& kvl, int64_t t, int64_t S, int64_t cap,
                                           int64_t* s_out) {
    const int64_t s = load_i(seq.dt, seq.base, t * seq.strides[0]);
    int64_t len = load_i(kvl.dt, kvl.base, t * kvl.strides[0]);
    if (s < 0 || s >= S || len < 0) len = 0;
    *s_out = s;
    return min64(len, cap);
}

// ---------------------------------------------------------------------------------------- sorting
// Ascending bitonic sort of a[0, n) in shared memory, n a power of two. Every thread of the block
// calls it; it begins and ends with a barrier, so the caller may fill a[] just before and read it
// just after.
__device__ __forceinline__ void bitonic_sort_u64(uint64_t* a, int n) {
    __syncthreads();
    for (int k = 2; k <= n; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const uint64_t x = a[i], y = a[l];
                    if ((x > y) == ((i & k) == 0)) {   // ascending where bit k of i is 0
                        a[i] = y;
                        a[l] = x;
                    }
                }
            }
            __syncthreads();
        }
}

// Radix key of a score: ascending unsigned order is descending score order (-0 ranks as +0, NaN
// first, as torch.topk ranks it largest).
__device__ __forceinline__ uint32_t desc_key(float f) {
    uint32_t u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}

struct SelectSmem {
    int hist[256];
    int digit, rem, count;
    int red[MAX_WARPS];
};

// The `want` smallest composite keys (key(i) << 32 | i) over i < n: the smallest keys, ties to the
// lower i (every composite is distinct). Written to sel[0, want) in no particular order.
// An MSB-first radix select (4 passes of 8 bits over key()) finds the want-th smallest key value kth
// and how many of its copies belong to the set; a last pass in index order takes every key below kth
// and, numbered by a block scan, the first copies of kth. key() is evaluated again in each pass (it
// reads global memory, and staging n keys would need n words of shared memory). Every thread calls
// it; it ends with a barrier.
template <class KeyF>
__device__ void select_smallest(KeyF key, int64_t n, int want, uint64_t* sel, SelectSmem& sm) {
    if (want <= 0) {
        __syncthreads();
        return;
    }
    if (n <= want) {   // all of them
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sel[i] = ((uint64_t)key(i) << 32) | (uint64_t)i;
        __syncthreads();
        return;
    }
    uint32_t prefix = 0, mask = 0;
    int rem = want;   // how many of the keys matching prefix on mask are still to be taken
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) sm.hist[b] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const uint32_t k = key(i);
            if ((k & mask) == prefix) atomicAdd(&sm.hist[(k >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0, b = 0;
            for (; b < 255 && cum + sm.hist[b] < rem; ++b) cum += sm.hist[b];
            sm.digit = b;
            sm.rem = rem - cum;
        }
        __syncthreads();
        prefix |= (uint32_t)sm.digit << shift;
        mask |= 255u << shift;
        rem = sm.rem;
        __syncthreads();   // the next pass rewrites hist, digit and rem
    }
    if (threadIdx.x == 0) sm.count = 0;   // published by the first barrier of block_scan_incl
    int eq_before = 0;
    for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
        const int64_t i = i0 + threadIdx.x;
        const uint32_t k = i < n ? key(i) : 0xffffffffu;
        const bool eq = i < n && k == prefix;
        int total;
        const int rank = block_scan_incl(eq ? 1 : 0, &total, sm.red);
        if (i < n && (k < prefix || (eq && eq_before + rank <= rem)))
            sel[atomicAdd(&sm.count, 1)] = ((uint64_t)k << 32) | (uint64_t)i;
        eq_before += total;
    }
    __syncthreads();
}

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

// ---------------------------------------------------------------------------------------- hc_pre
// mix = fn @ x[t] (flattened) and sum(x[t]^2) in one pass over x, split over the flattened row so
// that a handful of tokens still fills the GPU (decode reads all of fn, 2.75 MB for V4, per call);
// then per token: the RMS factor, pre / post / comb (Sinkhorn in one thread: N*N <= 64 values) and
// out = sum_n pre[n] x[t, n].
struct HcDims {
    int64_t T, H, NH;   // NH = N * H, the flattened row
    int64_t chunk;      // columns of the flattened row per split
    int32_t N, M, splits, iters;
    float   eps, hc_eps;
};
constexpr int HC_THREADS = 256, HC_MAX_N = 8;

// part[(t * splits + split) * (M + 1) + m] = sum over the split's columns of fn[m, k] * x[t, k]
// (m < M), and at m = M the split's sum of squares. TT tokens per block share every fn load.
template <int MM, int TT>
__global__ __launch_bounds__(HC_THREADS) void k_hc_mix(DTensor x, DTensor fn, float* part, HcDims d) {
    __shared__ float red[HC_THREADS / LANES][TT * (MM + 1)];
    const int64_t t0 = (int64_t)blockIdx.x * TT;
    const int split = blockIdx.y;
    const int nt = (int)min64(TT, d.T - t0);
    const int64_t k0 = split * d.chunk, k1 = min64(d.NH, k0 + d.chunk);
    const float* f = reinterpret_cast<const float*>(fn.base);
    float acc[TT][MM + 1];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int m = 0; m <= MM; ++m) acc[tt][m] = 0.f;
    for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
        const int64_t n = k / d.H, h = k - n * d.H;
        float xv[TT];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            xv[tt] = tt < nt ? load_f(x.dt, x.base, (t0 + tt) * x.strides[0] + n * x.strides[1] + h) : 0.f;
            acc[tt][MM] += xv[tt] * xv[tt];
        }
        // a guard, not a break: a loop that can exit early is not unrolled by clang, and the
        // accumulators would then live in scratch memory on AMD
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            if (m < d.M) {
                const float w = f[m * fn.strides[0] + k];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) acc[tt][m] += w * xv[tt];
            }
        }
    }
    const int lane = lane_id(), w = warp_id(), nw = blockDim.x / LANES;
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int m = 0; m <= MM; ++m) {
            const float v = warp_sum(acc[tt][m]);
            if (lane == 0) red[w][tt * (MM + 1) + m] = v;
        }
    __syncthreads();
    for (int v = threadIdx.x; v < TT * (MM + 1); v += blockDim.x) {
        const int tt = v / (MM + 1), m = v % (MM + 1);
        if (tt >= nt || (m < MM && m >= d.M)) continue;
        float s = 0.f;
        for (int ww = 0; ww < nw; ++ww) s += red[ww][v];
        part[((t0 + tt) * d.splits + split) * (d.M + 1) + (m == MM ? d.M : m)] = s;
    }
}

// comb of one token: softmax over j of each row i of the logits z (row-major N x N), + hc_eps, then
// Sinkhorn-Knopp (columns, then rows and columns iters - 1 more times, hc_eps flooring each sum).
// One thread, N known at compile time so the matrix lives in registers: the iterations are a chain
// of dependent sums and divisions, and in local memory each step would wait on L1.
template <int N>
__device__ __forceinline__ void hc_comb(const float* z, float hc_eps, int iters, float* out) {
    float c[N * N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float mx = -INFINITY, s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) mx = fmaxf(mx, z[i * N + j]);
#pragma unroll
        for (int j = 0; j < N; ++j) {
            c[i * N + j] = expf(z[i * N + j] - mx);
            s += c[i * N + j];
        }
#pragma unroll
        for (int j = 0; j < N; ++j) c[i * N + j] = c[i * N + j] / s + hc_eps;
    }
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {   // rows (not before the first column pass)
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < N; ++j) s += c[i * N + j];
#pragma unroll
                for (int j = 0; j < N; ++j) c[i * N + j] /= s + hc_eps;
            }
        }
#pragma unroll
        for (int j = 0; j < N; ++j) {   // columns
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < N; ++i) s += c[i * N + j];
#pragma unroll
            for (int i = 0; i < N; ++i) c[i * N + j] /= s + hc_eps;
        }
    }
#pragma unroll
    for (int k = 0; k < N * N; ++k) out[k] = c[k];
}

// Per token: the partial sums of the splits, the RMS factor, then (all threads at once) the logits
// z[m] = mix[m] * r * scale[part of m] + base[m] with pre and post, then comb's Sinkhorn (one thread,
// hc_comb), and out = sum_n pre[n] x[t, n]. One block per token; N = the streams.
template <int N>
__global__ __launch_bounds__(HC_THREADS) void k_hc_finish(DTensor x, DTensor base, DTensor scale, const float* part,
                                                          DTensor out, DTensor post, DTensor comb, HcDims d) {
    constexpr int MB = (2 + N) * N;   // M of a block; the head has M = N
    __shared__ float mix[MB + 1];
    __shared__ float z[MB];           // pre [0, N) (finished), post [N, 2N), comb logits [2N, M)
    __shared__ float cm[N * N];
    for (int64_t t = blockIdx.x; t < d.T; t += gridDim.x) {
        for (int m = threadIdx.x; m <= d.M; m += blockDim.x) {
            float s = 0.f;
            for (int sp = 0; sp < d.splits; ++sp) s += part[(t * d.splits + sp) * (d.M + 1) + m];
            mix[m == d.M ? MB : m] = s;
        }
        __syncthreads();
        const float r = rsqrtf(mix[MB] / (float)d.NH + d.eps);
        for (int m = threadIdx.x; m < d.M; m += blockDim.x) {
            const int which = m < N ? 0 : m < 2 * N ? 1 : 2;   // pre, post, comb
            const float v = mix[m] * r * load_f(scale.dt, scale.base, which * scale.strides[0]) +
                            load_f(base.dt, base.base, m * base.strides[0]);
            if (which == 0) z[m] = sigmoidf_(v) + d.hc_eps;
            else if (which == 1) store_f(post.dt, post.base, t * post.strides[0] + (m - N), 2.f * sigmoidf_(v));
            else z[m] = v;
        }
        __syncthreads();
        if (d.M == MB) {   // a block: comb (the head, M = N, has pre only)
            if (threadIdx.x == 0) hc_comb<N>(z + 2 * N, d.hc_eps, d.iters, cm);
            __syncthreads();
            for (int k = threadIdx.x; k < N * N; k += blockDim.x)
                store_f(comb.dt, comb.base, t * comb.strides[0] + (k / N) * comb.strides[1] + k % N, cm[k]);
        }
        for (int64_t h = threadIdx.x; h < d.H; h += blockDim.x) {
            float o = 0.f;
#pragma unroll
            for (int n = 0; n < N; ++n) o += z[n] * load_f(x.dt, x.base, t * x.strides[0] + n * x.strides[1] + h);
            store_f(out.dt, out.base, t * out.strides[0] + h, o);
        }
        __syncthreads();   // mix, z and cm are rewritten for the next token
    }
}

// the stream counts k_hc_finish is instantiated for (1 .. HC_MAX_N): X(N) for each
#define DI_HC_STREAMS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)

// ---------------------------------------------------------------------------------------- hc_post
// out[t, k, h] = post[t, k] y[t, h] + sum_j comb[t, j, k] x[t, j, h]: a block per (token, 256
// features), post and comb of the token staged in shared memory, each thread all N outputs of one h.
__global__ __launch_bounds__(256) void k_hc_post(DTensor x, DTensor y, DTensor post, DTensor comb, DTensor out,
                                                 int64_t T, int64_t H, int N, int64_t hchunks) {
    __shared__ float pw[HC_MAX_N], cw[HC_MAX_N * HC_MAX_N];
    for (int64_t bi = blockIdx.x; bi < T * hchunks; bi += gridDim.x) {
        const int64_t t = bi / hchunks, h = (bi % hchunks) * blockDim.x + threadIdx.x;
        __syncthreads();   // the previous token's weights are no longer read
        for (int i = threadIdx.x; i < N * N; i += blockDim.x)
            cw[i] = load_f(comb.dt, comb.base, t * comb.strides[0] + (i / N) * comb.strides[1] + i % N);
        for (int i = threadIdx.x; i < N; i += blockDim.x) pw[i] = load_f(post.dt, post.base, t * post.strides[0] + i);
        __syncthreads();
        if (h >= H) continue;
        float xv[HC_MAX_N];
#pragma unroll
        for (int j = 0; j < HC_MAX_N; ++j)
            xv[j] = j < N ? load_f(x.dt, x.base, t * x.strides[0] + j * x.strides[1] + h) : 0.f;
        const float yv = load_f(y.dt, y.base, t * y.strides[0] + h);
        for (int k = 0; k < N; ++k) {
            float o = pw[k] * yv;
#pragma unroll
            for (int j = 0; j < HC_MAX_N; ++j)
                if (j < N) o += cw[j * N + k] * xv[j];
            store_f(out.dt, out.base, t * out.strides[0] + k * out.strides[1] + h, o);
        }
    }
}

// ---------------------------------------------------------------------------------------- layernorm
// Two reductions (mean, then the centred variance, as the reference computes it) and the output;
// x is read three times, from L1/L2, which needs no shared-memory limit on H.
__global__ __launch_bounds__(256) void k_layernorm(DTensor x, DTensor w, DTensor b, DTensor out, int64_t T, int64_t H,
                                                   float eps) {
    __shared__ float red[MAX_WARPS];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int64_t xo = t * x.strides[0];
        float s = 0.f;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) s += load_f(x.dt, x.base, xo + h);
        const float mean = block_sum(s, red) / (float)H;
        float v = 0.f;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            const float c = load_f(x.dt, x.base, xo + h) - mean;
            v += c * c;
        }
        const float r = rsqrtf(block_sum(v, red) / (float)H + eps);
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float o = (load_f(x.dt, x.base, xo + h) - mean) * r * load_f(w.dt, w.base, h * w.strides[0]);
            if (b.base) o += load_f(b.dt, b.base, h * b.strides[0]);
            store_f(out.dt, out.base, t * out.strides[0] + h, o);
        }
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
