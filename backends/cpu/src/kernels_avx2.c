/* AVX2 + FMA kernels (x86-64 from Haswell / Zen 1 on). Same contracts as the AVX-512 file, with
 * 8-wide vectors; tails use vmaskmov for f32 and scalar code for packed weights. */
#include "di_cpu.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <string.h>

#include "x86_hsum.h"

#define TGT "avx2,fma,f16c"
#define K2 __attribute__((target(TGT)))
#define K2I static inline __attribute__((always_inline, target(TGT)))

K2I int32_t hsum_i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
K2I __m256i tail_mask(int64_t rem) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* ------------------------------------------------------------------ decoders: 8 weights at element k */
K2I __m256 dec_f32(const void* w, int64_t k) { return _mm256_loadu_ps((const float*)w + k); }
K2I __m256 dec_bf16(const void* w, int64_t k) {
    __m128i v = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
K2I __m256 dec_f16(const void* w, int64_t k) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + k)));
}
K2I __m256 dec_i8(const void* w, int64_t k) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)w + k))));
}
/* 8 nibbles (4 bytes at element k, k even) in element order in the low 8 bytes */
K2I __m128i nib8(const void* w, int64_t k) {
    int32_t raw;
    memcpy(&raw, (const uint8_t*)w + k / 2, 4);
    __m128i b = _mm_cvtsi32_si128(raw), m = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
}
K2I __m256 dec_i4(const void* w, int64_t k) {
    __m128i e = _mm_set1_epi8(8);
    __m128i v = _mm_sub_epi8(_mm_xor_si128(nib8(w, k), e), e);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
K2I __m256 dec_u4(const void* w, int64_t k) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib8(w, k))); }
K2I __m256 dec_e2m1(const void* w, int64_t k) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i v = _mm_shuffle_epi8(lut, nib8(w, k));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_set1_ps(0.5f));
}
K2I __m256 dec_e4m3(const void* w, int64_t k) {
    /* exact bit-field decode, see kernels_avx512.c */
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)w + k)));
    __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

