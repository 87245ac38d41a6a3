// The sm_90a fp8 block-scaled GEMM (gemm_sm90_api.cuh): e4m3 x e4m3 on the fp8 tensor cores with
// the (1 x 128) activation and (128 x 128) weight scales applied per 128-column block in f32
// (CUTLASS's blockwise-scaled cooperative kernel, DeepGEMM's promotion), bf16 out. 128 x 128 x 128
// tiles, clusters of 2 along N, persistent scheduler.
#include "gemm_sm90.cuh"  // run_gemm, the CUTLASS includes

#if DI_HAVE_CUTLASS && !defined(__HIP__)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace di {
namespace sm90 {

using namespace cute;

struct GemmBlockFP8 {
    using Tile = Shape<_128, _128, _128>;
    using Cluster = Shape<_1, _2, _1>;
    using ElementD = cutlass::bfloat16_t;
    using E4M3 = cutlass::float_e4m3_t;
    using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
    using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
    using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, cutlass::layout::RowMajor, 8, ElementD, cutlass::layout::RowMajor, 8,
        cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        E4M3, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16,
        E4M3, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16,
        float, Tile, Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                        cutlass::gemm::PersistentScheduler>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    static typename Gemm::Arguments args(const GemmFP8& g, int sm_count) {
        typename Kernel::StrideA sa = make_stride(g.lda, Int<1>{}, int64_t(0));
        typename Kernel::StrideB sb = make_stride(g.ldb, Int<1>{}, int64_t(0));
        typename Kernel::StrideD sd = make_stride(g.ldd, Int<1>{}, int64_t(0));
        auto lsfa = ScaleConfig::tile_atom_to_shape_SFA(make_shape(g.M, g.N, g.K, 1));
        auto lsfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(g.M, g.N, g.K, 1));
        cutlass::KernelHardwareInfo hw;
        hw.device_id = 0;
        hw.sm_count = sm_count;
        typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                                   {g.M, g.N, g.K, 1},
                                   {static_cast<const E4M3*>(g.a), sa, static_cast<const E4M3*>(g.b), sb, g.sa_mn, lsfa,
                                    g.sb, lsfb},
                                   {{}, nullptr, sd, static_cast<ElementD*>(g.d), sd},
                                   hw};
        a.epilogue.thread.alpha = 1.f;
        a.epilogue.thread.beta = 0.f;
        return a;
    }
};

}  // namespace sm90

// CUTLASS's own shape rules (it refuses some that the alignment rules alone admit, e.g. M = 1).
bool gemm_sm90_fp8_supported(const GemmFP8& g) {
    return sm90::GemmBlockFP8::Gemm::can_implement(sm90::GemmBlockFP8::args(g, 1)) == cutlass::Status::kSuccess;
}

size_t gemm_sm90_fp8_workspace(const GemmFP8& g, int sm_count) {
    return sm90::GemmBlockFP8::Gemm::get_workspace_size(sm90::GemmBlockFP8::args(g, sm_count));
}

cudaError_t gemm_sm90_fp8_run(const GemmFP8& g, void* ws, int sm_count, cudaStream_t s, const char** why) {
    return sm90::run_gemm<sm90::GemmBlockFP8::Gemm>(sm90::GemmBlockFP8::args(g, sm_count), ws, s, why);
}

}  // namespace di

#else

namespace di {
bool gemm_sm90_fp8_supported(const GemmFP8&) { return false; }
size_t gemm_sm90_fp8_workspace(const GemmFP8&, int) { return 0; }
cudaError_t gemm_sm90_fp8_run(const GemmFP8&, void*, int, cudaStream_t, const char** why) {
    if (why) *why = "built without CUTLASS";
    return cudaErrorNotSupported;
}
}  // namespace di

#endif
