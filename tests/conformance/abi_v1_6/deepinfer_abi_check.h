/*
 * deepinfer ABI: a header-only validator built from the op table of deepinfer_abi.h.
 *
 * Optional for vendors: include it (after deepinfer_abi.h) to check every tensor argument of an op
 * call the way abi/README.md sections 2-5 and the DI_ARGS_<op> rows say, before the op's own
 * shape checks. It needs the C standard library only and is valid C99 and C++11. Nothing here is
 * part of the binary interface: it is code that reads the same tables every other consumer reads.
 *
 *   char msg[256];
 *   DI_Status st = di_check_op_args(DI_OP_LINEAR, args, DI_DEVICE_CUDA, query, 0, msg, sizeof msg);
 *   if (st != DI_OK) return my_set_error(ctx, st, "%s", msg);
 *
 * What it checks, per argument: presence (REQ / OPT), ndim, device_type, a known dtype with
 * lanes 1, non-negative shape and strides, a last stride of 1, even strides for 4-bit data, the
 * dtype against the row's plain or quantized set, and the whole quantization descriptor
 * (struct_size, ext, flags, scheme, nibble order, block, scales and zeros: rank, shape, dtype).
 * What it cannot check: shape relations between arguments (each op's own rules) and whether
 * memory is large enough (the ABI carries no buffer sizes).
 */
#ifndef DEEPINFER_ABI_CHECK_H
#define DEEPINFER_ABI_CHECK_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "deepinfer_abi.h"

#define DI_ROLE_IN 1
#define DI_ROLE_OUT 2
#define DI_ROLE_INOUT 3
#define DI_ARG_REQ 0u
#define DI_ARG_OPT 1u
#define DI_ARG_ARRAY 2u

/* di_check_op_args flags */
#define DI_CHECK_SKIP_ARRAYS 1u   /* the op validates its descriptor arrays itself */

typedef struct DI_ArgInfo {
    const char* name;
    uint32_t    offset;        /* of the DI_Tensor (or the const DI_Tensor* of an array) */
    int32_t     role;          /* DI_ROLE_* */
    uint32_t    flags;         /* DI_ARG_OPT, DI_ARG_ARRAY */
    int32_t     ndim_lo, ndim_hi;
    uint32_t    plain;         /* DI_DTS_* without a quant descriptor (0: must be quantized) */
    uint32_t    quant;         /* DI_DTS_* of q with one (0: plain only) */
    int32_t     count_offset;  /* arrays: offset of the int32 element count; -1 otherwise */
} DI_ArgInfo;

typedef struct DI_OpInfo {
    int32_t           id;
    const char*       name;
    const char*       struct_name;
    uint32_t          struct_size;   /* sizeof the args struct in this header */
    uint32_t          since_minor;
    const DI_ArgInfo* args;
    int32_t           n_args;
} DI_OpInfo;

/* One row of DI_ARGS_SINCE: a field appended to an op's args struct after the op (1.2 on). */
typedef struct DI_FieldSince {
    const char* op;
    const char* field;
    uint32_t    offset;        /* in the args struct: a caller's struct_size <= offset lacks the field */
    uint32_t    minor;
} DI_FieldSince;

