// Shared pieces of the CUDA backend: the context, error reporting, host-side descriptor checks and
// the device-side view of a tensor with its element loaders and stores.
//
// Every op is one function `DI_Status op_xxx(DI_Context*, const Args*, OpMode*)`: it validates the
// descriptors on the host, computes its workspace, and launches only when mode->launch is set.
// op_query calls the same function with launch unset, so the two can never disagree.
#pragma once

#include "gpu_runtime.cuh"  // CUDA or HIP runtime, never a vendor header directly
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "deepinfer_abi.h"

#define DI_CUDA_VERSION "0.1.0"

// What the library calls itself and the memory it hands out: the same sources build
// libdeepinfer_cuda.so with nvcc and libdeepinfer_hip.so with hipcc (backends/hip).
#if DI_GPU_AMD
#define DI_GPU_LIB_NAME    "hip"                  // DI_PluginInfo.name: the loader's libdeepinfer_hip.so
#define DI_GPU_DEVICE      DI_DEVICE_ROCM         // device_type of every tensor the ops accept
#define DI_GPU_DEVICE_STR  "DI_DEVICE_ROCM (10)"
#define DI_GPU_DEVICE_TYPE "rocm"                 // the device.type attribute
#define DI_GPU_RUNTIME     "ROCm"                 // for messages
#else
#define DI_GPU_LIB_NAME    "cuda"
#define DI_GPU_DEVICE      DI_DEVICE_CUDA
#define DI_GPU_DEVICE_STR  "DI_DEVICE_CUDA (2)"
#define DI_GPU_DEVICE_TYPE "cuda"
#define DI_GPU_RUNTIME     "CUDA"
#endif

struct DI_Context {
    int32_t        device;
    int32_t        sm_count;
    cudaDeviceProp prop;
};

