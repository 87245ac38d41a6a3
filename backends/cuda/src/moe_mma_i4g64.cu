// moe_experts tensor-core kernels for one weight format (moe_mma.cuh).
#include "moe_mma.cuh"

#if DI_HAVE_MOE_MMA
namespace di {
DI_MOE_MMA_DEFINE(i4g64, MW_I4G64)
}  // namespace di
#endif
