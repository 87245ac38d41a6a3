/* Block quantization: the QMat view every quantized consumer uses, and the quantize /
 * dequantize ops. Both ops are bit-exact with the NumPy reference, so they stay scalar and do the
 * arithmetic in exactly the README's order: scale = amax / qmax (f32), optional power-of-two
 * rounding, store the scale in its dtype, then q = x / stored_scale rounded to nearest even. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "di_cpu.h"

int64_t lead_count(const DI_Tensor* t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim - 2; i++) n *= t->shape[i];
    return n;
}

int64_t lead_offset(const DI_Tensor* t, int64_t lead) {
    int64_t off = 0;
    for (int i = t->ndim - 3; i >= 0; i--) {
        int64_t n = t->shape[i];
        off += (lead % n) * t->strides[i];
        lead /= n;
    }
    return off;
}

void store_elem(int dt, void* base, int64_t e, float v) {
    uint8_t* p = (uint8_t*)base;
    switch (dt) {
    case DT_F32: ((float*)base)[e] = v; break;
    case DT_BF16: ((uint16_t*)base)[e] = f32_to_bf16(v); break;
    case DT_F16: ((uint16_t*)base)[e] = f32_to_f16(v); break;
    case DT_E4M3: p[e] = f32_to_e4m3(v); break;
    case DT_E8M0: p[e] = f32_to_e8m0(v); break;
    default: break;
    }
}

void qmat_init(QMat* m, const DI_Tensor* t, int64_t lead) {
    memset(m, 0, sizeof *m);
    m->dt = dt_id(t->dtype);
    int nd = t->ndim;
    m->R = nd >= 2 ? t->shape[nd - 2] : 1;
    m->C = nd >= 1 ? t->shape[nd - 1] : 1;
    m->rs = nd >= 2 ? t->strides[nd - 2] : 0;
    m->base = t_at(t, m->dt, lead_offset(t, lead));
    const DI_Quant* q = t->quant;
    if (!q) return;
    m->quant = 1;
    m->br = q->block_rows ? q->block_rows : (m->R ? m->R : 1);
    m->bc = q->block_cols ? q->block_cols : (m->C ? m->C : 1);
    m->nrb = (m->R + m->br - 1) / m->br;
    m->ncb = (m->C + m->bc - 1) / m->bc;
    const DI_Tensor* s = &q->scales;
    m->sdt = dt_id(s->dtype);
    m->sbase = t_at(s, m->sdt, lead_offset(s, lead));
    m->srs = s->ndim >= 2 ? s->strides[s->ndim - 2] : 0;
    m->scs = 1;
    if (q->zeros.data) {
        const DI_Tensor* z = &q->zeros;
        m->zdt = dt_id(z->dtype);
        m->zbase = t_at(z, m->zdt, lead_offset(z, lead));
        m->zrs = z->ndim >= 2 ? z->strides[z->ndim - 2] : 0;
        m->zcs = 1;
    }
}

void qmat_scale_row(const QMat* m, int64_t rb, float* s, float* z) {
    int sb = dt_bits(m->sdt), zb = m->zbase ? dt_bits(m->zdt) : 0;
    if (sb >= 8 && (!z || !m->zbase || zb >= 8)) {  /* contiguous rows of whole bytes: bulk convert */
        load_row(m->sdt, m->sbase + rb * m->srs * (sb / 8), 0, m->ncb, s);
        if (z) {
            if (m->zbase) load_row(m->zdt, m->zbase + rb * m->zrs * (zb / 8), 0, m->ncb, z);
            else memset(z, 0, (size_t)m->ncb * sizeof(float));
        }
        return;
    }
    for (int64_t cb = 0; cb < m->ncb; cb++) {
        s[cb] = ld_elem(m->sbase, m->sdt, rb * m->srs + cb);
        if (z) z[cb] = m->zbase ? ld_elem(m->zbase, m->zdt, rb * m->zrs + cb) : 0.0f;
    }
}

void qmat_dequant_row(const QMat* m, int64_t r, float* out) {
    const char* row = m->base + (dt_bits(m->dt) == 4 ? r * m->rs / 2 : r * m->rs * (dt_bits(m->dt) / 8));
    load_row(m->dt, row, 0, m->C, out);
    if (!m->quant) return;
    int64_t rb = r / m->br;
    for (int64_t cb = 0; cb < m->ncb; cb++) {
        float s = ld_elem(m->sbase, m->sdt, rb * m->srs + cb);
        int64_t c0 = cb * m->bc, c1 = c0 + m->bc < m->C ? c0 + m->bc : m->C;
        if (m->zbase) {
            float z = ld_elem(m->zbase, m->zdt, rb * m->zrs + cb);
            for (int64_t c = c0; c < c1; c++) out[c] = (out[c] - z) * s;
        } else {
            for (int64_t c = c0; c < c1; c++) out[c] = out[c] * s;
        }
    }
}

/* ------------------------------------------------------------------ quantize */
typedef struct {
    const DI_Tensor *x, *out;
    int xdt, qdt, sdt, pow2;
    int64_t R, C, br, bc, nrb, ncb;
    float qmax;
    float** scratch;  /* per worker, bc floats */
    _Atomic int bad_scale;
} QuantJob;

