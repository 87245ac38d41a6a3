// GEMV instantiation for F16 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_F16, f16)
}  // namespace di
