// The exported surface: deepinfer_plugin_info, the DI_Api table, contexts, memory, streams,
// graphs, attributes and op_query. Every entry point catches everything: nothing crosses the ABI.
#include <stdio.h>

#include <new>

#include "common.cuh"
#include "deepinfer_abi_check.h"
#include "dist_api.cuh"

using namespace di;

namespace di {
const char* global_error();
}

struct DI_Graph {
    cudaGraph_t     graph;
    cudaGraphExec_t exec;
};

#define DI_GUARD_BEGIN try {
#define DI_GUARD_END(ctx)                                                                      \
    }                                                                                          \
    catch (const std::bad_alloc&) {                                                            \
        return set_error(ctx, DI_RESOURCE_EXHAUSTED, "host out of memory");                    \
    }                                                                                          \
    catch (...) {                                                                              \
        return set_error(ctx, DI_INTERNAL, "unexpected C++ exception inside the " DI_GPU_LIB_NAME " backend"); \
    }

#define NEED_CTX(ctx, fn)                                                                     \
    do {                                                                                      \
        if (!(ctx)) return set_error(nullptr, DI_INVALID_ARGUMENT, "%s: ctx is NULL", fn);    \
        clear_error(ctx);                                                                     \
    } while (0)

// ---------------------------------------------------------------------------------------- contexts
static DI_Status context_create(const DI_ContextOptions* o, DI_Context** out) {
    DI_GUARD_BEGIN
    clear_error(nullptr);
    if (!out) return set_error(nullptr, DI_INVALID_ARGUMENT, "context_create: out is NULL");
    *out = nullptr;
    DI_TRY(check_sized(nullptr, "context_create", o, sizeof(DI_ContextOptions), "DI_ContextOptions", true));
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return set_error(nullptr, DI_FAILED_PRECONDITION, "context_create: no " DI_GPU_RUNTIME " device usable: %s",
                         cudaGetErrorString(e));
    }
    if (o->device_id < 0 || o->device_id >= n)
        return set_error(nullptr, DI_INVALID_ARGUMENT, "context_create: device_id=%d but %d " DI_GPU_RUNTIME " device(s) exist",
                         o->device_id, n);
    if (o->num_threads < 0)
        return set_error(nullptr, DI_INVALID_ARGUMENT, "context_create: num_threads=%d is negative", o->num_threads);
    DI_Context* c = new (std::nothrow) DI_Context();
    if (!c) return set_error(nullptr, DI_RESOURCE_EXHAUSTED, "context_create: host out of memory");
    c->device = o->device_id;
    DI_Status st = cuda_status(nullptr, cudaSetDevice(c->device), "context_create: cudaSetDevice");
    if (st == DI_OK) st = cuda_status(nullptr, cudaGetDeviceProperties(&c->prop, c->device), "context_create");
    if (st != DI_OK) {
        delete c;
        return st;
    }
    c->sm_count = c->prop.multiProcessorCount;
    *out = c;
    return DI_OK;
    DI_GUARD_END(nullptr)
}

static DI_Status context_destroy(DI_Context* ctx) {
    if (!ctx) return set_error(nullptr, DI_INVALID_ARGUMENT, "context_destroy: ctx is NULL");
    delete ctx;
    return DI_OK;
}

// One message per thread (ABI 1.1), whatever the context: two threads never see each other's.
static const char* last_error(DI_Context* ctx) {
    (void)ctx;
    return global_error();
}

static DI_Status put_str(DI_Context* ctx, const char* key, const char* v, char* buf, uint64_t size) {
    size_t n = strlen(v);
    if (!buf || size < n + 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "get_attribute(%s): buffer of %llu bytes, need %zu", key,
                         (unsigned long long)size, n + 1);
    memcpy(buf, v, n + 1);
    return DI_OK;
}

