/*
 * deepinfer kernel ABI, version 1.7 (abi/CHANGELOG.md lists what each minor version added).
 *
 * A vendor library (libdeepinfer_<name>.so) is built against this header alone. It exports one
 * frozen symbol, deepinfer_plugin_info(), which returns a DI_PluginInfo. The host asks that struct
 * for the function table of the ABI major version it speaks (get_api). abi/README.md specifies
 * every struct and every op; read it before implementing one.
 *
 * Rules that never change (ABI-NOTES.md says where each was learned):
 *  - DI_PluginInfo is frozen forever: fields are never added, removed or reordered.
 *  - DI_Api and every args struct are append-only within a major version. Each begins with
 *    struct_size (the size the *writer* of the struct was compiled with); readers never touch
 *    bytes past it. A NULL function pointer means "unsupported". A field appended to an args
 *    struct after its op is listed in DI_ARGS_SINCE (op table) and is absent for an older caller.
 *  - Every failure is a DI_Status plus a message from last_error(ctx). Nothing aborts, exits or
 *    throws across this boundary.
 *  - The host allocates outputs and workspaces; all work goes onto the stream in the args.
 *
 *  - No struct has implicit padding: where alignment would leave bytes, a named `reserved` field
 *    (zero) holds them, so appending any field always changes sizeof and struct_size tells a
 *    library exactly which fields its caller knows. Reserved fields are never repurposed.
 *
 * The block between DI_CDEF_BEGIN and DI_CDEF_END is plain declarations only (no preprocessor
 * conditionals): the Python loader hands it verbatim to cffi, so the header is the single source
 * of truth for struct layouts, op names and op order. After it, DI_OPS and the DI_ARGS_<op>
 * X-macros are the one machine-readable statement of each op's arguments (role, optionality,
 * ranks, dtypes, quantization); deepinfer_abi_check.h turns them into a validator any library may
 * use, and the Python runtime parses the same lines.
 */
#ifndef DEEPINFER_ABI_H
#define DEEPINFER_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* DI_CDEF_BEGIN */

#define DI_ABI_MAJOR 1
#define DI_ABI_MINOR 7
#define DI_MAX_DIMS 6

/* ---------------------------------------------------------------- status codes */
typedef int32_t DI_Status;
enum DI_StatusCode {
    DI_OK                  = 0,
    DI_INVALID_ARGUMENT    = 1,  /* bad pointer, shape, dtype, stride or struct_size */
    DI_UNIMPLEMENTED       = 2,  /* valid request this library cannot do (format, dtype, field) */
    DI_RESOURCE_EXHAUSTED  = 3,  /* out of memory (host or device) */
    DI_FAILED_PRECONDITION = 4,  /* valid request in the wrong state (e.g. expert not resident) */
    DI_INTERNAL            = 5,  /* bug or device fault inside the library */
    DI_VERSION_MISMATCH    = 6   /* get_api asked for a major version the library lacks */
};

/* ---------------------------------------------------------------- data types (DLPack codes) */
enum DI_DTypeCode {
    DI_DTYPE_INT        = 0,   /* kDLInt: two's complement; bits 4, 8, 32, 64 */
    DI_DTYPE_UINT       = 1,   /* kDLUInt: bits 4, 8 */
    DI_DTYPE_FLOAT      = 2,   /* kDLFloat: bits 16, 32 */
    DI_DTYPE_BFLOAT     = 4,   /* kDLBfloat: bits 16 */
    DI_DTYPE_F8_E4M3FN  = 10,  /* kDLFloat8_e4m3fn: bits 8, max 448, no inf */
    DI_DTYPE_F8_E5M2    = 12,  /* kDLFloat8_e5m2 */
    DI_DTYPE_F8_E8M0FNU = 14,  /* kDLFloat8_e8m0fnu: power-of-two scales (ue8m0) */
    DI_DTYPE_F4_E2M1FN  = 17   /* kDLFloat4_e2m1fn: bits 4, max 6 */
};

/* Dense ids of the ABI's dtypes (bit i of a DI_DTS_* set below is id i); not a wire format. */
enum DI_DTypeId {
    DI_DT_INVALID = 0,
    DI_DT_F32 = 1, DI_DT_F16 = 2, DI_DT_BF16 = 3,
    DI_DT_E4M3 = 4, DI_DT_E5M2 = 5, DI_DT_E8M0 = 6, DI_DT_E2M1 = 7,
    DI_DT_I4 = 8, DI_DT_U4 = 9, DI_DT_I8 = 10, DI_DT_U8 = 11,
    DI_DT_I32 = 12, DI_DT_I64 = 13, DI_DT_U64 = 14,
    DI_DT_COUNT = 15
};

/* == DLPack's DLDataType */
typedef struct DI_DataType {
    uint8_t  code;   /* DI_DTypeCode */
    uint8_t  bits;
    uint16_t lanes;  /* always 1 in v1 */
} DI_DataType;

/* == DLPack's DLDeviceType values */
enum DI_DeviceType {
    DI_DEVICE_CPU  = 1,
    DI_DEVICE_CUDA = 2,
    DI_DEVICE_ROCM = 10,
    DI_DEVICE_EXT  = 12    /* vendor devices (e.g. Ascend) */
};

struct DI_Quant;

/*
 * A strided view of memory, the fields of DLPack's DLTensor plus an optional quantization
 * descriptor. shape and strides are in logical elements; strides[ndim-1] must be 1 (the last
 * dimension is contiguous). 4-bit dtypes are packed two per byte along the last dimension
 * (see DI_Quant.nibble_order) and every other stride must be even. A tensor whose data is NULL
 * is "absent" (optional inputs). The descriptor is borrowed for the duration of one call.
 */
typedef struct DI_Tensor {
    void*                  data;          /* base pointer in the device's address space */
    int32_t                device_type;   /* DI_DeviceType */
    int32_t                device_id;
    int32_t                ndim;          /* 0..DI_MAX_DIMS */
    DI_DataType            dtype;         /* storage type of the elements */
    int64_t                shape[DI_MAX_DIMS];
    int64_t                strides[DI_MAX_DIMS];
    uint64_t               byte_offset;   /* added to data before indexing */
    const struct DI_Quant* quant;         /* NULL: the elements are plain values */
} DI_Tensor;

/* ---------------------------------------------------------------- quantization */
enum DI_QuantScheme {
    DI_QUANT_BLOCK = 1   /* real = (q - zero) * scale, one scale per block of the last two dims */
};
enum DI_NibbleOrder {
    DI_NIBBLE_LOW_FIRST = 0  /* element 2i in bits 0..3 of byte i, element 2i+1 in bits 4..7 */
};

/*
 * Block-scaled quantization of the last two dimensions [R, C] of a tensor (a 1-d tensor is one
 * row). Block (block_rows, block_cols); 0 means "the whole dimension". Element (r, c) uses
 * scales[..., r / block_rows, c / block_cols]; edge blocks are partial and use their own scale.
 * Leading dimensions of the tensor index the leading dimensions of scales one to one.
 *   int4 group-wise g (sym)    : q int4,  block (1, g),     scales f32/bf16/f16
 *   int4 group-wise g (asym)   : q uint4, block (1, g),     scales + zeros (same shape)
 *   int8 per output channel    : q int8,  block (1, 0)
 *   fp8 e4m3 weights (DeepSeek): q e4m3,  block (128, 128), scales f32 (= weight_scale_inv)
 *   fp8 per-token-group acts   : q e4m3,  block (1, 128)
 *   int8 per-token acts        : q int8,  block (1, 0)
 *   fp4 e2m1                   : q e2m1,  block (1, 16|32), scales e4m3 or e8m0
 * Scales always multiply (DeepSeek's weight_scale_inv is such a multiplier).
 */
