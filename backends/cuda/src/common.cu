// Host-side helpers: error messages, descriptor validation, dtype table, workspaces.
#include <stdarg.h>
#include <stdio.h>

#include "common.cuh"
#include "deepinfer_abi_check.h"

namespace di {

// The backend's dtype ids are the ABI's (DI_DTypeId), so the op table's DI_DTS_* sets index them.
static_assert((int)DT_F32 == (int)DI_DT_F32 && (int)DT_BF16 == (int)DI_DT_BF16 && (int)DT_E2M1 == (int)DI_DT_E2M1 &&
                  (int)DT_I4 == (int)DI_DT_I4 && (int)DT_U64 == (int)DI_DT_U64,
              "CUDA dtype ids must equal DI_DTypeId");

// The calling thread's last message (ABI 1.1: per thread, not per context, so two threads sharing
// a context never overwrite each other's).
static thread_local char g_err[1024];

DI_Status set_error(DI_Context* ctx, DI_Status st, const char* fmt, ...) {
    (void)ctx;
    char* buf = g_err;
    size_t n = sizeof(g_err);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
    return st;
}

void clear_error(DI_Context* ctx) {
    (void)ctx;
    g_err[0] = 0;
}

const char* global_error() { return g_err; }

DI_Status cuda_status(DI_Context* ctx, cudaError_t e, const char* what) {
    if (e == cudaSuccess) return DI_OK;
    DI_Status st = DI_INTERNAL;
    if (e == cudaErrorMemoryAllocation) st = DI_RESOURCE_EXHAUSTED;
    // an allocation failure is not sticky: clear it so the next call starts clean
    (void)cudaGetLastError();
    return set_error(ctx, st, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

DI_Status launch_status(DI_Context* ctx, const char* op) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return DI_OK;
    return set_error(ctx, DI_INTERNAL, "%s: kernel launch failed: %s", op, cudaGetErrorString(e));
}

DI_Status use_device(DI_Context* ctx) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == ctx->device) return DI_OK;
    return cuda_status(ctx, cudaSetDevice(ctx->device), "cudaSetDevice");
}

// ---------------------------------------------------------------------------------------- dtypes
// The ABI's dtype table (deepinfer_abi_check.h): this backend's dtype ids are DI_DTypeId.
int dt_from_abi(DI_DataType d) { return di_dtype_id(d); }
const char* dt_name(int dt) { return di_dtype_name(dt); }
int dt_bits(int dt) { return di_dtype_bits(dt); }

// ---------------------------------------------------------------------------------------- sizes
static bool tail_is_zero(const void* p, size_t from, size_t to) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = from; i < to; ++i)
        if (b[i]) return false;
    return true;
}

DI_Status check_sized(DI_Context* ctx, const char* what, const void* p, size_t own_size,
                      const char* struct_name, bool has_ext) {
    if (!p) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s is NULL", what, struct_name);
    uint32_t ss = *static_cast<const uint32_t*>(p);
    if (ss < own_size)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: struct_size %u < %zu for %s", what, ss, own_size,
                         struct_name);
    if (ss > own_size && !tail_is_zero(p, own_size, ss))
        return set_error(ctx, DI_UNIMPLEMENTED,
                         "%s: %s has non-zero fields past the %zu bytes this library knows (struct_size %u)",
                         what, struct_name, own_size, ss);
    if (has_ext) {
        const void* ext = *reinterpret_cast<const void* const*>(static_cast<const char*>(p) + 8);
        if (ext) return set_error(ctx, DI_UNIMPLEMENTED, "%s: unknown extension in %s.ext", what, struct_name);
    }
    return DI_OK;
}

DI_Status check_header(DI_Context* ctx, const char* op, const void* args, size_t own_size,
                       const char* struct_name) {
    return check_sized(ctx, op, args, own_size, struct_name, true);
}

// ---------------------------------------------------------------------------------------- tensors
bool present(const DI_Tensor& t, const OpMode* mode, uint32_t flags) {
    (void)mode;
    if (!(flags & T_OPTIONAL)) return true;
    return t.data != nullptr;
}

