// Memory-bound ops: embedding, rmsnorm, rope, mla_cache_write, add, mul, silu_mul, concat (layernorm, 1.3,
// is in ops_v4.cu with the other DeepSeek V4 / V3.2 ops).
// Each works on strided views through the generic loaders; all math in f32 (rope angles in f64).
#include "device.cuh"

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

// ---------------------------------------------------------------------------------------- rmsnorm
// One block per row; the row sum s lives in shared memory so residual_out may alias x or residual.
__global__ void k_rmsnorm(DTensor x, DTensor w, DTensor res, DTensor out, DTensor res_out, int64_t T, int64_t H,
                          float eps) {
    extern __shared__ float s[];
    __shared__ float red[MAX_WARPS];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        float ss = 0.f;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float v = load_f(x.dt, x.base, t * x.strides[0] + h);
            if (res.base) v += load_f(res.dt, res.base, t * res.strides[0] + h);
            s[h] = v;
            ss += v * v;
        }
        ss = block_sum(ss, red);  // also a barrier: every read of x and residual is done
        float r = rsqrtf(ss / (float)H + eps);
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float v = s[h];
            if (res_out.base) store_f(res_out.dt, res_out.base, t * res_out.strides[0] + h, v);
            store_f(out.dt, out.base, t * out.strides[0] + h, v * r * load_f(w.dt, w.base, h));
        }
        __syncthreads();
    }
}

DI_Status op_rmsnorm(DI_Context* ctx, const DI_RMSNormArgs* a, OpMode* mode) {
    const char* op = "rmsnorm";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_RMSNormArgs"));
    QTensor x, w, res, out, ro;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, 2, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "weight", a->weight, 1, 0, &w));
    DI_TRY(take_tensor(ctx, mode, op, "residual", a->residual, 2, T_OPTIONAL, &res));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, 2, 0, &out));
    DI_TRY(take_tensor(ctx, mode, op, "residual_out", a->residual_out, 2, T_OPTIONAL, &ro));
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "weight", w.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    if (res.q.base) {
        DI_NEED_DT(ctx, op, "residual", res.q.dt, FLOATS);
        DI_TRY(same_shape(ctx, op, "x", x.q, "residual", res.q));
    }
    if (ro.q.base) {
        DI_NEED_DT(ctx, op, "residual_out", ro.q.dt, FLOATS);
        DI_TRY(same_shape(ctx, op, "x", x.q, "residual_out", ro.q));
    }
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_shape(ctx, op, "weight", w.q, 0, x.q.shape[1], "x.shape[1]"));
    int64_t T = x.q.shape[0], H = x.q.shape[1];
    size_t smem = (size_t)H * sizeof(float);
    if (smem > DYN_SMEM_MAX)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: hidden size %lld exceeds this kernel's limit (%zu)", op,
                         (long long)H, DYN_SMEM_MAX / sizeof(float));
    if (!mode->launch || T == 0 || H == 0) return DI_OK;
    if (smem > 48 * 1024)
        (void)cudaFuncSetAttribute(k_rmsnorm, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    k_rmsnorm<<<grid_for(T, 1, 65535), 512, smem, (cudaStream_t)a->header.stream>>>(x.q, w.q, res.q, out.q, ro.q, T, H,
                                                                                 a->eps);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- rope
struct RopeP {
    int64_t T, H, D;
    int32_t interleaved, yarn;
    double  theta, factor, low, high, attn;
};

__global__ void k_rope(DTensor x, DTensor pos, DTensor out, RopeP p) {
    int64_t half = p.D / 2, n = p.T * p.H * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = i % half, th = i / half, h = th % p.H, t = th / p.H;
        double inv = pow(p.theta, -2.0 * (double)j / (double)p.D);
        if (p.yarn) {
            double ramp = ((double)j - p.low) / (p.high - p.low);
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            inv = inv / p.factor * ramp + inv * (1.0 - ramp);
        }
        double ang = (double)load_i(pos.dt, pos.base, t * pos.strides[0]) * inv;
        float c = (float)(cos(ang) * p.attn), s = (float)(sin(ang) * p.attn);
        int64_t xo = t * x.strides[0] + (x.ndim == 3 ? h * x.strides[1] : 0);
        int64_t oo = t * out.strides[0] + (out.ndim == 3 ? h * out.strides[1] : 0);
        int64_t i0 = p.interleaved ? 2 * j : j, i1 = p.interleaved ? 2 * j + 1 : j + half;
        float u = load_f(x.dt, x.base, xo + i0), v = load_f(x.dt, x.base, xo + i1);
        store_f(out.dt, out.base, oo + i0, u * c - v * s);
        store_f(out.dt, out.base, oo + i1, v * c + u * s);
    }
}

