/*
 * Internal header of the deepinfer CPU backend. Nothing here is part of the ABI: the library
 * exports deepinfer_plugin_info() only (see plugin.c for the layout of the folder).
 */
#ifndef DI_CPU_H
#define DI_CPU_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <time.h>

#include "deepinfer_abi.h"

#define DI_HIDDEN __attribute__((visibility("hidden")))
#define DI_CPU_VERSION "1.0.0"
#define DI_ERR_LEN 512

/* ------------------------------------------------------------------ dtypes */
/* Dense internal ids of the ABI dtypes, so tables can be indexed by them. */
enum {
    DT_INVALID = 0,
    DT_F32, DT_F16, DT_BF16, DT_E4M3, DT_E5M2, DT_E8M0, DT_E2M1,
    DT_I4, DT_U4, DT_I8, DT_U8, DT_I32, DT_I64, DT_U64,
    DT_COUNT
};
#define DTM(d) (1u << (d))
/* float activations of the ABI (DI_DTS_FLOAT); f16 is not one (embedding tables may be f16) */
#define DTM_FLOAT_ACT (DTM(DT_F32) | DTM(DT_BF16))
#define DTM_SCALES (DTM(DT_F32) | DTM(DT_BF16) | DTM(DT_F16) | DTM(DT_E8M0) | DTM(DT_E4M3))
#define DTM_ANY_NUM (((1u << DT_COUNT) - 1u) & ~1u)

DI_HIDDEN int dt_id(DI_DataType t);
DI_HIDDEN const char* dt_name(int dt);
DI_HIDDEN int dt_bits(int dt);

/* ------------------------------------------------------------------ scalar conversions */
DI_HIDDEN float f16_to_f32(uint16_t h);
DI_HIDDEN uint16_t f32_to_f16(float f);
DI_HIDDEN float bf16_to_f32(uint16_t h);
DI_HIDDEN uint16_t f32_to_bf16(float f);
DI_HIDDEN uint8_t f32_to_e4m3(float f);  /* RNE, saturating to +-448, NaN -> 0x7F */
DI_HIDDEN uint8_t f32_to_e2m1(float f);  /* RNE, saturating to +-6, 4-bit code */
DI_HIDDEN uint8_t f32_to_e8m0(float f);  /* ml_dtypes rounding (ties up), 0/neg/NaN -> 0xFF */
extern DI_HIDDEN float di_lut_e4m3[256];
extern DI_HIDDEN float di_lut_e5m2[256];
extern DI_HIDDEN float di_lut_e8m0[256];
extern DI_HIDDEN float di_lut_e2m1[16];
DI_HIDDEN void di_init_luts(void);

/* element e (in elements from base) of a row/buffer of dtype dt, as f32 (any dtype) */
DI_HIDDEN float ld_elem(const void* base, int dt, int64_t e);
/* elements [c0, c0+n) of a contiguous row as f32 */
DI_HIDDEN void load_row(int dt, const void* row, int64_t c0, int64_t n, float* out);
/* n f32 values rounded to dt (f32, bf16, f16) into a contiguous row */
DI_HIDDEN void store_row(int dt, void* row, const float* in, int64_t n);

/* ------------------------------------------------------------------ contexts and errors */
typedef struct DI_Pool DI_Pool;
struct DI_Context {
    uint32_t  magic;
    int       num_threads;
    DI_Pool*  pool;
    DI_Graph* capture;         /* non-NULL while graph_begin .. graph_end records capture_stream */
    DI_Stream capture_stream;
};

