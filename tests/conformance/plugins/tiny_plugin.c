/*
 * A tiny third-party deepinfer backend, built from abi/deepinfer_abi.h and nothing else:
 *
 *     cc -shared -fPIC -O1 -I abi tiny_plugin.c -o libdeepinfer_tiny.so
 *
 * It implements four ops (embedding, add, mul, silu_mul) for f32 and bf16 on host memory, leaves
 * every other entry NULL, and follows every behavioural rule of abi/README.md, so that the
 * conformance suite certifies exactly what it claims. The tests also compile broken variants:
 *
 *   -DTEST_ABI_MAJOR=N      DI_PluginInfo says ABI N.0 and get_api only answers N
 *   -DTEST_NO_BOOTSTRAP     the bootstrap symbol is missing
 *   -DTEST_NAME='"x"'       the backend's name (default "tiny")
 *   -DTEST_SCORE=N          export a score() returning N
 *   -DTEST_SCORE_REASON='"x"'  with TEST_SCORE: score() leaves x in last_error(NULL)
 *   -DTEST_NO_VALIDATION    skip argument checks (a plugin the suite must fail, not crash on)
 *   -DTEST_GRAPHS           streams and graph capture: ops issued on a capturing stream are recorded
 *                           (args copied) and run by graph_launch, so the L3 checks have something to see
 *   -DTEST_GRAPH_NOOP       with TEST_GRAPHS: graph_launch does nothing (the L3 checks must fail it)
 *   -DTEST_COMM             (1.4 headers) communicators of one rank and the three collectives as copies
 *   -DTEST_COMM_NO_CHECK    with TEST_COMM: a collective trusts any non-NULL comm (L0 must fail it)
 *   -DTEST_COMM_NO_CREATE   with TEST_COMM: comm_create left NULL (the six 1.4 entries are all or none)
 *
 * and plugins that would take down whatever process loads them (the loader must probe them in a
 * child process, the conformance suite must time them out):
 *
 *   -DTEST_BOOTSTRAP_SEGFAULT  deepinfer_plugin_info() dies with SIGSEGV
 *   -DTEST_BOOTSTRAP_WILD      deepinfer_plugin_info() returns a pointer to unmapped memory
 *   -DTEST_BOOTSTRAP_HANG      deepinfer_plugin_info() never returns
 *   -DTEST_API_GARBAGE         get_api() returns a table whose function pointers are garbage
 *   -DTEST_CONSTRUCTOR_EXIT    a constructor calls exit(3) as soon as the library is loaded
 *   -DTEST_HANG_MUL            mul never returns for 3-d f32 operands (one L1 case of the quick profile)
 */
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deepinfer_abi.h"

#if defined(TEST_BOOTSTRAP_HANG) || defined(TEST_HANG_MUL)
#include <threads.h>

static void hang_forever(void) {
    for (;;)
        thrd_sleep(&(struct timespec){.tv_sec = 1000}, NULL);
}
#endif

#ifndef TEST_ABI_MAJOR
#define TEST_ABI_MAJOR DI_ABI_MAJOR
#endif
#ifndef TEST_NAME
#define TEST_NAME "tiny"
#endif

typedef struct Recorded {
    int op;                       /* DI_OpId */
    union {
        DI_BinaryArgs    binary;
        DI_SiluMulArgs   silu_mul;
        DI_EmbeddingArgs embedding;
    } args;
} Recorded;

struct DI_Graph {
    Recorded* ops;
    int       n;
};

struct DI_Context {
    char      error[512];
    int       num_threads;
    DI_Stream capturing;          /* non-NULL while graph_begin is recording this stream */
    Recorded* rec;
    int       n_rec, cap_rec;
};

/* errors with no context to hold them (ctx == NULL, or context_create failing) */
static _Thread_local char g_error[512] = "";

static DI_Status fail(DI_Context* ctx, DI_Status st, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

/* ABI 1.1 asks for one message per thread; a 1.0 build keeps the 1.0 per-context buffer */
#if DI_ABI_MINOR >= 1
#define ERRBUF(ctx) ((void)(ctx), g_error)
#else
#define ERRBUF(ctx) ((ctx) ? (ctx)->error : g_error)
#endif

static DI_Status fail(DI_Context* ctx, DI_Status st, const char* fmt, ...) {
    char* buf = ERRBUF(ctx);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, 512, fmt, ap);
    va_end(ap);
    return st;
}

static DI_Status ok(DI_Context* ctx) {
    ERRBUF(ctx)[0] = '\0';
    return DI_OK;
}

/* The struct_size rule: too small is malformed; bytes past our size must all be zero. */
static DI_Status check_size(DI_Context* ctx, const void* s, uint32_t given, size_t ours, const char* what) {
    if (given < ours)
        return fail(ctx, DI_INVALID_ARGUMENT, "struct_size %u < %zu for %s", given, ours, what);
    const unsigned char* p = (const unsigned char*)s;
    for (size_t i = ours; i < given; ++i)
        if (p[i])
            return fail(ctx, DI_UNIMPLEMENTED, "%s has fields past this library's %zu bytes (byte %zu is set)",
                        what, ours, i);
    return DI_OK;
}

static DI_Status check_header(DI_Context* ctx, const void* args, size_t ours, const char* what) {
    if (!ctx)
        return fail(NULL, DI_INVALID_ARGUMENT, "%s: ctx is NULL", what);
    if (!args)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: args is NULL", what);
    const DI_ArgsHeader* h = (const DI_ArgsHeader*)args;
    DI_Status st = check_size(ctx, args, h->struct_size, ours, what);
    if (st)
        return st;
    if (h->ext)
        return fail(ctx, DI_UNIMPLEMENTED, "%s: unknown extension in header.ext", what);
    return DI_OK;
}

