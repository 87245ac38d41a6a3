// moe_experts on tensor cores: one kernel for the gate/up projection (SiLU(gate) * up fused) and
// one for the down projection, templated on the weight format and on the work shape.
//
// Work: moe_align (moe.cu) groups the routed (token, k) pairs by expert on the device
// and cuts each expert's pairs into items of 8 * NT tokens. grid = (row tiles, max items); a block
// whose item does not exist returns at once, so the work is proportional to the experts routed and
// the host never needs to know which ones they are.
//
// Each warp computes 16-row tiles of the weights against the item's tokens with
// mma.sync.m16n8k16 (bf16 in, f32 accumulate). The weights stream from global memory straight into
// registers, 16 bytes per lane, and are decoded there; no shared memory for them. The k order inside
// an mma is free as long as A and B agree, so each lane takes 16 contiguous bytes of one weight row
// and the 16 matching bytes of each token's activations: both operands are plain 16-byte loads.
//   lane = 4 * g + c: rows g and g + 8 of the tile, token g of each n-tile, k range
//   [k0 + c * EPL, k0 + (c + 1) * EPL) of the k-step (EPL weight elements in 16 bytes).
// Formats: bf16 as is; fp8 e4m3 by bit placement into bf16 and an exact multiply by 2^120; int8 and
// uint4 through f32; int4 by the 0x4300 | nibble trick (q + 136 in bf16, the offset removed after
// the k-step). Scales: after each k-step in f32 (fp8 128x128; int4, whose k-step is narrowed to 32 /
// 64 columns for groups of 32 / 64 so it never crosses a group), at the end for per-channel int8,
// before the mma only for uint4 ((u - z) * s in f32, rounded once to bf16).
// Decode (NT = 1): the block's 4 warps split K and reduce through shared memory. Prefill (NT = 8, 4 for
// the k-step-scaled formats):
// each warp owns its rows; a weight fragment serves 8 n-tiles.
#pragma once

#include "device.cuh"
#include "moe_mma_api.cuh"
#include "pdl.cuh"