#define DEF_ROWDOT(NAME, DEC, DT, BITS)                                                                      \
    K2I void NAME##_mr(const RowDot* a, float* y, const int MR) {                                    \
        const float *x0 = a->x[0], *x1 = a->x[MR > 1 ? 1 : 0], *x2 = a->x[MR > 2 ? 2 : 0],            \
                    *x3 = a->x[MR > 3 ? 3 : 0];                                                       \
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;                                   \
        float r0 = 0, r1 = 0, r2 = 0, r3 = 0;                                                         \
        int64_t bi = 0;                                                                               \
        for (int64_t b0 = 0; b0 < a->K; b0 += a->bc, bi++) {                                          \
            int64_t b1 = b0 + a->bc < a->K ? b0 + a->bc : a->K, k = b0;                               \
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                               \
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                     \
            /* two accumulator sets: one FMA chain per row would wait on FMA latency */       \
            __m256 d0 = c0, d1 = c0, d2 = c0, d3 = c0;                                            \
            for (; k + 16 <= b1; k += 16) {                                                   \
                _mm_prefetch((const char*)a->w + ((k * BITS) >> 3) + 4096, _MM_HINT_T0);      \
                __m256 wv = DEC(a->w, k), wu = DEC(a->w, k + 8);                                 \
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wv, c0);                                                  \
                d0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), wu, d0);                                             \
                if (MR > 1) { c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), wv, c1); d1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), wu, d1); } \
                if (MR > 2) { c2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k), wv, c2); d2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k + 8), wu, d2); } \
                if (MR > 3) { c3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k), wv, c3); d3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k + 8), wu, d3); } \
            }                                                                                 \
            c0 = _mm256_add_ps(c0, d0); c1 = _mm256_add_ps(c1, d1); c2 = _mm256_add_ps(c2, d2); c3 = _mm256_add_ps(c3, d3);               \
            for (; k + 8 <= b1; k += 8) {                                                             \
                /* without huge pages the hardware prefetcher stops at every 4 KiB page; a     \
                 * software prefetch 4 KiB ahead keeps DRAM streaming (2x on GEMV) */         \
                _mm_prefetch((const char*)a->w + ((k * BITS) >> 3) + 4096, _MM_HINT_T0);      \
                __m256 wv = DEC(a->w, k);                                                             \
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wv, c0);                                \
                if (MR > 1) c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), wv, c1);                    \
                if (MR > 2) c2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + k), wv, c2);                    \
                if (MR > 3) c3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + k), wv, c3);                    \
            }                                                                                         \
            for (; k < b1; k++) {                                                                     \
                float wv = ld_elem(a->w, DT, k);                                                      \
                s0 += x0[k] * wv;                                                                     \
                if (MR > 1) s1 += x1[k] * wv;                                                         \
                if (MR > 2) s2 += x2[k] * wv;                                                         \
                if (MR > 3) s3 += x3[k] * wv;                                                         \
            }                                                                                         \
            float s = a->s ? a->s[bi] : 1.0f;                                                         \
            __m256 sv = _mm256_set1_ps(s);                                                            \
            t0 = _mm256_fmadd_ps(c0, sv, t0); r0 += s0 * s;                                           \
            if (MR > 1) { t1 = _mm256_fmadd_ps(c1, sv, t1); r1 += s1 * s; }                           \
            if (MR > 2) { t2 = _mm256_fmadd_ps(c2, sv, t2); r2 += s2 * s; }                           \
            if (MR > 3) { t3 = _mm256_fmadd_ps(c3, sv, t3); r3 += s3 * s; }                           \
        }                                                                                             \
        y[0] = hsum256(t0) + r0;                                                                      \
        if (MR > 1) y[1] = hsum256(t1) + r1;                                                          \
        if (MR > 2) y[2] = hsum256(t2) + r2;                                                          \
        if (MR > 3) y[3] = hsum256(t3) + r3;                                                          \
    }                                                                                                 \
    static K2 void NAME(const RowDot* a, float* y) {                                                  \
        switch (a->mr) {                                                                              \
        case 1: NAME##_mr(a, y, 1); break;                                                            \
        case 2: NAME##_mr(a, y, 2); break;                                                            \
        case 3: NAME##_mr(a, y, 3); break;                                                            \
        default: NAME##_mr(a, y, 4); break;                                                           \
        }                                                                                             \
    }

DEF_ROWDOT(rowdot_f32, dec_f32, DT_F32, 32)
DEF_ROWDOT(rowdot_bf16, dec_bf16, DT_BF16, 16)
DEF_ROWDOT(rowdot_f16, dec_f16, DT_F16, 16)
DEF_ROWDOT(rowdot_i8, dec_i8, DT_I8, 8)
DEF_ROWDOT(rowdot_i4, dec_i4, DT_I4, 4)
DEF_ROWDOT(rowdot_u4, dec_u4, DT_U4, 4)
DEF_ROWDOT(rowdot_e2m1, dec_e2m1, DT_E2M1, 4)
DEF_ROWDOT(rowdot_e4m3, dec_e4m3, DT_E4M3, 8)

/* ------------------------------------------------------------------ f32 dot-product GEMM (4 x 2 blocks) */
K2I void dot_block(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                   const int MR, const int NR) {
    __m256 acc[4][2];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 b[2];
        for (int j = 0; j < NR; j++) b[j] = _mm256_loadu_ps(B + j * ldb + k);
        for (int i = 0; i < MR; i++) {
            __m256 av = _mm256_loadu_ps(A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(av, b[j], acc[i][j]);
        }
    }
    if (k < K) {
        __m256i m = tail_mask(K - k);
        __m256 b[2];
        for (int j = 0; j < NR; j++) b[j] = _mm256_maskload_ps(B + j * ldb + k, m);
        for (int i = 0; i < MR; i++) {
            __m256 av = _mm256_maskload_ps(A + i * lda + k, m);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(av, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) C[i * ldc + j] = hsum256(acc[i][j]);
}

static K2 void gemm_dot_avx2(const float* A, int64_t lda, int M, const float* B, int64_t ldb, int N, int64_t K,
                             float* C, int64_t ldc) {
    int i = 0;
    for (; i + 4 <= M; i += 4) {
        int j = 0;
        for (; j + 2 <= N; j += 2) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 4, 2);
        for (; j < N; j++) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 4, 1);
    }
    for (; i < M; i++) {
        int j = 0;
        for (; j + 2 <= N; j += 2) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 1, 2);
        for (; j < N; j++) dot_block(A + i * lda, lda, B + j * ldb, ldb, K, C + i * ldc + j, ldc, 1, 1);
    }
}

