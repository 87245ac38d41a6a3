/*
 * deepinfer CPU backend: libdeepinfer_cpu.so
 * ===========================================
 *
 * The sample plugin of the deepinfer kernel ABI (abi/deepinfer_abi.h, semantics in abi/README.md)
 * and the fast path on machines without a GPU. It is built against the ABI header alone and needs
 * nothing but libc, libm and pthreads (communicators of several ranks open Open MPI's libmpi at run
 * time, when one is created). To write a backend for another device, copy this folder, keep
 * plugin.c's bootstrap and validation, and replace the op bodies.
 *
 * Layout of src/
 *   plugin.c          this file: deepinfer_plugin_info, the DI_Api table, contexts, per-thread
 *                     errors, attributes, memory, streams, events and host memory (1.1), op_query,
 *                     and the argument checks every op shares.
 *   di_cpu.h          internal declarations (dtype ids, QMat view of quantized matrices, kernels).
 *   convert.c         dtype table and bit-exact scalar conversions (bf16, f16, e4m3, e2m1, e8m0).
 *   threadpool.c      persistent pthread pool; the caller thread is worker 0.
 *   op_rows.h         row views, per-worker scratch and task chunking the op files share.
 *   The ops, one file per op family (the families of backends/reference; abi/OPS.md lists every
 *   op's file):
 *   quant.c           quantize / dequantize ops and the QMat helpers the linear engine uses.
 *   linear.c          linear: one engine (lin_f32) for every weight format, plus the integer
 *                     W8A8 / W4A8 path for int8-quantized activations.
 *   norm.c            rmsnorm, layernorm.
 *   rope.c            rope.
 *   elementwise.c     embedding, add, mul, silu_mul, concat.
 *   attention.c       mla_cache_write, mla_prefill and mla_decode (dense, or V3.2's listed positions).
 *   moe.c             moe_router, and moe_experts on the linear engine.
 *   sampling.c        sample, spec_verify.
 *   hyper.c           hc_pre, hc_post (ABI 1.3: V4's hyper-connections).
 *   sparse.c          kv_compress, indexer_topk, sparse_attention (ABI 1.3: V4 / V3.2 sparse attention).
 *   dist.c            moe_dispatch and moe_combine (ABI 1.4): the local halves of expert parallelism.
 *   comm_mpi.c        communicators and the collectives all_reduce, all_gather, all_to_all (ABI 1.4) on
 *                     Open MPI, opened at run time (dlopen) only for a communicator of several ranks.
 *   kernels.c         run-time kernel selection (__builtin_cpu_supports) and the scalar kernels.
 *   kernels_avx2.c    AVX2+FMA kernels, kernels_avx512.c AVX-512 (+VNNI, +BF16) kernels, kernels_amx.c
 *                     AMX-INT8 tiles; all compiled
 *                     with GCC target attributes so one binary runs on any x86-64 (and the files
 *                     compile to nothing elsewhere).
 *   graph.c           graph capture: ops issued on a captured stream are recorded (args deep-copied)
 *                     and replayed natively by graph_launch, so a decode step is one call.
 *
 * Conventions
 *   - Dispatch (run_op) checks the header's struct_size rules and then every tensor argument against
 *     the header's op table (deepinfer_abi_check.h: presence, rank, dtype, the quant descriptor).
 *     Every op is `op_x(ctx, args, query)`: it adds its shape relations and what this library
 *     implements, and returns right after validation when query is 1, so op_query and the op share
 *     one set of checks. The op list, the dispatch table and the entry points come from DI_OPS.
 *   - Errors are per thread (ABI 1.1): last_error returns the calling thread's last message.
 *   - Math is f32; results are rounded to the output dtype once. Ops run synchronously on the
 *     calling thread (plus the pool), so a stream is a dummy handle and synchronize is a no-op.
 *   - Scratch memory comes from malloc (host memory is what a CPU workspace would be anyway), so
 *     op_query always reports workspace_size 0.
 *   - Validation cannot see buffer sizes (the ABI carries none): shapes and strides are trusted to
 *     describe memory the caller owns.
 *
 * Environment (for testing and tuning; nothing needs to be set)
 *   DEEPINFER_CPU_ISA=scalar|avx2|avx512|avx512vnni|amx   cap the kernels at that ISA level (test the fallbacks)
 *   DEEPINFER_CPU_SPIN=N            idle workers spin N iterations before sleeping (default 0)
 *   DEEPINFER_CPU_HOT_SPIN_US=N     during a graph replay, idle workers spin up to N us between ops (default 50)
 *   DEEPINFER_CPU_LINGER_US=N       after a graph replay, idle workers keep spinning N us (default 200)
 *   DEEPINFER_CPU_PAR_MIN=N         jobs below N multiply-adds run on the calling thread alone (default 65536)
 *   DEEPINFER_CPU_PROFILE=1         time every replayed graph node, per op, printed to stderr at exit
 *
 * Kernels by ISA level (kernels.c picks the best the CPU has, capped by DEEPINFER_CPU_ISA)
 *   scalar       portable C for everything
 *   avx2         AVX2/FMA row kernels and dot-product GEMM
 *   avx512       decode GEMV four rows at a time (f32/bf16/f16/int8/int4/fp8/fp4 decoded in registers,
 *                4-bit through a vpermps value table, the next rows prefetched), dot-product prefill
 *                GEMM on dequantized tiles, attention rows and softmax vectorized; bf16 weights
 *                on vdpbf16ps against x split exactly into three bf16 parts where AVX512-BF16 exists
 *   avx512vnni   W8A8 / W4A8 rows on vpdpbusd (weights offset to unsigned, corrected per lane)
 *   amx          W8A8 / W4A8 GEMM at 32 rows of x and more on AMX-INT8 tiles (kernels_amx.c)
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "deepinfer_abi_check.h"
#include "di_cpu.h"

/* the CPU backend's dtype ids are the ABI's (DI_DTypeId), so op-table dtype sets index them directly */
_Static_assert((int)DT_F32 == (int)DI_DT_F32 && (int)DT_BF16 == (int)DI_DT_BF16 && (int)DT_E2M1 == (int)DI_DT_E2M1 && (int)DT_I4 == (int)DI_DT_I4 &&
               (int)DT_U64 == (int)DI_DT_U64 && (int)DT_COUNT == (int)DI_DT_COUNT, "CPU dtype ids must equal DI_DTypeId");