#define DI_ROW_T_(S, f, r, p, lo, hi, pl, q) \
    {#f, (uint32_t)offsetof(S, f), DI_ROLE_##r, DI_ARG_##p, lo, hi, pl, q, -1},
#define DI_ROW_A_(S, f, r, p, lo, hi, pl, q, n) \
    {#f, (uint32_t)offsetof(S, f), DI_ROLE_##r, DI_ARG_##p | DI_ARG_ARRAY, lo, hi, pl, q, (int32_t)offsetof(S, n)},
#define DI_OPCOUNT_(id, name, S, minor) di_op_counted_##name,
#define DI_ARGTAB_(id, name, S, minor) static const DI_ArgInfo di_argtab_##name[] = {DI_ARGS_##name(DI_ROW_T_, DI_ROW_A_, S)};
#define DI_OPINFO_(id, name, S, minor) \
    {id, #name, #S, (uint32_t)sizeof(S), minor, di_argtab_##name, (int32_t)(sizeof(di_argtab_##name) / sizeof(DI_ArgInfo))},

/* Compile-time agreement of the op table with DI_Api: each op's entry sits at its id's position
 * (ids 0..15 from `embedding`, ids 16..27 from `spec_verify`, after the 1.1 entries, ids from 28 (1.6)
 * after 1.4's communicator entries) and takes the table's args struct (a mismatch fails to compile,
 * wherever this is included). */
#define DI_STATIC_CHECK_(name, cond) typedef char di_static_check_##name[(cond) ? 1 : -1]
#define DI_APIPOS_(id, name, S, minor)                                                                     \
    DI_STATIC_CHECK_(position_##name,                                                                     \
                     (id) < DI_OP_COUNT_V1_0                                                              \
                         ? offsetof(DI_Api, name) == offsetof(DI_Api, embedding) + (size_t)(id) * sizeof(void*) \
                     : (id) < DI_OP_COUNT_V1_5                                                            \
                         ? offsetof(DI_Api, name) == offsetof(DI_Api, spec_verify) +                      \
                                                         (size_t)((id) - DI_OP_SPEC_VERIFY) * sizeof(void*) \
                         : offsetof(DI_Api, name) == offsetof(DI_Api, comm_destroy) +                     \
                                                         (size_t)((id) - DI_OP_COUNT_V1_5 + 1) * sizeof(void*)); \
    DI_STATIC_CHECK_(args_##name, sizeof(((DI_Api*)0)->name((DI_Context*)0, (const S*)0)) == sizeof(DI_Status)); \
    DI_STATIC_CHECK_(minor_##name, ((id) < DI_OP_COUNT_V1_0) == ((minor) == 0) && (minor) <= DI_ABI_MINOR);
DI_OPS(DI_APIPOS_)
enum { DI_OPS(DI_OPCOUNT_) di_op_table_count_ };
DI_STATIC_CHECK_(op_count, (int)di_op_table_count_ == (int)DI_OP_COUNT_V1_6);
/* each DI_ARGS_SINCE row names a field of its op's args struct */
#define DI_SINCEPOS_(op, S, f, minor)                                                                      \
    DI_STATIC_CHECK_(since_##op##_##f, sizeof(((DI_Api*)0)->op((DI_Context*)0, (const S*)0)) == sizeof(DI_Status) && \
                                           offsetof(S, f) > 0);
DI_ARGS_SINCE(DI_SINCEPOS_)
#define DI_SINCEROW_(op, S, f, minor) {#op, #f, (uint32_t)offsetof(S, f), minor},

/* The fields appended to args structs after their ops (DI_ARGS_SINCE); *n gets the row count. */
static inline const DI_FieldSince* di_fields_since(int32_t* n) {
    static const DI_FieldSince rows[] = {DI_ARGS_SINCE(DI_SINCEROW_)};
    *n = (int32_t)(sizeof(rows) / sizeof(rows[0]));
    return rows;
}

/* The facts of op `op` (a DI_OpId), or NULL for an id this header does not know. */
static inline const DI_OpInfo* di_op_info(int32_t op) {
    DI_OPS(DI_ARGTAB_)
    static const DI_OpInfo infos[] = {DI_OPS(DI_OPINFO_)};
    if (op < 0 || op >= (int32_t)(sizeof(infos) / sizeof(infos[0]))) return NULL;
    return &infos[op];
}

/* The smallest header.struct_size a library accepts for op `op`: the size of its args struct in
 * the minor version that added the op (before any DI_ARGS_SINCE field). 0 for an unknown op. */
static inline uint32_t di_args_min_size(int32_t op) {
    const DI_OpInfo* info = di_op_info(op);
    if (!info) return 0;
    int32_t n;
    const DI_FieldSince* rows = di_fields_since(&n);
    uint32_t size = info->struct_size;
    for (int32_t i = 0; i < n; i++)
        if (!strcmp(rows[i].op, info->name) && rows[i].offset < size) size = rows[i].offset;
    return size;
}

/* Whether `size` (< this header's size) is the size of op's args struct in an earlier minor version:
 * the offset of a DI_ARGS_SINCE field that is the first field of its minor. */
static inline int di_args_older_size(int32_t op, uint32_t size) {
    const DI_OpInfo* info = di_op_info(op);
    if (!info) return 0;
    int32_t n, found = 0;
    const DI_FieldSince* rows = di_fields_since(&n);
    for (int32_t i = 0; i < n; i++)
        if (!strcmp(rows[i].op, info->name) && rows[i].offset == size) {
            found = 1;
            for (int32_t j = 0; j < n; j++)
                if (!strcmp(rows[j].op, info->name) && rows[j].offset < size && rows[j].minor >= rows[i].minor)
                    found = 0;
        }
    return found;
}

/* ---------------------------------------------------------------- dtypes */
static inline int32_t di_dtype_id(DI_DataType d) {
    if (d.lanes != 1) return DI_DT_INVALID;
    switch (d.code) {
        case DI_DTYPE_FLOAT: return d.bits == 32 ? DI_DT_F32 : d.bits == 16 ? DI_DT_F16 : DI_DT_INVALID;
        case DI_DTYPE_BFLOAT: return d.bits == 16 ? DI_DT_BF16 : DI_DT_INVALID;
        case DI_DTYPE_F8_E4M3FN: return d.bits == 8 ? DI_DT_E4M3 : DI_DT_INVALID;
        case DI_DTYPE_F8_E5M2: return d.bits == 8 ? DI_DT_E5M2 : DI_DT_INVALID;
        case DI_DTYPE_F8_E8M0FNU: return d.bits == 8 ? DI_DT_E8M0 : DI_DT_INVALID;
        case DI_DTYPE_F4_E2M1FN: return d.bits == 4 ? DI_DT_E2M1 : DI_DT_INVALID;
        case DI_DTYPE_INT:
            return d.bits == 4 ? DI_DT_I4 : d.bits == 8 ? DI_DT_I8 : d.bits == 32 ? DI_DT_I32
                 : d.bits == 64 ? DI_DT_I64 : DI_DT_INVALID;
        case DI_DTYPE_UINT: return d.bits == 4 ? DI_DT_U4 : d.bits == 8 ? DI_DT_U8 : d.bits == 64 ? DI_DT_U64
                                                                                               : DI_DT_INVALID;
        default: return DI_DT_INVALID;
    }
}

static inline const char* di_dtype_name(int32_t id) {
    static const char* names[DI_DT_COUNT] = {"invalid", "f32", "f16", "bf16", "e4m3", "e5m2", "e8m0", "e2m1",
                                             "int4", "uint4", "int8", "uint8", "int32", "int64", "uint64"};
    return id > 0 && id < DI_DT_COUNT ? names[id] : "invalid";
}

static inline int32_t di_dtype_bits(int32_t id) {
    static const int8_t bits[DI_DT_COUNT] = {0, 32, 16, 16, 8, 8, 8, 4, 4, 4, 8, 8, 32, 64, 64};
    return id > 0 && id < DI_DT_COUNT ? bits[id] : 0;
}

#define DI_DTS_ANY_FLOAT (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_F16) | DI_DTM(DI_DT_BF16) | DI_DTM(DI_DT_E4M3) | \
                          DI_DTM(DI_DT_E5M2) | DI_DTM(DI_DT_E8M0) | DI_DTM(DI_DT_E2M1))

/* "f32|bf16" */
static inline void di_dts_names(uint32_t set, char* buf, size_t n) {
    size_t used = 0;
    buf[0] = 0;
    for (int32_t d = 1; d < DI_DT_COUNT && used + 8 < n; d++)
        if (set & DI_DTM(d)) used += (size_t)snprintf(buf + used, n - used, "%s%s", used ? "|" : "", di_dtype_name(d));
}

/* ---------------------------------------------------------------- struct_size rules (section 2) */
/* `p` starts with a uint32 struct_size; `own` is this header's size of the struct. */
static inline DI_Status di_check_struct_size(const char* what, const char* struct_name, const void* p, uint32_t own,
                                             char* msg, size_t n) {
    uint32_t given = *(const uint32_t*)p;
    if (given < own) {
        snprintf(msg, n, "%s: struct_size %u < %u for %s", what, given, own, struct_name);
        return DI_INVALID_ARGUMENT;
    }
    const unsigned char* b = (const unsigned char*)p;
    for (uint32_t i = own; i < given; i++)
        if (b[i]) {
            snprintf(msg, n, "%s: %s has struct_size %u and a non-zero byte at offset %u; this library knows %u "
                     "bytes (a newer ABI field it cannot honour)", what, struct_name, given, i, own);
            return DI_UNIMPLEMENTED;
        }
    return DI_OK;
}

/*
 * The header.struct_size rule of an op's args (section 2, with DI_ARGS_SINCE): at least the op's
 * first size, and any bytes past this header's size zero. Then `copy` (this header's size, e.g. a
 * local of the op's args struct) receives the caller's struct with every field the caller does not
 * know zeroed (absent), so the op reads only fields the caller wrote; its struct_size becomes this
 * header's. copy may be NULL (check only).
 */
static inline DI_Status di_check_args_size(int32_t op, const void* args, void* copy, char* msg, size_t n) {
    const DI_OpInfo* info = di_op_info(op);
    if (!info) {
        snprintf(msg, n, "op id %d is not in this header's op table", op);
        return DI_UNIMPLEMENTED;
    }
    uint32_t given = ((const DI_ArgsHeader*)args)->struct_size, lo = di_args_min_size(op);
    if (given < lo) {
        snprintf(msg, n, "%s: struct_size %u < %u for %s", info->name, given, lo, info->struct_name);
        return DI_INVALID_ARGUMENT;
    }
    if (given < info->struct_size && !di_args_older_size(op, given)) {
        snprintf(msg, n, "%s: struct_size %u is no version's size of %s (%u in this header)", info->name, given,
                 info->struct_name, info->struct_size);
        return DI_INVALID_ARGUMENT;
    }
    DI_Status st = di_check_struct_size(info->name, info->struct_name, args, given < info->struct_size ? given
                                        : info->struct_size, msg, n);
    if (st) return st;
    if (copy) {
        uint32_t known = given < info->struct_size ? given : info->struct_size;
        memcpy(copy, args, known);
        memset((char*)copy + known, 0, info->struct_size - known);
        ((DI_ArgsHeader*)copy)->struct_size = info->struct_size;
    }
    return DI_OK;
}

/* ---------------------------------------------------------------- one tensor */
#define DI_CHK_FAIL_(st, ...)                 \
    do {                                      \
        snprintf(msg, n, __VA_ARGS__);        \
        return (st);                          \
    } while (0)

/* The layout rules every descriptor obeys (sections 3 and 4); *dt gets the dtype id. */
static inline DI_Status di_check_layout(const char* op, const char* name, const DI_Tensor* t, int32_t device_type,
                                        int32_t* dt, char* msg, size_t n) {
    if (t->ndim < 0 || t->ndim > DI_MAX_DIMS)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.ndim=%d is outside [0, %d]", op, name, t->ndim, DI_MAX_DIMS);
    if (t->device_type != device_type)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.device_type=%d, this library reads device type %d", op, name,
                     t->device_type, device_type);
    *dt = di_dtype_id(t->dtype);
    if (*dt == DI_DT_INVALID)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s has an unknown dtype (code %u, bits %u, lanes %u)", op, name,
                     t->dtype.code, t->dtype.bits, t->dtype.lanes);
    for (int32_t i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0)
            DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld is negative", op, name, i, (long long)t->shape[i]);
        if (i == t->ndim - 1) {
            if (t->strides[i] != 1)
                DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld, the last dimension must be contiguous "
                             "(stride 1)", op, name, i, (long long)t->strides[i]);
        } else if (t->strides[i] < 0) {
            DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld is negative", op, name, i,
                         (long long)t->strides[i]);
        } else if (di_dtype_bits(*dt) == 4 && (t->strides[i] & 1)) {
            DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.strides[%d]=%lld is odd; 4-bit rows must start on a byte "
                         "boundary", op, name, i, (long long)t->strides[i]);
        }
    }
    return DI_OK;
}