DI_Status op_rope(DI_Context* ctx, const DI_RopeArgs* a, OpMode* mode) {
    const char* op = "rope";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_RopeArgs"));
    QTensor x, pos, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, -1, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "positions", a->positions, 1, 0, &pos));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, -1, 0, &out));
    if (x.q.ndim != 2 && x.q.ndim != 3)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: x.ndim=%d, expected 2 ([T, D]) or 3 ([T, H, D])", op, x.q.ndim);
    DI_NEED_DT(ctx, op, "x", x.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "out", out.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "positions", pos.q.dt, DT_I32);
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    DI_TRY(need_shape(ctx, op, "positions", pos.q, 0, x.q.shape[0], "x.shape[0]"));
    int64_t D = x.q.shape[x.q.ndim - 1];
    if (D % 2) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: rotary dim D=%lld is odd", op, (long long)D);
    if (a->scaling != DI_ROPE_NONE && a->scaling != DI_ROPE_YARN)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: scaling=%d is not a known DI_RopeScaling", op, a->scaling);
    if (!(a->theta > 0.f)) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: theta=%g must be > 0", op, a->theta);
    RopeP p{};
    p.T = x.q.shape[0];
    p.H = x.q.ndim == 3 ? x.q.shape[1] : 1;
    p.D = D;
    p.interleaved = a->interleaved ? 1 : 0;
    p.theta = a->theta;
    p.attn = a->attn_factor;
    if (a->scaling == DI_ROPE_YARN) {
        if (!(a->factor > 0.f) || a->original_max_position <= 0 || !(a->beta_fast > 0.f) || !(a->beta_slow > 0.f))
            return set_error(ctx, DI_INVALID_ARGUMENT,
                             "%s: yarn needs factor, original_max_position, beta_fast and beta_slow > 0", op);
        const double PI = 3.14159265358979323846;
        auto dim = [&](double b) {
            return (double)D * log((double)a->original_max_position / (2.0 * PI * b)) / (2.0 * log((double)a->theta));
        };
        double lo = floor(dim(a->beta_fast)), hi = ceil(dim(a->beta_slow));
        lo = lo < 0 ? 0 : (lo > D - 1 ? D - 1 : lo);
        hi = hi < 0 ? 0 : (hi > D - 1 ? D - 1 : hi);
        if (lo == hi) hi += 0.001;
        p.yarn = 1;
        p.factor = a->factor;
        p.low = lo;
        p.high = hi;
    }
    if (!mode->launch) return DI_OK;
    int64_t n = p.T * p.H * (D / 2);
    if (n == 0) return DI_OK;
    k_rope<<<grid_for(n, 256), 256, 0, (cudaStream_t)a->header.stream>>>(x.q, pos.q, out.q, p);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- mla_cache_write
__global__ void k_cache_write(DTensor lat, DTensor kpe, DTensor slots, DTensor cache, int64_t T, int64_t Dc,
                              int64_t Dr) {
    int64_t NB = cache.shape[0], BS = cache.shape[1];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        int64_t slot = load_i(slots.dt, slots.base, t * slots.strides[0]);
        if (slot < 0 || slot >= NB * BS) continue;  // never write out of bounds
        int64_t base = (slot / BS) * cache.strides[0] + (slot % BS) * cache.strides[1];
        for (int64_t d = threadIdx.x; d < Dc + Dr; d += blockDim.x) {
            float v = d < Dc ? load_f(lat.dt, lat.base, t * lat.strides[0] + d)
                             : load_f(kpe.dt, kpe.base, t * kpe.strides[0] + d - Dc);
            store_f(cache.dt, cache.base, base + d, v);
        }
    }
}

DI_Status op_mla_cache_write(DI_Context* ctx, const DI_MLACacheWriteArgs* a, OpMode* mode) {
    const char* op = "mla_cache_write";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MLACacheWriteArgs"));
    QTensor lat, kpe, slots, cache;
    DI_TRY(take_tensor(ctx, mode, op, "latent", a->latent, 2, 0, &lat));
    DI_TRY(take_tensor(ctx, mode, op, "k_pe", a->k_pe, 2, 0, &kpe));
    DI_TRY(take_tensor(ctx, mode, op, "slots", a->slots, 1, 0, &slots));
    DI_TRY(take_tensor(ctx, mode, op, "cache", a->cache, 3, 0, &cache));
    DI_NEED_DT(ctx, op, "latent", lat.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "k_pe", kpe.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "slots", slots.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "cache", cache.q.dt, FLOATS);
    int64_t T = lat.q.shape[0], Dc = lat.q.shape[1], Dr = kpe.q.shape[1];
    DI_TRY(need_shape(ctx, op, "k_pe", kpe.q, 0, T, "latent.shape[0]"));
    DI_TRY(need_shape(ctx, op, "slots", slots.q, 0, T, "latent.shape[0]"));
    DI_TRY(need_shape(ctx, op, "cache", cache.q, 2, Dc + Dr, "Dc + Dr"));
    if (!mode->launch || T == 0) return DI_OK;
    k_cache_write<<<grid_for(T, 1, 65535), 256, 0, (cudaStream_t)a->header.stream>>>(lat.q, kpe.q, slots.q, cache.q, T,
                                                                                    Dc, Dr);
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
    k_silu_mul<<<grid_for(T * I, 256), 256, 0, (cudaStream_t)a->header.stream>>>(g.q, u.q, out.q, T, I, a->limit);
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
