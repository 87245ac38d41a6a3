/* AVX-512 kernels (F, BW, VL; VNNI for the int8 dot when present). Every function carries a GCC
 * target attribute, so this file builds with plain -O3 and the code only runs after kernels.c has
 * checked the CPU. Tails use masked loads, so any K and any block size work. */
#include "di_cpu.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "x86_hsum.h"

#define TGT "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define K512 __attribute__((target(TGT)))
#define K512I static inline __attribute__((always_inline, target(TGT)))

/* ------------------------------------------------------------------ weight decoders: 16 at element k */
K512I __m512 dec_f32(const void* w, int64_t k) { return _mm512_loadu_ps((const float*)w + k); }
K512I __m512 dec_bf16(const void* w, int64_t k) {
    __m256i v = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
K512I __m512 dec_f16(const void* w, int64_t k) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)w + k)));
}
K512I __m512 dec_i8(const void* w, int64_t k) {
    __m128i v = _mm_loadu_si128((const __m128i*)((const int8_t*)w + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
/* 16 nibbles (8 bytes at element k, k even) in element order, one per byte */
K512I __m128i nib16(const void* w, int64_t k) {
    __m128i b = _mm_loadl_epi64((const __m128i*)((const uint8_t*)w + k / 2));
    __m128i m = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
}
K512I __m512 dec_i4(const void* w, int64_t k) {
    __m128i e = _mm_set1_epi8(8);
    __m128i v = _mm_sub_epi8(_mm_xor_si128(nib16(w, k), e), e);  /* sign-extend 4 -> 8 bits */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
K512I __m512 dec_u4(const void* w, int64_t k) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib16(w, k))); }
K512I __m512 dec_e2m1(const void* w, int64_t k) {
    /* e2m1 codes -> twice their value as int8 (all integers), then halve */
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i v = _mm_shuffle_epi8(lut, nib16(w, k));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(0.5f));
}
K512I __m512 dec_e4m3(const void* w, int64_t k) {
    /* e4m3 bits moved into an f32's exponent/mantissa fields are the value * 2^-120, subnormals
     * included, so one shift and one multiply decode exactly (the 0x7f NaN code is not expected
     * in weights) */
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)w + k)));
    __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20);
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

/* four rows at a time: four accumulators, one transposing reduction for all four */
K512I __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* 512 -> 256 per vector, then pairwise adds until each lane holds one vector's total */
#define HI256(v) _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))
    __m256 a2 = _mm256_add_ps(_mm512_castps512_ps256(a), HI256(a));
    __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(b), HI256(b));
    __m256 c2 = _mm256_add_ps(_mm512_castps512_ps256(c), HI256(c));
    __m256 d2 = _mm256_add_ps(_mm512_castps512_ps256(d), HI256(d));
#undef HI256
    __m256 ab = _mm256_hadd_ps(a2, b2), cd = _mm256_hadd_ps(c2, d2);
    __m256 abcd = _mm256_hadd_ps(ab, cd);   /* a0 a1 b0 b1 | ... per 128-bit lane: hadd order */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* 32 weights at element k as two vectors: 4-bit rows decode both halves from one 16-byte load */
#define DEF_PAIR(DEC)                                                                                 \
    K512I void DEC##_2(const void* w, int64_t k, __m512* a, __m512* b) { *a = DEC(w, k); *b = DEC(w, k + 16); }
DEF_PAIR(dec_f32)
DEF_PAIR(dec_bf16)
DEF_PAIR(dec_f16)
DEF_PAIR(dec_i8)
DEF_PAIR(dec_e4m3)
K512I void nib32(const void* w, int64_t k, __m128i* a, __m128i* b) {
    __m128i x = _mm_loadu_si128((const __m128i*)((const uint8_t*)w + k / 2)), m = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    *a = _mm_unpacklo_epi8(lo, hi);
    *b = _mm_unpackhi_epi8(lo, hi);
}
K512I void dec_i4_2(const void* w, int64_t k, __m512* a, __m512* b) {
    __m128i u, v, e = _mm_set1_epi8(8);
    nib32(w, k, &u, &v);
    *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_xor_si128(u, e), e)));
    *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_xor_si128(v, e), e)));
}
K512I void dec_u4_2(const void* w, int64_t k, __m512* a, __m512* b) {
    __m128i u, v;
    nib32(w, k, &u, &v);
    *a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u));
    *b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
K512I void dec_e2m1_2(const void* w, int64_t k, __m512* a, __m512* b) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m512 half = _mm512_set1_ps(0.5f);
    __m128i u, v;
    nib32(w, k, &u, &v);
    *a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(lut, u))), half);
    *b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(lut, v))), half);
}
#define dec2_f32(w, k, a, b) dec_f32_2(w, k, &a, &b)
#define dec2_bf16(w, k, a, b) dec_bf16_2(w, k, &a, &b)
#define dec2_f16(w, k, a, b) dec_f16_2(w, k, &a, &b)
#define dec2_i8(w, k, a, b) dec_i8_2(w, k, &a, &b)
#define dec2_e4m3(w, k, a, b) dec_e4m3_2(w, k, &a, &b)
#define dec2_i4(w, k, a, b) dec_i4_2(w, k, &a, &b)
#define dec2_u4(w, k, a, b) dec_u4_2(w, k, &a, &b)
#define dec2_e2m1(w, k, a, b) dec_e2m1_2(w, k, &a, &b)

/*
 * One weight row against up to 4 activation rows. Per column block: accumulate in registers,
 * then fold into the running total with one FMA by the block's scale. A block's last < 16
 * elements are done in scalar (4-bit rows cannot be masked-loaded by element).
 */