static DI_Status get_attribute(DI_Context* ctx, const char* key, char* buf, uint64_t size) {
    DI_GUARD_BEGIN
    clear_error(ctx);
    if (!key) return set_error(ctx, DI_INVALID_ARGUMENT, "get_attribute: key is NULL");
    char tmp[256];
    if (!strcmp(key, "name")) return put_str(ctx, key, DI_GPU_LIB_NAME, buf, size);
    if (!strcmp(key, "device.type")) return put_str(ctx, key, DI_GPU_DEVICE_TYPE, buf, size);
    if (!strcmp(key, "version")) return put_str(ctx, key, DI_CUDA_VERSION, buf, size);
    if (!strcmp(key, "abi.version")) {
        snprintf(tmp, sizeof(tmp), "%d.%d", DI_ABI_MAJOR, DI_ABI_MINOR);
        return put_str(ctx, key, tmp, buf, size);
    }
    bool device_key = !strcmp(key, "device.name") || !strcmp(key, "device.sm_count") ||
                      !strcmp(key, "device.memory_bytes") || !strcmp(key, "device.arch") ||
                      !strcmp(key, "device.memory_free_bytes") || !strcmp(key, "device.memory_total_bytes");
    if (!device_key) return set_error(ctx, DI_UNIMPLEMENTED, "get_attribute: unknown key '%s'", key);
    if (!ctx) return set_error(nullptr, DI_INVALID_ARGUMENT, "get_attribute(%s): needs a context", key);
    if (!strcmp(key, "device.name")) return put_str(ctx, key, ctx->prop.name, buf, size);
    if (!strcmp(key, "device.sm_count")) snprintf(tmp, sizeof(tmp), "%d", ctx->sm_count);
    else if (!strcmp(key, "device.memory_bytes")) snprintf(tmp, sizeof(tmp), "%zu", ctx->prop.totalGlobalMem);
    else if (!strcmp(key, "device.memory_free_bytes") || !strcmp(key, "device.memory_total_bytes")) {
        DI_TRY(use_device(ctx));
        size_t fr = 0, tot = 0;
        DI_TRY(cuda_status(ctx, cudaMemGetInfo(&fr, &tot), "get_attribute: cudaMemGetInfo"));
        snprintf(tmp, sizeof(tmp), "%zu", !strcmp(key, "device.memory_free_bytes") ? fr : tot);
    }
#if DI_GPU_AMD
    else snprintf(tmp, sizeof(tmp), "%s", ctx->prop.gcnArchName);  // e.g. gfx90a:sramecc+:xnack-
#else
    else snprintf(tmp, sizeof(tmp), "sm_%d%d", ctx->prop.major, ctx->prop.minor);
#endif
    return put_str(ctx, key, tmp, buf, size);
    DI_GUARD_END(ctx)
}

// ---------------------------------------------------------------------------------------- memory
static DI_Status mem_alloc(DI_Context* ctx, uint64_t bytes, void** out) {
    NEED_CTX(ctx, "mem_alloc");
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "mem_alloc: out is NULL");
    *out = nullptr;
    DI_TRY(use_device(ctx));
    // cudaMalloc is 256-byte aligned; a zero-byte request still gets a distinct pointer
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 256);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (e == cudaErrorMemoryAllocation) {
            size_t fr = 0, tot = 0;
            (void)cudaMemGetInfo(&fr, &tot);
            (void)cudaGetLastError();
            return set_error(ctx, DI_RESOURCE_EXHAUSTED,
                             "mem_alloc: out of device memory allocating %llu bytes (%zu of %zu free)",
                             (unsigned long long)bytes, fr, tot);
        }
        return cuda_status(ctx, e, "mem_alloc: cudaMalloc");
    }
    *out = p;
    return DI_OK;
}

static DI_Status mem_free(DI_Context* ctx, void* ptr) {
    NEED_CTX(ctx, "mem_free");
    if (!ptr) return DI_OK;
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaFree(ptr), "mem_free: cudaFree");
}