#if DI_HAVE_MOE_MMA
namespace di {
namespace moe {

// EPL: weight elements a lane holds per k-step (a k-step is 4 * EPL columns); BITS: per element;
// PERM: 4-bit pairs are (e, e + 4), the activations are permuted to match.
template <int F> struct Fmt;
template <> struct Fmt<MW_BF16>  { static constexpr int EPL = 8,  BITS = 16; static constexpr bool PERM = false; };
template <> struct Fmt<MW_FP8>   { static constexpr int EPL = 16, BITS = 8;  static constexpr bool PERM = false; };
template <> struct Fmt<MW_I8>    { static constexpr int EPL = 16, BITS = 8;  static constexpr bool PERM = false; };
template <> struct Fmt<MW_I4>    { static constexpr int EPL = 32, BITS = 4;  static constexpr bool PERM = true; };
template <> struct Fmt<MW_I4G64> { static constexpr int EPL = 16, BITS = 4;  static constexpr bool PERM = true; };
template <> struct Fmt<MW_I4G32> { static constexpr int EPL = 8,  BITS = 4;  static constexpr bool PERM = true; };
template <> struct Fmt<MW_U4>    { static constexpr int EPL = 32, BITS = 4;  static constexpr bool PERM = true; };

// scale handling: 0 none, 1 per k-step after the mma (exact, f32), 2 per row at the end, 3 before
// the mma (uint4: (u - z) * s in f32, rounded once to bf16)
template <int F> __host__ __device__ constexpr int scale_mode() {
    return F == MW_BF16 ? 0 : (F == MW_FP8 || F == MW_I4 || F == MW_I4G64 || F == MW_I4G32) ? 1 : F == MW_I8 ? 2 : 3;
}
template <int F> __host__ __device__ constexpr bool is_i4() { return F == MW_I4 || F == MW_I4G64 || F == MW_I4G32; }

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bf2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// (lo, hi) f32 -> bf16x2, round to nearest even
__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ uint4 ld_stream(const char* p) {  // weights: read once, keep out of L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_act(const char* p) {  // activations: reused by every row tile
    return __ldg(reinterpret_cast<const uint4*>(p));
}

constexpr uint32_t BF2_ONE = 0x3F803F80u, BF2_NEG_ZERO = 0x80008000u;

// two e4m3 (the high bytes of each half of d) -> bf16x2, exact: sign in place, exponent and mantissa
// moved under the bf16 ones (a factor 2^-120, subnormals included), then times 2^120
__device__ __forceinline__ uint32_t e4m3x2_to_bf2(uint32_t d) {
    uint32_t r = (d & 0x80008000u) | ((d >> 4) & 0x07F007F0u);
    return bf2_fma(r, 0x7B807B80u, BF2_NEG_ZERO);
}
__device__ __forceinline__ float magic_u8(uint32_t w, uint32_t i) {  // 2^23 + byte i of w
    return __uint_as_float(prmt(w, 0x4B000000u, 0x7440u | i));
}

// Sub-chunk j (8 elements) of one lane's 16 weight bytes as 4 bf16x2 operands. For the 4-bit
// formats the pairs are (e, e + 4) of each 8-element word; the activations are permuted to match.
// sc: the pre-mma scale (MW_U4); zs: - zero * scale (MW_U4).
template <int F>
__device__ __forceinline__ void decode(const uint4& v, int j, uint32_t (&p)[4], float sc, float zs) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    if constexpr (F == MW_BF16) {
        p[0] = w[0]; p[1] = w[1]; p[2] = w[2]; p[3] = w[3];
    } else if constexpr (F == MW_FP8) {
        const uint32_t a = w[2 * j], b = w[2 * j + 1];
        p[0] = e4m3x2_to_bf2(prmt(a, 0, 0x1404u));
        p[1] = e4m3x2_to_bf2(prmt(a, 0, 0x3424u));
        p[2] = e4m3x2_to_bf2(prmt(b, 0, 0x1404u));
        p[3] = e4m3x2_to_bf2(prmt(b, 0, 0x3424u));
    } else if constexpr (F == MW_I8) {
        const float off = 8388736.f;  // 2^23 + 128
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t u = w[2 * j + h] ^ 0x80808080u;
            p[2 * h] = pack_bf2(magic_u8(u, 0) - off, magic_u8(u, 1) - off);
            p[2 * h + 1] = pack_bf2(magic_u8(u, 2) - off, magic_u8(u, 3) - off);
        }
    } else if constexpr (is_i4<F>()) {
        const uint32_t u = w[j] ^ 0x88888888u;  // two's complement nibble -> q + 8
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t b = ((u >> (4 * i)) & 0x000F000Fu) | 0x43004300u;   // 128 + q + 8, exact
            p[i] = b;  // q + 136: the 136 * sum(x) it adds is taken off after the k-step (kstep)
        }
    } else {  // MW_U4: (u - z) * s in f32, one rounding to bf16
        const uint32_t u = w[j];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float lo = __uint_as_float(((u >> (4 * i)) & 0xFu) | 0x4B000000u) - 8388608.f;
            float hi = __uint_as_float(((u >> (4 * i + 16)) & 0xFu) | 0x4B000000u) - 8388608.f;
            p[i] = pack_bf2(fmaf(lo, sc, zs), fmaf(hi, sc, zs));
        }
    }
}

// The 8 activations matching sub-chunk j, as the B operand pairs of its two mmas.
template <int F>
__device__ __forceinline__ void act_pairs(const uint4& v, uint32_t (&b)[4]) {
    if constexpr (Fmt<F>::PERM) {
        b[0] = prmt(v.x, v.z, 0x5410u);  // (x0, x4)
        b[1] = prmt(v.x, v.z, 0x7632u);  // (x1, x5)
        b[2] = prmt(v.y, v.w, 0x5410u);  // (x2, x6)
        b[3] = prmt(v.y, v.w, 0x7632u);  // (x3, x7)
    } else {
        b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
    }
}

