// mla_rope_cache_write (ABI 1.6): MLA's prologue (q's rope dims, the latent's rmsnorm, k_pe's rope, the
// paged cache row and kv_out) in one launch instead of four: at batch 1 each of those was a tiny,
// launch-bound kernel. One block per token; the math is rmsnorm's (norm.cu) and rope's (rope.cu), term
// for term, so the outputs match the unfused kernels' up to the order of the sum of squares.
//
// tests/gpu_emu/test_fused_ops.cpp includes this file with DI_GPU_HOST_EMU defined and runs the kernel
// on the CPU, one emulated block at a time; the host side below is left out there.
#include "device.cuh"
#include "kernel_util.cuh"
#include "pdl.cuh"
#include "rope.cuh"

namespace di {

// 512 threads: the block rmsnorm's k_rmsnorm launches with, so the latent's sum of squares is reduced
// in the same order (the same bits for Dc <= 512) and V3's 16 heads x 32 rope pairs take one pass.
constexpr int FUSED_ROPE_THREADS = 512;

struct FusedRopeP {
    int64_t  T, H, Dq, Dc, Dr, NB, BS;
    int32_t  interleaved;
    float    eps;
    RopeFreq f;   // of the Dr rotated dims
};

// Dynamic shared memory: the latent row [Dc] and k_pe [Dr] as read (f32), then cos and sin of each of
// the Dr / 2 rope pairs.
__global__ void k_mla_rope_cache_write(DTensor q, DTensor kv, DTensor w, DTensor pos, DTensor slots, DTensor cache,
                                       DTensor kv_out, FusedRopeP p) {
    DI_DYN_SMEM(float, sm);
    __shared__ float red[MAX_WARPS];
    const int64_t Dc = p.Dc, Dr = p.Dr, half = Dr / 2, tid = threadIdx.x;
    // before the wait (it overlaps the previous kernel's tail under PDL): the inverse frequency of this
    // thread's first pair (the op's parameters only) and an L2 prefetch of its norm weight (a hint: the
    // weight itself is read after the wait, since a caller may pass one an earlier op wrote)
    const double inv0 = tid < half ? rope_inv_freq(p.f, tid) : 0.0;
    if (tid < Dc) prefetch_l2(w.base + (tid << dt_lg(w.dt)));
    pdl_wait();
    pdl_trigger();
    const float w0 = tid < Dc ? load_f(w.dt, w.base, tid) : 0.f;
    float* lat = sm;
    float* kpe = lat + Dc;
    float* cs = kpe + Dr;   // cos of pair j at j, sin at half + j
    const int64_t qpairs = p.H * half;
    for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
        // (a) kv's row, read once: every read happens before the barrier of block_sum, every write after
        // it, which is what lets kv_out be kv. This thread's first q pair is read with it (q is only
        // written by the thread that reads it).
        const int64_t ko = t * kv.strides[0];
        // q pair i of token t: its row offset and the offsets of its two elements
        auto q_pair = [&](int64_t i, int64_t* qo, int64_t* i0, int64_t* i1) {
            const int64_t h = i / half, j = i % half;
            *qo = t * q.strides[0] + h * q.strides[1] + (p.Dq - Dr);
            *i0 = p.interleaved ? 2 * j : j;
            *i1 = p.interleaved ? 2 * j + 1 : j + half;
        };
        float qu0 = 0.f, qv0 = 0.f;
        if (tid < qpairs) {
            int64_t qo, i0, i1;
            q_pair(tid, &qo, &i0, &i1);
            qu0 = load_f(q.dt, q.base, qo + i0);
            qv0 = load_f(q.dt, q.base, qo + i1);
        }
        float ss = 0.f;
        for (int64_t h = tid; h < Dc; h += blockDim.x) {
            const float v = load_f(kv.dt, kv.base, ko + h);
            lat[h] = v;
            ss += v * v;
        }
        for (int64_t i = tid; i < Dr; i += blockDim.x) kpe[i] = load_f(kv.dt, kv.base, ko + Dc + i);
        // (b) each pair's angle once per token, in f64 as rope.cu computes it
        const double pp = (double)load_i(pos.dt, pos.base, t * pos.strides[0]);
        for (int64_t j = tid; j < half; j += blockDim.x)
            rope_cos_sin_at(p.f, j == tid ? inv0 : rope_inv_freq(p.f, j), pp, &cs[j], &cs[half + j]);
        ss = block_sum(ss, red);   // also the barrier after which lat, kpe and cs are complete
        const float r = rsqrtf(ss / (float)Dc + p.eps);
        // (c) the cache row (slots outside [0, NB*BS) write nothing) and kv_out
        const int64_t slot = load_i(slots.dt, slots.base, t * slots.strides[0]);
        const bool to_cache = slot >= 0 && slot < p.NB * p.BS;
        const int64_t co = to_cache ? (slot / p.BS) * cache.strides[0] + (slot % p.BS) * cache.strides[1] : 0;
        const int64_t oo = kv_out.base ? t * kv_out.strides[0] : 0;
        for (int64_t h = tid; h < Dc; h += blockDim.x) {
            const float v = lat[h] * r * (h == tid ? w0 : load_f(w.dt, w.base, h));
            if (to_cache) store_f(cache.dt, cache.base, co + h, v);
            if (kv_out.base) store_f(kv_out.dt, kv_out.base, oo + h, v);
        }
        for (int64_t j = tid; j < half; j += blockDim.x) {
            const int64_t i0 = p.interleaved ? 2 * j : j, i1 = p.interleaved ? 2 * j + 1 : j + half;
            const float c = cs[j], s = cs[half + j], u = kpe[i0], v = kpe[i1];
            const float ru = u * c - v * s, rv = v * c + u * s;
            if (to_cache) {
                store_f(cache.dt, cache.base, co + Dc + i0, ru);
                store_f(cache.dt, cache.base, co + Dc + i1, rv);
            }
            if (kv_out.base) {
                store_f(kv_out.dt, kv_out.base, oo + Dc + i0, ru);
                store_f(kv_out.dt, kv_out.base, oo + Dc + i1, rv);
            }
        }
        // every head's q_pe, in place: H * Dr / 2 pairs, each read and written by one thread
        for (int64_t i = tid; i < qpairs; i += blockDim.x) {
            int64_t qo, i0, i1;
            q_pair(i, &qo, &i0, &i1);
            const int64_t j = i % half;
            const float c = cs[j], s = cs[half + j];
            const float u = i == tid ? qu0 : load_f(q.dt, q.base, qo + i0);
            const float v = i == tid ? qv0 : load_f(q.dt, q.base, qo + i1);
            store_f(q.dt, q.base, qo + i0, u * c - v * s);
            store_f(q.dt, q.base, qo + i1, v * c + u * s);
        }
        __syncthreads();   // the next token's reads must not overwrite this one's shared rows early
    }
}