#define CTX_MAGIC 0x44494350u    /* "DICP" */
#define STREAM_MAGIC 0x44495354u /* "DIST" */

/* ------------------------------------------------------------------ errors */
/* One message per thread (ABI 1.1): two threads using one context never overwrite each other's
 * message; last_error(ctx) returns the calling thread's last message, whatever the context. */
static _Thread_local char g_err[DI_ERR_LEN];

DI_Status di_fail(DI_Context* ctx, DI_Status status, const char* fmt, ...) {
    (void)ctx;
    char* buf = g_err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, DI_ERR_LEN, fmt, ap);
    va_end(ap);
    return status;
}

void di_clear(DI_Context* ctx) { (void)ctx; g_err[0] = 0; }

void* di_malloc(size_t n) { return malloc(n ? n : 1); }

static int ctx_ok(DI_Context* ctx) { return ctx && ctx->magic == CTX_MAGIC; }

static const char* api_last_error(DI_Context* ctx) { (void)ctx; return g_err; }

const char* di_last_error(void) { return g_err; }

/* ------------------------------------------------------------------ struct_size rules */
static DI_Status check_size(DI_Context* ctx, const char* what, const void* s, uint32_t given, uint32_t mine,
                            const char* struct_name) {
    if (given < mine)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: struct_size %u < %u for %s", what, given, mine, struct_name);
    const unsigned char* p = (const unsigned char*)s;
    for (uint32_t i = mine; i < given; i++)
        if (p[i])
            return di_fail(ctx, DI_UNIMPLEMENTED,
                           "%s: %s has struct_size %u and non-zero byte at offset %u; this library knows %u bytes "
                           "(a newer ABI field it cannot honour)", what, struct_name, given, i, mine);
    return DI_OK;
}

/* ------------------------------------------------------------------ tensor checks */
int tensor_present(const VC* v, const DI_Tensor* t) {
    /* In op_query data may be NULL for every tensor; an absent optional tensor is then all zero. */
    return t->data != NULL || (v->query && t->ndim > 0);
}

/*
 * By the time an op runs, run_op has checked every tensor argument against the header's op table
 * (di_check_op_args: presence, rank, device type, dtype set, strides, the whole quant descriptor).
 * What an op still checks here is what this library implements of it: a rank range, a dtype
 * subset, plain values where it decodes no quantized form, and the quantized storage it decodes.
 */