// One 16-row source of A: an expert matrix at rows r0 .. r0 + 15.
struct ASrc {
    const char* q;       // row g of the tile, this lane's first byte of the k-step 0
    const char* s;       // scale base
    const char* z;       // zero base
    int64_t     r;       // row g (absolute)
    int64_t     srow[2]; // element offsets of rows g and g + 8 in the scales
    int64_t     zrow[2]; // and in the zeros
    bool        ok;
};

// Row offsets are computed once per kernel: the k loop only shifts (or divides, for a group size
// that is not a power of two) the column, in 32 bits.
__device__ __forceinline__ void src_rows(ASrc& a, const MoeMat& m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        a.srow[h] = ((a.r + 8 * h) / m.br) * m.s_rs;
        a.zrow[h] = ((a.r + 8 * h) / m.br) * m.z_rs;
    }
}
__device__ __forceinline__ uint32_t col_group(const MoeMat& m, uint32_t k) {
    return m.bc_shift >= 0 ? k >> m.bc_shift : k / (uint32_t)m.bc;
}
// scales and zeros: the common dtypes without load_f's general switch
__device__ __forceinline__ float load_sz(int dt, const char* base, int64_t i) {
    if (dt == DT_F32) return __ldg(reinterpret_cast<const float*>(base) + i);
    if (dt == DT_BF16) return __uint_as_float((uint32_t)__ldg(reinterpret_cast<const unsigned short*>(base) + i) << 16);
    if (dt == DT_F16) return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(base) + i)));
    return load_f(dt, base, i);
}

// acc[src][n] += A_src (16 rows, k-step st) x B (tokens of n-tile n). B rows: brow[n] (NULL: zero).
template <int F, int NT>
__device__ __forceinline__ void kstep(const MoeMat (&m)[2], const ASrc (&a)[2], const uint4 (&raw)[2][2],
                                      const char* const (&brow)[NT], int64_t kl,
                                      float (&acc)[2][NT][4]) {
    constexpr int EPL = Fmt<F>::EPL, SUBS = EPL / 8, SM = scale_mode<F>();
    float sc[2][2] = {}, zs[2][2] = {}, post[2][2] = {};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if constexpr (SM == 1 || SM == 3) {
                const int64_t gc = col_group(m[i], (uint32_t)kl);
                float s = a[i].ok ? load_sz(m[i].s_dt, a[i].s, a[i].srow[h] + gc * m[i].s_cs) : 0.f;
                if constexpr (SM == 1) post[i][h] = s;
                else {
                    sc[i][h] = s;
                    zs[i][h] = a[i].ok ? -load_sz(m[i].z_dt, a[i].z, a[i].zrow[h] + gc * m[i].z_cs) * s : 0.f;
                }
            }
        }
    // int4 weights enter the mma as q + 136 (the decode is then one lop3 per pair); xs[n] collects
    // sum(x) over the k-step with an all-ones A, and the k-step result is part - 136 * xs.
    float xs[NT][4];
    if constexpr (is_i4<F>()) {
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) xs[n][e] = 0.f;
    }
    auto body = [&](float (&dst)[2][NT][4]) {
#pragma unroll
        for (int j = 0; j < SUBS; ++j) {
            uint32_t p[2][2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) decode<F>(raw[i][h], j, p[i][h], sc[i][h], zs[i][h]);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                uint4 xv = brow[n] ? ld_act(brow[n] + (kl + 8 * j) * 2) : make_uint4(0, 0, 0, 0);
                uint32_t b[4];
                act_pairs<F>(xv, b);
                if constexpr (is_i4<F>()) {
                    mma_bf16(xs[n], BF2_ONE, BF2_ONE, BF2_ONE, BF2_ONE, b[0], b[1]);
                    mma_bf16(xs[n], BF2_ONE, BF2_ONE, BF2_ONE, BF2_ONE, b[2], b[3]);
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mma_bf16(dst[i][n], p[i][0][0], p[i][1][0], p[i][0][1], p[i][1][1], b[0], b[1]);
                    mma_bf16(dst[i][n], p[i][0][2], p[i][1][2], p[i][0][3], p[i][1][3], b[2], b[3]);
                }
            }
        }
    };
    if constexpr (SM != 1) {
        body(acc);
    } else {
        float part[2][NT][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[i][n][e] = 0.f;
        body(part);
        if constexpr (is_i4<F>()) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) part[i][n][e] = fmaf(-136.f, xs[n][e], part[i][n][e]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                acc[i][n][0] = fmaf(post[i][0], part[i][n][0], acc[i][n][0]);
                acc[i][n][1] = fmaf(post[i][0], part[i][n][1], acc[i][n][1]);
                acc[i][n][2] = fmaf(post[i][1], part[i][n][2], acc[i][n][2]);
                acc[i][n][3] = fmaf(post[i][1], part[i][n][3], acc[i][n][3]);
            }
    }
}

