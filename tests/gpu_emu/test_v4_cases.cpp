// Conformance cases through the GPU backend's ABI 1.3 kernels on the CPU: tests/test_gpu_emu_v4.py
// writes a case of hc_pre, hc_post, kv_compress, indexer_topk, sparse_attention or layernorm (its
// tensors in the op table's field order, contiguous, then its scalars), this program runs the
// kernels of hyper.cuh, norm.cuh and sparse.cuh on it through host_emu.h with the launches hyper.cu, norm.cu and sparse.cu make, and writes
// every tensor back; the test compares the outputs with the reference backend's as the conformance
// suite compares a device library's. The split counts are fixed here rather than sized for a GPU
// (more splits than the host would pick for these small cases, so the merges run).
//
//   test_v4_cases IN OUT
// IN:  int32 op (0 hc_pre, 1 hc_post, 2 kv_compress, 3 indexer_topk, 4 sparse_attention, 5 layernorm),
//      int32 n; n x [int32 present; if present: int32 dt (DI_DTypeId: f32, bf16, i32), int32 ndim,
//      int64 shape[ndim], int64 bytes, the bytes]; int32 m, float64 scalars[m] (the op's scalars in the
//      order the test lists them).
// OUT: the bytes of every present tensor, in order.
#include <stdio.h>

#include <cstdint>
#include <vector>

#include "device.cuh"
#include "hyper.cuh"
#include "norm.cuh"
#include "sparse.cuh"

using namespace di;

struct Arg {
    bool present = false;
    std::vector<int64_t> shape;
    std::vector<uint64_t> mem;   // 8-byte words: any element read stays inside
    int64_t bytes = 0;
    DTensor v;
};

template <class T>
static bool rd(FILE* f, T* v, size_t n = 1) {
    return fread(v, sizeof(T), n, f) == n;
}

