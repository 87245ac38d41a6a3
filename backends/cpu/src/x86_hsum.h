/* The horizontal sum of a __m256, shared by the x86 kernel files (kernels_avx2.c, kernels_avx512.c).
 * Include it after <immintrin.h>, inside their x86 guard. Its target is plain AVX, so functions built
 * for avx2 or avx512 inline it. */
#ifndef DI_CPU_X86_HSUM_H
#define DI_CPU_X86_HSUM_H

static inline __attribute__((always_inline, target("avx"))) float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
