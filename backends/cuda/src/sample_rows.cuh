// The per-row algorithms of sample and spec_verify (abi/README.md section 8), one thread block per
// row, shared by both ops so they can never disagree about a row's distribution. sampling.cu wraps
// them in kernels; tests/gpu_emu runs them on the CPU (host_emu.h), where the GPU cannot be.
//
// The pipeline of a row with temperature > 0: row_softmax writes p = softmax(logits / T) and the
// indices; the rows are sorted by p descending, ties to the lower index (CUB's segmented radix sort, or
// sort_rows.cuh); kept_prefix finds sample's kept set (top_k, then the shortest prefix reaching
// top_p) and its sum; draw_kept is sample's draw. verify_row adds speculative sampling's acceptance
// test and residual draw over the kept sets of the target (and of the draft, when it has logits).
//
// Every function here is called by all threads of the block, with block-uniform arguments.
#pragma once

#include "block_best.cuh"
#include "device.cuh"

#ifndef DI_SAMPLE_CUB
#define DI_SAMPLE_CUB 0
#endif

namespace di {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// (splitmix64(seed) >> 11) * 2^-53, in [0, 1)
__device__ __forceinline__ double uniform01(uint64_t seed) {
    return (double)(splitmix64(seed) >> 11) * (1.0 / 9007199254740992.0);
}

// spec_verify's second draw uses seed + this (mod 2^64)
constexpr uint64_t SPEC_SEED_STEP = 0x9E3779B97F4A7C15ull;

// p = softmax(logits[row] / T) of a row of V logits at element offset ro of lg, into kr, with the
// indices into vr (the sort's payload).
__device__ void row_softmax(const DTensor& lg, int64_t ro, float T, float* kr, int* vr, int64_t V, float* red) {
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, load_f(lg.dt, lg.base, ro + i) / T);
    mx = block_max(mx, red);
    float sum = 0.f;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        float e = expf(load_f(lg.dt, lg.base, ro + i) / T - mx);
        kr[i] = e;
        vr[i] = (int)i;
        sum += e;
    }
    sum = block_sum(sum, red);
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) kr[i] = kr[i] / sum;
    __syncthreads();
}

// The argmax of a row (lowest index on ties) and, if prob is not NULL, its softmax probability at
// temperature 1 (sample's `probs` of a greedy row).
__device__ int row_argmax(const DTensor& lg, int64_t ro, int64_t V, float* prob, float* redv, int* redi) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    const float* row = reinterpret_cast<const float*>(lg.base) + ro;
    if (lg.dt == DT_F32 && V % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
        // f32 rows (the logits always are): 16-byte loads, four in flight per thread (the scan is
        // a greedy step's whole sampling cost, so its loads must not wait one by one)
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int64_t n4 = V / 4;
#pragma unroll 4
        for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 v = r4[i];
            const int b = (int)(4 * i);
            if (better(v.x, b, bv, bi)) { bv = v.x; bi = b; }
            if (better(v.y, b + 1, bv, bi)) { bv = v.y; bi = b + 1; }
            if (better(v.z, b + 2, bv, bi)) { bv = v.z; bi = b + 2; }
            if (better(v.w, b + 3, bv, bi)) { bv = v.w; bi = b + 3; }
        }
    } else {
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
            float v = load_f(lg.dt, lg.base, ro + i);
            if (better(v, (int)i, bv, bi)) { bv = v; bi = (int)i; }
        }
    }
    block_best(bv, bi, redv, redi);
    if (bi == 0x7fffffff) bi = 0;
    if (prob) {
        const float top = load_f(lg.dt, lg.base, ro + bi);
        float s = 0.f;
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) s += expf(load_f(lg.dt, lg.base, ro + i) - top);
        s = block_sum(s, redv);
        *prob = 1.f / s;
    }
    return bi;
}

// The first i < limit (in chunks of the block) whose inclusive running sum (in f64, in index order)
// of val(i) satisfies cmp; -1 if none. total (if not NULL) receives the sum over [0, limit) when
// nothing matched.
template <class Val, class Cmp>
__device__ int64_t scan_find(Val val, int64_t limit, Cmp cmp, double* total_out) {
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
        double v = i < limit ? val(i) : 0.0, inc, total;
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
    if (total_out) *total_out = carry;
    __syncthreads();
    return -1;
}

