/* AMX tiles (Intel Sapphire Rapids and later): the integer W8A8 / W4A8 GEMM on TDPBSSD.
 *
 * Used by linear's integer path when x has at least AMX_MIN_M rows (prefill, large batches); decode
 * stays on the VNNI rows (a GEMV is memory-bound, and a tile wants 16 rows of x). One call computes
 * a strip of 32 output columns (two B tiles) for every row of x, 32 rows (two A tiles) at a time,
 * into four int32 C tiles:
 *  - B tiles want the weights "VNNI-packed": tile row r holds, for each of 16 columns n, the 4
 *    consecutive k of that column (B[r][4n + j] = W[n][64c + 4r + j]). The strip's weights are
 *    packed once (int4 unpacked to int8 on the way) and reused by every block of x rows.
 *  - Scales: a C tile holds exact int32 sums over one segment (a run of 64-element chunks inside
 *    one x block and one w block); at the end of each segment the tiles are stored and folded into
 *    f32 accumulators as C * sx[row] * sw[column], so int4 groups of 64 cost a fold per chunk.
 * Tile configuration is per thread: each strip loads it and releases the tiles when done.
 * Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), made once here. */
#include <string.h>

#include "di_cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) && __GNUC__ >= 11)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TGTA __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma")))

typedef struct {
    uint8_t  palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t  rows[16];
} TileConfig;

int amx_init(void) {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return 0;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return 0;
    /* the kernel refuses when the OS (or the VM) does not enable the tile state */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* tiles 0-3: C (16 x 16 int32), 4-5: A (16 rows x 64 bytes of x), 6-7: B (16 x 64 packed bytes) */
static TGTA void config_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* B tiles of the strip: pk[(c * 2 + t) * 1024 + r * 64 + 4n + j] = W[n0 + 16t + n][64c + 4r + j]
 * (zero for rows past N). Row r of a B tile is dword r of 16 weight rows: one gather. int4 rows are
 * first widened, 16 rows x 64 elements at a time, into int8 (nibbles sign-extended). */
static TGTA void pack_strip(const AmxIntJob* j, int64_t n0, int8_t* pk, int8_t* tmp) {
    const QMat* m = j->m;
    int64_t nch = j->K / 64;
    int four = dt_bits(m->dt) == 4;
    for (int t = 0; t < 2; t++) {
        int64_t nt = j->N - (n0 + 16 * t);
        if (nt <= 0) {
            for (int64_t c = 0; c < nch; c++) memset(pk + (c * 2 + t) * 1024, 0, 1024);
            continue;
        }
        if (nt > 16) nt = 16;
        __mmask16 live = (__mmask16)((1u << nt) - 1u);
        const char* base = m->base + (four ? (n0 + 16 * t) * m->rs / 2 : (n0 + 16 * t) * m->rs);
        int64_t rowb = four ? m->rs / 2 : m->rs;   /* bytes between weight rows */
        for (int64_t c = 0; c < nch; c++) {
            const char* src;
            __m512i idx;
            if (four) {
                const __m512i m4 = _mm512_set1_epi16(0x0f), e8 = _mm512_set1_epi8(8);
                for (int q = 0; q < nt; q++) {
                    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(base + q * rowb + c * 32)));
                    __m512i v = _mm512_or_si512(_mm512_and_si512(w, m4), _mm512_slli_epi16(_mm512_srli_epi16(w, 4), 8));
                    _mm512_storeu_si512((void*)(tmp + q * 64), _mm512_sub_epi8(_mm512_xor_si512(v, e8), e8));
                }
                src = (const char*)tmp;
                idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(64));
            } else {
                src = base + c * 64;
                idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)rowb));
            }
            int8_t* dst = pk + (c * 2 + t) * 1024;
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512((void*)(dst + r * 64),
                                    _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, src + 4 * r, 1));
        }
    }
}