DI_Status check_tensor(VC* v, const DI_Tensor* t, const char* name, int nlo, int nhi, uint32_t dtmask,
                       int quant_ok) {
    DI_Context* c = v->ctx;
    if (t->ndim < nlo || t->ndim > nhi) {
        if (nlo == nhi)
            return di_fail(c, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d", v->op, name, t->ndim, nlo);
        return di_fail(c, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d..%d", v->op, name, t->ndim, nlo, nhi);
    }
    int dt = dt_id(t->dtype);
    if (!(dtmask & DTM(dt))) {
        char want[160];
        di_dts_names(dtmask, want, sizeof want);
        /* another float format where floats are taken is a format this op lacks (UNIMPLEMENTED);
         * anything else (an int where a float belongs, a float where ids belong) is malformed */
        int unimpl = (DI_DTS_ANY_FLOAT & DTM(dt)) && (DI_DTS_ANY_FLOAT & dtmask);
        return di_fail(c, unimpl ? DI_UNIMPLEMENTED : DI_INVALID_ARGUMENT, "%s: %s.dtype=%s is %s (takes %s)",
                       v->op, name, dt_name(dt), unimpl ? "not supported" : "not accepted", want);
    }
    if (t->quant) {
        if (!quant_ok)
            return di_fail(c, DI_UNIMPLEMENTED, "%s: %s carries a quantization descriptor; this argument takes "
                           "plain values only", v->op, name);
        /* the storage this library's kernels decode (the ABI also names e5m2; no kernel here reads it) */
        const uint32_t qdts = DTM(DT_I4) | DTM(DT_U4) | DTM(DT_I8) | DTM(DT_U8) | DTM(DT_E4M3) | DTM(DT_E2M1);
        if (!(qdts & DTM(dt)))
            return di_fail(c, DI_UNIMPLEMENTED, "%s: %s.quant: quantized storage dtype %s is not implemented",
                           v->op, name, dt_name(dt));
    }
    return DI_OK;
}

DI_Status check_same_shape(VC* v, const DI_Tensor* a, const char* an, const DI_Tensor* b, const char* bn) {
    if (a->ndim != b->ndim)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d != %s.ndim=%d", v->op, bn, b->ndim, an, a->ndim);
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld != %s.shape[%d]=%lld", v->op, bn, i,
                           (long long)b->shape[i], an, i, (long long)a->shape[i]);
    return DI_OK;
}

DI_Status check_dim(VC* v, const DI_Tensor* t, const char* name, int d, int64_t want) {
    if (t->shape[d] != want)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld, expected %lld", v->op, name, d,
                       (long long)t->shape[d], (long long)want);
    return DI_OK;
}

/* ------------------------------------------------------------------ contexts */
static int online_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)(n > 256 ? 256 : n) : 1;
}

static DI_Status api_context_create(const DI_ContextOptions* opt, DI_Context** out) {
    di_clear(NULL);
    if (!out) return di_fail(NULL, DI_INVALID_ARGUMENT, "context_create: out is NULL");
    *out = NULL;
    int nt = 0;
    if (opt) {
        DI_Status st = check_size(NULL, "context_create", opt, opt->struct_size, (uint32_t)sizeof(*opt),
                                  "DI_ContextOptions");
        if (st) return st;
        if (opt->ext) return di_fail(NULL, DI_UNIMPLEMENTED, "context_create: options.ext is set; none is known");
        if (opt->device_id != 0)
            return di_fail(NULL, DI_INVALID_ARGUMENT, "context_create: device_id=%d; the CPU backend has one "
                           "device (0)", opt->device_id);
        if (opt->num_threads < 0)
            return di_fail(NULL, DI_INVALID_ARGUMENT, "context_create: num_threads=%d is negative", opt->num_threads);
        nt = opt->num_threads;
    }
    if (nt == 0) nt = online_cpus();
    if (nt > 1024) nt = 1024;
    (void)kernels();  /* once per process: conversion tables and the kernel choice */
    DI_Context* c = calloc(1, sizeof(*c));
    if (!c) return di_fail(NULL, DI_RESOURCE_EXHAUSTED, "context_create: out of host memory");
    c->magic = CTX_MAGIC;
    c->pool = pool_create(nt);
    if (!c->pool) {
        free(c);
        return di_fail(NULL, DI_RESOURCE_EXHAUSTED, "context_create: cannot create the thread pool");
    }
    c->num_threads = pool_size(c->pool);
    *out = c;
    return DI_OK;
}

