"""kv_compress, indexer_topk and sparse_attention (ABI 1.3) on the CPU library against the reference:
also the indexer's tie rule and selection against the scores, the rows kv_compress leaves zero,
entries listed twice or out of range, and the argument checks.
"""
from __future__ import annotations

import deepinfer
import numpy as np
import pytest

from cpu_op_harness import _paged, In, both, close, expect_error, run
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== kv_compress


@pytest.mark.parametrize("dt,odt", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("overlap,ratio,BS,W", [(0, 4, 8, 24), (1, 4, 8, 32), (0, 16, 4, 8), (1, 2, 2, 12),
                                                  (0, 1, 4, 6)])
def test_kv_compress(be, ref, dt, odt, overlap, ratio, BS, W):
    rng = np.random.default_rng(ratio * 100 + BS * 10 + W + overlap)
    S, MB = 2, 12
    NB = S * MB + 3
    D = W // 2 if overlap else W
    L = [MB * BS, MB * BS - 3]
    # every position of sequence 0, then the last few of sequence 1 (a decode-like tail)
    tok = [(0, p) for p in range(L[0])] + [(1, p) for p in range(L[1] - 2 * ratio - 1, L[1])]
    tok = [tok[i] for i in rng.permutation(len(tok))]
    ins = {"staged": In(rng.standard_normal((NB, BS, 2 * W)), dt),
           "position_bias": In(rng.standard_normal((ratio, W)) * 0.5),
           "block_table": In(_paged(rng, S, MB, NB), "int32"),
           "token_seq": In([s for s, _ in tok], "int32"), "positions": In([p for _, p in tok], "int32")}
    T = len(tok)
    got, want = both(be, ref, "kv_compress", ins, {"out": ((T, D), odt)}, ratio=ratio, overlap=overlap)
    close(got["out"], want["out"], odt, "kv_compress")
    closing = np.array([(p + 1) % ratio == 0 for _, p in tok])
    assert (got["out"][~closing] == 0).all() and not np.signbit(got["out"][~closing]).any()


def test_kv_compress_checks(be):
    rng = np.random.default_rng(1)
    base = {"staged": In(rng.standard_normal((4, 4, 8))), "position_bias": In(rng.standard_normal((4, 4))),
            "block_table": In([[0, 1]], "int32"), "token_seq": In([0], "int32")}
    outs = {"out": ((1, 4), "f32")}
    expect_error(be, "kv_compress", {**base, "positions": In([8], "int32")}, outs, match="positions",
                 ratio=4, overlap=0)
    expect_error(be, "kv_compress", {**base, "positions": In([-1], "int32")}, outs, match="positions",
                 ratio=4, overlap=0)
    bad = {**base, "block_table": In([[0, 9]], "int32"), "positions": In([7], "int32")}
    expect_error(be, "kv_compress", bad, outs, match="block_table", ratio=4, overlap=0)
    bias3 = {**base, "position_bias": In(rng.standard_normal((3, 4))), "positions": In([2], "int32")}
    expect_error(be, "kv_compress", bias3, outs, match="power of two", ratio=3, overlap=0)


# ====================================================================== indexer_topk


def _indexer_scores(ins, t, n, ratio, BS, scale, magnitude=False):
    """Row t's scores in f64; magnitude: the sum of the magnitudes of their terms instead (what f32
    accumulation errors scale with)."""
    q, w, keys = ins["q"].rounded(), ins["weights"].rounded(), ins["keys"].rounded()
    table, seq = ins["block_table"].values, ins["token_seq"].values
    pe = (np.arange(n) + 1) * ratio - 1
    k = keys[table[seq[t], pe // BS], (pe % BS) // ratio]
    if magnitude:
        return abs(scale) * (np.abs(w[t]) @ (np.abs(q[t]) @ np.abs(k).T))
    return scale * (w[t] @ np.maximum(q[t] @ k.T, 0.0))


def _check_selection(got, ins, kv_len, K, ratio, BS, scale):
    """Each row: the min(K, visible) entries of largest score in descending order, then -1; nothing left
    out that beats something kept; both up to f32 accumulation (1e-5 of the terms' magnitudes)."""
    for t in range(got.shape[0]):
        n = int(kv_len[t]) // ratio
        sc = _indexer_scores(ins, t, n, ratio, BS, scale)
        tol = 1e-5 * _indexer_scores(ins, t, n, ratio, BS, scale, magnitude=True)
        m = min(K, n)
        row = got[t]
        assert (row[m:] == -1).all(), f"row {t}: {row}"
        sel = row[:m]
        assert len(set(sel.tolist())) == m and ((sel >= 0) & (sel < n)).all(), f"row {t}: {sel}"
        assert (sc[sel[1:]] <= sc[sel[:-1]] + tol[sel[1:]] + tol[sel[:-1]]).all(), f"row {t}: not descending"
        if m < n:
            rest = np.setdiff1d(np.arange(n), sel)
            worst = sel[np.argmin(sc[sel])]
            assert (sc[rest] <= sc[worst] + tol[rest] + tol[worst]).all(), f"row {t}: a better entry was left out"


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("ratio,BS,K,Di,NI", [(1, 16, 20, 32, 4), (4, 16, 8, 64, 8), (4, 4, 64, 16, 3),
                                              (8, 4, 5, 24, 2)])
def test_indexer_topk(be, ref, dt, ratio, BS, K, Di, NI):
    rng = np.random.default_rng(ratio * 1000 + K + Di)
    S, MB = 3, 40
    NB = S * MB + 1
    CB = max(1, BS // ratio)
    kv_len = np.array([0, 1, ratio - 1, ratio, 5 * ratio + 1, MB * BS, MB * BS - 1, 37 * ratio // 4 + 3, 600])
    kv_len = np.minimum(kv_len, MB * BS)
    T = len(kv_len)
    ins = {"q": In(rng.standard_normal((T, NI, Di)), dt, (0, 4) if dt == "f32" else (0, 0)),
           "weights": In(rng.standard_normal((T, NI))), "keys": In(rng.standard_normal((NB, CB, Di)), dt),
           "block_table": In(_paged(rng, S, MB, NB), "int32"), "token_seq": In(rng.integers(0, S, T), "int32"),
           "kv_len": In(kv_len, "int32")}
    scale = 0.125
    got, want = both(be, ref, "indexer_topk", ins, {"out": ((T, K), "int32")}, scale=scale, ratio=ratio,
                     block_size=BS)
    _check_selection(got["out"], ins, kv_len, K, ratio, BS, scale)
    # and the same lists as the reference, but for swaps of entries whose scores tie to f32 rounding
    for t in range(T):
        if not np.array_equal(got["out"][t], want["out"][t]):
            n = int(kv_len[t]) // ratio
            sc = _indexer_scores(ins, t, n, ratio, BS, scale)
            tol = 1e-5 * _indexer_scores(ins, t, n, ratio, BS, scale, magnitude=True)
            g, w = got["out"][t], want["out"][t]
            d = g != w
            assert (np.abs(sc[g[d]] - sc[w[d]]) <= tol[g[d]] + tol[w[d]]).all(), (t, g, w)


def test_indexer_topk_ties_go_to_the_lower_entry(be, ref):
    """Keys repeat, so scores tie exactly (small integers: exact in f32); the lower entry comes first,
    across a selection boundary too."""
    rng = np.random.default_rng(5)
    n, Di, NI, K = 300, 8, 2, 37
    distinct = rng.integers(-3, 4, (6, Di))
    keys = distinct[rng.integers(0, 6, n)].reshape(n, 1, Di)
    ins = {"q": In(rng.integers(-2, 3, (2, NI, Di))), "weights": In([[1.0, 2.0], [0.5, 1.0]]),
           "keys": In(keys), "block_table": In(np.arange(n).reshape(1, n), "int32"),
           "token_seq": In([0, 0], "int32"), "kv_len": In([n, 101], "int32")}
    got, want = both(be, ref, "indexer_topk", ins, {"out": ((2, K), "int32")}, scale=1.0, ratio=1, block_size=1)
    np.testing.assert_array_equal(got["out"], want["out"])
    for t, L in enumerate((n, 101)):
        sc = _indexer_scores(ins, t, L, 1, 1, 1.0)
        order = sorted(range(L), key=lambda e: (-sc[e], e))[:K]
        np.testing.assert_array_equal(got["out"][t], order)


def test_indexer_topk_one_row_many_entries(be, ref):
    """A decode step over a long context: one row's scoring spreads over several tasks."""
    rng = np.random.default_rng(9)
    ratio, BS, MB, Di, NI, K = 4, 64, 64, 32, 4, 50
    CB = BS // ratio
    kv_len = np.array([MB * BS - 5])
    ins = {"q": In(rng.standard_normal((1, NI, Di))), "weights": In(rng.standard_normal((1, NI))),
           "keys": In(rng.standard_normal((MB, CB, Di))),
           "block_table": In(rng.permutation(MB).reshape(1, MB), "int32"), "token_seq": In([0], "int32"),
           "kv_len": In(kv_len, "int32")}
    got, _ = both(be, ref, "indexer_topk", ins, {"out": ((1, K), "int32")}, scale=1.0, ratio=ratio, block_size=BS)
    _check_selection(got["out"], ins, kv_len, K, ratio, BS, 1.0)


def test_indexer_topk_checks(be):
    rng = np.random.default_rng(2)
    ins = {"q": In(rng.standard_normal((1, 2, 8))), "weights": In(rng.standard_normal((1, 2))),
           "keys": In(rng.standard_normal((4, 2, 8))), "block_table": In([[0, 5]], "int32"),
           "token_seq": In([0], "int32"), "kv_len": In([16], "int32")}
    outs = {"out": ((1, 3), "int32")}
    expect_error(be, "indexer_topk", ins, outs, match="block_table", scale=1.0, ratio=4, block_size=8)
    expect_error(be, "indexer_topk", ins, outs, match="keys.shape[1]", scale=1.0, ratio=2, block_size=8)
    ins["block_table"] = In([[0, 1]], "int32")
    expect_error(be, "indexer_topk", {**ins, "token_seq": In([1], "int32")}, outs, match="token_seq", scale=1.0,
                 ratio=4, block_size=8)
    expect_error(be, "indexer_topk", {**ins, "kv_len": In([17], "int32")}, outs, match="kv_len", scale=1.0,
                 ratio=4, block_size=8)


# ====================================================================== sparse_attention


def _sa_inputs(rng, dt, T, NH, D, S, MB, BS, ratio, comp, idx_k, sinks, view=False):
    NB = S * MB + 2
    CB = max(1, BS // ratio)
    kv_len = rng.integers(0, MB * BS + 1, T)
    kv_len[0] = 0
    kv_len[-1] = MB * BS
    ins = {"q": In(rng.standard_normal((T, NH, D)), dt, (3, 1) if view else (0, 0)),
           "kv_cache": In(rng.standard_normal((NB, BS, D)), dt),
           "comp_cache": In(rng.standard_normal((NB, CB, D)), dt) if comp else None,
           "sinks": In(rng.standard_normal(NH)) if sinks else None,
           "block_table": In(_paged(rng, S, MB, NB), "int32"), "token_seq": In(rng.integers(0, S, T), "int32"),
           "kv_len": In(kv_len, "int32")}
    if idx_k:   # visible entries, some listed twice, -1 and not-yet-visible ones (all skipped)
        idx = rng.integers(-2, MB * BS // ratio + 3, (T, idx_k))
        idx[:, 1] = idx[:, 0]
        idx[:, -1] = -1
        ins["indices"] = In(idx, "int32")
    return ins


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("window,comp,idx_k,sinks", [(0, False, 0, True), (5, False, 0, False), (7, True, 0, True),
                                                     (4, True, 9, True), (0, True, 6, False), (3, True, 0, False)])
def test_sparse_attention(be, ref, dt, window, comp, idx_k, sinks):
    rng = np.random.default_rng(window * 100 + idx_k * 10 + comp + 2 * sinks)
    T, NH, D, S, MB, BS, ratio = 7, 5, 48, 3, 6, 8, 4
    ins = _sa_inputs(rng, dt, T, NH, D, S, MB, BS, ratio, comp, idx_k, sinks, view=dt == "f32")
    got, want = both(be, ref, "sparse_attention", ins, {"out": ((T, NH, D), dt)}, scale=D ** -0.5, window=window,
                     ratio=ratio if comp else 0)
    close(got["out"], want["out"], dt, "sparse_attention", rtol=2e-2 if dt == "bf16" else 1e-4)


def test_sparse_attention_heads_split_alike(cpu_backend):
    """How the pool splits a row's heads (and so which heads share a pass over the keys) changes no bit."""
    rng = np.random.default_rng(21)
    ins = _sa_inputs(rng, "bf16", 1, 10, 40, 1, 5, 8, 4, True, 7, True)
    outs = {"out": ((1, 10, 40), "f32")}
    res = []
    for n in (1, 2, 3):
        b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=n)
        res.append(run(b, "sparse_attention", ins, outs, scale=0.2, window=6, ratio=4)["out"])
        b.close()
    assert np.array_equal(res[0], res[1]) and np.array_equal(res[0], res[2])


@pytest.mark.parametrize("ratio,BS", [(16, 4), (1, 4), (128, 64)])
def test_sparse_attention_ratios(be, ref, ratio, BS):
    """Entries per block from several (ratio < BS) to one per several blocks (ratio > BS); many heads
    on one row (the decode split over heads) and long rows (several key chunks)."""
    rng = np.random.default_rng(ratio + BS)
    T, NH, D, S, MB = 2, 16, 32, 1, 300 // BS + 1
    ins = _sa_inputs(rng, "f32", T, NH, D, S, MB, BS, ratio, True, 0, True)
    got, want = both(be, ref, "sparse_attention", ins, {"out": ((T, NH, D), "f32")}, scale=0.1, window=128,
                     ratio=ratio)
    close(got["out"], want["out"], "f32", "sparse_attention", rtol=1e-4)


def test_sparse_attention_reads_listed_entries_only(be, ref):
    """Compressed entries no row lists, and positions before each row's window, are NaN."""
    rng = np.random.default_rng(13)
    T, NH, D, S, MB, BS, ratio, window = 4, 3, 16, 1, 8, 4, 4, 5
    ins = _sa_inputs(rng, "f32", T, NH, D, S, MB, BS, ratio, True, 5, True)
    ins["token_seq"] = In(np.zeros(T), "int32")
    table, kv_len, idx = ins["block_table"].values, ins["kv_len"].values, ins["indices"].values
    kv = np.full(ins["kv_cache"].values.shape, np.nan)
    comp = np.full(ins["comp_cache"].values.shape, np.nan)
    for t in range(T):
        L = int(kv_len[t])
        for p in range(max(0, L - window), L):
            kv[table[0, p // BS], p % BS] = ins["kv_cache"].values[table[0, p // BS], p % BS]
        for e in idx[t]:
            if 0 <= e < L // ratio:
                pe = (e + 1) * ratio - 1
                comp[table[0, pe // BS], (pe % BS) // ratio] = ins["comp_cache"].values[table[0, pe // BS],
                                                                                        (pe % BS) // ratio]
    ins["kv_cache"], ins["comp_cache"] = In(kv), In(comp)
    got, want = both(be, ref, "sparse_attention", ins, {"out": ((T, NH, D), "f32")}, scale=0.25, window=window,
                     ratio=ratio)
    close(got["out"], want["out"], "f32", "sparse_attention", rtol=1e-4)


def test_sparse_attention_no_keys(be):
    """kv_len 0: no window and no entry; zero rows with or without a sink."""
    rng = np.random.default_rng(3)
    for sinks in (False, True):
        ins = _sa_inputs(rng, "f32", 2, 3, 16, 1, 2, 4, 4, True, 0, sinks)
        ins["kv_len"] = In([0, 0], "int32")
        got = run(be, "sparse_attention", ins, {"out": ((2, 3, 16), "f32")}, scale=1.0, window=0, ratio=4)
        assert (got["out"] == 0).all()


def test_sparse_attention_checks(be):
    rng = np.random.default_rng(4)
    ins = _sa_inputs(rng, "f32", 2, 2, 8, 1, 2, 4, 4, False, 0, False)
    outs = {"out": ((2, 2, 8), "f32")}
    idx = {**ins, "indices": In([[0], [0]], "int32")}
    expect_error(be, "sparse_attention", idx, outs, match="comp_cache", scale=1.0, window=0, ratio=4)
    expect_error(be, "sparse_attention", ins, outs, match="window", scale=1.0, window=-1, ratio=0)
    bad = {**ins, "block_table": In([[0, 99]], "int32"), "kv_len": In([8, 8], "int32")}
    expect_error(be, "sparse_attention", bad, outs, match="block_table", scale=1.0, window=0, ratio=0)
    comp = _sa_inputs(rng, "f32", 2, 2, 8, 1, 2, 4, 4, True, 0, False)
    comp["comp_cache"] = In(rng.standard_normal((4, 2, 8)))   # CB must be max(1, 4 / 4) = 1
    expect_error(be, "sparse_attention", comp, outs, match="comp_cache.shape[1]", scale=1.0, window=0, ratio=4)