/* While a stream is being captured, an op issued on it is recorded instead of run (returns 1). */
static int capture(DI_Context* ctx, int op, const void* args, size_t size) {
#ifdef TEST_GRAPHS
    const DI_ArgsHeader* h = (const DI_ArgsHeader*)args;
    if (!ctx->capturing || h->stream != ctx->capturing)
        return 0;
    if (ctx->n_rec == ctx->cap_rec) {
        int cap = ctx->cap_rec ? 2 * ctx->cap_rec : 8;
        Recorded* r = (Recorded*)realloc(ctx->rec, (size_t)cap * sizeof(Recorded));
        if (!r)
            return -1;
        ctx->rec = r;
        ctx->cap_rec = cap;
    }
    Recorded* r = &ctx->rec[ctx->n_rec++];
    memset(r, 0, sizeof *r);
    r->op = op;
    memcpy(&r->args, args, size);  /* our own prefix only: the struct_size check already passed */
    ((DI_ArgsHeader*)&r->args)->struct_size = (uint32_t)size;
    return 1;
#else
    (void)ctx; (void)op; (void)args; (void)size;
    return 0;
#endif
}

/* ------------------------------------------------------------------ bf16 */
static float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

enum { F32, BF16, I32, OTHER };

static int kind(DI_DataType d) {
    if (d.code == DI_DTYPE_FLOAT && d.bits == 32) return F32;
    if (d.code == DI_DTYPE_BFLOAT && d.bits == 16) return BF16;
    if (d.code == DI_DTYPE_INT && d.bits == 32) return I32;
    return OTHER;
}

__attribute__((unused)) static int known_dtype(DI_DataType d) {
    switch (d.code) {
    case DI_DTYPE_INT: return d.bits == 4 || d.bits == 8 || d.bits == 32 || d.bits == 64;
    case DI_DTYPE_UINT: return d.bits == 4 || d.bits == 8 || d.bits == 64;
    case DI_DTYPE_FLOAT: return d.bits == 16 || d.bits == 32;
    case DI_DTYPE_BFLOAT: return d.bits == 16;
    case DI_DTYPE_F8_E4M3FN: case DI_DTYPE_F8_E5M2: case DI_DTYPE_F8_E8M0FNU: return d.bits == 8;
    case DI_DTYPE_F4_E2M1FN: return d.bits == 4;
    default: return 0;
    }
}

static size_t elem_size(int k) { return k == BF16 ? 2 : 4; }

/* Everything about one tensor argument except how its shape relates to the others; want_float 1: f32 or
 * bf16, 0: int32, -1: any known dtype (the caller checks which). */
static DI_Status check_tensor(DI_Context* ctx, const char* op, const char* name, const DI_Tensor* t, int ndim_lo,
                              int ndim_hi, int want_float) {
#ifdef TEST_NO_VALIDATION
    (void)ctx; (void)op; (void)name; (void)t; (void)ndim_lo; (void)ndim_hi; (void)want_float;
    return DI_OK;
#else
    if (!t->data)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.data is NULL", op, name);
    if (t->ndim < ndim_lo || t->ndim > ndim_hi || t->ndim > DI_MAX_DIMS)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d..%d", op, name, t->ndim, ndim_lo, ndim_hi);
    if (t->dtype.lanes != 1)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.dtype.lanes=%u, must be 1", op, name, t->dtype.lanes);
    if (!known_dtype(t->dtype))
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s has unknown dtype (code %u, %u bits)", op, name,
                    t->dtype.code, t->dtype.bits);
    if (t->device_type != DI_DEVICE_CPU)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.device_type=%d, this library reads host memory (1)", op, name,
                    t->device_type);
    if (t->quant)
        return fail(ctx, DI_UNIMPLEMENTED, "%s: %s is quantized; tiny supports plain values only", op, name);
    for (int i = 0; i < t->ndim; ++i) {
        if (t->shape[i] < 0)
            return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld < 0", op, name, i, (long long)t->shape[i]);
        if (t->strides[i] < 0)
            return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld < 0", op, name, i,
                        (long long)t->strides[i]);
    }
    if (t->ndim && t->strides[t->ndim - 1] != 1)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld, the last stride must be 1", op, name,
                    t->ndim - 1, (long long)t->strides[t->ndim - 1]);
    int k = kind(t->dtype);
    if (want_float < 0)
        return DI_OK;   /* any dtype: the caller checks it */
    if (want_float && k != F32 && k != BF16)
        return fail(ctx, DI_UNIMPLEMENTED, "%s: %s dtype (code %u, %u bits) unsupported; tiny takes f32 or bf16", op,
                    name, t->dtype.code, t->dtype.bits);
    if (!want_float && k != I32)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s must be int32", op, name);
    return DI_OK;
#endif
}

static DI_Status same_shape(DI_Context* ctx, const char* op, const char* an, const DI_Tensor* a, const char* bn,
                            const DI_Tensor* b) {
#ifndef TEST_NO_VALIDATION
    int same = a->ndim == b->ndim;
    for (int i = 0; same && i < a->ndim; ++i)
        same = a->shape[i] == b->shape[i];
    if (!same)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s and %s differ in shape", op, an, bn);
#else
    (void)ctx; (void)op; (void)an; (void)a; (void)bn; (void)b;
#endif
    return DI_OK;
}

static char* base_of(const DI_Tensor* t) { return (char*)t->data + t->byte_offset; }

static float load(const DI_Tensor* t, int k, int64_t off) {
    char* p = base_of(t);
    return k == F32 ? ((float*)p)[off] : bf16_to_f32(((uint16_t*)p)[off]);
}

static void store(const DI_Tensor* t, int k, int64_t off, float v) {
    char* p = base_of(t);
    if (k == F32)
        ((float*)p)[off] = v;
    else
        ((uint16_t*)p)[off] = f32_to_bf16(v);
}

