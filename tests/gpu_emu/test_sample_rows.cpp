// sample's and spec_verify's row bodies of the GPU backend (backends/cuda/src/sample_rows.cuh: the
// softmax pass, the portable sort of sort_rows.cuh, the pick of each op), run on the CPU through
// host_emu.h exactly as sampling.cu's kernels run them, one emulated block per row. Built and driven
// by tests/test_gpu_emu.py, which writes the inputs of conformance cases and compares the outputs
// with the reference backend's, as the conformance suite compares a device library's.
//
//   test_sample_rows IN OUT THREADS
// IN: int64 [op (0 sample, 1 spec_verify), T, V, has_draft, want_probs, L, N, has_mask], then f32
//     logits[T*V], f32 draft_logits[T*V] (has_draft), int32 draft_ids[T] (spec_verify), f32
//     temperature[T], int32 top_k[T], f32 top_p[T], uint64 seeds[T]; then sample's 1.7 controls:
//     int32 history[T*L], int32 prompt_lens[T], f32 penalties[T*3] (L >= 0), int32 bias_ids[T*N],
//     f32 bias[T*N] (N >= 0), int32 token_mask[T*ceil(V/32)] (has_mask); L, N = -1: absent.
// OUT: int32 out[T], then int32 accepted[T] (spec_verify) or f32 probs[T] (sample with probs).
#include <stdio.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "device.cuh"
#include "sample_rows.cuh"
#include "sort_rows.cuh"

using namespace di;

template <class T>
static bool read_n(FILE* f, std::vector<T>& v, size_t n) {
    v.resize(n);
    return fread(v.data(), sizeof(T), n, f) == n;
}

