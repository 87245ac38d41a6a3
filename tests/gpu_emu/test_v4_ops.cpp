// The ABI 1.3 kernels of the GPU backend (backends/cuda/src/hyper.cuh, norm.cuh, sparse.cuh: hc_pre, hc_post,
// layernorm, kv_compress, indexer_topk with its radix select and bitonic sort, sparse_attention and
// the cleaning of `indices`) run on the CPU through host_emu.h, block by block with the grids
// hyper.cu, norm.cu and sparse.cu launch, and are compared with serial float64 transcriptions of abi/README.md section 8.
// The compressor's reference builds its slots the way transformers' DeepSeek V4 code does (the
// two-series window layout), an independent statement of the mapping the kernel computes per slot.
// Inputs are small, strided (padded rows) and in both float dtypes; outputs are poisoned with NaN
// first. The indexer uses small-integer inputs so that its scores are exact in f32 and the top-k
// order, ties included, must match exactly.
//
// Built and run by tests/test_gpu_emu_v4.py; exit status 0 and "all checks passed" when every check
// passes, else 1 with the mismatches on stderr.
#include <stdio.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "device.cuh"
#include "hyper.cuh"
#include "norm.cuh"
#include "sparse.cuh"

using namespace di;

static int failures = 0;
#define CHECK(cond, ...)                                         \
    do {                                                         \
        if (!(cond)) {                                           \
            if (failures < 40) {                                 \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                    \
                fprintf(stderr, "\n");                           \
            }                                                    \
            ++failures;                                          \
        }                                                        \
    } while (0)