/* Visit every element of an N-d tensor: callback gets the element offsets of up to 3 tensors. */
typedef float (*binop)(float, float);
static float op_add(float a, float b) { return a + b; }
static float op_mul(float a, float b) { return a * b; }
static float op_silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }
#if DI_ABI_MINOR >= 3
/* 1.3's clipped SwiGLU: elementwise() takes a plain function, so the limit of the running call sits here */
static _Thread_local float t_limit;
static float op_silu_mul_clipped(float g, float u) {
    g = g < t_limit ? g : t_limit;
    u = u < -t_limit ? -t_limit : u > t_limit ? t_limit : u;
    return op_silu_mul(g, u);
}
#endif

static void elementwise(const DI_Tensor* a, const DI_Tensor* b, const DI_Tensor* o, binop f) {
    int nd = a->ndim;
    int64_t n = nd ? a->shape[nd - 1] : 1;
    int64_t rows = 1;
    for (int i = 0; i < nd - 1; ++i)
        rows *= a->shape[i];
    int ka = kind(a->dtype), kb = kind(b->dtype), ko = kind(o->dtype);
    for (int64_t r = 0; r < rows; ++r) {
        int64_t oa = 0, ob = 0, oo = 0, rem = r;
        for (int i = nd - 2; i >= 0; --i) {
            int64_t idx = rem % a->shape[i];
            rem /= a->shape[i];
            oa += idx * a->strides[i];
            ob += idx * b->strides[i];
            oo += idx * o->strides[i];
        }
        for (int64_t j = 0; j < n; ++j)
            store(o, ko, oo + j, f(load(a, ka, oa + j), load(b, kb, ob + j)));
    }
}

static DI_Status binary(DI_Context* ctx, const DI_BinaryArgs* args, const char* op, binop f, int validate_only) {
    DI_Status st = check_header(ctx, args, sizeof(DI_BinaryArgs), op);
    if (st) return st;
    if ((st = check_tensor(ctx, op, "a", &args->a, 0, DI_MAX_DIMS, 1))) return st;
    if ((st = check_tensor(ctx, op, "b", &args->b, 0, DI_MAX_DIMS, 1))) return st;
    if ((st = check_tensor(ctx, op, "out", &args->out, 0, DI_MAX_DIMS, 1))) return st;
    if ((st = same_shape(ctx, op, "a", &args->a, "b", &args->b))) return st;
    if ((st = same_shape(ctx, op, "a", &args->a, "out", &args->out))) return st;
    if (kind(args->a.dtype) != kind(args->out.dtype) || kind(args->b.dtype) != kind(args->out.dtype))
        return fail(ctx, DI_UNIMPLEMENTED, "%s: mixed dtypes are not supported", op);
    if (validate_only)
        return ok(ctx);
    int c = capture(ctx, f == op_add ? DI_OP_ADD : DI_OP_MUL, args, sizeof(DI_BinaryArgs));
    if (c < 0)
        return fail(ctx, DI_RESOURCE_EXHAUSTED, "%s: out of memory while capturing", op);
#ifdef TEST_HANG_MUL
    if (!c && f == op_mul && args->a.ndim == 3 && kind(args->a.dtype) == F32)
        hang_forever();
#endif
    if (!c)
        elementwise(&args->a, &args->b, &args->out, f);
    return ok(ctx);
}

static DI_Status tiny_add(DI_Context* ctx, const DI_BinaryArgs* args) { return binary(ctx, args, "add", op_add, 0); }
static DI_Status tiny_mul(DI_Context* ctx, const DI_BinaryArgs* args) { return binary(ctx, args, "mul", op_mul, 0); }

static void silu_mul_run(const DI_SiluMulArgs* a) {
#if DI_ABI_MINOR >= 3
    if (a->limit > 0) {
        t_limit = a->limit;
        elementwise(&a->gate, &a->up, &a->out, op_silu_mul_clipped);
        return;
    }
#endif
    elementwise(&a->gate, &a->up, &a->out, op_silu_mul);
}

static DI_Status silu_mul_impl(DI_Context* ctx, const DI_SiluMulArgs* in, int validate_only) {
    const char* op = "silu_mul";
    const DI_SiluMulArgs* args = in;
#if DI_ABI_MINOR >= 3
    /* 1.3 appended `limit`: an older caller's struct ends just before it. That size is accepted, and the
     * call runs on a zero-filled copy (limit 0, no clipping), never reading past the caller's bytes. */
    DI_SiluMulArgs local;
    if (ctx && in && in->header.struct_size == offsetof(DI_SiluMulArgs, limit)) {
        memset(&local, 0, sizeof local);
        memcpy(&local, in, offsetof(DI_SiluMulArgs, limit));
        local.header.struct_size = sizeof local;
        args = &local;
    }
#endif
    DI_Status st = check_header(ctx, args, sizeof(DI_SiluMulArgs), op);
    if (st) return st;
#if DI_ABI_MINOR >= 3
    if (!(args->limit >= 0 && args->limit <= 3.4e38f))
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: limit=%g must be finite and >= 0", op, (double)args->limit);
#endif
    if ((st = check_tensor(ctx, op, "gate", &args->gate, 2, 2, 1))) return st;
    if ((st = check_tensor(ctx, op, "up", &args->up, 2, 2, 1))) return st;
    if ((st = check_tensor(ctx, op, "out", &args->out, 2, 2, 1))) return st;
    if ((st = same_shape(ctx, op, "gate", &args->gate, "up", &args->up))) return st;
    if ((st = same_shape(ctx, op, "gate", &args->gate, "out", &args->out))) return st;
    if (kind(args->gate.dtype) != kind(args->out.dtype) || kind(args->up.dtype) != kind(args->out.dtype))
        return fail(ctx, DI_UNIMPLEMENTED, "%s: mixed dtypes are not supported", op);
    if (validate_only)
        return ok(ctx);
    int c = capture(ctx, DI_OP_SILU_MUL, args, sizeof(DI_SiluMulArgs));
    if (c < 0)
        return fail(ctx, DI_RESOURCE_EXHAUSTED, "%s: out of memory while capturing", op);
    if (!c)
        silu_mul_run(args);
    return ok(ctx);
}