static DI_Status mem_copy(DI_Context* ctx, void* dst, const void* src, uint64_t bytes, int32_t kind,
                          DI_Stream stream) {
    NEED_CTX(ctx, "mem_copy");
    if (bytes == 0) return DI_OK;
    if (!dst || !src) return set_error(ctx, DI_INVALID_ARGUMENT, "mem_copy: %s is NULL", dst ? "src" : "dst");
    cudaMemcpyKind k;
    switch (kind) {
        case DI_COPY_HOST_TO_DEVICE: k = cudaMemcpyHostToDevice; break;
        case DI_COPY_DEVICE_TO_HOST: k = cudaMemcpyDeviceToHost; break;
        case DI_COPY_DEVICE_TO_DEVICE: k = cudaMemcpyDeviceToDevice; break;
        case DI_COPY_HOST_TO_HOST: memmove(dst, src, bytes); return DI_OK;
        default: return set_error(ctx, DI_INVALID_ARGUMENT, "mem_copy: unknown kind %d", kind);
    }
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaMemcpyAsync(dst, src, bytes, k, static_cast<cudaStream_t>(stream)),
                       "mem_copy: cudaMemcpyAsync");
}

static DI_Status stream_create(DI_Context* ctx, DI_Stream* out) {
    NEED_CTX(ctx, "stream_create");
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "stream_create: out is NULL");
    DI_TRY(use_device(ctx));
    cudaStream_t s = nullptr;
    DI_TRY(cuda_status(ctx, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream_create"));
    *out = s;
    return DI_OK;
}

static DI_Status stream_destroy(DI_Context* ctx, DI_Stream stream) {
    NEED_CTX(ctx, "stream_destroy");
    if (!stream) return DI_OK;  // the default stream is not ours to destroy
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "stream_destroy");
}

static DI_Status stream_synchronize(DI_Context* ctx, DI_Stream stream) {
    NEED_CTX(ctx, "stream_synchronize");
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "stream_synchronize");
}

// ---------------------------------------------------------------------------------------- graphs
static DI_Status graph_begin(DI_Context* ctx, DI_Stream stream) {
    NEED_CTX(ctx, "graph_begin");
    if (!stream)
        return set_error(ctx, DI_INVALID_ARGUMENT, "graph_begin: the default stream cannot be captured; use stream_create");
    DI_TRY(use_device(ctx));
    // relaxed: the ops may use stream-ordered allocation for workspaces while capturing
    return cuda_status(ctx, cudaStreamBeginCapture(static_cast<cudaStream_t>(stream), cudaStreamCaptureModeRelaxed),
                       "graph_begin: cudaStreamBeginCapture");
}

static DI_Status graph_end(DI_Context* ctx, DI_Stream stream, DI_Graph** out) {
    NEED_CTX(ctx, "graph_end");
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "graph_end: out is NULL");
    *out = nullptr;
    DI_TRY(use_device(ctx));
    cudaGraph_t g = nullptr;
    DI_TRY(cuda_status(ctx, cudaStreamEndCapture(static_cast<cudaStream_t>(stream), &g),
                       "graph_end: cudaStreamEndCapture"));
    cudaGraphExec_t ex = nullptr;
    DI_Status st = cuda_status(ctx, cudaGraphInstantiate(&ex, g, 0), "graph_end: cudaGraphInstantiate");
    if (st != DI_OK) {
        (void)cudaGraphDestroy(g);
        return st;
    }
    DI_Graph* G = new (std::nothrow) DI_Graph{g, ex};
    if (!G) {
        (void)cudaGraphExecDestroy(ex);
        (void)cudaGraphDestroy(g);
        return set_error(ctx, DI_RESOURCE_EXHAUSTED, "graph_end: host out of memory");
    }
    *out = G;
    return DI_OK;
}

static DI_Status graph_launch(DI_Context* ctx, DI_Graph* g, DI_Stream stream) {
    NEED_CTX(ctx, "graph_launch");
    if (!g) return set_error(ctx, DI_INVALID_ARGUMENT, "graph_launch: graph is NULL");
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaGraphLaunch(g->exec, static_cast<cudaStream_t>(stream)), "graph_launch");
}

