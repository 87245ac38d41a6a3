"""The CPU library's ABI 1.3 ops (DeepSeek V4 and V3.2) against the reference backend.

Every test makes fresh random inputs, runs the same call on the CPU library and on the NumPy
reference (each on its own copies; outputs poisoned with NaN or a sentinel, so an element the op
forgets to write fails), and compares: f32 results within a few f32 roundings of the reference's f64
math, bf16 results within a step of bf16, integer results exactly. On top of that, what a comparison
with the reference cannot show: the indexer's tie rule and selection against the scores, the rows
kv_compress leaves zero, positions listed twice or out of range, hash routing's table order, the
clipped SwiGLU on both moe_experts paths, negative rope positions, and the argument checks.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import deepinfer
from deepinfer.errors import BackendCallError
from deepinfer.tensor import Tensor

NP = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "int32": np.int32}
POISON_INT = -7777


@pytest.fixture(scope="module")
def be(cpu_backend):
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    yield b
    b.close()


@pytest.fixture(scope="module")
def ref():
    r = deepinfer.get_backend("reference")
    missing = [op for op in ("hc_pre", "hc_post", "kv_compress", "indexer_topk", "sparse_attention", "layernorm")
               if not r.has_op(op)]
    if missing:
        pytest.skip(f"the reference backend lacks {missing}")
    return r


class In:
    """An input: values (cast to dtype), optionally a column view of a wider buffer (pad before, after)."""

    def __init__(self, values, dtype="f32", pad=(0, 0)):
        self.values = np.asarray(values)
        self.dtype, self.pad = dtype, pad

    def tensor(self) -> Tensor:
        v = self.values.astype(NP[self.dtype])
        if self.pad == (0, 0):
            return Tensor.from_numpy(np.ascontiguousarray(v))
        n = v.shape[-1]
        wide = np.full(v.shape[:-1] + (n + sum(self.pad),), 99, NP[self.dtype])   # garbage around the view
        wide[..., self.pad[0]:self.pad[0] + n] = v
        return Tensor.from_numpy(wide).narrow(-1, self.pad[0], n)

    def rounded(self) -> np.ndarray:
        """The values as the op sees them (after rounding to the dtype), in f64."""
        return self.values.astype(NP[self.dtype]).astype(np.float64)


def run(backend, op, ins: dict, outs: dict, **scalars) -> dict:
    """op on `backend` with fresh tensors; outs: name -> (shape, dtype), poisoned; returns their values."""
    kw = {k: (None if v is None else v.tensor()) for k, v in ins.items()}
    kw = {k: v for k, v in kw.items() if v is not None}
    o = {}
    for name, (shape, dt) in outs.items():
        o[name] = backend.empty(shape, dt, fill=POISON_INT if dt == "int32" else np.nan)
    backend.call(op, **kw, **o, **scalars)
    return {n: backend.to_numpy(t).astype(np.float64 if outs[n][1] != "int32" else np.int64) for n, t in o.items()}


def close(got, want, dtype, what="", rtol=None):
    """|got - want| <= rtol |want| + atol * rms(want), elementwise (an f32 or a bf16 result of f64 math)."""
    rtol = rtol if rtol is not None else (2e-2 if dtype == "bf16" else 2e-5)
    rms = float(np.sqrt(np.mean(want * want))) if want.size else 0.0
    assert not np.isnan(got).any(), f"{what}: NaN in the result (an element left unwritten?)"
    err = np.abs(got - want)
    bound = rtol * np.abs(want) + rtol * max(rms, 1e-30)
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements off, worst |diff| {err.max():.3g} "
                           f"(rms {rms:.3g})")


def both(be, ref, op, ins, outs, **scalars):
    return run(be, op, ins, outs, **scalars), run(ref, op, ins, outs, **scalars)


def expect_error(backend, op, ins, outs, status="INVALID_ARGUMENT", match=None, **scalars):
    with pytest.raises(BackendCallError) as e:
        run(backend, op, ins, outs, **scalars)
    assert e.value.status_name == status, str(e.value)
    if match:
        assert match in e.value.message, e.value.message
    return e.value


# ====================================================================== layernorm


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("T,H,bias,view", [(1, 64, True, False), (37, 300, False, True), (9, 128, True, True)])
def test_layernorm(be, ref, dt, T, H, bias, view):
    rng = np.random.default_rng(T * 1000 + H)
    ins = {"x": In(rng.standard_normal((T, H)) * 3 + 1.5, dt, (2, 5) if view else (0, 0)),
           "weight": In(rng.standard_normal(H), dt), "bias": In(rng.standard_normal(H), dt) if bias else None}
    got, want = both(be, ref, "layernorm", ins, {"out": ((T, H), dt)}, eps=1e-6)
    close(got["out"], want["out"], dt, "layernorm")


def test_layernorm_rejects_negative_eps(be):
    expect_error(be, "layernorm", {"x": In(np.ones((2, 4))), "weight": In(np.ones(4))}, {"out": ((2, 4), "f32")},
                 eps=-1.0, match="eps")


# ====================================================================== hc_pre, hc_post


def _hc_inputs(rng, T, N, H, block, xdt, view=False):
    M = (2 + N) * N if block else N
    return {"x": In(rng.standard_normal((T, N, H)), xdt, (1, 3) if view else (0, 0)),
            "fn": In(rng.standard_normal((M, N * H)) * 0.05),
            "base": In(rng.standard_normal(M) * 0.5),
            "scale": In(rng.uniform(0.5, 2.0, 3 if block else 1))}


@pytest.mark.parametrize("xdt,odt", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("T,N,H,iters", [(1, 4, 64, 20), (5, 4, 200, 1), (9, 2, 96, 3), (3, 1, 32, 2)])
def test_hc_pre_block(be, ref, xdt, odt, T, N, H, iters):
    rng = np.random.default_rng(T * 31 + N * 7 + H)
    ins = _hc_inputs(rng, T, N, H, True, xdt, view=T == 5)
    outs = {"out": ((T, H), odt), "post": ((T, N), "f32"), "comb": ((T, N, N), "f32")}
    got, want = both(be, ref, "hc_pre", ins, outs, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters)
    close(got["out"], want["out"], odt, "out", rtol=2e-2 if odt == "bf16" else 1e-4)
    close(got["post"], want["post"], "f32", "post", rtol=1e-4)
    close(got["comb"], want["comb"], "f32", "comb", rtol=1e-4)
    if iters >= 20:   # Sinkhorn converges to a doubly stochastic matrix
        np.testing.assert_allclose(got["comb"].sum(axis=-1), 1.0, atol=1e-3)
        np.testing.assert_allclose(got["comb"].sum(axis=-2), 1.0, atol=1e-3)


@pytest.mark.parametrize("T", [1, 6])
def test_hc_pre_head(be, ref, T):
    """M = N (the model's head): pre only, scale [1], no post or comb."""
    rng = np.random.default_rng(T)
    N, H = 4, 80
    ins = _hc_inputs(rng, T, N, H, False, "bf16")
    got, want = both(be, ref, "hc_pre", ins, {"out": ((T, H), "bf16")}, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=0)
    close(got["out"], want["out"], "bf16", "out")


def test_hc_pre_checks(be):
    rng = np.random.default_rng(0)
    ins = _hc_inputs(rng, 2, 4, 16, True, "f32")
    outs = {"out": ((2, 16), "f32"), "post": ((2, 4), "f32")}
    expect_error(be, "hc_pre", ins, outs, match="comb", eps=1e-6, hc_eps=1e-6, sinkhorn_iters=1)
    outs["comb"] = ((2, 4, 4), "f32")
    expect_error(be, "hc_pre", ins, outs, match="sinkhorn_iters", eps=1e-6, hc_eps=1e-6, sinkhorn_iters=0)
    ins["fn"] = In(rng.standard_normal((10, 64)))
    ins["base"] = In(rng.standard_normal(10))
    expect_error(be, "hc_pre", ins, outs, match="fn.shape[0]", eps=1e-6, hc_eps=1e-6, sinkhorn_iters=1)


@pytest.mark.parametrize("xdt,ydt,odt", [("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("bf16", "f32", "f32")])
@pytest.mark.parametrize("T,N,H", [(1, 4, 64), (7, 4, 130), (3, 2, 8)])
def test_hc_post(be, ref, xdt, ydt, odt, T, N, H):
    rng = np.random.default_rng(T * 100 + H)
    ins = {"x": In(rng.standard_normal((T, N, H)), xdt, (0, 2) if T == 7 else (0, 0)),
           "y": In(rng.standard_normal((T, H)), ydt),
           "post": In(rng.uniform(0, 2, (T, N))), "comb": In(rng.uniform(0, 1, (T, N, N)))}
    got, want = both(be, ref, "hc_post", ins, {"out": ((T, N, H), odt)})
    close(got["out"], want["out"], odt, "hc_post")
    # comb is applied transposed: input stream j feeds output stream k with comb[t, j, k]
    x, y, p, c = (ins[n].rounded() for n in ("x", "y", "post", "comb"))
    mine = p[:, :, None] * y[:, None, :] + np.einsum("tjk,tjh->tkh", c, x)
    close(got["out"], mine, odt, "hc_post vs the README formula")


def test_hc_post_rejects_out_overlapping_x(be):
    T, N, H = 2, 2, 8
    x = Tensor.from_numpy(np.ones((T, N, H), np.float32))
    kw = {"y": Tensor.from_numpy(np.ones((T, H), np.float32)), "post": Tensor.from_numpy(np.ones((T, N), np.float32)),
          "comb": Tensor.from_numpy(np.ones((T, N, N), np.float32))}
    with pytest.raises(BackendCallError) as e:
        be.call("hc_post", x=x, out=x, **kw)
    assert e.value.status_name == "INVALID_ARGUMENT" and "overlaps" in e.value.message


# ====================================================================== kv_compress


def _paged(rng, S, MB, NB):
    """A block table of S sequences x MB blocks, distinct random blocks of NB."""
    return rng.permutation(NB)[:S * MB].reshape(S, MB).astype(np.int32)


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


# ====================================================================== mla_decode with indices


def _mla_inputs(rng, dt, T, S, H, Dn, Dr, Dv, Dc, BS, MB, K):
    NB = S * MB + 1
    kv_len = rng.integers(1, MB * BS + 1, T)
    kv_len[0] = 0
    idx = rng.integers(-2, MB * BS + 2, (T, K))
    idx[:, 2] = idx[:, 1]   # listed twice: counts once
    idx[1, :] = -1          # nothing valid: a zero row
    return {"q": In(rng.standard_normal((T, H, Dn + Dr)), dt),
            "wkv_b": In(rng.standard_normal((H * (Dn + Dv), Dc)) / np.sqrt(Dc), dt),
            "cache": In(rng.standard_normal((NB, BS, Dc + Dr)), dt),
            "block_table": In(_paged(rng, S, MB, NB), "int32"), "token_seq": In(np.sort(rng.integers(0, S, T)), "int32"),
            "kv_len": In(kv_len, "int32"), "indices": In(idx, "int32")}


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("K", [5, 70])
def test_mla_decode_indices(be, ref, dt, K):
    rng = np.random.default_rng(K)
    T, S, H, Dn, Dr, Dv, Dc, BS, MB = 9, 2, 3, 10, 4, 7, 40, 8, 12
    ins = _mla_inputs(rng, dt, T, S, H, Dn, Dr, Dv, Dc, BS, MB, K)
    got, want = both(be, ref, "mla_decode", ins, {"out": ((T, H, Dv), dt)}, scale=(Dn + Dr) ** -0.5)
    close(got["out"], want["out"], dt, "mla_decode", rtol=2e-2 if dt == "bf16" else 1e-4)
    assert (got["out"][[0, 1]] == 0).all()


def test_mla_decode_indices_reads_listed_positions_only(be, ref):
    """Every cache row no token lists is NaN: the result stays finite (and the reference's)."""
    rng = np.random.default_rng(12)
    T, S, H, Dn, Dr, Dv, Dc, BS, MB, K = 5, 1, 2, 8, 4, 6, 24, 4, 8, 6
    ins = _mla_inputs(rng, "f32", T, S, H, Dn, Dr, Dv, Dc, BS, MB, K)
    table, kv_len, idx = ins["block_table"].values, ins["kv_len"].values, ins["indices"].values
    cache = np.full(ins["cache"].values.shape, np.nan)
    for t in range(T):
        for p in idx[t]:
            if 0 <= p < kv_len[t]:
                cache[table[0, p // BS], p % BS] = ins["cache"].values[table[0, p // BS], p % BS]
    ins["cache"] = In(cache)
    ins["token_seq"] = In(np.zeros(T), "int32")
    got, want = both(be, ref, "mla_decode", ins, {"out": ((T, H, Dv), "f32")}, scale=0.3)
    close(got["out"], want["out"], "f32", "mla_decode", rtol=1e-4)


def test_mla_decode_all_positions_listed_is_dense(be):
    """indices naming every position below kv_len (shuffled, with repeats) is the dense op."""
    rng = np.random.default_rng(11)
    T, S, H, Dn, Dr, Dv, Dc, BS, MB = 4, 2, 2, 8, 4, 6, 32, 8, 6
    ins = _mla_inputs(rng, "f32", T, S, H, Dn, Dr, Dv, Dc, BS, MB, 3)
    kv_len = ins["kv_len"].values
    K = 2 * MB * BS
    idx = np.full((T, K), -1)
    for t in range(T):
        p = np.concatenate([rng.permutation(kv_len[t]), rng.integers(0, max(kv_len[t], 1), 3)])[:K]
        idx[t, :len(p)] = p
    dense = run(be, "mla_decode", {k: v for k, v in ins.items() if k != "indices"}, {"out": ((T, H, Dv), "f32")},
                scale=0.3)
    sparse = run(be, "mla_decode", {**ins, "indices": In(idx, "int32")}, {"out": ((T, H, Dv), "f32")}, scale=0.3)
    close(sparse["out"], dense["out"], "f32", "sparse vs dense", rtol=1e-5)


# ====================================================================== moe_router


@pytest.mark.parametrize("n_group,topk_group,bias", [(0, 0, True), (1, 1, False), (4, 2, True)])
def test_moe_router_sqrtsoftplus(be, ref, n_group, topk_group, bias):
    rng = np.random.default_rng(n_group)
    T, E, K = 11, 32, 6
    logits = rng.standard_normal((T, E)) * 4
    logits[0, :4] = [25.0, -30.0, 19.5, 20.5]   # both sides of softplus's threshold
    ins = {"logits": In(logits), "bias": In(rng.standard_normal(E) * 0.1) if bias else None}
    outs = {"topk_ids": ((T, K), "int32"), "topk_weights": ((T, K), "f32")}
    sc = dict(scoring=2, n_group=n_group, topk_group=topk_group, group_score=0, norm_topk_prob=1,
              routed_scaling_factor=1.5)
    got, want = both(be, ref, "moe_router", ins, outs, **sc)
    np.testing.assert_array_equal(got["topk_ids"], want["topk_ids"])
    close(got["topk_weights"], want["topk_weights"], "f32", "topk_weights", rtol=1e-6)


@pytest.mark.parametrize("scoring", [0, 1, 2])
def test_moe_router_hash(be, ref, scoring):
    """ids = hash_table[token_ids[t]] in table order (bias and groups unused); weights = their scores."""
    rng = np.random.default_rng(scoring)
    T, E, K, V = 9, 16, 4, 50
    table = np.stack([rng.permutation(E)[:K] for _ in range(V)]).astype(np.int32)
    tids = rng.integers(0, V, T).astype(np.int32)
    ins = {"logits": In(rng.standard_normal((T, E)) * 3), "bias": In(rng.standard_normal(E)),
           "token_ids": In(tids, "int32"), "hash_table": In(table, "int32")}
    outs = {"topk_ids": ((T, K), "int32"), "topk_weights": ((T, K), "f32")}
    for norm in (0, 1):
        sc = dict(scoring=scoring, n_group=1, topk_group=1, group_score=0, norm_topk_prob=norm,
                  routed_scaling_factor=2.0)
        got, want = both(be, ref, "moe_router", ins, outs, **sc)
        np.testing.assert_array_equal(got["topk_ids"], table[tids])
        np.testing.assert_array_equal(got["topk_ids"], want["topk_ids"])
        close(got["topk_weights"], want["topk_weights"], "f32", "topk_weights", rtol=1e-6)


def test_moe_router_hash_checks(be):
    rng = np.random.default_rng(0)
    T, E, K = 2, 8, 2
    base = {"logits": In(rng.standard_normal((T, E)))}
    outs = {"topk_ids": ((T, K), "int32"), "topk_weights": ((T, K), "f32")}
    sc = dict(scoring=1, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1, routed_scaling_factor=1.0)
    expect_error(be, "moe_router", {**base, "token_ids": In([0, 1], "int32")}, outs, match="hash_table", **sc)
    table = In([[0, 1], [2, 3], [4, 8]], "int32")
    expect_error(be, "moe_router", {**base, "token_ids": In([0, 3], "int32"), "hash_table": table}, outs,
                 match="token_ids[1]", **sc)
    expect_error(be, "moe_router", {**base, "token_ids": In([0, 2], "int32"), "hash_table": table}, outs,
                 match="hash_table[2, 1]", **sc)


# ====================================================================== clipped SwiGLU


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_silu_mul_limit(be, ref, dt):
    rng = np.random.default_rng(8)
    T, I = 13, 70
    ins = {"gate": In(rng.standard_normal((T, I)) * 8, dt, (0, 3)), "up": In(rng.standard_normal((T, I)) * 8, dt)}
    outs = {"out": ((T, I), dt)}
    got, want = both(be, ref, "silu_mul", ins, outs, limit=7.0)
    close(got["out"], want["out"], dt, "silu_mul limit 7")
    g, u = ins["gate"].rounded(), ins["up"].rounded()
    assert (np.abs(got["out"]) <= 7.0 * 7.0 * 1.01).all()
    mine = np.minimum(g, 7.0) / (1 + np.exp(-np.minimum(g, 7.0))) * np.clip(u, -7.0, 7.0)
    close(got["out"], mine, dt, "silu_mul vs the README formula")
    # limit 0 is no clipping: the same bits as a call that leaves the field out
    a = run(be, "silu_mul", ins, outs, limit=0.0)["out"]
    b = run(be, "silu_mul", ins, outs)["out"]
    assert np.array_equal(a, b)
    expect_error(be, "silu_mul", ins, outs, match="limit", limit=-1.0)


def _experts(rng, E, I, H, dt):
    w = lambda n, k: Tensor.from_numpy((rng.standard_normal((n, k)) * 0.3).astype(NP[dt]))
    return [w(I, H) for _ in range(E)], [w(I, H) for _ in range(E)], [w(H, I) for _ in range(E)]


def _moe(backend, x, ids, tw, experts, limit, dt="f32"):
    T, H = x.shape
    out = backend.empty((T, H), dt, fill=np.nan)
    g, u, d = experts
    backend.moe_experts(x=Tensor.from_numpy(x.astype(NP[dt])), topk_ids=Tensor.from_numpy(ids),
                        topk_weights=Tensor.from_numpy(tw), w_gate=g, w_up=u, w_down=d, out=out,
                        num_experts=len(g), accumulate=0, swiglu_limit=limit)
    return backend.to_numpy(out).astype(np.float64)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("T", [3, 40])
def test_moe_experts_swiglu_limit(be, ref, dt, T):
    """Both paths: a few tokens (one task per expert) and many (every expert's rows batched)."""
    rng = np.random.default_rng(T)
    E, K, H, I = 6, 2, 64, 48
    experts = _experts(rng, E, I, H, dt)
    x = rng.standard_normal((T, H)) * 3
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    tw = rng.random((T, K)).astype(np.float32)
    got = _moe(be, x, ids, tw, experts, 1.5, dt)
    want = _moe(ref, x, ids, tw, experts, 1.5, dt)
    close(got, want, dt, "moe_experts swiglu_limit", rtol=2e-2 if dt == "bf16" else 1e-4)
    unclipped = _moe(ref, x, ids, tw, experts, 0.0, dt)
    assert np.abs(unclipped - want).max() > 0.1 * np.abs(want).max()   # the clip mattered


def test_moe_experts_swiglu_limit_token_independent(be):
    """A token's output is the one it gets alone, with the clip too (rows of one expert share a call)."""
    rng = np.random.default_rng(17)
    E, K, H, I, T = 8, 2, 128, 64, 5
    experts = _experts(rng, E, I, H, "bf16")
    x = rng.standard_normal((T, H)) * 3
    ids = np.array([[0, 1], [1, 2], [0, 2], [3, 1], [0, 1]], np.int32)
    tw = rng.random((T, K)).astype(np.float32)
    together = _moe(be, x, ids, tw, experts, 2.0)
    for t in range(T):
        alone = _moe(be, x[t:t + 1], ids[t:t + 1], tw[t:t + 1], experts, 2.0)[0]
        assert np.array_equal(together[t], alone), f"token {t}"


# ====================================================================== rope with negative positions


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rope_negative_positions_undo(be, ref, interleaved):
    """V4 rotates its attention output back by -p: rope(-p) after rope(p) is the identity, and rope at
    negative positions agrees with the reference."""
    rng = np.random.default_rng(interleaved)
    T, H, D = 6, 3, 16
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 2047, 5], np.int32)
    sc = dict(interleaved=interleaved, scaling=1, theta=10000.0, factor=4.0, original_max_position=64,
              beta_fast=32.0, beta_slow=1.0, attn_factor=1.0)
    fwd = run(be, "rope", {"x": In(x), "positions": In(pos, "int32")}, {"out": ((T, H, D), "f32")}, **sc)["out"]
    back, want = both(be, ref, "rope", {"x": In(fwd), "positions": In(-pos, "int32")}, {"out": ((T, H, D), "f32")},
                      **sc)
    close(back["out"], want["out"], "f32", "rope(-p)", rtol=1e-4)
    np.testing.assert_allclose(back["out"], x, rtol=1e-4, atol=1e-4)