static DI_Status tiny_silu_mul(DI_Context* ctx, const DI_SiluMulArgs* args) { return silu_mul_impl(ctx, args, 0); }

static DI_Status embedding_impl(DI_Context* ctx, const DI_EmbeddingArgs* args, int validate_only) {
    const char* op = "embedding";
    DI_Status st = check_header(ctx, args, sizeof(DI_EmbeddingArgs), op);
    if (st) return st;
    if ((st = check_tensor(ctx, op, "ids", &args->ids, 1, 1, 0))) return st;
    if ((st = check_tensor(ctx, op, "table", &args->table, 2, 2, 1))) return st;
    if ((st = check_tensor(ctx, op, "out", &args->out, 2, 2, 1))) return st;
#ifndef TEST_NO_VALIDATION
    if (args->out.shape[0] != args->ids.shape[0])
        return fail(ctx, DI_INVALID_ARGUMENT, "embedding: out.shape[0]=%lld != ids.shape[0]=%lld",
                    (long long)args->out.shape[0], (long long)args->ids.shape[0]);
    if (args->out.shape[1] != args->table.shape[1])
        return fail(ctx, DI_INVALID_ARGUMENT, "embedding: out.shape[1]=%lld != table.shape[1]=%lld",
                    (long long)args->out.shape[1], (long long)args->table.shape[1]);
#endif
    if (kind(args->table.dtype) != kind(args->out.dtype))
        return fail(ctx, DI_UNIMPLEMENTED, "embedding: out must have the table's dtype in tiny");
    if (validate_only)
        return ok(ctx);
    int c = capture(ctx, DI_OP_EMBEDDING, args, sizeof(DI_EmbeddingArgs));
    if (c < 0)
        return fail(ctx, DI_RESOURCE_EXHAUSTED, "embedding: out of memory while capturing");
    if (c)
        return ok(ctx);
    int64_t T = args->ids.shape[0], V = args->table.shape[0], H = args->table.shape[1];
    const int32_t* ids = (const int32_t*)base_of(&args->ids);
    int k = kind(args->table.dtype);
    size_t es = elem_size(k);
    for (int64_t t = 0; t < T; ++t) {
        int32_t id = ids[t * args->ids.strides[0]];
        char* dst = base_of(&args->out) + (size_t)(t * args->out.strides[0]) * es;
        if (id < 0 || id >= V)
            memset(dst, 0, (size_t)H * es);
        else
            memmove(dst, base_of(&args->table) + (size_t)(id * args->table.strides[0]) * es, (size_t)H * es);
    }
    return ok(ctx);
}

static DI_Status tiny_embedding(DI_Context* ctx, const DI_EmbeddingArgs* args) {
    return embedding_impl(ctx, args, 0);
}

#if defined(TEST_COMM) && DI_ABI_MINOR >= 4
/* ------------------------------------------------------------------ communicators (1.4), one rank
 * tiny's communicators are one process each: comm_create takes nranks == 1 only (UNIMPLEMENTED past
 * that) and the collectives are copies. It knows its own communicators by a registry of live ones, so
 * a NULL or forged comm is INVALID_ARGUMENT without reading through the pointer. */
#include <pthread.h>

struct DI_Comm {
    DI_Context* ctx;
    int32_t     nranks, rank;
};

#define TINY_MAX_COMMS 64
static DI_Comm*        g_comms[TINY_MAX_COMMS];
static pthread_mutex_t g_comms_lock = PTHREAD_MUTEX_INITIALIZER;
static const char      g_id_magic[] = "tiny-comm-id";

static int comm_live(const DI_Comm* c) {
    int found = 0;
    pthread_mutex_lock(&g_comms_lock);
    for (int i = 0; i < TINY_MAX_COMMS && !found; ++i)
        found = c && g_comms[i] == c;
    pthread_mutex_unlock(&g_comms_lock);
    return found;
}

static DI_Status tiny_comm_unique_id(DI_Context* ctx, DI_CommId* out) {
    static uint64_t counter;
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "comm_unique_id: ctx is NULL");
    if (!out) return fail(ctx, DI_INVALID_ARGUMENT, "comm_unique_id: out is NULL");
    memset(out, 0, sizeof *out);
    memcpy(out->bytes, g_id_magic, sizeof g_id_magic);
    uint64_t n = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    memcpy(out->bytes + 16, &n, sizeof n);
    return ok(ctx);
}

__attribute__((unused)) static DI_Status tiny_comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "comm_create: ctx is NULL");
    if (!id || !out) return fail(ctx, DI_INVALID_ARGUMENT, "comm_create: id and out must not be NULL");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return fail(ctx, DI_INVALID_ARGUMENT, "comm_create: rank %d of %d ranks is out of range", rank, nranks);
    if (memcmp(id->bytes, g_id_magic, sizeof g_id_magic))
        return fail(ctx, DI_INVALID_ARGUMENT, "comm_create: the id was not made by tiny's comm_unique_id");
    if (nranks > 1)
        return fail(ctx, DI_UNIMPLEMENTED, "comm_create: tiny runs one rank only (nranks=%d)", nranks);
    DI_Comm* c = (DI_Comm*)calloc(1, sizeof *c);
    if (!c) return fail(ctx, DI_RESOURCE_EXHAUSTED, "comm_create: out of memory");
    c->ctx = ctx;
    c->nranks = nranks;
    c->rank = rank;
    int slot = -1;
    pthread_mutex_lock(&g_comms_lock);
    for (int i = 0; i < TINY_MAX_COMMS && slot < 0; ++i)
        if (!g_comms[i]) g_comms[slot = i] = c;
    pthread_mutex_unlock(&g_comms_lock);
    if (slot < 0) {
        free(c);
        return fail(ctx, DI_RESOURCE_EXHAUSTED, "comm_create: more than %d communicators", TINY_MAX_COMMS);
    }
    *out = c;
    return ok(ctx);
}

