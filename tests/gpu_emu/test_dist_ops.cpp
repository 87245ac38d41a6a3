// The GPU backend's expert-parallel kernels (backends/cuda/src/dist_kernels.cuh: moe_dispatch's
// per-rank scan and row copy, moe_combine) run on the CPU through host_emu.h, block by block with the
// geometry dist.cu launches (and a smaller one, so the grid-stride loops and the scan's carry
// across chunks run too).
//
//   test_dist_ops                 self-check: random cases on strided (padded) views, both float
//                                 dtypes, every row-copy width, against a serial transcription of
//                                 backends/reference/dist.py; prints "all checks passed"
//   test_dist_ops IN OUT          one case from tests/test_gpu_emu_dist.py (which compares OUT with
//                                 the reference backend itself): IN and OUT are raw little-endian
//                                 arrays in the order that file writes and reads them
//
// Exit status 0 when every check passes, else 1 with the mismatches on stderr.
#include <stdio.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "device.cuh"
#include "dist_kernels.cuh"

using namespace di;

static int failures = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            if (failures < 40) {                                      \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);  \
                fprintf(stderr, __VA_ARGS__);                         \
                fprintf(stderr, "\n");                                \
            }                                                         \
            ++failures;                                               \
        }                                                             \
    } while (0)

static std::mt19937_64 rng(20261206);
static int irand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
static double uni(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }

// ------------------------------------------------------------------------------ host tensors
// Row-major storage, the last dimension padded by `pad` elements (strided views), poisoned first.
struct HT {
    int dt = DT_F32;
    std::vector<int64_t> shape, strides;
    std::vector<uint32_t> mem;
    DTensor v;
    HT(int dt_, std::vector<int64_t> shp, int64_t pad = 0) : dt(dt_), shape(std::move(shp)) {
        const int nd = (int)shape.size();
        strides.assign(nd, 1);
        int64_t s = 1;
        for (int d = nd - 1; d >= 0; --d) {
            strides[d] = s;
            s *= shape[d] + (d == nd - 1 ? pad : 0);
        }
        mem.assign((size_t)(s * (dt == DT_BF16 ? 2 : 4) / 4 + 8), dt == DT_I32 ? 0x7f7f7f7fu : 0x7fc07fc0u);
        memset(&v, 0, sizeof v);
        v.base = reinterpret_cast<char*>(mem.data());
        v.dt = dt;
        v.ndim = nd;
        for (int d = 0; d < DI_MAX_DIMS; ++d) {
            v.shape[d] = d < nd ? shape[d] : 1;
            v.strides[d] = d < nd ? strides[d] : 0;
        }
    }
    HT(const HT&) = delete;
    HT& operator=(const HT&) = delete;
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
    uint32_t bits(int64_t o) const {  // the stored element, for exact comparisons of copies
        if (dt == DT_BF16) return reinterpret_cast<const uint16_t*>(mem.data())[o];
        return mem[(size_t)o];
    }
};

static const char* dname(int dt) { return dt == DT_BF16 ? "bf16" : "f32"; }

// Runs body once per block of a gx-block grid, each as one emulated block of `threads` threads.
template <class F>
static void launch(int64_t gx, unsigned threads, F&& body) {
    di_emu::grid_dim = {(unsigned)gx, 1, 1};
    for (int64_t x = 0; x < gx; ++x) {
        di_emu::block_idx = {(unsigned)x, 0, 0};
        di_emu::run_block(threads, body);
    }
}

// The row-copy width dist.cu picks: the widest unit every row start and the row length divide.
static int copy_width(const HT& x, const HT& sx) {
    const int64_t eb = x.dt == DT_BF16 ? 2 : 4, row = x.shape[1] * eb;
    int V = 16;
    const uintptr_t ax = reinterpret_cast<uintptr_t>(x.v.base), as = reinterpret_cast<uintptr_t>(sx.v.base);
    while (V > 1 && (row % V || ax % V || as % V || (x.strides[0] * eb) % V || (sx.strides[0] * eb) % V ||
                     (sx.strides[1] * eb) % V))
        V /= 2;
    return V;
}

