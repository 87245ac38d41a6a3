/* dtype table and scalar conversions. Every rounding here is round-to-nearest-even unless the
 * format's reference (ml_dtypes) says otherwise, because quantize/dequantize must match the NumPy
 * reference bit for bit. */
#include <math.h>
#include <string.h>

#include "deepinfer_abi_check.h"
#include "di_cpu.h"

/* the ABI's dtype table (deepinfer_abi_check.h): this library's dtype ids are DI_DTypeId */
int dt_id(DI_DataType t) { return di_dtype_id(t); }
const char* dt_name(int dt) { return di_dtype_name(dt); }
int dt_bits(int dt) { return di_dtype_bits(dt); }

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float v = (float)m * 0x1p-24f;  /* subnormal (or zero): exact */
        return s ? -v : v;
    }
    if (e == 31) return u2f(s | 0x7f800000u | (m << 13));
    return u2f(s | ((e + 112) << 23) | (m << 13));
}

uint16_t f32_to_f16(float f) {
    uint32_t u = f2u(f), s = (u >> 16) & 0x8000;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00);
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00);  /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {  /* below 2^-14: subnormal half, RNE of a * 2^24 */
        float v = u2f(a) * 0x1p24f;
        return (uint16_t)(s | (uint32_t)rintf(v));
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(s | ((r - (112u << 23)) >> 13));
}

uint8_t f32_to_e4m3(float f) {
    uint8_t s = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (isnan(f)) return (uint8_t)(s | 0x7f);
    if (a >= 448.0f) return (uint8_t)(s | 0x7e);
    if (a < 0x1p-6f) return (uint8_t)(s | (uint8_t)rintf(a * 512.0f));  /* subnormals: m * 2^-9 */
    int e;
    float m = frexpf(a, &e);       /* a = m * 2^e, m in [0.5, 1) */
    e -= 1;                        /* a = (2m) * 2^e, 2m in [1, 2) */
    int q = (int)rintf((2.0f * m - 1.0f) * 8.0f);
    if (q == 8) { q = 0; e++; }
    int code = ((e + 7) << 3) | q;
    if (code > 0x7e) code = 0x7e;
    return (uint8_t)(s | code);
}