static DI_Status tiny_comm_destroy(DI_Context* ctx, DI_Comm* comm) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "comm_destroy: ctx is NULL");
    int found = 0;
    pthread_mutex_lock(&g_comms_lock);
    for (int i = 0; i < TINY_MAX_COMMS && !found; ++i)
        if (comm && g_comms[i] == comm) {
            g_comms[i] = NULL;
            found = 1;
        }
    pthread_mutex_unlock(&g_comms_lock);
    if (!found) return fail(ctx, DI_INVALID_ARGUMENT, "comm_destroy: not a live communicator of this library");
    free(comm);
    return ok(ctx);
}

static DI_Status check_comm(DI_Context* ctx, const char* op, const DI_Comm* comm) {
    if (!comm) return fail(ctx, DI_INVALID_ARGUMENT, "%s: comm is NULL", op);
#ifndef TEST_COMM_NO_CHECK
    if (!comm_live(comm))
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: comm was not made by comm_create (or was destroyed)", op);
    if (comm->ctx != ctx)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: comm belongs to another context", op);
#else
    (void)comm_live;
#endif
    return DI_OK;
}

/* bytes per element of a dtype the collectives move (DI_DTS_COMM), 0 for any other;
 * *is_float says whether it is a float type (another float is UNIMPLEMENTED, the rest INVALID) */
static size_t comm_elem(DI_DataType d, int floats_only, int* is_float) {
    *is_float = d.code == DI_DTYPE_FLOAT || d.code == DI_DTYPE_BFLOAT || d.code == DI_DTYPE_F8_E4M3FN ||
                d.code == DI_DTYPE_F8_E5M2 || d.code == DI_DTYPE_F8_E8M0FNU || d.code == DI_DTYPE_F4_E2M1FN;
    if (kind(d) == F32 || kind(d) == BF16) return kind(d) == F32 ? 4 : 2;
    if (floats_only) return 0;
    if (d.code == DI_DTYPE_FLOAT && d.bits == 16) return 2;
    if (d.code == DI_DTYPE_INT && d.bits == 32) return 4;
    if ((d.code == DI_DTYPE_INT || d.code == DI_DTYPE_UINT) && d.bits == 8) return 1;
    if (d.code == DI_DTYPE_F8_E4M3FN && d.bits == 8) return 1;
    return 0;
}

/* a tensor the collectives take: contiguous, of a dtype they move; returns its bytes per element */
static DI_Status comm_tensor(DI_Context* ctx, const char* op, const char* name, const DI_Tensor* t, int lo, int hi,
                             int floats_only, size_t* es) {
    DI_Status st = check_tensor(ctx, op, name, t, lo, hi, -1);
    if (st) return st;
    int is_float;
    *es = comm_elem(t->dtype, floats_only, &is_float);
    if (!*es)
        return fail(ctx, is_float ? DI_UNIMPLEMENTED : DI_INVALID_ARGUMENT, "%s: %s has a dtype (code %u, %u bits) "
                    "this op does not move", op, name, t->dtype.code, t->dtype.bits);
    int64_t want = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
        if (t->shape[i] > 1 && t->strides[i] != want)
            return fail(ctx, DI_INVALID_ARGUMENT, "%s: %s must be contiguous", op, name);
        want *= t->shape[i];
    }
    return DI_OK;
}

static int64_t numel(const DI_Tensor* t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
    return n;
}

static DI_Status same_dtype(DI_Context* ctx, const char* op, const DI_Tensor* a, const DI_Tensor* b) {
    if (a->dtype.code != b->dtype.code || a->dtype.bits != b->dtype.bits)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: the output's dtype differs from the input's", op);
    return DI_OK;
}

static DI_Status comm_op_header(DI_Context* ctx, const void* args, size_t size, const char* op) {
    DI_Status st = check_header(ctx, args, size, op);
    if (st) return st;
#ifdef TEST_GRAPHS
    if (ctx->capturing && ((const DI_ArgsHeader*)args)->stream == ctx->capturing)
        return fail(ctx, DI_UNIMPLEMENTED, "%s: tiny does not capture collectives", op);
#endif
    return DI_OK;
}

static DI_Status all_reduce_impl(DI_Context* ctx, const DI_AllReduceArgs* a, int validate_only) {
    const char* op = "all_reduce";
    size_t es, eo;
    DI_Status st = comm_op_header(ctx, a, sizeof *a, op);
    if (st) return st;
    if ((st = check_comm(ctx, op, a->comm))) return st;
    if ((st = comm_tensor(ctx, op, "x", &a->x, 1, 6, 1, &es))) return st;
    if ((st = comm_tensor(ctx, op, "out", &a->out, 1, 6, 1, &eo))) return st;
    if ((st = same_shape(ctx, op, "x", &a->x, "out", &a->out))) return st;
    if ((st = same_dtype(ctx, op, &a->x, &a->out))) return st;
    if (!validate_only)   /* the sum over one rank */
        memmove(base_of(&a->out), base_of(&a->x), (size_t)numel(&a->x) * es);
    return ok(ctx);
}

static DI_Status all_gather_impl(DI_Context* ctx, const DI_AllGatherArgs* a, int validate_only) {
    const char* op = "all_gather";
    size_t es, eo;
    DI_Status st = comm_op_header(ctx, a, sizeof *a, op);
    if (st) return st;
    if ((st = check_comm(ctx, op, a->comm))) return st;
    if ((st = comm_tensor(ctx, op, "x", &a->x, 1, 5, 0, &es))) return st;
    if ((st = comm_tensor(ctx, op, "out", &a->out, 2, 6, 0, &eo))) return st;
    int same = a->out.ndim == a->x.ndim + 1 && a->out.shape[0] == a->comm->nranks;
    for (int i = 0; same && i < a->x.ndim; ++i)
        same = a->out.shape[i + 1] == a->x.shape[i];
    if (!same) return fail(ctx, DI_INVALID_ARGUMENT, "%s: out must be [nranks, *x.shape]", op);
    if ((st = same_dtype(ctx, op, &a->x, &a->out))) return st;
    if (!validate_only)
        memcpy(base_of(&a->out), base_of(&a->x), (size_t)numel(&a->x) * es);
    return ok(ctx);
}