#define DEF_ROWDOT(NAME, DEC, DEC2, DT, BITS)                                                                      \
    K512I void NAME##_mr(const RowDot* a, float* y, const int MR) {                                  \
        const float *x0 = a->x[0], *x1 = a->x[MR > 1 ? 1 : 0], *x2 = a->x[MR > 2 ? 2 : 0],            \
                    *x3 = a->x[MR > 3 ? 3 : 0];                                                       \
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;                                   \
        float r0 = 0, r1 = 0, r2 = 0, r3 = 0;                                                         \
        int64_t bi = 0;                                                                               \
        for (int64_t b0 = 0; b0 < a->K; b0 += a->bc, bi++) {                                          \
            int64_t b1 = b0 + a->bc < a->K ? b0 + a->bc : a->K, k = b0;                               \
            __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                               \
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                     \
            /* two accumulator sets: one FMA chain per row would wait on FMA latency */       \
            __m512 d0 = c0, d1 = c0, d2 = c0, d3 = c0;                                            \
            for (; k + 32 <= b1; k += 32) {                                                   \
                _mm_prefetch((const char*)a->w + ((k * BITS) >> 3) + 4096, _MM_HINT_T0);      \
                __m512 wv, wu;                                                                \
                DEC2(a->w, k, wv, wu);                                                        \
                c0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), wv, c0);                                                  \
                d0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k + 16), wu, d0);                                             \
                if (MR > 1) { c1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k), wv, c1); d1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k + 16), wu, d1); } \
                if (MR > 2) { c2 = _mm512_fmadd_ps(_mm512_loadu_ps(x2 + k), wv, c2); d2 = _mm512_fmadd_ps(_mm512_loadu_ps(x2 + k + 16), wu, d2); } \
                if (MR > 3) { c3 = _mm512_fmadd_ps(_mm512_loadu_ps(x3 + k), wv, c3); d3 = _mm512_fmadd_ps(_mm512_loadu_ps(x3 + k + 16), wu, d3); } \
            }                                                                                 \
            c0 = _mm512_add_ps(c0, d0); c1 = _mm512_add_ps(c1, d1); c2 = _mm512_add_ps(c2, d2); c3 = _mm512_add_ps(c3, d3);               \
            for (; k + 16 <= b1; k += 16) {                                                           \
                /* without huge pages the hardware prefetcher stops at every 4 KiB page; a     \
                 * software prefetch 4 KiB ahead keeps DRAM streaming (2x on GEMV) */         \
                _mm_prefetch((const char*)a->w + ((k * BITS) >> 3) + 4096, _MM_HINT_T0);      \
                __m512 wv = DEC(a->w, k);                                                             \
                c0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), wv, c0);                                \
                if (MR > 1) c1 = _mm512_fmadd_ps(_mm512_loadu_ps(x1 + k), wv, c1);                    \
                if (MR > 2) c2 = _mm512_fmadd_ps(_mm512_loadu_ps(x2 + k), wv, c2);                    \
                if (MR > 3) c3 = _mm512_fmadd_ps(_mm512_loadu_ps(x3 + k), wv, c3);                    \
            }                                                                                         \
            for (; k < b1; k++) {                                                                     \
                float wv = ld_elem(a->w, DT, k);                                                      \
                s0 += x0[k] * wv;                                                                     \
                if (MR > 1) s1 += x1[k] * wv;                                                         \
                if (MR > 2) s2 += x2[k] * wv;                                                         \
                if (MR > 3) s3 += x3[k] * wv;                                                         \
            }                                                                                         \
            float s = a->s ? a->s[bi] : 1.0f;                                                         \
            __m512 sv = _mm512_set1_ps(s);                                                            \
            t0 = _mm512_fmadd_ps(c0, sv, t0); r0 += s0 * s;                                           \
            if (MR > 1) { t1 = _mm512_fmadd_ps(c1, sv, t1); r1 += s1 * s; }                           \
            if (MR > 2) { t2 = _mm512_fmadd_ps(c2, sv, t2); r2 += s2 * s; }                           \
            if (MR > 3) { t3 = _mm512_fmadd_ps(c3, sv, t3); r3 += s3 * s; }                           \
        }                                                                                             \
        y[0] = _mm512_reduce_add_ps(t0) + r0;                                                         \
        if (MR > 1) y[1] = _mm512_reduce_add_ps(t1) + r1;                                             \
        if (MR > 2) y[2] = _mm512_reduce_add_ps(t2) + r2;                                             \
        if (MR > 3) y[3] = _mm512_reduce_add_ps(t3) + r3;                                             \
    }                                                                                                 \
    static K512 void NAME(const RowDot* a, float* y) {                                                \
        switch (a->mr) {                                                                              \
        case 1: NAME##_mr(a, y, 1); break;                                                            \
        case 2: NAME##_mr(a, y, 2); break;                                                            \
        case 3: NAME##_mr(a, y, 3); break;                                                            \
        default: NAME##_mr(a, y, 4); break;                                                           \
        }                                                                                             \
    }

#define DEF_ROWDOT4(NAME, DEC, DEC2, DT, BITS)                                                        \
    static K512 void NAME(const RowDot4* a, float* y) {                                               \
        const float* x = a->x;                                                                        \
        __m512 t[4];                                                                                  \
        float r[4] = {0, 0, 0, 0};                                                                    \
        for (int q = 0; q < 4; q++) t[q] = _mm512_setzero_ps();                                       \
        int64_t bi = 0;                                                                               \
        for (int64_t b0 = 0; b0 < a->K; b0 += a->bc, bi++) {                                          \
            int64_t b1 = b0 + a->bc < a->K ? b0 + a->bc : a->K, k = b0;                               \
            __m512 c[4], d[4];                                                                        \
            float sr[4] = {0, 0, 0, 0};                                                               \
            for (int q = 0; q < 4; q++) c[q] = d[q] = _mm512_setzero_ps();                            \
            for (; k + 32 <= b1; k += 32) {                                                           \
                if (a->pf && !((k * BITS / 8) & 63))                                                  \
                    for (int q = 0; q < 4; q++)                                                       \
                        _mm_prefetch((const char*)a->w[q] + a->pf + (k * BITS) / 8, _MM_HINT_T0);     \
                if (a->pf && BITS >= 32)                                                              \
                    for (int q = 0; q < 4; q++)                                                       \
                        _mm_prefetch((const char*)a->w[q] + a->pf + (k * BITS) / 8 + 64, _MM_HINT_T0);\
                __m512 xa = _mm512_loadu_ps(x + k), xb = _mm512_loadu_ps(x + k + 16);                 \
                for (int q = 0; q < 4; q++) {                                                         \
                    __m512 wv, wu;                                                                    \
                    DEC2(a->w[q], k, wv, wu);                                                         \
                    c[q] = _mm512_fmadd_ps(xa, wv, c[q]);                                             \
                    d[q] = _mm512_fmadd_ps(xb, wu, d[q]);                                             \
                }                                                                                     \
            }                                                                                         \
            for (; k + 16 <= b1; k += 16) {                                                           \
                __m512 xa = _mm512_loadu_ps(x + k);                                                   \
                for (int q = 0; q < 4; q++) c[q] = _mm512_fmadd_ps(xa, DEC(a->w[q], k), c[q]);        \
            }                                                                                         \
            for (; k < b1; k++)                                                                       \
                for (int q = 0; q < 4; q++) sr[q] += x[k] * ld_elem(a->w[q], DT, k);                  \
            for (int q = 0; q < 4; q++) {                                                             \
                float s = a->s[q] ? a->s[q][bi] : 1.0f;                                               \
                t[q] = _mm512_fmadd_ps(_mm512_add_ps(c[q], d[q]), _mm512_set1_ps(s), t[q]);           \
                r[q] += sr[q] * s;                                                                    \
            }                                                                                         \
        }                                                                                             \
        _mm_storeu_ps(y, _mm_add_ps(reduce4(t[0], t[1], t[2], t[3]), _mm_loadu_ps(r)));               \
    }

/*
 * Kernels for RowDot4.mr x rows (decode of several tokens of a sequence): the four weight rows
 * are loaded (and decoded) once a pass for two x rows, the first pass streaming them from memory
 * (it alone prefetches, PF) and later ones finding them in L1 or L2; an odd last x row goes
 * through the one-row kernel itself. A pass sums each (weight row, x row) pair with that kernel's
 * instructions in its order, so a row's result is the one-row kernel's bit for bit whatever mr is.
 */
#define ROWDOT4X_PASSES(PASS, ONE, a, y)                                                              \
    do {                                                                                              \
        int64_t i_ = 0;                                                                               \
        /* PF as a run-time flag: one copy of the pass (GCC 12 made two specialized copies whose    \
         * loop ran 40% slower on Zen 4, the same instructions in another layout) */                  \
        for (; i_ + 2 <= (a)->mr; i_ += 2) PASS(a, i_, i_ == 0, y);                                   \
        if (i_ < (a)->mr) {                                                                           \
            RowDot4 b_;                                                                               \
            b_.x = (a)->x + (a)->ldx * i_;                                                            \
            for (int q_ = 0; q_ < 4; q_++) { b_.w[q_] = (a)->w[q_]; b_.s[q_] = (a)->s[q_]; }          \
            b_.K = (a)->K;                                                                            \
            b_.bc = (a)->bc;                                                                          \
            b_.xp = (a)->xp ? (a)->xp + (a)->K * i_ : NULL;                                           \
            b_.xs = (a)->xs ? (a)->xs + 3 * (a)->K * i_ : NULL;                                       \
            b_.pf = i_ == 0 ? (a)->pf : 0;                                                            \
            ONE(&b_, y + (a)->ldy * i_);                                                              \
        }                                                                                             \
    } while (0)