// sample's kept set of a sorted row ps (probabilities descending): the first top_k (0 = all), then the
// shortest prefix whose sum reaches top_p (at least one). *n_keep gets its length, *kept_sum its sum.
__device__ void kept_prefix(const float* ps, int64_t V, int64_t top_k, float top_p, int64_t* n_keep,
                            double* kept_sum) {
    const int64_t kk = (top_k > 0 && top_k < V) ? top_k : V;
    int64_t n = kk;
    const int64_t f = scan_find([&](int64_t i) { return (double)ps[i]; }, kk,
                                [&](double cum) { return cum >= (double)top_p; }, nullptr);
    if (f >= 0) n = f + 1;
    double tot = 0.0;
    scan_find([&](int64_t i) { return (double)ps[i]; }, n, [](double) { return false; }, &tot);
    *n_keep = n;
    *kept_sum = tot;
}

// sample's draw: the position in ps[0, n_keep) of the first running sum exceeding u(seed) * kept_sum.
__device__ int64_t draw_kept(const float* ps, int64_t n_keep, double kept_sum, uint64_t seed) {
    const double target = uniform01(seed) * kept_sum;
    int64_t f = scan_find([&](int64_t i) { return (double)ps[i]; }, n_keep, [&](double cum) { return cum > target; },
                          nullptr);
    return f < 0 ? n_keep - 1 : f;
}

// One row of sample with temperature > 0, its probabilities already sorted (ps, with indices is):
// the token, and in *prob its probability in the kept set renormalized.
__device__ int sample_sorted_row(const float* ps, const int* is, int64_t V, int64_t top_k, float top_p,
                                 uint64_t seed, float* prob) {
    int64_t n_keep;
    double kept_sum;
    kept_prefix(ps, V, top_k, top_p, &n_keep, &kept_sum);
    const int64_t f = draw_kept(ps, n_keep, kept_sum, seed);
    *prob = (float)((double)ps[f] / kept_sum);
    return is[f];
}

// One sampled row of spec_verify with a draft d in [0, V) (abi/README.md section 8). ps/is: the
// target's sorted probabilities and indices; qs/qi: the draft's (NULL: q is one-hot at d). pd and qd
// are V floats of scratch each (qd unused without draft logits): the kept sets scattered back to index
// order. Returns the token; *accepted gets 1 when it is the accepted draft.
__device__ int verify_sorted_row(const float* ps, const int* is, const float* qs, const int* qi, int64_t V,
                                 int d, int64_t top_k, float top_p, uint64_t seed, float* pd, float* qd,
                                 int* accepted) {
    __shared__ int last_pos;
    int64_t np, nq = 0;
    double sp, sq = 1.0;
    kept_prefix(ps, V, top_k, top_p, &np, &sp);
    if (qs) kept_prefix(qs, V, top_k, top_p, &nq, &sq);
    // p and q over all V in index order: the kept softmax probabilities, zero elsewhere
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        pd[i] = 0.f;
        if (qs) qd[i] = 0.f;
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < np; j += blockDim.x) pd[is[j]] = ps[j];
    for (int64_t j = threadIdx.x; j < nq; j += blockDim.x) qd[qi[j]] = qs[j];
    __syncthreads();
    const double p_d = (double)pd[d] / sp, q_d = qs ? (double)qd[d] / sq : 1.0;
    if (uniform01(seed) * q_d < p_d) {
        *accepted = 1;
        return d;
    }
    *accepted = 0;
    // rejected: r(x) = max(p(x) - q(x), 0), drawn in index order
    auto r = [&](int64_t x) {
        const double q = qs ? (double)qd[x] / sq : (x == d ? 1.0 : 0.0);
        const double v = (double)pd[x] / sp - q;
        return v > 0.0 ? v : 0.0;
    };
    double rsum = 0.0;
    scan_find(r, V, [](double) { return false; }, &rsum);
    const uint64_t seed2 = seed + SPEC_SEED_STEP;
    if (!(rsum > 0.0)) return is[draw_kept(ps, np, sp, seed2)];   // p <= q everywhere: sample's draw
    const double target = uniform01(seed2) * rsum;
    int64_t f = scan_find(r, V, [&](double cum) { return cum > target; }, nullptr);
    if (f >= 0) return (int)f;
    // rounding ran out before the target: the last token with r > 0
    if (threadIdx.x == 0) last_pos = -1;
    __syncthreads();
    for (int64_t x = threadIdx.x; x < V; x += blockDim.x)
        if (r(x) > 0.0) atomicMax(&last_pos, (int)x);
    __syncthreads();
    const int tok = last_pos;
    __syncthreads();
    return tok;
}

// ---------------------------------------------------------------------------------------- row bodies
// R rows of V probabilities: row r is the softmax of row (r % nt) of lg (r < nt) or of lg2 (r >= nt),
// at temperature row (r % nt). sample: R = nt = B, lg2 = lg. spec_verify: nt = T, R = T or 2T (the
// draft's rows after the target's).
struct SampleP {
    int64_t R, V, nt;
    const int* dead = nullptr;   // sample with 1.7's controls: dead[b] = 1 where they banned every token
};

