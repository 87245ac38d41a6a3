/* Row views, per-worker scratch and task chunking that several op files share (static inline: each
 * op file gets its own copy, as when they were static functions of the file that used them). */
#ifndef DI_CPU_OP_ROWS_H
#define DI_CPU_OP_ROWS_H

#include "di_cpu.h"

/* element offset of row r of t, rows being every dim but the last */
static inline int64_t row_off(const DI_Tensor* t, int64_t r) {
    int64_t off = 0;
    for (int i = t->ndim - 2; i >= 0; i--) {
        int64_t n = t->shape[i];
        off += (r % n) * t->strides[i];
        r /= n;
    }
    return off;
}
static inline int64_t n_rows(const DI_Tensor* t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim - 1; i++) n *= t->shape[i];
    return n;
}
static inline int64_t n_cols(const DI_Tensor* t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static inline char* row_ptr(const DI_Tensor* t, int dt, int64_t r) { return t_at(t, dt, row_off(t, r)); }

/* scratch: nw buffers of n floats each */
typedef struct { float* mem; size_t per; } Scratch;
static inline int scratch_init(Scratch* s, DI_Context* ctx, int64_t n) {
    s->per = (size_t)(n > 0 ? n : 1);
    s->mem = di_malloc((size_t)pool_size(ctx->pool) * s->per * sizeof(float));
    return s->mem != NULL;
}
static inline float* scratch_get(const Scratch* s, int worker, int i) { return s->mem + (size_t)worker * s->per + (size_t)i; }

/* tasks of `per` rows out of `rows` */
static inline int64_t chunks(int64_t rows, int64_t cols, int64_t* per) {
    int64_t p = cols >= 8192 ? 1 : 8192 / (cols ? cols : 1);
    if (p < 1) p = 1;
    *per = p;
    return (rows + p - 1) / p;
}

/* element i of a 1-d int32 / f32 tensor, row r of a 2-d int32 tensor (last stride 1) */
static inline int32_t ix1(const DI_Tensor* t, int64_t i) { return ((const int32_t*)t_base(t))[i * t->strides[0]]; }
static inline float fx1(const DI_Tensor* t, int64_t i) { return ((const float*)t_base(t))[i * t->strides[0]]; }
static inline const int32_t* ixrow(const DI_Tensor* t, int64_t r) {
    return (const int32_t*)t_base(t) + r * t->strides[0];
}
/* row (i, j) of a 3-d tensor */
static inline char* row3(const DI_Tensor* t, int dt, int64_t i, int64_t j) { return t_row2(t, dt, i, j); }

/* tasks of `per` rows out of `rows`, about 8192 elements a task (the rule of chunks above) */
static inline int64_t row_chunks(int64_t rows, int64_t cols, int64_t* per) {
    int64_t p = cols >= 8192 ? 1 : 8192 / (cols > 0 ? cols : 1);
    *per = p < 1 ? 1 : p;
    return (rows + *per - 1) / *per;
}

#endif
