// The sm_90a bf16 GEMM with an f32 output (gemm_sm90.cuh).
#include "gemm_sm90.cuh"
DI_GEMM_SM90_DEFINE(f32out, float)
