// ABI 1.4: communicators and the ops of several processes on one model. all_reduce, all_gather and
// all_to_all go through NCCL (RCCL in the HIP build), which this library loads at run time: nothing
// links against it, so the library loads and runs every other op with the driver alone, and a
// missing NCCL is a DI_UNIMPLEMENTED from comm_create that says how to get it. moe_dispatch and
// moe_combine are local kernels (dist_kernels.cuh, where tests/gpu_emu runs them on the CPU).
//
// NCCL is declared here, by hand, with only what this file calls (its C API is stable across 2.x):
// no nccl.h is needed to build. Where the library comes from: $DEEPINFER_NCCL_LIB if set, else the
// dynamic loader's search for libnccl.so.2 (librccl.so.1 on AMD). A process that already has it
// loaded (PyTorch's wheels load it) gets that copy. Finding the nvidia-nccl-cu13 wheel's file under
// site-packages is the Python runtime's business: it sets DEEPINFER_NCCL_LIB.
//
// A one-rank communicator works without NCCL (comm_unique_id then makes an id of this library's own,
// which comm_create accepts for nranks == 1 only): the single-process conformance suite runs the
// collectives anywhere, as the reference's one-rank communicator needs no MPI.
//
// Capture: every op enqueues on the args' stream, never allocates and never reads device memory on
// the host. all_to_all with counts moves whole slots, the counts travelling on the device alongside
// (recv rows past recv_counts are unspecified, abi/deepinfer_abi.h).
#include <dlfcn.h>
#include <stdlib.h>

#include <mutex>
#include <new>
#include <random>

#include "common.cuh"
#include "dist_api.cuh"
#include "dist_kernels.cuh"

using namespace di;

#if DI_GPU_AMD
#define DI_NCCL_NAME "RCCL"
#define DI_NCCL_HINT "install RCCL (ROCm's rccl package) or set DEEPINFER_NCCL_LIB to librccl.so"
static const char* const kNcclDefaultLibs[] = {"librccl.so.1", "librccl.so"};
#else
#define DI_NCCL_NAME "NCCL"
#define DI_NCCL_HINT "pip install nvidia-nccl-cu13 or set DEEPINFER_NCCL_LIB to libnccl.so.2"
static const char* const kNcclDefaultLibs[] = {"libnccl.so.2", "libnccl.so"};
#endif