static DTensor tensor(void* base, int dt, int64_t rows, int64_t cols) {
    DTensor t;
    memset(&t, 0, sizeof t);
    t.base = static_cast<char*>(base);
    t.dt = dt;
    t.ndim = cols ? 2 : 1;
    t.shape[0] = rows;
    t.shape[1] = cols;
    t.strides[0] = cols ? cols : 1;
    t.strides[1] = 1;
    return t;
}

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: test_sample_rows IN OUT THREADS\n");
        return 2;
    }
    FILE* in = fopen(argv[1], "rb");
    const unsigned threads = (unsigned)atoi(argv[3]);
    std::vector<int64_t> hdr;
    if (!in || !read_n(in, hdr, 8)) return 2;
    const int64_t op = hdr[0], T = hdr[1], V = hdr[2], has_draft = hdr[3], want_probs = hdr[4];
    const int64_t L = hdr[5], N = hdr[6], has_mask = hdr[7], W = (V + 31) / 32;
    std::vector<float> logits, draft, temp, topp;
    std::vector<int32_t> ids, topk;
    std::vector<uint64_t> seeds;
    bool ok = read_n(in, logits, T * V);
    if (has_draft) ok = ok && read_n(in, draft, T * V);
    if (op == 1) ok = ok && read_n(in, ids, T);
    ok = ok && read_n(in, temp, T) && read_n(in, topk, T) && read_n(in, topp, T) && read_n(in, seeds, T);
    std::vector<int32_t> hist, plen, bids, mask;
    std::vector<float> pen, bias;
    if (L >= 0) ok = ok && read_n(in, hist, T * L) && read_n(in, plen, T) && read_n(in, pen, T * 3);
    if (N >= 0) ok = ok && read_n(in, bids, T * N) && read_n(in, bias, T * N);
    if (has_mask) ok = ok && read_n(in, mask, T * W);
    fclose(in);
    if (!ok) return 2;

    const int64_t R = has_draft ? 2 * T : T;
    SampleP p{R, V, T};
    std::vector<float> k0(R * V), k1(R * V), dense(R * V, NAN);
    std::vector<int> v0(R * V), v1(R * V), offs(2 * R);
    std::vector<int32_t> out(T, 0x7f7f7f7f), acc(T, 0x7f7f7f7f);
    std::vector<float> probs(T, NAN);
    DTensor lg = tensor(logits.data(), DT_F32, T, V), dlg = has_draft ? tensor(draft.data(), DT_F32, T, V) : lg;
    DTensor dt_temp = tensor(temp.data(), DT_F32, T, 0), dt_topk = tensor(topk.data(), DT_I32, T, 0);
    DTensor dt_topp = tensor(topp.data(), DT_F32, T, 0), dt_seeds = tensor(seeds.data(), DT_U64, T, 0);
    DTensor dt_ids = tensor(ids.data(), DT_I32, T, 0), dt_out = tensor(out.data(), DT_I32, T, 0);
    DTensor dt_acc = tensor(acc.data(), DT_I32, T, 0);
    DTensor dt_probs = want_probs ? tensor(probs.data(), DT_F32, T, 0) : tensor(nullptr, DT_F32, T, 0);
    // sample's controls first (sampling.cu: k_sample_controls), into adjusted rows the rest then reads
    std::vector<float> adj;
    std::vector<int> cnt, dead;
    if (L >= 0 || N >= 0 || has_mask) {
        SampleControls c;
        memset(&c, 0, sizeof c);
        if (L >= 0) {
            c.hist = tensor(hist.data(), DT_I32, T, L);
            c.hist.shape[1] = L;    // (a [T, 0] history is still a history)
            c.plen = tensor(plen.data(), DT_I32, T, 0);
            c.pen = tensor(pen.data(), DT_F32, T, 3);
        }
        if (N >= 0) {
            c.bids = tensor(bids.data(), DT_I32, T, N);
            c.bids.shape[1] = N;
            c.bias = tensor(bias.data(), DT_F32, T, N);
        }
        if (has_mask) c.mask = tensor(mask.data(), DT_I32, T, W);
        adj.assign(T * V, NAN);
        cnt.assign(T * V, 0x55555555);   // poison: control_row zeroes what it uses
        dead.assign(T, 7);
        for (int64_t t = 0; t < T; ++t)
            di_emu::run_block(threads, [&] {
                __shared__ int flag;
                const int left = control_row(lg, t * V, c, t, V, &adj[t * V], &cnt[t * V], &flag);
                if (threadIdx.x == 0) dead[t] = !left;
            });
        lg = tensor(adj.data(), DT_F32, T, V);
        dlg = lg;
        p.dead = dead.data();
    }
    // the three kernels of the op, in order (sampling.cu: k_sample_probs, k_sort_rows, k_*_pick)
    for (int64_t r = 0; r < R; ++r)
        di_emu::run_block(threads, [&] {
            __shared__ float red[MAX_WARPS];
            probs_row(lg, dlg, dt_temp, k0.data(), v0.data(), offs.data(), p, r, red);
        });
    for (int64_t r = 0; r < R; ++r) {
        if (!(temp[r % T] > 0.f)) continue;
        di_emu::run_block(threads, [&] { sort_row_desc(&k0[r * V], &v0[r * V], &k1[r * V], &v1[r * V], V); });
    }
    for (int64_t t = 0; t < T; ++t)
        di_emu::run_block(threads, [&] {
            if (op == 0)
                sample_pick_row(lg, dt_temp, dt_topk, dt_topp, dt_seeds, k0.data(), v0.data(), dt_out, dt_probs, p, t);
            else
                verify_pick_row(lg, dt_ids, dt_temp, dt_topk, dt_topp, dt_seeds, k0.data(), v0.data(), dense.data(),
                                dt_out, dt_acc, (int)has_draft, p, t);
        });
    FILE* o = fopen(argv[2], "wb");
    if (!o) return 2;
    fwrite(out.data(), 4, T, o);
    if (op == 1) fwrite(acc.data(), 4, T, o);
    else if (want_probs) fwrite(probs.data(), 4, T, o);
    fclose(o);
    return 0;
}