/* ------------------------------------------------------------------ int8 dot and int4 unpack */
static K2 int32_t dot_i8_avx2(const int8_t* a, const int8_t* b, int64_t n) {
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a + i)));
        __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(x, y));
    }
    int32_t s = hsum_i(acc);
    for (; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define DI_HAVE_AVXVNNI 1
/* AVX-VNNI (Alder Lake and later client cores): vpdpwssd on 256-bit registers */
static __attribute__((target(TGT ",avxvnni"))) int32_t dot_i8_avxvnni(const int8_t* a, const int8_t* b, int64_t n) {
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a + i)));
        __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + i)));
        acc = _mm256_dpwssd_avx_epi32(acc, x, y);
    }
    int32_t s = hsum_i(acc);
    for (; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}
#endif

static K2 float dot_i8_seg_avx2(const int8_t* a, const int8_t* b, const int64_t* seg, int64_t nseg,
                                const float* scale) {
    __m256 tot = _mm256_setzero_ps();
    float tail = 0.0f;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t k = seg[s], k1 = seg[s + 1];
        __m256i acc = _mm256_setzero_si256();
        for (; k + 16 <= k1; k += 16) {
            __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a + k)));
            __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + k)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(x, y));
        }
        int32_t t = 0;
        for (; k < k1; k++) t += (int32_t)a[k] * (int32_t)b[k];
        tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(scale[s]), tot);
        tail += (float)t * scale[s];
    }
    return hsum256(tot) + tail;
}

static K2 void unpack_i4_avx2(const uint8_t* src, int64_t n, int8_t* dst, int sign) {
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

static K2 void axpy_avx2(float a, const float* x, float* y, int64_t n) {
    __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

static K2 void axpy_bf16_avx2(float a, const uint16_t* x, float* y, int64_t n) {
    __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + i))), 16));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] += a * bf16_to_f32(x[i]);
}

int kernels_avx2(Kernels* k) {
    k->axpy = axpy_avx2;
    k->axpy_bf16 = axpy_bf16_avx2;
    k->gemm_dot = gemm_dot_avx2;
    k->rowdot[DT_F32] = rowdot_f32;
    k->rowdot[DT_BF16] = rowdot_bf16;
    k->rowdot[DT_F16] = rowdot_f16;
    k->rowdot[DT_I8] = rowdot_i8;
    k->rowdot[DT_I4] = rowdot_i4;
    k->rowdot[DT_U4] = rowdot_u4;
    k->rowdot[DT_E2M1] = rowdot_e2m1;
    k->rowdot[DT_E4M3] = rowdot_e4m3;
    k->dot_i8 = dot_i8_avx2;
    k->dot_i8_seg = dot_i8_seg_avx2;
    k->unpack_i4 = unpack_i4_avx2;
    k->name = "avx2";
#ifdef DI_HAVE_AVXVNNI
    if (__builtin_cpu_supports("avxvnni")) {
        k->dot_i8 = dot_i8_avxvnni;
        k->name = "avx2+avxvnni";
    }
#endif
    return 1;
}

#else
/* not x86 or not GCC/clang: no vector kernels; kernels.c keeps the scalar ones */
int kernels_avx2(Kernels* k) {
    (void)k;
    return 0;
}
#endif