/* dt against `set`: another float where floats are taken is UNIMPLEMENTED, anything else INVALID */
static inline DI_Status di_check_dtype(const char* op, const char* name, int32_t dt, uint32_t set, char* msg,
                                       size_t n) {
    if (set & DI_DTM(dt)) return DI_OK;
    char want[128];
    di_dts_names(set, want, sizeof want);
    int unimpl = (DI_DTS_ANY_FLOAT & DI_DTM(dt)) && (DI_DTS_ANY_FLOAT & set);
    DI_CHK_FAIL_(unimpl ? DI_UNIMPLEMENTED : DI_INVALID_ARGUMENT, "%s: %s.dtype=%s is %s (takes %s)", op, name,
                 di_dtype_name(dt), unimpl ? "not supported" : "not accepted", want);
}

/* scales / zeros of a quantized tensor t: present, t's rank, the block grid's shape, dtype in set */
static inline DI_Status di_check_scale_tensor(const char* op, const char* name, const char* part, const DI_Tensor* t,
                                              const DI_Tensor* s, const int64_t* grid, uint32_t set,
                                              int32_t device_type, char* msg, size_t n) {
    char sn[96];
    snprintf(sn, sizeof sn, "%s.quant.%s", name, part);
    int32_t sdt;
    DI_Status st = di_check_layout(op, sn, s, device_type, &sdt, msg, n);
    if (st) return st;
    if (s->quant) DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s carries a quantization descriptor of its own", op, sn);
    if (s->ndim != t->ndim)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d (the tensor's rank)", op, sn, s->ndim, t->ndim);
    for (int32_t i = 0; i < t->ndim; i++)
        if (s->shape[i] != grid[i])
            DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.shape[%d]=%lld, expected %lld for %s.shape[%d]=%lld and block "
                         "(%d, %d)", op, sn, i, (long long)s->shape[i], (long long)grid[i], name, i,
                         (long long)t->shape[i], t->quant->block_rows, t->quant->block_cols);
    return di_check_dtype(op, sn, sdt, set, msg, n);
}