static DI_Status take_plain(DI_Context* ctx, const OpMode* mode, const char* op, const char* name,
                            const DI_Tensor& t, int ndim, bool required_data, DTensor* v) {
    memset(v, 0, sizeof(*v));
    if (!t.data && required_data && mode->launch)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s is required but its data is NULL", op, name);
    if (t.ndim < 0 || t.ndim > DI_MAX_DIMS)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d out of range [0, %d]", op, name, t.ndim,
                         DI_MAX_DIMS);
    if (ndim >= 0 && t.ndim != ndim)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d", op, name, t.ndim, ndim);
    if (t.device_type != DI_GPU_DEVICE)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.device_type=%d, expected " DI_GPU_DEVICE_STR, op, name,
                         t.device_type);
    if (t.device_id != ctx->device)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.device_id=%d but the context is on device %d", op,
                         name, t.device_id, ctx->device);
    int dt = dt_from_abi(t.dtype);
    if (dt == DT_INVALID)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s has unknown dtype (code %u, bits %u, lanes %u)", op,
                         name, t.dtype.code, t.dtype.bits, t.dtype.lanes);
    for (int d = 0; d < t.ndim; ++d) {
        if (t.shape[d] < 0)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld is negative", op, name, d,
                             (long long)t.shape[d]);
        if (t.strides[d] < 0)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld is negative", op, name, d,
                             (long long)t.strides[d]);
    }
    if (t.ndim > 0 && t.strides[t.ndim - 1] != 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld, the last stride must be 1", op, name,
                         t.ndim - 1, (long long)t.strides[t.ndim - 1]);
    if (dt_is_packed(dt))
        for (int d = 0; d + 1 < t.ndim; ++d)
            if (t.strides[d] % 2)
                return set_error(ctx, DI_INVALID_ARGUMENT,
                                 "%s: %s is 4-bit packed but strides[%d]=%lld is odd", op, name, d,
                                 (long long)t.strides[d]);
    if (t.data && mode->check_ptrs) {
        // A host pointer labelled as device memory would fault inside a kernel and poison the whole GPU
        // context; one driver lookup per tensor keeps that an ordinary INVALID_ARGUMENT.
        cudaPointerAttributes pa;
        cudaError_t e = cudaPointerGetAttributes(&pa, t.data);
        bool ok = e == cudaSuccess && (pa.type == cudaMemoryTypeDevice || pa.type == cudaMemoryTypeManaged ||
                                       (pa.type == cudaMemoryTypeHost && pa.devicePointer != nullptr));
        if (e != cudaSuccess) (void)cudaGetLastError();
        if (!ok)
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.data=%p is not memory the GPU can access", op, name,
                             t.data);
    }
    v->base = static_cast<char*>(t.data) + (t.data ? t.byte_offset : 0);
    v->dt = dt;
    v->ndim = t.ndim;
    for (int d = 0; d < DI_MAX_DIMS; ++d) {
        v->shape[d] = d < t.ndim ? t.shape[d] : 1;
        v->strides[d] = d < t.ndim ? t.strides[d] : 0;
    }
    return DI_OK;
}

DI_Status take_tensor(DI_Context* ctx, const OpMode* mode, const char* op, const char* name,
                      const DI_Tensor& t, int ndim, uint32_t flags, QTensor* v) {
    memset(v, 0, sizeof(*v));
    if ((flags & T_OPTIONAL) && !t.data) return DI_OK;  // absent
    DI_TRY(take_plain(ctx, mode, op, name, t, ndim, true, &v->q));
    v->br = v->bc = 1;
    if (!t.quant) return DI_OK;
    if (!(flags & T_ALLOW_Q))
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: %s carries a quantization descriptor, which this op does not take",
                         op, name);
    // Names for messages are formatted only when there is an error to report: moe_experts validates
    // hundreds of these per call, and the formatting would dominate its host time.
    char what[160] = {0}, sname[160];
    auto W = [&]() -> const char* {
        if (!what[0]) snprintf(what, sizeof(what), "%s: %s.quant", op, name);
        return what;
    };
    if (check_sized(ctx, "quant", t.quant, sizeof(DI_Quant), "DI_Quant", true) != DI_OK)
        return check_sized(ctx, W(), t.quant, sizeof(DI_Quant), "DI_Quant", true);
    const DI_Quant& q = *t.quant;
    if (q.flags) return set_error(ctx, DI_UNIMPLEMENTED, "%s.flags=%u (reserved, must be 0)", W(), q.flags);
    if (q.scheme != DI_QUANT_BLOCK)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s.scheme=%d is not DI_QUANT_BLOCK", W(), q.scheme);
    if (q.nibble_order != DI_NIBBLE_LOW_FIRST)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s.nibble_order=%d is not DI_NIBBLE_LOW_FIRST", W(), q.nibble_order);
    if (q.block_rows < 0 || q.block_cols < 0)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: block (%d, %d) has a negative size", W(), q.block_rows,
                         q.block_cols);
    if (t.ndim < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: a quantized tensor needs ndim >= 1", W());
    int64_t R = t.ndim >= 2 ? t.shape[t.ndim - 2] : 1, C = t.shape[t.ndim - 1];
    v->br = q.block_rows ? q.block_rows : (R > 0 ? R : 1);
    v->bc = q.block_cols ? q.block_cols : (C > 0 ? C : 1);
    if (take_plain(ctx, mode, op, "scales", q.scales, t.ndim, true, &v->s) != DI_OK) {
        snprintf(sname, sizeof(sname), "%s.quant->scales", name);
        return take_plain(ctx, mode, op, sname, q.scales, t.ndim, true, &v->s);
    }
    if (!(DI_DTS_SCALES & DI_DTM(v->s.dt)))   // the op table's scale dtypes
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: scales of dtype %s are not supported", W(), dt_name(v->s.dt));
    int64_t expect[DI_MAX_DIMS];
    for (int d = 0; d < t.ndim; ++d) expect[d] = t.shape[d];
    if (t.ndim >= 2) expect[t.ndim - 2] = ceil_div(R, v->br);
    expect[t.ndim - 1] = ceil_div(C, v->bc);
    for (int d = 0; d < t.ndim; ++d)
        if (v->s.shape[d] != expect[d])
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: scales.shape[%d]=%lld, expected %lld for block (%d, %d)",
                             W(), d, (long long)v->s.shape[d], (long long)expect[d], q.block_rows, q.block_cols);
    v->mode = 1;
    if (q.zeros.data || (!mode->launch && q.zeros.ndim > 0 && q.zeros.device_type == DI_GPU_DEVICE)) {
        if (take_plain(ctx, mode, op, "zeros", q.zeros, t.ndim, true, &v->z) != DI_OK) {
            snprintf(sname, sizeof(sname), "%s.quant->zeros", name);
            return take_plain(ctx, mode, op, sname, q.zeros, t.ndim, true, &v->z);
        }
        for (int d = 0; d < t.ndim; ++d)
            if (v->z.shape[d] != expect[d])
                return set_error(ctx, DI_INVALID_ARGUMENT, "%s: zeros.shape[%d]=%lld, expected %lld (scales' shape)",
                                 W(), d, (long long)v->z.shape[d], (long long)expect[d]);
        if (!(DI_DTS_ZEROS & DI_DTM(v->z.dt)))   // the op table's zero-point dtypes
            return set_error(ctx, DI_UNIMPLEMENTED, "%s: zeros of dtype %s are not supported", W(), dt_name(v->z.dt));
        v->mode = 2;
    }
    return DI_OK;
}