static DI_Status api_context_destroy(DI_Context* ctx) {
    if (!ctx) return di_fail(NULL, DI_INVALID_ARGUMENT, "context_destroy: ctx is NULL");
    if (!ctx_ok(ctx)) return di_fail(NULL, DI_INVALID_ARGUMENT, "context_destroy: not a live CPU context");
    ctx->magic = 0;
    graph_abandon(ctx);
    graph_profile_report();
    pool_destroy(ctx->pool);
    free(ctx);
    return DI_OK;
}

#define NEED_CTX(ctx, what)                                                                          \
    do {                                                                                             \
        if (!ctx_ok(ctx)) return di_fail(NULL, DI_INVALID_ARGUMENT, "%s: ctx is NULL or not a CPU " \
                                         "backend context", what);                                  \
        di_clear(ctx);                                                                               \
    } while (0)

/* ------------------------------------------------------------------ attributes */
static void cpu_model_name(char* buf, size_t n) {
    snprintf(buf, n, "cpu");
    FILE* f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char* p = strchr(line, ':');
            if (p) {
                p++;
                while (*p == ' ' || *p == '\t') p++;
                size_t l = strlen(p);
                while (l && (p[l - 1] == '\n' || p[l - 1] == ' ')) p[--l] = 0;
                if (l) snprintf(buf, n, "%s", p);
            }
            break;
        }
    }
    fclose(f);
}

/* MemAvailable of /proc/meminfo (what can be allocated without swapping), else free pages */
static long long mem_available(void) {
    FILE* f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        long long kb = -1;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
        fclose(f);
        if (kb >= 0) return kb * 1024;
    }
    return (long long)sysconf(_SC_AVPHYS_PAGES) * (long long)sysconf(_SC_PAGESIZE);
}

static DI_Status api_get_attribute(DI_Context* ctx, const char* key, char* buf, uint64_t size) {
    NEED_CTX(ctx, "get_attribute");
    if (!key) return di_fail(ctx, DI_INVALID_ARGUMENT, "get_attribute: key is NULL");
    if (!buf) return di_fail(ctx, DI_INVALID_ARGUMENT, "get_attribute: buf is NULL");
    char val[512];
    if (!strcmp(key, "name")) snprintf(val, sizeof val, "cpu");
    else if (!strcmp(key, "version")) snprintf(val, sizeof val, "%s", DI_CPU_VERSION);
    else if (!strcmp(key, "abi.version")) snprintf(val, sizeof val, "%d.%d", DI_ABI_MAJOR, DI_ABI_MINOR);
    else if (!strcmp(key, "device.name")) cpu_model_name(val, sizeof val);
    else if (!strcmp(key, "device.arch")) snprintf(val, sizeof val, "%s", kernels()->name);
    else if (!strcmp(key, "cpu.features")) snprintf(val, sizeof val, "%s", cpu_features());
    else if (!strcmp(key, "threads")) snprintf(val, sizeof val, "%d", ctx->num_threads);
    else if (!strcmp(key, "device.memory_bytes") || !strcmp(key, "device.memory_total_bytes"))
        snprintf(val, sizeof val, "%lld", (long long)sysconf(_SC_PHYS_PAGES) * (long long)sysconf(_SC_PAGESIZE));
    else if (!strcmp(key, "device.memory_free_bytes")) snprintf(val, sizeof val, "%lld", mem_available());
    else return di_fail(ctx, DI_UNIMPLEMENTED, "get_attribute: unknown key '%s'", key);
    size_t l = strlen(val);
    if (size < l + 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "get_attribute: buffer of %llu bytes is too small for '%s' "
                       "(%zu needed)", (unsigned long long)size, key, l + 1);
    memcpy(buf, val, l + 1);
    return DI_OK;
}

/* ------------------------------------------------------------------ memory and streams */
static DI_Status api_mem_alloc(DI_Context* ctx, uint64_t bytes, void** out) {
    NEED_CTX(ctx, "mem_alloc");
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "mem_alloc: out is NULL");
    *out = NULL;
    /* Linux overcommits, so refuse what cannot possibly be backed instead of failing later. */
    long long phys = (long long)sysconf(_SC_PHYS_PAGES) * (long long)sysconf(_SC_PAGESIZE);
    if (bytes > ((uint64_t)1 << 56) || (phys > 0 && bytes > (uint64_t)phys))
        return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "mem_alloc: %llu bytes exceed the host memory (%lld bytes)",
                       (unsigned long long)bytes, phys);
    size_t n = bytes ? (size_t)((bytes + 255) & ~(uint64_t)255) : 256;
    /* weights stream through GEMV once per token: huge pages keep the hardware prefetcher going
     * across 4 KiB boundaries (measured ~3x on this backend's GEMV), so big buffers get them */
    size_t align = n >= ((size_t)4 << 20) ? ((size_t)2 << 20) : 256;
    void* p = NULL;
    if (posix_memalign(&p, align, n) != 0 || !p)
        return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "mem_alloc: cannot allocate %llu bytes of host memory",
                       (unsigned long long)bytes);