static inline DI_Status di_check_quant(const char* op, const char* name, const DI_Tensor* t, int32_t dt,
                                       uint32_t quant_set, int32_t device_type, int query, char* msg, size_t n) {
    const DI_Quant* q = t->quant;
    char what[96];
    snprintf(what, sizeof what, "%s: %s.quant", op, name);
    if (!quant_set)
        DI_CHK_FAIL_(DI_UNIMPLEMENTED, "%s: %s carries a quantization descriptor; this argument takes plain values "
                     "only", op, name);
    DI_Status st = di_check_struct_size(what, "DI_Quant", q, (uint32_t)sizeof(DI_Quant), msg, n);
    if (st) return st;
    if (q->ext) DI_CHK_FAIL_(DI_UNIMPLEMENTED, "%s.ext is set; no extensions are known", what);
    if (q->flags) DI_CHK_FAIL_(DI_UNIMPLEMENTED, "%s.flags=0x%x; no flags are defined", what, q->flags);
    if (q->scheme != DI_QUANT_BLOCK)
        DI_CHK_FAIL_(DI_UNIMPLEMENTED, "%s.scheme=%d; only DI_QUANT_BLOCK (1) is defined", what, q->scheme);
    if (di_dtype_bits(dt) == 4 && q->nibble_order != DI_NIBBLE_LOW_FIRST)
        DI_CHK_FAIL_(DI_UNIMPLEMENTED, "%s.nibble_order=%d; only DI_NIBBLE_LOW_FIRST (0) is defined", what,
                     q->nibble_order);
    if (q->block_rows < 0 || q->block_cols < 0)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: block (%d, %d) is negative", what, q->block_rows, q->block_cols);
    if (!(quant_set & DI_DTM(dt))) {
        char want[128];
        di_dts_names(quant_set, want, sizeof want);
        DI_CHK_FAIL_(DI_UNIMPLEMENTED, "%s: quantized storage dtype %s is not a format of this argument (takes %s)",
                     what, di_dtype_name(dt), want);
    }
    if (t->ndim < 1) DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: a quantized tensor needs ndim >= 1", what);
    int64_t R = t->ndim >= 2 ? t->shape[t->ndim - 2] : 1, C = t->shape[t->ndim - 1];
    int64_t br = q->block_rows ? q->block_rows : (R > 0 ? R : 1), bc = q->block_cols ? q->block_cols : (C > 0 ? C : 1);
    int64_t grid[DI_MAX_DIMS];
    for (int32_t i = 0; i < t->ndim; i++) grid[i] = t->shape[i];
    if (t->ndim >= 2) grid[t->ndim - 2] = (R + br - 1) / br;
    grid[t->ndim - 1] = (C + bc - 1) / bc;
    if (query ? q->scales.ndim == 0 && !q->scales.data : !q->scales.data)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s.scales is absent (data NULL); block quantization needs scales", what);
    st = di_check_scale_tensor(op, name, "scales", t, &q->scales, grid, DI_DTS_SCALES, device_type, msg, n);
    if (st) return st;
    if (q->zeros.data || (query && q->zeros.ndim > 0))
        return di_check_scale_tensor(op, name, "zeros", t, &q->zeros, grid, DI_DTS_ZEROS, device_type, msg, n);
    return DI_OK;
}

