// The exported surface: deepinfer_plugin_info, the DI_Api table, contexts, memory, streams,
// graphs, attributes and op_query. Every entry point catches everything: nothing crosses the ABI.
#include <stdio.h>

#include <new>

#include "common.cuh"

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
        return set_error(ctx, DI_INTERNAL, "unexpected C++ exception inside the CUDA backend"); \
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
        return set_error(nullptr, DI_FAILED_PRECONDITION, "context_create: no CUDA device usable: %s",
                         cudaGetErrorString(e));
    }
    if (o->device_id < 0 || o->device_id >= n)
        return set_error(nullptr, DI_INVALID_ARGUMENT, "context_create: device_id=%d but %d CUDA device(s) exist",
                         o->device_id, n);
    if (o->num_threads < 0)
        return set_error(nullptr, DI_INVALID_ARGUMENT, "context_create: num_threads=%d is negative", o->num_threads);
    DI_Context* c = new (std::nothrow) DI_Context();
    if (!c) return set_error(nullptr, DI_RESOURCE_EXHAUSTED, "context_create: host out of memory");
    c->device = o->device_id;
    c->err[0] = 0;
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

static const char* last_error(DI_Context* ctx) { return ctx ? ctx->err : global_error(); }

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
    if (!strcmp(key, "name")) return put_str(ctx, key, "cuda", buf, size);
    if (!strcmp(key, "version")) return put_str(ctx, key, DI_CUDA_VERSION, buf, size);
    if (!strcmp(key, "abi.version")) {
        snprintf(tmp, sizeof(tmp), "%d.%d", DI_ABI_MAJOR, DI_ABI_MINOR);
        return put_str(ctx, key, tmp, buf, size);
    }
    bool device_key = !strcmp(key, "device.name") || !strcmp(key, "device.sm_count") ||
                      !strcmp(key, "device.memory_bytes") || !strcmp(key, "device.arch");
    if (!device_key) return set_error(ctx, DI_UNIMPLEMENTED, "get_attribute: unknown key '%s'", key);
    if (!ctx) return set_error(nullptr, DI_INVALID_ARGUMENT, "get_attribute(%s): needs a context", key);
    if (!strcmp(key, "device.name")) return put_str(ctx, key, ctx->prop.name, buf, size);
    if (!strcmp(key, "device.sm_count")) snprintf(tmp, sizeof(tmp), "%d", ctx->sm_count);
    else if (!strcmp(key, "device.memory_bytes")) snprintf(tmp, sizeof(tmp), "%zu", ctx->prop.totalGlobalMem);
    else snprintf(tmp, sizeof(tmp), "sm_%d%d", ctx->prop.major, ctx->prop.minor);
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
            cudaMemGetInfo(&fr, &tot);
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
        cudaGraphDestroy(g);
        return st;
    }
    DI_Graph* G = new (std::nothrow) DI_Graph{g, ex};
    if (!G) {
        cudaGraphExecDestroy(ex);
        cudaGraphDestroy(g);
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
    cudaGraphExecDestroy(g->exec);
    cudaGraphDestroy(g->graph);
    delete g;
    return DI_OK;
}

