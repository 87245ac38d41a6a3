// GEMV instantiation for BF16 weights (see gemv.cuh).
#include "gemv.cuh"

namespace di {
DI_GEMV_INSTANTIATE(WF_BF16, bf16)
}  // namespace di