// ---- ABI 1.7's controls of sample (abi/README.md section 8): the tensors of each group (base NULL:
// the group is absent).
struct SampleControls {
    DTensor hist, plen, pen;   // [B, L] int32, [B] int32, [B, 3] f32
    DTensor bids, bias;        // [B, N] int32, [B, N] f32
    DTensor mask;              // [B, ceil(V/32)] int32
};

constexpr int SEEN_IN_PROMPT = 1 << 30;   // cnt's flag; the low 30 bits count the output's occurrences

// Row b's logits (element offset ro of lg) after the controls, into x (V f32); cnt: V int32 of
// scratch (with a history), of which only the history's entries are zeroed and read. In f32 with explicit roundings (no FMA), in the README's order: the mask
// first (a banned token is -inf whatever the rest adds), bias, then each history token once, claimed
// by the thread whose atomicExch takes its count. Returns 1 if some token is left. flag: one int of
// smem.
__device__ int control_row(const DTensor& lg, int64_t ro, const SampleControls& c, int64_t b, int64_t V, float* x,
                           int* cnt, int* flag) {
    const bool hist = c.hist.base != nullptr;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        float v = load_f(lg.dt, lg.base, ro + i);
        if (c.mask.base) {
            const uint32_t w = (uint32_t)load_i(c.mask.dt, c.mask.base, b * c.mask.strides[0] + (i >> 5) * c.mask.strides[1]);
            if (!((w >> (i & 31)) & 1u)) v = -INFINITY;
        }
        x[i] = v;
    }
    if (hist) {
        const int64_t L = c.hist.shape[1], h0 = b * c.hist.strides[0];
        for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
            const int64_t t = load_i(c.hist.dt, c.hist.base, h0 + i * c.hist.strides[1]);
            if (t >= 0 && t < V) cnt[t] = 0;
        }
    }
    __syncthreads();
    if (c.bids.base) {
        for (int64_t n = threadIdx.x; n < c.bids.shape[1]; n += blockDim.x) {
            const int64_t t = load_i(c.bids.dt, c.bids.base, b * c.bids.strides[0] + n * c.bids.strides[1]);
            if (t >= 0 && t < V)
                x[t] = __fadd_rn(x[t], load_f(c.bias.dt, c.bias.base, b * c.bias.strides[0] + n * c.bias.strides[1]));
        }
        __syncthreads();
    }
    if (hist) {
        const int64_t L = c.hist.shape[1], pl = load_i(c.plen.dt, c.plen.base, b * c.plen.strides[0]);
        const int64_t h0 = b * c.hist.strides[0], hs = c.hist.strides[1];
        for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
            const int64_t t = load_i(c.hist.dt, c.hist.base, h0 + i * hs);
            if (t < 0 || t >= V) continue;
            if (i < pl) atomicOr(&cnt[t], SEEN_IN_PROMPT);
            else atomicAdd(&cnt[t], 1);
        }
        __syncthreads();
        const int64_t p0 = b * c.pen.strides[0], ps = c.pen.strides[1];
        const float r = load_f(c.pen.dt, c.pen.base, p0), f = load_f(c.pen.dt, c.pen.base, p0 + ps),
                    pr = load_f(c.pen.dt, c.pen.base, p0 + 2 * ps);
        for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
            const int64_t t = load_i(c.hist.dt, c.hist.base, h0 + i * hs);
            if (t < 0 || t >= V) continue;
            const int n = atomicExch(&cnt[t], 0);
            if (!n) continue;                 // another entry of the same token took it
            float v = x[t];
            if (r != 1.f) v = v > 0.f ? __fdiv_rn(v, r) : __fmul_rn(v, r);
            const int k = n & (SEEN_IN_PROMPT - 1);
            if (k > 0) v = __fsub_rn(__fsub_rn(v, __fmul_rn((float)k, f)), pr);
            x[t] = v;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *flag = 0;
    __syncthreads();
    bool any = false;
    for (int64_t i = threadIdx.x; i < V && !any; i += blockDim.x) any = x[i] > -INFINITY;
    if (any) *flag = 1;                       // every writer writes the same value
    __syncthreads();
    const int left = *flag;
    __syncthreads();
    return left;
}