typedef struct DI_Quant {
    uint32_t    struct_size;
    uint32_t    flags;          /* reserved, 0 */
    const void* ext;            /* extension chain, NULL */
    int32_t     scheme;         /* DI_QuantScheme */
    int32_t     block_rows;
    int32_t     block_cols;
    int32_t     nibble_order;   /* DI_NibbleOrder, for 4-bit q */
    DI_Tensor   scales;         /* [..., ceil(R/br), ceil(C/bc)], any float dtype incl. e8m0 */
    DI_Tensor   zeros;          /* data NULL: symmetric; else same shape as scales */
} DI_Quant;

/* ---------------------------------------------------------------- contexts, streams, graphs */
typedef struct DI_Context DI_Context;   /* opaque, owned by the library */
typedef struct DI_Graph   DI_Graph;     /* opaque, owned by the library */
typedef void*             DI_Stream;    /* cudaStream_t / hipStream_t / ...; NULL = default */
typedef void*             DI_Event;     /* cudaEvent_t / hipEvent_t / ... (v1.1) */

typedef struct DI_ContextOptions {
    uint32_t    struct_size;
    uint32_t    reserved;
    const void* ext;
    int32_t     device_id;      /* which device of this library's kind */
    int32_t     num_threads;    /* host threads the library may use; 0 = its own choice */
} DI_ContextOptions;

enum DI_CopyKind {
    DI_COPY_HOST_TO_DEVICE   = 0,
    DI_COPY_DEVICE_TO_HOST   = 1,
    DI_COPY_DEVICE_TO_DEVICE = 2,
    DI_COPY_HOST_TO_HOST     = 3
};

enum DI_Support {
    DI_SUPPORT_NO   = 0,
    DI_SUPPORT_YES  = 1,
    DI_SUPPORT_SLOW = 2   /* correct, but a fallback the host may prefer to avoid */
};

typedef struct DI_OpQuery {
    uint32_t struct_size;
    int32_t  support;          /* DI_Support, written by the library */
    uint64_t workspace_size;   /* bytes the call needs in args.header.workspace */
} DI_OpQuery;

/* Every args struct starts with this header, so with struct_size and an extension pointer. */
typedef struct DI_ArgsHeader {
    uint32_t    struct_size;     /* sizeof the whole args struct as the caller compiled it */
    uint32_t    reserved;
    const void* ext;             /* extension chain, NULL in v1 */
    DI_Stream   stream;          /* all work of the call goes here */
    void*       workspace;       /* device memory of at least op_query's workspace_size */
    uint64_t    workspace_size;
} DI_ArgsHeader;

/* ---------------------------------------------------------------- op ids (= order in DI_Api) */
enum DI_OpId {
    DI_OP_EMBEDDING       = 0,
    DI_OP_RMSNORM         = 1,
    DI_OP_LINEAR          = 2,
    DI_OP_QUANTIZE        = 3,
    DI_OP_DEQUANTIZE      = 4,
    DI_OP_ROPE            = 5,
    DI_OP_MLA_CACHE_WRITE = 6,
    DI_OP_MLA_PREFILL     = 7,
    DI_OP_MLA_DECODE      = 8,
    DI_OP_MOE_ROUTER      = 9,
    DI_OP_MOE_EXPERTS     = 10,
    DI_OP_ADD             = 11,
    DI_OP_MUL             = 12,
    DI_OP_SILU_MUL        = 13,
    DI_OP_CONCAT          = 14,
    DI_OP_SAMPLE          = 15,
    DI_OP_COUNT_V1_0      = 16,
    DI_OP_COUNT_V1_1      = 16,  /* 1.1 added no ops */
    DI_OP_SPEC_VERIFY     = 16,  /* 1.2 */
    DI_OP_COUNT_V1_2      = 17,
    DI_OP_HC_PRE          = 17,  /* 1.3: DeepSeek V4 and V3.2 */
    DI_OP_HC_POST         = 18,
    DI_OP_KV_COMPRESS     = 19,
    DI_OP_INDEXER_TOPK    = 20,
    DI_OP_SPARSE_ATTENTION = 21,
    DI_OP_LAYERNORM       = 22,
    DI_OP_COUNT_V1_3      = 23,
    DI_OP_ALL_REDUCE      = 23,  /* 1.4: collectives over a DI_Comm, and MoE expert parallelism */
    DI_OP_ALL_GATHER      = 24,
    DI_OP_ALL_TO_ALL      = 25,
    DI_OP_MOE_DISPATCH    = 26,
    DI_OP_MOE_COMBINE     = 27,
    DI_OP_COUNT_V1_4      = 28,
    DI_OP_COUNT_V1_5      = 28,  /* 1.5 added no ops (moe_experts' expert_map and misses) */
    DI_OP_MLA_ROPE_CACHE_WRITE = 28,  /* 1.6: fused ops */
    DI_OP_COUNT_V1_6      = 29,
    DI_OP_COUNT_V1_7      = 29   /* 1.7 added no ops (sample's controls) */
};

/* ---------------------------------------------------------------- op args (README: semantics) */

/* out[t, :] = table[ids[t], :]; ids outside [0, V) give a zero row. */
typedef struct DI_EmbeddingArgs {
    DI_ArgsHeader header;
    DI_Tensor ids;       /* [T] int32 */
    DI_Tensor table;     /* [V, H] f32 | bf16 */
    DI_Tensor out;       /* [T, H] f32 | bf16 */
} DI_EmbeddingArgs;

/* s = x (+ residual); residual_out = s; out = s * rsqrt(mean(s^2) + eps) * weight */
typedef struct DI_RMSNormArgs {
    DI_ArgsHeader header;
    DI_Tensor x;             /* [T, H] */
    DI_Tensor weight;        /* [H] */
    DI_Tensor residual;      /* [T, H] or absent */
    DI_Tensor out;           /* [T, H] */
    DI_Tensor residual_out;  /* [T, H] or absent; may alias x or residual */
    float     eps;
    uint32_t  reserved;      /* 0 (was tail padding in 1.0) */
} DI_RMSNormArgs;

/* out = dequant(x) @ dequant(w)^T (+ bias); x plain or activation-quantized, w any format */
typedef struct DI_LinearArgs {
    DI_ArgsHeader header;
    DI_Tensor x;       /* [M, K] f32 | bf16 | int8 (1,0) | e4m3 (1,128) */
    DI_Tensor w;       /* [N, K] f32 | bf16 | quantized */
    DI_Tensor bias;    /* [N] or absent */
    DI_Tensor out;     /* [M, N] f32 | bf16 */
} DI_LinearArgs;

/* symmetric block quantization of x into out (q) and out.quant->scales (both written) */
typedef struct DI_QuantizeArgs {
    DI_ArgsHeader header;
    DI_Tensor x;               /* [..., R, C] f32 | bf16 */
    DI_Tensor out;             /* same shape, int8 | int4 | e4m3 | e2m1, quant describes blocks */
    int32_t   scale_pow2;      /* 1: round each scale up to a power of two (ue8m0 style) */
    uint32_t  reserved;        /* 0 (was tail padding in 1.0) */
} DI_QuantizeArgs;

/* out = (q - zero) * scale, computed in f32, then rounded to out's dtype; bit-exact */
typedef struct DI_DequantizeArgs {
    DI_ArgsHeader header;
    DI_Tensor x;       /* quantized, any format */
    DI_Tensor out;     /* same shape, f32 | bf16 */
} DI_DequantizeArgs;

enum DI_RopeScaling { DI_ROPE_NONE = 0, DI_ROPE_YARN = 1 };

