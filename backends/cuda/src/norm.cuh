// Device code of layernorm (ABI 1.3). The host side is norm.cu, the only translation unit
// that includes this header (its __global__ functions have external linkage); tests/gpu_emu includes
// it too and runs these very kernels on the CPU, one emulated block at a time.
#pragma once

#include "kernel_util.cuh"

namespace di {

// ---------------------------------------------------------------------------------------- layernorm
// Two reductions (mean, then the centred variance, as the reference computes it) and the output;
// x is read three times, from L1/L2, which needs no shared-memory limit on H.
__global__ __launch_bounds__(256) void k_layernorm(DTensor x, DTensor w, DTensor b, DTensor out, int64_t T, int64_t H,
                                                   float eps) {
    __shared__ float red[MAX_WARPS];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int64_t xo = t * x.strides[0];
        float s = 0.f;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) s += load_f(x.dt, x.base, xo + h);
        const float mean = block_sum(s, red) / (float)H;
        float v = 0.f;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            const float c = load_f(x.dt, x.base, xo + h) - mean;
            v += c * c;
        }
        const float r = rsqrtf(block_sum(v, red) / (float)H + eps);
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float o = (load_f(x.dt, x.base, xo + h) - mean) * r * load_f(w.dt, w.base, h * w.strides[0]);
            if (b.base) o += load_f(b.dt, b.base, h * b.strides[0]);
            store_f(out.dt, out.base, t * out.strides[0] + h, o);
        }
    }
}

}  // namespace di