// The k loop of one warp over its steps st = st0, st0 + stride, ...: D k-steps of A in flight (a
// static ring, so the buffers stay in registers).
template <int F>
__device__ __forceinline__ uint4 ld_weights(const char* p) {
    constexpr int BYTES = Fmt<F>::EPL * Fmt<F>::BITS / 8;  // 16, or 8 / 4 for the narrow int4 steps
    if constexpr (BYTES == 16) {
        return ld_stream(p);
    } else if constexpr (BYTES == 8) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        return make_uint4(v.x, v.y, 0, 0);
    } else {
        return make_uint4(__ldg(reinterpret_cast<const uint32_t*>(p)), 0, 0, 0);
    }
}

template <int F, int NT, int D>
__device__ __forceinline__ void kloop(const MoeMat (&m)[2], const ASrc (&a)[2], const char* const (&brow)[NT],
                                      int c, int st0, int stride, float (&acc)[2][NT][4]) {
    constexpr int EPL = Fmt<F>::EPL, QS = 4 * EPL, BITS = Fmt<F>::BITS;
    static_assert(QS == moe_kstep_cols(F), "moe_kstep_cols (the host's shape check) disagrees with Fmt");
    const int nsteps = (int)(m[0].K / QS);
    auto load = [&](int st, uint4 (&raw)[2][2]) {
        const int64_t kb = ((int64_t)st * QS + (int64_t)c * EPL) * BITS / 8;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                raw[i][h] = a[i].ok ? ld_weights<F>(a[i].q + 8 * h * m[i].ld + kb) : make_uint4(0, 0, 0, 0);
    };
    uint4 buf[D][2][2];
#pragma unroll
    for (int d = 0; d < D; ++d)
        if (st0 + d * stride < nsteps) load(st0 + d * stride, buf[d]);
    for (int st = st0; st < nsteps; st += D * stride) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int sd = st + d * stride;
            if (sd < nsteps) {
                const int64_t kl = (int64_t)sd * QS + (int64_t)c * EPL;  // this lane's first k
                kstep<F, NT>(m, a, buf[d], brow, kl, acc);
                if (sd + D * stride < nsteps) load(sd + D * stride, buf[d]);
            }
        }
    }
    if constexpr (scale_mode<F>() == 2) {  // int8 per output channel
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float s0 = a[i].ok ? load_sz(m[i].s_dt, a[i].s, a[i].srow[0]) : 0.f;
            float s1 = a[i].ok ? load_sz(m[i].s_dt, a[i].s, a[i].srow[1]) : 0.f;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                acc[i][n][0] *= s0; acc[i][n][1] *= s0;
                acc[i][n][2] *= s1; acc[i][n][3] *= s1;
            }
        }
    }
}