static void quantize_task(void* arg, int64_t task, int worker) {
    const QuantJob* j = (const QuantJob*)arg;
    int64_t lead = task / j->nrb, rb = task % j->nrb;
    const DI_Tensor *x = j->x, *o = j->out;
    const DI_Tensor* st = &o->quant->scales;
    int nd = x->ndim;
    int64_t xrs = nd >= 2 ? x->strides[nd - 2] : 0, ors = nd >= 2 ? o->strides[nd - 2] : 0;
    int64_t srs = st->ndim >= 2 ? st->strides[st->ndim - 2] : 0;
    const char* xb = t_at(x, j->xdt, lead_offset(x, lead));
    char* ob = t_at(o, j->qdt, lead_offset(o, lead));
    char* sb = t_at(st, j->sdt, lead_offset(st, lead));
    float* buf = j->scratch[worker];
    int xbytes = dt_bits(j->xdt) / 8;
    int64_t r0 = rb * j->br, r1 = r0 + j->br < j->R ? r0 + j->br : j->R;
    for (int64_t cb = 0; cb < j->ncb; cb++) {
        int64_t c0 = cb * j->bc, n = (c0 + j->bc < j->C ? c0 + j->bc : j->C) - c0;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; r++) {
            load_row(j->xdt, xb + r * xrs * xbytes, c0, n, buf);
            for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(buf[i]));
        }
        float scale = amax == 0.0f ? 1.0f : amax / j->qmax;
        if (j->pow2 && isfinite(scale) && scale > 0.0f) {
            int e;
            float mant = frexpf(scale, &e);  /* scale = mant * 2^e, mant in [0.5, 1) */
            scale = mant == 0.5f ? scale : ldexpf(1.0f, e);
        }
        store_elem(j->sdt, sb, rb * srs + cb, scale);
        float sf = ld_elem(sb, j->sdt, rb * srs + cb);  /* quantize with the scale as stored */
        if (sf == 0.0f || !isfinite(sf)) ((QuantJob*)j)->bad_scale = 1;
        for (int64_t r = r0; r < r1; r++) {
            load_row(j->xdt, xb + r * xrs * xbytes, c0, n, buf);
            if (j->qdt == DT_I8) {
                int8_t* q = (int8_t*)ob + r * ors + c0;
                for (int64_t i = 0; i < n; i++) {
                    float v = buf[i] / sf;
                    v = isnan(v) ? 0.0f : fminf(fmaxf(rintf(v), -127.0f), 127.0f);
                    q[i] = (int8_t)v;
                }
            } else if (j->qdt == DT_E4M3) {
                uint8_t* q = (uint8_t*)ob + r * ors + c0;
                for (int64_t i = 0; i < n; i++) q[i] = f32_to_e4m3(buf[i] / sf);
            } else {  /* 4-bit: int4 or e2m1, packed low nibble first */
                uint8_t* q = (uint8_t*)ob + r * ors / 2;
                for (int64_t i = 0; i < n; i++) {
                    float v = buf[i] / sf;
                    uint8_t code;
                    if (j->qdt == DT_I4) {
                        v = isnan(v) ? 0.0f : fminf(fmaxf(rintf(v), -7.0f), 7.0f);
                        code = (uint8_t)((int)v & 15);
                    } else {
                        code = f32_to_e2m1(v);
                    }
                    int64_t c = c0 + i;
                    int sh = (int)(c & 1) * 4;
                    q[c >> 1] = (uint8_t)((q[c >> 1] & ~(15 << sh)) | (code << sh));
                }
            }
        }
    }
    if (dt_bits(j->qdt) == 4 && (j->C & 1)) {  /* zero the padding nibble of odd rows */
        for (int64_t r = r0; r < r1; r++) {
            uint8_t* q = (uint8_t*)ob + r * ors / 2;
            q[j->C >> 1] &= 0x0f;
        }
    }
}