static DI_Status graph_destroy(DI_Context* ctx, DI_Graph* g) {
    NEED_CTX(ctx, "graph_destroy");
    if (!g) return set_error(ctx, DI_INVALID_ARGUMENT, "graph_destroy: graph is NULL");
    DI_TRY(use_device(ctx));
    (void)cudaGraphExecDestroy(g->exec);
    (void)cudaGraphDestroy(g->graph);
    delete g;
    return DI_OK;
}

// ---------------------------------------------------------------------------------------- ops
// Every tensor argument is first checked against the header's op table (deepinfer_abi_check.h); the
// op's own function then adds its shape rules and what this library implements. moe_experts checks
// its per-expert descriptor arrays itself (take_expert), once per expert, with names formatted lazily.
static DI_Status check_args(DI_Context* ctx, int32_t op, const void* a, bool query) {
    const DI_OpInfo* info = di_op_info(op);
    DI_TRY(check_header(ctx, info->name, a, info->struct_size, info->struct_name));
    char msg[512];
    DI_Status st = di_check_op_args(op, a, DI_GPU_DEVICE, query ? 1 : 0, DI_CHECK_SKIP_ARRAYS, msg, sizeof(msg));
    if (st != DI_OK) return set_error(ctx, st, "%s", msg);
    return DI_OK;
}

// room for any op's args struct as this header has it
union AnyArgs {
#define U(id, name, Args, minor) Args name;
    DI_OPS(U)
#undef U
};

// The caller's args struct as this header's (abi/README.md section 2, DI_ARGS_SINCE): an older
// caller's smaller struct_size is accepted and the fields it does not know are zeroed (absent), so
// the ops read only what the caller wrote and never look past its struct.
static DI_Status normalize_args(DI_Context* ctx, int32_t op, const void* a, AnyArgs* local) {
    char msg[512];
    DI_Status st = di_check_args_size(op, a, local, msg, sizeof(msg));
    if (st != DI_OK) return set_error(ctx, st, "%s", msg);
    return DI_OK;
}

// Each op entry: context and device checks, the table check, then the shared implementation.
#define DI_OP_ENTRY(id, name, Args, minor)                                          \
    static DI_Status api_##name(DI_Context* ctx, const Args* a) {                   \
        NEED_CTX(ctx, #name);                                                       \
        if (!a) return set_error(ctx, DI_INVALID_ARGUMENT, #name ": args is NULL"); \
        DI_GUARD_BEGIN                                                              \
        DI_TRY(use_device(ctx));                                                    \
        AnyArgs local;                                                              \
        DI_TRY(normalize_args(ctx, id, a, &local));                                 \
        DI_TRY(check_args(ctx, id, &local.name, false));                            \
        OpMode m{true, true, DI_SUPPORT_YES, 0};                                    \
        return op_##name(ctx, &local.name, &m);                                     \
        DI_GUARD_END(ctx)                                                           \
    }
DI_OPS(DI_OP_ENTRY)
#undef DI_OP_ENTRY

static DI_Status op_query(DI_Context* ctx, int32_t op, const void* args, DI_OpQuery* out) {
    NEED_CTX(ctx, "op_query");
    DI_TRY(check_sized(ctx, "op_query", out, sizeof(DI_OpQuery), "DI_OpQuery", false));
    out->support = DI_SUPPORT_NO;
    out->workspace_size = 0;
    if (op < 0) return set_error(ctx, DI_INVALID_ARGUMENT, "op_query: op id %d is negative", op);
    if (op >= DI_OP_COUNT_V1_6) return DI_OK;  // an op from a newer ABI: not supported here
    if (!args) return set_error(ctx, DI_INVALID_ARGUMENT, "op_query: args is NULL");
    DI_GUARD_BEGIN
    OpMode m{false, false, DI_SUPPORT_YES, 0};
    AnyArgs local;
    DI_Status st = normalize_args(ctx, op, args, &local);
    if (st == DI_OK) st = check_args(ctx, op, &local, true);
    if (st == DI_OK) {
        switch (op) {
#define Q(id, name, Args, minor) \
    case id: st = op_##name(ctx, &local.name, &m); break;
            DI_OPS(Q)
#undef Q
            default: st = DI_UNIMPLEMENTED;
        }
    }
    if (st == DI_UNIMPLEMENTED) {  // well-formed but not supported: answer NO, not an error
        clear_error(ctx);
        return DI_OK;
    }
    if (st != DI_OK) return st;
    out->support = m.support;
    out->workspace_size = m.workspace;
    return DI_OK;
    DI_GUARD_END(ctx)
}

// ---------------------------------------------------------------------------------------- v1.1
// Events order work across streams (an expert upload on a copy stream, the layer that needs it on
// the compute stream) without blocking the host. Timing is off: they are for ordering only.
static DI_Status event_create(DI_Context* ctx, DI_Event* out) {
    NEED_CTX(ctx, "event_create");
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "event_create: out is NULL");
    *out = nullptr;
    DI_TRY(use_device(ctx));
    cudaEvent_t e = nullptr;
    DI_TRY(cuda_status(ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event_create"));
    *out = e;
    return DI_OK;
}

static DI_Status event_destroy(DI_Context* ctx, DI_Event ev) {
    NEED_CTX(ctx, "event_destroy");
    if (!ev) return set_error(ctx, DI_INVALID_ARGUMENT, "event_destroy: event is NULL");
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaEventDestroy(static_cast<cudaEvent_t>(ev)), "event_destroy");
}

static DI_Status event_record(DI_Context* ctx, DI_Event ev, DI_Stream stream) {
    NEED_CTX(ctx, "event_record");
    if (!ev) return set_error(ctx, DI_INVALID_ARGUMENT, "event_record: event is NULL");
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaEventRecord(static_cast<cudaEvent_t>(ev), static_cast<cudaStream_t>(stream)),
                       "event_record");
}

