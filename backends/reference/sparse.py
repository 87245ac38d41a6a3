"""DeepSeek V4's compressed and sparse attention and V3.2's indexer: kv_compress, indexer_topk,
sparse_attention (abi/README.md section 8).

All three address paged caches through a block table. Token rows live at
[block_table[s, p / BS], p % BS]; a compressed entry e (of `ratio` tokens) lives in the block of its
window's last token pe = (e + 1) * ratio - 1, at [block_table[s, pe / BS], (pe % BS) / ratio], a
cache of CB = max(1, BS / ratio) entries a block. Only the blocks an op actually reads are checked
(a sliding-window cache may have released the others).

Math is float64; each output is rounded once.
"""
from __future__ import annotations

import numpy as np

from .common import (blocks_of, check_arg, check_dim, check_pow2, check_shape, f32, i32, read, read_index, softmax,
                     write)


def _rows_of(op: str, token_seq, what_len: str, lengths: np.ndarray, S: int, limit: int) -> np.ndarray:
    """token_seq checked against the block table's S rows, and the per-row lengths against [0, limit]."""
    seq = read_index(token_seq)
    for t in range(len(seq)):
        if not 0 <= seq[t] < S:
            raise ValueError(f"{op}: token_seq[{t}]={seq[t]} outside [0, {S})")
        if not 0 <= lengths[t] <= limit:
            raise ValueError(f"{op}: {what_len}[{t}]={lengths[t]} outside [0, {limit}]")
    return seq