#ifdef MADV_HUGEPAGE
    if (align > 256) madvise(p, n & ~(((size_t)2 << 20) - 1), MADV_HUGEPAGE);
#endif
    *out = p;
    return DI_OK;
}

static DI_Status api_mem_free(DI_Context* ctx, void* ptr) {
    NEED_CTX(ctx, "mem_free");
    free(ptr);
    return DI_OK;
}

static DI_Status api_mem_copy(DI_Context* ctx, void* dst, const void* src, uint64_t bytes, int32_t kind,
                              DI_Stream stream) {
    NEED_CTX(ctx, "mem_copy");
    if (kind < DI_COPY_HOST_TO_DEVICE || kind > DI_COPY_HOST_TO_HOST)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mem_copy: kind=%d is not a DI_CopyKind", kind);
    if (bytes == 0) return DI_OK;
    if (!dst || !src)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "mem_copy: %s is NULL with %llu bytes to copy", dst ? "src" : "dst",
                       (unsigned long long)bytes);
    if (graph_capturing(ctx, stream)) return graph_capture_copy(ctx, dst, src, bytes);
    memmove(dst, src, (size_t)bytes);
    return DI_OK;
}

typedef struct { uint32_t magic; } CpuStream;

static DI_Status api_stream_create(DI_Context* ctx, DI_Stream* out) {
    NEED_CTX(ctx, "stream_create");
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "stream_create: out is NULL");
    CpuStream* s = malloc(sizeof *s);
    if (!s) return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "stream_create: out of host memory");
    s->magic = STREAM_MAGIC;
    *out = s;
    return DI_OK;
}

static DI_Status api_stream_destroy(DI_Context* ctx, DI_Stream stream) {
    NEED_CTX(ctx, "stream_destroy");
    if (!stream) return DI_OK;  /* the default stream is never destroyed */
    CpuStream* s = (CpuStream*)stream;
    if (s->magic != STREAM_MAGIC)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "stream_destroy: not a stream of this library");
    s->magic = 0;
    free(s);
    return DI_OK;
}

static DI_Status api_stream_synchronize(DI_Context* ctx, DI_Stream stream) {
    NEED_CTX(ctx, "stream_synchronize");
    (void)stream;  /* every op has finished when it returns */
    return DI_OK;
}

/* ------------------------------------------------------------------ events, host memory (ABI 1.1) */
/* Every op and copy has finished when it returns, so an event is reached the moment it is recorded
 * and waiting on one never blocks. The handles still exist and are checked, so that code written
 * against a device library runs unchanged (and its mistakes are caught) here. */
#define EVENT_MAGIC 0x44494556u /* "DIEV" */
typedef struct { uint32_t magic; int recorded; } CpuEvent;

static DI_Status need_event(DI_Context* ctx, DI_Event e, const char* what, CpuEvent** out) {
    CpuEvent* ev = (CpuEvent*)e;
    if (!ev || ev->magic != EVENT_MAGIC)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: event is NULL or not a live event of this library", what);
    *out = ev;
    return DI_OK;
}

static DI_Status need_stream(DI_Context* ctx, DI_Stream s, const char* what) {
    if (s && ((CpuStream*)s)->magic != STREAM_MAGIC)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: not a stream of this library", what);
    return DI_OK;
}

static DI_Status api_event_create(DI_Context* ctx, DI_Event* out) {
    NEED_CTX(ctx, "event_create");
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "event_create: out is NULL");
    CpuEvent* e = malloc(sizeof *e);
    if (!e) return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "event_create: out of host memory");
    e->magic = EVENT_MAGIC;
    e->recorded = 0;
    *out = e;
    return DI_OK;
}

static DI_Status api_event_destroy(DI_Context* ctx, DI_Event event) {
    NEED_CTX(ctx, "event_destroy");
    CpuEvent* e = NULL;
    DI_Status st = need_event(ctx, event, "event_destroy", &e);
    if (st) return st;
    e->magic = 0;
    free(e);
    return DI_OK;
}

