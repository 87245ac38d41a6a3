// Memory-bound elementwise ops: embedding, add, mul, silu_mul, concat.
// Each works on strided views through the generic loaders; all math in f32.
#include "device.cuh"
#include "pdl.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

// ---------------------------------------------------------------------------------------- embedding
__global__ void k_embedding(DTensor ids, DTensor table, DTensor out, int64_t T, int64_t H) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        int64_t id = load_i(ids.dt, ids.base, t * ids.strides[0]);
        bool ok = id >= 0 && id < table.shape[0];
        const char* row = table.base;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float v = ok ? load_f(table.dt, row, id * table.strides[0] + h) : 0.f;
            store_f(out.dt, out.base, t * out.strides[0] + h, v);
        }
    }
}

DI_Status op_embedding(DI_Context* ctx, const DI_EmbeddingArgs* a, OpMode* mode) {
    const char* op = "embedding";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_EmbeddingArgs"));
    QTensor ids, table, out;
    DI_TRY(take_tensor(ctx, mode, op, "ids", a->ids, 1, 0, &ids));
    DI_TRY(take_tensor(ctx, mode, op, "table", a->table, 2, 0, &table));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "ids", ids.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "table", table.q.dt, FLOATS, DT_F16);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, ids.q.shape[0], "ids.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, table.q.shape[1], "table.shape[1]"));
    if (!mode->launch) return DI_OK;
    int64_t T = ids.q.shape[0], H = table.q.shape[1];
    if (T == 0 || H == 0) return DI_OK;
    k_embedding<<<grid_for(T, 1, 65535), 256, 0, (cudaStream_t)a->header.stream>>>(ids.q, table.q, out.q, T, H);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- add, mul
// N-d elementwise over identical shapes; each element is read before it is written, so out may
// alias a or b.
struct NdIndex {
    int32_t ndim;
    int64_t shape[DI_MAX_DIMS];
};

__device__ __forceinline__ int64_t nd_offset(const NdIndex& ix, const DTensor& t, int64_t i) {
    int64_t off = 0;
    for (int d = ix.ndim - 1; d >= 0; --d) {
        int64_t n = ix.shape[d];
        off += (i % n) * t.strides[d];
        i /= n;
    }
    return off;
}

template <int OP>
__global__ void k_binary(DTensor a, DTensor b, DTensor out, NdIndex ix, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float x = load_f(a.dt, a.base, nd_offset(ix, a, i));
        float y = load_f(b.dt, b.base, nd_offset(ix, b, i));
        store_f(out.dt, out.base, nd_offset(ix, out, i), OP == 0 ? x + y : x * y);
    }
}

template <int OP>
static DI_Status binary(DI_Context* ctx, const DI_BinaryArgs* a, OpMode* mode, const char* op) {
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_BinaryArgs"));
    QTensor x, y, out;
    DI_TRY(take_tensor(ctx, mode, op, "a", a->a, -1, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "b", a->b, -1, 0, &y));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, -1, 0, &out));
    DI_NEED_DT(ctx, op, "a", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "b", y.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DI_TRY(same_shape(ctx, op, "a", x.q, "b", y.q));
    DI_TRY(same_shape(ctx, op, "a", x.q, "out", out.q));
    if (!mode->launch) return DI_OK;
    NdIndex ix{};
    ix.ndim = x.q.ndim;
    int64_t n = 1;
    for (int d = 0; d < x.q.ndim; ++d) n *= (ix.shape[d] = x.q.shape[d]);
    if (n == 0) return DI_OK;
    k_binary<OP><<<grid_for(n, 256), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, y.q, out.q, ix, n);
    return launch_status(ctx, op);
}

DI_Status op_add(DI_Context* ctx, const DI_BinaryArgs* a, OpMode* mode) { return binary<0>(ctx, a, mode, "add"); }
DI_Status op_mul(DI_Context* ctx, const DI_BinaryArgs* a, OpMode* mode) { return binary<1>(ctx, a, mode, "mul"); }

