// linear weight-streaming tensor-core kernels for one weight format (linear_mma.cuh).
#include "linear_mma.cuh"
DI_LINEAR_MMA_DEFINE(u4, MW_U4)