/*
 * One tensor argument against its row. query != 0 (op_query): data pointers may be NULL; a tensor
 * then counts as present when its ndim is set. *present says whether it was present.
 */
static inline DI_Status di_check_arg(const char* op, const DI_ArgInfo* a, const char* name, const DI_Tensor* t,
                                     int32_t device_type, int query, int* present, char* msg, size_t n) {
    int here = t->data != NULL || (query && t->ndim > 0);
    if (present) *present = here;
    if (!here) {
        if (a->flags & DI_ARG_OPT) return DI_OK;
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s is required but its data is NULL", op, name);
    }
    int32_t dt;
    DI_Status st = di_check_layout(op, name, t, device_type, &dt, msg, n);
    if (st) return st;
    if (t->ndim < a->ndim_lo || t->ndim > a->ndim_hi) {
        if (a->ndim_lo == a->ndim_hi)
            DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d", op, name, t->ndim, a->ndim_lo);
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s.ndim=%d, expected %d..%d", op, name, t->ndim, a->ndim_lo,
                     a->ndim_hi);
    }
    if (t->quant) return di_check_quant(op, name, t, dt, a->quant, device_type, query, msg, n);
    if (!a->plain)
        DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s has no quantization descriptor (dtype %s); it must be quantized",
                     op, name, di_dtype_name(dt));
    return di_check_dtype(op, name, dt, a->plain, msg, n);
}