/* DEF_ROWDOT4 for x rows i0, i0 + 1 */
#define DEF_ROWDOT4X(NAME, ONE, DEC, DEC2, DT, BITS)                                                  \
    K512I void NAME##_pass(const RowDot4* a, int64_t i0, const int PF, float* y) {                   \
        const float* x0 = a->x + a->ldx * i0;                                                         \
        const float* x1 = x0 + a->ldx;                                                                \
        __m512 t0[4], t1[4];                                                                          \
        float r0[4] = {0, 0, 0, 0}, r1[4] = {0, 0, 0, 0};                                             \
        for (int q = 0; q < 4; q++) t0[q] = t1[q] = _mm512_setzero_ps();                              \
        int64_t bi = 0;                                                                               \
        for (int64_t b0 = 0; b0 < a->K; b0 += a->bc, bi++) {                                          \
            int64_t b1 = b0 + a->bc < a->K ? b0 + a->bc : a->K, k = b0;                               \
            __m512 c0[4], d0[4], c1[4], d1[4];                                                        \
            float s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0};                                         \
            for (int q = 0; q < 4; q++) c0[q] = d0[q] = c1[q] = d1[q] = _mm512_setzero_ps();          \
            for (; k + 32 <= b1; k += 32) {                                                           \
                if (PF && a->pf && !((k * BITS / 8) & 63))                                            \
                    for (int q = 0; q < 4; q++)                                                       \
                        _mm_prefetch((const char*)a->w[q] + a->pf + (k * BITS) / 8, _MM_HINT_T0);     \
                if (PF && a->pf && BITS >= 32)                                                        \
                    for (int q = 0; q < 4; q++)                                                       \
                        _mm_prefetch((const char*)a->w[q] + a->pf + (k * BITS) / 8 + 64, _MM_HINT_T0);\
                __m512 xa0 = _mm512_loadu_ps(x0 + k), xb0 = _mm512_loadu_ps(x0 + k + 16);             \
                __m512 xa1 = _mm512_loadu_ps(x1 + k), xb1 = _mm512_loadu_ps(x1 + k + 16);             \
                for (int q = 0; q < 4; q++) {                                                         \
                    __m512 wv, wu;                                                                    \
                    DEC2(a->w[q], k, wv, wu);                                                         \
                    /* in registers: f32 rows would otherwise be loaded once per x row */             \
                    __asm__("" : "+v"(wv), "+v"(wu));                                                 \
                    c0[q] = _mm512_fmadd_ps(xa0, wv, c0[q]);                                          \
                    d0[q] = _mm512_fmadd_ps(xb0, wu, d0[q]);                                          \
                    c1[q] = _mm512_fmadd_ps(xa1, wv, c1[q]);                                          \
                    d1[q] = _mm512_fmadd_ps(xb1, wu, d1[q]);                                          \
                }                                                                                     \
            }                                                                                         \
            for (; k + 16 <= b1; k += 16) {                                                           \
                __m512 xa0 = _mm512_loadu_ps(x0 + k), xa1 = _mm512_loadu_ps(x1 + k);                  \
                for (int q = 0; q < 4; q++) {                                                         \
                    __m512 wv = DEC(a->w[q], k);                                                      \
                    c0[q] = _mm512_fmadd_ps(xa0, wv, c0[q]);                                          \
                    c1[q] = _mm512_fmadd_ps(xa1, wv, c1[q]);                                          \
                }                                                                                     \
            }                                                                                         \
            for (; k < b1; k++)                                                                       \
                for (int q = 0; q < 4; q++) {                                                         \
                    float wv = ld_elem(a->w[q], DT, k);                                               \
                    s0[q] += x0[k] * wv;                                                              \
                    s1[q] += x1[k] * wv;                                                              \
                }                                                                                     \
            for (int q = 0; q < 4; q++) {                                                             \
                float s = a->s[q] ? a->s[q][bi] : 1.0f;                                               \
                t0[q] = _mm512_fmadd_ps(_mm512_add_ps(c0[q], d0[q]), _mm512_set1_ps(s), t0[q]);       \
                t1[q] = _mm512_fmadd_ps(_mm512_add_ps(c1[q], d1[q]), _mm512_set1_ps(s), t1[q]);       \
                r0[q] += s0[q] * s;                                                                   \
                r1[q] += s1[q] * s;                                                                   \
            }                                                                                         \
        }                                                                                             \
        _mm_storeu_ps(y + a->ldy * i0, _mm_add_ps(reduce4(t0[0], t0[1], t0[2], t0[3]), _mm_loadu_ps(r0))); \
        _mm_storeu_ps(y + a->ldy * (i0 + 1), _mm_add_ps(reduce4(t1[0], t1[1], t1[2], t1[3]), _mm_loadu_ps(r1))); \
    }                                                                                                 \
    static K512 void NAME(const RowDot4* a, float* y) { ROWDOT4X_PASSES(NAME##_pass, ONE, a, y); }

/* 32 weights of a 4-bit row per step: 16 bytes widened to 16 dwords, low nibbles (even elements)
 * and high nibbles (odd ones) looked up in the dtype's value table, against x's even and odd
 * elements (xp). One block scale per block as in the other kernels. */
K512I void rowdot4_nib_impl(const RowDot4* a, float* y, const float* table) {
    const __m512 lut = _mm512_loadu_ps(table);
    __m512 t[4];
    float r[4] = {0, 0, 0, 0};
    for (int q = 0; q < 4; q++) t[q] = _mm512_setzero_ps();
    int64_t bi = 0;
    for (int64_t b0 = 0; b0 < a->K; b0 += a->bc, bi++) {
        int64_t b1 = b0 + a->bc < a->K ? b0 + a->bc : a->K, k = b0;
        __m512 c[4], d[4];
        float sr[4] = {0, 0, 0, 0};
        for (int q = 0; q < 4; q++) c[q] = d[q] = _mm512_setzero_ps();
        for (; k + 32 <= b1; k += 32) {
            if (a->pf && !(k & 127))
                for (int q = 0; q < 4; q++) _mm_prefetch((const char*)a->w[q] + a->pf + k / 2, _MM_HINT_T0);
            __m512 xe = _mm512_loadu_ps(a->xp + k), xo = _mm512_loadu_ps(a->xp + k + 16);
            for (int q = 0; q < 4; q++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)a->w[q] + k / 2)));
                /* vpermps reads only the low 4 bits of each index: the low nibble as it is */
                c[q] = _mm512_fmadd_ps(xe, _mm512_permutexvar_ps(v, lut), c[q]);
                d[q] = _mm512_fmadd_ps(xo, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), d[q]);
            }
        }
        for (; k < b1; k++) {   /* a tail shorter than 32: x in its natural order */
            for (int q = 0; q < 4; q++) {
                const uint8_t* p = (const uint8_t*)a->w[q];
                sr[q] += a->x[k] * table[(p[k >> 1] >> ((k & 1) * 4)) & 15];
            }
        }
        for (int q = 0; q < 4; q++) {
            float s = a->s[q] ? a->s[q][bi] : 1.0f;
            t[q] = _mm512_fmadd_ps(_mm512_add_ps(c[q], d[q]), _mm512_set1_ps(s), t[q]);
            r[q] += sr[q] * s;
        }
    }
    _mm_storeu_ps(y, _mm_add_ps(reduce4(t[0], t[1], t[2], t[3]), _mm_loadu_ps(r)));
}
/* rowdot4_nib_impl for x rows i0, i0 + 1 (xp holds K reordered values per x row) */
K512I void nibx_pass(const RowDot4* a, int64_t i0, const int PF, float* y, const float* table) {
    const __m512 lut = _mm512_loadu_ps(table);
    const float *p0 = a->xp + a->K * i0, *p1 = p0 + a->K;
    const float *x0 = a->x + a->ldx * i0, *x1 = x0 + a->ldx;
    __m512 t0[4], t1[4];
    float r0[4] = {0, 0, 0, 0}, r1[4] = {0, 0, 0, 0};
    for (int q = 0; q < 4; q++) t0[q] = t1[q] = _mm512_setzero_ps();
    int64_t bi = 0;
    for (int64_t b0 = 0; b0 < a->K; b0 += a->bc, bi++) {
        int64_t b1 = b0 + a->bc < a->K ? b0 + a->bc : a->K, k = b0;
        __m512 c0[4], d0[4], c1[4], d1[4];
        float s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0};
        for (int q = 0; q < 4; q++) c0[q] = d0[q] = c1[q] = d1[q] = _mm512_setzero_ps();
        for (; k + 32 <= b1; k += 32) {
            if (PF && a->pf && !(k & 127))
                for (int q = 0; q < 4; q++) _mm_prefetch((const char*)a->w[q] + a->pf + k / 2, _MM_HINT_T0);
            __m512 xe0 = _mm512_loadu_ps(p0 + k), xo0 = _mm512_loadu_ps(p0 + k + 16);
            __m512 xe1 = _mm512_loadu_ps(p1 + k), xo1 = _mm512_loadu_ps(p1 + k + 16);
            for (int q = 0; q < 4; q++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)a->w[q] + k / 2)));
                __m512 we = _mm512_permutexvar_ps(v, lut), wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
                c0[q] = _mm512_fmadd_ps(xe0, we, c0[q]);
                d0[q] = _mm512_fmadd_ps(xo0, wo, d0[q]);
                c1[q] = _mm512_fmadd_ps(xe1, we, c1[q]);
                d1[q] = _mm512_fmadd_ps(xo1, wo, d1[q]);
            }
        }
        for (; k < b1; k++)
            for (int q = 0; q < 4; q++) {
                const uint8_t* p = (const uint8_t*)a->w[q];
                float wv = table[(p[k >> 1] >> ((k & 1) * 4)) & 15];
                s0[q] += x0[k] * wv;
                s1[q] += x1[k] * wv;
            }
        for (int q = 0; q < 4; q++) {
            float s = a->s[q] ? a->s[q][bi] : 1.0f;
            t0[q] = _mm512_fmadd_ps(_mm512_add_ps(c0[q], d0[q]), _mm512_set1_ps(s), t0[q]);
            t1[q] = _mm512_fmadd_ps(_mm512_add_ps(c1[q], d1[q]), _mm512_set1_ps(s), t1[q]);
            r0[q] += s0[q] * s;
            r1[q] += s1[q] * s;
        }
    }
    _mm_storeu_ps(y + a->ldy * i0, _mm_add_ps(reduce4(t0[0], t0[1], t0[2], t0[3]), _mm_loadu_ps(r0)));
    _mm_storeu_ps(y + a->ldy * (i0 + 1), _mm_add_ps(reduce4(t1[0], t1[1], t1[2], t1[3]), _mm_loadu_ps(r1)));
}