// Row r of the softmax pass: p = softmax(logits / temperature) and the indices (the sort's payload)
// at keys/vals + r * V; offs[r] and offs[R + r] are where the row's sort segment begins and ends. A
// greedy row's segment is empty: the sort skips it (sorting a vocabulary nobody reads cost a block
// ~200 us per row) and its keys are never read (the pick takes the argmax of the logits).
// red: MAX_WARPS floats of smem.
__device__ void probs_row(const DTensor& lg, const DTensor& lg2, const DTensor& temp, float* keys, int* vals,
                          int* offs, const SampleP& p, int64_t r, float* red) {
    const int64_t b = r % p.nt;
    const float T = load_f(temp.dt, temp.base, b * temp.strides[0]);
    const bool greedy = !(T > 0.f) || (p.dead && p.dead[b]);   // no order needed: argmax, or no draw
    if (threadIdx.x == 0) {
        offs[r] = (int)(r * p.V);
        offs[p.R + r] = (int)((greedy ? r : r + 1) * p.V);
    }
    if (greedy) return;
    float* kr = keys + r * p.V;
    int* vr = vals + r * p.V;
    const DTensor& src = r < p.nt ? lg : lg2;
    row_softmax(src, b * src.strides[0], T, kr, vr, p.V, red);
}

// Row b of sample, its probabilities sorted (ks/vs): out[b] and, when probs is present, probs[b].
__device__ void sample_pick_row(const DTensor& lg, const DTensor& temp, const DTensor& topk, const DTensor& topp,
                                const DTensor& seeds, const float* ks, const int* vs, const DTensor& out,
                                const DTensor& probs, const SampleP& p, int64_t b) {
    __shared__ float redv[MAX_WARPS];
    __shared__ int redi[MAX_WARPS];
    const float T = load_f(temp.dt, temp.base, b * temp.strides[0]);
    float prob = 0.f;
    int tok;
    if (p.dead && p.dead[b]) {              // 1.7's controls banned every token: no draw
        tok = -1;
    } else if (!(T > 0.f)) {
        tok = row_argmax(lg, b * lg.strides[0], p.V, probs.base ? &prob : nullptr, redv, redi);
    } else {
        tok = sample_sorted_row(ks + b * p.V, vs + b * p.V, p.V, load_i(topk.dt, topk.base, b * topk.strides[0]),
                                load_f(topp.dt, topp.base, b * topp.strides[0]),
                                (uint64_t)load_i(seeds.dt, seeds.base, b * seeds.strides[0]), &prob);
    }
    if (threadIdx.x == 0) {
        reinterpret_cast<int32_t*>(out.base)[b * out.strides[0]] = tok;
        if (probs.base) reinterpret_cast<float*>(probs.base)[b * probs.strides[0]] = prob;
    }
    __syncthreads();
}

// Row t of spec_verify: ks/vs hold the target's sorted rows, then (has_draft) the draft's at row
// nt + t; dense holds V floats per row (two with a draft) of scratch. Writes out[t] and accepted[t].
__device__ void verify_pick_row(const DTensor& lg, const DTensor& ids, const DTensor& temp, const DTensor& topk,
                                const DTensor& topp, const DTensor& seeds, const float* ks, const int* vs,
                                float* dense, const DTensor& out, const DTensor& acc, int has_draft,
                                const SampleP& p, int64_t t) {
    __shared__ float redv[MAX_WARPS];
    __shared__ int redi[MAX_WARPS];
    const float T = load_f(temp.dt, temp.base, t * temp.strides[0]);
    int64_t d = load_i(ids.dt, ids.base, t * ids.strides[0]);
    if (d >= p.V) d = -1;   // INVALID_ARGUMENT where the host can see it; a device library never reads past V
    int tok, accepted = 0;
    if (!(T > 0.f)) {        // greedy: the argmax, accepted when it is the draft
        tok = row_argmax(lg, t * lg.strides[0], p.V, nullptr, redv, redi);
        accepted = d >= 0 && tok == d;
    } else {
        const float* ps = ks + t * p.V;
        const int* is = vs + t * p.V;
        const int64_t k = load_i(topk.dt, topk.base, t * topk.strides[0]);
        const float tp = load_f(topp.dt, topp.base, t * topp.strides[0]);
        const uint64_t seed = (uint64_t)load_i(seeds.dt, seeds.base, t * seeds.strides[0]);
        if (d < 0) {         // the bonus position: sample's draw
            float unused;
            tok = sample_sorted_row(ps, is, p.V, k, tp, seed, &unused);
        } else {
            float* pd = dense + t * p.V * (has_draft ? 2 : 1);
            tok = verify_sorted_row(ps, is, has_draft ? ks + (p.nt + t) * p.V : nullptr,
                                    has_draft ? vs + (p.nt + t) * p.V : nullptr, p.V, (int)d, k, tp, seed, pd,
                                    pd + p.V, &accepted);
        }
    }
    if (threadIdx.x == 0) {
        reinterpret_cast<int32_t*>(out.base)[t * out.strides[0]] = tok;
        reinterpret_cast<int32_t*>(acc.base)[t * acc.strides[0]] = accepted;
    }
    __syncthreads();
}

}  // namespace di
