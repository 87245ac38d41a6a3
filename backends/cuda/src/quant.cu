// quantize and dequantize. Quantize runs in two passes so that q is computed from the scale as
// stored (the rule of abi/README.md) and 4-bit outputs are written a whole byte at a time.
#include "device.cuh"

using namespace di;

// ---------------------------------------------------------------------------------------- dequantize
__global__ void k_dequantize(const __grid_constant__ QTensor x, DTensor out, int64_t L, int64_t R, int64_t C) {
    int64_t n = L * R * C;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t c = i % C, r = (i / C) % R, l = i / (C * R);
        float v = qload(x, l, r, c);
        int64_t oo = (out.ndim > 2 ? lead_offset(out, l) : 0) + rc_offset(out, r, c);
        store_f(out.dt, out.base, oo, v);
    }
}

static void rc_dims(const DTensor& t, int64_t* L, int64_t* R, int64_t* C) {
    *C = t.ndim >= 1 ? t.shape[t.ndim - 1] : 1;
    *R = t.ndim >= 2 ? t.shape[t.ndim - 2] : 1;
    int64_t l = 1;
    for (int d = 0; d + 2 < t.ndim; ++d) l *= t.shape[d];
    *L = l;
}

DI_Status op_dequantize(DI_Context* ctx, const DI_DequantizeArgs* a, OpMode* mode) {
    const char* op = "dequantize";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_DequantizeArgs"));
    QTensor x, out;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, -1, T_ALLOW_Q, &x));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, -1, 0, &out));
    DI_NEED_DT(ctx, op, "out", out.q.dt, DT_F32, DT_BF16);
    DI_NEED_DT(ctx, op, "x", x.q.dt, DT_E4M3, DT_E5M2, DT_E2M1, DT_I4, DT_U4, DT_I8, DT_U8);
    if (x.q.ndim < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: x.ndim must be >= 1", op);
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", out.q));
    if (!mode->launch) return DI_OK;
    int64_t L, R, C;
    rc_dims(x.q, &L, &R, &C);
    if (L * R * C == 0) return DI_OK;
    k_dequantize<<<grid_for(L * R * C, 256), 256, 0, (cudaStream_t)a->header.stream>>>(x, out.q, L, R, C);
    return launch_status(ctx, op);
}

// ---------------------------------------------------------------------------------------- quantize
// Scale as its storage dtype holds it (the value q is computed with).
__device__ float round_scale(int dt, float s, uint32_t* code) {
    switch (dt) {
        case DT_F32: *code = __float_as_uint(s); return s;
        case DT_BF16: { uint16_t b = f_to_bf16(s); *code = b; return bf16_to_f(b); }
        case DT_F16: { uint16_t h = __half_as_ushort(__float2half_rn(s)); *code = h; return f16_to_f(h); }
        case DT_E4M3: { uint8_t b = f_to_e4m3(s); *code = b; return e4m3_to_f(b); }
        case DT_E8M0: {
            // nearest power of two; a tie (mantissa exactly 1.5) goes to the even exponent code
            uint32_t u = __float_as_uint(s);
            int e = (int)((u >> 23) & 255);
            uint32_t m = u & 0x7fffff;
            if (e == 0) { *code = 0; return e8m0_to_f(0); }
            if (m > 0x400000u || (m == 0x400000u && (e & 1))) e += 1;
            if (e > 254) e = 254;
            *code = (uint32_t)e;
            return e8m0_to_f((uint32_t)e);
        }
        default: *code = 0; return s;
    }
}

__device__ void store_code(int dt, char* base, int64_t e, uint32_t code) {
    switch (dt) {
        case DT_F32: reinterpret_cast<uint32_t*>(base)[e] = code; break;
        case DT_BF16: case DT_F16: reinterpret_cast<uint16_t*>(base)[e] = (uint16_t)code; break;
        default: reinterpret_cast<uint8_t*>(base)[e] = (uint8_t)code; break;
    }
}

// Pass 1: one warp per quant block: amax, scale, stored scale.
__global__ void k_quant_scales(DTensor x, const __grid_constant__ QTensor o, int64_t L, int64_t R, int64_t C, float qmax, int pow2) {
    int64_t nrb = ceil_div(R, o.br), ncb = ceil_div(C, o.bc), nblk = L * nrb * ncb;
    int lane = lane_id();
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / LANES;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / LANES;
    for (int64_t b = warp; b < nblk; b += nwarps) {
        int64_t cb = b % ncb, rb = (b / ncb) % nrb, l = b / (ncb * nrb);
        int64_t r0 = rb * o.br, c0 = cb * o.bc;
        int64_t nr = min(o.br, R - r0), nc = min(o.bc, C - c0);
        int64_t lo = x.ndim > 2 ? lead_offset(x, l) : 0;
        float amax = 0.f;
        for (int64_t k = lane; k < nr * nc; k += LANES) {
            int64_t r = r0 + k / nc, c = c0 + k % nc;
            amax = fmaxf(amax, fabsf(load_f(x.dt, x.base, lo + rc_offset(x, r, c))));
        }
        amax = warp_max(amax);
        if (lane == 0) {
            float s = amax / qmax;
            if (amax == 0.f) s = 1.f;
            else if (pow2) {
                int E;
                float m = frexpf(s, &E);
                s = ldexpf(1.f, m == 0.5f ? E - 1 : E);
            }
            uint32_t code;
            round_scale(o.s.dt, s, &code);
            int64_t so = (o.s.ndim > 2 ? lead_offset(o.s, l) : 0) + rc_offset(o.s, rb, cb);
            store_code(o.s.dt, o.s.base, so, code);
        }
    }
}