def entry_rows(op: str, cache: np.ndarray, table: np.ndarray, s: int, entries, ratio: int, BS: int,
               name: str) -> np.ndarray:
    """The rows [n, D] of compressed entries `entries` of sequence s. Entry e lives in the block of its
    window's last token pe = (e + 1) * ratio - 1 (so that a prefix-cache block stays a function of its
    tokens), at slot (pe % BS) / ratio of that block."""
    e = np.asarray(entries, np.int64).reshape(-1)
    pe = (e + 1) * ratio - 1
    blocks = blocks_of(op, table, s, pe, BS, cache.shape[0], f"{name}: the entry whose window ends at position")
    return cache[blocks, (pe % BS) // ratio]


# ====================================================================== kv_compress


def kv_compress(staged=None, position_bias=None, block_table=None, token_seq=None, positions=None, out=None,
                ratio=None, overlap=None) -> None:
    """Row t whose position p closes a window (p + 1 = (w + 1) * ratio) gets the softmax-gated sum of
    the window's staged values (overlap 1: the first halves of window w - 1 and the second halves of
    window w); every other row gets zeros."""
    op = "kv_compress"
    for name, t in (("staged", staged), ("position_bias", position_bias), ("block_table", block_table),
                    ("token_seq", token_seq), ("positions", positions), ("out", out)):
        check_arg(op, name, t)
    ratio, overlap = i32(ratio, op, "ratio"), i32(overlap, op, "overlap")
    NB, BS, W2 = staged.shape
    S, MB = block_table.shape
    T = positions.shape[0]
    check_pow2(op, "ratio", ratio)
    check_pow2(op, "staged.shape[1] (the block size)", BS)
    if overlap not in (0, 1):
        raise ValueError(f"{op}: overlap={overlap} must be 0 or 1")
    if W2 % 2:
        raise ValueError(f"{op}: staged.shape[2]={W2} must be even (W values, then W gate logits)")
    W = W2 // 2
    if overlap and W % 2:
        raise ValueError(f"{op}: with overlap 1, W = staged.shape[2] / 2 = {W} must be even (two series of W / 2)")
    D = W // 2 if overlap else W
    check_shape(op, "position_bias", position_bias, (ratio, W))
    check_dim(op, "token_seq.shape[0]", token_seq.shape[0], T, "positions.shape[0]")
    check_shape(op, "out", out, (T, D))
    pos = read_index(positions)
    seq = read_index(token_seq)
    for t in range(T):
        if not 0 <= seq[t] < S:
            raise ValueError(f"{op}: token_seq[{t}]={seq[t]} outside [0, {S})")
        if not 0 <= pos[t] < MB * BS:
            raise ValueError(f"{op}: positions[{t}]={pos[t]} outside [0, MB*BS={MB * BS})")
    table = read_index(block_table)
    closing = [t for t in range(T) if (pos[t] + 1) % ratio == 0]
    # every block a closing row reads, checked before anything is read or written
    for t in closing:
        w = (pos[t] + 1) // ratio - 1
        first = (w - 1) * ratio if overlap and w >= 1 else w * ratio
        blocks_of(op, table, seq[t], np.arange(first, pos[t] + 1), BS, NB, f"row {t} reads position")

    cache, bias = read(staged), read(position_bias)
    y = np.zeros((T, D))

    def rows(s, start):
        p = np.arange(start, start + ratio)
        return cache[table[s, p // BS], p % BS]            # [ratio, 2W]

    for t in closing:
        s, w = seq[t], (pos[t] + 1) // ratio - 1
        cur = rows(s, w * ratio)
        if not overlap:
            values, logits = cur[:, :W], cur[:, W:] + bias
        else:
            values, logits = cur[:, D:W], cur[:, W + D:] + bias[:, D:]
            if w >= 1:   # window 0 has no previous window: its ratio slots are absent, not zero
                prev = rows(s, (w - 1) * ratio)
                values = np.concatenate([prev[:, :D], values])
                logits = np.concatenate([prev[:, W:W + D] + bias[:, :D], logits])
        y[t] = (softmax(logits, axis=0) * values).sum(axis=0)
    write(out, y)


# ====================================================================== indexer_topk


def indexer_topk(q=None, weights=None, keys=None, block_table=None, token_seq=None, kv_len=None, out=None,
                 scale=None, ratio=None, block_size=None) -> None:
    """out[t] = the visible entries (e < kv_len[t] / ratio) of largest
    scale * sum_h weights[t, h] * relu(q[t, h] . key_e), descending, ties to the lower e, then -1."""
    op = "indexer_topk"
    for name, t in (("q", q), ("weights", weights), ("keys", keys), ("block_table", block_table),
                    ("token_seq", token_seq), ("kv_len", kv_len), ("out", out)):
        check_arg(op, name, t)
    scale = f32(scale, op, "scale")
    ratio, BS = i32(ratio, op, "ratio"), i32(block_size, op, "block_size")
    T, NI, Di = q.shape
    NB, CB, Dk = keys.shape
    S, MB = block_table.shape
    K = out.shape[1]
    check_pow2(op, "ratio", ratio)
    check_pow2(op, "block_size", BS)
    check_shape(op, "weights", weights, (T, NI))
    check_dim(op, "keys.shape[2]", Dk, Di, "q.shape[2]")
    check_dim(op, "keys.shape[1]", CB, max(1, BS // ratio), "max(1, block_size / ratio)")
    check_dim(op, "token_seq.shape[0]", token_seq.shape[0], T, "q.shape[0]")
    check_dim(op, "kv_len.shape[0]", kv_len.shape[0], T, "q.shape[0]")
    check_dim(op, "out.shape[0]", out.shape[0], T, "q.shape[0]")
    if not np.isfinite(scale):
        raise ValueError(f"{op}: scale={scale} is not finite")
    length = read_index(kv_len)
    seq = _rows_of(op, token_seq, "kv_len", length, S, MB * BS)
    table, kv, qv, wv = read_index(block_table), read(keys), read(q), read(weights)
    rows = [entry_rows(op, kv, table, seq[t], np.arange(length[t] // ratio), ratio, BS, "keys") for t in range(T)]

    ids = np.full((T, K), -1, np.int64)
    for t in range(T):
        if not len(rows[t]) or not K:
            continue
        dots = np.maximum(qv[t] @ rows[t].T, 0.0)           # [NI, n]
        score = scale * (wv[t] @ dots)                      # [n]
        order = np.argsort(-score, kind="stable")[:K]       # stable: ties keep the lower entry first
        ids[t, :len(order)] = order
    write(out, ids)


# ====================================================================== sparse_attention


def sparse_attention(q=None, kv_cache=None, comp_cache=None, indices=None, sinks=None, block_table=None,
                     token_seq=None, kv_len=None, out=None, scale=None, window=None, ratio=None) -> None:
    """MQA of each row over one shared key = value per position: the sliding window of kv_cache, the
    visible compressed entries of comp_cache (all, or those in indices[t]), and a sink logit per head."""
    op = "sparse_attention"
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("token_seq", token_seq),
                    ("kv_len", kv_len), ("out", out)):
        check_arg(op, name, t)
    for name, t in (("comp_cache", comp_cache), ("indices", indices), ("sinks", sinks)):
        check_arg(op, name, t)   # optional: None passes
    scale = f32(scale, op, "scale")
    window, ratio = i32(window, op, "window"), i32(ratio, op, "ratio")
    T, NH, D = q.shape
    NB, BS, Dk = kv_cache.shape
    S, MB = block_table.shape
    check_dim(op, "kv_cache.shape[2]", Dk, D, "q.shape[2]")
    check_dim(op, "token_seq.shape[0]", token_seq.shape[0], T, "q.shape[0]")
    check_dim(op, "kv_len.shape[0]", kv_len.shape[0], T, "q.shape[0]")
    check_shape(op, "out", out, (T, NH, D))
    if window < 0:
        raise ValueError(f"{op}: window={window} is negative (0 means all positions)")
    if not np.isfinite(scale):
        raise ValueError(f"{op}: scale={scale} is not finite")
    if comp_cache is not None:
        check_pow2(op, "ratio", ratio)
        check_pow2(op, "kv_cache.shape[1] (the block size)", BS)
        CB = max(1, BS // ratio)
        check_shape(op, "comp_cache", comp_cache, (comp_cache.shape[0], CB, D))
        if indices is not None:
            check_dim(op, "indices.shape[0]", indices.shape[0], T, "q.shape[0]")
    elif indices is not None:
        raise ValueError(f"{op}: indices name compressed entries; they need comp_cache")
    if sinks is not None:
        check_shape(op, "sinks", sinks, (NH,))
    length = read_index(kv_len)
    seq = _rows_of(op, token_seq, "kv_len", length, S, MB * BS)
    table = read_index(block_table)
    idx = read_index(indices) if indices is not None else None

    # which positions and entries each row reads; every block they touch is checked before any math
    kv_rows, comp_rows = [], []
    cache = read(kv_cache)
    comp = read(comp_cache) if comp_cache is not None else None
    for t in range(T):
        L, s = int(length[t]), int(seq[t])
        first = max(0, L - window) if window > 0 else 0
        p = np.arange(first, L)
        kv_rows.append(cache[blocks_of(op, table, s, p, BS, NB, f"row {t} reads position"), p % BS])
        if comp is None:
            comp_rows.append(np.zeros((0, D)))
            continue
        visible = L // ratio
        if idx is None:
            entries = np.arange(visible)
        else:   # < 0 or not yet visible: skipped; listed twice: counted once
            entries = sorted({int(e) for e in idx[t] if 0 <= e < visible})
        comp_rows.append(entry_rows(op, comp, table, s, entries, ratio, BS, "comp_cache"))

    qv = read(q)
    sink = read(sinks) if sinks is not None else None
    y = np.zeros((T, NH, D))
    for t in range(T):
        k = np.concatenate([kv_rows[t], comp_rows[t]])      # [n, D]: key = value
        if not len(k):
            continue   # nothing to attend: a zero row (with a sink the numerator is empty too)
        logits = scale * (qv[t] @ k.T)                       # [NH, n]
        m = logits.max(axis=-1)
        if sink is not None:
            m = np.maximum(m, sink)
        e = np.exp(logits - m[:, None])
        denom = e.sum(axis=-1)
        if sink is not None:
            denom = denom + np.exp(sink - m)                 # the sink joins the softmax with no value
        y[t] = (e @ k) / denom[:, None]
    write(out, y)