template <int NT, int KS>
__device__ __forceinline__ void reduce_warps(float (&acc)[2][NT][4], float* red) {
    if constexpr (KS > 1) {
        const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
        constexpr int V = 2 * NT * 4;
        if (w > 0) {
            const float* f = &acc[0][0][0];
#pragma unroll
            for (int v = 0; v < V; ++v) red[((w - 1) * V + v) * 32 + lane] = f[v];
        }
        __syncthreads();
        if (w == 0) {
            float* f = &acc[0][0][0];
#pragma unroll
            for (int ww = 0; ww < KS - 1; ++ww)
#pragma unroll
                for (int v = 0; v < V; ++v) f[v] += red[(ww * V + v) * 32 + lane];
        }
    }
}

constexpr int KS_DECODE = 4;

// Decode (NT = 1) is latency-bound: registers are capped so that 5-6 blocks (20-24 warps) fit an
// SM, as far as that stays free of spills (checked with -Xptxas -v).
template <int F> constexpr int decode_min_blocks() {
    return (F == MW_I4 || F == MW_FP8 || F == MW_U4) ? 5 : 6;
}

// Work item i of the plan into *item; false when it has nothing to run (past n_items, or a direct
// plan's pair whose expert is out of range or has no weights in this call: it is skipped, as moe_align
// leaves it out).
__device__ __forceinline__ bool plan_item(const MoePlan& p, int i, int4* item) {
    if (p.direct) {
        const int64_t e = load_i(p.ids.dt, p.ids.base, i);
        *item = make_int4((int)e, i, 1, 0);
        return p.res.has(e, p.E);
    }
    if (i >= *p.n_items) return false;
    *item = p.items[i];
    return true;
}

// The pair at position pos of the plan's order
__device__ __forceinline__ int plan_pair(const MoePlan& p, int pos) { return p.direct ? pos : p.sorted[pos]; }

// A direct plan's combine, run by every thread of each down block once its y rows are written (or
// skipped): the last block of the tile to arrive sums the tile's rows of out over the K pairs that ran,
// in k order, exactly as k_moe_combine does (the threadfence-reduction pattern).
__device__ __forceinline__ void direct_combine(const MoePlan& p, const float* y, int64_t H) {
    __shared__ int last;
    __threadfence();   // this block's y rows are visible to whichever block sums them
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&p.tile_cnt[blockIdx.x], 1) == (int)gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int64_t c = (int64_t)blockIdx.x * MOE_DOWN_DECODE_ROWS + threadIdx.x;
    if (threadIdx.x >= MOE_DOWN_DECODE_ROWS || c >= H) return;
    float acc = 0.f;
    for (int k = 0; k < p.Ktop; ++k) {
        const int64_t e = load_i(p.ids.dt, p.ids.base, k);
        if (!p.res.has(e, p.E)) continue;
        acc += load_f(p.tw.dt, p.tw.base, k) * __ldcg(&y[(int64_t)k * H + c]);
    }
    if (p.accumulate) acc += load_f(p.out.dt, p.out.base, c);
    store_f(p.out.dt, p.out.base, c, acc);
}