// ---------------------------------------------------------------------------------------- NCCL
// The part of NCCL's C API this file uses (the same in RCCL). Enums are ints in the C ABI; the id is
// passed by value, a 128-byte struct of chars, which DI_CommId mirrors byte for byte.
namespace {

typedef int   NcclResult;  // ncclResult_t
typedef void* NcclComm;    // ncclComm_t: an opaque pointer
struct NcclId {
    char bytes[128];       // ncclUniqueId
};
static_assert(sizeof(NcclId) == sizeof(DI_CommId), "DI_CommId is an ncclUniqueId");

enum : int {  // ncclResult_t
    NCCL_OK = 0,
    NCCL_INVALID_ARGUMENT = 4,
    NCCL_INVALID_USAGE = 5,
    NCCL_REMOTE_ERROR = 6,
    NCCL_IN_PROGRESS = 7,
};
enum : int {  // ncclDataType_t
    NCCL_INT8 = 0,
    NCCL_UINT8 = 1,
    NCCL_INT32 = 2,
    NCCL_FLOAT16 = 6,
    NCCL_FLOAT32 = 7,
    NCCL_BFLOAT16 = 9,
};
enum : int { NCCL_SUM = 0 };  // ncclRedOp_t

struct Nccl {
    void* lib = nullptr;
    NcclResult (*get_unique_id)(NcclId*) = nullptr;
    NcclResult (*comm_init_rank)(NcclComm*, int, NcclId, int) = nullptr;
    NcclResult (*comm_destroy)(NcclComm) = nullptr;
    NcclResult (*comm_abort)(NcclComm) = nullptr;
    NcclResult (*all_reduce)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
    NcclResult (*all_gather)(const void*, void*, size_t, int, NcclComm, cudaStream_t) = nullptr;
    NcclResult (*send)(const void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
    NcclResult (*recv)(void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
    NcclResult (*group_start)() = nullptr;
    NcclResult (*group_end)() = nullptr;
    const char* (*error_string)(NcclResult) = nullptr;
    NcclResult (*async_error)(NcclComm, NcclResult*) = nullptr;
    const char* (*last_error)(NcclComm) = nullptr;  // NCCL 2.13 and later; optional
    int version = 0;
};

std::mutex g_nccl_mu;
Nccl g_nccl;                // filled once, by the first load that succeeds
bool g_nccl_loaded = false;

template <class F>
bool bind(void* lib, const char* name, F* f) {
    *f = reinterpret_cast<F>(dlsym(lib, name));
    return *f != nullptr;
}

// NCCL, loaded on first use. NULL with the reason in *why (a missing library is retried next time:
// the user may fix the environment between two calls).
const Nccl* load_nccl(char* why, size_t n) {
    std::lock_guard<std::mutex> lock(g_nccl_mu);
    if (g_nccl_loaded) return &g_nccl;
#if !DI_GPU_AMD
    // NVLink multicast stays off (it needs fabric setup this project does not do); a value the user
    // set wins. NCCL reads its environment when it initializes, i.e. after this.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
#endif
    const char* env = getenv("DEEPINFER_NCCL_LIB");
    void* lib = nullptr;
    const char* name = nullptr;
    char err[512] = {0};
    if (env && *env) {
        name = env;
        lib = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char* e = dlerror();
            snprintf(why, n, DI_NCCL_NAME " not found: DEEPINFER_NCCL_LIB=%s cannot be loaded (%s)", env,
                     e ? e : "dlopen failed");
            return nullptr;
        }
    } else {
        for (const char* cand : kNcclDefaultLibs) {
            lib = dlopen(cand, RTLD_NOW | RTLD_LOCAL);
            if (lib) {
                name = cand;
                break;
            }
            const char* e = dlerror();
            if (!err[0]) snprintf(err, sizeof(err), "%s", e ? e : "dlopen failed");
        }
        if (!lib) {
            snprintf(why, n, DI_NCCL_NAME " not found: " DI_NCCL_HINT " (dlopen %s: %s)", kNcclDefaultLibs[0], err);
            return nullptr;
        }
    }
    Nccl L;
    L.lib = lib;
    const char* missing = nullptr;
#define DI_BIND(field, sym) \
    if (!missing && !bind(lib, sym, &L.field)) missing = sym;
    DI_BIND(get_unique_id, "ncclGetUniqueId")
    DI_BIND(comm_init_rank, "ncclCommInitRank")
    DI_BIND(comm_destroy, "ncclCommDestroy")
    DI_BIND(comm_abort, "ncclCommAbort")
    DI_BIND(all_reduce, "ncclAllReduce")
    DI_BIND(all_gather, "ncclAllGather")
    DI_BIND(send, "ncclSend")
    DI_BIND(recv, "ncclRecv")
    DI_BIND(group_start, "ncclGroupStart")
    DI_BIND(group_end, "ncclGroupEnd")
    DI_BIND(error_string, "ncclGetErrorString")
    DI_BIND(async_error, "ncclCommGetAsyncError")
#undef DI_BIND
    if (missing) {
        snprintf(why, n, "%s lacks %s: " DI_NCCL_NAME " 2.10 or newer (bf16) is needed (" DI_NCCL_HINT ")", name, missing);
        dlclose(lib);
        return nullptr;
    }
    (void)bind(lib, "ncclGetLastError", &L.last_error);
    NcclResult (*get_version)(int*) = nullptr;
    if (bind(lib, "ncclGetVersion", &get_version)) (void)get_version(&L.version);
    g_nccl = L;
    g_nccl_loaded = true;
    return &g_nccl;
}

DI_Status nccl_status(DI_Context* ctx, const Nccl& L, NcclResult r, NcclComm comm, const char* op, const char* what) {
    if (r == NCCL_OK) return DI_OK;
    const char* detail = L.last_error ? L.last_error(comm) : nullptr;
    const DI_Status st = r == NCCL_INVALID_ARGUMENT || r == NCCL_INVALID_USAGE ? DI_INVALID_ARGUMENT
                         : r == NCCL_REMOTE_ERROR                            ? DI_FAILED_PRECONDITION
                                                                             : DI_INTERNAL;
    return set_error(ctx, st, "%s: %s failed: %s (" DI_NCCL_NAME " error %d)%s%s", op, what, L.error_string(r), r,
                     detail && *detail ? ": " : "", detail && *detail ? detail : "");
}

// Ids of a one-rank communicator made without NCCL start with this.
const char kLocalMagic[] = "deepinfer-" DI_GPU_LIB_NAME "-local-comm";

bool is_local_id(const DI_CommId& id) { return !memcmp(id.bytes, kLocalMagic, sizeof(kLocalMagic)); }

}  // namespace

// ---------------------------------------------------------------------------------------- communicators
// One per comm_create: the NCCL communicator (NULL for a one-rank one without NCCL).
struct DI_Comm {
    uint64_t magic;
    int32_t  nranks, rank, device;
    NcclComm nccl;
};

namespace {

constexpr uint64_t kCommMagic = 0x6d6d6f632d6964ull;  // "di-comm"

DI_Status take_comm(DI_Context* ctx, const char* op, DI_Comm* c) {
    if (!c) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: comm is NULL (comm_create makes one)", op);
    if (c->magic != kCommMagic)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: comm is not a communicator of this library, or was destroyed",
                         op);
    if (c->device != ctx->device)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: comm was created on device %d but the context is on device %d",
                         op, c->device, ctx->device);
    return DI_OK;
}

}  // namespace

