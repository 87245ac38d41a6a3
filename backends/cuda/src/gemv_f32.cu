// GEMV instantiation for F32 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_F32, f32)
}  // namespace di
