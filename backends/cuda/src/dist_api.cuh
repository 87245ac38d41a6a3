// What dist.cu shares with api.cu: the communicator entries of the DI_Api table (ABI 1.4). The
// ops themselves (all_reduce, all_gather, all_to_all, moe_dispatch, moe_combine) are declared with
// every other op in common.cuh. api.cu checks ctx and catches exceptions; these do the rest.
#pragma once

#include "common.cuh"

namespace di {

// 128 bytes naming a new communicator: NCCL's unique id, or, where NCCL cannot be loaded, an id of
// this library's own that comm_create accepts for a one-rank communicator only.
DI_Status dist_comm_unique_id(DI_Context* ctx, DI_CommId* out);

// Joins communicator `id` as `rank` of `nranks` on the context's device (collective: blocks until
// every rank has joined).
DI_Status dist_comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out);

DI_Status dist_comm_destroy(DI_Context* ctx, DI_Comm* comm);

}  // namespace di