__device__ __forceinline__ uint32_t quant_one(int dt, float v, float qmax) {
    switch (dt) {
        case DT_E4M3: return f_to_e4m3(v);
        case DT_E2M1: return f_to_e2m1(v);
        default: {
            float q = rintf(v);
            q = fminf(fmaxf(q, -qmax), qmax);
            if (q != q) q = 0.f;
            return (uint32_t)(int32_t)q;
        }
    }
}

// Pass 2: each thread one output byte (two elements for packed 4-bit dtypes).
__global__ void k_quant_values(DTensor x, const __grid_constant__ QTensor o, int64_t L, int64_t R, int64_t C, float qmax) {
    bool packed = o.q.dt == DT_I4 || o.q.dt == DT_E2M1;
    int64_t per_row = packed ? (C + 1) / 2 : C, n = L * R * per_row;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = i % per_row, r = (i / per_row) % R, l = i / (per_row * R);
        int64_t lx = x.ndim > 2 ? lead_offset(x, l) : 0, lq = o.q.ndim > 2 ? lead_offset(o.q, l) : 0;
        int64_t ls = o.s.ndim > 2 ? lead_offset(o.s, l) : 0;
        int cnt = packed ? 2 : 1;
        uint32_t codes[2] = {0, 0};
        for (int k = 0; k < cnt; ++k) {
            int64_t c = packed ? 2 * j + k : j;
            if (c >= C) break;
            float s = load_f(o.s.dt, o.s.base, ls + rc_offset(o.s, r / o.br, c / o.bc));
            float v = load_f(x.dt, x.base, lx + rc_offset(x, r, c)) / s;
            codes[k] = quant_one(o.q.dt, v, qmax);
        }
        int64_t e = lq + rc_offset(o.q, r, packed ? 2 * j : j);
        uint8_t* ob = reinterpret_cast<uint8_t*>(o.q.base);
        if (packed) ob[e >> 1] = (uint8_t)((codes[0] & 15) | ((codes[1] & 15) << 4));
        else ob[e] = (uint8_t)codes[0];
    }
}

DI_Status op_quantize(DI_Context* ctx, const DI_QuantizeArgs* a, OpMode* mode) {
    const char* op = "quantize";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_QuantizeArgs"));
    QTensor x, o;
    DI_TRY(take_tensor(ctx, mode, op, "x", a->x, -1, 0, &x));
    DI_TRY(take_tensor(ctx, mode, op, "out", a->out, -1, T_ALLOW_Q, &o));
    DI_NEED_DT(ctx, op, "x", x.q.dt, DT_F32, DT_BF16);
    DI_NEED_DT(ctx, op, "out", o.q.dt, DT_I8, DT_I4, DT_E4M3, DT_E2M1);
    if (x.q.ndim < 1) return set_error(ctx, DI_INVALID_ARGUMENT, "%s: x.ndim must be >= 1", op);
    DI_TRY(same_shape(ctx, op, "x", x.q, "out", o.q));
    if (o.mode == 0)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: out needs a quant descriptor (it receives the scales)", op);
    if (o.mode == 2)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: quantize is symmetric; out.quant->zeros must be absent", op);
    float qmax = 0.f;
    switch (o.q.dt) {   // DI_QMAX of the header's format table
#define Q(dt, v) case dt: qmax = (float)(v); break;
        DI_QMAX(Q)
#undef Q
        default: break;
    }
    if (!mode->launch) return DI_OK;
    int64_t L, R, C;
    rc_dims(x.q, &L, &R, &C);
    if (L * R * C == 0) return DI_OK;
    cudaStream_t s = (cudaStream_t)a->header.stream;
    int64_t nblk = L * ceil_div(R, o.br) * ceil_div(C, o.bc);
    k_quant_scales<<<grid_for(nblk * LANES, 256), 256, 0, s>>>(x.q, o, L, R, C, qmax, a->scale_pow2 ? 1 : 0);
    DI_TRY(launch_status(ctx, op));
    int64_t n = L * R * ((o.q.dt == DT_I4 || o.q.dt == DT_E2M1) ? (C + 1) / 2 : C);
    k_quant_values<<<grid_for(n, 256), 256, 0, s>>>(x.q, o, L, R, C, qmax);
    return launch_status(ctx, op);
}