static __attribute__((target(TGT ",avx512bf16"))) void rowdot4_bf16dp(const RowDot4* a, float* y) {
    const uint16_t *xh = a->xs, *xm = a->xs + a->K, *xl = a->xs + 2 * a->K;
    __m512 h[4], m[4], l[4];
    for (int q = 0; q < 4; q++) h[q] = m[q] = l[q] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= a->K; k += 32) {
        if (a->pf && !(k & 31))
            for (int q = 0; q < 4; q++) _mm_prefetch((const char*)a->w[q] + a->pf + 2 * k, _MM_HINT_T0);
        __m512bh vh = (__m512bh)_mm512_loadu_si512((const void*)(xh + k));
        __m512bh vm = (__m512bh)_mm512_loadu_si512((const void*)(xm + k));
        __m512bh vl = (__m512bh)_mm512_loadu_si512((const void*)(xl + k));
        for (int q = 0; q < 4; q++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)((const uint16_t*)a->w[q] + k));
            h[q] = _mm512_dpbf16_ps(h[q], w, vh);
            m[q] = _mm512_dpbf16_ps(m[q], w, vm);
            l[q] = _mm512_dpbf16_ps(l[q], w, vl);
        }
    }
    float r[4] = {0, 0, 0, 0};
    for (; k < a->K; k++)
        for (int q = 0; q < 4; q++) r[q] += a->x[k] * bf16_to_f32(((const uint16_t*)a->w[q])[k]);
    __m512 t[4];
    for (int q = 0; q < 4; q++) t[q] = _mm512_add_ps(_mm512_add_ps(l[q], m[q]), h[q]);
    _mm_storeu_ps(y, _mm_add_ps(reduce4(t[0], t[1], t[2], t[3]), _mm_loadu_ps(r)));
}

/* rowdot4_bf16dp for x rows i0, i0 + 1: 24 accumulators, the four weight vectors and one x part
 * of both rows fill 30 registers */
#define TGTBF TGT ",avx512bf16"
static inline __attribute__((always_inline, target(TGTBF))) void bf16dp_pass(const RowDot4* a, int64_t i0,
                                                                              const int PF, float* y) {
    int64_t K = a->K;
    const uint16_t* x0 = a->xs + 3 * K * i0;
    const uint16_t* x1 = x0 + 3 * K;
    __m512 h0[4], m0[4], l0[4], h1[4], m1[4], l1[4];
    for (int q = 0; q < 4; q++) h0[q] = m0[q] = l0[q] = h1[q] = m1[q] = l1[q] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (PF && a->pf)
            for (int q = 0; q < 4; q++) _mm_prefetch((const char*)a->w[q] + a->pf + 2 * k, _MM_HINT_T0);
        __m512bh w[4];
        for (int q = 0; q < 4; q++) w[q] = (__m512bh)_mm512_loadu_si512((const void*)((const uint16_t*)a->w[q] + k));
        __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void*)(x0 + k));
        __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void*)(x1 + k));
        for (int q = 0; q < 4; q++) {
            h0[q] = _mm512_dpbf16_ps(h0[q], w[q], v0);
            h1[q] = _mm512_dpbf16_ps(h1[q], w[q], v1);
        }
        v0 = (__m512bh)_mm512_loadu_si512((const void*)(x0 + K + k));
        v1 = (__m512bh)_mm512_loadu_si512((const void*)(x1 + K + k));
        for (int q = 0; q < 4; q++) {
            m0[q] = _mm512_dpbf16_ps(m0[q], w[q], v0);
            m1[q] = _mm512_dpbf16_ps(m1[q], w[q], v1);
        }
        v0 = (__m512bh)_mm512_loadu_si512((const void*)(x0 + 2 * K + k));
        v1 = (__m512bh)_mm512_loadu_si512((const void*)(x1 + 2 * K + k));
        for (int q = 0; q < 4; q++) {
            l0[q] = _mm512_dpbf16_ps(l0[q], w[q], v0);
            l1[q] = _mm512_dpbf16_ps(l1[q], w[q], v1);
        }
    }
    const float* f0 = a->x + a->ldx * i0;
    const float* f1 = f0 + a->ldx;
    float r0[4] = {0, 0, 0, 0}, r1[4] = {0, 0, 0, 0};
    for (; k < K; k++)
        for (int q = 0; q < 4; q++) {
            float wv = bf16_to_f32(((const uint16_t*)a->w[q])[k]);
            r0[q] += f0[k] * wv;
            r1[q] += f1[k] * wv;
        }
    __m512 t[4];
    for (int q = 0; q < 4; q++) t[q] = _mm512_add_ps(_mm512_add_ps(l0[q], m0[q]), h0[q]);
    _mm_storeu_ps(y + a->ldy * i0, _mm_add_ps(reduce4(t[0], t[1], t[2], t[3]), _mm_loadu_ps(r0)));
    for (int q = 0; q < 4; q++) t[q] = _mm512_add_ps(_mm512_add_ps(l1[q], m1[q]), h1[q]);
    _mm_storeu_ps(y + a->ldy * (i0 + 1), _mm_add_ps(reduce4(t[0], t[1], t[2], t[3]), _mm_loadu_ps(r1)));
}

/* x = hi + mid + lo in bf16, 16 elements a step: truncation keeps 8 significant bits a part, so
 * both subtractions are exact */
static K512 void split_bf16x3_512(const float* x, int64_t K, uint16_t* xs) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000);
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        __m512i v = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, x + k));
        __m512i hi = _mm512_and_si512(v, top);
        /* inf / NaN: all in hi, as the f32 path would see it */
        __mmask16 fin = _mm512_cmpneq_epi32_mask(_mm512_and_si512(v, expo), expo);
        __m512 r1 = _mm512_maskz_sub_ps(fin, _mm512_castsi512_ps(v), _mm512_castsi512_ps(hi));
        __m512i mid = _mm512_and_si512(_mm512_castps_si512(r1), top);
        __m512i lo = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(mid)));
        _mm256_mask_storeu_epi16(xs + k, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
        _mm256_mask_storeu_epi16(xs + K + k, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(mid, 16)));
        _mm256_mask_storeu_epi16(xs + 2 * K + k, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
    }
}