/* rotary embedding of the last dim of x at positions; out may alias x */
typedef struct DI_RopeArgs {
    DI_ArgsHeader header;
    DI_Tensor x;                 /* [T, H, D] or [T, D], D even */
    DI_Tensor positions;         /* [T] int32; may be negative (rotation by -p: V4 un-rotates outputs) */
    DI_Tensor out;               /* same shape as x */
    int32_t   interleaved;       /* 1: pairs (2i, 2i+1); 0: pairs (i, i + D/2) */
    int32_t   scaling;           /* DI_RopeScaling */
    float     theta;             /* base */
    float     factor;            /* yarn */
    int32_t   original_max_position;
    float     beta_fast;
    float     beta_slow;
    float     attn_factor;       /* multiplies cos and sin (1.0 unless the config says) */
} DI_RopeArgs;

/* cache[slot / BS, slot % BS, :] = concat(latent[t], k_pe[t]) for slot = slots[t] >= 0 */
typedef struct DI_MLACacheWriteArgs {
    DI_ArgsHeader header;
    DI_Tensor latent;    /* [T, Dc] */
    DI_Tensor k_pe;      /* [T, Dr] */
    DI_Tensor slots;     /* [T] int32; -1 = skip */
    DI_Tensor cache;     /* [NB, BS, Dc + Dr] */
} DI_MLACacheWriteArgs;

/* causal MLA attention of fresh sequences packed along T, keys and values un-absorbed */
typedef struct DI_MLAPrefillArgs {
    DI_ArgsHeader header;
    DI_Tensor q;           /* [T, H, Dn + Dr], rope already applied to the last Dr */
    DI_Tensor kv;          /* [T, H, Dn + Dv]: k_nope then v */
    DI_Tensor k_pe;        /* [T, Dr], shared by all heads, rope applied */
    DI_Tensor cu_seqlens;  /* [S + 1] int32, cu_seqlens[0] = 0, cu_seqlens[S] = T */
    DI_Tensor out;         /* [T, H, Dv] */
    float     scale;       /* softmax scale */
    uint32_t  reserved;    /* 0 (was tail padding in 1.0) */
} DI_MLAPrefillArgs;

/* MLA attention of T query tokens over the paged latent cache with absorbed kv_b weights */
typedef struct DI_MLADecodeArgs {
    DI_ArgsHeader header;
    DI_Tensor q;            /* [T, H, Dn + Dr], rope applied */
    DI_Tensor wkv_b;        /* [H * (Dn + Dv), Dc] f32 | bf16 (kv_b_proj.weight) */
    DI_Tensor cache;        /* [NB, BS, Dc + Dr] */
    DI_Tensor block_table;  /* [S, MB] int32 */
    DI_Tensor token_seq;    /* [T] int32: the sequence (row of block_table) of each token */
    DI_Tensor kv_len;       /* [T] int32: token t attends to positions [0, kv_len[t]) */
    DI_Tensor out;          /* [T, H, Dv] */
    float     scale;
    uint32_t  reserved;     /* 0 (was tail padding in 1.0) */
    /* ---- v1.3 (DI_ARGS_SINCE) ---- */
    DI_Tensor indices;      /* [T, K] int32 or absent: the only positions token t attends (V3.2's
                               sparse attention); entries < 0 or >= kv_len[t] are skipped */
} DI_MLADecodeArgs;

enum DI_Scoring    { DI_SCORING_SOFTMAX = 0, DI_SCORING_SIGMOID = 1, DI_SCORING_SQRTSOFTPLUS = 2 /* 1.3 */ };
enum DI_GroupScore { DI_GROUP_SCORE_MAX = 0, DI_GROUP_SCORE_SUM_TOP2 = 1 };

/* DeepSeek MoE gate: scores, biased selection, group-limited top-k, normalize, scale */
typedef struct DI_MoERouterArgs {
    DI_ArgsHeader header;
    DI_Tensor logits;           /* [T, E] f32 */
    DI_Tensor bias;             /* [E] f32 e_score_correction_bias, or absent */
    DI_Tensor topk_ids;         /* [T, K] int32, written */
    DI_Tensor topk_weights;     /* [T, K] f32, written */
    int32_t   scoring;          /* DI_Scoring */
    int32_t   n_group;          /* 1 = no grouping */
    int32_t   topk_group;
    int32_t   group_score;      /* DI_GroupScore */
    int32_t   norm_topk_prob;
    float     routed_scaling_factor;
    /* ---- v1.3 (DI_ARGS_SINCE): hash routing, both present or both absent ---- */
    DI_Tensor token_ids;        /* [T] int32: the token at each row */
    DI_Tensor hash_table;       /* [V, K] int32: the experts of each token id (V4's tid2eid) */
} DI_MoERouterArgs;

/* out[t] (+)= sum_k w[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t,k] */
typedef struct DI_MoEExpertsArgs {
    DI_ArgsHeader    header;
    DI_Tensor        x;              /* [T, H] */
    DI_Tensor        topk_ids;       /* [T, K] int32; ids outside [0, E) are skipped */
    DI_Tensor        topk_weights;   /* [T, K] f32 */
    int32_t          num_experts;    /* E: length of the three arrays below */
    int32_t          accumulate;     /* 1: add into out; 0: overwrite */
    const DI_Tensor* w_gate;         /* E x [I, H]; data NULL = not resident */
    const DI_Tensor* w_up;           /* E x [I, H] */
    const DI_Tensor* w_down;         /* E x [H, I] */
    DI_Tensor        out;            /* [T, H] */
    /* ---- v1.3 (DI_ARGS_SINCE) ---- */
    float            swiglu_limit;   /* > 0: gate = min(gate, limit), up = clamp(up, -limit, limit) */
    uint32_t         reserved;       /* 0 */
    /* ---- v1.5 (DI_ARGS_SINCE): an expert cache's device-side table ---- */
    DI_Tensor        expert_map;     /* [M] int32 or absent: pair (t, k) uses descriptor expert_map[topk_ids[t, k]]
                                      * for ids in [0, M); an entry < 0 or a non-resident descriptor: not resident */
    DI_Tensor        misses;         /* [T, K] int32, required with expert_map: 1 = the pair's expert was not
                                      * resident and the pair was skipped, else 0 (written for every pair) */
} DI_MoEExpertsArgs;

/* out = a + b (same shape); out may alias a or b */
typedef struct DI_BinaryArgs {
    DI_ArgsHeader header;
    DI_Tensor a;
    DI_Tensor b;
    DI_Tensor out;
} DI_BinaryArgs;

/* out = silu(gate) * up (gate and up clipped first when limit > 0, 1.3) */
typedef struct DI_SiluMulArgs {
    DI_ArgsHeader header;
    DI_Tensor gate;   /* [T, I] */
    DI_Tensor up;     /* [T, I] */
    DI_Tensor out;    /* [T, I] */
    /* ---- v1.3 (DI_ARGS_SINCE) ---- */
    float     limit;      /* > 0: gate = min(gate, limit), up = clamp(up, -limit, limit) */
    uint32_t  reserved;   /* 0 */
} DI_SiluMulArgs;

/* out = concat(a, b) along the last dimension */
typedef struct DI_ConcatArgs {
    DI_ArgsHeader header;
    DI_Tensor a;      /* [T, A] */
    DI_Tensor b;      /* [T, B] */
    DI_Tensor out;    /* [T, A + B] */
} DI_ConcatArgs;

/* one token per row: greedy when temperature <= 0, else seeded top-k / top-p sampling; 1.7's controls
 * (logit bias, penalties over each row's history, an allowed-token mask) first adjust the row's logits */
