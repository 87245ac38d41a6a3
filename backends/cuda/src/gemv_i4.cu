// GEMV instantiation for I4 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_I4, i4)
}  // namespace di