static DI_Status all_to_all_impl(DI_Context* ctx, const DI_AllToAllArgs* a, int validate_only) {
    const char* op = "all_to_all";
    size_t es, eo;
    DI_Status st = comm_op_header(ctx, a, sizeof *a, op);
    if (st) return st;
    if ((st = check_comm(ctx, op, a->comm))) return st;
    if ((st = comm_tensor(ctx, op, "send", &a->send, 2, 6, 0, &es))) return st;
    if ((st = comm_tensor(ctx, op, "recv", &a->recv, 2, 6, 0, &eo))) return st;
    if ((st = same_shape(ctx, op, "send", &a->send, "recv", &a->recv))) return st;
    if ((st = same_dtype(ctx, op, &a->send, &a->recv))) return st;
    int32_t N = a->comm->nranks;
    int64_t C = a->send.shape[1];
    if (a->send.shape[0] != N)
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: send.shape[0]=%lld != the communicator's %d ranks", op,
                    (long long)a->send.shape[0], N);
    int counts = a->send_counts.data != NULL;
    if (counts != (a->recv_counts.data != NULL))
        return fail(ctx, DI_INVALID_ARGUMENT, "%s: send_counts and recv_counts go together", op);
    int32_t n = (int32_t)C;
    if (counts) {
        if ((st = check_tensor(ctx, op, "send_counts", &a->send_counts, 1, 1, 0))) return st;
        if ((st = check_tensor(ctx, op, "recv_counts", &a->recv_counts, 1, 1, 0))) return st;
        if (a->send_counts.shape[0] != N || a->recv_counts.shape[0] != N)
            return fail(ctx, DI_INVALID_ARGUMENT, "%s: send_counts and recv_counts must be [%d]", op, N);
        n = ((const int32_t*)base_of(&a->send_counts))[0];
        if (n < 0 || n > C)
            return fail(ctx, DI_INVALID_ARGUMENT, "%s: send_counts[0]=%d outside [0, C=%lld]", op, n, (long long)C);
    }
    if (validate_only)
        return ok(ctx);
    size_t row = C ? (size_t)(numel(&a->send) / (N * C)) * es : 0;
    memcpy(base_of(&a->recv), base_of(&a->send), (size_t)n * row);
    if (counts)
        ((int32_t*)base_of(&a->recv_counts))[0] = n;
    return ok(ctx);
}

static DI_Status tiny_all_reduce(DI_Context* ctx, const DI_AllReduceArgs* a) { return all_reduce_impl(ctx, a, 0); }
static DI_Status tiny_all_gather(DI_Context* ctx, const DI_AllGatherArgs* a) { return all_gather_impl(ctx, a, 0); }
static DI_Status tiny_all_to_all(DI_Context* ctx, const DI_AllToAllArgs* a) { return all_to_all_impl(ctx, a, 0); }
#endif

/* ------------------------------------------------------------------ contexts, memory, attributes */
static DI_Status tiny_context_create(const DI_ContextOptions* options, DI_Context** out) {
    if (!out)
        return fail(NULL, DI_INVALID_ARGUMENT, "context_create: out is NULL");
    *out = NULL;
    int threads = 0;
    if (options) {
        DI_Status st = check_size(NULL, options, options->struct_size, sizeof(DI_ContextOptions),
                                  "DI_ContextOptions");
        if (st) return st;
        if (options->ext)
            return fail(NULL, DI_UNIMPLEMENTED, "context_create: unknown extension in options.ext");
        if (options->device_id != 0)
            return fail(NULL, DI_INVALID_ARGUMENT, "context_create: device_id=%d, tiny has one device (0)",
                        options->device_id);
        threads = options->num_threads;
    }
    DI_Context* c = (DI_Context*)calloc(1, sizeof(DI_Context));
    if (!c)
        return fail(NULL, DI_RESOURCE_EXHAUSTED, "context_create: out of memory");
    c->num_threads = threads;
    *out = c;
    return DI_OK;
}

static DI_Status tiny_context_destroy(DI_Context* ctx) {
    if (!ctx)
        return fail(NULL, DI_INVALID_ARGUMENT, "context_destroy: ctx is NULL");
    free(ctx->rec);
    free(ctx);
    return DI_OK;
}

static const char* tiny_last_error(DI_Context* ctx) { return ERRBUF(ctx); }

static DI_Status tiny_get_attribute(DI_Context* ctx, const char* key, char* buf, uint64_t size) {
    if (!ctx)
        return fail(NULL, DI_INVALID_ARGUMENT, "get_attribute: ctx is NULL");
    if (!key || !buf)
        return fail(ctx, DI_INVALID_ARGUMENT, "get_attribute: key and buf must not be NULL");
    const char* v = NULL;
    char tmp[32];
    if (!strcmp(key, "name")) v = TEST_NAME;
    else if (!strcmp(key, "version")) v = "0.0.1";
    else if (!strcmp(key, "abi.version")) { snprintf(tmp, sizeof tmp, "%d.%d", TEST_ABI_MAJOR, DI_ABI_MINOR); v = tmp; }
    else if (!strcmp(key, "device.name")) v = "host CPU (tiny test plugin)";
#if DI_ABI_MINOR >= 1
    /* required from 1.1 on; a test plugin may answer with any plausible pair */
    else if (!strcmp(key, "device.memory_total_bytes")) v = "1073741824";
    else if (!strcmp(key, "device.memory_free_bytes")) v = "536870912";
#endif
    if (!v)
        return fail(ctx, DI_UNIMPLEMENTED, "get_attribute: unknown key '%s'", key);
    if (strlen(v) + 1 > size)
        return fail(ctx, DI_INVALID_ARGUMENT, "get_attribute: '%s' needs %zu bytes, buffer has %llu", key,
                    strlen(v) + 1, (unsigned long long)size);
    memcpy(buf, v, strlen(v) + 1);
    return ok(ctx);
}