typedef struct DI_SampleArgs {
    DI_ArgsHeader header;
    DI_Tensor logits;        /* [B, V] f32 */
    DI_Tensor temperature;   /* [B] f32 */
    DI_Tensor top_k;         /* [B] int32, 0 = off */
    DI_Tensor top_p;         /* [B] f32, 1 = off */
    DI_Tensor seeds;         /* [B] uint64 */
    DI_Tensor out;           /* [B] int32 */
    /* ---- v1.2 (DI_ARGS_SINCE): absent when struct_size ends before it ---- */
    DI_Tensor probs;         /* [B] f32 or absent: the probability out[b] had when drawn */
    /* ---- v1.7 (DI_ARGS_SINCE): sampling controls, each group all present or all absent ---- */
    DI_Tensor history;       /* [B, L] int32: row b's prompt tokens, then its generated ones; ids outside [0, V) pad */
    DI_Tensor prompt_lens;   /* [B] int32: history[b, :prompt_lens[b]] is prompt (repetition penalty only) */
    DI_Tensor penalties;     /* [B, 3] f32: repetition (1 = off, > 0), frequency (0 = off), presence (0 = off) */
    DI_Tensor bias_ids;      /* [B, N] int32 or absent: logit_bias token ids (distinct); outside [0, V) = unused */
    DI_Tensor bias;          /* [B, N] f32: added to logits[b, bias_ids[b, n]]; finite or -inf */
    DI_Tensor token_mask;    /* [B, ceil(V/32)] int32 or absent: bit v%32 of word v/32 clear = token v banned */
} DI_SampleArgs;

/* speculative sampling: accept or replace each draft token so that out[t] ~ the target's p (v1.2) */
typedef struct DI_SpecVerifyArgs {
    DI_ArgsHeader header;
    DI_Tensor logits;        /* [T, V] f32: the target model's logits, one row per verified position */
    DI_Tensor draft_logits;  /* [T, V] f32 or absent (absent: greedy drafts, q one-hot at draft_ids) */
    DI_Tensor draft_ids;     /* [T] int32: the draft token judged at row t; < 0 = none (bonus row) */
    DI_Tensor temperature;   /* [T] f32 */
    DI_Tensor top_k;         /* [T] int32, 0 = off */
    DI_Tensor top_p;         /* [T] f32, 1 = off */
    DI_Tensor seeds;         /* [T] uint64 */
    DI_Tensor out;           /* [T] int32: the token at row t */
    DI_Tensor accepted;      /* [T] int32: 1 = out[t] is draft_ids[t] and was accepted */
} DI_SpecVerifyArgs;

/* ---- 1.3: DeepSeek V4 (hyper-connections, compressed and sparse attention) and V3.2 (DSA) ---- */

/* manifold-constrained hyper-connection, entering a block: mixing weights from the N residual
 * streams, and the streams collapsed into the block's input (README section 8, hc_pre) */
typedef struct DI_HCPreArgs {
    DI_ArgsHeader header;
    DI_Tensor x;        /* [T, N, H] f32 | bf16: the N residual streams of each token */
    DI_Tensor fn;       /* [M, N * H] f32: M = (2 + N) * N (pre, post, comb) or N (pre only) */
    DI_Tensor base;     /* [M] f32 */
    DI_Tensor scale;    /* [3] f32 (pre, post, comb), or [1] when M = N */
    DI_Tensor out;      /* [T, H] f32 | bf16: sum_n pre[t, n] * x[t, n, :] */
    DI_Tensor post;     /* [T, N] f32: written when M = (2 + N) * N, else absent */
    DI_Tensor comb;     /* [T, N, N] f32: written when M = (2 + N) * N, else absent */
    float     eps;             /* the RMS norm's epsilon */
    float     hc_eps;          /* added to pre and comb; floor of the Sinkhorn denominators */
    int32_t   sinkhorn_iters;  /* >= 1 */
    uint32_t  reserved;        /* 0 */
} DI_HCPreArgs;

/* hyper-connection, leaving a block: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j] */
typedef struct DI_HCPostArgs {
    DI_ArgsHeader header;
    DI_Tensor x;        /* [T, N, H] f32 | bf16: the streams that entered the block */
    DI_Tensor y;        /* [T, H]: the block's output */
    DI_Tensor post;     /* [T, N] f32 */
    DI_Tensor comb;     /* [T, N, N] f32 */
    DI_Tensor out;      /* [T, N, H]; must not overlap x */
} DI_HCPostArgs;

/* V4's KV compressor: the rows whose position closes a window of `ratio` tokens get the
 * softmax-gated sum of the window's staged values (overlap: two windows), the others zero */
typedef struct DI_KVCompressArgs {
    DI_ArgsHeader header;
    DI_Tensor staged;         /* [NB, BS, 2W] f32 | bf16, paged per token: values [0, W), gate logits [W, 2W) */
    DI_Tensor position_bias;  /* [ratio, W] f32, added to the gate logits */
    DI_Tensor block_table;    /* [S, MB] int32 */
    DI_Tensor token_seq;      /* [T] int32 */
    DI_Tensor positions;      /* [T] int32 */
    DI_Tensor out;            /* [T, D] f32 | bf16; D = W (overlap 0) or W / 2 (overlap 1) */
    int32_t   ratio;          /* tokens per window, >= 1 */
    int32_t   overlap;        /* 1: entry w pools the first halves of window w-1 and the second halves of window w */
} DI_KVCompressArgs;

/* lightning indexer: the K paged entries of highest score sum_h w[t,h] relu(q[t,h] . key) per row */
typedef struct DI_IndexerTopkArgs {
    DI_ArgsHeader header;
    DI_Tensor q;            /* [T, NI, Di] f32 | bf16 */
    DI_Tensor weights;      /* [T, NI] f32 */
    DI_Tensor keys;         /* [NB, CB, Di] f32 | bf16: entry keys, CB = max(1, block_size / ratio) a block */
    DI_Tensor block_table;  /* [S, MB] int32 */
    DI_Tensor token_seq;    /* [T] int32 */
    DI_Tensor kv_len;       /* [T] int32: entries e < kv_len[t] / ratio are visible to row t */
    DI_Tensor out;          /* [T, K] int32: visible entries by descending score, ties to the lower e; -1 after the last */
    float     scale;        /* multiplies every score */
    int32_t   ratio;        /* tokens an entry covers (1: an entry per token) */
    int32_t   block_size;   /* tokens per block of block_table */
    uint32_t  reserved;     /* 0 */
} DI_IndexerTopkArgs;

/* V4 attention: one shared key = value per position (MQA), a sliding window of the paged cache plus
 * compressed entries (all visible ones, or those listed in indices), with a per-head sink */
typedef struct DI_SparseAttentionArgs {
    DI_ArgsHeader header;
    DI_Tensor q;            /* [T, NH, D] f32 | bf16, rope applied */
    DI_Tensor kv_cache;     /* [NB, BS, D] f32 | bf16: one key (= value) per token */
    DI_Tensor comp_cache;   /* [NB, CB, D] or absent: compressed entries, CB = max(1, BS / ratio) a block */
    DI_Tensor indices;      /* [T, K] int32 or absent (all visible entries): the entries row t attends; < 0 skipped */
    DI_Tensor sinks;        /* [NH] f32 or absent: a logit per head that joins the softmax, with no value */
    DI_Tensor block_table;  /* [S, MB] int32 */
    DI_Tensor token_seq;    /* [T] int32 */
    DI_Tensor kv_len;       /* [T] int32: row t is the query at position kv_len[t] - 1 */
    DI_Tensor out;          /* [T, NH, D] */
    float     scale;
    int32_t   window;       /* positions [kv_len - window, kv_len); 0: all of [0, kv_len) */
    int32_t   ratio;        /* tokens a compressed entry covers; entries e < kv_len[t] / ratio are visible */
    uint32_t  reserved;     /* 0 */
} DI_SparseAttentionArgs;

/* out = (x - mean(x)) * rsqrt(var(x) + eps) * weight (+ bias), over the last dim */
typedef struct DI_LayerNormArgs {
    DI_ArgsHeader header;
    DI_Tensor x;        /* [T, H] f32 | bf16 */
    DI_Tensor weight;   /* [H] */
    DI_Tensor bias;     /* [H] or absent */
    DI_Tensor out;      /* [T, H] */
    float     eps;
    uint32_t  reserved; /* 0 */
} DI_LayerNormArgs;