DI_Status need_dtype(DI_Context* ctx, const char* op, const char* name, int dt, const int* allowed,
                     int n_allowed) {
    for (int i = 0; i < n_allowed; ++i)
        if (allowed[i] == dt) return DI_OK;
    char list[256] = {0};
    size_t used = 0;
    for (int i = 0; i < n_allowed && used + 16 < sizeof(list); ++i)
        used += snprintf(list + used, sizeof(list) - used, "%s%s", i ? ", " : "", dt_name(allowed[i]));
    return set_error(ctx, DI_UNIMPLEMENTED, "%s: %s of dtype %s is not supported (supported: %s)", op, name,
                     dt_name(dt), list);
}

DI_Status need_shape(DI_Context* ctx, const char* op, const char* name, const DTensor& t, int dim,
                     int64_t expect, const char* what) {
    if (t.shape[dim] == expect) return DI_OK;
    return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld != %s=%lld", op, name, dim,
                     (long long)t.shape[dim], what, (long long)expect);
}

DI_Status same_shape(DI_Context* ctx, const char* op, const char* a_name, const DTensor& a,
                     const char* b_name, const DTensor& b) {
    if (a.ndim != b.ndim)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.ndim=%d != %s.ndim=%d", op, b_name, b.ndim, a_name,
                         a.ndim);
    for (int d = 0; d < a.ndim; ++d)
        if (a.shape[d] != b.shape[d])
            return set_error(ctx, DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld != %s.shape[%d]=%lld", op, b_name, d,
                             (long long)b.shape[d], a_name, d, (long long)a.shape[d]);
    return DI_OK;
}

// ---------------------------------------------------------------------------------------- workspace
DI_Status Workspace::acquire(DI_Context* ctx, const DI_ArgsHeader& h, uint64_t bytes) {
    stream = static_cast<cudaStream_t>(h.stream);
    if (bytes == 0) return DI_OK;
    if (h.workspace && h.workspace_size >= bytes) {
        ptr = h.workspace;
        return DI_OK;
    }
    cudaError_t e = cudaMallocAsync(&ptr, bytes, stream);
    if (e != cudaSuccess) {
        ptr = nullptr;
        return cuda_status(ctx, e, "workspace allocation (cudaMallocAsync)");
    }
    owned = true;
    return DI_OK;
}

void Workspace::release() {
    if (owned && ptr) (void)cudaFreeAsync(ptr, stream);
    ptr = nullptr;
    owned = false;
}

}  // namespace di