/*
 * Every tensor argument of one op call (args: the op's args struct, header already checked).
 * device_type: where this library reads tensors (DI_DEVICE_CPU, DI_DEVICE_CUDA, ...).
 */
static inline DI_Status di_check_op_args(int32_t op, const void* args, int32_t device_type, int query,
                                         uint32_t flags, char* msg, size_t n) {
    const DI_OpInfo* info = di_op_info(op);
    if (!info) DI_CHK_FAIL_(DI_UNIMPLEMENTED, "op id %d is not in this header's op table", op);
    const char* base = (const char*)args;
    uint32_t given = ((const DI_ArgsHeader*)args)->struct_size;
    for (int32_t i = 0; i < info->n_args; i++) {
        const DI_ArgInfo* a = &info->args[i];
        uint32_t end = a->offset + (uint32_t)((a->flags & DI_ARG_ARRAY) ? sizeof(void*) : sizeof(DI_Tensor));
        if (end > given) continue;   /* a field the caller's struct_size leaves out: absent */
        if (a->flags & DI_ARG_ARRAY) {
            if (flags & DI_CHECK_SKIP_ARRAYS) continue;
            const DI_Tensor* arr = *(const DI_Tensor* const*)(base + a->offset);
            int32_t count = *(const int32_t*)(base + a->count_offset);
            if (count < 0) DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %d descriptors in %s", info->name, count, a->name);
            if (!arr) {
                if (count == 0) continue;
                DI_CHK_FAIL_(DI_INVALID_ARGUMENT, "%s: %s is NULL with %d descriptors", info->name, a->name, count);
            }
            for (int32_t e = 0; e < count; e++) {
                if (!arr[e].data && !(query && arr[e].ndim > 0)) continue;   /* not resident */
                char en[64];
                snprintf(en, sizeof en, "%s[%d]", a->name, e);
                DI_Status st = di_check_arg(info->name, a, en, &arr[e], device_type, query, NULL, msg, n);
                if (st) return st;
            }
            continue;
        }
        DI_Status st = di_check_arg(info->name, a, a->name, (const DI_Tensor*)(base + a->offset), device_type, query,
                                    NULL, msg, n);
        if (st) return st;
    }
    return DI_OK;
}

#undef DI_CHK_FAIL_

#endif /* DEEPINFER_ABI_CHECK_H */