// bytes of k_mla_rope_cache_write's dynamic shared memory
inline size_t fused_rope_smem(int64_t Dc, int64_t Dr) { return (size_t)(Dc + 2 * Dr) * sizeof(float); }

}  // namespace di

#if !defined(DI_GPU_HOST_EMU)
#include "arg_checks.cuh"

using namespace di;

#define FLOATS DT_F32, DT_BF16   // DI_DTS_FLOAT of the op table

DI_Status op_mla_rope_cache_write(DI_Context* ctx, const DI_MLARopeCacheWriteArgs* a, OpMode* mode) {
    const char* op = "mla_rope_cache_write";
    DI_TRY(check_header(ctx, op, a, sizeof(*a), "DI_MLARopeCacheWriteArgs"));
    QTensor q, kv, w, pos, slots, cache, kvo;
    bool has_out;
    DI_TRY(take_tensor(ctx, mode, op, "q", a->q, 3, 0, &q));
    DI_TRY(take_tensor(ctx, mode, op, "kv", a->kv, 2, 0, &kv));
    DI_TRY(take_tensor(ctx, mode, op, "norm_weight", a->norm_weight, 1, 0, &w));
    DI_TRY(take_tensor(ctx, mode, op, "positions", a->positions, 1, 0, &pos));
    DI_TRY(take_tensor(ctx, mode, op, "slots", a->slots, 1, 0, &slots));
    DI_TRY(take_tensor(ctx, mode, op, "cache", a->cache, 3, 0, &cache));
    DI_TRY(take_opt(ctx, mode, op, "kv_out", a->kv_out, 2, &kvo, &has_out));
    DI_NEED_DT(ctx, op, "q", q.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "kv", kv.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "norm_weight", w.q.dt, FLOATS);
    DI_NEED_DT(ctx, op, "positions", pos.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "slots", slots.q.dt, DT_I32);
    DI_NEED_DT(ctx, op, "cache", cache.q.dt, FLOATS);
    if (has_out) DI_NEED_DT(ctx, op, "kv_out", kvo.q.dt, FLOATS);
    FusedRopeP p{};
    p.T = q.q.shape[0];
    p.H = q.q.shape[1];
    p.Dq = q.q.shape[2];
    p.Dc = w.q.shape[0];
    p.Dr = kv.q.shape[1] - p.Dc;
    DI_TRY(need_shape(ctx, op, "kv", kv.q, 0, p.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "positions", pos.q, 0, p.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "slots", slots.q, 0, p.T, "q.shape[0]"));
    DI_TRY(need_shape(ctx, op, "cache", cache.q, 2, kv.q.shape[1], "kv.shape[1]"));
    if (has_out) DI_TRY(same_shape(ctx, op, "kv", kv.q, "kv_out", kvo.q));
    if (p.Dr < 0 || p.Dr % 2)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: Dr = kv.shape[1] - norm_weight.shape[0] = %lld must be even "
                         "and >= 0", op, (long long)p.Dr);
    if (p.Dq < p.Dr)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: q.shape[2]=%lld < Dr=%lld", op, (long long)p.Dq,
                         (long long)p.Dr);
    DI_TRY(need_finite(ctx, op, "eps", a->eps, true));
    if (a->interleaved != 0 && a->interleaved != 1)
        return set_error(ctx, DI_INVALID_ARGUMENT, "%s: interleaved=%d, expected 0 or 1", op, a->interleaved);
    DI_TRY(rope_freq(ctx, op, p.Dr, a->scaling, a->theta, a->factor, a->original_max_position, a->beta_fast,
                     a->beta_slow, a->attn_factor, true, &p.f));
    p.interleaved = a->interleaved;
    p.eps = a->eps;
    p.NB = cache.q.shape[0];
    p.BS = cache.q.shape[1];
    const size_t smem = fused_rope_smem(p.Dc, p.Dr);
    if (smem > DYN_SMEM_MAX)
        return set_error(ctx, DI_UNIMPLEMENTED, "%s: Dc + 2 * Dr = %lld floats exceed this library's shared memory",
                         op, (long long)(p.Dc + 2 * p.Dr));
    if (!mode->launch || p.T == 0) return DI_OK;
    allow_smem(k_mla_rope_cache_write, smem);
    launch_pdl(k_mla_rope_cache_write, grid_for(p.T, 1, 65535), FUSED_ROPE_THREADS, smem,
               (cudaStream_t)a->header.stream, q.q, kv.q, w.q, pos.q, slots.q, cache.q, kvo.q, p);
    return launch_status(ctx, op);
}
#endif