static DI_Status stream_wait_event(DI_Context* ctx, DI_Stream stream, DI_Event ev) {
    NEED_CTX(ctx, "stream_wait_event");
    if (!ev) return set_error(ctx, DI_INVALID_ARGUMENT, "stream_wait_event: event is NULL");
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(ev), 0),
                       "stream_wait_event");
}

static DI_Status event_query(DI_Context* ctx, DI_Event ev, int32_t* done) {
    NEED_CTX(ctx, "event_query");
    if (!ev || !done) return set_error(ctx, DI_INVALID_ARGUMENT, "event_query: %s is NULL", ev ? "done" : "event");
    DI_TRY(use_device(ctx));
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(ev));
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        *done = 0;
        return DI_OK;
    }
    DI_TRY(cuda_status(ctx, e, "event_query"));
    *done = 1;
    return DI_OK;
}

static DI_Status event_synchronize(DI_Context* ctx, DI_Event ev) {
    NEED_CTX(ctx, "event_synchronize");
    if (!ev) return set_error(ctx, DI_INVALID_ARGUMENT, "event_synchronize: event is NULL");
    DI_TRY(use_device(ctx));
    return cuda_status(ctx, cudaEventSynchronize(static_cast<cudaEvent_t>(ev)), "event_synchronize");
}

// Pinned host memory: the only kind a cudaMemcpyAsync really overlaps with compute.
static DI_Status host_alloc(DI_Context* ctx, uint64_t bytes, void** out) {
    NEED_CTX(ctx, "host_alloc");
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "host_alloc: out is NULL");
    *out = nullptr;
    DI_TRY(use_device(ctx));
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 256, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return set_error(ctx, DI_RESOURCE_EXHAUSTED, "host_alloc: cannot pin %llu bytes of host memory: %s",
                         (unsigned long long)bytes, cudaGetErrorString(e));
    }
    *out = p;
    return DI_OK;
}

static DI_Status host_free(DI_Context* ctx, void* ptr) {
    NEED_CTX(ctx, "host_free");
    if (!ptr) return DI_OK;
    return cuda_status(ctx, cudaFreeHost(ptr), "host_free: cudaFreeHost");
}