namespace di {

// ---------------------------------------------------------------------------------------- dtypes
// Internal dtype ids: one switch in the loaders instead of (code, bits) pairs.
enum DT : int32_t {
    DT_INVALID = 0,
    DT_F32, DT_F16, DT_BF16,
    DT_E4M3, DT_E5M2, DT_E8M0, DT_E2M1,
    DT_I4, DT_U4, DT_I8, DT_U8, DT_I32, DT_I64, DT_U64
};

int         dt_from_abi(DI_DataType d);         // DT_INVALID if unknown or lanes != 1
const char* dt_name(int dt);
int         dt_bits(int dt);
inline bool dt_is_packed(int dt) { return dt == DT_E2M1 || dt == DT_I4 || dt == DT_U4; }
inline bool dt_is_act_float(int dt) { return dt == DT_F32 || dt == DT_BF16 || dt == DT_F16; }
inline bool dt_is_int(int dt) {
    return dt == DT_I4 || dt == DT_U4 || dt == DT_I8 || dt == DT_U8 || dt == DT_I32 || dt == DT_I64 ||
           dt == DT_U64;
}

// ---------------------------------------------------------------------------------------- views
// A device-side view of a DI_Tensor: base already includes byte_offset; strides in elements.
struct DTensor {
    char*   base;
    int32_t dt;
    int32_t ndim;
    int64_t shape[DI_MAX_DIMS];
    int64_t strides[DI_MAX_DIMS];
};

// A (possibly) block-quantized tensor: real = (q - z) * s with s, z indexed by (r / br, c / bc).
// mode 0: plain values, 1: scales, 2: scales and zeros. br/bc are resolved (never 0).
struct QTensor {
    DTensor q;
    DTensor s;
    DTensor z;
    int64_t br, bc;
    int32_t mode;
    int32_t pad_;
};

// Per-call state shared by an op and op_query.
struct OpMode {
    bool     launch;          // false: validate and size only
    bool     check_ptrs;      // look every data pointer up (off for the per-expert weight arrays)
    int32_t  support;         // DI_SUPPORT_YES or DI_SUPPORT_SLOW (generic fallback)
    uint64_t workspace;       // bytes needed in header.workspace
};

// ---------------------------------------------------------------------------------------- errors
DI_Status set_error(DI_Context* ctx, DI_Status st, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
void      clear_error(DI_Context* ctx);
DI_Status cuda_status(DI_Context* ctx, cudaError_t e, const char* what);  // OK if e == cudaSuccess
DI_Status launch_status(DI_Context* ctx, const char* op);                 // after <<<>>>
DI_Status use_device(DI_Context* ctx);                                    // cudaSetDevice if needed

#define DI_TRY(expr)                          \
    do {                                      \
        DI_Status st_ = (expr);               \
        if (st_ != DI_OK) return st_;         \
    } while (0)

// ---------------------------------------------------------------------------------------- checks
// struct_size / ext rules of abi/README.md section 2 for an args struct that begins with a header.
DI_Status check_header(DI_Context* ctx, const char* op, const void* args, size_t own_size,
                       const char* struct_name);
// Same rules for a struct whose first field is struct_size and which has ext at offset 8.
DI_Status check_sized(DI_Context* ctx, const char* what, const void* p, size_t own_size,
                      const char* struct_name, bool has_ext);

enum TensorFlags : uint32_t {
    T_OPTIONAL  = 1u << 0,   // data NULL means absent
    T_ALLOW_Q   = 1u << 1,   // may carry a quant descriptor
};

// Validates a tensor descriptor and builds its view. ndim < 0: any ndim. In query mode a required
// tensor may have data NULL. Absent optional tensors give v->q.base == NULL and DI_OK.
DI_Status take_tensor(DI_Context* ctx, const OpMode* mode, const char* op, const char* name,
                      const DI_Tensor& t, int ndim, uint32_t flags, QTensor* v);
bool      present(const DI_Tensor& t, const OpMode* mode, uint32_t flags);

DI_Status need_dtype(DI_Context* ctx, const char* op, const char* name, int dt, const int* allowed,
                     int n_allowed);
#define DI_NEED_DT(ctx, op, name, dt, ...)                                                       \
    do {                                                                                         \
        static const int allowed_[] = {__VA_ARGS__};                                             \
        DI_TRY(need_dtype(ctx, op, name, dt, allowed_, (int)(sizeof(allowed_) / sizeof(int)))); \
    } while (0)

// A weight operand of linear / moe_experts: a supported dtype, and scales where the dtype needs them.
DI_Status check_weight(DI_Context* ctx, const char* op, const char* name, const QTensor& w);

DI_Status need_shape(DI_Context* ctx, const char* op, const char* name, const DTensor& t, int dim,
                     int64_t expect, const char* what);
DI_Status same_shape(DI_Context* ctx, const char* op, const char* a_name, const DTensor& a,
                     const char* b_name, const DTensor& b);

// Workspace: the caller's if large enough, else stream-ordered memory freed after the op's
// kernels (cudaMallocAsync is capturable, so this also works inside graph capture).
struct Workspace {
    void*        ptr = nullptr;
    bool         owned = false;
    cudaStream_t stream = nullptr;
    DI_Status acquire(DI_Context* ctx, const DI_ArgsHeader& h, uint64_t bytes);
    void      release();
};

// Dynamic shared memory a kernel may ask for: AMD's LDS is 64 KB per workgroup (1 KB is left for the
// kernels' static part); NVIDIA sm_80+ allows up to 227 KB, and the kernels here stay under 200 KB.
constexpr size_t DYN_SMEM_MAX = DI_GPU_AMD ? 63 * 1024 : 200 * 1024;

inline uint64_t align256(uint64_t n) { return (n + 255) & ~uint64_t(255); }
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline unsigned grid_for(int64_t n, int threads, int64_t cap = 1 << 20) {
    int64_t g = ceil_div(n, threads);
    if (g < 1) g = 1;
    if (g > cap) g = cap;
    return (unsigned)g;
}

}  // namespace di

// ---------------------------------------------------------------------------------------- ops
// One per DI_Api op entry; defined in the op family files (norm.cu, rope.cu, ...; abi/OPS.md lists each op's).
#define DI_OP_DECL(id, name, Args, minor) DI_Status op_##name(DI_Context* ctx, const Args* a, di::OpMode* mode);
DI_OPS(DI_OP_DECL)
#undef DI_OP_DECL