// ---------------------------------------------------------------------------------------- ops
// Each op entry: context and device checks, then the shared implementation with launch on.
#define DI_OP_ENTRY(name, Args)                                                     \
    static DI_Status api_##name(DI_Context* ctx, const Args* a) {                   \
        NEED_CTX(ctx, #name);                                                       \
        if (!a) return set_error(ctx, DI_INVALID_ARGUMENT, #name ": args is NULL"); \
        DI_GUARD_BEGIN                                                              \
        DI_TRY(use_device(ctx));                                                    \
        OpMode m{true, true, DI_SUPPORT_YES, 0};                                          \
        return op_##name(ctx, a, &m);                                               \
        DI_GUARD_END(ctx)                                                           \
    }

DI_OP_ENTRY(embedding, DI_EmbeddingArgs)
DI_OP_ENTRY(rmsnorm, DI_RMSNormArgs)
DI_OP_ENTRY(linear, DI_LinearArgs)
DI_OP_ENTRY(quantize, DI_QuantizeArgs)
DI_OP_ENTRY(dequantize, DI_DequantizeArgs)
DI_OP_ENTRY(rope, DI_RopeArgs)
DI_OP_ENTRY(mla_cache_write, DI_MLACacheWriteArgs)
DI_OP_ENTRY(mla_prefill, DI_MLAPrefillArgs)
DI_OP_ENTRY(mla_decode, DI_MLADecodeArgs)
DI_OP_ENTRY(moe_router, DI_MoERouterArgs)
DI_OP_ENTRY(moe_experts, DI_MoEExpertsArgs)
DI_OP_ENTRY(add, DI_BinaryArgs)
DI_OP_ENTRY(mul, DI_BinaryArgs)
DI_OP_ENTRY(silu_mul, DI_SiluMulArgs)
DI_OP_ENTRY(concat, DI_ConcatArgs)
DI_OP_ENTRY(sample, DI_SampleArgs)

static DI_Status op_query(DI_Context* ctx, int32_t op, const void* args, DI_OpQuery* out) {
    NEED_CTX(ctx, "op_query");
    DI_TRY(check_sized(ctx, "op_query", out, sizeof(DI_OpQuery), "DI_OpQuery", false));
    out->support = DI_SUPPORT_NO;
    out->workspace_size = 0;
    if (op < 0) return set_error(ctx, DI_INVALID_ARGUMENT, "op_query: op id %d is negative", op);
    if (op >= DI_OP_COUNT_V1_0) return DI_OK;  // an op from a newer ABI: not supported here
    if (!args) return set_error(ctx, DI_INVALID_ARGUMENT, "op_query: args is NULL");
    DI_GUARD_BEGIN
    OpMode m{false, false, DI_SUPPORT_YES, 0};
    DI_Status st;
    switch (op) {
#define Q(id, name, Args) \
    case id: st = op_##name(ctx, static_cast<const Args*>(args), &m); break;
        Q(DI_OP_EMBEDDING, embedding, DI_EmbeddingArgs)
        Q(DI_OP_RMSNORM, rmsnorm, DI_RMSNormArgs)
        Q(DI_OP_LINEAR, linear, DI_LinearArgs)
        Q(DI_OP_QUANTIZE, quantize, DI_QuantizeArgs)
        Q(DI_OP_DEQUANTIZE, dequantize, DI_DequantizeArgs)
        Q(DI_OP_ROPE, rope, DI_RopeArgs)
        Q(DI_OP_MLA_CACHE_WRITE, mla_cache_write, DI_MLACacheWriteArgs)
        Q(DI_OP_MLA_PREFILL, mla_prefill, DI_MLAPrefillArgs)
        Q(DI_OP_MLA_DECODE, mla_decode, DI_MLADecodeArgs)
        Q(DI_OP_MOE_ROUTER, moe_router, DI_MoERouterArgs)
        Q(DI_OP_MOE_EXPERTS, moe_experts, DI_MoEExpertsArgs)
        Q(DI_OP_ADD, add, DI_BinaryArgs)
        Q(DI_OP_MUL, mul, DI_BinaryArgs)
        Q(DI_OP_SILU_MUL, silu_mul, DI_SiluMulArgs)
        Q(DI_OP_CONCAT, concat, DI_ConcatArgs)
        Q(DI_OP_SAMPLE, sample, DI_SampleArgs)
#undef Q
        default: st = DI_UNIMPLEMENTED;
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

// ---------------------------------------------------------------------------------------- tables
static const DI_Api g_api = {
    sizeof(DI_Api), DI_ABI_MAJOR, DI_ABI_MINOR, 0,
    context_create, context_destroy, last_error, get_attribute,
    mem_alloc, mem_free, mem_copy, stream_create, stream_destroy, stream_synchronize,
    op_query,
    graph_begin, graph_end, graph_launch, graph_destroy,
    api_embedding, api_rmsnorm, api_linear, api_quantize, api_dequantize, api_rope,
    api_mla_cache_write, api_mla_prefill, api_mla_decode, api_moe_router, api_moe_experts,
    api_add, api_mul, api_silu_mul, api_concat, api_sample,
};

static const DI_Api* get_api(uint32_t major) { return major == DI_ABI_MAJOR ? &g_api : nullptr; }

// Ranks builds of this vendor: compute capability as 10*major+minor; < 0 when no device can run us.
static int32_t score(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return -1;
    }
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    if (major < 8) return -1;  // built for sm_80 and newer
    return major * 10 + minor;
}

static const DI_PluginInfo g_info = {
    sizeof(DI_PluginInfo), DI_ABI_MAJOR, DI_ABI_MINOR, 0, "cuda", DI_CUDA_VERSION, get_api, score,
};

extern "C" DI_EXPORT const DI_PluginInfo* deepinfer_plugin_info(void) { return &g_info; }