/* Records a message for ctx (or the global fallback when ctx is NULL) and returns status. */
DI_HIDDEN DI_Status di_fail(DI_Context* ctx, DI_Status status, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
DI_HIDDEN void di_clear(DI_Context* ctx);
DI_HIDDEN const char* di_last_error(void);   /* the calling thread's message */
/* one op call: the header and op-table checks, then the op body (query: validate only) */
DI_HIDDEN DI_Status di_run_op(DI_Context* ctx, int op, const void* args, int query);

/* ------------------------------------------------------------------ graphs (graph.c) */
DI_HIDDEN int graph_capturing(DI_Context* ctx, DI_Stream stream);
DI_HIDDEN DI_Status graph_capture_op(DI_Context* ctx, int op, const void* args, uint32_t lib_size);
DI_HIDDEN DI_Status graph_capture_copy(DI_Context* ctx, void* dst, const void* src, uint64_t bytes);
DI_HIDDEN DI_Status graph_begin(DI_Context* ctx, DI_Stream stream);
DI_HIDDEN DI_Status graph_end(DI_Context* ctx, DI_Stream stream, DI_Graph** out);
DI_HIDDEN DI_Status graph_launch(DI_Context* ctx, DI_Graph* g, DI_Stream stream);
DI_HIDDEN DI_Status graph_destroy(DI_Context* ctx, DI_Graph* g);
DI_HIDDEN void graph_abandon(DI_Context* ctx);   /* a capture never ended (context_destroy) */
DI_HIDDEN void graph_profile_report(void);       /* DEEPINFER_CPU_PROFILE: per-op replay times */

/* ------------------------------------------------------------------ thread pool */
typedef void (*di_task_fn)(void* arg, int64_t task, int worker);
DI_HIDDEN DI_Pool* pool_create(int nthreads);
DI_HIDDEN void pool_destroy(DI_Pool* p);
/* Runs fn(arg, i, worker) for i in [0, ntasks); the caller is worker 0. Blocks until done.
 * amount: about how many multiply-adds or elements the job touches; below DEEPINFER_CPU_PAR_MIN
 * (default 65536) the caller runs every task itself, because waking a worker costs more than the
 * job (a decode step of a small model is mostly such jobs). */
DI_HIDDEN void pool_run(DI_Pool* p, int64_t ntasks, di_task_fn fn, void* arg, int64_t amount);
DI_HIDDEN int pool_size(const DI_Pool* p);
/* hot = 1: idle workers spin between jobs instead of sleeping (a graph replay's many tiny ops);
 * hot = 0: back to sleeping after DEEPINFER_CPU_SPIN iterations */
DI_HIDDEN void pool_hot(DI_Pool* p, int hot);

/* ------------------------------------------------------------------ validation */
/* One op call being checked: query mode accepts NULL data pointers on required tensors. */
typedef struct {
    DI_Context* ctx;
    const char* op;
    int         query;
} VC;

DI_HIDDEN int tensor_present(const VC* v, const DI_Tensor* t);
/*
 * What this library implements of an argument the op table has already validated at dispatch
 * (run_op): ndim in [nlo, nhi], dtype in mask, and with quant_ok = 0 no quant descriptor (1: one
 * whose storage dtype the kernels decode).
 */
DI_HIDDEN DI_Status check_tensor(VC* v, const DI_Tensor* t, const char* name, int nlo, int nhi,
                                 uint32_t dtmask, int quant_ok);
DI_HIDDEN DI_Status check_same_shape(VC* v, const DI_Tensor* a, const char* an, const DI_Tensor* b,
                                     const char* bn);
DI_HIDDEN DI_Status check_dim(VC* v, const DI_Tensor* t, const char* name, int d, int64_t want);

/* address of element with flat element offset e (4-bit: e must be even) */
static inline char* t_base(const DI_Tensor* t) { return (char*)t->data + t->byte_offset; }
static inline char* t_at(const DI_Tensor* t, int dt, int64_t e) {
    int b = dt_bits(dt);
    return t_base(t) + (b == 4 ? e / 2 : e * (b / 8));
}
static inline char* t_row(const DI_Tensor* t, int dt, int64_t r) { return t_at(t, dt, r * t->strides[0]); }
static inline char* t_row2(const DI_Tensor* t, int dt, int64_t i, int64_t j) {
    return t_at(t, dt, i * t->strides[0] + j * t->strides[1]);
}

/* ------------------------------------------------------------------ quantized matrices */
/* A resolved view of the last two dims [R, C] of a (possibly quantized) matrix slice. */
typedef struct QMat_ {
    int         dt;          /* element storage dtype */
    int64_t     R, C;
    const char* base;        /* element (0, 0) */
    int64_t     rs;          /* row stride in elements */
    int         quant;       /* 0: plain values */
    int64_t     br, bc;      /* block sizes (>= 1, whole dims resolved) */
    int64_t     nrb, ncb;    /* number of row/col blocks */
    int         sdt, zdt;    /* scales / zeros dtype (zdt DT_INVALID when absent) */
    const char* sbase;       /* scales [nrb, ncb] of this slice */
    int64_t     srs, scs;    /* scale row stride / col stride in elements */
    const char* zbase;
    int64_t     zrs, zcs;
} QMat;

/* lead = flat index over the leading dims (row-major over shape[0..ndim-3]) */
DI_HIDDEN void qmat_init(QMat* m, const DI_Tensor* t, int64_t lead);
DI_HIDDEN int64_t lead_count(const DI_Tensor* t);
/* element offset of leading index `lead` (dims 0..ndim-3) */
DI_HIDDEN int64_t lead_offset(const DI_Tensor* t, int64_t lead);
DI_HIDDEN void store_elem(int dt, void* base, int64_t e, float v);
/* scales (and zeros, 0 when absent) of row block rb as f32, ncb values each */
DI_HIDDEN void qmat_scale_row(const QMat* m, int64_t rb, float* s, float* z);
/* row block rb's scales in place when they are contiguous f32 (no copy), else qmat_scale_row into buf */
static inline const float* qmat_scales(const QMat* m, int64_t rb, float* buf) {
    if (m->sdt == DT_F32 && (m->scs == 1 || m->ncb == 1)) return (const float*)m->sbase + rb * m->srs;
    qmat_scale_row(m, rb, buf, NULL);
    return buf;
}
/* bit-exact dequantized row r of m (C values): (q - z) * s in f32 */
DI_HIDDEN void qmat_dequant_row(const QMat* m, int64_t r, float* out);

/* ------------------------------------------------------------------ kernels (per ISA) */
/* y[i] = dot(x[i], w) over K for i < mr (mr <= 4); x rows contiguous f32, w a plain row. */
typedef struct {
    const float* x[4];
    int          mr;
    const void*  w;        /* row of the weight in its storage dtype */
    int64_t      K;
    int64_t      bc;       /* column block size (>= K: one block) */
    const float* s;        /* per-block scales (NULL: 1) */
} RowDot;
typedef void (*rowdot_fn)(const RowDot* a, float* y);
/* y[r] = dot(x, w[r]) for 4 weight rows against one x row (decode's M = 1): one x load feeds four
 * rows and the call, block and reduction overheads are paid once per four rows. Four short row
 * streams do not wake the hardware prefetcher in time (measured: int4 rows of 1 KiB ran at a third
 * of the memory bandwidth), so the kernels prefetch the next call's rows as they go (pf). */
typedef struct {
    const float* x;
    const void*  w[4];
    int64_t      K, bc;
    const float* s[4];     /* per-block scales of each row (NULL: 1) */
    const float* xp;       /* 4-bit weights (rowdot4_nib): x with each 32-chunk's even elements, then odd */
    int64_t      pf;       /* bytes from w[r] to the rows the next call reads (prefetched), 0: none */
    const uint16_t* xs;    /* bf16 weights (rowdot4_bf16dp): x as three bf16 rows hi, mid, lo of K
                            * each, x = hi + mid + lo exactly */
    /* rowdot4x kernels: mr x rows, row i at x + i * ldx, its reordered copy at xp + K * i and its
     * split at xs + 3 * K * i; outputs y[i * ldy + r] */
    int          mr;
    int64_t      ldx, ldy;
} RowDot4;
typedef void (*rowdot4_fn)(const RowDot4* a, float* y);

/*
 * Integer rows for the W8A8 / W4A8 path (AVX512-VNNI vpdpbusd): for x rows i < mr (mr <= 8),
 * y[i] = sum over segments s of scale[i * nseg + s] * (exact int32 dot of w and x_i over segment s).
 * K is a multiple of 64 and segments end on 64-element chunks (seg_end[s], in chunks). vpdpbusd
 * multiplies unsigned by signed bytes, so the weights are offset to unsigned (int4 q + 8, int8
 * w + 128), and each accumulator lane starts at minus offset * (the x_i elements that lane sums
 * over segment s): bias[((i * nseg + s) * lanes + lane], 8 lanes for int4, 16 for int8. Every lane
 * then holds an exact signed partial dot, as small as one, so its conversion to f32 is exact.
 * For int4 weights each 64-element chunk of an x row holds its 32 even elements and then its 32
 * odd ones: the order in which a byte's low and high nibbles unpack.
 */
#define IDOT_MAX_MR 8
typedef struct {
    const void*    w;        /* the weight row (int8, or int4 packed low nibble first) */
    const int8_t*  x[IDOT_MAX_MR];
    int            mr;
    int64_t        nseg;
    const int64_t* seg_end;
    const int32_t* bias;     /* negated, see above */
    const float*   scale;
} IDot;
typedef void (*idot_fn)(const IDot* a, float* y);
/* The same for four weight rows against one x row (M = 1): y[r] for w[r], scales scale[r][s]. */
typedef struct {
    const void*    w[4];
    const int8_t*  x;
    int64_t        nseg;
    const int64_t* seg_end;
    const int32_t* bias;     /* [nseg][lanes] of the one x row */
    const float*   scale[4];
    int64_t        pf;       /* bytes from w[r] to the rows the next call reads (prefetched), 0: none */
} IDot4;
typedef void (*idot4_fn)(const IDot4* a, float* y);

/* The AMX integer GEMM (kernels_amx.c): Y[M, N] = x @ W^T for int8 x and int8 / int4 weights, one
 * strip of 32 output columns per call; segments as for IDot (64-element chunks, one x block and one
 * w block each). */
#define AMX_MIN_M 32
typedef struct {
    const int8_t*  x;        /* [Mp, K] x rows, zero rows past M (Mp a multiple of 32) */
    int64_t        M, Mp, K, N;
    const struct QMat_* m;   /* the weights (int8, or int4 packed low nibble first) */
    int64_t        nseg;
    const int64_t *seg_end, *seg_xb, *seg_wb;
    const float*   sx;       /* x scales [ceil(M / xbr), xncb] */
    int64_t        xbr, xncb;
    float*         Y;
    int64_t        ldy;
} AmxIntJob;
DI_HIDDEN int amx_init(void);   /* 1: the CPU and the OS give this process AMX tiles */
DI_HIDDEN size_t amx_scratch_bytes(int64_t K, int64_t nseg, int64_t ncb);
DI_HIDDEN void amx_int_strip(const AmxIntJob* j, int64_t n0, void* scratch);

typedef struct {
    /* C[i * ldc + j] = dot(A[i], B[j]) over K (overwrites); A: M rows (lda), B: N rows (ldb) */
    void (*gemm_dot)(const float* A, int64_t lda, int M, const float* B, int64_t ldb, int N, int64_t K,
                     float* C, int64_t ldc);
    rowdot_fn rowdot[DT_COUNT];  /* fused float-x kernels by weight dtype, NULL = none */
    rowdot4_fn rowdot4[DT_COUNT];  /* the same for four rows at M = 1, NULL = use rowdot */
    /* 4-bit weights at M = 1 through a 16-entry value table (vpermps): no integer-to-float
     * conversion; needs xp, block sizes a multiple of 32 (or one block), K's tail done in scalar */
    rowdot4_fn rowdot4_nib[DT_COUNT];
    /* rowdot4 and rowdot4_nib for RowDot4.mr x rows (decode of several tokens; xp then holds K
     * values per x row): the four rows are read once for all x rows, and each (weight row, x row)
     * pair is summed exactly as the one-row kernel sums it, so a row's result does not depend on mr */
    rowdot4_fn rowdot4x[DT_COUNT];
    rowdot4_fn rowdot4x_nib[DT_COUNT];
    /* bf16 weights at M = 1 on AVX512-BF16 dot products (vdpbf16ps) against x split exactly into
     * three bf16 parts: every product is exact, as in the f32 path, without converting weights */
    rowdot4_fn rowdot4_bf16dp;
    /* the same for mr x rows (RowDot4.mr, ldx, ldy; decode of several tokens): each weight row is
     * streamed once for all of them, and every (weight row, x row) pair is summed exactly as
     * rowdot4_bf16dp sums it, so a row's result does not depend on mr */
    rowdot4_fn rowdot4x_bf16dp;
    /* x[0:K] split for the two above, exactly: xs[0:K] the bf16 hi parts (x truncated to bf16),
     * xs[K:2K] the mid parts (x - hi truncated), xs[2K:3K] the lo parts (x - hi - mid, exact); inf
     * and NaN go whole into hi. Set with them. */
    void (*split_bf16x3)(const float* x, int64_t K, uint16_t* xs);
    int32_t (*dot_i8)(const int8_t* a, const int8_t* b, int64_t n);
    /* sum over segments s of scale[s] * (exact int32 dot of a, b over [seg[s], seg[s+1])) */
    float (*dot_i8_seg)(const int8_t* a, const int8_t* b, const int64_t* seg, int64_t nseg, const float* scale);
    void (*unpack_i4)(const uint8_t* src, int64_t n, int8_t* dst, int sign);  /* n even */
    void (*axpy)(float a, const float* x, float* y, int64_t n);               /* y += a * x */
    void (*axpy_bf16)(float a, const uint16_t* x, float* y, int64_t n);      /* y += a * bf16 x */
    /* y += sum_r a[r] * bf16 row r for 4 rows (stride ld elements); NULL: use axpy_bf16 */
    void (*axpy4_bf16)(const float* a, const uint16_t* x, int64_t ld, float* y, int64_t n);
    /* axpy4_bf16 for nt rows y + t * ldy with coefficients a + t * lda (the tokens of a sequence
     * share the four rows, decoded once); each row gets axpy4_bf16's result. NULL: call that per row */
    void (*axpy4x_bf16)(const float* a, int64_t lda, int nt, const uint16_t* x, int64_t ld, float* y, int64_t ldy,
                        int64_t n);
    idot_fn idot[DT_COUNT];   /* DT_I8 and DT_I4 rows on VNNI; NULL: the generic integer path */
    idot4_fn idot4[DT_COUNT];
    /* attention over cache rows (row r at rows + r * ld, D floats used): out[r] = q . row r for
     * r < n; acc[0:D] += sum_r w[r] * row r; s[0:n] = softmax(scale * s) in place (f32) */
    void (*dot_rows)(const float* q, const float* rows, int64_t ld, int n, int64_t D, float* out);
    void (*wsum_rows)(const float* w, const float* rows, int64_t ld, int n, int64_t D, float* acc);
    void (*softmax)(float* s, int64_t n, float scale);
    /* wsum_rows for four weight rows at once (acc[h][0:D] += sum_r w[h][r] * row r, h < 4): each row
     * is loaded once for the four, and every element gets wsum_rows's FMAs in wsum_rows's order, so
     * the bits are the same. NULL: call wsum_rows per weight row */
    void (*wsum_rows4)(const float* const w[4], const float* rows, int64_t ld, int n, int64_t D, float* const acc[4]);
    int amx;                  /* AMX tiles usable (amx_init succeeded and the ISA cap allows them) */
    const char* name;
} Kernels;

DI_HIDDEN const Kernels* kernels(void);
DI_HIDDEN void kernels_scalar(Kernels* k);
DI_HIDDEN int kernels_avx2(Kernels* k);    /* 0 when not compiled in */
DI_HIDDEN int kernels_avx512(Kernels* k);
DI_HIDDEN const char* cpu_features(void);
/* ISA levels, each including the ones before: scalar, avx2, avx512 (F/BW/VL), avx512vnni (+VNNI
 * integer rows), amx. DEEPINFER_CPU_ISA=<level> caps the kernels at that level (to test every
 * fallback on one machine); isa_allows(level) says whether the cap admits `level`. */
DI_HIDDEN int isa_allows(const char* level);

/* ------------------------------------------------------------------ linear engine */
/* the weight dtypes linear and moe_experts take (plain or as quantized storage) */
static const uint32_t k_wdts = DTM(DT_F32) | DTM(DT_BF16) | DTM(DT_F16) | DTM(DT_I8) | DTM(DT_U8) | DTM(DT_I4) |
                               DTM(DT_U4) | DTM(DT_E4M3) | DTM(DT_E2M1);

/* Y[M, N] (ldy) = X[M, K] (ldx, f32) @ dequant(W)^T; W validated 2-d [N, K]. */
DI_HIDDEN DI_Status lin_f32(DI_Context* ctx, const char* op, const float* X, int64_t ldx, int64_t M,
                            const DI_Tensor* w, float* Y, int64_t ldy);
DI_HIDDEN DI_Status check_weight(VC* v, const DI_Tensor* w, const char* name, int64_t N, int64_t K);
/* Y = X @ W^T on the calling thread only (inside another job's task: the pool takes one job at a time) */
DI_HIDDEN DI_Status lin_f32_serial(DI_Context* ctx, const char* op, const float* X, int64_t ldx, int64_t M,
                                   const DI_Tensor* w, float* Y, int64_t ldy);
/* one product of lin_f32_multi */
typedef struct {
    const float*     X;
    int64_t          ldx, M;
    const DI_Tensor* w;
    float*           Y;
    int64_t          ldy;
} LinSpec;

/* Several independent products in one parallel region (the experts of a MoE layer) */
DI_HIDDEN DI_Status lin_f32_multi(DI_Context* ctx, const char* op, const LinSpec* spec, int n);
/* up to this many x rows, weights stream through the row kernels (4 x rows a pass); more: a
 * dequantized tile and the dot-product GEMM (measured on Zen 4 and Sapphire Rapids: a GEBP
 * outer-product panel lost to it at K = 2048, 119 against 190 GFLOP/s, and rows past 8 ran no
 * faster through the row kernels than through the tile) */
#define FUSED_MAX_M 8

/* ------------------------------------------------------------------ ops */
/* one body per row of the header's op table */
#define DI_OP_DECL(id, name, T, minor) DI_HIDDEN DI_Status op_##name(DI_Context* ctx, const T* args, int query);
DI_OPS(DI_OP_DECL)
#undef DI_OP_DECL

/* silu(g) * u, with V4's clipped SwiGLU when limit > 0 (g = min(g, limit), u = clamp(u, -limit,
 * limit); comparisons keep a NaN as torch's clamp does). silu_mul and both moe_experts paths share
 * it, so a (token, k) pair's activation has the same bits whichever path computes it. */
static inline float di_swiglu(float g, float u, float limit) {
    if (limit > 0.0f) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : u < -limit ? -limit : u;
    }
    return g / (1.0f + expf(-g)) * u;
}