static DI_Status api_event_record(DI_Context* ctx, DI_Event event, DI_Stream stream) {
    NEED_CTX(ctx, "event_record");
    CpuEvent* e = NULL;
    DI_Status st = need_event(ctx, event, "event_record", &e);
    if (!st) st = need_stream(ctx, stream, "event_record");
    if (st) return st;
    e->recorded = 1;
    return DI_OK;
}

static DI_Status api_stream_wait_event(DI_Context* ctx, DI_Stream stream, DI_Event event) {
    NEED_CTX(ctx, "stream_wait_event");
    CpuEvent* e = NULL;
    DI_Status st = need_event(ctx, event, "stream_wait_event", &e);
    if (!st) st = need_stream(ctx, stream, "stream_wait_event");
    return st;
}

static DI_Status api_event_query(DI_Context* ctx, DI_Event event, int32_t* done) {
    NEED_CTX(ctx, "event_query");
    if (!done) return di_fail(ctx, DI_INVALID_ARGUMENT, "event_query: done is NULL");
    CpuEvent* e = NULL;
    DI_Status st = need_event(ctx, event, "event_query", &e);
    if (st) return st;
    *done = 1;  /* recorded work is finished; an event never recorded counts as reached (CUDA's rule) */
    return DI_OK;
}

static DI_Status api_event_synchronize(DI_Context* ctx, DI_Event event) {
    NEED_CTX(ctx, "event_synchronize");
    CpuEvent* e = NULL;
    return need_event(ctx, event, "event_synchronize", &e);
}

/* Host memory is what this library allocates anyway; host_alloc is mem_alloc. Registrations are
 * kept so that unregistering a range that was never registered is the error it is on a GPU. */
#define MAX_REGISTERED 4096
static struct { void* ptr; uint64_t bytes; } g_reg[MAX_REGISTERED];
static int g_nreg;
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;

static DI_Status api_host_alloc(DI_Context* ctx, uint64_t bytes, void** out) { return api_mem_alloc(ctx, bytes, out); }
static DI_Status api_host_free(DI_Context* ctx, void* ptr) { return api_mem_free(ctx, ptr); }

static DI_Status api_host_register(DI_Context* ctx, void* ptr, uint64_t bytes) {
    NEED_CTX(ctx, "host_register");
    if (!ptr || !bytes) return di_fail(ctx, DI_INVALID_ARGUMENT, "host_register: %s", ptr ? "0 bytes" : "ptr is NULL");
    DI_Status st = DI_OK;
    pthread_mutex_lock(&g_reg_lock);
    for (int i = 0; i < g_nreg; i++) {
        char* a = (char*)g_reg[i].ptr;
        if ((char*)ptr < a + g_reg[i].bytes && a < (char*)ptr + bytes) {
            st = di_fail(ctx, DI_INVALID_ARGUMENT, "host_register: [%p, +%llu) overlaps a registered range", ptr,
                         (unsigned long long)bytes);
            break;
        }
    }
    if (!st && g_nreg == MAX_REGISTERED)
        st = di_fail(ctx, DI_RESOURCE_EXHAUSTED, "host_register: %d ranges are registered already", MAX_REGISTERED);
    if (!st) {
        g_reg[g_nreg].ptr = ptr;
        g_reg[g_nreg].bytes = bytes;
        g_nreg++;
    }
    pthread_mutex_unlock(&g_reg_lock);
    return st;
}

static DI_Status api_host_unregister(DI_Context* ctx, void* ptr) {
    NEED_CTX(ctx, "host_unregister");
    int found = 0;
    pthread_mutex_lock(&g_reg_lock);
    for (int i = 0; i < g_nreg; i++)
        if (g_reg[i].ptr == ptr) {
            g_reg[i] = g_reg[--g_nreg];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g_reg_lock);
    if (!found) return di_fail(ctx, DI_INVALID_ARGUMENT, "host_unregister: %p was not registered", ptr);
    return DI_OK;
}

static DI_Status api_mem_copy_async(DI_Context* ctx, void* dst, const void* src, uint64_t bytes, int32_t kind,
                                    DI_Stream stream) {
    NEED_CTX(ctx, "mem_copy_async");
    DI_Status st = need_stream(ctx, stream, "mem_copy_async");
    if (st) return st;
    return api_mem_copy(ctx, dst, src, bytes, kind, stream);   /* recorded when the stream is captured */
}

static DI_Status api_device_count(int32_t* out) {
    di_clear(NULL);
    if (!out) return di_fail(NULL, DI_INVALID_ARGUMENT, "device_count: out is NULL");
    *out = 1;
    return DI_OK;
}

