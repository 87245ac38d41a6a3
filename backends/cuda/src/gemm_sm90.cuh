// The CUTLASS 3 kernels behind gemm_sm90_api.cuh, instantiated once per output dtype in
// gemm_sm90_<out>.cu (each TU compiles only for sm_90a: wgmma and TMA exist nowhere else).
//
// Two tile configurations, chosen by M:
//  * M >= 256: cooperative (two consumer warpgroups) 128 x 256 x 64 tiles, clusters of 2 along M
//    so each weight tile is multicast to both CTAs, persistent tile scheduler. The prefill shape.
//  * M < 256: 128 x 128 x 64 tiles with the stream-K scheduler, which splits K across CTAs when
//    the output has too few tiles to fill 132 SMs (kv_a 576, o_proj 2048 at M = 64).
#pragma once

#include "gemm_sm90_api.cuh"

#if DI_HAVE_CUTLASS && !defined(__HIP__)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace di {
namespace sm90 {

using namespace cute;

// One CUTLASS launch: its shape rules, workspace set-up and the kernel; the reason if it refuses.
template <class Gemm>
cudaError_t run_gemm(const typename Gemm::Arguments& a, void* ws, cudaStream_t s, const char** why) {
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(a);
    if (st == cutlass::Status::kSuccess) st = gemm.initialize(a, ws, s);
    if (st == cutlass::Status::kSuccess) st = gemm.run(s);
    if (st == cutlass::Status::kSuccess) return cudaGetLastError();
    if (why) *why = cutlassGetStatusString(st);
    return cudaErrorInvalidValue;
}

template <class ElementD, class Tile, class Cluster, class Scheduler>
struct GemmConfig {
    using ElementA = cutlass::bfloat16_t;
    using ElementB = cutlass::bfloat16_t;
    using LayoutA = cutlass::layout::RowMajor;     // x [M, K]
    using LayoutB = cutlass::layout::ColumnMajor;  // w [N, K] row-major is B [K, N] column-major
    using LayoutD = cutlass::layout::RowMajor;
    static constexpr int AlignA = 8, AlignB = 8, AlignD = 16 / sizeof(ElementD);

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, LayoutD, AlignD,  // no C operand: D = acc, nothing is read
        ElementD, LayoutD, AlignD, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, AlignA, ElementB, LayoutB, AlignB,
        float, Tile, Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    static typename Gemm::Arguments args(const GemmBF16& g, int sm_count) {
        using SA = typename Kernel::StrideA;
        using SB = typename Kernel::StrideB;
        using SD = typename Kernel::StrideD;
        SA sa = make_stride(g.lda, Int<1>{}, int64_t(0));
        SB sb = make_stride(g.ldb, Int<1>{}, int64_t(0));
        SD sd = make_stride(g.ldd, Int<1>{}, int64_t(0));
        cutlass::KernelHardwareInfo hw;
        hw.device_id = 0;  // only sm_count is read when it is set
        hw.sm_count = sm_count;
        typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                                   {g.M, g.N, g.K, 1},
                                   {static_cast<const ElementA*>(g.a), sa, static_cast<const ElementB*>(g.b), sb},
                                   {{1.f, 0.f}, nullptr, sd, static_cast<ElementD*>(g.d), sd},
                                   hw};
        return a;
    }
    static size_t workspace(const GemmBF16& g, int sm_count) { return Gemm::get_workspace_size(args(g, sm_count)); }
    static cudaError_t run(const GemmBF16& g, void* ws, int sm_count, cudaStream_t s, const char** why) {
        return run_gemm<Gemm>(args(g, sm_count), ws, s, why);
    }
};

template <class ElementD>
using Large = GemmConfig<ElementD, Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::PersistentScheduler>;
template <class ElementD>
using Small = GemmConfig<ElementD, Shape<_128, _128, _64>, Shape<_1, _1, _1>, cutlass::gemm::StreamKScheduler>;

constexpr int LARGE_M = 256;

template <class ElementD>
size_t workspace(const GemmBF16& g, int sm_count) {
    return g.M >= LARGE_M ? Large<ElementD>::workspace(g, sm_count) : Small<ElementD>::workspace(g, sm_count);
}
template <class ElementD>
cudaError_t run(const GemmBF16& g, void* ws, int sm_count, cudaStream_t s, const char** why) {
    return g.M >= LARGE_M ? Large<ElementD>::run(g, ws, sm_count, s, why) : Small<ElementD>::run(g, ws, sm_count, s, why);
}

}  // namespace sm90
}  // namespace di

#define DI_GEMM_SM90_DEFINE(name, ElementD)                                                                \
    namespace di {                                                                                         \
    size_t gemm_sm90_workspace_##name(const GemmBF16& g, int sm_count) {                                  \
        return sm90::workspace<ElementD>(g, sm_count);                                                     \
    }                                                                                                      \
    cudaError_t gemm_sm90_run_##name(const GemmBF16& g, void* ws, int sm_count, cudaStream_t s, const char** why) { \
        return sm90::run<ElementD>(g, ws, sm_count, s, why);                                               \
    }                                                                                                      \
    }

#else  // no CUTLASS: the entry points exist and say so

#define DI_GEMM_SM90_DEFINE(name, ElementD)                                                                \
    namespace di {                                                                                         \
    size_t gemm_sm90_workspace_##name(const GemmBF16&, int) { return 0; }                                  \
    cudaError_t gemm_sm90_run_##name(const GemmBF16&, void*, int, cudaStream_t, const char** why) {        \
        if (why) *why = "built without CUTLASS";                                                           \
        return cudaErrorNotSupported;                                                                      \
    }                                                                                                      \
    }

#endif