namespace di {

DI_Status dist_comm_unique_id(DI_Context* ctx, DI_CommId* out) {
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "comm_unique_id: out is NULL");
    memset(out->bytes, 0, sizeof(out->bytes));
    char why[768];
    const Nccl* L = load_nccl(why, sizeof(why));
    if (!L) {
        // no NCCL: an id of our own, good for a one-rank communicator (comm_create says why not more)
        memcpy(out->bytes, kLocalMagic, sizeof(kLocalMagic));
        std::random_device rd;
        for (size_t i = sizeof(kLocalMagic); i + 4 <= sizeof(out->bytes); i += 4) {
            const uint32_t r = rd();
            memcpy(out->bytes + i, &r, 4);
        }
        return DI_OK;
    }
    DI_TRY(use_device(ctx));
    NcclId id;
    DI_TRY(nccl_status(ctx, *L, L->get_unique_id(&id), nullptr, "comm_unique_id", "ncclGetUniqueId"));
    memcpy(out->bytes, id.bytes, sizeof(id.bytes));
    return DI_OK;
}

DI_Status dist_comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out) {
    const char* op = "comm_create";
    if (!out) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out is NULL", op);
    *out = nullptr;
    if (!id) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: id is NULL (comm_unique_id makes one)", op);
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: rank %d of %d ranks is out of range", op, rank, nranks);
    DI_TRY(use_device(ctx));
    NcclComm nc = nullptr;
    const Nccl* L = nullptr;
    if (is_local_id(*id)) {
        if (nranks != 1) {
            char why[768];
            if (load_nccl(why, sizeof(why)))
                return set_error(ctx, DI_FAILED_PRECONDITION, "%s: %d ranks need " DI_NCCL_NAME ", and this id was "
                                 "made when it could not be loaded (an id for one rank only): make it again", op, nranks);
            return set_error(ctx, DI_UNIMPLEMENTED, "%s: %d ranks need " DI_NCCL_NAME ": %s", op, nranks, why);
        }
    } else {
        char why[768];
        L = load_nccl(why, sizeof(why));
        if (!L) return set_error(ctx, DI_UNIMPLEMENTED, "%s: %s", op, why);
        NcclId nid;
        memcpy(nid.bytes, id->bytes, sizeof(nid.bytes));
        // collective: blocks until all nranks have joined
        DI_TRY(nccl_status(ctx, *L, L->comm_init_rank(&nc, nranks, nid, rank), nullptr, op, "ncclCommInitRank"));
    }
    DI_Comm* c = new (std::nothrow) DI_Comm;
    if (!c) {
        if (nc) (void)L->comm_destroy(nc);
        return set_error(ctx, DI_RESOURCE_EXHAUSTED, "%s: host out of memory", op);
    }
    c->magic = kCommMagic;
    c->nranks = nranks;
    c->rank = rank;
    c->device = ctx->device;
    c->nccl = nc;
    *out = c;
    return DI_OK;
}