template <class F>
static void launch(int64_t gx, int64_t gy, unsigned threads, F&& body) {
    di_emu::grid_dim = {(unsigned)gx, (unsigned)gy, 1};
    for (int64_t y = 0; y < gy; ++y)
        for (int64_t x = 0; x < gx; ++x) {
            di_emu::block_idx = {(unsigned)x, (unsigned)y, 0};
            di_emu::run_block(threads, body);
        }
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: test_v4_cases IN OUT\n");
        return 2;
    }
    FILE* in = fopen(argv[1], "rb");
    if (!in) return 2;
    int32_t op = -1, n = 0, m = 0;
    if (!rd(in, &op) || !rd(in, &n)) return 2;
    std::vector<Arg> a((size_t)n);
    for (auto& x : a) {
        memset(&x.v, 0, sizeof x.v);
        int32_t present = 0, dt = 0, nd = 0;
        if (!rd(in, &present)) return 2;
        if (!present) continue;
        if (!rd(in, &dt) || !rd(in, &nd)) return 2;
        x.present = true;
        x.shape.resize((size_t)nd);
        if (nd && !rd(in, x.shape.data(), (size_t)nd)) return 2;
        if (!rd(in, &x.bytes)) return 2;
        x.mem.assign((size_t)(x.bytes / 8 + 2), 0);
        if (x.bytes && fread(x.mem.data(), 1, (size_t)x.bytes, in) != (size_t)x.bytes) return 2;
        x.v.base = reinterpret_cast<char*>(x.mem.data());
        x.v.dt = dt;
        x.v.ndim = nd;
        int64_t s = 1;
        for (int d = DI_MAX_DIMS - 1; d >= 0; --d) {
            x.v.shape[d] = d < nd ? x.shape[(size_t)d] : 1;
            x.v.strides[d] = d < nd ? s : 0;
            if (d < nd) s *= x.shape[(size_t)d];
        }
    }
    if (!rd(in, &m)) return 2;
    std::vector<double> sc((size_t)m);
    if (m && !rd(in, sc.data(), (size_t)m)) return 2;
    fclose(in);

    if (op == 0) {   // hc_pre: x, fn, base, scale, out, post, comb; eps, hc_eps, sinkhorn_iters
        const DTensor &x = a[0].v, &fn = a[1].v;
        HcDims d{};
        d.T = x.shape[0];
        d.N = (int)x.shape[1];
        d.H = x.shape[2];
        d.NH = d.N * d.H;
        d.M = (int)fn.shape[0];
        d.eps = (float)sc[0];
        d.hc_eps = (float)sc[1];
        d.iters = (int)sc[2];
        d.chunk = ceil_div(d.NH, (int64_t)3);
        d.splits = (int)ceil_div(d.NH, d.chunk);
        const int TT = d.M <= 24 && d.T > 1 ? 4 : 1;   // as sparse.cu picks
        std::vector<float> part((size_t)(d.T * d.splits * (d.M + 1)) + 1, NAN);
        if (d.T > 0) {
            launch(ceil_div(d.T, (int64_t)TT), d.splits, HC_THREADS, [&] {
                if (TT == 4) k_hc_mix<24, 4>(x, fn, part.data(), d);
                else if (d.M <= 24) k_hc_mix<24, 1>(x, fn, part.data(), d);
                else k_hc_mix<(2 + HC_MAX_N) * HC_MAX_N, 1>(x, fn, part.data(), d);
            });
            launch(std::min<int64_t>(d.T, 3), 1, HC_THREADS, [&] {
                switch (d.N) {
#define FIN(n) case n: k_hc_finish<n>(x, a[2].v, a[3].v, part.data(), a[4].v, a[5].v, a[6].v, d); break;
                    DI_HC_STREAMS(FIN)
#undef FIN
                }
            });
        }
    } else if (op == 1) {   // hc_post: x, y, post, comb, out
        const DTensor& x = a[0].v;
        const int64_t T = x.shape[0], N = x.shape[1], H = x.shape[2], hch = ceil_div(H, (int64_t)256);
        if (T * N * H > 0)
            launch(std::min<int64_t>(T * hch, 3), 1, 256, [&] { k_hc_post(x, a[1].v, a[2].v, a[3].v, a[4].v, T, H, (int)N, hch); });
    } else if (op == 2) {   // kv_compress: staged, position_bias, block_table, token_seq, positions, out; ratio, overlap
        const DTensor& st = a[0].v;
        CompressDims d{};
        d.NB = st.shape[0];
        d.BS = st.shape[1];
        d.W = st.shape[2] / 2;
        d.S = a[2].v.shape[0];
        d.T = a[4].v.shape[0];
        d.ratio = (int)sc[0];
        d.overlap = (int)sc[1];
        d.D = d.overlap ? d.W / 2 : d.W;
        if (d.T * d.D > 0)
            launch(std::min<int64_t>(ceil_div(d.T * d.D, (int64_t)256), 4), 1, 256,
                   [&] { k_kv_compress(st, a[1].v, a[2].v, a[3].v, a[4].v, a[5].v, d); });
    } else if (op == 3) {   // indexer_topk: q, weights, keys, block_table, token_seq, kv_len, out; scale, ratio, block_size
        const DTensor &q = a[0].v, &keys = a[2].v, &btab = a[3].v;
        IndexerDims d{};
        d.T = q.shape[0];
        d.NI = q.shape[1];
        d.Di = q.shape[2];
        d.NB = keys.shape[0];
        d.CB = keys.shape[1];
        d.S = btab.shape[0];
        d.K = a[6].v.shape[1];
        d.scale = (float)sc[0];
        d.ratio = (int)sc[1];
        d.bs = (int64_t)sc[2];
        d.P = pow2_at_least(d.K);
        d.cap = btab.shape[1] * d.bs;
        d.maxN = d.cap / d.ratio;
        std::vector<float> scores((size_t)(d.T * d.maxN) + 1, NAN);
        if (d.T > 0 && d.K > 0) {
            if (d.maxN > 0)
                launch(ceil_div(d.maxN, (int64_t)TB), std::min<int64_t>(d.T, 2), 256,
                       [&] { k_index_scores(q, a[1].v, keys, btab, a[4].v, a[5].v, scores.data(), d); });
            launch(std::min<int64_t>(d.T, 2), 1, 512, [&] { k_index_topk(scores.data(), a[4].v, a[5].v, a[6].v, d); });
        }
    } else if (op == 4) {   // sparse_attention: q, kv_cache, comp_cache, indices, sinks, block_table, token_seq, kv_len, out
        const DTensor &q = a[0].v, &kv = a[1].v, &btab = a[5].v;
        SparseDims d{};
        d.T = q.shape[0];
        d.NH = q.shape[1];
        d.D = (int)q.shape[2];
        d.NB = kv.shape[0];
        d.BS = kv.shape[1];
        d.S = btab.shape[0];
        d.MB = btab.shape[1];
        d.scale = (float)sc[0];
        d.window = (int)sc[1];
        d.ratio = 1;
        if (a[2].present) {
            d.has_comp = 1;
            d.ratio = (int)sc[2];
            d.NBc = a[2].v.shape[0];
            d.CB = a[2].v.shape[1];
            d.has_idx = a[3].present;
            d.K = a[3].present ? a[3].v.shape[1] : 0;
        }
        d.splits = 3;
        const int64_t cap = d.MB * d.BS;
        std::vector<int> list((size_t)(d.T * std::max<int64_t>(d.K, 1)) + 1, -7), cnt((size_t)d.T + 1, -7);
        if (d.T * d.NH > 0 && d.D > 0) {
            if (d.K) {
                const CleanDims cd{d.T, d.K, d.S, cap, d.ratio, pow2_at_least(d.K)};
                launch(std::min<int64_t>(d.T, 2), 1, (unsigned)std::min<int64_t>(1024, std::max<int64_t>(LANES, cd.P)),
                       [&] { k_clean_indices(a[3].v, a[6].v, a[7].v, list.data(), cnt.data(), cd); });
            } else if (d.has_idx) {   // indices [T, 0]: no entry at all (launch_clean_indices zeroes the counts)
                std::fill(cnt.begin(), cnt.end(), 0);
            }
            std::vector<float> part((size_t)(d.T * d.NH * d.splits * (d.D + 2)), NAN);
            const int64_t nq = ceil_div((int64_t)d.D, (int64_t)LANES);
            launch(d.T * ceil_div(d.NH, (int64_t)SP_HG), d.splits, SP_WARPS * LANES, [&] {
                if (nq <= 4) k_sparse_attn<4>(q, kv, a[2].v, btab, a[6].v, a[7].v, list.data(), cnt.data(), part.data(), d);
                else if (nq <= 8) k_sparse_attn<8>(q, kv, a[2].v, btab, a[6].v, a[7].v, list.data(), cnt.data(), part.data(), d);
                else k_sparse_attn<16>(q, kv, a[2].v, btab, a[6].v, a[7].v, list.data(), cnt.data(), part.data(), d);
            });
            launch(std::min<int64_t>(d.T * d.NH, 3), 1, 128,
                   [&] { k_sparse_merge(part.data(), a[6].v, a[7].v, cnt.data(), a[4].v, a[8].v, d); });
        }
    } else if (op == 5) {   // layernorm: x, weight, bias, out; eps
        const DTensor& x = a[0].v;
        const int64_t T = x.shape[0], H = x.shape[1];
        if (T > 0 && H > 0) launch(std::min<int64_t>(T, 2), 1, 256, [&] { k_layernorm(x, a[1].v, a[2].v, a[3].v, T, H, (float)sc[0]); });
    } else {
        fprintf(stderr, "unknown op %d\n", op);
        return 2;
    }

    FILE* o = fopen(argv[2], "wb");
    if (!o) return 2;
    for (auto& x : a)
        if (x.present && x.bytes) fwrite(x.mem.data(), 1, (size_t)x.bytes, o);
    fclose(o);
    return 0;
}