static std::mt19937_64 rng(20261205);
static double uni(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
static int irand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// ------------------------------------------------------------------------------ host tensors
// Row-major storage (the last dimension padded by `pad` elements, so the views are strided), poisoned
// with NaN (and a junk int32), with the device view the kernels take.
struct HT {
    int dt = DT_F32;
    std::vector<int64_t> shape, strides;
    std::vector<uint32_t> mem;
    DTensor v;   // points into mem: moving keeps the buffer, copying would not
    HT() { memset(&v, 0, sizeof v); }
    HT(const HT&) = delete;
    HT& operator=(const HT&) = delete;
    HT(HT&&) = default;
    HT& operator=(HT&&) = default;
    HT(int dt_, std::vector<int64_t> shp, int64_t pad = 0) : dt(dt_), shape(std::move(shp)) {
        const int nd = (int)shape.size();
        strides.assign(nd, 1);
        int64_t s = 1;
        for (int d = nd - 1; d >= 0; --d) {
            strides[d] = s;
            s *= shape[d] + (d == nd - 1 ? pad : 0);
        }
        mem.assign((size_t)(s * (dt == DT_BF16 ? 2 : 4) / 4 + 4), 0x7fc0ffffu);
        memset(&v, 0, sizeof v);
        v.base = reinterpret_cast<char*>(mem.data());
        v.dt = dt;
        v.ndim = nd;
        for (int d = 0; d < DI_MAX_DIMS; ++d) {
            v.shape[d] = d < nd ? shape[d] : 1;
            v.strides[d] = d < nd ? strides[d] : 0;
        }
    }
    int64_t off(std::initializer_list<int64_t> ix) const {
        int64_t o = 0;
        int d = 0;
        for (int64_t i : ix) o += i * strides[d++];
        return o;
    }
    void put(int64_t o, double x) {
        if (dt == DT_F32) reinterpret_cast<float*>(mem.data())[o] = (float)x;
        else if (dt == DT_BF16) reinterpret_cast<uint16_t*>(mem.data())[o] = f_to_bf16((float)x);
        else reinterpret_cast<int32_t*>(mem.data())[o] = (int32_t)x;
    }
    double get(int64_t o) const {
        if (dt == DT_F32) return reinterpret_cast<const float*>(mem.data())[o];
        if (dt == DT_BF16) return bf16_to_f(reinterpret_cast<const uint16_t*>(mem.data())[o]);
        return reinterpret_cast<const int32_t*>(mem.data())[o];
    }
};

// within f32 compute error, plus the rounding of a bf16 output
static bool near(double got, double want, int dt) {
    const double atol = dt == DT_BF16 ? 2e-3 : 3e-5, rtol = dt == DT_BF16 ? 1e-2 : 3e-4;
    return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

static const char* dname(int dt) { return dt == DT_BF16 ? "bf16" : dt == DT_F32 ? "f32" : "i32"; }

// Runs body once per block of a gx x gy grid, each as one emulated block of `threads` threads.
template <class F>
static void launch(int64_t gx, int64_t gy, unsigned threads, F&& body) {
    di_emu::grid_dim = {(unsigned)gx, (unsigned)gy, 1};
    for (int64_t y = 0; y < gy; ++y)
        for (int64_t x = 0; x < gx; ++x) {
            di_emu::block_idx = {(unsigned)x, (unsigned)y, 0};
            di_emu::run_block(threads, body);
        }
}

static double sigm(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// ------------------------------------------------------------------------------ hc_pre
static void check_hc_pre(int N, int64_t T, int64_t H, bool block, int xdt, int odt, int splits_req, int iters) {
    const int M = block ? (2 + N) * N : N;
    HT x(xdt, {T, N, H}, 3), fn(DT_F32, {M, N * H}, 1), base(DT_F32, {M}), scale(DT_F32, {block ? 3 : 1});
    HT out(odt, {T, H}, 2), post, comb;
    if (block) {
        post = HT(DT_F32, {T, N}, 1);
        comb = HT(DT_F32, {T, N, N}, 1);
    }
    for (int64_t t = 0; t < T; ++t)
        for (int n = 0; n < N; ++n)
            for (int64_t h = 0; h < H; ++h) x.put(x.off({t, n, h}), uni(-2, 2));
    for (int m = 0; m < M; ++m) {
        for (int64_t k = 0; k < N * H; ++k) fn.put(fn.off({m, k}), uni(-0.1, 0.1));
        base.put(m, uni(-1, 1));
    }
    for (int i = 0; i < (block ? 3 : 1); ++i) scale.put(i, uni(0.5, 2));
    HcDims d{};
    d.T = T;
    d.H = H;
    d.NH = N * H;
    d.N = N;
    d.M = M;
    d.iters = iters;
    d.eps = 1e-6f;
    d.hc_eps = 1e-3f;
    d.chunk = ceil_div(d.NH, (int64_t)splits_req);
    d.splits = (int)ceil_div(d.NH, d.chunk);
    std::vector<float> part((size_t)(T * d.splits * (M + 1)), NAN);
    const int TT = M <= 24 && T > 1 ? 4 : 1;   // as sparse.cu picks
    launch(ceil_div(T, TT), d.splits, HC_THREADS, [&] {
        if (TT == 4) k_hc_mix<24, 4>(x.v, fn.v, part.data(), d);
        else if (M <= 24) k_hc_mix<24, 1>(x.v, fn.v, part.data(), d);
        else k_hc_mix<(2 + HC_MAX_N) * HC_MAX_N, 1>(x.v, fn.v, part.data(), d);
    });
    launch(2, 1, HC_THREADS, [&] {
        switch (N) {
#define FIN(n) case n: k_hc_finish<n>(x.v, base.v, scale.v, part.data(), out.v, post.v, comb.v, d); break;
            DI_HC_STREAMS(FIN)
#undef FIN
        }
    });

    for (int64_t t = 0; t < T; ++t) {
        std::vector<double> f(N * H);
        double ss = 0;
        for (int n = 0; n < N; ++n)
            for (int64_t h = 0; h < H; ++h) {
                f[n * H + h] = x.get(x.off({t, n, h}));
                ss += f[n * H + h] * f[n * H + h];
            }
        const double r = 1.0 / std::sqrt(ss / (N * H) + d.eps);
        std::vector<double> mix(M);
        for (int m = 0; m < M; ++m) {
            double s = 0;
            for (int64_t k = 0; k < N * H; ++k) s += fn.get(fn.off({m, k})) * f[k] * r;
            mix[m] = s;
        }
        std::vector<double> pre(N);
        for (int n = 0; n < N; ++n) pre[n] = sigm(mix[n] * scale.get(0) + base.get(n)) + d.hc_eps;
        for (int64_t h = 0; h < H; ++h) {
            double o = 0;
            for (int n = 0; n < N; ++n) o += pre[n] * f[n * H + h];
            const double got = out.get(out.off({t, h}));
            CHECK(near(got, o, odt), "hc_pre N=%d %s->%s out[%lld, %lld] = %.7g, want %.7g", N, dname(xdt), dname(odt),
                  (long long)t, (long long)h, got, o);
        }
        if (!block) continue;
        for (int n = 0; n < N; ++n) {
            const double want = 2 * sigm(mix[N + n] * scale.get(1) + base.get(N + n));
            const double got = post.get(post.off({t, n}));
            CHECK(near(got, want, DT_F32), "hc_pre post[%lld, %d] = %.7g, want %.7g", (long long)t, n, got, want);
        }
        std::vector<double> c(N * N);
        for (int i = 0; i < N; ++i) {
            double mx = -INFINITY, s = 0;
            for (int j = 0; j < N; ++j) mx = std::max(mx, mix[2 * N + i * N + j] * scale.get(2) + base.get(2 * N + i * N + j));
            for (int j = 0; j < N; ++j) s += std::exp(mix[2 * N + i * N + j] * scale.get(2) + base.get(2 * N + i * N + j) - mx);
            for (int j = 0; j < N; ++j)
                c[i * N + j] = std::exp(mix[2 * N + i * N + j] * scale.get(2) + base.get(2 * N + i * N + j) - mx) / s + d.hc_eps;
        }
        auto colnorm = [&] {
            for (int j = 0; j < N; ++j) {
                double s = 0;
                for (int i = 0; i < N; ++i) s += c[i * N + j];
                for (int i = 0; i < N; ++i) c[i * N + j] /= s + d.hc_eps;
            }
        };
        colnorm();
        for (int it = 1; it < iters; ++it) {
            for (int i = 0; i < N; ++i) {
                double s = 0;
                for (int j = 0; j < N; ++j) s += c[i * N + j];
                for (int j = 0; j < N; ++j) c[i * N + j] /= s + d.hc_eps;
            }
            colnorm();
        }
        for (int i = 0; i < N; ++i)
            for (int j = 0; j < N; ++j) {
                const double got = comb.get(comb.off({t, i, j}));
                CHECK(near(got, c[i * N + j], DT_F32), "hc_pre N=%d iters=%d comb[%lld, %d, %d] = %.7g, want %.7g", N,
                      iters, (long long)t, i, j, got, c[i * N + j]);
            }
    }
}

// ------------------------------------------------------------------------------ hc_post
static void check_hc_post(int N, int64_t T, int64_t H, int xdt, int ydt, int odt) {
    HT x(xdt, {T, N, H}, 1), y(ydt, {T, H}, 3), post(DT_F32, {T, N}), comb(DT_F32, {T, N, N}, 1), out(odt, {T, N, H}, 2);
    for (int64_t t = 0; t < T; ++t) {
        for (int n = 0; n < N; ++n) {
            for (int64_t h = 0; h < H; ++h) x.put(x.off({t, n, h}), uni(-2, 2));
            post.put(post.off({t, n}), uni(0, 2));
            for (int k = 0; k < N; ++k) comb.put(comb.off({t, n, k}), uni(0, 1));
        }
        for (int64_t h = 0; h < H; ++h) y.put(y.off({t, h}), uni(-2, 2));
    }
    const int64_t hchunks = ceil_div(H, (int64_t)256);
    launch(3, 1, 256, [&] { k_hc_post(x.v, y.v, post.v, comb.v, out.v, T, H, N, hchunks); });
    for (int64_t t = 0; t < T; ++t)
        for (int k = 0; k < N; ++k)
            for (int64_t h = 0; h < H; ++h) {
                double want = post.get(post.off({t, k})) * y.get(y.off({t, h}));
                for (int j = 0; j < N; ++j) want += comb.get(comb.off({t, j, k})) * x.get(x.off({t, j, h}));
                const double got = out.get(out.off({t, k, h}));
                CHECK(near(got, want, odt), "hc_post out[%lld, %d, %lld] = %.7g, want %.7g", (long long)t, k,
                      (long long)h, got, want);
            }
}

// ------------------------------------------------------------------------------ layernorm
static void check_layernorm(int64_t T, int64_t H, int xdt, bool bias) {
    HT x(xdt, {T, H}, 5), w(DT_F32, {H}), b, out(xdt, {T, H}, 1);
    if (bias) b = HT(DT_BF16, {H});
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) x.put(x.off({t, h}), 3.0 + uni(-2, 2));   // an offset mean: centring matters
    for (int64_t h = 0; h < H; ++h) {
        w.put(h, uni(0.5, 1.5));
        if (bias) b.put(h, uni(-1, 1));
    }
    const float eps = 1e-5f;
    launch(2, 1, 256, [&] { k_layernorm(x.v, w.v, b.v, out.v, T, H, eps); });
    for (int64_t t = 0; t < T; ++t) {
        double mean = 0, var = 0;
        for (int64_t h = 0; h < H; ++h) mean += x.get(x.off({t, h}));
        mean /= H;
        for (int64_t h = 0; h < H; ++h) var += (x.get(x.off({t, h})) - mean) * (x.get(x.off({t, h})) - mean);
        var /= H;
        for (int64_t h = 0; h < H; ++h) {
            double want = (x.get(x.off({t, h})) - mean) / std::sqrt(var + eps) * w.get(h) + (bias ? b.get(h) : 0.0);
            const double got = out.get(out.off({t, h}));
            CHECK(near(got, want, xdt), "layernorm %s bias=%d out[%lld, %lld] = %.7g, want %.7g", dname(xdt), (int)bias,
                  (long long)t, (long long)h, got, want);
        }
    }
}

// ------------------------------------------------------------------------------ paging helpers
// A block table of S sequences x MB blocks: a random permutation of the NB blocks (NB >= S * MB).
static HT block_table(int64_t S, int64_t MB, int64_t NB) {
    std::vector<int> perm(NB);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    HT t(DT_I32, {S, MB}, 1);
    for (int64_t s = 0; s < S; ++s)
        for (int64_t b = 0; b < MB; ++b) t.put(t.off({s, b}), perm[s * MB + b]);
    return t;
}

// ------------------------------------------------------------------------------ kv_compress
// The reference lays a closing window out as transformers' compressors do: overlap 0, the window's
// ratio rows; overlap 1 (CSA), 2 * ratio slots, the first ratio holding the previous window's first
// halves (value [0, D), gate [W, W + D), bias [0, D); -inf gates for window 0) and the last ratio
// the window's own second halves (value [D, W), gate [W + D, 2W), bias [D, W)).
static void check_kv_compress(int64_t BS, int ratio, int overlap, int64_t D, int sdt, int odt) {
    const int64_t W = overlap ? 2 * D : D, S = 2, MB = std::max<int64_t>(2, 4 * ratio / BS + 1), NB = S * MB + 1;
    HT st(sdt, {NB, BS, 2 * W}, 3), pb(DT_F32, {ratio, W}, 1);
    HT table = block_table(S, MB, NB);
    for (int64_t b = 0; b < NB; ++b)
        for (int64_t i = 0; i < BS; ++i)
            for (int64_t c = 0; c < 2 * W; ++c) st.put(st.off({b, i, c}), uni(-2, 2));
    for (int i = 0; i < ratio; ++i)
        for (int64_t c = 0; c < W; ++c) pb.put(pb.off({i, c}), uni(-1, 1));
    // rows: every closing position of both sequences, some non-closing ones, and a row whose
    // sequence is outside the table (a device library gives it zeros)
    std::vector<std::pair<int, int>> rows;   // (sequence, position)
    const int64_t cap = MB * BS;
    for (int s = 0; s < S; ++s)
        for (int64_t p = ratio - 1; p < cap; p += ratio) rows.push_back({s, (int)p});
    if (ratio > 1) {
        rows.push_back({0, 1});
        rows.push_back({1, ratio});
    }
    rows.push_back({(int)S, ratio - 1});
    const int64_t T = (int64_t)rows.size();
    HT seq(DT_I32, {T}), pos(DT_I32, {T}), out(odt, {T, D}, 2);
    for (int64_t t = 0; t < T; ++t) {
        seq.put(t, rows[t].first);
        pos.put(t, rows[t].second);
    }
    CompressDims d{};
    d.T = T;
    d.D = D;
    d.W = W;
    d.S = S;
    d.NB = NB;
    d.BS = BS;
    d.ratio = ratio;
    d.overlap = overlap;
    launch(2, 1, 256, [&] { k_kv_compress(st.v, pb.v, table.v, seq.v, pos.v, out.v, d); });

    auto srow = [&](int s, int64_t q, int64_t c) {
        return st.get(st.off({(int64_t)table.get(table.off({s, q / BS})), q % BS, c}));
    };
    for (int64_t t = 0; t < T; ++t) {
        const int s = rows[t].first;
        const int64_t p = rows[t].second;
        const bool closing = s < S && (p + 1) % ratio == 0;
        const int64_t w = (p + 1) / ratio - 1;
        for (int64_t f = 0; f < D; ++f) {
            double want = 0;
            if (closing) {
                std::vector<double> kv, gate;
                if (!overlap) {
                    for (int i = 0; i < ratio; ++i) {
                        kv.push_back(srow(s, w * ratio + i, f));
                        gate.push_back(srow(s, w * ratio + i, W + f) + pb.get(pb.off({i, f})));
                    }
                } else {
                    kv.assign(2 * ratio, 0.0);
                    gate.assign(2 * ratio, -INFINITY);
                    for (int i = 0; i < ratio; ++i) {
                        kv[ratio + i] = srow(s, w * ratio + i, D + f);
                        gate[ratio + i] = srow(s, w * ratio + i, W + D + f) + pb.get(pb.off({i, D + f}));
                        if (w >= 1) {
                            kv[i] = srow(s, (w - 1) * ratio + i, f);
                            gate[i] = srow(s, (w - 1) * ratio + i, W + f) + pb.get(pb.off({i, f}));
                        }
                    }
                }
                const double mx = *std::max_element(gate.begin(), gate.end());
                double den = 0, num = 0;
                for (size_t i = 0; i < gate.size(); ++i) {
                    const double e = std::exp(gate[i] - mx);
                    den += e;
                    num += e * kv[i];
                }
                want = num / den;
            }
            const double got = out.get(out.off({t, f}));
            CHECK(near(got, want, odt), "kv_compress BS=%lld ratio=%d overlap=%d %s: row %lld (seq %d, pos %lld) "
                  "feature %lld = %.7g, want %.7g", (long long)BS, ratio, overlap, dname(sdt), (long long)t, s,
                  (long long)p, (long long)f, got, want);
        }
    }
}

// ------------------------------------------------------------------------------ indexer_topk
// Small-integer q and keys and weights in {-1, -1/2, 1/2, 1, 2}: every score is exact in f32, so the
// kernel's order must be the reference's exactly, ties (many) to the lower entry.
static void check_indexer(int64_t NI, int64_t Di, int64_t bs, int ratio, int64_t MB, int64_t K,
                          const std::vector<int>& kv_lens, int qdt, int kdt, unsigned topk_threads) {
    const int64_t T = (int64_t)kv_lens.size(), S = 2, NB = S * MB + 2, CB = std::max<int64_t>(1, bs / ratio);
    HT q(qdt, {T, NI, Di}, 1), w(DT_F32, {T, NI}, 2), keys(kdt, {NB, CB, Di}, 3), seq(DT_I32, {T}), kvl(DT_I32, {T});
    HT out(DT_I32, {T, K}, 1);
    HT table = block_table(S, MB, NB);
    const double wv[] = {-1, -0.5, 0.5, 1, 2};
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < NI; ++h) {
            for (int64_t k = 0; k < Di; ++k) q.put(q.off({t, h, k}), irand(-2, 2));
            w.put(w.off({t, h}), wv[irand(0, 4)]);
        }
        seq.put(t, t % S);
        kvl.put(t, kv_lens[t]);
    }
    for (int64_t b = 0; b < NB; ++b)
        for (int64_t c = 0; c < CB; ++c)
            for (int64_t k = 0; k < Di; ++k) keys.put(keys.off({b, c, k}), irand(-1, 1));
    IndexerDims d{};
    d.T = T;
    d.NI = NI;
    d.Di = Di;
    d.S = S;
    d.NB = NB;
    d.CB = CB;
    d.bs = bs;
    d.cap = MB * bs;
    d.maxN = d.cap / ratio;
    d.K = K;
    d.ratio = ratio;
    d.P = pow2_at_least(K);
    d.scale = 0.25f;
    std::vector<float> scores((size_t)(T * d.maxN), NAN);
    launch(ceil_div(d.maxN, (int64_t)TB), std::min<int64_t>(T, 2), 256,
           [&] { k_index_scores(q.v, w.v, keys.v, table.v, seq.v, kvl.v, scores.data(), d); });
    launch(2, 1, topk_threads, [&] { k_index_topk(scores.data(), seq.v, kvl.v, out.v, d); });

    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = t % S, n = std::min<int64_t>(kv_lens[t], d.cap) / ratio;
        std::vector<double> sc(n);
        for (int64_t e = 0; e < n; ++e) {
            const int64_t pe = (e + 1) * ratio - 1;
            const int64_t blk = (int64_t)table.get(table.off({s, pe / bs})), slot = (pe % bs) / ratio;
            double tot = 0;
            for (int64_t h = 0; h < NI; ++h) {
                double dot = 0;
                for (int64_t k = 0; k < Di; ++k) dot += q.get(q.off({t, h, k})) * keys.get(keys.off({blk, slot, k}));
                tot += w.get(w.off({t, h})) * std::max(dot, 0.0);
            }
            sc[e] = 0.25 * tot;
            CHECK(scores[t * d.maxN + e] == (float)sc[e], "indexer score[%lld, %lld] = %.9g, want %.9g", (long long)t,
                  (long long)e, scores[t * d.maxN + e], sc[e]);
        }
        std::vector<int64_t> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sc[a] > sc[b]; });
        for (int64_t i = 0; i < K; ++i) {
            const int64_t want = i < n ? order[i] : -1;
            const int64_t got = (int64_t)out.get(out.off({t, i}));
            CHECK(got == want, "indexer_topk NI=%lld bs=%lld ratio=%d K=%lld row %lld (n=%lld): out[%lld] = %lld, want %lld",
                  (long long)NI, (long long)bs, ratio, (long long)K, (long long)t, (long long)n, (long long)i,
                  (long long)got, (long long)want);
        }
    }
}

