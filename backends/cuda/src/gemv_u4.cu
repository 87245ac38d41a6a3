// GEMV instantiation for U4 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_U4, u4)
}  // namespace di