// Registers an existing range (an mmap'd safetensors file is mapped read-only: CUDA then needs the
// read-only flag, so that is the retry).
static DI_Status host_register(DI_Context* ctx, void* ptr, uint64_t bytes) {
    NEED_CTX(ctx, "host_register");
    if (!ptr || !bytes)
        return set_error(ctx, DI_INVALID_ARGUMENT, "host_register: %s", ptr ? "0 bytes" : "ptr is NULL");
    DI_TRY(use_device(ctx));
    cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess && e != cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    }
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        return set_error(ctx, DI_INVALID_ARGUMENT, "host_register: [%p, +%llu) overlaps a registered range", ptr,
                         (unsigned long long)bytes);
    }
    return cuda_status(ctx, e, "host_register: cudaHostRegister");
}

static DI_Status host_unregister(DI_Context* ctx, void* ptr) {
    NEED_CTX(ctx, "host_unregister");
    DI_TRY(use_device(ctx));
    cudaError_t e = cudaHostUnregister(ptr);
    if (e == cudaErrorHostMemoryNotRegistered || e == cudaErrorInvalidValue) {
        (void)cudaGetLastError();
        return set_error(ctx, DI_INVALID_ARGUMENT, "host_unregister: %p was not registered", ptr);
    }
    return cuda_status(ctx, e, "host_unregister: cudaHostUnregister");
}

// mem_copy already enqueues with cudaMemcpyAsync; the difference is the contract: the caller keeps
// both buffers alive and unchanged until the stream reaches the copy (pinned memory: a true DMA).
static DI_Status mem_copy_async(DI_Context* ctx, void* dst, const void* src, uint64_t bytes, int32_t kind,
                                DI_Stream stream) {
    if (kind == DI_COPY_HOST_TO_HOST) {
        NEED_CTX(ctx, "mem_copy_async");
        // ordered after the stream's earlier work, like every other copy on it
        DI_TRY(use_device(ctx));
        DI_TRY(cuda_status(ctx, cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "mem_copy_async"));
    }
    return mem_copy(ctx, dst, src, bytes, kind, stream);
}

// ---------------------------------------------------------------------------------------- v1.4
// Communicators (dist.cu): NCCL, loaded at run time, or a one-rank communicator without it.
static DI_Status comm_unique_id(DI_Context* ctx, DI_CommId* out) {
    NEED_CTX(ctx, "comm_unique_id");
    DI_GUARD_BEGIN
    return dist_comm_unique_id(ctx, out);
    DI_GUARD_END(ctx)
}

static DI_Status comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out) {
    NEED_CTX(ctx, "comm_create");
    DI_GUARD_BEGIN
    return dist_comm_create(ctx, id, nranks, rank, out);
    DI_GUARD_END(ctx)
}

static DI_Status comm_destroy(DI_Context* ctx, DI_Comm* comm) {
    NEED_CTX(ctx, "comm_destroy");
    DI_GUARD_BEGIN
    return dist_comm_destroy(ctx, comm);
    DI_GUARD_END(ctx)
}

static DI_Status device_count(int32_t* out) {
    clear_error(nullptr);
    if (!out) return set_error(nullptr, DI_INVALID_ARGUMENT, "device_count: out is NULL");
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;  // no driver or no device: zero devices, not an error
    }
    *out = n;
    return DI_OK;
}

// ---------------------------------------------------------------------------------------- tables
static DI_Api make_api() {
    DI_Api a;
    memset(&a, 0, sizeof(a));
    a.struct_size = sizeof(DI_Api);
    a.abi_major = DI_ABI_MAJOR;
    a.abi_minor = DI_ABI_MINOR;
    a.context_create = context_create;
    a.context_destroy = context_destroy;
    a.last_error = last_error;
    a.get_attribute = get_attribute;
    a.mem_alloc = mem_alloc;
    a.mem_free = mem_free;
    a.mem_copy = mem_copy;
    a.stream_create = stream_create;
    a.stream_destroy = stream_destroy;
    a.stream_synchronize = stream_synchronize;
    a.op_query = op_query;
    a.graph_begin = graph_begin;
    a.graph_end = graph_end;
    a.graph_launch = graph_launch;
    a.graph_destroy = graph_destroy;
#define SET(id, name, Args, minor) a.name = api_##name;
    DI_OPS(SET)
#undef SET
    a.event_create = event_create;
    a.event_destroy = event_destroy;
    a.event_record = event_record;
    a.stream_wait_event = stream_wait_event;
    a.event_query = event_query;
    a.event_synchronize = event_synchronize;
    a.host_alloc = host_alloc;
    a.host_free = host_free;
    a.host_register = host_register;
    a.host_unregister = host_unregister;
    a.mem_copy_async = mem_copy_async;
    a.device_count = device_count;
    a.comm_unique_id = comm_unique_id;
    a.comm_create = comm_create;
    a.comm_destroy = comm_destroy;
    return a;
}
static const DI_Api g_api = make_api();