uint8_t f32_to_e2m1(float f) {
    static const float v[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    uint8_t s = signbit(f) ? 8 : 0;
    float a = fabsf(f);
    if (isnan(f)) return 0;
    int i = 0;
    while (i < 7) {
        float mid = 0.5f * (v[i] + v[i + 1]);
        if (a < mid) break;
        if (a == mid) { if (i & 1) i++; break; }  /* tie: the even code */
        i++;
    }
    return (uint8_t)(s | i);
}

uint8_t f32_to_e8m0(float f) {
    uint32_t u = f2u(f);
    if (!(f > 0.0f) || isinf(f) || isnan(f)) return 0xff;
    uint32_t e = (u >> 23) & 0xff, m = u & 0x7fffffu;
    if (e == 0) return f >= 1.5f * 0x1p-127f ? 1 : 0;   /* f32 subnormals: 2^-127 or 2^-126 */
    uint32_t code = e + (m >= 0x400000u ? 1u : 0u);       /* ml_dtypes: ties round up */
    return code >= 255 ? 0xff : (uint8_t)code;
}

float di_lut_e4m3[256], di_lut_e5m2[256], di_lut_e8m0[256], di_lut_e2m1[16];

void di_init_luts(void) {
    for (int c = 0; c < 256; c++) {
        int s = c & 0x80, e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if ((c & 0x7f) == 0x7f) v = NAN;
        di_lut_e4m3[c] = s ? -v : v;
        e = (c >> 2) & 31; m = c & 3;
        v = e == 0 ? ldexpf((float)m, -16) : e == 31 ? (m ? NAN : INFINITY) : ldexpf(1.0f + m / 4.0f, e - 15);
        di_lut_e5m2[c] = s ? -v : v;
        di_lut_e8m0[c] = c == 255 ? NAN : ldexpf(1.0f, c - 127);
    }
    static const float v[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int c = 0; c < 16; c++) di_lut_e2m1[c] = (c & 8) ? -v[c & 7] : v[c & 7];
}

static inline int nib(const uint8_t* p, int64_t e) { return (p[e >> 1] >> ((e & 1) * 4)) & 15; }

float ld_elem(const void* base, int dt, int64_t e) {
    const uint8_t* p = (const uint8_t*)base;
    switch (dt) {
    case DT_F32: return ((const float*)base)[e];
    case DT_F16: return f16_to_f32(((const uint16_t*)base)[e]);
    case DT_BF16: return bf16_to_f32(((const uint16_t*)base)[e]);
    case DT_E4M3: return di_lut_e4m3[p[e]];
    case DT_E5M2: return di_lut_e5m2[p[e]];
    case DT_E8M0: return di_lut_e8m0[p[e]];
    case DT_E2M1: return di_lut_e2m1[nib(p, e)];
    case DT_I4: { int v = nib(p, e); return (float)(v >= 8 ? v - 16 : v); }
    case DT_U4: return (float)nib(p, e);
    case DT_I8: return (float)((const int8_t*)base)[e];
    case DT_U8: return (float)p[e];
    case DT_I32: return (float)((const int32_t*)base)[e];
    case DT_I64: return (float)((const int64_t*)base)[e];
    case DT_U64: return (float)((const uint64_t*)base)[e];
    default: return 0.0f;
    }
}

void load_row(int dt, const void* row, int64_t c0, int64_t n, float* out) {
    switch (dt) {
    case DT_F32: memcpy(out, (const float*)row + c0, (size_t)n * 4); return;
    case DT_BF16: {
        const uint16_t* p = (const uint16_t*)row + c0;
        for (int64_t i = 0; i < n; i++) out[i] = u2f((uint32_t)p[i] << 16);
        return;
    }
    case DT_F16: {
        const uint16_t* p = (const uint16_t*)row + c0;
        for (int64_t i = 0; i < n; i++) out[i] = f16_to_f32(p[i]);
        return;
    }
    case DT_I8: {
        const int8_t* p = (const int8_t*)row + c0;
        for (int64_t i = 0; i < n; i++) out[i] = (float)p[i];
        return;
    }
    case DT_E4M3: {
        const uint8_t* p = (const uint8_t*)row + c0;
        for (int64_t i = 0; i < n; i++) out[i] = di_lut_e4m3[p[i]];
        return;
    }
    case DT_E8M0: {  /* fp4 scales: one per 16 or 32 weights, so this runs once per row in GEMV */
        const uint8_t* p = (const uint8_t*)row + c0;
        for (int64_t i = 0; i < n; i++) out[i] = di_lut_e8m0[p[i]];
        return;
    }
    case DT_I4: case DT_U4: case DT_E2M1: {
        /* whole bytes at a time; an odd start or end takes one nibble alone */
        int64_t i = 0;
        if (c0 & 1 && n > 0) { out[0] = ld_elem(row, dt, c0); i = 1; }
        const uint8_t* b = (const uint8_t*)row + (c0 + i) / 2;
        int64_t pairs = (n - i) / 2;
        float* o = out + i;
        if (dt == DT_I4)
            for (int64_t k = 0; k < pairs; k++) {
                o[2 * k] = (float)((int8_t)(uint8_t)(b[k] << 4) >> 4);
                o[2 * k + 1] = (float)((int8_t)b[k] >> 4);
            }
        else if (dt == DT_U4)
            for (int64_t k = 0; k < pairs; k++) { o[2 * k] = (float)(b[k] & 15); o[2 * k + 1] = (float)(b[k] >> 4); }
        else
            for (int64_t k = 0; k < pairs; k++) {
                o[2 * k] = di_lut_e2m1[b[k] & 15];
                o[2 * k + 1] = di_lut_e2m1[b[k] >> 4];
            }
        i += 2 * pairs;
        if (i < n) out[i] = ld_elem(row, dt, c0 + i);
        return;
    }
    default:
        for (int64_t i = 0; i < n; i++) out[i] = ld_elem(row, dt, c0 + i);
    }
}

void store_row(int dt, void* row, const float* in, int64_t n) {
    switch (dt) {
    case DT_F32: if ((const void*)in != row) memmove(row, in, (size_t)n * 4); return;
    case DT_BF16: {
        uint16_t* p = (uint16_t*)row;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_bf16(in[i]);
        return;
    }
    case DT_F16: {
        uint16_t* p = (uint16_t*)row;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_f16(in[i]);
        return;
    }
    default: return;  /* callers validate the output dtype first */
    }
}