/* Row math of rmsnorm (norm.c) and rope (rope.c), shared with the fused mla_rope_cache_write
 * (fused.c) so that it computes exactly the unfused ops' bits. f32 rows; inv [D/2], c and s [D/2]. */
DI_HIDDEN void rmsnorm_row(const float* s, const float* w, int64_t H, float eps, float* out);
DI_HIDDEN DI_Status rope_check_params(DI_Context* ctx, const char* op, int32_t interleaved, int32_t scaling,
                                      float theta, float factor, int32_t original_max_position, float beta_fast,
                                      float beta_slow);
DI_HIDDEN void rope_inv_freq(int64_t D, int32_t scaling, float theta, float factor, int32_t original_max_position,
                             float beta_fast, float beta_slow, double* inv);
DI_HIDDEN void rope_cos_sin(double pos, const double* inv, int64_t half, float attn_factor, float* c, float* s);
DI_HIDDEN void rope_rotate(float* row, const float* c, const float* s, int64_t D, int inter);

/* returned by an op in query mode only: supported, but by a fallback (op_query says SLOW) */
#define DI_QUERY_SLOW 1000

/* CLOCK_MONOTONIC in nanoseconds (bounded spins, the replay profile) */
static inline uint64_t di_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ communicators (comm_mpi.c) */
/* the DI_Api entries, after plugin.c has checked ctx */
DI_HIDDEN DI_Status comm_unique_id(DI_Context* ctx, DI_CommId* out);
DI_HIDDEN DI_Status comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out);
DI_HIDDEN DI_Status comm_destroy(DI_Context* ctx, DI_Comm* comm);

/* malloc that never returns NULL for n == 0; NULL on failure */
DI_HIDDEN void* di_malloc(size_t n);
#define DI_OOM(ctx, op) di_fail((ctx), DI_RESOURCE_EXHAUSTED, "%s: out of host memory for scratch", (op))

#endif