static DI_Status tiny_mem_alloc(DI_Context* ctx, uint64_t bytes, void** out) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "mem_alloc: ctx is NULL");
    if (!out) return fail(ctx, DI_INVALID_ARGUMENT, "mem_alloc: out is NULL");
    uint64_t rounded = (bytes + 255) / 256 * 256;
    void* p = (bytes > ((uint64_t)1 << 48)) ? NULL : aligned_alloc(256, rounded ? rounded : 256);
    if (!p)
        return fail(ctx, DI_RESOURCE_EXHAUSTED, "mem_alloc: cannot allocate %llu bytes", (unsigned long long)bytes);
    *out = p;
    return ok(ctx);
}

static DI_Status tiny_mem_free(DI_Context* ctx, void* p) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "mem_free: ctx is NULL");
    free(p);
    return ok(ctx);
}

static DI_Status tiny_mem_copy(DI_Context* ctx, void* dst, const void* src, uint64_t bytes, int32_t kind_,
                               DI_Stream stream) {
    (void)stream;
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "mem_copy: ctx is NULL");
    if (kind_ < DI_COPY_HOST_TO_DEVICE || kind_ > DI_COPY_HOST_TO_HOST)
        return fail(ctx, DI_INVALID_ARGUMENT, "mem_copy: kind=%d is not a DI_CopyKind", kind_);
    if (bytes && (!dst || !src)) return fail(ctx, DI_INVALID_ARGUMENT, "mem_copy: NULL pointer");
    memmove(dst, src, bytes);
    return ok(ctx);
}

static DI_Status tiny_stream_synchronize(DI_Context* ctx, DI_Stream stream) {
    (void)stream;
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "stream_synchronize: ctx is NULL");
    return ok(ctx);
}

#ifdef TEST_GRAPHS
/* ------------------------------------------------------------------ streams and graphs */
static DI_Status tiny_stream_create(DI_Context* ctx, DI_Stream* out) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "stream_create: ctx is NULL");
    if (!out) return fail(ctx, DI_INVALID_ARGUMENT, "stream_create: out is NULL");
    *out = malloc(1);   /* a host library's stream is just a distinct handle */
    return *out ? ok(ctx) : fail(ctx, DI_RESOURCE_EXHAUSTED, "stream_create: out of memory");
}

static DI_Status tiny_stream_destroy(DI_Context* ctx, DI_Stream s) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "stream_destroy: ctx is NULL");
    free(s);
    return ok(ctx);
}

static DI_Status tiny_graph_begin(DI_Context* ctx, DI_Stream s) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "graph_begin: ctx is NULL");
    if (!s) return fail(ctx, DI_INVALID_ARGUMENT, "graph_begin: tiny captures created streams only, not NULL");
    if (ctx->capturing) return fail(ctx, DI_FAILED_PRECONDITION, "graph_begin: already capturing");
    ctx->capturing = s;
    ctx->n_rec = 0;
    return ok(ctx);
}

static DI_Status tiny_graph_end(DI_Context* ctx, DI_Stream s, DI_Graph** out) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "graph_end: ctx is NULL");
    if (!out) return fail(ctx, DI_INVALID_ARGUMENT, "graph_end: out is NULL");
    if (!ctx->capturing || s != ctx->capturing)
        return fail(ctx, DI_FAILED_PRECONDITION, "graph_end: this stream is not being captured");
    DI_Graph* g = (DI_Graph*)calloc(1, sizeof(DI_Graph));
    if (!g) return fail(ctx, DI_RESOURCE_EXHAUSTED, "graph_end: out of memory");
    g->ops = ctx->rec;
    g->n = ctx->n_rec;
    ctx->rec = NULL;
    ctx->n_rec = ctx->cap_rec = 0;
    ctx->capturing = NULL;
    *out = g;
    return ok(ctx);
}

static DI_Status tiny_graph_launch(DI_Context* ctx, DI_Graph* g, DI_Stream s) {
    (void)s;
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "graph_launch: ctx is NULL");
    if (!g) return fail(ctx, DI_INVALID_ARGUMENT, "graph_launch: graph is NULL");
#ifdef TEST_GRAPH_NOOP
    return ok(ctx);   /* a broken replay, for the suite's own tests */
#endif
    for (int i = 0; i < g->n; ++i) {
        Recorded* r = &g->ops[i];
        switch (r->op) {
        case DI_OP_ADD: elementwise(&r->args.binary.a, &r->args.binary.b, &r->args.binary.out, op_add); break;
        case DI_OP_MUL: elementwise(&r->args.binary.a, &r->args.binary.b, &r->args.binary.out, op_mul); break;
        case DI_OP_SILU_MUL: silu_mul_run(&r->args.silu_mul); break;
        case DI_OP_EMBEDDING: {
            DI_EmbeddingArgs a = r->args.embedding;
            a.header.stream = NULL;
            DI_Stream saved = ctx->capturing;
            ctx->capturing = NULL;
            DI_Status st = embedding_impl(ctx, &a, 0);
            ctx->capturing = saved;
            if (st) return st;
            break;
        }
        default: return fail(ctx, DI_INTERNAL, "graph_launch: corrupt graph");
        }
    }
    return ok(ctx);
}

