// GEMV instantiation for FP8 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_FP8, fp8)
}  // namespace di