/* ---- 1.4: processes that work on one model together (README section 9) ---- */

/* A communicator: nranks processes of one job (one per GPU, or per CPU rank) that run the
 * collective ops below together, each on its own stream. Opaque, owned by the library. */
typedef struct DI_Comm DI_Comm;

/* What comm_create needs to join a communicator. One rank makes it (comm_unique_id); the runtime
 * hands the same bytes to every rank (the library never learns how). */
typedef struct DI_CommId {
    uint8_t bytes[128];
} DI_CommId;

/* out = the sum over all ranks of their x (f32 accumulation; every rank gets the same out) */
typedef struct DI_AllReduceArgs {
    DI_ArgsHeader header;
    DI_Comm*  comm;
    DI_Tensor x;        /* [...] f32 | bf16, contiguous */
    DI_Tensor out;      /* same shape and dtype, contiguous; may alias x */
} DI_AllReduceArgs;

/* out[r] = x of rank r, on every rank */
typedef struct DI_AllGatherArgs {
    DI_ArgsHeader header;
    DI_Comm*  comm;
    DI_Tensor x;        /* [...] contiguous, the same shape on every rank */
    DI_Tensor out;      /* [N, ...] same dtype, contiguous; must not overlap x */
} DI_AllGatherArgs;

/* slot p of send goes to rank p and arrives in slot q (the sender's rank) of rank p's recv. With
 * counts only the first send_counts[p] rows (along dim 1) of slot p travel, recv_counts[q] says
 * how many arrived from rank q, and recv rows past it are unspecified. */
typedef struct DI_AllToAllArgs {
    DI_ArgsHeader header;
    DI_Comm*  comm;
    DI_Tensor send;          /* [N, C, ...] contiguous */
    DI_Tensor recv;          /* [N, C, ...] same shape and dtype, contiguous; must not overlap send */
    DI_Tensor send_counts;   /* [N] int32 in [0, C], or absent: every slot whole */
    DI_Tensor recv_counts;   /* [N] int32, written; present exactly when send_counts is */
} DI_AllToAllArgs;

/* Expert parallelism, the sending side: expert e lives on rank e / experts_per_rank. Each token
 * with an expert on rank p gets one row in slot p, in token order: its hidden row, and its top-k
 * as rank p's local expert ids (-1 where the expert is elsewhere) with their weights. */
typedef struct DI_MoEDispatchArgs {
    DI_ArgsHeader header;
    DI_Tensor x;             /* [T, H] f32 | bf16 */
    DI_Tensor topk_ids;      /* [T, K] int32, global expert ids; outside [0, N * experts_per_rank) skipped */
    DI_Tensor topk_weights;  /* [T, K] f32 */
    DI_Tensor send_x;        /* [N, C, H] x's dtype, C >= T: rows past send_counts[p] unspecified */
    DI_Tensor send_ids;      /* [N, C, K] int32: local ids, -1 elsewhere and in every row past the count */
    DI_Tensor send_weights;  /* [N, C, K] f32: the weights, 0 where the id is -1 */
    DI_Tensor send_counts;   /* [N] int32: rows of each slot */
    DI_Tensor route;         /* [T, N] int32: token t's row in slot p, -1 if none */
    int32_t   experts_per_rank;
    uint32_t  reserved;      /* 0 */
} DI_MoEDispatchArgs;

/* Expert parallelism, the returning side: out[t] (+)= sum over p = 0..N-1 of back[p, route[t, p]]
 * where route[t, p] >= 0 (f32 sum in rank order, rounded once) */
typedef struct DI_MoECombineArgs {
    DI_ArgsHeader header;
    DI_Tensor back;          /* [N, C, H] f32 | bf16: the expert outputs returned by each rank */
    DI_Tensor route;         /* [T, N] int32, from moe_dispatch */
    DI_Tensor out;           /* [T, H] f32 | bf16; must not overlap back */
    int32_t   accumulate;    /* 1: add into out; 0: overwrite */
    uint32_t  reserved;      /* 0 */
} DI_MoECombineArgs;

/* ---- 1.6: fused ops (optional entries: a library without one leaves it NULL, and the runtime
 * runs the ops it stands for instead) ---- */

/* MLA's prologue in one call: q's rope dims and kv's k_pe rotated, kv's latent rmsnormed, and the
 * pair written to the paged cache; exactly rope + rmsnorm + rope + mla_cache_write (README section 8) */
typedef struct DI_MLARopeCacheWriteArgs {
    DI_ArgsHeader header;
    DI_Tensor q;            /* [T, H, Dq] f32 | bf16, Dq >= Dr: q[..., Dq-Dr:] is rotated in place */
    DI_Tensor kv;           /* [T, Dc + Dr]: kv_a's output, latent then k_pe (neither normed nor rotated) */
    DI_Tensor norm_weight;  /* [Dc]: the latent's rmsnorm weight (Dc = its length) */
    DI_Tensor positions;    /* [T] int32 */
    DI_Tensor slots;        /* [T] int32; < 0 or >= NB*BS: no cache write for that token */
    DI_Tensor cache;        /* [NB, BS, Dc + Dr] (Dr = cache.shape[2] - Dc) */
    DI_Tensor kv_out;       /* [T, Dc + Dr] or absent: normed latent then rotated k_pe; may alias kv */
    float     eps;          /* rmsnorm epsilon */
    int32_t   interleaved;  /* the rope fields, as in DI_RopeArgs */
    int32_t   scaling;      /* DI_RopeScaling */
    float     theta;
    float     factor;
    int32_t   original_max_position;
    float     beta_fast;
    float     beta_slow;
    float     attn_factor;
    uint32_t  reserved;     /* 0 */
} DI_MLARopeCacheWriteArgs;