// ---------------------------------------------------------------------------------------- silu_mul
// limit > 0 (1.3): V4's clipped SwiGLU, gate capped above and up clamped on both sides (silu of a
// large negative gate is 0 anyway, so the gate has no lower clip)
__global__ void k_silu_mul(DTensor g, DTensor u, DTensor out, int64_t T, int64_t I, float limit) {
    pdl_wait();
    pdl_trigger();
    int64_t n = T * I;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / I, c = i % I;
        float x = load_f(g.dt, g.base, t * g.strides[0] + c);
        float y = load_f(u.dt, u.base, t * u.strides[0] + c);
        if (limit > 0.f) {
            x = fminf(x, limit);
            y = fminf(fmaxf(y, -limit), limit);
        }
        store_f(out.dt, out.base, t * out.strides[0] + c, x / (1.f + expf(-x)) * y);
    }
}

DI_Status op_silu_mul(DI_Context* ctx, const DI_SiluMulArgs* a, OpMode* mode) {
    const char* op = "silu_mul";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_SiluMulArgs"));
    QTensor g, u, out;
    DI_TRY(take_tensor(ctx, mode, op, "gate", a->gate, 2, 0, &g));
    DI_TRY(take_tensor(ctx, mode, op, "up", a->up, 2, 0, &u));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_NEED_DT(ctx, op, "gate", g.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "up", u.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DI_TRY(same_shape(ctx, op, "gate", g.q, "up", u.q));
    DI_TRY(same_shape(ctx, op, "gate", g.q, "out", out.q));
    // limit (1.3; zero for an older caller: api.cu zeroes the fields it does not know)
    if (!(isfinite(a->limit) && a->limit >= 0.f))
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: limit=%g must be finite and >= 0 (0 = no clipping)", op, a->limit);
    if (!mode->launch) return DI_OK;
    int64_t T = g.q.shape[0], I = g.q.shape[1];
    if (T * I == 0) return DI_OK;
    launch_pdl(k_silu_mul, grid_for(T * I, 256), 256, 0, (cudaStream_t)a->header.stream, g.q, u.q, out.q, T, I, a->limit);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- concat
// Same dtype everywhere: bytes are copied exactly (any non-packed dtype); otherwise via f32.
__global__ void k_concat(DTensor a, DTensor b, DTensor out, int64_t T, int64_t A, int64_t B, int32_t raw_bytes) {
    int64_t W = A + B, n = T * W;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / W, c = i % W;
        const DTensor& src = c < A ? a : b;
        int64_t so = t * src.strides[0] + (c < A ? c : c - A), oo = t * out.strides[0] + c;
        if (raw_bytes) {
            const char* s = src.base + so * raw_bytes;
            char* d = out.base + oo * raw_bytes;
            for (int k = 0; k < raw_bytes; ++k) d[k] = s[k];
        } else {
            store_f(out.dt, out.base, oo, load_f(src.dt, src.base, so));
        }
    }
}

DI_Status op_concat(DI_Context* ctx, const DI_ConcatArgs* a, OpMode* mode) {
    const char* op = "concat";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_ConcatArgs"));
    QTensor x, y, out;
    DI_TRY(take_tensor(ctx, mode, op, "a", a->a, 2, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "b", a->b, 2, 0, &y));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    bool same = x.q.dt == y.q.dt && x.q.dt == out.q.dt && !dt_is_packed(x.q.dt);
    if (!same) {
        DI_NEED_DT(ctx, op, "a", x.q.dt, FLOATS);
        DI_NEED_DT(ctx, op, "b", y.q.dt, FLOATS);
        DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    }
    int64_t T = x.q.shape[0], A = x.q.shape[1], B = y.q.shape[1];
    DI_TRY(need_shape(ctx, op, "b", y.q, 0, T, "a.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 0, T, "a.shape[0]"));
    DI_TRY(need_shape(ctx, op, "out", out.q, 1, A + B, "a.shape[1] + b.shape[1]"));
    if (!mode->launch || T * (A + B) == 0) return DI_OK;
    k_concat<<<grid_for(T * (A + B), 256), 256, 0, (cudaStream_t)a->header.stream>>>(
        x.q, y.q, out.q, T, A, B, same ? dt_bits(x.q.dt) / 8 : 0);
    return launch_status(ctx, op);
}
