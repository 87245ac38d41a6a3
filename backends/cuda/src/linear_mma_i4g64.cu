// linear weight-streaming tensor-core kernels for one weight format (linear_mma.cuh).
#include "linear_mma.cuh"
DI_LINEAR_MMA_DEFINE(i4g64, MW_I4G64)