size_t amx_scratch_bytes(int64_t K, int64_t nseg, int64_t ncb) {
    /* packed B, 4 C tiles of int32, f32 accumulators [32][32], weight scales [nseg][32], one scale
     * row, 16 widened int4 rows */
    return (size_t)(K / 64) * 2048 + 4 * 1024 + 32 * 32 * 4 + (size_t)(32 * nseg) * 4 + (size_t)(ncb + 16) * 4 +
           16 * 64 + 64;
}

TGTA void amx_int_strip(const AmxIntJob* j, int64_t n0, void* scratch) {
    int64_t nch = j->K / 64, ns = j->nseg;
    int8_t* pk = (int8_t*)scratch;
    int32_t* cbuf = (int32_t*)(pk + nch * 2048);
    float* F = (float*)(cbuf + 4 * 256);
    float* sw = F + 32 * 32;   /* [seg][32 columns] */
    float* srow = sw + 32 * ns;
    const QMat* m = j->m;
    pack_strip(j, n0, pk, (int8_t*)(srow + m->ncb + 16));
    int64_t cur_rb = -1;
    for (int q = 0; q < 32; q++) {
        int64_t n = n0 + q < j->N ? n0 + q : j->N - 1;
        int64_t rb = n / m->br;
        if (rb != cur_rb) {
            qmat_scale_row(m, rb, srow, NULL);
            cur_rb = rb;
        }
        for (int64_t s = 0; s < ns; s++) sw[s * 32 + q] = srow[j->seg_wb[s]];
    }
    config_tiles();
    for (int64_t m0 = 0; m0 < j->Mp; m0 += 32) {
        memset(F, 0, 32 * 32 * sizeof(float));
        const int8_t* x0 = j->x + m0 * j->K;
        const int8_t* x1 = x0 + 16 * j->K;
        int64_t c = 0;
        for (int64_t s = 0; s < ns; s++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (; c < j->seg_end[s]; c++) {
                _tile_loadd(4, x0 + c * 64, j->K);
                _tile_loadd(5, x1 + c * 64, j->K);
                _tile_loadd(6, pk + (c * 2) * 1024, 64);
                _tile_loadd(7, pk + (c * 2 + 1) * 1024, 64);
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(2, 5, 6);
                _tile_dpbssd(3, 5, 7);
            }
            _tile_stored(0, cbuf, 64);
            _tile_stored(1, cbuf + 256, 64);
            _tile_stored(2, cbuf + 512, 64);
            _tile_stored(3, cbuf + 768, 64);
            /* F[i][n] += C[i][n] * sx[i] * sw[n]: tile (a, b) covers rows 16a.., columns 16b.. */
            __m512 swv0 = _mm512_loadu_ps(sw + s * 32), swv1 = _mm512_loadu_ps(sw + s * 32 + 16);
            for (int i = 0; i < 32; i++) {
                int64_t r = m0 + i < j->M ? m0 + i : j->M - 1;
                __m512 sx = _mm512_set1_ps(j->sx[(r / j->xbr) * j->xncb + j->seg_xb[s]]);
                const int32_t* c0 = cbuf + (i / 16) * 512 + (i % 16) * 16;
                float* f = F + i * 32;
                _mm512_storeu_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)c0)),
                                                    _mm512_mul_ps(swv0, sx), _mm512_loadu_ps(f)));
                _mm512_storeu_ps(f + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(c0 + 256))),
                                                         _mm512_mul_ps(swv1, sx), _mm512_loadu_ps(f + 16)));
            }
        }
        int64_t nn = j->N - n0 < 32 ? j->N - n0 : 32;
        for (int i = 0; i < 32 && m0 + i < j->M; i++) memcpy(j->Y + (m0 + i) * j->ldy + n0, F + i * 32, (size_t)nn * 4);
    }
    _tile_release();
}

#else
int amx_init(void) { return 0; }
size_t amx_scratch_bytes(int64_t K, int64_t nseg, int64_t ncb) { (void)K; (void)nseg; (void)ncb; return 0; }
void amx_int_strip(const AmxIntJob* j, int64_t n0, void* scratch) { (void)j; (void)n0; (void)scratch; }
#endif
