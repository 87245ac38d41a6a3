// GEMV instantiation for I8 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_I8, i8)
}  // namespace di
