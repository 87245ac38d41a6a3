// The GPU backend's block-level algorithms, run on the CPU through host_emu.h: the lane helpers of
// device.cuh (warp and block reductions, warp and block prefix sums) and sample's portable sort
// (sort_rows.cuh), which the HIP build uses in place of CUB. Each is compared with a plain serial
// computation on fresh random inputs, with outputs poisoned first. Built and run by
// tests/test_gpu_emu.py; exit status 0 when every check passes, else 1 with the first mismatch.
#include <stdio.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "device.cuh"
#include "sort_rows.cuh"

using namespace di;

static int failures = 0;
#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                  \
            fprintf(stderr, "\n");                         \
            ++failures;                                    \
        }                                                  \
    } while (0)

static std::mt19937_64 rng(12345);

// ------------------------------------------------------------------------------ prefix sums, reductions
static void check_block_scans(unsigned threads) {
    std::vector<int> xi(threads), inc_i(threads, -7);
    std::vector<double> xd(threads), inc_d(threads, NAN);
    std::vector<float> xf(threads), wsum(threads, NAN), bsum(threads, NAN), bmax(threads, NAN);
    std::vector<int> tot_i(threads, -7), inc_i2(threads, -7), tot_i2(threads, -7);
    std::vector<double> tot_d(threads, NAN);
    std::uniform_int_distribution<int> di_(-1000, 1000);
    std::uniform_real_distribution<double> dd(0.0, 1.0);
    for (unsigned t = 0; t < threads; ++t) {
        xi[t] = di_(rng);
        xd[t] = dd(rng);
        xf[t] = (float)(dd(rng) * 2 - 1);
    }
    di_emu::run_block(threads, [&] {
        __shared__ int red_i[MAX_WARPS];
        __shared__ double red_d[MAX_WARPS];
        __shared__ float red_f[MAX_WARPS];
        const unsigned t = threadIdx.x;
        int ti;
        double td;
        inc_i[t] = block_scan_incl(xi[t], &ti, red_i);
        tot_i[t] = ti;
        // a second scan straight after, on the same scratch (moe_experts' routing plan does this)
        int ti2;
        inc_i2[t] = block_scan_incl(2 * xi[t] + 1, &ti2, red_i);
        tot_i2[t] = ti2;
        inc_d[t] = block_scan_incl(xd[t], &td, red_d);
        tot_d[t] = td;
        wsum[t] = warp_sum(xf[t]);
        bsum[t] = block_sum(xf[t], red_f);
        bmax[t] = block_max(xf[t], red_f);
    });
    int si = 0;
    double sd = 0;
    for (unsigned t = 0; t < threads; ++t) {
        si += xi[t];
        sd += xd[t];
        CHECK(inc_i[t] == si, "block_scan_incl<int>, %u threads: thread %u got %d, want %d", threads, t, inc_i[t], si);
        CHECK(inc_i2[t] == 2 * si + (int)t + 1, "second block_scan_incl<int> on the same scratch, %u threads: thread %u got %d, want %d",
              threads, t, inc_i2[t], 2 * si + (int)t + 1);
        CHECK(std::fabs(inc_d[t] - sd) <= 1e-12 * std::max(1.0, sd), "block_scan_incl<double>, %u threads: thread %u got %.17g, want %.17g",
              threads, t, inc_d[t], sd);
    }
    const float fsum = std::accumulate(xf.begin(), xf.end(), 0.f);
    const float fmax = *std::max_element(xf.begin(), xf.end());
    for (unsigned t = 0; t < threads; ++t) {
        CHECK(tot_i[t] == si && std::fabs(tot_d[t] - sd) <= 1e-12 * std::max(1.0, sd), "block totals, thread %u", t);
        CHECK(tot_i2[t] == 2 * si + (int)threads, "second scan's total, thread %u", t);
        CHECK(std::fabs(bsum[t] - fsum) <= 1e-4f, "block_sum, %u threads: thread %u got %g, want %g", threads, t, bsum[t], fsum);
        CHECK(bmax[t] == fmax, "block_max, %u threads: thread %u got %g, want %g", threads, t, bmax[t], fmax);
        const unsigned w0 = t / LANES * LANES;
        float ws = 0.f;
        for (unsigned k = w0; k < w0 + LANES; ++k) ws += xf[k];
        CHECK(std::fabs(wsum[t] - ws) <= 1e-5f, "warp_sum, thread %u got %g, want %g (its own warp of %d lanes only)", t,
              wsum[t], ws, LANES);
    }
}

// ------------------------------------------------------------------------------ the portable sort
// The order it must give: probability descending, ties (and -0.0 against +0.0) in index order.
static void reference_order(const std::vector<float>& k, std::vector<int>& order) {
    order.resize(k.size());
    std::iota(order.begin(), order.end(), 0);
    // float comparison: -0.0 == +0.0 (no NaN is drawn)
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return k[a] > k[b]; });
}

static std::vector<float> draw_row(int64_t V, int kind) {
    std::vector<float> k(V);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (int64_t i = 0; i < V; ++i) {
        float p = u(rng);
        switch (kind) {
            case 0: break;                                             // all distinct, almost surely
            case 1: p = std::floor(p * 8) / 8; break;                  // many ties
            case 2: p = (i % 3 == 0) ? 0.f : (i % 3 == 1 ? -0.f : p); break;  // zeros of both signs
            case 3: p = p < 0.5f ? 1e-40f * p : std::exp(-40.f * p); break;   // subnormals, tiny values
            default: p = 0.25f; break;                                 // one value everywhere
        }
        k[i] = p;
    }
    return k;
}

static void check_sort(int64_t V, unsigned threads, int kind) {
    std::vector<float> k0 = draw_row(V, kind), k1(V, NAN);
    std::vector<int> v0(V), v1(V, -1);
    std::iota(v0.begin(), v0.end(), 0);
    const std::vector<float> keys = k0;
    std::vector<int> want;
    reference_order(keys, want);
    di_emu::run_block(threads, [&] { sort_row_desc(k0.data(), v0.data(), k1.data(), v1.data(), V); });
    for (int64_t i = 0; i < V; ++i) {
        const bool ok = v0[i] == want[i] && __float_as_uint(k0[i]) == __float_as_uint(keys[want[i]]);
        CHECK(ok, "sort_row_desc V=%lld threads=%u kind=%d: position %lld holds index %d (%a), want %d (%a)",
              (long long)V, threads, kind, (long long)i, v0[i], k0[i], want[i], keys[want[i]]);
        if (!ok) return;
    }
}

int main() {
    for (unsigned threads : {32u, 96u, 256u, 1024u}) check_block_scans(threads);
    // the sweep on small blocks (an emulated barrier over 1024 threads is slow), then the block size
    // sample launches, SORT_THREADS, on rows shorter than, equal to and longer than a tile
    for (int64_t V : {1, 2, 31, 32, 33, 63, 64, 65, 300})
        for (int kind = 0; kind < 5; ++kind) check_sort(V, 64, kind);
    check_sort(2113, SORT_THREADS, 1);
    check_sort(1024, SORT_THREADS, 2);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("lanes and sort: all checks passed\n");
    return 0;
}