/* ------------------------------------------------------------------ op dispatch */
/* One row per op of the header's op table (DI_OPS): its name and body (args struct sizes are
 * di_check_args_size's, from the same table). */
typedef DI_Status (*op_impl)(DI_Context*, const void*, int);
static const struct { const char* name; op_impl fn; } k_ops[DI_OP_COUNT_V1_6] = {
#define E(id, name, T, minor) [id] = {#name, (op_impl)op_##name},
    DI_OPS(E)
#undef E
};

/* room for any op's args struct as this header has it */
typedef union {
#define U(id, name, T, minor) T name;
    DI_OPS(U)
#undef U
} AnyArgs;

/* The caller's args struct as this header's: struct_size checked (DI_ARGS_SINCE: an older caller's
 * smaller struct is fine) and the fields it does not know zeroed, so the op bodies never look at
 * struct_size and never read past the caller's bytes. */
static DI_Status normalize_args(DI_Context* ctx, int op, const void* args, AnyArgs* local) {
    DI_Status st = di_check_args_size(op, args, local, g_err, sizeof g_err);
    if (st) return st;
    if (((const DI_ArgsHeader*)args)->ext)
        return di_fail(ctx, DI_UNIMPLEMENTED, "%s: header.ext is set; no extensions are known", k_ops[op].name);
    return DI_OK;
}

DI_Status di_run_op(DI_Context* ctx, int op, const void* args, int query) {
    const char* name = k_ops[op].name;
    if (!ctx_ok(ctx)) return di_fail(NULL, DI_INVALID_ARGUMENT, "%s: ctx is NULL or not a CPU backend context", name);
    di_clear(ctx);
    if (!args) return di_fail(ctx, DI_INVALID_ARGUMENT, "%s: args is NULL", name);
    AnyArgs local;
    DI_Status st = normalize_args(ctx, op, args, &local);
    if (st) return st;
    /* every tensor argument against the op table first: the op bodies add the shape relations */
    st = di_check_op_args(op, &local, DI_DEVICE_CPU, query, 0, g_err, sizeof g_err);
    if (st) return st;
    return k_ops[op].fn(ctx, &local, query);
}

static DI_Status api_op_query(DI_Context* ctx, int32_t op, const void* args, DI_OpQuery* out) {
    NEED_CTX(ctx, "op_query");
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "op_query: out is NULL");
    DI_Status st = check_size(ctx, "op_query", out, out->struct_size, (uint32_t)sizeof(DI_OpQuery), "DI_OpQuery");
    if (st) return st;
    out->support = DI_SUPPORT_NO;
    out->workspace_size = 0;
    if (op < 0 || op >= DI_OP_COUNT_V1_6) {
        di_fail(ctx, DI_OK, "op_query: op %d is not an op of ABI 1.%d", op, DI_ABI_MINOR);
        return DI_OK;
    }
    if (!args) return di_fail(ctx, DI_INVALID_ARGUMENT, "op_query(%s): args is NULL", k_ops[op].name);
    st = di_run_op(ctx, op, args, 1);
    if (st == DI_UNIMPLEMENTED) return DI_OK;  /* well-formed but unsupported: NO, with the reason kept */
    if (st == DI_QUERY_SLOW) {
        out->support = DI_SUPPORT_SLOW;
        return DI_OK;
    }
    if (st) return st;
    out->support = DI_SUPPORT_YES;
    return DI_OK;
}

/* an op issued on a stream being captured is checked and recorded instead of run (graph.c) */
#define WRAP(id, name, T, minor)                                                                   \
    static DI_Status api_##name(DI_Context* ctx, const T* args) {                                \
        if (ctx_ok(ctx) && ctx->capture && args && graph_capturing(ctx, args->header.stream)) {  \
            di_clear(ctx);                                                                       \
            AnyArgs local;  /* the node records this header's struct, unknown fields zeroed */   \
            DI_Status st = normalize_args(ctx, id, args, &local);                                \
            return st ? st : graph_capture_op(ctx, id, &local, (uint32_t)sizeof(T));             \
        }                                                                                        \
        return di_run_op(ctx, id, args, 0);                                                      \
    }
DI_OPS(WRAP)
#undef WRAP

/* ------------------------------------------------------------------ graph entries */
static DI_Status api_graph_begin(DI_Context* ctx, DI_Stream stream) {
    NEED_CTX(ctx, "graph_begin");
    DI_Status st = need_stream(ctx, stream, "graph_begin");
    return st ? st : graph_begin(ctx, stream);
}

