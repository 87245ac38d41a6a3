// The fused kernel of ABI 1.6, k_mla_rope_cache_write (backends/cuda/src/mla_rope_cache_write.cu), run on
// the CPU through host_emu.h with the grid and block its host side launches (one block per token, the
// grid capped below T so the grid-stride loop runs too), and compared with a serial float64
// transcription of abi/README.md section 8 (rope, rmsnorm, mla_cache_write composed). Inputs in both
// float dtypes, q inside wider rows (the runtime's x_proj view), slots with -1 and out-of-range ones,
// kv_out absent, separate and aliasing kv; the cache rows no slot names and q's no-rope columns and
// row padding must keep their bytes.
//
// Built and run by tests/test_gpu_emu_fused.py; exit status 0 and "all checks passed" when every check
// passes, else 1 with the mismatches on stderr.
#include <stdio.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "mla_rope_cache_write.cu"

using namespace di;

static int failures = 0;
#define CHECK(cond, ...)                                             \
    do {                                                             \
        if (!(cond)) {                                               \
            if (failures < 40) {                                     \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                        \
                fprintf(stderr, "\n");                               \
            }                                                        \
            ++failures;                                              \
        }                                                            \
    } while (0)

static const double PI_ = 3.14159265358979323846;
static std::mt19937_64 rng(20261207);
static double gauss() { return std::normal_distribution<double>(0.0, 1.0)(rng); }

// A host buffer of `n` elements of dtype dt and a device view of it with the given shape and strides.
struct Buf {
    int dt;
    std::vector<uint32_t> mem;
    DTensor v;
    Buf(int dt_, int64_t n, std::vector<int64_t> shape, std::vector<int64_t> strides) : dt(dt_) {
        mem.assign((size_t)(n * (dt == DT_BF16 ? 2 : 4) / 4 + 2), 0x7fc0ffffu);   // NaN poison
        memset(&v, 0, sizeof v);
        v.base = reinterpret_cast<char*>(mem.data());
        v.dt = dt;
        v.ndim = (int)shape.size();
        for (int d = 0; d < DI_MAX_DIMS; ++d) {
            v.shape[d] = d < v.ndim ? shape[d] : 1;
            v.strides[d] = d < v.ndim ? strides[d] : 0;
        }
    }
    void set(int64_t e, double x) { store_f(dt, v.base, e, (float)x); }
    void seti(int64_t e, int32_t x) { reinterpret_cast<int32_t*>(v.base)[e] = x; }
    double get(int64_t e) const { return load_f(dt, v.base, e); }
    uint32_t bits(int64_t e) const {
        return dt == DT_BF16 ? reinterpret_cast<const uint16_t*>(v.base)[e] : reinterpret_cast<const uint32_t*>(v.base)[e];
    }
};

static const char* dname(int dt) { return dt == DT_BF16 ? "bf16" : "f32"; }

struct Case {
    int64_t T, H, Dn, Dr, Dc, NB, BS;
    int dt, cdt, interleaved, yarn, kv_out;   // kv_out: 0 absent, 1 separate, 2 aliasing kv
    int64_t q_row_pad;
    int64_t grid;                              // blocks launched (< T: the grid-stride loop)
};

// rope frequencies per abi/README.md (rope), D the rotated width
static std::vector<double> inv_freq(int64_t D, bool yarn, double theta, double factor, double omp, double bf,
                                    double bs) {
    std::vector<double> f(D / 2);
    double low = 0, high = 0;
    if (yarn) {
        auto d = [&](double b) { return D * std::log(omp / (2 * PI_ * b)) / (2 * std::log(theta)); };
        low = std::max(std::floor(d(bf)), 0.0);
        high = std::min(std::ceil(d(bs)), (double)(D - 1));
        if (low == high) high += 0.001;
    }
    for (int64_t i = 0; i < D / 2; ++i) {
        f[i] = std::pow(theta, -2.0 * (double)i / (double)D);
        if (yarn) {
            double r = std::min(std::max(((double)i - low) / (high - low), 0.0), 1.0);
            f[i] = f[i] / factor * r + f[i] * (1 - r);
        }
    }
    return f;
}