static __attribute__((target(TGTBF))) void rowdot4x_bf16dp(const RowDot4* a, float* y) {
    ROWDOT4X_PASSES(bf16dp_pass, rowdot4_bf16dp, a, y);
}

static const float k_tab_i4[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
static const float k_tab_u4[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const float k_tab_e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
static K512 void rowdot4_nib_i4(const RowDot4* a, float* y) { rowdot4_nib_impl(a, y, k_tab_i4); }
static K512 void rowdot4_nib_u4(const RowDot4* a, float* y) { rowdot4_nib_impl(a, y, k_tab_u4); }
static K512 void rowdot4_nib_e2m1(const RowDot4* a, float* y) { rowdot4_nib_impl(a, y, k_tab_e2m1); }
#define DEF_NIBX(NAME, ONE, TABLE)                                                                    \
    K512I void NAME##_pass(const RowDot4* a, int64_t i0, const int PF, float* y) {                   \
        nibx_pass(a, i0, PF, y, TABLE);                                                               \
    }                                                                                                 \
    static K512 void NAME(const RowDot4* a, float* y) { ROWDOT4X_PASSES(NAME##_pass, ONE, a, y); }
DEF_NIBX(rowdot4x_nib_i4, rowdot4_nib_i4, k_tab_i4)
DEF_NIBX(rowdot4x_nib_u4, rowdot4_nib_u4, k_tab_u4)
DEF_NIBX(rowdot4x_nib_e2m1, rowdot4_nib_e2m1, k_tab_e2m1)

DEF_ROWDOT4(rowdot4_f32, dec_f32, dec2_f32, DT_F32, 32)
DEF_ROWDOT4(rowdot4_bf16, dec_bf16, dec2_bf16, DT_BF16, 16)
DEF_ROWDOT4(rowdot4_f16, dec_f16, dec2_f16, DT_F16, 16)
DEF_ROWDOT4(rowdot4_i8, dec_i8, dec2_i8, DT_I8, 8)
DEF_ROWDOT4(rowdot4_i4, dec_i4, dec2_i4, DT_I4, 4)
DEF_ROWDOT4(rowdot4_u4, dec_u4, dec2_u4, DT_U4, 4)
DEF_ROWDOT4(rowdot4_e2m1, dec_e2m1, dec2_e2m1, DT_E2M1, 4)
DEF_ROWDOT4(rowdot4_e4m3, dec_e4m3, dec2_e4m3, DT_E4M3, 8)

DEF_ROWDOT4X(rowdot4x_f32, rowdot4_f32, dec_f32, dec2_f32, DT_F32, 32)
DEF_ROWDOT4X(rowdot4x_bf16, rowdot4_bf16, dec_bf16, dec2_bf16, DT_BF16, 16)
DEF_ROWDOT4X(rowdot4x_f16, rowdot4_f16, dec_f16, dec2_f16, DT_F16, 16)
DEF_ROWDOT4X(rowdot4x_i8, rowdot4_i8, dec_i8, dec2_i8, DT_I8, 8)
DEF_ROWDOT4X(rowdot4x_i4, rowdot4_i4, dec_i4, dec2_i4, DT_I4, 4)
DEF_ROWDOT4X(rowdot4x_u4, rowdot4_u4, dec_u4, dec2_u4, DT_U4, 4)
DEF_ROWDOT4X(rowdot4x_e2m1, rowdot4_e2m1, dec_e2m1, dec2_e2m1, DT_E2M1, 4)
DEF_ROWDOT4X(rowdot4x_e4m3, rowdot4_e4m3, dec_e4m3, dec2_e4m3, DT_E4M3, 8)

DEF_ROWDOT(rowdot_f32, dec_f32, dec2_f32, DT_F32, 32)
DEF_ROWDOT(rowdot_bf16, dec_bf16, dec2_bf16, DT_BF16, 16)
DEF_ROWDOT(rowdot_f16, dec_f16, dec2_f16, DT_F16, 16)
DEF_ROWDOT(rowdot_i8, dec_i8, dec2_i8, DT_I8, 8)
DEF_ROWDOT(rowdot_i4, dec_i4, dec2_i4, DT_I4, 4)
DEF_ROWDOT(rowdot_u4, dec_u4, dec2_u4, DT_U4, 4)
DEF_ROWDOT(rowdot_e2m1, dec_e2m1, dec2_e2m1, DT_E2M1, 4)
DEF_ROWDOT(rowdot_e4m3, dec_e4m3, dec2_e4m3, DT_E4M3, 8)

/* ------------------------------------------------------------------ f32 dot-product GEMM */
/* C[i, j] = A[i] . B[j] for MR x NR rows, K with a masked tail */
K512I void dot_block(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                     const int MR, const int NR) {
    __m512 acc[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 b[4];
        for (int j = 0; j < NR; j++) b[j] = _mm512_loadu_ps(B + j * ldb + k);
        for (int i = 0; i < MR; i++) {
            __m512 av = _mm512_loadu_ps(A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(av, b[j], acc[i][j]);
        }
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        __m512 b[4];
        for (int j = 0; j < NR; j++) b[j] = _mm512_maskz_loadu_ps(m, B + j * ldb + k);
        for (int i = 0; i < MR; i++) {
            __m512 av = _mm512_maskz_loadu_ps(m, A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(av, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) C[i * ldc + j] = _mm512_reduce_add_ps(acc[i][j]);
}

static K512 void gemm_dot_512(const float* A, int64_t lda, int M, const float* B, int64_t ldb, int N, int64_t K,
                              float* C, int64_t ldc) {
    int i = 0;
    for (; i + 4 <= M; i += 4) {
        int j = 0;
        for (; j + 4 <= N; j += 4) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 4, 4);
        for (; j < N; j++) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 4, 1);
    }
    for (; i < M; i++) {
        int j = 0;
        for (; j + 4 <= N; j += 4) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 1, 4);
        for (; j < N; j++) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 1, 1);
    }
}

/* ------------------------------------------------------------------ attention rows */
static K512 void dot_rows_512(const float* q, const float* rows, int64_t ld,
                                                                    int n, int64_t D, float* out) {
    int r = 0;
    for (; r + 4 <= n; r += 4) {
        const float *r0 = rows + r * ld, *r1 = r0 + ld, *r2 = r1 + ld, *r3 = r2 + ld;
        __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
        int64_t k = 0;
        for (; k + 16 <= D; k += 16) {
            __m512 qv = _mm512_loadu_ps(q + k);
            a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(r0 + k), a);
            b = _mm512_fmadd_ps(qv, _mm512_loadu_ps(r1 + k), b);
            c = _mm512_fmadd_ps(qv, _mm512_loadu_ps(r2 + k), c);
            d = _mm512_fmadd_ps(qv, _mm512_loadu_ps(r3 + k), d);
        }
        if (k < D) {
            __mmask16 m = (__mmask16)((1u << (D - k)) - 1u);
            __m512 qv = _mm512_maskz_loadu_ps(m, q + k);
            a = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, r0 + k), a);
            b = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, r1 + k), b);
            c = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, r2 + k), c);
            d = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, r3 + k), d);
        }
        _mm_storeu_ps(out + r, reduce4(a, b, c, d));
    }
    for (; r < n; r++) {
        const float* rr = rows + r * ld;
        __m512 a = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= D; k += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + k), _mm512_loadu_ps(rr + k), a);
        if (k < D) {
            __mmask16 m = (__mmask16)((1u << (D - k)) - 1u);
            a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + k), _mm512_maskz_loadu_ps(m, rr + k), a);
        }
        out[r] = _mm512_reduce_add_ps(a);
    }
}

