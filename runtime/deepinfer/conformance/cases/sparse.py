"""Cases of V4's compressed and sparse attention and V3.2/V4's lightning indexer (1.3): kv_compress,
indexer_topk and sparse_attention, over scattered paged caches."""
from __future__ import annotations

import numpy as np

from .common import FLOATS, Case, OpCases, TSpec, _shape_str, _sparse_indices, ints, out, plain, randn


# ====================================================================== builders


def _block_table(rng, seqlens, BS: int, low=None) -> tuple[np.ndarray, int]:
    """A scattered block table for sequences of seqlens tokens: each sequence's blocks are distinct ids
    of a pool in random order (NB = all of them plus two spare blocks). Columns a sequence does not
    reach hold -1, as do the columns wholly below low[s] (blocks a sliding window has given back):
    an op must never read them."""
    S = len(seqlens)
    MB = max([1] + [-(-int(n) // BS) for n in seqlens])
    used = [-(-int(n) // BS) for n in seqlens]
    NB = sum(used) + 2
    ids = iter(rng.permutation(NB))
    table = np.full((S, MB), -1, np.int64)
    for s in range(S):
        for c in range(used[s]):
            table[s, c] = next(ids)
        if low is not None:
            table[s, : int(low[s]) // BS] = -1
    return table, NB


def kv_compress(seed, ratio, overlap, BS, W, seqlens, dtype, rows="some") -> Case:
    """Sequences of seqlens staged tokens in a scattered paged cache. rows: "all" (every position of
    every sequence, a prefill) or "some" (window-closing rows, window 0's among them, and others, in
    random order)."""
    rng = np.random.default_rng(seed)
    table, NB = _block_table(rng, seqlens, BS)
    picks = []
    for s, n in enumerate(seqlens):
        if rows == "all":
            picks += [(s, p) for p in range(n)]
            continue
        closing = [p for p in range(ratio - 1, n, ratio)]
        picks += [(s, p) for i, p in enumerate(closing) if i == 0 or rng.random() < 0.6]
        picks += [(s, int(p)) for p in rng.integers(0, n, min(3, n))]
    order = rng.permutation(len(picks)) if rows != "all" else np.arange(len(picks))
    seq = np.array([picks[i][0] for i in order], np.int64)
    pos = np.array([picks[i][1] for i in order], np.int64)
    T = len(pos)
    D = W // 2 if overlap else W
    t = {"staged": plain(rng, (NB, BS, 2 * W), dtype, scale=1.5),
         "position_bias": plain(rng, (ratio, W), "f32", scale=0.5),
         "block_table": ints(table), "token_seq": ints(seq), "positions": ints(pos),
         "out": out((T, D), dtype)}
    name = f"kv_compress {dtype} ratio={ratio} overlap={overlap} BS={BS} W={W} seqlens={list(seqlens)} rows={rows}"
    return Case("kv_compress", name, f"{dtype} ratio={ratio} overlap={overlap}", t,
                {"ratio": ratio, "overlap": overlap}, tol_key=dtype, seed=seed)


def _rows_over(rng, seqlens, T, zero_len=True) -> tuple[np.ndarray, np.ndarray]:
    """T query rows over the sequences: (token_seq, kv_len), kv_len mostly near the sequence's end (a
    decode or verification step) and one empty row."""
    S = len(seqlens)
    seq = rng.integers(0, S, T)
    lens = np.array([int(rng.integers(max(1, seqlens[s] - 8), seqlens[s] + 1)) if rng.random() < 0.7
                     else int(rng.integers(1, seqlens[s] + 1)) for s in seq], np.int64)
    if zero_len and T > 1:
        lens[0] = 0
    return seq, lens


def indexer_topk(seed, T, seqlens, NI, Di, K, ratio, BS, dtype, ties=False) -> Case:
    """ties: some entries share their key exactly (equal scores: either may be chosen at the cut)."""
    rng = np.random.default_rng(seed)
    table, NB = _block_table(rng, seqlens, BS)
    seq, lens = _rows_over(rng, seqlens, T)
    CB = max(1, BS // ratio)
    keys = randn(rng, (NB, CB, Di), dtype)
    if ties and NB * CB > 3:
        flat = keys.reshape(NB * CB, Di)
        flat[1::3] = flat[0]
    t = {"q": plain(rng, (T, NI, Di), dtype), "weights": plain(rng, (T, NI), "f32"),
         "keys": TSpec(dtype, (NB, CB, Di), keys), "block_table": ints(table), "token_seq": ints(seq),
         "kv_len": ints(lens), "out": out((T, K), "int32")}
    name = f"indexer_topk {dtype} ratio={ratio} BS={BS} {_shape_str(T=T, NI=NI, Di=Di, K=K)} " \
           f"seqlens={list(seqlens)}{' ties' if ties else ''}"
    return Case("indexer_topk", name, f"{dtype} ratio={ratio}", t,
                {"scale": Di ** -0.5, "ratio": ratio, "block_size": BS}, tol_key="exact", compare="indexer", seed=seed)


def sparse_attention(seed, T, seqlens, NH, D, BS, window, dtype, ratio=0, indices=0, sinks=False) -> Case:
    """ratio > 0: with comp_cache (entries of ratio tokens); indices=K > 0: only K listed entries per row
    (invalid and repeated ones mixed in); sinks: a sink logit per head. Without comp_cache and with a
    window, the blocks wholly below every row's window hold -1 (released)."""
    rng = np.random.default_rng(seed)
    seq, lens = _rows_over(rng, seqlens, T)
    low = None
    if not ratio and window:
        low = [min([max(0, int(L) - window) for q, L in zip(seq, lens) if q == s] or [0]) for s in range(len(seqlens))]
    table, NB = _block_table(rng, seqlens, BS, low)
    t = {"q": plain(rng, (T, NH, D), dtype), "kv_cache": plain(rng, (NB, BS, D), dtype)}
    if ratio:
        t["comp_cache"] = plain(rng, (NB, max(1, BS // ratio), D), dtype)
        if indices:
            t["indices"] = ints(_sparse_indices(rng, lens // ratio, indices))
    if sinks:
        t["sinks"] = TSpec("f32", (NH,), (rng.standard_normal(NH) * 2.0).astype(np.float32))
    t.update({"block_table": ints(table), "token_seq": ints(seq), "kv_len": ints(lens), "out": out((T, NH, D), dtype)})
    parts = [f"window={window}"] + ([f"comp ratio={ratio}"] if ratio else []) + \
        ([f"indices K={indices}"] if indices and ratio else []) + (["sinks"] if sinks else [])
    name = f"sparse_attention {dtype} BS={BS} {_shape_str(T=T, NH=NH, D=D)} seqlens={list(seqlens)} {' '.join(parts)}"
    fmt = f"{dtype} " + ("window" if not ratio else "comp+indices" if indices else "comp")
    # ratio 0 without comp_cache: the field is unused (a sliding-window layer has no compressor)
    return Case("sparse_attention", name, fmt, t, {"scale": D ** -0.5, "window": window, "ratio": ratio},
                tol_key=dtype, seed=seed)


# ====================================================================== generators


# (ratio, overlap, block sizes: one below the ratio, one above): V4's CSA (4, overlapping), HCA (128),
# and ratio 1 (an entry per token)
KV_COMPRESS_CONFIGS = ((4, 1, (2, 16)), (4, 0, (2, 16)), (128, 0, (16, 256)), (1, 0, (4,)), (1, 1, (4,)))


def gen_kv_compress(p, s):
    for dt in FLOATS:
        yield kv_compress(s(), 4, 1, 16, 8, [0], dt)
        for ratio, overlap, sizes in KV_COMPRESS_CONFIGS:
            lens = [3 * ratio + 1, ratio - 1 or 1, 2 * ratio] if ratio > 1 else [5, 1, 9]
            for BS in sizes:
                W = 8 if ratio == 128 else 12
                yield kv_compress(s(), ratio, overlap, BS, W, lens, dt, rows="some")
            yield kv_compress(s(), ratio, overlap, sizes[0], 16, lens[:1], dt, rows="all")
        for _ in range(p.random_draws):
            r = s.rng
            ratio, overlap, sizes = KV_COMPRESS_CONFIGS[int(r.integers(0, len(KV_COMPRESS_CONFIGS)))]
            lens = [int(n) for n in r.integers(1, 4 * ratio + 2, int(r.integers(1, 4)))]
            yield kv_compress(s(), ratio, overlap, sizes[int(r.integers(0, len(sizes)))], 2 * int(r.integers(1, 9)),
                              lens, dt)


def gen_indexer_topk(p, s):
    for dt in FLOATS:
        yield indexer_topk(s(), 0, [8], 2, 16, 4, 4, 16, dt)
        yield indexer_topk(s(), 9, [70, 23, 41], 4, 32, 8, 4, 16, dt)     # CSA: 4 entries a block
        yield indexer_topk(s(), 9, [70, 23, 41], 4, 32, 8, 4, 2, dt)      # block smaller than the ratio
        yield indexer_topk(s(), 7, [40, 9], 3, 16, 64, 1, 8, dt)          # V3.2: a token per entry; K > visible
        yield indexer_topk(s(), 6, [600, 300], 2, 16, 3, 128, 64, dt)     # HCA-sized entries
        yield indexer_topk(s(), 8, [90, 50], 4, 16, 6, 4, 16, dt, ties=True)
        yield indexer_topk(s(), 5, [30], 2, 8, 0, 4, 8, dt)               # K = 0
        for _ in range(p.random_draws):
            r = s.rng
            ratio = [1, 4, 128][int(r.integers(0, 3))]
            BS = 2 ** int(r.integers(0, 9))
            lens = [int(n) for n in r.integers(1, 40 * ratio if ratio < 128 else 700, int(r.integers(1, 4)))]
            yield indexer_topk(s(), int(r.integers(1, 12)), lens, int(r.integers(1, 6)), int(r.integers(1, 40)),
                               int(r.integers(1, 40)), ratio, BS, dt)


def gen_sparse_attention(p, s):
    for dt in FLOATS:
        yield sparse_attention(s(), 0, [8], 2, 16, 4, 0, dt)
        # sliding window only: the whole past (window 0) and a window (released blocks hold -1)
        yield sparse_attention(s(), 7, [30, 9, 17], 3, 32, 4, 0, dt)
        yield sparse_attention(s(), 7, [30, 9, 17], 3, 32, 4, 8, dt, sinks=True)
        # HCA: every visible entry of 128 tokens, blocks below and above the ratio
        for BS in (16, 256):
            yield sparse_attention(s(), 6, [300, 140, 60], 2, 16, BS, 16, dt, ratio=128, sinks=True)
        # CSA: the indexer's entries of 4 tokens (-1, out of range and repeats among them)
        for BS in (2, 16):
            yield sparse_attention(s(), 8, [45, 13, 30], 3, 16, BS, 8, dt, ratio=4, indices=6, sinks=True)
        yield sparse_attention(s(), 6, [45, 20], 2, 16, 16, 0, dt, ratio=4, indices=5)
        yield sparse_attention(s(), 6, [45, 20], 2, 16, 8, 4, dt, ratio=4)                # every entry, no sink
        yield sparse_attention(s(), 5, [25, 12], 2, 16, 4, 3, dt, ratio=1, indices=4, sinks=True)
        for _ in range(p.random_draws):
            r = s.rng
            ratio = [0, 1, 4, 128][int(r.integers(0, 4))]
            lens = [int(n) for n in r.integers(1, 300 if ratio == 128 else 60, int(r.integers(1, 4)))]
            yield sparse_attention(s(), int(r.integers(1, 9)), lens, int(r.integers(1, 5)), 2 * int(r.integers(1, 17)),
                                   2 ** int(r.integers(0, 6)), int(r.integers(0, 20)), dt, ratio=ratio,
                                   indices=int(r.integers(0, 10)) if ratio else 0, sinks=bool(r.integers(0, 2)))


# ====================================================================== large cases


def large_kv_compress(s):
    yield kv_compress(s(), 4, 1, 64, 1024, [300, 77], "bf16", rows="all")   # V4's CSA: 2 x 512
    yield kv_compress(s(), 128, 0, 64, 512, [520], "bf16")


def large_indexer_topk(s):
    yield indexer_topk(s(), 12, [3000, 1200], 64, 128, 512, 4, 64, "bf16")  # V4's indexer shapes


def large_sparse_attention(s):
    yield sparse_attention(s(), 8, [900, 400], 16, 512, 64, 128, "bf16", ratio=4, indices=64, sinks=True)


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    # with every optional argument (so that the L0 checks reach them)
    "kv_compress": OpCases(gen_kv_compress, lambda: kv_compress(1, 2, 1, 2, 4, [8], "f32", rows="all"),
                           large_kv_compress),
    "indexer_topk": OpCases(gen_indexer_topk, lambda: indexer_topk(1, 3, [16], 2, 8, 3, 2, 4, "f32"),
                            large_indexer_topk),
    "sparse_attention": OpCases(gen_sparse_attention,
                                lambda: sparse_attention(1, 3, [12], 2, 8, 4, 6, "f32", ratio=2, indices=3, sinks=True),
                                large_sparse_attention),
}
