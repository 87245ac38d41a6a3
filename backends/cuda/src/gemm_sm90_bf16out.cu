// The sm_90a bf16 GEMM with a bf16 output (gemm_sm90.cuh).
#include "gemm_sm90.cuh"
DI_GEMM_SM90_DEFINE(bf16out, cutlass::bfloat16_t)