// The selection alone on long rows of heavily tied scores (+0 and -0 among them, which rank equal).
static void check_topk_select(int64_t n, int64_t K, unsigned threads, bool ties) {
    const int64_t T = 3;
    IndexerDims d{};
    d.T = T;
    d.S = 1;
    d.cap = n;
    d.maxN = n;
    d.K = K;
    d.ratio = 1;
    d.P = pow2_at_least(K);
    const int64_t lens[T] = {n, n / 3, 0};
    HT seq(DT_I32, {T}), kvl(DT_I32, {T}), out(DT_I32, {T, K});
    std::vector<float> scores((size_t)(T * n));
    const float pool[] = {-1.f, -0.f, 0.f, 0.5f, 1.f, 1.f, 2.f, 3.5f};
    for (int64_t t = 0; t < T; ++t) {
        seq.put(t, 0);
        kvl.put(t, lens[t]);
        for (int64_t i = 0; i < n; ++i) scores[t * n + i] = ties ? pool[irand(0, 7)] : (float)uni(-100, 100);
    }
    launch(2, 1, threads, [&] { k_index_topk(scores.data(), seq.v, kvl.v, out.v, d); });
    for (int64_t t = 0; t < T; ++t) {
        std::vector<int64_t> order(lens[t]);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return scores[t * n + a] > scores[t * n + b]; });
        int bad = 0;
        for (int64_t i = 0; i < K; ++i) {
            const int64_t want = i < lens[t] ? order[i] : -1, got = (int64_t)out.get(out.off({t, i}));
            if (got != want && bad++ < 3)
                CHECK(false, "top-k select n=%lld K=%lld threads=%u ties=%d row %lld: out[%lld] = %lld, want %lld",
                      (long long)n, (long long)K, threads, (int)ties, (long long)t, (long long)i, (long long)got,
                      (long long)want);
        }
    }
}

