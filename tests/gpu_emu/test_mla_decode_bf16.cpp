// mla_decode's bf16 fast path (backends/cuda/src/mla_decode_bf16.cuh: qlat, attn, merge_uv) on the CPU
// through host_emu.h, block by block with the grids attention.cu launches, against a float64
// transcription of the op (abi/README.md: absorbed MLA over the paged latent cache). Cases cover a
// partial head group, partial token tiles, tokens with no keys, several active chunks, a hole in a
// block table, a strided q (the runtime's x_proj view) and both output dtypes.
//
// Built and run by tests/test_gpu_emu.py; exit status 0 and "all checks passed" when every check
// passes, else 1 with the mismatches on stderr.
#include <stdio.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "device.cuh"
#include "mla_decode_bf16.cuh"

using namespace di;

static int failures = 0;
static std::mt19937_64 rng(20261207);
static float uni(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

static float bf(float x) { return bf16_to_f(f_to_bf16(x)); }

static DTensor view(void* base, int dt, std::vector<int64_t> shape, std::vector<int64_t> strides) {
    DTensor t;
    memset(&t, 0, sizeof t);
    t.base = static_cast<char*>(base);
    t.dt = dt;
    t.ndim = (int)shape.size();
    for (int d = 0; d < DI_MAX_DIMS; ++d) {
        t.shape[d] = d < t.ndim ? shape[d] : 1;
        t.strides[d] = d < t.ndim ? strides[d] : 0;
    }
    return t;
}

template <class F>
static void launch(unsigned gx, unsigned gy, unsigned gz, F&& body) {
    di_emu::grid_dim = {gx, gy, gz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                di_emu::block_idx = {x, y, z};
                di_emu::run_block(256, body);
            }
}

template <int TT>
static void run_case(int64_t T, int64_t H, int splits, bool out_bf16, const char* name) {
    const int Dn = 128, Dr = 64, Dc = 512, Dv = 128, Dk = Dc + Dr, BS = 16, MB = 8, S = 3, NB = 30;
    const int64_t qrow = H * (Dn + Dr) + 40;   // q rows longer than H * Dq, as x_proj's view
    std::vector<uint16_t> q(T * qrow), w(H * (Dn + Dv) * Dc), cache((int64_t)NB * BS * Dk);
    for (auto& v : q) v = f_to_bf16(uni(-1, 1));
    for (auto& v : w) v = f_to_bf16(uni(-0.1f, 0.1f));
    for (auto& v : cache) v = f_to_bf16(uni(-1, 1));
    // block tables: distinct blocks, one hole in sequence 1
    std::vector<int32_t> btab(S * MB);
    for (int i = 0; i < S * MB; ++i) btab[i] = (i * 7 + 3) % NB;
    btab[1 * MB + 2] = -1;
    std::vector<int32_t> seq(T), kvl(T);
    const int lens[] = {100, 0, 17, 40, 1, 128, 33, 64, 5, 90};
    for (int64_t t = 0; t < T; ++t) {
        seq[t] = (int32_t)(t % S);
        kvl[t] = lens[t % 10];
    }
    DecodeDims d{};
    d.T = T; d.H = H; d.S = S; d.MB = MB; d.NB = NB; d.BS = BS;
    d.Dn = Dn; d.Dr = Dr; d.Dv = Dv; d.Dc = Dc; d.splits = splits;
    DTensor qv = view(q.data(), DT_BF16, {T, H, Dn + Dr}, {qrow, Dn + Dr, 1});
    DTensor wv = view(w.data(), DT_BF16, {H * (Dn + Dv), Dc}, {Dc, 1});
    DTensor cv = view(cache.data(), DT_BF16, {NB, BS, Dk}, {BS * Dk, Dk, 1});
    DTensor bv = view(btab.data(), DT_I32, {S, MB}, {MB, 1});
    DTensor sv = view(seq.data(), DT_I32, {T}, {1});
    DTensor lv = view(kvl.data(), DT_I32, {T}, {1});
    std::vector<float> outf(T * H * Dv, NAN);
    std::vector<uint16_t> outb(T * H * Dv, 0x7fc0);
    DTensor ov = out_bf16 ? view(outb.data(), DT_BF16, {T, H, Dv}, {H * Dv, Dv, 1})
                          : view(outf.data(), DT_F32, {T, H, Dv}, {H * Dv, Dv, 1});
    if (!mla_decode_bf16_ok(qv, wv, cv, d)) {
        fprintf(stderr, "FAIL %s: the fast path refuses the case\n", name);
        ++failures;
        return;
    }
    std::vector<float> qf(T * H * Dk, NAN), part(T * H * splits * (Dc + 2), NAN);
    const unsigned tiles = (unsigned)ceil_div(T, TT);
    launch((unsigned)H, Dc / MLAF_COLS, tiles, [&] { k_mla_qlat_bf16<TT>(qv, wv, qf.data(), d); });
    launch((unsigned)(T * ceil_div(H, MLA_HG)), (unsigned)splits, 1,
           [&] { k_mla_attn_bf16(qf.data(), cv, bv, sv, lv, part.data(), d, 0.0721f); });
    launch((unsigned)H, (unsigned)ceil_div(Dv, MLAF_UV_ROWS), tiles,
           [&] { k_mla_merge_uv_bf16<TT>(part.data(), sv, lv, wv, ov, d); });
    // float64 reference
    int bad = 0;
    double worst = 0;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            std::vector<double> ql(Dc, 0.0), ol(Dc, 0.0);
            const uint16_t* qr = &q[t * qrow + h * (Dn + Dr)];
            for (int k = 0; k < Dn; ++k)
                for (int c = 0; c < Dc; ++c) ql[c] += (double)bf16_to_f(qr[k]) * bf16_to_f(w[(h * (Dn + Dv) + k) * Dc + c]);
            std::vector<double> sc;
            std::vector<const uint16_t*> rows;
            for (int p = 0; p < kvl[t]; ++p) {
                const int blk = btab[seq[t] * MB + p / BS];
                if (blk < 0) continue;
                const uint16_t* row = &cache[((int64_t)blk * BS + p % BS) * Dk];
                double s = 0;
                for (int c = 0; c < Dc; ++c) s += ql[c] * bf16_to_f(row[c]);
                for (int r = 0; r < Dr; ++r) s += (double)bf16_to_f(qr[Dn + r]) * bf16_to_f(row[Dc + r]);
                sc.push_back(s * 0.0721f);
                rows.push_back(row);
            }
            double mx = -INFINITY, sum = 0;
            for (double s : sc) mx = std::max(mx, s);
            for (double& s : sc) sum += (s = std::exp(s - mx));
            for (size_t i = 0; i < sc.size(); ++i)
                for (int c = 0; c < Dc; ++c) ol[c] += sc[i] / sum * bf16_to_f(rows[i][c]);
            for (int j = 0; j < Dv; ++j) {
                double want = 0;
                for (int c = 0; c < Dc; ++c) want += (double)bf16_to_f(w[(h * (Dn + Dv) + Dn + j) * Dc + c]) * ol[c];
                const int64_t o = (t * H + h) * Dv + j;
                const double got = out_bf16 ? bf16_to_f(outb[o]) : outf[o];
                const double tol = out_bf16 ? 2e-3 + 1e-2 * std::fabs(want) : 2e-5 + 1e-3 * std::fabs(want);
                const double err = std::fabs(got - want);
                worst = std::max(worst, err);
                if (!(err <= tol)) {
                    if (bad < 5) fprintf(stderr, "FAIL %s: out[%lld, %lld, %d] = %g, want %g\n", name, (long long)t,
                                         (long long)h, j, got, want);
                    ++bad;
                }
            }
        }
    failures += bad;
    printf("%s: T=%lld H=%lld splits=%d %s: worst error %.3g, %d bad\n", name, (long long)T, (long long)H, splits,
           out_bf16 ? "bf16" : "f32", worst, bad);
}

int main() {
    (void)bf;
    run_case<1>(1, 16, 8, true, "batch 1, V2-Lite heads");
    run_case<4>(3, 6, 5, false, "3 tokens, a partial head group");
    run_case<8>(10, 4, 2, false, "10 tokens, two token tiles");
    run_case<2>(2, 5, 1, true, "one chunk");
    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
