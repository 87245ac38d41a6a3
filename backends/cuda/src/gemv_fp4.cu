// GEMV instantiation for FP4 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_FP4, fp4)
}  // namespace di