// moe_dispatch as dist.cu launches it: the route kernel over `route_blocks` blocks of
// `route_threads`, then the row copy in width V (0: the width dist.cu would pick).
static void run_dispatch(HT& x, HT& ids, HT& wts, HT& sx, HT& sids, HT& swts, HT& counts, HT& route, int Er,
                         int64_t route_blocks, unsigned route_threads, int V) {
    const int64_t T = x.shape[0], H = x.shape[1];
    DispatchP P{T, sx.shape[1], (int32_t)sx.shape[0], (int32_t)ids.shape[1], Er, 0};
    launch(route_blocks, route_threads,
           [&] { k_moe_dispatch_route(ids.v, wts.v, sids.v, swts.v, counts.v, route.v, P); });
    if (T == 0 || H == 0) return;
    const int64_t row_bytes = H * (x.dt == DT_BF16 ? 2 : 4);
    if (V == 0) V = copy_width(x, sx);
    const int64_t blocks = T < 3 ? T : 3;
    switch (V) {
        case 16: launch(blocks, 64, [&] { k_moe_dispatch_rows<16>(x.v, route.v, sx.v, row_bytes, P); }); break;
        case 8: launch(blocks, 64, [&] { k_moe_dispatch_rows<8>(x.v, route.v, sx.v, row_bytes, P); }); break;
        case 4: launch(blocks, 64, [&] { k_moe_dispatch_rows<4>(x.v, route.v, sx.v, row_bytes, P); }); break;
        case 2: launch(blocks, 64, [&] { k_moe_dispatch_rows<2>(x.v, route.v, sx.v, row_bytes, P); }); break;
        default: launch(blocks, 64, [&] { k_moe_dispatch_rows<1>(x.v, route.v, sx.v, row_bytes, P); }); break;
    }
}

static void run_combine(HT& back, HT& route, HT& out, int accumulate, int64_t blocks, unsigned threads) {
    const int64_t T = out.shape[0], H = out.shape[1];
    if (T == 0 || H == 0) return;
    launch(blocks, threads, [&] { k_moe_combine(back.v, route.v, out.v, T, H, (int)back.shape[0], accumulate); });
}

// ------------------------------------------------------------------------------ self-check
// backends/reference/dist.py's moe_dispatch, serially, against the kernels' outputs.
static void check_dispatch(int64_t T, int64_t H, int K, int N, int Er, int64_t C, int xdt, int64_t pad,
                           int64_t route_blocks, unsigned route_threads, int V) {
    HT x(xdt, {T, H}, pad), ids(DT_I32, {T, (int64_t)K}, pad ? 1 : 0), wts(DT_F32, {T, (int64_t)K}, pad ? 2 : 0);
    HT sx(xdt, {(int64_t)N, C, H}, pad), sids(DT_I32, {(int64_t)N, C, (int64_t)K}, pad ? 3 : 0);
    HT swts(DT_F32, {(int64_t)N, C, (int64_t)K}, pad ? 1 : 0), counts(DT_I32, {(int64_t)N});
    HT route(DT_I32, {T, (int64_t)N}, pad ? 2 : 0);
    const int E = N * Er;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) x.put(x.off({t, h}), uni(-4, 4));
        for (int k = 0; k < K; ++k) {
            // mostly real experts, some outside [0, E) (no rank's), and some rows with none of a rank's
            const int r = irand(0, 9);
            const int e = r == 0 ? -1 - irand(0, 3) : r == 1 ? E + irand(0, 5) : irand(0, E - 1);
            ids.put(ids.off({t, k}), e);
            wts.put(wts.off({t, k}), uni(0, 1));
        }
    }
    run_dispatch(x, ids, wts, sx, sids, swts, counts, route, Er, route_blocks, route_threads, V);
    char what[160];
    snprintf(what, sizeof what, "dispatch T=%lld H=%lld K=%d N=%d Er=%d C=%lld %s pad=%lld V=%d", (long long)T,
             (long long)H, K, N, Er, (long long)C, dname(xdt), (long long)pad, V);
    std::vector<int64_t> cnt(N, 0);
    for (int64_t t = 0; t < T; ++t)
        for (int p = 0; p < N; ++p) {
            bool mine = false;
            for (int k = 0; k < K; ++k) {
                const int64_t e = (int64_t)ids.get(ids.off({t, k}));
                mine |= e >= 0 && e < E && e / Er == p;
            }
            const int64_t want = mine ? cnt[p] : -1;
            CHECK(route.get(route.off({t, p})) == want, "%s: route[%lld, %d]=%g, want %lld", what, (long long)t, p,
                  route.get(route.off({t, p})), (long long)want);
            if (!mine) continue;
            const int64_t j = cnt[p]++;
            for (int64_t h = 0; h < H; ++h)
                CHECK(sx.bits(sx.off({p, j, h})) == x.bits(x.off({t, h})), "%s: send_x[%d, %lld, %lld] != x[%lld, %lld]",
                      what, p, (long long)j, (long long)h, (long long)t, (long long)h);
            for (int k = 0; k < K; ++k) {
                const int64_t e = (int64_t)ids.get(ids.off({t, k}));
                const bool here = e >= 0 && e < E && e / Er == p;
                const double wid = here ? (double)(e - (int64_t)p * Er) : -1.0;
                const double ww = here ? wts.get(wts.off({t, k})) : 0.0;
                CHECK(sids.get(sids.off({p, j, k})) == wid, "%s: send_ids[%d, %lld, %d]=%g, want %g", what, p,
                      (long long)j, k, sids.get(sids.off({p, j, k})), wid);
                CHECK(swts.get(swts.off({p, j, k})) == ww, "%s: send_weights[%d, %lld, %d]=%g, want %g", what, p,
                      (long long)j, k, swts.get(swts.off({p, j, k})), ww);
            }
        }
    for (int p = 0; p < N; ++p) {
        CHECK(counts.get(p) == cnt[p], "%s: send_counts[%d]=%g, want %lld", what, p, counts.get(p), (long long)cnt[p]);
        for (int64_t j = cnt[p]; j < C; ++j)
            for (int k = 0; k < K; ++k) {
                CHECK(sids.get(sids.off({p, j, k})) == -1, "%s: send_ids[%d, %lld, %d] past the count is %g", what, p,
                      (long long)j, k, sids.get(sids.off({p, j, k})));
                CHECK(swts.get(swts.off({p, j, k})) == 0, "%s: send_weights[%d, %lld, %d] past the count is %g", what,
                      p, (long long)j, k, swts.get(swts.off({p, j, k})));
            }
    }
}