/* ---------------------------------------------------------------- the function table */
typedef struct DI_Api {
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t reserved;

    /* contexts and errors */
    DI_Status   (*context_create)(const DI_ContextOptions* options, DI_Context** out);
    DI_Status   (*context_destroy)(DI_Context* ctx);
    const char* (*last_error)(DI_Context* ctx);      /* message of the last failure; never NULL */
    DI_Status   (*get_attribute)(DI_Context* ctx, const char* key, char* buf, uint64_t buf_size);

    /* memory and streams */
    DI_Status (*mem_alloc)(DI_Context* ctx, uint64_t bytes, void** out);
    DI_Status (*mem_free)(DI_Context* ctx, void* ptr);
    DI_Status (*mem_copy)(DI_Context* ctx, void* dst, const void* src, uint64_t bytes,
                          int32_t kind, DI_Stream stream);
    DI_Status (*stream_create)(DI_Context* ctx, DI_Stream* out);
    DI_Status (*stream_destroy)(DI_Context* ctx, DI_Stream stream);
    DI_Status (*stream_synchronize)(DI_Context* ctx, DI_Stream stream);

    /* capability and workspace of one concrete call (args as for the op itself) */
    DI_Status (*op_query)(DI_Context* ctx, int32_t op, const void* args, DI_OpQuery* out);

    /* graph capture (optional: all four or none) */
    DI_Status (*graph_begin)(DI_Context* ctx, DI_Stream stream);
    DI_Status (*graph_end)(DI_Context* ctx, DI_Stream stream, DI_Graph** out);
    DI_Status (*graph_launch)(DI_Context* ctx, DI_Graph* graph, DI_Stream stream);
    DI_Status (*graph_destroy)(DI_Context* ctx, DI_Graph* graph);

    /* ops v1.0, in DI_OpId order; NULL = unsupported */
    DI_Status (*embedding)(DI_Context* ctx, const DI_EmbeddingArgs* args);
    DI_Status (*rmsnorm)(DI_Context* ctx, const DI_RMSNormArgs* args);
    DI_Status (*linear)(DI_Context* ctx, const DI_LinearArgs* args);
    DI_Status (*quantize)(DI_Context* ctx, const DI_QuantizeArgs* args);
    DI_Status (*dequantize)(DI_Context* ctx, const DI_DequantizeArgs* args);
    DI_Status (*rope)(DI_Context* ctx, const DI_RopeArgs* args);
    DI_Status (*mla_cache_write)(DI_Context* ctx, const DI_MLACacheWriteArgs* args);
    DI_Status (*mla_prefill)(DI_Context* ctx, const DI_MLAPrefillArgs* args);
    DI_Status (*mla_decode)(DI_Context* ctx, const DI_MLADecodeArgs* args);
    DI_Status (*moe_router)(DI_Context* ctx, const DI_MoERouterArgs* args);
    DI_Status (*moe_experts)(DI_Context* ctx, const DI_MoEExpertsArgs* args);
    DI_Status (*add)(DI_Context* ctx, const DI_BinaryArgs* args);
    DI_Status (*mul)(DI_Context* ctx, const DI_BinaryArgs* args);
    DI_Status (*silu_mul)(DI_Context* ctx, const DI_SiluMulArgs* args);
    DI_Status (*concat)(DI_Context* ctx, const DI_ConcatArgs* args);
    DI_Status (*sample)(DI_Context* ctx, const DI_SampleArgs* args);

    /* ---- v1.1 (present when abi_minor >= 1 and the offset is below struct_size) ---- */
    /* events (optional: all six or none): order work across streams without blocking the host */
    DI_Status (*event_create)(DI_Context* ctx, DI_Event* out);
    DI_Status (*event_destroy)(DI_Context* ctx, DI_Event event);
    DI_Status (*event_record)(DI_Context* ctx, DI_Event event, DI_Stream stream);
    DI_Status (*stream_wait_event)(DI_Context* ctx, DI_Stream stream, DI_Event event);
    DI_Status (*event_query)(DI_Context* ctx, DI_Event event, int32_t* done);   /* *done = 1: reached */
    DI_Status (*event_synchronize)(DI_Context* ctx, DI_Event event);

    /* host memory for asynchronous copies (optional: all four or none) */
    DI_Status (*host_alloc)(DI_Context* ctx, uint64_t bytes, void** out);       /* pinned, 256-aligned */
    DI_Status (*host_free)(DI_Context* ctx, void* ptr);
    DI_Status (*host_register)(DI_Context* ctx, void* ptr, uint64_t bytes);     /* e.g. an mmap'd file */
    DI_Status (*host_unregister)(DI_Context* ctx, void* ptr);

    /* a copy that returns at once; both buffers must stay valid until the stream reaches it */
    DI_Status (*mem_copy_async)(DI_Context* ctx, void* dst, const void* src, uint64_t bytes,
                                int32_t kind, DI_Stream stream);
    /* devices of this library's kind on this machine (no context needed; errors: last_error(NULL)) */
    DI_Status (*device_count)(int32_t* out);

    /* ---- v1.2 (present when abi_minor >= 2 and the offset is below struct_size) ---- */
    /* ops appended after 1.0's, in DI_OpId order from DI_OP_SPEC_VERIFY; NULL = unsupported */
    DI_Status (*spec_verify)(DI_Context* ctx, const DI_SpecVerifyArgs* args);

    /* ---- v1.3 (present when abi_minor >= 3 and the offset is below struct_size) ---- */
    DI_Status (*hc_pre)(DI_Context* ctx, const DI_HCPreArgs* args);
    DI_Status (*hc_post)(DI_Context* ctx, const DI_HCPostArgs* args);
    DI_Status (*kv_compress)(DI_Context* ctx, const DI_KVCompressArgs* args);
    DI_Status (*indexer_topk)(DI_Context* ctx, const DI_IndexerTopkArgs* args);
    DI_Status (*sparse_attention)(DI_Context* ctx, const DI_SparseAttentionArgs* args);
    DI_Status (*layernorm)(DI_Context* ctx, const DI_LayerNormArgs* args);

    /* ---- v1.4 (present when abi_minor >= 4 and the offset is below struct_size) ---- */
    DI_Status (*all_reduce)(DI_Context* ctx, const DI_AllReduceArgs* args);
    DI_Status (*all_gather)(DI_Context* ctx, const DI_AllGatherArgs* args);
    DI_Status (*all_to_all)(DI_Context* ctx, const DI_AllToAllArgs* args);
    DI_Status (*moe_dispatch)(DI_Context* ctx, const DI_MoEDispatchArgs* args);
    DI_Status (*moe_combine)(DI_Context* ctx, const DI_MoECombineArgs* args);
    /* communicators (optional: all three, with the three collective ops, or none). comm_create is
     * collective: every rank calls it with the same id and blocks until all nranks have joined. */
    DI_Status (*comm_unique_id)(DI_Context* ctx, DI_CommId* out);
    DI_Status (*comm_create)(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank,
                             DI_Comm** out);
    DI_Status (*comm_destroy)(DI_Context* ctx, DI_Comm* comm);
    /* 1.5 appended no entry */

    /* ---- v1.6 (present when abi_minor >= 6 and the offset is below struct_size) ---- */
    /* fused ops (optional: NULL, or DI_UNIMPLEMENTED for a call, and the host runs the unfused ops) */
    DI_Status (*mla_rope_cache_write)(DI_Context* ctx, const DI_MLARopeCacheWriteArgs* args);
    /* v1.7 and later append here */
} DI_Api;

/*
 * The frozen bootstrap struct. Never changes in any version.
 * get_api(major) returns the table for that ABI major version, or NULL if unsupported.
 * score() (optional) ranks several builds of one vendor on this machine: < 0 = cannot run here.
 */
typedef struct DI_PluginInfo {
    uint32_t      struct_size;
    uint32_t      abi_major;      /* the newest major this library implements */
    uint32_t      abi_minor;      /* and its minor */
    uint32_t      reserved;
    const char*   name;           /* short backend name, e.g. "cpu", "cuda" */
    const char*   version;        /* library version string */
    const DI_Api* (*get_api)(uint32_t abi_major);
    int32_t       (*score)(void);
} DI_PluginInfo;

const DI_PluginInfo* deepinfer_plugin_info(void);

/* DI_CDEF_END */

/* DI_OPTABLE_BEGIN
 * ------------------------------------------------------------------------------------------------
 * The op table: the single machine-readable statement of every op's arguments. Every consumer
 * derives from these lines: deepinfer_abi_check.h (a validator any library may include), the CPU
 * and CUDA backends' dispatch tables, the Python loader's bindings, the reference backend's
 * argument checks, the planner's output fields and the conformance suite's per-op facts. The
 * Python runtime parses this block, so keep each entry on one line in exactly this form.
 *
 * DI_OPS(X): X(op id, name (= the DI_Api entry), args struct, minor version that added it)
 *   The op entries of DI_Api are in id order: ids 0..15 (1.0) follow `embedding`, ids 16..27
 *   (1.2 to 1.4) follow the 1.1 entries, starting at `spec_verify`, and ids from 28 (1.6 on) follow
 *   1.4's communicator entries, starting at `mla_rope_cache_write`.
 * DI_ARGS_<name>(T, A, S): one row per DI_Tensor field of the args struct S, in field order:
 *   T(S, field, role, presence, ndim_lo, ndim_hi, plain dtypes, quantized storage dtypes)
 *   A(S, field, role, presence, ndim_lo, ndim_hi, plain dtypes, quantized storage dtypes, count field)
 *     for a `const DI_Tensor*` array of `count field` descriptors (data NULL: not resident)
 *   role: IN (read), OUT (written), INOUT (read and written)
 *   presence: REQ (data must be set) or OPT (data NULL = absent)
 *   plain dtypes: what the tensor may be without a quant descriptor (DI_DTS_NONE: it must be
 *     quantized); quantized storage dtypes: what q may be with one (DI_DTS_NONE: plain only).
 *   The rules of abi/README.md sections 3-5 apply on top: another float dtype where floats are
 *   taken is UNIMPLEMENTED, anything else outside the set INVALID_ARGUMENT; scales have the
 *   tensor's rank and dtype DI_DTS_SCALES, zeros the scales' shape and dtype DI_DTS_ZEROS. A
 *   library may implement less than a row allows (UNIMPLEMENTED), never more.
 * ------------------------------------------------------------------------------------------------ */