/* acc += sum_r w[r] row r, 128 columns at a time held in eight registers across all rows */
static K512 void wsum_rows_512(const float* w, const float* rows, int64_t ld, int n, int64_t D, float* acc) {
    int64_t d0 = 0;
    for (; d0 + 128 <= D; d0 += 128) {
        __m512 v[8];
        for (int i = 0; i < 8; i++) v[i] = _mm512_loadu_ps(acc + d0 + 16 * i);
        for (int r = 0; r < n; r++) {
            __m512 wr = _mm512_set1_ps(w[r]);
            const float* rr = rows + r * ld + d0;
            for (int i = 0; i < 8; i++) v[i] = _mm512_fmadd_ps(wr, _mm512_loadu_ps(rr + 16 * i), v[i]);
        }
        for (int i = 0; i < 8; i++) _mm512_storeu_ps(acc + d0 + 16 * i, v[i]);
    }
    for (; d0 < D; d0 += 16) {
        __mmask16 m = D - d0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d0)) - 1u);
        __m512 v = _mm512_maskz_loadu_ps(m, acc + d0);
        for (int r = 0; r < n; r++)
            v = _mm512_fmadd_ps(_mm512_set1_ps(w[r]), _mm512_maskz_loadu_ps(m, rows + r * ld + d0), v);
        _mm512_mask_storeu_ps(acc + d0, m, v);
    }
}

/* wsum_rows_512 for four weight rows: 64 columns (4 registers) of four accumulators held across all
 * rows, each row's 4 vectors loaded once and fed to four FMAs each; per element the FMAs of
 * wsum_rows_512 in its order (r ascending), so the sums are bit-identical to four calls of it */
static K512 void wsum_rows4_512(const float* const w[4], const float* rows, int64_t ld, int n, int64_t D,
                                float* const acc[4]) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m512 v[4][4];
        for (int h = 0; h < 4; h++)
            for (int i = 0; i < 4; i++) v[h][i] = _mm512_loadu_ps(acc[h] + d0 + 16 * i);
        for (int r = 0; r < n; r++) {
            const float* rr = rows + r * ld + d0;
            __m512 x0 = _mm512_loadu_ps(rr), x1 = _mm512_loadu_ps(rr + 16), x2 = _mm512_loadu_ps(rr + 32),
                   x3 = _mm512_loadu_ps(rr + 48);
            for (int h = 0; h < 4; h++) {
                __m512 wr = _mm512_set1_ps(w[h][r]);
                v[h][0] = _mm512_fmadd_ps(wr, x0, v[h][0]);
                v[h][1] = _mm512_fmadd_ps(wr, x1, v[h][1]);
                v[h][2] = _mm512_fmadd_ps(wr, x2, v[h][2]);
                v[h][3] = _mm512_fmadd_ps(wr, x3, v[h][3]);
            }
        }
        for (int h = 0; h < 4; h++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc[h] + d0 + 16 * i, v[h][i]);
    }
    for (; d0 < D; d0 += 16) {
        __mmask16 m = D - d0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d0)) - 1u);
        __m512 v[4];
        for (int h = 0; h < 4; h++) v[h] = _mm512_maskz_loadu_ps(m, acc[h] + d0);
        for (int r = 0; r < n; r++) {
            __m512 x = _mm512_maskz_loadu_ps(m, rows + r * ld + d0);
            for (int h = 0; h < 4; h++) v[h] = _mm512_fmadd_ps(_mm512_set1_ps(w[h][r]), x, v[h]);
        }
        for (int h = 0; h < 4; h++) _mm512_mask_storeu_ps(acc[h] + d0, m, v[h]);
    }
}

/* exp(x) for x <= 0 (softmax after the max is subtracted): 2^(x log2 e) split into 2^n * 2^f,
 * 2^f by a degree-6 polynomial on [-0.5, 0.5] (relative error ~2e-7, that of expf to a few ulp);
 * below -87 the result is 0 */
K512I __m512 exp_neg(__m512 x) {
    const __m512 l2e = _mm512_set1_ps(1.44269504088896341f);
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), l2e);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));   /* f ln2 in [-ln2/2, ln2/2] */
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512 r = _mm512_scalef_ps(p, n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), r, _mm512_setzero_ps());
}

static K512 void softmax_512(float* s, int64_t n, float scale) {
    __m512 sc = _mm512_set1_ps(scale), mx = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + i), sc);
        _mm512_storeu_ps(s + i, v);
        mx = _mm512_max_ps(mx, v);
    }
    float m = _mm512_reduce_max_ps(mx);
    for (; i < n; i++) { s[i] *= scale; m = fmaxf(m, s[i]); }
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    float tot = _mm512_reduce_add_ps(sum);
    for (; i < n; i++) { s[i] = expf(s[i] - m); tot += s[i]; }
    __m512 inv = _mm512_set1_ps(1.0f / tot);
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    for (; i < n; i++) s[i] *= 1.0f / tot;
}

/* ------------------------------------------------------------------ int8 dot and int4 unpack */
static K512 int32_t dot_i8_512(const int8_t* a, const int8_t* b, int64_t n) {
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(a + i)));
        __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b + i)));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(x, y));
    }
    int32_t s = _mm512_reduce_add_epi32(acc);
    for (; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* VNNI: vpdpwssd fuses the pairwise multiply-add and the accumulate; int16 operands keep it
 * exact for every int8 value (the u8 x s8 form would need a bias correction and cannot take -128) */
static __attribute__((target(TGT ",avx512vnni"))) int32_t dot_i8_vnni(const int8_t* a, const int8_t* b, int64_t n) {
    __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(a + i)));
        __m512i y0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b + i)));
        __m512i x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(a + i + 32)));
        __m512i y1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b + i + 32)));
        acc0 = _mm512_dpwssd_epi32(acc0, x0, y0);
        acc1 = _mm512_dpwssd_epi32(acc1, x1, y1);
    }
    for (; i + 32 <= n; i += 32) {
        __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(a + i)));
        __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b + i)));
        acc0 = _mm512_dpwssd_epi32(acc0, x, y);
    }
    int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(acc0, acc1));
    for (; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* per segment: exact int32 lanes, converted and scaled once; one horizontal sum per row */
#define DEF_DOT_SEG(NAME, ATTR, MAC)                                                                   \
    static ATTR float NAME(const int8_t* a, const int8_t* b, const int64_t* seg, int64_t nseg,         \
                           const float* scale) {                                                       \
        __m512 tot = _mm512_setzero_ps();                                                              \
        float tail = 0.0f;                                                                             \
        for (int64_t s = 0; s < nseg; s++) {                                                           \
            int64_t k = seg[s], k1 = seg[s + 1];                                                       \
            __m512i acc = _mm512_setzero_si512();                                                      \
            for (; k + 32 <= k1; k += 32) {                                                            \
                __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(a + k)));         \
                __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b + k)));         \
                acc = MAC(acc, x, y);                                                                  \
            }                                                                                          \
            int32_t t = 0;                                                                             \
            for (; k < k1; k++) t += (int32_t)a[k] * (int32_t)b[k];                                    \
            tot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(scale[s]), tot);             \
            tail += (float)t * scale[s];                                                               \
        }                                                                                              \
        return _mm512_reduce_add_ps(tot) + tail;                                                       \
    }
#define MAC_MADD(acc, x, y) _mm512_add_epi32(acc, _mm512_madd_epi16(x, y))
#define MAC_VNNI(acc, x, y) _mm512_dpwssd_epi32(acc, x, y)
DEF_DOT_SEG(dot_i8_seg_512, K512, MAC_MADD)
DEF_DOT_SEG(dot_i8_seg_vnni, __attribute__((target(TGT ",avx512vnni"))), MAC_VNNI)