template <int F, int NT, int KS>
__global__ __launch_bounds__(128, NT == 1 ? decode_min_blocks<F>() : 1) void k_gate_up(const MoeMat mg, const __grid_constant__ MoePtrs pg,
                                                 const MoeMat mu, const __grid_constant__ MoePtrs pu,
                                                 MoePlan plan, const char* x, int64_t x_rs, int Ktop,
                                                 float limit, uint16_t* h) {
    __shared__ float red[KS > 1 ? (KS - 1) * 2 * NT * 4 * 32 : 1];
    pdl_wait();
    pdl_trigger();
    if (plan.direct && blockIdx.x == 0 && blockIdx.y == 0)   // down's tile counters, fresh each call
        for (int i = threadIdx.x; i < plan.n_tiles; i += blockDim.x) plan.tile_cnt[i] = 0;
    int4 item;
    if (!plan_item(plan, (int)blockIdx.y, &item)) return;
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t I = mg.N;
    const int64_t r0 = KS > 1 ? (int64_t)blockIdx.x * 16 : ((int64_t)blockIdx.x * 4 + w) * 16;
    const bool ok = r0 < I;
    const char* bq[2] = {pg.q[item.x], pu.q[item.x]};
    const MoeMat m[2] = {mg, mu};
    ASrc a[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        a[i].q = bq[i] + (r0 + g) * m[i].ld;
        a[i].s = i == 0 ? pg.s[item.x] : pu.s[item.x];
        a[i].z = i == 0 ? pg.z[item.x] : pu.z[item.x];
        a[i].r = r0 + g;
        a[i].ok = ok;
        src_rows(a[i], m[i]);
    }
    const char* brow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int j = n * 8 + g;
        brow[n] = j < item.z ? x + (int64_t)(plan_pair(plan, item.y + j) / Ktop) * x_rs : nullptr;
    }
    float acc[2][NT][4] = {};
    kloop<F, NT, 2>(m, a, brow, c, KS > 1 ? w : 0, KS, acc);
    reduce_warps<NT, KS>(acc, red);
    if ((KS > 1 && w != 0) || !ok) return;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = n * 8 + 2 * c + (e & 1);
            if (j >= item.z) continue;
            const int64_t row = r0 + g + (e >> 1) * 8;
            float gv = acc[0][n][e], uv = acc[1][n][e];
            if (limit > 0.f) {   // clipped SwiGLU (1.3)
                gv = fminf(gv, limit);
                uv = fminf(fmaxf(uv, -limit), limit);
            }
            const float hv = gv / (1.f + __expf(-gv)) * uv;
            h[(int64_t)(item.y + j) * I + row] = f_to_bf16(hv);
        }
}

template <int F, int NT, int KS>
__global__ __launch_bounds__(128, NT == 1 ? decode_min_blocks<F>() : 1) void k_down(const MoeMat md, const __grid_constant__ MoePtrs pd, MoePlan plan,
                                              const uint16_t* h, float* y) {
    __shared__ float red[KS > 1 ? (KS - 1) * 2 * NT * 4 * 32 : 1];
    pdl_wait();
    pdl_trigger();
    int4 item;
    const bool run = plan_item(plan, (int)blockIdx.y, &item);
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t H = md.N, I = md.K;
    if (!run) {   // a direct plan's skipped pair still counts towards its tiles
        if constexpr (KS > 1)
            if (plan.direct) direct_combine(plan, y, H);
        return;
    }
    static_assert(KS == 1 || MOE_DOWN_DECODE_ROWS == 32, "the decode tile is the block's 32 rows");
    const int64_t r0 = KS > 1 ? (int64_t)blockIdx.x * 32 : ((int64_t)blockIdx.x * 4 + w) * 32;
    const MoeMat m[2] = {md, md};
    ASrc a[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        a[i].r = r0 + 16 * i + g;
        a[i].q = pd.q[item.x] + a[i].r * md.ld;
        a[i].s = pd.s[item.x];
        a[i].z = pd.z[item.x];
        a[i].ok = r0 + 16 * i < H;
        src_rows(a[i], md);
    }
    const char* brow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int j = n * 8 + g;
        brow[n] = j < item.z ? reinterpret_cast<const char*>(h + (int64_t)(item.y + j) * I) : nullptr;
    }
    float acc[2][NT][4] = {};
    kloop<F, NT, 2>(m, a, brow, c, KS > 1 ? w : 0, KS, acc);
    reduce_warps<NT, KS>(acc, red);
    if (KS > 1 && w != 0 && !plan.direct) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!a[i].ok || (KS > 1 && w != 0)) continue;   // warp 0 holds the block's sums
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = n * 8 + 2 * c + (e & 1);
                if (j >= item.z) continue;
                const int64_t row = r0 + 16 * i + g + (e >> 1) * 8;
                y[(int64_t)plan_pair(plan, item.y + j) * H + row] = acc[i][n][e];
            }
    }
    if constexpr (KS > 1)
        if (plan.direct) direct_combine(plan, y, H);
}