static void run_case(const Case& c) {
    const int64_t T = c.T, H = c.H, Dr = c.Dr, Dc = c.Dc, W = Dc + Dr, Dq = c.Dn + Dr, half = Dr / 2;
    const int64_t qrow = H * Dq + c.q_row_pad;
    const double theta = 10000.0, factor = 40.0, omp = 4096.0, bfast = 32.0, bslow = 1.0;
    const double attn = c.yarn ? 1.1 : 1.0, eps = 1e-6;
    Buf q(c.dt, T * qrow, {T, H, Dq}, {qrow, Dq, 1});
    Buf kv(c.dt, T * (W + 3), {T, W}, {W + 3, 1});   // padded rows
    Buf w(c.dt, Dc, {Dc}, {1});
    Buf pos(DT_I32, T, {T}, {1}), slots(DT_I32, T, {T}, {1});
    Buf cache(c.cdt, c.NB * c.BS * W, {c.NB, c.BS, W}, {c.BS * W, W, 1});
    Buf sep(c.dt, T * W, {T, W}, {W, 1});
    std::vector<double> q0(T * qrow), kv0(T * W), w0(Dc);
    for (int64_t i = 0; i < T * qrow; ++i) {
        q.set(i, gauss());
        q0[i] = q.get(i);
    }
    for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < W; ++i) {
            kv.set(t * (W + 3) + i, gauss());
            kv0[t * W + i] = kv.get(t * (W + 3) + i);
        }
    for (int64_t i = 0; i < Dc; ++i) {
        w.set(i, 1.0 + 0.2 * gauss());
        w0[i] = w.get(i);
    }
    for (int64_t i = 0; i < c.NB * c.BS * W; ++i) cache.set(i, gauss());
    std::vector<uint32_t> cache0(c.NB * c.BS * W);
    for (int64_t i = 0; i < c.NB * c.BS * W; ++i) cache0[i] = cache.bits(i);
    std::vector<int64_t> perm(c.NB * c.BS);
    for (int64_t i = 0; i < (int64_t)perm.size(); ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t t = 0; t < T; ++t) {
        pos.seti(t, t == 0 ? 0 : (int32_t)(rng() % 3000));
        int64_t s = perm[t];
        if (t == 1) s = -1;
        if (t == 2) s = c.NB * c.BS;   // out of range: skipped
        slots.seti(t, (int32_t)s);
    }

    FusedRopeP p{};
    p.T = T; p.H = H; p.Dq = Dq; p.Dc = Dc; p.Dr = Dr; p.NB = c.NB; p.BS = c.BS;
    p.interleaved = c.interleaved; p.eps = (float)eps;
    p.f.D = Dr; p.f.theta = theta; p.f.attn = attn;
    if (c.yarn) {   // the host side's ramp ends (mla_rope_cache_write.cu), as rope.cu finds them
        auto d = [&](double b) { return (double)Dr * std::log(omp / (2.0 * PI_ * b)) / (2.0 * std::log(theta)); };
        double lo = std::floor(d(bfast)), hi = std::ceil(d(bslow));
        lo = lo < 0 ? 0 : (lo > Dr - 1 ? Dr - 1 : lo);
        hi = hi < 0 ? 0 : (hi > Dr - 1 ? Dr - 1 : hi);
        if (lo == hi) hi += 0.001;
        p.f.yarn = 1; p.f.factor = factor; p.f.low = lo; p.f.high = hi;
    }
    DTensor none;
    memset(&none, 0, sizeof none);
    DTensor out = c.kv_out == 0 ? none : c.kv_out == 1 ? sep.v : kv.v;
    di_emu::grid_dim = {(unsigned)c.grid, 1, 1};
    for (int64_t b = 0; b < c.grid; ++b) {
        di_emu::block_idx = {(unsigned)b, 0, 0};
        di_emu::run_block(FUSED_ROPE_THREADS, [&] { k_mla_rope_cache_write(q.v, kv.v, w.v, pos.v, slots.v, cache.v, out, p); });
    }

    // the serial float64 composition
    const double rt = c.dt == DT_BF16 || c.cdt == DT_BF16 ? 1.6e-2 : 2e-4, at = rt;
    const std::vector<double> inv = inv_freq(Dr, c.yarn, theta, factor, omp, bfast, bslow);
    std::vector<bool> written(c.NB * c.BS, false);
    for (int64_t t = 0; t < T; ++t) {
        double ss = 0;
        for (int64_t i = 0; i < Dc; ++i) ss += kv0[t * W + i] * kv0[t * W + i];
        const double r = 1.0 / std::sqrt(ss / (double)Dc + eps);
        std::vector<double> row(W);
        for (int64_t i = 0; i < Dc; ++i) row[i] = kv0[t * W + i] * r * w0[i];
        std::vector<double> cs(half), sn(half);
        const double pp = (double)reinterpret_cast<const int32_t*>(pos.v.base)[t];
        for (int64_t j = 0; j < half; ++j) {
            cs[j] = std::cos(pp * inv[j]) * attn;
            sn[j] = std::sin(pp * inv[j]) * attn;
        }
        auto rot = [&](const double* x, double* y) {
            for (int64_t j = 0; j < half; ++j) {
                const int64_t i0 = c.interleaved ? 2 * j : j, i1 = c.interleaved ? 2 * j + 1 : j + half;
                y[i0] = x[i0] * cs[j] - x[i1] * sn[j];
                y[i1] = x[i1] * cs[j] + x[i0] * sn[j];
            }
        };
        rot(&kv0[t * W + Dc], &row[Dc]);
        const int64_t s = reinterpret_cast<const int32_t*>(slots.v.base)[t];
        if (s >= 0 && s < c.NB * c.BS) {
            written[s] = true;
            for (int64_t i = 0; i < W; ++i) {
                const double g = cache.get(s * W + i);
                CHECK(std::fabs(g - row[i]) <= rt * std::fabs(row[i]) + at, "%s->%s t=%lld cache[%lld]=%g, want %g",
                      dname(c.dt), dname(c.cdt), (long long)t, (long long)i, g, row[i]);
            }
        }
        if (c.kv_out) {
            const Buf& o = c.kv_out == 1 ? sep : kv;
            const int64_t rs = c.kv_out == 1 ? W : W + 3;
            for (int64_t i = 0; i < W; ++i) {
                const double g = o.get(t * rs + i);
                CHECK(std::fabs(g - row[i]) <= rt * std::fabs(row[i]) + at, "%s t=%lld kv_out[%lld]=%g, want %g",
                      dname(c.dt), (long long)t, (long long)i, g, row[i]);
            }
        } else {
            for (int64_t i = 0; i < W; ++i)
                CHECK(kv.get(t * (W + 3) + i) == kv0[t * W + i], "t=%lld kv[%lld] changed without kv_out", (long long)t,
                      (long long)i);
        }
        for (int64_t h = 0; h < H; ++h) {
            const int64_t b = t * qrow + h * Dq;
            std::vector<double> want(Dr);
            rot(&q0[b + c.Dn], want.data());
            for (int64_t i = 0; i < c.Dn; ++i)
                CHECK(q.get(b + i) == q0[b + i], "t=%lld h=%lld q[%lld] (not a rope dim) changed", (long long)t,
                      (long long)h, (long long)i);
            for (int64_t i = 0; i < Dr; ++i) {
                const double g = q.get(b + c.Dn + i);
                CHECK(std::fabs(g - want[i]) <= rt * std::fabs(want[i]) + at, "%s t=%lld h=%lld q_pe[%lld]=%g, want %g",
                      dname(c.dt), (long long)t, (long long)h, (long long)i, g, want[i]);
            }
        }
        for (int64_t i = H * Dq; i < qrow; ++i)
            CHECK(q.get(t * qrow + i) == q0[t * qrow + i], "t=%lld q's row padding [%lld] changed", (long long)t,
                  (long long)i);
    }
    for (int64_t s = 0; s < c.NB * c.BS; ++s)
        if (!written[s])
            for (int64_t i = 0; i < W; ++i)
                CHECK(cache.bits(s * W + i) == cache0[s * W + i], "cache slot %lld (no token's) changed", (long long)s);
}