static K512 void unpack_i4_512(const uint8_t* src, int64_t n, int8_t* dst, int sign) {
    const __m128i m = _mm_set1_epi8(15), e = _mm_set1_epi8(8);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m128i b = _mm_loadu_si128((const __m128i*)(src + i / 2));
        __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        __m128i v0 = _mm_unpacklo_epi8(lo, hi), v1 = _mm_unpackhi_epi8(lo, hi);
        if (sign) {
            v0 = _mm_sub_epi8(_mm_xor_si128(v0, e), e);
            v1 = _mm_sub_epi8(_mm_xor_si128(v1, e), e);
        }
        _mm_storeu_si128((__m128i*)(dst + i), v0);
        _mm_storeu_si128((__m128i*)(dst + i + 16), v1);
    }
    for (; i + 1 < n; i += 2) {
        int lo = src[i / 2] & 15, hi = src[i / 2] >> 4;
        if (sign) { lo = lo >= 8 ? lo - 16 : lo; hi = hi >= 8 ? hi - 16 : hi; }
        dst[i] = (int8_t)lo;
        dst[i + 1] = (int8_t)hi;
    }
}

/* ------------------------------------------------------------------ VNNI integer rows (IDot) */
#define TGTV TGT ",avx512vnni"
#define KV static inline __attribute__((always_inline, target(TGTV)))

/* int4: a chunk is 32 bytes = 64 weights; (b ^ 0x88) turns both nibbles' two's complement q into
 * the unsigned q + 8; low nibbles are the even elements, high nibbles the odd ones. Two accumulators
 * per row (even, odd) halve the dependency chain; the even one starts from the bias. */
KV void idot_i4_mr(const IDot* a, float* y, const int MR) {
    const uint8_t* w = (const uint8_t*)a->w;
    const __m256i m4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x88);
    __m256 tot[IDOT_MAX_MR];
    for (int i = 0; i < MR; i++) tot[i] = _mm256_setzero_ps();
    int64_t c = 0;
    for (int64_t s = 0; s < a->nseg; s++) {
        __m256i ae[IDOT_MAX_MR], ao[IDOT_MAX_MR];
        for (int i = 0; i < MR; i++) {
            ae[i] = _mm256_loadu_si256((const __m256i*)(a->bias + (i * a->nseg + s) * 8));
            ao[i] = _mm256_setzero_si256();
        }
        for (int64_t c1 = a->seg_end[s]; c < c1; c++) {
            _mm_prefetch((const char*)w + c * 32 + 2048, _MM_HINT_T0);
            __m256i b = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + c * 32)), flip);
            __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
            for (int i = 0; i < MR; i++) {
                const int8_t* x = a->x[i] + c * 64;
                ae[i] = _mm256_dpbusd_epi32(ae[i], lo, _mm256_loadu_si256((const __m256i*)x));
                ao[i] = _mm256_dpbusd_epi32(ao[i], hi, _mm256_loadu_si256((const __m256i*)(x + 32)));
            }
        }
        for (int i = 0; i < MR; i++)
            tot[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ae[i], ao[i])),
                                     _mm256_set1_ps(a->scale[i * a->nseg + s]), tot[i]);
    }
    for (int i = 0; i < MR; i++) y[i] = hsum256(tot[i]);
}

/* int8: a chunk is 64 weights; w ^ 0x80 is the unsigned w + 128. Chunks alternate between two
 * accumulators per row, so a long per-channel segment is not one dependency chain. */
KV void idot_i8_mr(const IDot* a, float* y, const int MR) {
    const int8_t* w = (const int8_t*)a->w;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 tot[IDOT_MAX_MR];
    for (int i = 0; i < MR; i++) tot[i] = _mm512_setzero_ps();
    int64_t c = 0;
    for (int64_t s = 0; s < a->nseg; s++) {
        __m512i a0[IDOT_MAX_MR], a1[IDOT_MAX_MR];
        for (int i = 0; i < MR; i++) {
            a0[i] = _mm512_loadu_si512((const void*)(a->bias + (i * a->nseg + s) * 16));
            a1[i] = _mm512_setzero_si512();
        }
        int64_t c1 = a->seg_end[s];
        for (; c + 2 <= c1; c += 2) {
            _mm_prefetch((const char*)w + c * 64 + 2048, _MM_HINT_T0);
            __m512i u0 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(w + c * 64)), flip);
            __m512i u1 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(w + c * 64 + 64)), flip);
            for (int i = 0; i < MR; i++) {
                const int8_t* x = a->x[i] + c * 64;
                a0[i] = _mm512_dpbusd_epi32(a0[i], u0, _mm512_loadu_si512((const void*)x));
                a1[i] = _mm512_dpbusd_epi32(a1[i], u1, _mm512_loadu_si512((const void*)(x + 64)));
            }
        }
        if (c < c1) {
            __m512i u0 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(w + c * 64)), flip);
            for (int i = 0; i < MR; i++)
                a0[i] = _mm512_dpbusd_epi32(a0[i], u0, _mm512_loadu_si512((const void*)(a->x[i] + c * 64)));
            c++;
        }
        for (int i = 0; i < MR; i++)
            tot[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0[i], a1[i])),
                                     _mm512_set1_ps(a->scale[i * a->nseg + s]), tot[i]);
    }
    /* idot4_i8's reduction (reduce4 sums each vector alone): a row's result is the same at any M */
    const __m512 z = _mm512_setzero_ps();
    for (int i = 0; i < MR; i += 4) {
        float r[4];
        _mm_storeu_ps(r, reduce4(tot[i], i + 1 < MR ? tot[i + 1] : z, i + 2 < MR ? tot[i + 2] : z,
                                 i + 3 < MR ? tot[i + 3] : z));
        for (int q = 0; q < 4 && i + q < MR; q++) y[i + q] = r[q];
    }
}

static __attribute__((target(TGTV))) void idot4_i4(const IDot4* a, float* y) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x88);
    __m256 tot[4];
    for (int q = 0; q < 4; q++) tot[q] = _mm256_setzero_ps();
    int64_t c = 0;
    for (int64_t s = 0; s < a->nseg; s++) {
        __m256i ae[4], ao[4];
        __m256i b0 = _mm256_loadu_si256((const __m256i*)(a->bias + s * 8));
        for (int q = 0; q < 4; q++) { ae[q] = b0; ao[q] = _mm256_setzero_si256(); }
        for (int64_t c1 = a->seg_end[s]; c < c1; c++) {
            if (a->pf && !(c & 1))
                for (int q = 0; q < 4; q++) _mm_prefetch((const char*)a->w[q] + a->pf + c * 32, _MM_HINT_T0);
            __m256i xe = _mm256_loadu_si256((const __m256i*)(a->x + c * 64));
            __m256i xo = _mm256_loadu_si256((const __m256i*)(a->x + c * 64 + 32));
            for (int q = 0; q < 4; q++) {
                const uint8_t* w = (const uint8_t*)a->w[q] + c * 32;
                __m256i b = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)w), flip);
                ae[q] = _mm256_dpbusd_epi32(ae[q], _mm256_and_si256(b, m4), xe);
                ao[q] = _mm256_dpbusd_epi32(ao[q], _mm256_and_si256(_mm256_srli_epi16(b, 4), m4), xo);
            }
        }
        for (int q = 0; q < 4; q++)
            tot[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ae[q], ao[q])),
                                     _mm256_set1_ps(a->scale[q][s]), tot[q]);
    }
    for (int q = 0; q < 4; q++) y[q] = hsum256(tot[q]);
}

static __attribute__((target(TGTV))) void idot4_i8(const IDot4* a, float* y) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 tot[4];
    for (int q = 0; q < 4; q++) tot[q] = _mm512_setzero_ps();
    int64_t c = 0;
    for (int64_t s = 0; s < a->nseg; s++) {
        __m512i acc[4];
        __m512i b0 = _mm512_loadu_si512((const void*)(a->bias + s * 16));
        for (int q = 0; q < 4; q++) acc[q] = b0;
        for (int64_t c1 = a->seg_end[s]; c < c1; c++) {
            if (a->pf)
                for (int q = 0; q < 4; q++) _mm_prefetch((const char*)a->w[q] + a->pf + c * 64, _MM_HINT_T0);
            __m512i xv = _mm512_loadu_si512((const void*)(a->x + c * 64));
            for (int q = 0; q < 4; q++) {
                __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void*)((const int8_t*)a->w[q] + c * 64)), flip);
                acc[q] = _mm512_dpbusd_epi32(acc[q], u, xv);
            }
        }
        for (int q = 0; q < 4; q++)
            tot[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[q]), _mm512_set1_ps(a->scale[q][s]), tot[q]);
    }
    _mm_storeu_ps(y, reduce4(tot[0], tot[1], tot[2], tot[3]));
}

