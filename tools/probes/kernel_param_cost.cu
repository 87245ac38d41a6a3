// How much a large __grid_constant__ kernel parameter costs per launch (eager and in a CUDA graph):
// moe_experts passes its expert pointer tables (18 KB) this way. Prints us per launch.
//   nvcc -O2 -arch=sm_90a tools/probes/kernel_param_cost.cu -o /tmp/kpc && /tmp/kpc
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

struct Big { const char* q[2304]; };   // 18 KB, as moe_experts' gate + up tables
struct Small { const char* q[8]; };

template <class P>
__global__ void k(const __grid_constant__ P p, int* out, int n) {
    if (threadIdx.x == 0) atomicAdd(out, (int)(reinterpret_cast<uintptr_t>(p.q[blockIdx.x % n]) & 1));
}

template <class P>
float time_it(bool graph, int blocks) {
    static P p{};
    int* out; cudaMalloc(&out, 4);
    cudaStream_t s; cudaStreamCreate(&s);
    const int N = 200;
    cudaGraphExec_t ge = nullptr;
    if (graph) {
        cudaGraph_t g;
        cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
        for (int i = 0; i < N; ++i) k<P><<<blocks, 128, 0, s>>>(p, out, 8);
        cudaStreamEndCapture(s, &g);
        cudaGraphInstantiate(&ge, g, 0);
    }
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int rep = 0; rep < 2; ++rep) {
        cudaEventRecord(a, s);
        if (graph) cudaGraphLaunch(ge, s);
        else for (int i = 0; i < N; ++i) k<P><<<blocks, 128, 0, s>>>(p, out, 8);
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
    }
    float ms; cudaEventElapsedTime(&ms, a, b);
    return ms * 1000 / N;
}

int main() {
    for (int blocks : {132, 528, 2048})
        printf("blocks %4d: small params %.2f us eager / %.2f us graph; 18 KB params %.2f us eager / %.2f us graph\n",
               blocks, time_it<Small>(false, blocks), time_it<Small>(true, blocks), time_it<Big>(false, blocks),
               time_it<Big>(true, blocks));
    return 0;
}