int main() {
    const Case cases[] = {
        // T  H  Dn  Dr  Dc  NB BS  dt       cache    int yarn kv_out pad grid
        {1, 2, 4, 4, 8, 2, 4, DT_F32, DT_F32, 1, 0, 0, 0, 1},
        {5, 3, 8, 8, 16, 3, 4, DT_F32, DT_F32, 1, 1, 1, 0, 5},
        {6, 2, 8, 4, 12, 2, 4, DT_BF16, DT_BF16, 0, 1, 2, 24, 4},
        {4, 2, 0, 8, 16, 2, 4, DT_BF16, DT_BF16, 1, 0, 1, 7, 2},
        {5, 2, 8, 8, 16, 3, 4, DT_F32, DT_BF16, 0, 1, 1, 0, 3},
        // V3's head shape: 16 heads x 32 pairs, latent 512 (each thread one latent element)
        {3, 16, 128, 64, 512, 2, 4, DT_BF16, DT_BF16, 1, 1, 2, 576, 2},
        {3, 16, 128, 64, 512, 2, 4, DT_F32, DT_F32, 0, 1, 0, 0, 3},
        // more q pairs (40 x 16) and latent elements (520) than threads: the passes after the first
        {2, 40, 8, 32, 520, 2, 4, DT_F32, DT_F32, 1, 1, 1, 0, 2},
        {3, 40, 8, 32, 520, 2, 4, DT_BF16, DT_BF16, 0, 0, 2, 0, 1},
    };
    for (const Case& c : cases) run_case(c);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