DI_Status dist_comm_destroy(DI_Context* ctx, DI_Comm* c) {
    DI_TRY(take_comm(ctx, "comm_destroy", c));
    DI_TRY(use_device(ctx));
    DI_Status st = DI_OK;
    if (c->nccl) {
        char why[768];
        const Nccl* L = load_nccl(why, sizeof(why));  // loaded: the comm was made with it
        // a communicator with an asynchronous error (a peer died, a collective failed) is aborted:
        // ncclCommDestroy would wait for its unfinished kernels, i.e. forever
        NcclResult ae = NCCL_OK;
        const bool broken = L && L->async_error(c->nccl, &ae) == NCCL_OK && ae != NCCL_OK && ae != NCCL_IN_PROGRESS;
        if (broken) st = nccl_status(ctx, *L, L->comm_abort(c->nccl), nullptr, "comm_destroy", "ncclCommAbort");
        else if (L) st = nccl_status(ctx, *L, L->comm_destroy(c->nccl), nullptr, "comm_destroy", "ncclCommDestroy");
    }
    c->magic = 0;
    delete c;
    return st;
}

}  // namespace di

// ---------------------------------------------------------------------------------------- helpers
namespace {

int64_t numel(const DTensor& t) {
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
    return n;
}

int64_t elt_bytes(const DTensor& t) { return dt_bits(t.dt) / 8; }

// Row-major with no gaps (dimensions of size 1 may carry any stride).
bool contiguous(const DTensor& t) {
    int64_t want = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
        if (t.shape[d] != 1 && t.strides[d] != want) return false;
        want *= t.shape[d];
    }
    return true;
}

DI_Status need_contiguous(DI_Context* ctx, const char* op, const char* name, const DTensor& t) {
    if (contiguous(t)) return DI_OK;
    return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s must be contiguous (row-major, no padding)", op, name);
}

// Whether two contiguous tensors share any byte.
bool overlap(const DTensor& a, const DTensor& b) {
    const uintptr_t a0 = reinterpret_cast<uintptr_t>(a.base), b0 = reinterpret_cast<uintptr_t>(b.base);
    const uintptr_t a1 = a0 + (uintptr_t)(numel(a) * elt_bytes(a)), b1 = b0 + (uintptr_t)(numel(b) * elt_bytes(b));
    return a.base && b.base && a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;
}

DI_Status nccl_async(DI_Context* ctx, const Nccl& L, NcclComm comm, const char* op) {
    NcclResult ae = NCCL_OK;
    if (L.async_error(comm, &ae) != NCCL_OK || ae == NCCL_OK || ae == NCCL_IN_PROGRESS) return DI_OK;
    return nccl_status(ctx, L, ae, comm, op, "the communicator (a peer failed, or an earlier collective did)");
}

// The NCCL of a communicator that has one (NULL for a one-rank communicator without it).
const Nccl* comm_nccl(const DI_Comm* c) {
    if (!c->nccl) return nullptr;
    char why[8];
    return load_nccl(why, sizeof(why));  // already loaded: comm_create succeeded with it
}

cudaStream_t stream_of(const DI_ArgsHeader& h) { return static_cast<cudaStream_t>(h.stream); }

}  // namespace