// moe_combine against a float64 sum in rank order, rounded once.
static void check_combine(int64_t T, int64_t H, int N, int64_t C, int bdt, int odt, int accumulate, int64_t pad,
                          int64_t blocks, unsigned threads) {
    HT back(bdt, {(int64_t)N, C, H}, pad), route(DT_I32, {T, (int64_t)N}, pad ? 1 : 0), out(odt, {T, H}, pad);
    for (int p = 0; p < N; ++p)
        for (int64_t j = 0; j < C; ++j)
            for (int64_t h = 0; h < H; ++h) back.put(back.off({p, j, h}), uni(-2, 2));
    for (int64_t t = 0; t < T; ++t) {
        for (int p = 0; p < N; ++p) route.put(route.off({t, p}), irand(0, 3) == 0 ? -1 : irand(0, (int)C - 1));
        for (int64_t h = 0; h < H; ++h) out.put(out.off({t, h}), uni(-1, 1));
    }
    std::vector<double> before((size_t)(T * H));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) before[(size_t)(t * H + h)] = out.get(out.off({t, h}));
    run_combine(back, route, out, accumulate, blocks, threads);
    char what[160];
    snprintf(what, sizeof what, "combine T=%lld H=%lld N=%d C=%lld %s->%s acc=%d pad=%lld", (long long)T, (long long)H,
             N, (long long)C, dname(bdt), dname(odt), accumulate, (long long)pad);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            double want = accumulate ? before[(size_t)(t * H + h)] : 0.0;
            for (int p = 0; p < N; ++p) {
                const int64_t j = (int64_t)route.get(route.off({t, p}));
                if (j >= 0) want += back.get(back.off({p, j, h}));
            }
            const double got = out.get(out.off({t, h}));
            const double tol = odt == DT_BF16 ? 1e-2 * std::fabs(want) + 1e-2 : 1e-5 * std::fabs(want) + 1e-5;
            CHECK(std::fabs(got - want) <= tol, "%s: out[%lld, %lld]=%.8g, want %.8g", what, (long long)t, (long long)h,
                  got, want);
        }
}

