// What mla_decode's kernels share (attention.cu's generic kernels and mla_decode_bf16.cuh's fast
// path): the problem's dimensions and how a token's positions are split into chunks. A header of its
// own so tests/gpu_emu can run the fast path's kernels on the CPU.
#pragma once

#include "device.cuh"

namespace di {

constexpr int MLA_MIN_CHUNK = 16; // positions: smaller chunks cost more in the merge than they save

struct DecodeDims {
    int64_t T, H, S, MB, NB, BS;
    int     Dn, Dr, Dv, Dc, splits;
    const int* list;   // [T, K] cleaned indices, or NULL: positions [0, kv_len)
    const int* cnt;    // [T] their counts
    int64_t    K;
};

// the number of positions token t attends: kv_len[t], or its count of cleaned indices
__device__ __forceinline__ int64_t decode_len(const DTensor& seq, const DTensor& kvl, const DecodeDims& d, int64_t t,
                                              int64_t* s_out) {
    int64_t s = load_i(seq.dt, seq.base, t * seq.strides[0]);
    int64_t len = d.list ? d.cnt[t] : load_i(kvl.dt, kvl.base, t * kvl.strides[0]);
    if (s < 0 || s >= d.S) len = 0;
    if (len < 0) len = 0;
    if (len > d.MB * d.BS) len = d.MB * d.BS;  // never index past the block table
    *s_out = s;
    return len;
}

// positions per chunk for a token with `len` keys: the fixed number of splits shares them, in
// multiples of MLA_MIN_CHUNK; chunks at or past len are inactive (neither written nor merged)
__device__ __forceinline__ int64_t decode_chunk(int64_t len, int splits) {
    int64_t c = ceil_div(len, (int64_t)splits);
    return c < MLA_MIN_CHUNK ? MLA_MIN_CHUNK : ceil_div(c, MLA_MIN_CHUNK) * MLA_MIN_CHUNK;
}

// partial[(t*H + h) * splits + split] = [m, l, o (Dc)] over the positions of one chunk.
// A block serves MLA_HG heads of one token, so each latent row read from the cache is used by all of
// them (the heads share the cache: reading it once per head made decode L2-bound). One warp per
// position; each warp keeps an online-softmax state per head; the 8 warps merge at the end.
constexpr int MLA_HG = 4;

}  // namespace di