DI_Status op_quantize(DI_Context* ctx, const DI_QuantizeArgs* a, int query) {
    VC v = {ctx, "quantize", query};
    DI_Status st;
    if ((st = check_tensor(&v, &a->x, "x", 1, DI_MAX_DIMS, DTM_FLOAT_ACT, 0))) return st;
    if (!a->out.quant)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "quantize: out.quant is NULL; it must describe the blocks and "
                       "hold the scales tensor to write");
    uint32_t qmask = DTM(DT_I8) | DTM(DT_I4) | DTM(DT_E4M3) | DTM(DT_E2M1);
    if ((st = check_tensor(&v, &a->out, "out", 1, DI_MAX_DIMS, qmask, 1))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if (tensor_present(&v, &a->out.quant->zeros))
        return di_fail(ctx, DI_UNIMPLEMENTED, "quantize: out.quant.zeros is present; quantize is symmetric only");
    if (a->scale_pow2 != 0 && a->scale_pow2 != 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "quantize: scale_pow2=%d, expected 0 or 1", a->scale_pow2);
    if (query) return DI_OK;

    QuantJob j;
    memset(&j, 0, sizeof j);
    QMat m;
    qmat_init(&m, &a->out, 0);
    j.x = &a->x;
    j.out = &a->out;
    j.xdt = dt_id(a->x.dtype);
    j.qdt = m.dt;
    j.sdt = m.sdt;
    j.pow2 = a->scale_pow2;
    j.R = m.R; j.C = m.C; j.br = m.br; j.bc = m.bc; j.nrb = m.nrb; j.ncb = m.ncb;
    j.qmax = 0.0f;
    switch (j.qdt) {   /* DI_QMAX of the header's format table */
#define Q(dt, v) case dt: j.qmax = (float)(v); break;
        DI_QMAX(Q)
#undef Q
        default: break;
    }
    int64_t L = lead_count(&a->x);
    if (L == 0 || j.R == 0 || j.C == 0) return DI_OK;
    int nw = pool_size(ctx->pool);
    j.scratch = calloc((size_t)nw, sizeof(float*));
    size_t per = (size_t)(j.bc < j.C ? j.bc : j.C);  /* a block never holds more than one row's C */
    float* mem = di_malloc((size_t)nw * per * sizeof(float));
    if (!j.scratch || !mem) { free(j.scratch); free(mem); return DI_OOM(ctx, "quantize"); }
    for (int i = 0; i < nw; i++) j.scratch[i] = mem + (size_t)i * per;
    pool_run(ctx->pool, L * j.nrb, quantize_task, &j, L * j.R * j.C * 4);
    free(mem);
    free(j.scratch);
    if (j.bad_scale)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "quantize: a block scale is 0 or not finite once stored as %s "
                       "(input values too small, too large or not finite)", dt_name(j.sdt));
    return DI_OK;
}

/* ------------------------------------------------------------------ dequantize */
typedef struct {
    const DI_Tensor *x, *out;
    int odt;
    int64_t R, rows_per_task, tasks_per_lead;
    float** scratch;
} DequantJob;

static void dequant_task(void* arg, int64_t task, int worker) {
    const DequantJob* j = (const DequantJob*)arg;
    int64_t lead = task / j->tasks_per_lead, r0 = (task % j->tasks_per_lead) * j->rows_per_task;
    int64_t r1 = r0 + j->rows_per_task < j->R ? r0 + j->rows_per_task : j->R;
    QMat m;
    qmat_init(&m, j->x, lead);
    const DI_Tensor* o = j->out;
    int64_t ors = o->ndim >= 2 ? o->strides[o->ndim - 2] : 0;
    char* ob = t_at(o, j->odt, lead_offset(o, lead));
    int ob_bytes = dt_bits(j->odt) / 8;
    float* buf = j->scratch[worker];
    for (int64_t r = r0; r < r1; r++) {
        qmat_dequant_row(&m, r, buf);
        store_row(j->odt, ob + r * ors * ob_bytes, buf, m.C);
    }
}

DI_Status op_dequantize(DI_Context* ctx, const DI_DequantizeArgs* a, int query) {
    VC v = {ctx, "dequantize", query};
    DI_Status st;
    uint32_t xmask = DTM(DT_I4) | DTM(DT_U4) | DTM(DT_I8) | DTM(DT_U8) | DTM(DT_E4M3) |
                     DTM(DT_E2M1) | DTM_FLOAT_ACT;
    if ((st = check_tensor(&v, &a->x, "x", 1, DI_MAX_DIMS, xmask, 1))) return st;
    if ((st = check_tensor(&v, &a->out, "out", 1, DI_MAX_DIMS, DTM_FLOAT_ACT, 0))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if (!a->x.quant)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "dequantize: x has no quantization descriptor (dtype %s)",
                       dt_name(dt_id(a->x.dtype)));
    if (query) return DI_OK;
    DequantJob j;
    memset(&j, 0, sizeof j);
    j.x = &a->x;
    j.out = &a->out;
    j.odt = dt_id(a->out.dtype);
    int nd = a->x.ndim;
    j.R = nd >= 2 ? a->x.shape[nd - 2] : 1;
    int64_t C = a->x.shape[nd - 1], L = lead_count(&a->x);
    if (L == 0 || j.R == 0 || C == 0) return DI_OK;
    j.rows_per_task = C >= 4096 ? 4 : 32;
    j.tasks_per_lead = (j.R + j.rows_per_task - 1) / j.rows_per_task;
    int nw = pool_size(ctx->pool);
    j.scratch = calloc((size_t)nw, sizeof(float*));
    float* mem = di_malloc((size_t)nw * (size_t)C * sizeof(float));
    if (!j.scratch || !mem) { free(j.scratch); free(mem); return DI_OOM(ctx, "dequantize"); }
    for (int i = 0; i < nw; i++) j.scratch[i] = mem + (size_t)i * (size_t)C;
    pool_run(ctx->pool, L * j.tasks_per_lead, dequant_task, &j, L * j.R * C * 2);
    free(mem);
    free(j.scratch);
    return DI_OK;
}