static DI_Status tiny_graph_destroy(DI_Context* ctx, DI_Graph* g) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "graph_destroy: ctx is NULL");
    if (!g) return fail(ctx, DI_INVALID_ARGUMENT, "graph_destroy: graph is NULL");
    free(g->ops);
    free(g);
    return ok(ctx);
}
#endif

static DI_Status tiny_op_query(DI_Context* ctx, int32_t op, const void* args, DI_OpQuery* out) {
    if (!ctx) return fail(NULL, DI_INVALID_ARGUMENT, "op_query: ctx is NULL");
    if (!out) return fail(ctx, DI_INVALID_ARGUMENT, "op_query: out is NULL");
    DI_Status st = check_size(ctx, out, out->struct_size, sizeof(DI_OpQuery), "DI_OpQuery");
    if (st) return st;
    if (!args) return fail(ctx, DI_INVALID_ARGUMENT, "op_query: args is NULL");
    out->support = DI_SUPPORT_NO;
    out->workspace_size = 0;
    switch (op) {
    case DI_OP_ADD: case DI_OP_MUL: st = binary(ctx, (const DI_BinaryArgs*)args, "add", op_add, 1); break;
    case DI_OP_SILU_MUL: st = silu_mul_impl(ctx, (const DI_SiluMulArgs*)args, 1); break;
    case DI_OP_EMBEDDING: st = embedding_impl(ctx, (const DI_EmbeddingArgs*)args, 1); break;
#if defined(TEST_COMM) && DI_ABI_MINOR >= 4
    case DI_OP_ALL_REDUCE: st = all_reduce_impl(ctx, (const DI_AllReduceArgs*)args, 1); break;
    case DI_OP_ALL_GATHER: st = all_gather_impl(ctx, (const DI_AllGatherArgs*)args, 1); break;
    case DI_OP_ALL_TO_ALL: st = all_to_all_impl(ctx, (const DI_AllToAllArgs*)args, 1); break;
#endif
    default: return ok(ctx);   /* an op tiny lacks, or one newer than v1.0: NO */
    }
    if (st == DI_UNIMPLEMENTED) return ok(ctx);    /* well-formed but unsupported: NO */
    if (st) return st;
    out->support = DI_SUPPORT_YES;
    return ok(ctx);
}

/* ------------------------------------------------------------------ the table and the bootstrap */
static const DI_Api g_api = {
    .struct_size = sizeof(DI_Api),
    .abi_major = TEST_ABI_MAJOR,
    .abi_minor = DI_ABI_MINOR,
    .context_create = tiny_context_create,
    .context_destroy = tiny_context_destroy,
    .last_error = tiny_last_error,
    .get_attribute = tiny_get_attribute,
    .mem_alloc = tiny_mem_alloc,
    .mem_free = tiny_mem_free,
    .mem_copy = tiny_mem_copy,
    .stream_synchronize = tiny_stream_synchronize,
    .op_query = tiny_op_query,
#ifdef TEST_GRAPHS
    .stream_create = tiny_stream_create,
    .stream_destroy = tiny_stream_destroy,
    .graph_begin = tiny_graph_begin,
    .graph_end = tiny_graph_end,
    .graph_launch = tiny_graph_launch,
    .graph_destroy = tiny_graph_destroy,
#endif
    .embedding = tiny_embedding,
    .add = tiny_add,
    .mul = tiny_mul,
    .silu_mul = tiny_silu_mul,
#if defined(TEST_COMM) && DI_ABI_MINOR >= 4
    .all_reduce = tiny_all_reduce,
    .all_gather = tiny_all_gather,
    .all_to_all = tiny_all_to_all,
    .comm_unique_id = tiny_comm_unique_id,
#ifndef TEST_COMM_NO_CREATE
    .comm_create = tiny_comm_create,
#endif
    .comm_destroy = tiny_comm_destroy,
#endif
};

#ifdef TEST_API_GARBAGE
/* a valid header over function pointers that point nowhere (non-canonical addresses) */
static DI_Api g_garbage_api;

static const DI_Api* tiny_get_api(uint32_t major) {
    if (major != TEST_ABI_MAJOR)
        return NULL;
    memset(&g_garbage_api, 0x5a, sizeof g_garbage_api);
    g_garbage_api.struct_size = g_api.struct_size;
    g_garbage_api.abi_major = g_api.abi_major;
    g_garbage_api.abi_minor = g_api.abi_minor;
    return &g_garbage_api;
}
#else
static const DI_Api* tiny_get_api(uint32_t major) { return major == TEST_ABI_MAJOR ? &g_api : NULL; }
#endif

#ifdef TEST_SCORE
static int32_t tiny_score(void) {
#ifdef TEST_SCORE_REASON
    snprintf(g_error, sizeof(g_error), "%s", TEST_SCORE_REASON);
#endif
    return TEST_SCORE;
}
#endif

static const DI_PluginInfo g_info = {
    .struct_size = sizeof(DI_PluginInfo),
    .abi_major = TEST_ABI_MAJOR,
    .abi_minor = DI_ABI_MINOR,
    .name = TEST_NAME,
    .version = "0.0.1",
    .get_api = tiny_get_api,
#ifdef TEST_SCORE
    .score = tiny_score,
#endif
};

#ifdef TEST_CONSTRUCTOR_EXIT
__attribute__((constructor)) static void exit_on_load(void) { exit(3); }
#endif

#ifndef TEST_NO_BOOTSTRAP
DI_EXPORT const DI_PluginInfo* deepinfer_plugin_info(void) {
#if defined(TEST_BOOTSTRAP_SEGFAULT)
    raise(SIGSEGV);
#elif defined(TEST_BOOTSTRAP_WILD)
    return (const DI_PluginInfo*)(uintptr_t)0x10;   /* the first page is never mapped */
#elif defined(TEST_BOOTSTRAP_HANG)
    hang_forever();
#endif
    return &g_info;
}
#else
DI_EXPORT const DI_PluginInfo* some_other_symbol(void) { return &g_info; }
#endif
