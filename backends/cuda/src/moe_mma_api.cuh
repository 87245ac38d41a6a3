// The tensor-core path of moe_experts (moe_mma.cuh): what moe.cu hands the kernels.
// One kernel template per weight format, each instantiated in its own moe_mma_<fmt>.cu so the
// unrolled bodies compile in parallel (as gemv_<fmt>.cu).
#pragma once

#include "common.cuh"

// The kernels are inline PTX (mma.sync, bf16x2 fma): CUDA only, sm_80 and newer. A HIP build keeps
// the SIMT path until it has its own matrix-core kernels.
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define DI_HAVE_MOE_MMA 0
#else
#define DI_HAVE_MOE_MMA 1
#endif

namespace di {

// Experts whose pointers travel in one launch as kernel parameters (2 tables of 3 x 384 pointers:
// 18 KB of the 32 KB a launch may carry since CUDA 12.1). Nothing is marshalled through memory,
// so a call is capturable and never waits for the host.
constexpr int MOE_MAX_E = 384;

// Weight formats of the fast path. int4 comes in three k-step widths so that a k-step never crosses
// a scale group and the scale is applied exactly, in f32, after the mma: MW_I4 (groups of 128k),
// MW_I4G64 (64k), MW_I4G32 (32k).
enum MoeWF { MW_BF16, MW_FP8, MW_I8, MW_I4, MW_I4G64, MW_I4G32, MW_U4, MW_COUNT };

// The layout every expert of one weight family shares (checked on the host).
struct MoeMat {
    int64_t N, K;          // rows, columns
    int64_t ld;            // bytes between rows of q
    int64_t s_rs, s_cs;    // scale strides in elements
    int64_t z_rs, z_cs;    // zero-point strides
    int32_t s_dt, z_dt;    // scale / zero dtypes (DT_*)
    int32_t br, bc;        // block, resolved
    int32_t bc_shift;      // log2(bc) when bc is a power of two, else -1 (the group of column k)
    int32_t pad_;
};

struct MoePtrs {
    const char* q[MOE_MAX_E];
    const char* s[MOE_MAX_E];
    const char* z[MOE_MAX_E];
};

// Bit e: expert e has weights in this call.
struct ResidentMask {
    uint32_t w[MOE_MAX_E / 32];
    // whether e names one of the E experts and that expert has weights in this call
    __host__ __device__ bool has(int64_t e, int64_t E) const {
        return e >= 0 && e < E && ((w[e >> 5] >> (e & 31)) & 1u);
    }
};

// Rows of out per block of the decode-shaped down kernel: the tiles of a direct plan's combine.
constexpr int MOE_DOWN_DECODE_ROWS = 32;

// The routing plan moe_align writes on the device: pairs grouped by expert and cut into work items.
// Direct (decode shape, one token, no expert map): work item i is pair i, its expert read from ids by
// the kernels themselves, so no moe_align runs; and the last of down's blocks to finish a tile of
// MOE_DOWN_DECODE_ROWS rows sums the K pairs into out, in k order (k_moe_combine's sum), so no
// moe_combine runs either. A token's K experts are distinct, so nothing is read twice.
struct MoePlan {
    const int*  sorted;    // [P] pair index t * K + k, grouped by expert
    const int4* items;     // [max_items] (expert, first position in sorted, count, 0)
    const int*  n_items;   // [1]
    // direct plans only
    int          direct;
    int          E, Ktop, accumulate, n_tiles;
    int*         tile_cnt;  // [n_tiles] blocks done per tile: zeroed by gate_up's first block each call
    DTensor      ids, tw, out;   // [1, K], [1, K], [1, H]
    ResidentMask res;
};

// Tokens per work item: 8 * NT. Decode: NT 1 with the K dimension split over the block's 4 warps;
// prefill: NT 8 (4 for the formats whose k-step scaling needs a second accumulator set, which at
// NT 8 would spill) with each warp on its own rows.
enum MoeShape { MOE_DECODE, MOE_PREFILL, MOE_PREFILL_NARROW };
inline int moe_tokens_per_item(MoeShape sh) { return sh == MOE_DECODE ? 8 : sh == MOE_PREFILL ? 64 : 32; }
__host__ __device__ constexpr bool moe_needs_narrow_prefill(int f) {
    return f == MW_FP8 || f == MW_I4 || f == MW_I4G64 || f == MW_I4G32 || f == MW_U4;
}
// Columns of one k-step (4 lanes x the 16, 8 or 4 bytes each lane loads of a row): K must be a
// multiple of it. The kernels' format traits (moe_mma.cuh) are checked against this table.
__host__ __device__ constexpr int moe_kstep_cols(int f) {
    return f == MW_BF16 ? 32 : f == MW_I4G32 ? 32 : (f == MW_FP8 || f == MW_I8 || f == MW_I4G64) ? 64 : 128;
}

// The tensor-core format of a weight [N, K] (N a multiple of 16, K of the format's k-step), or -1.
// Shared with linear's weight-streaming path (linear_mma.cuh).
int    mma_format(const QTensor& w);
int64_t row_bytes(const QTensor& w);  // bytes between rows of w.q
MoeMat mat_of(const QTensor& w);      // the kernels' view of w's layout

// gate_up: h[pos, i] = silu(gate_e x[t]) * up_e x[t] (bf16), pos = position in plan.sorted, t = p / Ktop;
//          limit > 0 (V4's clipped SwiGLU) clips gate above and up on both sides first.
// down:    y[p, c]  = down_e h[pos] (f32), p = plan.sorted[pos].
#define DI_MOE_MMA_DECL(name)                                                                                \
    void launch_moe_gate_up_##name(MoeShape sh, int max_items, const MoeMat& mg, const MoePtrs& pg,         \
                                   const MoeMat& mu, const MoePtrs& pu, MoePlan plan, const char* x,         \
                                   int64_t x_rs, int Ktop, float limit, uint16_t* h, cudaStream_t s);        \
    void launch_moe_down_##name(MoeShape sh, int max_items, const MoeMat& md, const MoePtrs& pd, MoePlan plan, \
                                const uint16_t* h, float* y, cudaStream_t s);
DI_MOE_MMA_DECL(bf16)
DI_MOE_MMA_DECL(fp8)
DI_MOE_MMA_DECL(i8)
DI_MOE_MMA_DECL(i4)
DI_MOE_MMA_DECL(i4g64)
DI_MOE_MMA_DECL(i4g32)
DI_MOE_MMA_DECL(u4)
#undef DI_MOE_MMA_DECL

}  // namespace di