static const DI_Api* get_api(uint32_t major) { return major == DI_ABI_MAJOR ? &g_api : nullptr; }

#if DI_GPU_AMD
#ifdef DI_HIP_TARGETS
#define DI_HIP_TARGETS_STR DI_HIP_TARGETS
#else
#define DI_HIP_TARGETS_STR "(no target list recorded)"
#endif
// DI_HIP_TARGETS: the --offload-arch list the library was built for (backends/hip/build.sh passes it).
// A GPU outside it has no code object here, and every launch would fail.
static bool built_for(const char* gcn_arch) {
#ifdef DI_HIP_TARGETS
    char want[64];
    snprintf(want, sizeof(want), "%s", gcn_arch);
    want[strcspn(want, ":")] = 0;  // gfx90a:sramecc+:xnack- -> gfx90a
    const char* t = DI_HIP_TARGETS;
    const size_t n = strlen(want);
    while (*t) {
        while (*t == ' ') ++t;
        size_t len = strcspn(t, " ");
        if (len == n && n > 0 && !strncmp(t, want, n)) return true;
        t += len;
    }
    return false;
#else
    (void)gcn_arch;
    return true;
#endif
}
#endif

// Ranks builds of this vendor: the device's major * 10 + minor (compute capability on NVIDIA, the
// gfx generation on AMD: gfx90a 90, gfx942 94). < 0 when no device can run us, with the reason in
// last_error(NULL), which the loader shows.
static int32_t score(void) {
    clear_error(nullptr);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        set_error(nullptr, DI_FAILED_PRECONDITION,
                  "no usable " DI_GPU_RUNTIME " device: the runtime's device count says %s%s",
                  e != cudaSuccess ? cudaGetErrorString(e) : "0 devices",
                  DI_GPU_AMD ? " (is the amdgpu kernel driver loaded, and /dev/kfd readable by this user?)"
                             : " (is the NVIDIA driver installed and a GPU visible?)");
        return -1;
    }
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        set_error(nullptr, DI_FAILED_PRECONDITION, "cannot read device 0's architecture");
        return -1;
    }
#if DI_GPU_AMD
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        set_error(nullptr, DI_FAILED_PRECONDITION, "cannot read device 0's properties");
        return -1;
    }
    if (!built_for(p.gcnArchName)) {
        set_error(nullptr, DI_FAILED_PRECONDITION, "device 0 is %s; this library was built for %s: rebuild with "
                  "DI_HIP_ARCHS set to it (backends/hip/build.sh)", p.gcnArchName, DI_HIP_TARGETS_STR);
        return -1;
    }
#else
    if (major < 8) {  // built for sm_80 and newer
        set_error(nullptr, DI_FAILED_PRECONDITION, "device 0 is sm_%d%d; this library needs sm_80 or newer",
                  major, minor);
        return -1;
    }
#endif
    return major * 10 + minor;
}

static const DI_PluginInfo g_info = {
    sizeof(DI_PluginInfo), DI_ABI_MAJOR, DI_ABI_MINOR, 0, DI_GPU_LIB_NAME, DI_CUDA_VERSION, get_api, score,
};

extern "C" DI_EXPORT const DI_PluginInfo* deepinfer_plugin_info(void) { return &g_info; }