#define DI_DTM(id) (1u << (id))
#define DI_DTS_NONE        0u
#define DI_DTS_FLOAT       (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_BF16))
#define DI_DTS_F32         (DI_DTM(DI_DT_F32))
#define DI_DTS_TABLE       (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_BF16) | DI_DTM(DI_DT_F16))
#define DI_DTS_INDEX       (DI_DTM(DI_DT_I32))
#define DI_DTS_SEED        (DI_DTM(DI_DT_U64))
#define DI_DTS_ACT_Q       (DI_DTM(DI_DT_I8) | DI_DTM(DI_DT_E4M3))
#define DI_DTS_WEIGHT_Q    (DI_DTM(DI_DT_I4) | DI_DTM(DI_DT_U4) | DI_DTM(DI_DT_I8) | DI_DTM(DI_DT_U8) | DI_DTM(DI_DT_E4M3) | DI_DTM(DI_DT_E5M2) | DI_DTM(DI_DT_E2M1))
#define DI_DTS_QUANTIZE_Q  (DI_DTM(DI_DT_I8) | DI_DTM(DI_DT_I4) | DI_DTM(DI_DT_E4M3) | DI_DTM(DI_DT_E2M1))
#define DI_DTS_SCALES      (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_BF16) | DI_DTM(DI_DT_F16) | DI_DTM(DI_DT_E8M0) | DI_DTM(DI_DT_E4M3))
#define DI_DTS_SCALES_INT  (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_BF16) | DI_DTM(DI_DT_F16))
#define DI_DTS_SCALES_FP4  (DI_DTM(DI_DT_E4M3) | DI_DTM(DI_DT_E8M0))
#define DI_DTS_COMM        (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_BF16) | DI_DTM(DI_DT_F16) | DI_DTM(DI_DT_I32) | DI_DTM(DI_DT_I8) | DI_DTM(DI_DT_U8) | DI_DTM(DI_DT_E4M3))
#define DI_DTS_ZEROS       (DI_DTM(DI_DT_F32) | DI_DTM(DI_DT_BF16) | DI_DTM(DI_DT_F16) | DI_DTM(DI_DT_I8) | DI_DTM(DI_DT_U8) | DI_DTM(DI_DT_I32))

#define DI_OPS(X) \
    X(DI_OP_EMBEDDING, embedding, DI_EmbeddingArgs, 0) \
    X(DI_OP_RMSNORM, rmsnorm, DI_RMSNormArgs, 0) \
    X(DI_OP_LINEAR, linear, DI_LinearArgs, 0) \
    X(DI_OP_QUANTIZE, quantize, DI_QuantizeArgs, 0) \
    X(DI_OP_DEQUANTIZE, dequantize, DI_DequantizeArgs, 0) \
    X(DI_OP_ROPE, rope, DI_RopeArgs, 0) \
    X(DI_OP_MLA_CACHE_WRITE, mla_cache_write, DI_MLACacheWriteArgs, 0) \
    X(DI_OP_MLA_PREFILL, mla_prefill, DI_MLAPrefillArgs, 0) \
    X(DI_OP_MLA_DECODE, mla_decode, DI_MLADecodeArgs, 0) \
    X(DI_OP_MOE_ROUTER, moe_router, DI_MoERouterArgs, 0) \
    X(DI_OP_MOE_EXPERTS, moe_experts, DI_MoEExpertsArgs, 0) \
    X(DI_OP_ADD, add, DI_BinaryArgs, 0) \
    X(DI_OP_MUL, mul, DI_BinaryArgs, 0) \
    X(DI_OP_SILU_MUL, silu_mul, DI_SiluMulArgs, 0) \
    X(DI_OP_CONCAT, concat, DI_ConcatArgs, 0) \
    X(DI_OP_SAMPLE, sample, DI_SampleArgs, 0) \
    X(DI_OP_SPEC_VERIFY, spec_verify, DI_SpecVerifyArgs, 2) \
    X(DI_OP_HC_PRE, hc_pre, DI_HCPreArgs, 3) \
    X(DI_OP_HC_POST, hc_post, DI_HCPostArgs, 3) \
    X(DI_OP_KV_COMPRESS, kv_compress, DI_KVCompressArgs, 3) \
    X(DI_OP_INDEXER_TOPK, indexer_topk, DI_IndexerTopkArgs, 3) \
    X(DI_OP_SPARSE_ATTENTION, sparse_attention, DI_SparseAttentionArgs, 3) \
    X(DI_OP_LAYERNORM, layernorm, DI_LayerNormArgs, 3) \
    X(DI_OP_ALL_REDUCE, all_reduce, DI_AllReduceArgs, 4) \
    X(DI_OP_ALL_GATHER, all_gather, DI_AllGatherArgs, 4) \
    X(DI_OP_ALL_TO_ALL, all_to_all, DI_AllToAllArgs, 4) \
    X(DI_OP_MOE_DISPATCH, moe_dispatch, DI_MoEDispatchArgs, 4) \
    X(DI_OP_MOE_COMBINE, moe_combine, DI_MoECombineArgs, 4) \
    X(DI_OP_MLA_ROPE_CACHE_WRITE, mla_rope_cache_write, DI_MLARopeCacheWriteArgs, 6)

