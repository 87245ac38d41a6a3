/* Run-time kernel selection and the portable scalar kernels. The SIMD files fill the same table
 * when the CPU has the features (checked once with __builtin_cpu_supports); the scalar kernels are
 * the reference every SIMD kernel must agree with and the path on non-x86 machines. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "di_cpu.h"

static void gemm_dot_scalar(const float* A, int64_t lda, int M, const float* B, int64_t ldb, int N, int64_t K,
                            float* C, int64_t ldc) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            const float *a = A + i * lda, *b = B + j * ldb;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int64_t k = 0;
            for (; k + 4 <= K; k += 4) {
                s0 += a[k] * b[k];
                s1 += a[k + 1] * b[k + 1];
                s2 += a[k + 2] * b[k + 2];
                s3 += a[k + 3] * b[k + 3];
            }
            for (; k < K; k++) s0 += a[k] * b[k];
            C[i * ldc + j] = (s0 + s1) + (s2 + s3);
        }
}

static int32_t dot_i8_scalar(const int8_t* a, const int8_t* b, int64_t n) {
    int32_t s = 0;
    for (int64_t i = 0; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

static float dot_i8_seg_scalar(const int8_t* a, const int8_t* b, const int64_t* seg, int64_t nseg,
                                const float* scale) {
    float acc = 0.0f;
    for (int64_t s = 0; s < nseg; s++)
        acc += (float)dot_i8_scalar(a + seg[s], b + seg[s], seg[s + 1] - seg[s]) * scale[s];
    return acc;
}

static void unpack_i4_scalar(const uint8_t* src, int64_t n, int8_t* dst, int sign) {
    for (int64_t i = 0; i < n / 2; i++) {
        int lo = src[i] & 15, hi = src[i] >> 4;
        if (sign) { lo = lo >= 8 ? lo - 16 : lo; hi = hi >= 8 ? hi - 16 : hi; }
        dst[2 * i] = (int8_t)lo;
        dst[2 * i + 1] = (int8_t)hi;
    }
}

static void axpy_scalar(float a, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void axpy_bf16_scalar(float a, const uint16_t* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * bf16_to_f32(x[i]);
}

static void dot_rows_scalar(const float* q, const float* rows, int64_t ld, int n, int64_t D, float* out) {
    for (int r = 0; r < n; r++) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; d++) acc += q[d] * rows[r * ld + d];
        out[r] = acc;
    }
}

static void wsum_rows_scalar(const float* w, const float* rows, int64_t ld, int n, int64_t D, float* acc) {
    for (int r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) acc[d] += w[r] * rows[r * ld + d];
}

static void softmax_scalar(float* s, int64_t n, float scale) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) { s[i] *= scale; mx = fmaxf(mx, s[i]); }
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) { s[i] = expf(s[i] - mx); sum += s[i]; }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) s[i] *= inv;
}

void kernels_scalar(Kernels* k) {
    memset(k, 0, sizeof *k);
    k->gemm_dot = gemm_dot_scalar;
    k->dot_i8 = dot_i8_scalar;
    k->dot_i8_seg = dot_i8_seg_scalar;
    k->unpack_i4 = unpack_i4_scalar;
    k->axpy = axpy_scalar;
    k->axpy_bf16 = axpy_bf16_scalar;
    k->dot_rows = dot_rows_scalar;
    k->wsum_rows = wsum_rows_scalar;
    k->softmax = softmax_scalar;
    k->name = "scalar";
}

static const char* const k_levels[] = {"scalar", "avx2", "avx512", "avx512vnni", "amx"};
#define N_LEVELS 5

static int level_of(const char* name) {
    for (int i = 0; i < N_LEVELS; i++)
        if (!strcmp(name, k_levels[i])) return i;
    return -1;
}

int isa_allows(const char* level) {
    const char* cap = getenv("DEEPINFER_CPU_ISA");
    if (!cap || !*cap) return 1;
    int c = level_of(cap), l = level_of(level);
    if (c < 0) return 1;   /* an unknown cap caps nothing (the loader's probe reports it) */
    return l <= c;
}

static Kernels g_kernels;
static char g_features[256];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void select_kernels(void) {
    di_init_luts();
    kernels_scalar(&g_kernels);
    g_features[0] = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    static const char* names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                  "avx512vnni", "avxvnni", "avx512bf16"};
    int have[11] = {__builtin_cpu_supports("sse4.2"), __builtin_cpu_supports("avx"), __builtin_cpu_supports("avx2"),
                    __builtin_cpu_supports("fma"), 0, __builtin_cpu_supports("avx512f"),
                    __builtin_cpu_supports("avx512bw"), __builtin_cpu_supports("avx512vl"),
                    __builtin_cpu_supports("avx512vnni"), 0, 0};
#if __GNUC__ >= 11
    have[9] = __builtin_cpu_supports("avxvnni");
    have[10] = __builtin_cpu_supports("avx512bf16");
#endif
    have[4] = have[1];  /* f16c ships with every AVX CPU that also has AVX2/FMA */
    for (int i = 0; i < 11; i++)
        if (have[i]) {
            size_t l = strlen(g_features);
            snprintf(g_features + l, sizeof g_features - l, "%s%s", l ? " " : "", names[i]);
        }
    int allow512 = isa_allows("avx512");
    int allow2 = isa_allows("avx2");
    if (allow2 && have[2] && have[3]) kernels_avx2(&g_kernels);
    if (allow512 && have[5] && have[6] && have[7] && have[2] && have[3]) kernels_avx512(&g_kernels);
    if (g_kernels.idot[DT_I8] && isa_allows("amx") && amx_init()) {
        g_kernels.amx = 1;
        g_kernels.name = "avx512+vnni+amx";
    }
#if __GNUC__ >= 11
    if (__builtin_cpu_supports("amx-int8")) {
        size_t l = strlen(g_features);
        snprintf(g_features + l, sizeof g_features - l, "%s", l ? " amx-int8" : "amx-int8");
    }
#endif
#else
    snprintf(g_features, sizeof g_features, "portable");
#endif
}

const Kernels* kernels(void) {
    pthread_once(&g_once, select_kernels);
    return &g_kernels;
}

const char* cpu_features(void) {
    kernels();
    return g_features;
}