static DI_Status api_graph_end(DI_Context* ctx, DI_Stream stream, DI_Graph** out) {
    NEED_CTX(ctx, "graph_end");
    return graph_end(ctx, stream, out);
}

static DI_Status api_graph_launch(DI_Context* ctx, DI_Graph* graph, DI_Stream stream) {
    NEED_CTX(ctx, "graph_launch");
    DI_Status st = need_stream(ctx, stream, "graph_launch");
    return st ? st : graph_launch(ctx, graph, stream);
}

static DI_Status api_graph_destroy(DI_Context* ctx, DI_Graph* graph) {
    NEED_CTX(ctx, "graph_destroy");
    return graph_destroy(ctx, graph);
}

/* ------------------------------------------------------------------ communicators (ABI 1.4, comm_mpi.c) */
static DI_Status api_comm_unique_id(DI_Context* ctx, DI_CommId* out) {
    NEED_CTX(ctx, "comm_unique_id");
    return comm_unique_id(ctx, out);
}

static DI_Status api_comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out) {
    NEED_CTX(ctx, "comm_create");
    return comm_create(ctx, id, nranks, rank, out);
}

static DI_Status api_comm_destroy(DI_Context* ctx, DI_Comm* comm) {
    NEED_CTX(ctx, "comm_destroy");
    return comm_destroy(ctx, comm);
}

/* ------------------------------------------------------------------ the tables */
static const DI_Api k_api = {
    .struct_size = sizeof(DI_Api),
    .abi_major = DI_ABI_MAJOR,
    .abi_minor = DI_ABI_MINOR,
    .context_create = api_context_create,
    .context_destroy = api_context_destroy,
    .last_error = api_last_error,
    .get_attribute = api_get_attribute,
    .mem_alloc = api_mem_alloc,
    .mem_free = api_mem_free,
    .mem_copy = api_mem_copy,
    .stream_create = api_stream_create,
    .stream_destroy = api_stream_destroy,
    .stream_synchronize = api_stream_synchronize,
    .op_query = api_op_query,
    .graph_begin = api_graph_begin,
    .graph_end = api_graph_end,
    .graph_launch = api_graph_launch,
    .graph_destroy = api_graph_destroy,
    .embedding = api_embedding,
    .rmsnorm = api_rmsnorm,
    .linear = api_linear,
    .quantize = api_quantize,
    .dequantize = api_dequantize,
    .rope = api_rope,
    .mla_cache_write = api_mla_cache_write,
    .mla_prefill = api_mla_prefill,
    .mla_decode = api_mla_decode,
    .moe_router = api_moe_router,
    .moe_experts = api_moe_experts,
    .add = api_add,
    .mul = api_mul,
    .silu_mul = api_silu_mul,
    .concat = api_concat,
    .sample = api_sample,
    .event_create = api_event_create,
    .event_destroy = api_event_destroy,
    .event_record = api_event_record,
    .stream_wait_event = api_stream_wait_event,
    .event_query = api_event_query,
    .event_synchronize = api_event_synchronize,
    .host_alloc = api_host_alloc,
    .host_free = api_host_free,
    .host_register = api_host_register,
    .host_unregister = api_host_unregister,
    .mem_copy_async = api_mem_copy_async,
    .device_count = api_device_count,
    .spec_verify = api_spec_verify,
    .hc_pre = api_hc_pre,
    .hc_post = api_hc_post,
    .kv_compress = api_kv_compress,
    .indexer_topk = api_indexer_topk,
    .sparse_attention = api_sparse_attention,
    .layernorm = api_layernorm,
    .all_reduce = api_all_reduce,
    .all_gather = api_all_gather,
    .all_to_all = api_all_to_all,
    .moe_dispatch = api_moe_dispatch,
    .moe_combine = api_moe_combine,
    .mla_rope_cache_write = api_mla_rope_cache_write,
    .comm_unique_id = api_comm_unique_id,
    .comm_create = api_comm_create,
    .comm_destroy = api_comm_destroy,
};

static const DI_Api* get_api(uint32_t major) { return major == DI_ABI_MAJOR ? &k_api : NULL; }

static int32_t score(void) { return 10; }

static const DI_PluginInfo k_info = {
    .struct_size = sizeof(DI_PluginInfo),
    .abi_major = DI_ABI_MAJOR,
    .abi_minor = DI_ABI_MINOR,
    .name = "cpu",
    .version = DI_CPU_VERSION,
    .get_api = get_api,
    .score = score,
};

DI_EXPORT const DI_PluginInfo* deepinfer_plugin_info(void) { return &k_info; }