// ---------------------------------------------------------------------------------------- all_reduce
DI_Status op_all_reduce(DI_Context* ctx, const DI_AllReduceArgs* a, OpMode* mode) {
    const char* op = "all_reduce";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_AllReduceArgs"));
    DI_TRY(take_comm(ctx, op, a->comm));
    QTensor x, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, -1, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, -1, 0, &out));
    DI_NEED_DT(ctx, op, "x", x.q.dt, DT_F32, DT_BF16);
    if (out.q.dt != x.q.dt)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out is %s but x is %s", op, dt_name(out.q.dt), dt_name(x.q.dt));
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_contiguous(ctx, op, "x", x.q));
    DI_TRY(need_contiguous(ctx, op, "out", out.q));
    if (x.q.base != out.q.base && overlap(x.q, out.q))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out overlaps x without being x (in place: pass the same tensor)",
                         op);
    const int64_t n = numel(x.q);
    if (!mode->launch || n == 0) return DI_OK;
    const cudaStream_t s = stream_of(a->header);
    DI_Comm* c = a->comm;
    if (const Nccl* L = comm_nccl(c)) {
        const int dt = x.q.dt == DT_F32 ? NCCL_FLOAT32 : NCCL_BFLOAT16;
        DI_TRY(nccl_status(ctx, *L, L->all_reduce(x.q.base, out.q.base, (size_t)n, dt, NCCL_SUM, c->nccl, s), c->nccl,
                           op, "ncclAllReduce"));
        return nccl_async(ctx, *L, c->nccl, op);
    }
    if (x.q.base == out.q.base) return DI_OK;  // one rank: the sum is x
    return cuda_status(ctx, cudaMemcpyAsync(out.q.base, x.q.base, (size_t)(n * elt_bytes(x.q)), cudaMemcpyDeviceToDevice, s),
                       "all_reduce: cudaMemcpyAsync");
}

// ---------------------------------------------------------------------------------------- all_gather
DI_Status op_all_gather(DI_Context* ctx, const DI_AllGatherArgs* a, OpMode* mode) {
    const char* op = "all_gather";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_AllGatherArgs"));
    DI_TRY(take_comm(ctx, op, a->comm));
    DI_Comm* c = a->comm;
    QTensor x, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, -1, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, x.q.ndim + 1, 0, &out));
    if (out.q.dt != x.q.dt)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out is %s but x is %s", op, dt_name(out.q.dt), dt_name(x.q.dt));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, c->nranks, "the communicator's ranks"));
    for (int d = 0; d < x.q.ndim; ++d)
        if (out.q.shape[d + 1] != x.q.shape[d])
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out.shape[%d]=%lld != x.shape[%d]=%lld", op, d + 1,
                             (long long)out.q.shape[d + 1], d, (long long)x.q.shape[d]);
    DI_TRY(need_contiguous(ctx, op, "x", x.q));
    DI_TRY(need_contiguous(ctx, op, "out", out.q));
    if (overlap(x.q, out.q)) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out overlaps x", op);
    const size_t bytes = (size_t)(numel(x.q) * elt_bytes(x.q));
    if (!mode->launch || bytes == 0) return DI_OK;
    const cudaStream_t s = stream_of(a->header);
    if (const Nccl* L = comm_nccl(c)) {
        // bytes: every dtype of the op table travels unchanged
        DI_TRY(nccl_status(ctx, *L, L->all_gather(x.q.base, out.q.base, bytes, NCCL_UINT8, c->nccl, s), c->nccl, op,
                           "ncclAllGather"));
        return nccl_async(ctx, *L, c->nccl, op);
    }
    return cuda_status(ctx, cudaMemcpyAsync(out.q.base, x.q.base, bytes, cudaMemcpyDeviceToDevice, s),
                       "all_gather: cudaMemcpyAsync");
}