#define DI_ARGS_embedding(T, A, S) \
    T(S, ids, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, table, IN, REQ, 2, 2, DI_DTS_TABLE, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_rmsnorm(T, A, S) \
    T(S, x, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, weight, IN, REQ, 1, 1, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, residual, IN, OPT, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, residual_out, OUT, OPT, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_linear(T, A, S) \
    T(S, x, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_ACT_Q) \
    T(S, w, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_WEIGHT_Q) \
    T(S, bias, IN, OPT, 1, 1, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_quantize(T, A, S) \
    T(S, x, IN, REQ, 1, 6, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 1, 6, DI_DTS_NONE, DI_DTS_QUANTIZE_Q)
#define DI_ARGS_dequantize(T, A, S) \
    T(S, x, IN, REQ, 1, 6, DI_DTS_NONE, DI_DTS_WEIGHT_Q) \
    T(S, out, OUT, REQ, 1, 6, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_rope(T, A, S) \
    T(S, x, IN, REQ, 2, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, positions, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 3, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_mla_cache_write(T, A, S) \
    T(S, latent, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, k_pe, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, slots, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, cache, INOUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_mla_prefill(T, A, S) \
    T(S, q, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, kv, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, k_pe, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, cu_seqlens, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_mla_decode(T, A, S) \
    T(S, q, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, wkv_b, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, cache, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, block_table, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, token_seq, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, kv_len, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, indices, IN, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_moe_router(T, A, S) \
    T(S, logits, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, bias, IN, OPT, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, topk_ids, OUT, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, topk_weights, OUT, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, token_ids, IN, OPT, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, hash_table, IN, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_moe_experts(T, A, S) \
    T(S, x, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, topk_ids, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, topk_weights, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    A(S, w_gate, IN, OPT, 2, 2, DI_DTS_FLOAT, DI_DTS_WEIGHT_Q, num_experts) \
    A(S, w_up, IN, OPT, 2, 2, DI_DTS_FLOAT, DI_DTS_WEIGHT_Q, num_experts) \
    A(S, w_down, IN, OPT, 2, 2, DI_DTS_FLOAT, DI_DTS_WEIGHT_Q, num_experts) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, expert_map, IN, OPT, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, misses, OUT, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_add(T, A, S) \
    T(S, a, IN, REQ, 0, 6, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, b, IN, REQ, 0, 6, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 0, 6, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_mul(T, A, S) \
    T(S, a, IN, REQ, 0, 6, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, b, IN, REQ, 0, 6, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 0, 6, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_silu_mul(T, A, S) \
    T(S, gate, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, up, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_concat(T, A, S) \
    T(S, a, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, b, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_sample(T, A, S) \
    T(S, logits, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, temperature, IN, REQ, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, top_k, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, top_p, IN, REQ, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, seeds, IN, REQ, 1, 1, DI_DTS_SEED, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, probs, OUT, OPT, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, history, IN, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, prompt_lens, IN, OPT, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, penalties, IN, OPT, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, bias_ids, IN, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, bias, IN, OPT, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, token_mask, IN, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_spec_verify(T, A, S) \
    T(S, logits, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, draft_logits, IN, OPT, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, draft_ids, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, temperature, IN, REQ, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, top_k, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, top_p, IN, REQ, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, seeds, IN, REQ, 1, 1, DI_DTS_SEED, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, accepted, OUT, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_hc_pre(T, A, S) \
    T(S, x, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, fn, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, base, IN, REQ, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, scale, IN, REQ, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, post, OUT, OPT, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, comb, OUT, OPT, 3, 3, DI_DTS_F32, DI_DTS_NONE)
#define DI_ARGS_hc_post(T, A, S) \
    T(S, x, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, y, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, post, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, comb, IN, REQ, 3, 3, DI_DTS_F32, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_kv_compress(T, A, S) \
    T(S, staged, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, position_bias, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, block_table, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, token_seq, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, positions, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_indexer_topk(T, A, S) \
    T(S, q, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, weights, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, keys, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, block_table, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, token_seq, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, kv_len, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_sparse_attention(T, A, S) \
    T(S, q, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, kv_cache, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, comp_cache, IN, OPT, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, indices, IN, OPT, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, sinks, IN, OPT, 1, 1, DI_DTS_F32, DI_DTS_NONE) \
    T(S, block_table, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, token_seq, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, kv_len, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_layernorm(T, A, S) \
    T(S, x, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, weight, IN, REQ, 1, 1, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, bias, IN, OPT, 1, 1, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_all_reduce(T, A, S) \
    T(S, x, IN, REQ, 1, 6, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 1, 6, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_all_gather(T, A, S) \
    T(S, x, IN, REQ, 1, 5, DI_DTS_COMM, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 6, DI_DTS_COMM, DI_DTS_NONE)
#define DI_ARGS_all_to_all(T, A, S) \
    T(S, send, IN, REQ, 2, 6, DI_DTS_COMM, DI_DTS_NONE) \
    T(S, recv, OUT, REQ, 2, 6, DI_DTS_COMM, DI_DTS_NONE) \
    T(S, send_counts, IN, OPT, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, recv_counts, OUT, OPT, 1, 1, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_moe_dispatch(T, A, S) \
    T(S, x, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, topk_ids, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, topk_weights, IN, REQ, 2, 2, DI_DTS_F32, DI_DTS_NONE) \
    T(S, send_x, OUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, send_ids, OUT, REQ, 3, 3, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, send_weights, OUT, REQ, 3, 3, DI_DTS_F32, DI_DTS_NONE) \
    T(S, send_counts, OUT, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, route, OUT, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE)
#define DI_ARGS_moe_combine(T, A, S) \
    T(S, back, IN, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, route, IN, REQ, 2, 2, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, out, OUT, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)
#define DI_ARGS_mla_rope_cache_write(T, A, S) \
    T(S, q, INOUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, kv, IN, REQ, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, norm_weight, IN, REQ, 1, 1, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, positions, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, slots, IN, REQ, 1, 1, DI_DTS_INDEX, DI_DTS_NONE) \
    T(S, cache, INOUT, REQ, 3, 3, DI_DTS_FLOAT, DI_DTS_NONE) \
    T(S, kv_out, OUT, OPT, 2, 2, DI_DTS_FLOAT, DI_DTS_NONE)

/*
 * DI_ARGS_SINCE(F): F(op name, args struct, field, minor) for every field appended to an op's args
 * struct in a minor version after the op's own (fields not listed arrived with their op). Rows are
 * in field order; an appended field is always optional and all fields of one minor come after all
 * fields of earlier minors. A caller whose header.struct_size ends at or before such a field's offset
 * does not know the field: the library treats it as absent (zero) and never reads those bytes. It
 * accepts the older minors' sizes (the offset of each minor's first appended field) and any size from
 * its own on; another size below its own is DI_INVALID_ARGUMENT (deepinfer_abi_check.h does this).
 * A host must not set a field for a library whose abi_minor is below the field's minor (that library
 * would answer DI_UNIMPLEMENTED for the non-zero bytes past its struct, section 2).
 */
#define DI_ARGS_SINCE(F) \
    F(mla_decode, DI_MLADecodeArgs, indices, 3) \
    F(moe_router, DI_MoERouterArgs, token_ids, 3) \
    F(moe_router, DI_MoERouterArgs, hash_table, 3) \
    F(moe_experts, DI_MoEExpertsArgs, swiglu_limit, 3) \
    F(moe_experts, DI_MoEExpertsArgs, expert_map, 5) \
    F(moe_experts, DI_MoEExpertsArgs, misses, 5) \
    F(silu_mul, DI_SiluMulArgs, limit, 3) \
    F(sample, DI_SampleArgs, probs, 2) \
    F(sample, DI_SampleArgs, history, 7) \
    F(sample, DI_SampleArgs, prompt_lens, 7) \
    F(sample, DI_SampleArgs, penalties, 7) \
    F(sample, DI_SampleArgs, bias_ids, 7) \
    F(sample, DI_SampleArgs, bias, 7) \
    F(sample, DI_SampleArgs, token_mask, 7)

/*
 * The quantization formats of section 5 (abi/README.md), one row each:
 *   F(name, q storage dtype, block_rows, block_cols, scale dtypes, asymmetric, use)
 *   block 0 = the whole dimension; -1 = a group size of DI_GROUP_SIZES; use: W weight, A activation
 * DI_QMAX(Q): Q(q dtype, largest magnitude) of the symmetric quantize op.
 */
#define DI_GROUP_SIZES(G) G(32) G(64) G(128)
#define DI_FORMATS(F) \
    F(int4_sym, DI_DT_I4, 1, -1, DI_DTS_SCALES_INT, 0, W) \
    F(int4_asym, DI_DT_U4, 1, -1, DI_DTS_SCALES_INT, 1, W) \
    F(int8_channel, DI_DT_I8, 1, 0, DI_DTS_F32, 0, W) \
    F(fp8_block, DI_DT_E4M3, 128, 128, DI_DTS_F32, 0, W) \
    F(fp4_g16, DI_DT_E2M1, 1, 16, DI_DTS_SCALES_FP4, 0, W) \
    F(fp4_g32, DI_DT_E2M1, 1, 32, DI_DTS_SCALES_FP4, 0, W) \
    F(fp8_act, DI_DT_E4M3, 1, 128, DI_DTS_F32, 0, A) \
    F(int8_act, DI_DT_I8, 1, 0, DI_DTS_F32, 0, A)
#define DI_QMAX(Q) \
    Q(DI_DT_I8, 127) \
    Q(DI_DT_I4, 7) \
    Q(DI_DT_E4M3, 448) \
    Q(DI_DT_E2M1, 6)
/* DI_OPTABLE_END */

#if defined(_WIN32)
#define DI_EXPORT __declspec(dllexport)
#else
#define DI_EXPORT __attribute__((visibility("default")))
#endif

#define DI_PLUGIN_INFO_SYMBOL "deepinfer_plugin_info"

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DEEPINFER_ABI_H */
