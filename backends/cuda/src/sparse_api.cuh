// What sparse.cu shares with the other ops: the cleaning of an `indices` argument (sorted, distinct,
// in range), which mla_decode (ABI 1.3, V3.2's sparse MLA) runs as well as sparse_attention.
#pragma once

#include "common.cuh"

namespace di {

// The largest number of columns of `indices` the cleaning sorts in one block's shared memory.
int64_t clean_indices_max_k();

// Workspace of the cleaned rows of a [T, K] `indices`: list [T, K] int32, then counts [T] int32.
uint64_t clean_indices_bytes(int64_t T, int64_t K);

// list[t, 0 .. cnt[t]) = the distinct entries of idx[t] in [0, min(kv_len[t], cap) / ratio), ascending
// (a row whose token_seq is outside [0, S) keeps none). ws points at clean_indices_bytes(T, K) bytes.
DI_Status launch_clean_indices(DI_Context* ctx, const char* op, const DTensor& idx, const DTensor& seq,
                               const DTensor& kvl, int64_t S, int64_t cap, int ratio, char* ws, cudaStream_t s);

}  // namespace di