// ---------------------------------------------------------------------------------------- all_to_all
namespace {

// Slot p of send to rank p, slot p of recv from rank p, for every peer p != rank, in one NCCL group
// (the self slot is a copy, by the caller); the counts, when given, travel ahead of the rows.
DI_Status exchange_slots(DI_Context* ctx, const Nccl& L, const DI_Comm* c, const char* send, char* recv,
                         int64_t slot_bytes, const int32_t* send_counts, int32_t* recv_counts, cudaStream_t s,
                         const char* op) {
    DI_TRY(nccl_status(ctx, L, L.group_start(), c->nccl, op, "ncclGroupStart"));
    NcclResult r = NCCL_OK;
    const char* what = "";
    for (int p = 0; p < c->nranks && r == NCCL_OK; ++p) {
        if (p == c->rank) continue;
        if (send_counts) {  // one int32 each way ahead of the rows
            what = "ncclSend (counts)";
            r = L.send(send_counts + p, 1, NCCL_INT32, p, c->nccl, s);
            if (r == NCCL_OK) {
                what = "ncclRecv (counts)";
                r = L.recv(recv_counts + p, 1, NCCL_INT32, p, c->nccl, s);
            }
        }
        if (r == NCCL_OK && slot_bytes > 0) {
            what = "ncclSend";
            r = L.send(send + p * slot_bytes, (size_t)slot_bytes, NCCL_UINT8, p, c->nccl, s);
        }
        if (r == NCCL_OK && slot_bytes > 0) {
            what = "ncclRecv";
            r = L.recv(recv + p * slot_bytes, (size_t)slot_bytes, NCCL_UINT8, p, c->nccl, s);
        }
    }
    const NcclResult end = L.group_end();  // always closed, also after a failed call inside
    DI_TRY(nccl_status(ctx, L, r, c->nccl, op, what));
    return nccl_status(ctx, L, end, c->nccl, op, "ncclGroupEnd");
}

}  // namespace

DI_Status op_all_to_all(DI_Context* ctx, const DI_AllToAllArgs* a, OpMode* mode) {
    const char* op = "all_to_all";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_AllToAllArgs"));
    DI_TRY(take_comm(ctx, op, a->comm));
    DI_Comm* c = a->comm;
    const int N = c->nranks, me = c->rank;
    QTensor send, recv, sc, rc;
    DI_TRY(take_tensor(ctx, mode, op, "send", a->send, -1, 0, &send));
    DI_TRY(take_tensor(ctx, mode, op, "recv", a->recv, -1, 0, &recv));
    if (recv.q.dt != send.q.dt)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: recv is %s but send is %s", op, dt_name(recv.q.dt),
                         dt_name(send.q.dt));
    DI_TRY(need_shape(ctx, op, "send", send.q, 0, N, "the communicator's ranks"));
    DI_TRY(same_shape(ctx, op, "send", send.q, "recv", recv.q));
    DI_TRY(need_contiguous(ctx, op, "send", send.q));
    DI_TRY(need_contiguous(ctx, op, "recv", recv.q));
    if (overlap(send.q, recv.q)) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: recv overlaps send", op);
    // the counts: both or neither (in op_query also present when only a shape is given)
    const bool has_sc = a->send_counts.data || (!mode->launch && a->send_counts.ndim > 0);
    const bool has_rc = a->recv_counts.data || (!mode->launch && a->recv_counts.ndim > 0);
    if (has_sc != has_rc)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: send_counts and recv_counts go together (%s without %s)", op,
                         has_sc ? "send_counts" : "recv_counts", has_sc ? "recv_counts" : "send_counts");
    if (has_sc) {
        DI_TRY(take_tensor(ctx, mode, op, "send_counts", a->send_counts, 1, 0, &sc));
        DI_TRY(take_tensor(ctx, mode, op, "recv_counts", a->recv_counts, 1, 0, &rc));
        DI_NEED_DT(ctx, op, "send_counts", sc.q.dt, DT_I32);
        DI_NEED_DT(ctx, op, "recv_counts", rc.q.dt, DT_I32);
        DI_TRY(need_shape(ctx, op, "send_counts", sc.q, 0, N, "the communicator's ranks"));
        DI_TRY(need_shape(ctx, op, "recv_counts", rc.q, 0, N, "the communicator's ranks"));
        if (overlap(sc.q, rc.q)) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: recv_counts overlaps send_counts", op);
    }
    const int64_t slot_bytes = numel(send.q) / N * elt_bytes(send.q);
    if (!mode->launch) return DI_OK;
    const cudaStream_t s = stream_of(a->header);
    const Nccl* L = comm_nccl(c);
    char* sbase = send.q.base;
    char* rbase = recv.q.base;
    int32_t* scp = has_sc ? reinterpret_cast<int32_t*>(sc.q.base) : nullptr;
    int32_t* rcp = has_sc ? reinterpret_cast<int32_t*>(rc.q.base) : nullptr;
    const auto copy = [&](void* dst, const void* src, int64_t bytes, const char* what) -> DI_Status {
        if (bytes <= 0) return DI_OK;
        return cuda_status(ctx, cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToDevice, s), what);
    };

    // Whole slots, the counts (if any) travelling on the device alongside: the row counts live in
    // device memory, and reading them on the host would sync the stream inside an op (README section
    // 6) and break graph capture. Rows past a count cross the wire unread; with DeepSeek's top-8 over
    // a few ranks most slots are mostly full anyway. Exact rows need device-initiated sends (a
    // DeepEP-style kernel), a later optimization that this op's semantics already allow.
    if (L && N > 1)
        DI_TRY(exchange_slots(ctx, *L, c, sbase, rbase, slot_bytes, scp, rcp, s, op));
    if (has_sc) DI_TRY(copy(rcp + me, scp + me, sizeof(int32_t), "all_to_all: cudaMemcpyAsync (own count)"));
    DI_TRY(copy(rbase + me * slot_bytes, sbase + me * slot_bytes, slot_bytes, "all_to_all: cudaMemcpyAsync (own slot)"));
    return L ? nccl_async(ctx, *L, c->nccl, op) : DI_OK;
}