// ------------------------------------------------------------------------------ sparse_attention
struct SparseCase {
    int64_t NH, D, BS, MB;
    int ratio, window, splits;
    bool comp, sinks, hole;
    int64_t K;   // indices columns (0: none)
    int kdt, qdt, odt;
    std::vector<int> kv_lens;
};

static void check_sparse(const SparseCase& c) {
    const int64_t T = (int64_t)c.kv_lens.size(), S = 2, NB = S * c.MB + 1, cap = c.MB * c.BS;
    const int64_t CB = std::max<int64_t>(1, c.BS / c.ratio);
    HT q(c.qdt, {T, c.NH, c.D}, 1), kv(c.kdt, {NB, c.BS, c.D}, 2), cc, idx, sinks, out(c.odt, {T, c.NH, c.D}, 3);
    HT seq(DT_I32, {T}), kvl(DT_I32, {T});
    HT table = block_table(S, c.MB, NB);
    if (c.hole) table.put(table.off({0, 1}), -1);   // a released block: its keys are skipped
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < c.NH; ++h)
            for (int64_t k = 0; k < c.D; ++k) q.put(q.off({t, h, k}), uni(-1, 1));
        seq.put(t, t == T - 1 ? S : t % S);   // the last row's sequence is outside the table: a zero row
        kvl.put(t, c.kv_lens[t]);
    }
    for (int64_t b = 0; b < NB; ++b)
        for (int64_t i = 0; i < c.BS; ++i)
            for (int64_t k = 0; k < c.D; ++k) kv.put(kv.off({b, i, k}), uni(-1, 1));
    if (c.comp) {
        cc = HT(c.kdt, {NB, CB, c.D}, 1);
        for (int64_t b = 0; b < NB; ++b)
            for (int64_t i = 0; i < CB; ++i)
                for (int64_t k = 0; k < c.D; ++k) cc.put(cc.off({b, i, k}), uni(-1, 1));
    }
    std::vector<std::vector<int>> lists(T);
    if (c.K) {
        idx = HT(DT_I32, {T, c.K}, 2);
        for (int64_t t = 0; t < T; ++t) {
            const int vis = std::min<int64_t>(c.kv_lens[t], cap) / c.ratio;
            for (int64_t i = 0; i < c.K; ++i) {
                // valid entries, repeats, -1 and entries not yet visible
                const int r = irand(0, 9);
                const int v = r < 6 ? irand(0, std::max(0, vis - 1)) : r < 8 ? -1 : vis + irand(0, 3);
                idx.put(idx.off({t, i}), v);
            }
        }
    }
    if (c.sinks) {
        sinks = HT(DT_F32, {c.NH});
        for (int64_t h = 0; h < c.NH; ++h) sinks.put(h, uni(-1, 2));
    }
    SparseDims d{};
    d.T = T;
    d.NH = c.NH;
    d.S = S;
    d.MB = c.MB;
    d.NB = NB;
    d.BS = c.BS;
    d.NBc = NB;
    d.CB = CB;
    d.K = c.K;
    d.has_idx = c.K > 0;
    d.D = (int)c.D;
    d.window = c.window;
    d.ratio = c.comp ? c.ratio : 1;
    d.has_comp = c.comp;
    d.splits = c.splits;
    d.scale = (float)(1.0 / std::sqrt((double)c.D));
    std::vector<int> list((size_t)(T * std::max<int64_t>(c.K, 1)), -7), cnt((size_t)T, -7);
    if (c.K) {
        const CleanDims cd{T, c.K, S, cap, d.ratio, pow2_at_least(c.K)};
        const unsigned threads = (unsigned)std::min<int64_t>(1024, std::max<int64_t>(LANES, cd.P));
        launch(2, 1, threads, [&] { k_clean_indices(idx.v, seq.v, kvl.v, list.data(), cnt.data(), cd); });
    }
    std::vector<float> part((size_t)(T * c.NH * c.splits * (c.D + 2)), NAN);
    const int64_t groups = ceil_div(c.NH, (int64_t)SP_HG), nq = ceil_div(c.D, (int64_t)LANES);
    launch(T * groups, c.splits, SP_WARPS * LANES, [&] {
        if (nq <= 4) k_sparse_attn<4>(q.v, kv.v, cc.v, table.v, seq.v, kvl.v, list.data(), cnt.data(), part.data(), d);
        else if (nq <= 8) k_sparse_attn<8>(q.v, kv.v, cc.v, table.v, seq.v, kvl.v, list.data(), cnt.data(), part.data(), d);
        else k_sparse_attn<16>(q.v, kv.v, cc.v, table.v, seq.v, kvl.v, list.data(), cnt.data(), part.data(), d);
    });
    launch(3, 1, 128, [&] { k_sparse_merge(part.data(), seq.v, kvl.v, cnt.data(), sinks.v, out.v, d); });

    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = t == T - 1 ? S : t % S;
        const int64_t L = s < S ? std::min<int64_t>(c.kv_lens[t], cap) : 0;
        std::vector<const HT*> src;
        std::vector<int64_t> offs;
        auto block = [&](int64_t b) { return (int64_t)table.get(table.off({s, b})); };
        const int64_t lo = c.window > 0 ? std::max<int64_t>(0, L - c.window) : 0;
        for (int64_t p = lo; p < L; ++p)
            if (block(p / c.BS) >= 0) {
                src.push_back(&kv);
                offs.push_back(kv.off({block(p / c.BS), p % c.BS, 0}));
            }
        if (c.comp) {
            const int64_t vis = L / c.ratio;
            std::set<int64_t> ents;
            if (c.K) {
                for (int64_t i = 0; i < c.K; ++i) {
                    const int64_t e = (int64_t)idx.get(idx.off({t, i}));
                    if (e >= 0 && e < vis) ents.insert(e);
                }
                CHECK(s >= S || cnt[t] == (int)ents.size(), "cleaned indices row %lld: count %d, want %zu", (long long)t,
                      cnt[t], ents.size());
                int i = 0;
                for (int64_t e : ents) {
                    CHECK(s >= S || (i < cnt[t] && list[t * c.K + i] == e), "cleaned indices row %lld [%d] = %d, want %lld",
                          (long long)t, i, i < cnt[t] ? list[t * c.K + i] : -999, (long long)e);
                    ++i;
                }
            } else {
                for (int64_t e = 0; e < vis; ++e) ents.insert(e);
            }
            for (int64_t e : ents) {
                const int64_t pe = (e + 1) * c.ratio - 1;
                if (block(pe / c.BS) < 0) continue;
                src.push_back(&cc);
                offs.push_back(cc.off({block(pe / c.BS), (pe % c.BS) / c.ratio, 0}));
            }
        }
        for (int64_t h = 0; h < c.NH; ++h) {
            std::vector<double> want(c.D, 0.0);
            if (!src.empty()) {
                std::vector<double> lg(src.size());
                double m = c.sinks ? sinks.get(h) : -INFINITY;
                for (size_t j = 0; j < src.size(); ++j) {
                    double dot = 0;
                    for (int64_t k = 0; k < c.D; ++k) dot += q.get(q.off({t, h, k})) * src[j]->get(offs[j] + k);
                    lg[j] = dot * d.scale;
                    m = std::max(m, lg[j]);
                }
                double den = c.sinks ? std::exp(sinks.get(h) - m) : 0.0;
                for (size_t j = 0; j < src.size(); ++j) {
                    const double e = std::exp(lg[j] - m);
                    den += e;
                    for (int64_t k = 0; k < c.D; ++k) want[k] += e * src[j]->get(offs[j] + k);
                }
                for (int64_t k = 0; k < c.D; ++k) want[k] /= den;
            }
            for (int64_t k = 0; k < c.D; ++k) {
                const double got = out.get(out.off({t, h, k}));
                CHECK(near(got, want[k], c.odt), "sparse_attention NH=%lld D=%lld window=%d comp=%d K=%lld sinks=%d "
                      "hole=%d splits=%d: out[%lld, %lld, %lld] = %.7g, want %.7g (%zu keys)", (long long)c.NH,
                      (long long)c.D, c.window, (int)c.comp, (long long)c.K, (int)c.sinks, (int)c.hole, c.splits,
                      (long long)t, (long long)h, (long long)k, got, want[k], src.size());
            }
        }
    }
}

