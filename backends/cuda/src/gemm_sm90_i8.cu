// The sm_90a W8A8 GEMM (gemm_sm90_api.cuh): int8 x int8 on the integer tensor cores (wgmma s8,
// int32 accumulation: exact), the per-token and per-channel scales applied in the epilogue through
// an epilogue visitor tree, bf16 out. Cooperative 128 x 128 x 128 tiles (128 bytes of K per stage
// row, the TMA swizzle width), persistent scheduler; one configuration for every M > 16.
#include "gemm_sm90.cuh"  // run_gemm, the CUTLASS includes

#if DI_HAVE_CUTLASS && !defined(__HIP__)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace di {
namespace sm90 {

using namespace cute;
using namespace cutlass::epilogue::fusion;

struct GemmW8A8 {
    using Tile = Shape<_128, _128, _128>;
    using Cluster = Shape<_1, _2, _1>;
    using ElementD = cutlass::bfloat16_t;
    static constexpr auto Round = cutlass::FloatRoundStyle::round_to_nearest;

    // D = sa[m] * (sb[n] * float(acc))
    using ScaleB = Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, int64_t>>;  // along N
    using ScaleA = Sm90ColBroadcast<0, Tile, float, float, Stride<_1, _0, int64_t>>;  // along M
    using AccTimesB = Sm90EVT<Sm90Compute<cutlass::multiplies, float, float, Round>, ScaleB, Sm90AccFetch>;
    using Fusion = Sm90EVT<Sm90Compute<cutlass::multiplies, ElementD, float, Round>, ScaleA, AccTimesB>;

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
        cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float,
        void, cutlass::layout::RowMajor, 8, ElementD, cutlass::layout::RowMajor, 8,
        cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, int8_t, cutlass::layout::RowMajor, 16, int8_t,
        cutlass::layout::ColumnMajor, 16, int32_t, Tile, Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                        cutlass::gemm::PersistentScheduler>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    static typename Gemm::Arguments args(const GemmI8& g, int sm_count) {
        typename Kernel::StrideA sa = make_stride(g.lda, Int<1>{}, int64_t(0));
        typename Kernel::StrideB sb = make_stride(g.ldb, Int<1>{}, int64_t(0));
        typename Kernel::StrideD sd = make_stride(g.ldd, Int<1>{}, int64_t(0));
        cutlass::KernelHardwareInfo hw;
        hw.device_id = 0;
        hw.sm_count = sm_count;
        typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                                   {g.M, g.N, g.K, 1},
                                   {static_cast<const int8_t*>(g.a), sa, static_cast<const int8_t*>(g.b), sb},
                                   {{}, nullptr, sd, static_cast<ElementD*>(g.d), sd},
                                   hw};
        // the tree's arguments, outermost node first: {ScaleA, {ScaleB, Acc, op}, op}
        a.epilogue.thread = {
            {g.sa, 0.f, {Int<1>{}, Int<0>{}, int64_t(0)}},
            {{g.sb, 0.f, {Int<0>{}, Int<1>{}, int64_t(0)}}, {}, {}},
            {}};
        return a;
    }
};

}  // namespace sm90

bool gemm_sm90_i8_supported(const GemmI8& g) {
    return sm90::GemmW8A8::Gemm::can_implement(sm90::GemmW8A8::args(g, 1)) == cutlass::Status::kSuccess;
}

size_t gemm_sm90_i8_workspace(const GemmI8& g, int sm_count) {
    return sm90::GemmW8A8::Gemm::get_workspace_size(sm90::GemmW8A8::args(g, sm_count));
}

cudaError_t gemm_sm90_i8_run(const GemmI8& g, void* ws, int sm_count, cudaStream_t s, const char** why) {
    return sm90::run_gemm<sm90::GemmW8A8::Gemm>(sm90::GemmW8A8::args(g, sm_count), ws, s, why);
}

}  // namespace di

#else

namespace di {
bool gemm_sm90_i8_supported(const GemmI8&) { return false; }
size_t gemm_sm90_i8_workspace(const GemmI8&, int) { return 0; }
cudaError_t gemm_sm90_i8_run(const GemmI8&, void*, int, cudaStream_t, const char** why) {
    if (why) *why = "built without CUTLASS";
    return cudaErrorNotSupported;
}
}  // namespace di

#endif