template <int F>
void launch_gate_up(MoeShape sh, int max_items, const MoeMat& mg, const MoePtrs& pg, const MoeMat& mu,
                    const MoePtrs& pu, MoePlan plan, const char* x, int64_t x_rs, int Ktop, float limit, uint16_t* h,
                    cudaStream_t s) {
    if (sh == MOE_DECODE) {
        dim3 grid((unsigned)ceil_div(mg.N, 16), (unsigned)max_items);
        launch_pdl(k_gate_up<F, 1, KS_DECODE>, grid, 128, 0, s, mg, pg, mu, pu, plan, x, x_rs, Ktop, limit, h);
    } else if (sh == MOE_PREFILL) {  // never planned for the narrow formats (moe_needs_narrow_prefill)
        dim3 grid((unsigned)ceil_div(mg.N, 64), (unsigned)max_items);
        if constexpr (!moe_needs_narrow_prefill(F))
            k_gate_up<F, 8, 1><<<grid, 128, 0, s>>>(mg, pg, mu, pu, plan, x, x_rs, Ktop, limit, h);
    } else {
        dim3 grid((unsigned)ceil_div(mg.N, 64), (unsigned)max_items);
        k_gate_up<F, 4, 1><<<grid, 128, 0, s>>>(mg, pg, mu, pu, plan, x, x_rs, Ktop, limit, h);
    }
}

template <int F>
void launch_down(MoeShape sh, int max_items, const MoeMat& md, const MoePtrs& pd, MoePlan plan, const uint16_t* h,
                 float* y, cudaStream_t s) {
    if (sh == MOE_DECODE) {
        dim3 grid((unsigned)ceil_div(md.N, MOE_DOWN_DECODE_ROWS), (unsigned)max_items);
        launch_pdl(k_down<F, 1, KS_DECODE>, grid, 128, 0, s, md, pd, plan, h, y);
    } else if (sh == MOE_PREFILL) {
        dim3 grid((unsigned)ceil_div(md.N, 128), (unsigned)max_items);
        if constexpr (!moe_needs_narrow_prefill(F)) k_down<F, 8, 1><<<grid, 128, 0, s>>>(md, pd, plan, h, y);
    } else {
        dim3 grid((unsigned)ceil_div(md.N, 128), (unsigned)max_items);
        k_down<F, 4, 1><<<grid, 128, 0, s>>>(md, pd, plan, h, y);
    }
}

}  // namespace moe

#define DI_MOE_MMA_DEFINE(name, F)                                                                           \
    void launch_moe_gate_up_##name(MoeShape sh, int max_items, const MoeMat& mg, const MoePtrs& pg,         \
                                   const MoeMat& mu, const MoePtrs& pu, MoePlan plan, const char* x,         \
                                   int64_t x_rs, int Ktop, float limit, uint16_t* h, cudaStream_t s) {       \
        moe::launch_gate_up<F>(sh, max_items, mg, pg, mu, pu, plan, x, x_rs, Ktop, limit, h, s);            \
    }                                                                                                        \
    void launch_moe_down_##name(MoeShape sh, int max_items, const MoeMat& md, const MoePtrs& pd, MoePlan plan, \
                                const uint16_t* h, float* y, cudaStream_t s) {                               \
        moe::launch_down<F>(sh, max_items, md, pd, plan, h, y, s);                                          \
    }

}  // namespace di
#endif  // DI_HAVE_MOE_MMA