// ---------------------------------------------------------------------------------------- moe_dispatch
DI_Status op_moe_dispatch(DI_Context* ctx, const DI_MoEDispatchArgs* a, OpMode* mode) {
    const char* op = "moe_dispatch";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MoEDispatchArgs"));
    QTensor x, ids, wts, sx, sids, swts, counts, route;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "topk_ids", a->topk_ids, 2, 0, &ids));
    DI_TRY(take_tensor(ctx, mode, op, "topk_weights", a->topk_weights, 2, 0, &wts));
    DI_TRY(take_tensor(ctx, mode, op, "send_x", a->send_x, 3, 0, &sx));
    DI_TRY(take_tensor(ctx, mode, op, "send_ids", a->send_ids, 3, 0, &sids));
    DI_TRY(take_tensor(ctx, mode, op, "send_weights", a->send_weights, 3, 0, &swts));
    DI_TRY(take_tensor(ctx, mode, op, "send_counts", a->send_counts, 1, 0, &counts));
    DI_TRY(take_tensor(ctx, mode, op, "route", a->route, 2, 0, &route));
    DI_NEED_DT(ctx, op, "x", x.q.dt, DT_F32, DT_BF16);
    DI_NEED_DT(ctx, op, "topk_ids", ids.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "topk_weights", wts.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "send_ids", sids.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "send_weights", swts.q.dt, DT_F32);
    DI_NEED_DT(ctx, op, "send_counts", counts.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "route", route.q.dt, DT_I32);
    if (sx.q.dt != x.q.dt)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: send_x is %s but x is %s", op, dt_name(sx.q.dt), dt_name(x.q.dt));
    const int64_t T = x.q.shape[0], H = x.q.shape[1], K = ids.q.shape[1];
    const int64_t N = sx.q.shape[0], C = sx.q.shape[1];
    if (a->experts_per_rank < 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: experts_per_rank=%d must be >= 1", op, a->experts_per_rank);
    if (N < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: send_x.shape[0] (ranks) must be >= 1", op);
    DI_TRY(need_shape(ctx, op, "topk_ids", ids.q, 0, T, "x.shape[0]"));
    DI_TRY(same_shape(ctx, op, "topk_ids", ids.q, "topk_weights", wts.q));
    if (C < T)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: send_x.shape[1]=%lld < x.shape[0]=%lld: a slot must hold every "
                         "token", op, (long long)C, (long long)T);
    DI_TRY(need_shape(ctx, op, "send_x", sx.q, 2, H, "x.shape[1]"));
    DI_TRY(need_shape(ctx, op, "send_ids", sids.q, 0, N, "send_x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "send_ids", sids.q, 1, C, "send_x.shape[1]"));
    DI_TRY(need_shape(ctx, op, "send_ids", sids.q, 2, K, "topk_ids.shape[1]"));
    DI_TRY(same_shape(ctx, op, "send_ids", sids.q, "send_weights", swts.q));
    DI_TRY(need_shape(ctx, op, "send_counts", counts.q, 0, N, "send_x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "route", route.q, 0, T, "x.shape[0]"));
    DI_TRY(need_shape(ctx, op, "route", route.q, 1, N, "send_x.shape[0]"));
    if (C > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld rows per slot, %lld ranks or a top-%lld do not fit the int32 "
                         "counts", op, (long long)C, (long long)N, (long long)K);
    if (!mode->launch) return DI_OK;
    DispatchP P{T, C, (int32_t)N, (int32_t)K, a->experts_per_rank, 0};
    const cudaStream_t s = stream_of(a->header);
    // the rows, ids and weights of each slot, one block per rank
    const unsigned threads = T > 256 ? 1024 : 256;
    k_moe_dispatch_route<<<grid_for(N, 1, 65535), threads, 0, s>>>(ids.q, wts.q, sids.q, swts.q, counts.q, route.q, P);
    DI_TRY(launch_status(ctx, op));
    if (T == 0 || H == 0) return DI_OK;
    // the x rows, in the widest unit that every row start and the row length are multiples of
    const int64_t eb = elt_bytes(x.q), row_bytes = H * eb;
    int V = 16;
    const uintptr_t ax = reinterpret_cast<uintptr_t>(x.q.base), as = reinterpret_cast<uintptr_t>(sx.q.base);
    while (V > 1 && (row_bytes % V || ax % V || as % V || (x.q.strides[0] * eb) % V || (sx.q.strides[0] * eb) % V ||
                     (sx.q.strides[1] * eb) % V))
        V /= 2;
    const unsigned grid = grid_for(T, 1, 65535);
    switch (V) {
        case 16: k_moe_dispatch_rows<16><<<grid, 256, 0, s>>>(x.q, route.q, sx.q, row_bytes, P); break;
        case 8: k_moe_dispatch_rows<8><<<grid, 256, 0, s>>>(x.q, route.q, sx.q, row_bytes, P); break;
        case 4: k_moe_dispatch_rows<4><<<grid, 256, 0, s>>>(x.q, route.q, sx.q, row_bytes, P); break;
        case 2: k_moe_dispatch_rows<2><<<grid, 256, 0, s>>>(x.q, route.q, sx.q, row_bytes, P); break;
        default: k_moe_dispatch_rows<1><<<grid, 256, 0, s>>>(x.q, route.q, sx.q, row_bytes, P); break;
    }
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- moe_combine
DI_Status op_moe_combine(DI_Context* ctx, const DI_MoECombineArgs* a, OpMode* mode) {
    const char* op = "moe_combine";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MoECombineArgs"));
    QTensor back, route, out;
    DI_TRY(take_tensor(ctx, mode, op, "back", a->back, 3, 0, &back));
    DI_TRY(take_tensor(ctx, mode, op, "route", a->route, 2, 0, &route));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "back", back.q.dt, DT_F32, DT_BF16);
    DI_NEED_DT(ctx, op, "route", route.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_F32, DT_BF16);
    const int64_t N = back.q.shape[0], H = back.q.shape[2], T = out.q.shape[0];
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, H, "back.shape[2]"));
    DI_TRY(need_shape(ctx, op, "route", route.q, 0, T, "out.shape[0]"));
    DI_TRY(need_shape(ctx, op, "route", route.q, 1, N, "back.shape[0]"));
    if (N > DIST_MAX_RANKS)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %lld ranks, this library combines at most %d", op, (long long)N,
                         DIST_MAX_RANKS);
    if (!mode->launch || T == 0 || H == 0) return DI_OK;
    k_moe_combine<<<grid_for(T, 1, 65535), 256, 0, stream_of(a->header)>>>(back.q, route.q, out.q, T, H, (int)N,
                                                                          a->accumulate ? 1 : 0);
    return launch_status(ctx, op);
}
