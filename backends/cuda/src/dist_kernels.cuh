// Device code of the two local halves of expert parallelism (ABI 1.4): moe_dispatch, which packs
// each token's row into one slot per rank that owns one of its experts, and moe_combine, which sums
// the expert outputs that come back. The host side is dist.cu, the only translation unit of the
// library that includes this header; tests/gpu_emu includes it too and runs these kernels on the CPU.
//
// Nothing here reads a device value on the host: a route entry outside [0, C) is skipped (the
// reference rejects it, which a device library cannot do without a sync), an expert id outside
// [0, N * experts_per_rank) belongs to no rank, as abi/deepinfer_abi.h says.
#pragma once

#include "device.cuh"

namespace di {

// Ranks one combine block keeps in shared memory; a larger communicator is refused on the host.
constexpr int DIST_MAX_RANKS = 1024;

struct DispatchP {
    int64_t T, C;      // tokens, rows per slot (C >= T)
    int32_t N, K, Er;  // ranks, top-k, experts per rank
    int32_t pad_;
};

// The rank that owns global expert e, or -1 for an id outside [0, N * Er).
__device__ __forceinline__ int owner_of(int64_t e, int N, int Er) {
    return e >= 0 && e < (int64_t)N * Er ? (int)(e / Er) : -1;
}

// One block per rank p (grid-stride over ranks). The block walks the tokens in chunks of blockDim.x
// threads; a token takes the next row of slot p when one of its experts lives on p, the rows in
// token order through a block-wide prefix sum, so the layout is deterministic. The block writes the
// token's route entry, its local ids and weights in that row, then -1 / 0 in every row past the
// count, and the count itself. blockDim.x: a multiple of LANES.
__global__ __launch_bounds__(1024) void k_moe_dispatch_route(DTensor ids, DTensor wts, DTensor sids, DTensor swts,
                                                             DTensor counts, DTensor route, DispatchP P) {
    __shared__ int red[MAX_WARPS];
    for (int p = blockIdx.x; p < P.N; p += gridDim.x) {
        int base = 0;
        for (int64_t t0 = 0; t0 < P.T; t0 += blockDim.x) {
            const int64_t t = t0 + threadIdx.x;
            int mine = 0;
            if (t < P.T)
                for (int k = 0; k < P.K; ++k)
                    mine |= owner_of(load_i(ids.dt, ids.base, t * ids.strides[0] + k), P.N, P.Er) == p;
            int total;
            const int incl = block_scan_incl(mine, &total, red);
            if (t < P.T) {
                const int64_t j = base + incl - 1;
                reinterpret_cast<int32_t*>(route.base)[t * route.strides[0] + p * route.strides[1]] =
                    mine ? (int32_t)j : -1;
                if (mine) {
                    const int64_t o = p * sids.strides[0] + j * sids.strides[1];
                    const int64_t ow = p * swts.strides[0] + j * swts.strides[1];
                    for (int k = 0; k < P.K; ++k) {
                        const int64_t e = load_i(ids.dt, ids.base, t * ids.strides[0] + k);
                        const bool here = owner_of(e, P.N, P.Er) == p;
                        reinterpret_cast<int32_t*>(sids.base)[o + k] = here ? (int32_t)(e - (int64_t)p * P.Er) : -1;
                        reinterpret_cast<float*>(swts.base)[ow + k] =
                            here ? load_f(wts.dt, wts.base, t * wts.strides[0] + k) : 0.f;
                    }
                }
            }
            base += total;
        }
        const int64_t rest = (P.C - base) * P.K;
        for (int64_t i = threadIdx.x; i < rest; i += blockDim.x) {
            const int64_t j = base + i / P.K, k = i % P.K;
            reinterpret_cast<int32_t*>(sids.base)[p * sids.strides[0] + j * sids.strides[1] + k] = -1;
            reinterpret_cast<float*>(swts.base)[p * swts.strides[0] + j * swts.strides[1] + k] = 0.f;
        }
        if (threadIdx.x == 0) reinterpret_cast<int32_t*>(counts.base)[p * counts.strides[0]] = base;
    }
}

// A unit of V bytes, the widest the host found every row start and row length aligned to.
template <int V>
struct alignas(V) Bytes {
    uint8_t b[V];
};

// send_x[p, route[t, p]] = x[t] for every rank p with a row of token t: one block per token
// (grid-stride), the row read once and written once per rank, V bytes per thread and step.
template <int V>
__global__ __launch_bounds__(256) void k_moe_dispatch_rows(DTensor x, DTensor route, DTensor sx, int64_t row_bytes,
                                                           DispatchP P) {
    const int elt = dt_lg(x.dt) >= 0 ? 1 << dt_lg(x.dt) : 1;
    const int64_t n = row_bytes / V;
    for (int64_t t = blockIdx.x; t < P.T; t += gridDim.x) {
        const Bytes<V>* src = reinterpret_cast<const Bytes<V>*>(x.base + t * x.strides[0] * elt);
        for (int p = 0; p < P.N; ++p) {
            const int64_t j = reinterpret_cast<const int32_t*>(route.base)[t * route.strides[0] + p * route.strides[1]];
            if (j < 0 || j >= P.C) continue;
            Bytes<V>* dst = reinterpret_cast<Bytes<V>*>(sx.base + (p * sx.strides[0] + j * sx.strides[1]) * elt);
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
        }
    }
}

// out[t] (+)= sum over p = 0..N-1 of back[p, route[t, p]] in f32, in rank order, rounded once: one
// block per token (grid-stride), the token's N row offsets in shared memory (-1: none, or a route
// entry outside [0, C)), the threads across H. N <= DIST_MAX_RANKS.
__global__ __launch_bounds__(256) void k_moe_combine(DTensor back, DTensor route, DTensor out, int64_t T, int64_t H,
                                                     int N, int accumulate) {
    __shared__ int64_t offs[DIST_MAX_RANKS];
    const int64_t C = back.shape[1];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        __syncthreads();  // the previous token's offsets are no longer read
        for (int p = threadIdx.x; p < N; p += blockDim.x) {
            const int64_t j = reinterpret_cast<const int32_t*>(route.base)[t * route.strides[0] + p * route.strides[1]];
            offs[p] = j >= 0 && j < C ? p * back.strides[0] + j * back.strides[1] : -1;
        }
        __syncthreads();
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            const int64_t o = t * out.strides[0] + h;
            float acc = accumulate ? load_f(out.dt, out.base, o) : 0.f;
            for (int p = 0; p < N; ++p)
                if (offs[p] >= 0) acc += load_f(back.dt, back.base, offs[p] + h);
            store_f(out.dt, out.base, o, acc);
        }
    }
}

}  // namespace di