static int self_check() {
    // dispatch: decode-sized and prefill-sized token counts, one and many ranks, chunks of the scan
    // (route_threads below T), fewer blocks than ranks (grid-stride), padded views, every copy width
    const int dts[2] = {DT_F32, DT_BF16};
    for (int dt : dts) {
        check_dispatch(1, 16, 2, 1, 4, 1, dt, 0, 1, 32, 0);
        check_dispatch(5, 24, 4, 4, 2, 7, dt, 0, 4, 32, 0);
        check_dispatch(70, 40, 6, 3, 5, 80, dt, 1, 2, 32, 0);      // 3 chunks, 2 blocks for 3 ranks
        check_dispatch(130, 8, 8, 8, 4, 130, dt, 0, 8, 64, 0);
        check_dispatch(33, 64, 3, 2, 8, 40, dt, 0, 2, 256, 16);
        check_dispatch(33, 12, 3, 2, 8, 40, dt, 2, 2, 32, 2);
        check_dispatch(17, 20, 2, 5, 3, 17, dt, 0, 5, 32, 1);
        check_dispatch(0, 16, 2, 3, 2, 4, dt, 0, 3, 32, 0);        // no tokens: counts 0, every row -1
        check_dispatch(9, 0, 2, 3, 2, 9, dt, 0, 3, 32, 0);         // empty rows
    }
    for (int bdt : dts)
        for (int odt : dts)
            for (int acc = 0; acc < 2; ++acc) {
                check_combine(1, 40, 1, 2, bdt, odt, acc, 0, 1, 32);
                check_combine(9, 70, 4, 5, bdt, odt, acc, 1, 2, 32);   // H past the block, grid-stride over T
                check_combine(20, 16, 8, 20, bdt, odt, acc, 0, 20, 64);
            }
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}

// ------------------------------------------------------------------------------ one case from a file
// IN: int64 op (0 dispatch, 1 combine), then
//   dispatch: int64 T, H, K, N, C, experts_per_rank, xdt; x [T, H] (xdt), topk_ids [T, K] int32,
//             topk_weights [T, K] f32.  OUT: send_x [N, C, H], send_ids, send_weights, send_counts,
//             route, contiguous, in that order (send_x rows past the counts are the poison).
//   combine: int64 N, C, H, T, bdt, odt, accumulate; back [N, C, H] (bdt), route [T, N] int32,
//            out [T, H] (odt, the initial values).  OUT: out.
// dtypes are DI_DTypeId: 1 f32, 3 bf16, 12 int32.
static bool read_all(FILE* f, void* dst, size_t n) { return fread(dst, 1, n, f) == n; }

static size_t nbytes(const HT& t) {
    size_t n = t.dt == DT_BF16 ? 2 : 4;
    for (int64_t s : t.shape) n *= (size_t)s;
    return n;
}

static int run_file(const char* in_path, const char* out_path) {
    FILE* f = fopen(in_path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", in_path);
        return 1;
    }
    int64_t hdr[8];
    if (!read_all(f, hdr, 8 * sizeof(int64_t))) {
        fprintf(stderr, "short header\n");
        return 1;
    }
    FILE* o = fopen(out_path, "wb");
    if (!o) {
        fprintf(stderr, "cannot write %s\n", out_path);
        return 1;
    }
    bool ok = true;
    if (hdr[0] == 0) {
        const int64_t T = hdr[1], H = hdr[2], K = hdr[3], N = hdr[4], C = hdr[5], Er = hdr[6];
        const int xdt = (int)hdr[7];
        HT x(xdt, {T, H}), ids(DT_I32, {T, K}), wts(DT_F32, {T, K});
        HT sx(xdt, {N, C, H}), sids(DT_I32, {N, C, K}), swts(DT_F32, {N, C, K}), counts(DT_I32, {N}), route(DT_I32, {T, N});
        ok = read_all(f, x.mem.data(), nbytes(x)) && read_all(f, ids.mem.data(), nbytes(ids)) &&
             read_all(f, wts.mem.data(), nbytes(wts));
        // the launch geometry of dist.cu
        run_dispatch(x, ids, wts, sx, sids, swts, counts, route, (int)Er, N, T > 256 ? 1024 : 256, 0);
        for (HT* t : {&sx, &sids, &swts, &counts, &route}) ok = ok && fwrite(t->mem.data(), 1, nbytes(*t), o) == nbytes(*t);
    } else {
        const int64_t N = hdr[1], C = hdr[2], H = hdr[3], T = hdr[4];
        const int bdt = (int)hdr[5], odt = (int)hdr[6], acc = hdr[7] ? 1 : 0;
        HT back(bdt, {N, C, H}), route(DT_I32, {T, N}), out(odt, {T, H});
        ok = read_all(f, back.mem.data(), nbytes(back)) && read_all(f, route.mem.data(), nbytes(route)) &&
             read_all(f, out.mem.data(), nbytes(out));
        run_combine(back, route, out, acc, T < 4 ? T : 4, 256);
        ok = ok && fwrite(out.mem.data(), 1, nbytes(out), o) == nbytes(out);
    }
    fclose(f);
    fclose(o);
    if (!ok) fprintf(stderr, "short read or write\n");
    return ok ? 0 : 1;
}

int main(int argc, char** argv) {
    if (argc == 3) return run_file(argv[1], argv[2]);
    return self_check();
}