#define DEF_IDOT(NAME)                                                                              \
    static __attribute__((target(TGTV))) void NAME(const IDot* a, float* y) {                       \
        switch (a->mr) {                                                                            \
        case 1: NAME##_mr(a, y, 1); break;                                                          \
        case 2: NAME##_mr(a, y, 2); break;                                                          \
        case 3: NAME##_mr(a, y, 3); break;                                                          \
        case 4: NAME##_mr(a, y, 4); break;                                                          \
        case 5: NAME##_mr(a, y, 5); break;                                                          \
        case 6: NAME##_mr(a, y, 6); break;                                                          \
        case 7: NAME##_mr(a, y, 7); break;                                                          \
        default: NAME##_mr(a, y, 8); break;                                                         \
        }                                                                                           \
    }
DEF_IDOT(idot_i4)
DEF_IDOT(idot_i8)

static K512 void axpy_bf16_512(float a, const uint16_t* x, float* y, int64_t n) {
    __m512 av = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, dec_bf16(x, i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + i)), 16));
        _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, xv, _mm512_maskz_loadu_ps(m, y + i)));
    }
}

/* y += sum_r a[r] * x_r for four bf16 rows x_r (stride ld): y is read and written once per four rows */
static K512 void axpy4_bf16_512(const float* a, const uint16_t* x, int64_t ld, float* y, int64_t n) {
    __m512 a0 = _mm512_set1_ps(a[0]), a1 = _mm512_set1_ps(a[1]), a2 = _mm512_set1_ps(a[2]), a3 = _mm512_set1_ps(a[3]);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(y + i);
        v = _mm512_fmadd_ps(a0, dec_bf16(x, i), v);
        v = _mm512_fmadd_ps(a1, dec_bf16(x + ld, i), v);
        v = _mm512_fmadd_ps(a2, dec_bf16(x + 2 * ld, i), v);
        v = _mm512_fmadd_ps(a3, dec_bf16(x + 3 * ld, i), v);
        _mm512_storeu_ps(y + i, v);
    }
    for (; i < n; i++)
        for (int r = 0; r < 4; r++) y[i] += a[r] * bf16_to_f32(x[r * ld + i]);
}

/* axpy4_bf16_512 for nt rows y_t with their own coefficients, the four bf16 rows decoded once per
 * 16 columns for all of them; each y_t gets axpy4_bf16_512's operations in its order */
static K512 void axpy4x_bf16_512(const float* a, int64_t lda, int nt, const uint16_t* x, int64_t ld, float* y,
                                 int64_t ldy, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 w0 = dec_bf16(x, i), w1 = dec_bf16(x + ld, i), w2 = dec_bf16(x + 2 * ld, i), w3 = dec_bf16(x + 3 * ld, i);
        for (int t = 0; t < nt; t++) {
            const float* at = a + t * lda;
            float* yt = y + t * ldy;
            __m512 v = _mm512_loadu_ps(yt + i);
            v = _mm512_fmadd_ps(_mm512_set1_ps(at[0]), w0, v);
            v = _mm512_fmadd_ps(_mm512_set1_ps(at[1]), w1, v);
            v = _mm512_fmadd_ps(_mm512_set1_ps(at[2]), w2, v);
            v = _mm512_fmadd_ps(_mm512_set1_ps(at[3]), w3, v);
            _mm512_storeu_ps(yt + i, v);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int64_t e = i; e < n; e++)
            for (int r = 0; r < 4; r++) y[t * ldy + e] += a[t * lda + r] * bf16_to_f32(x[r * ld + e]);
}

static K512 void axpy_512(float a, const float* x, float* y, int64_t n) {
    __m512 av = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
}

int kernels_avx512(Kernels* k) {
    k->axpy = axpy_512;
    k->axpy_bf16 = axpy_bf16_512;
    k->axpy4_bf16 = axpy4_bf16_512;
    k->axpy4x_bf16 = axpy4x_bf16_512;
    k->gemm_dot = gemm_dot_512;
    k->dot_rows = dot_rows_512;
    k->wsum_rows = wsum_rows_512;
    k->wsum_rows4 = wsum_rows4_512;
    k->softmax = softmax_512;
    k->rowdot[DT_F32] = rowdot_f32;
    k->rowdot[DT_BF16] = rowdot_bf16;
    k->rowdot[DT_F16] = rowdot_f16;
    k->rowdot[DT_I8] = rowdot_i8;
    k->rowdot[DT_I4] = rowdot_i4;
    k->rowdot[DT_U4] = rowdot_u4;
    k->rowdot[DT_E2M1] = rowdot_e2m1;
    k->rowdot[DT_E4M3] = rowdot_e4m3;
    k->rowdot4[DT_F32] = rowdot4_f32;
    k->rowdot4[DT_BF16] = rowdot4_bf16;
    k->rowdot4[DT_F16] = rowdot4_f16;
    k->rowdot4[DT_I8] = rowdot4_i8;
    k->rowdot4[DT_I4] = rowdot4_i4;
    k->rowdot4[DT_U4] = rowdot4_u4;
    k->rowdot4[DT_E2M1] = rowdot4_e2m1;
    k->rowdot4[DT_E4M3] = rowdot4_e4m3;
    k->rowdot4_nib[DT_I4] = rowdot4_nib_i4;
    k->rowdot4_nib[DT_U4] = rowdot4_nib_u4;
    k->rowdot4_nib[DT_E2M1] = rowdot4_nib_e2m1;
    k->rowdot4x[DT_F32] = rowdot4x_f32;
    k->rowdot4x[DT_BF16] = rowdot4x_bf16;
    k->rowdot4x[DT_F16] = rowdot4x_f16;
    k->rowdot4x[DT_I8] = rowdot4x_i8;
    k->rowdot4x[DT_I4] = rowdot4x_i4;
    k->rowdot4x[DT_U4] = rowdot4x_u4;
    k->rowdot4x[DT_E2M1] = rowdot4x_e2m1;
    k->rowdot4x[DT_E4M3] = rowdot4x_e4m3;
    k->rowdot4x_nib[DT_I4] = rowdot4x_nib_i4;
    k->rowdot4x_nib[DT_U4] = rowdot4x_nib_u4;
    k->rowdot4x_nib[DT_E2M1] = rowdot4x_nib_e2m1;
    if (__builtin_cpu_supports("avx512bf16") && isa_allows("avx512vnni")) {
        k->rowdot4_bf16dp = rowdot4_bf16dp;
        k->rowdot4x_bf16dp = rowdot4x_bf16dp;
        k->split_bf16x3 = split_bf16x3_512;
    }
    k->dot_i8 = dot_i8_512;
    k->dot_i8_seg = dot_i8_seg_512;
    if (__builtin_cpu_supports("avx512vnni") && isa_allows("avx512vnni")) {
        k->dot_i8 = dot_i8_vnni;
        k->dot_i8_seg = dot_i8_seg_vnni;
        k->idot[DT_I4] = idot_i4;
        k->idot[DT_I8] = idot_i8;
        k->idot4[DT_I4] = idot4_i4;
        k->idot4[DT_I8] = idot4_i8;
    }
    k->unpack_i4 = unpack_i4_512;
    k->name = k->idot[DT_I8] ? "avx512+vnni" : "avx512";
    return 1;
}

#else
/* not x86 or not GCC/clang: no vector kernels; kernels.c keeps the scalar ones */
int kernels_avx512(Kernels* k) {
    (void)k;
    return 0;
}
#endif