int main() {
    // hc_pre: a block (N = 4: M = 24, 4 tokens a mix block) with a partial token group and uneven
    // splits, the head (M = N), and N = 5 (M = 35: the one-token variant); f32 and bf16 streams
    check_hc_pre(4, 5, 100, true, DT_F32, DT_F32, 3, 20);
    check_hc_pre(4, 3, 64, true, DT_BF16, DT_BF16, 1, 1);
    check_hc_pre(4, 2, 77, false, DT_BF16, DT_F32, 2, 0);
    check_hc_pre(5, 2, 40, true, DT_F32, DT_BF16, 2, 7);
    check_hc_post(4, 3, 300, DT_BF16, DT_F32, DT_F32);
    check_hc_post(3, 2, 40, DT_F32, DT_BF16, DT_BF16);
    check_layernorm(3, 1000, DT_BF16, true);
    check_layernorm(2, 128, DT_F32, false);
    // kv_compress: CSA's overlap with ratio 4 in blocks of 8, HCA-like ratio above the block size,
    // ratio 1, and bf16 staging
    check_kv_compress(8, 4, 1, 6, DT_F32, DT_F32);
    check_kv_compress(8, 16, 0, 5, DT_F32, DT_F32);
    check_kv_compress(4, 1, 1, 3, DT_BF16, DT_BF16);
    check_kv_compress(16, 4, 0, 7, DT_BF16, DT_F32);
    // indexer_topk: V4-style (ratio 4) with fewer and more visible entries than K, V3.2-style
    // (ratio 1), ratio above the block size, more than 64 heads (two head tiles), bf16 inputs
    check_indexer(5, 16, 8, 4, 6, 10, {0, 1, 4, 7, 30, 48, 100}, DT_F32, DT_F32, 512);
    check_indexer(3, 8, 4, 1, 20, 33, {80, 17, 33, 64}, DT_BF16, DT_BF16, 64);
    check_indexer(70, 12, 8, 16, 8, 5, {64, 15, 16, 47}, DT_F32, DT_BF16, 128);
    check_topk_select(3000, 700, 512, true);
    check_topk_select(2500, 64, 256, false);
    check_topk_select(700, 700, 128, true);
    // sparse_attention: window + indexed entries (repeats, -1, invisible) + sinks over 3 splits with
    // a hole; all visible entries; window only; the MQA head groups (NH = 6: a group of 2); D of 512
    SparseCase a{6, 40, 8, 5, 4, 8, 3, true, true, true, 6, DT_F32, DT_F32, DT_F32, {0, 5, 23, 40, 38, 12}};
    check_sparse(a);
    SparseCase b{5, 64, 8, 4, 4, 0, 2, true, false, false, 0, DT_BF16, DT_BF16, DT_BF16, {32, 9, 31, 20}};
    check_sparse(b);
    SparseCase c{4, 33, 4, 6, 1, 5, 1, false, true, false, 0, DT_F32, DT_BF16, DT_F32, {24, 3, 0, 11}};
    check_sparse(c);
    SparseCase e{3, 512, 16, 3, 16, 20, 4, true, true, false, 3, DT_BF16, DT_F32, DT_BF16, {48, 47, 17, 30}};
    check_sparse(e);
    SparseCase f{8, 96, 8, 8, 2, 16, 2, true, true, true, 40, DT_F32, DT_F32, DT_F32, {64, 50, 2, 9}};
    check_sparse(f);
    // compressed entries wider than a block (ratio 8, blocks of 4: one entry per block, in the block of
    // the window's last token)
    SparseCase g{4, 32, 4, 10, 8, 6, 2, true, false, true, 0, DT_F32, DT_F32, DT_F32, {40, 39, 31, 16, 7}};
    check_sparse(g);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
