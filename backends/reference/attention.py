"""MLA attention: mla_cache_write, mla_prefill, mla_decode (abi/README.md section 8).

Scores, softmax and both matrix products are float64; each output is rounded once.
"""
from __future__ import annotations

import numpy as np

from .common import cast, check_arg, check_dim, f32, read, read_index, softmax, write


def mla_cache_write(latent=None, k_pe=None, slots=None, cache=None) -> None:
    """cache[slot // BS, slot % BS] = concat(latent[t], k_pe[t]) for every slot = slots[t] >= 0."""
    op = "mla_cache_write"
    check_arg(op, "latent", latent)
    check_arg(op, "k_pe", k_pe)
    check_arg(op, "slots", slots)
    check_arg(op, "cache", cache)
    (T, Dc), Dr = latent.shape, k_pe.shape[1]
    NB, BS, W = cache.shape
    check_dim(op, "k_pe.shape[0]", k_pe.shape[0], T, "latent.shape[0]")
    check_dim(op, "slots.shape[0]", slots.shape[0], T, "latent.shape[0]")
    check_dim(op, "cache.shape[2]", W, Dc + Dr, "latent.shape[1] + k_pe.shape[1]")
    slot = read_index(slots)
    bad = slot >= NB * BS
    if bad.any():
        t = int(np.argmax(bad))
        raise ValueError(f"{op}: slots[{t}]={slot[t]} >= NB*BS={NB * BS}")
    rows = np.concatenate([read(latent), read(k_pe)], axis=-1)
    c = cache.numpy()   # a writable view: only the addressed rows change
    for t in np.flatnonzero(slot >= 0):
        c[slot[t] // BS, slot[t] % BS, :] = cast(rows[t], cache.dtype)


def mla_prefill(q=None, kv=None, k_pe=None, cu_seqlens=None, out=None, scale=None) -> None:
    """Causal attention within each packed sequence, keys and values un-absorbed."""
    op = "mla_prefill"
    check_arg(op, "q", q)
    check_arg(op, "kv", kv)
    check_arg(op, "k_pe", k_pe)
    check_arg(op, "cu_seqlens", cu_seqlens)
    check_arg(op, "out", out)
    scale = f32(scale, op, "scale")
    T, H, Dq = q.shape
    Dv = out.shape[2]
    Dn = kv.shape[2] - Dv
    Dr = k_pe.shape[1]
    check_dim(op, "kv.shape[0]", kv.shape[0], T, "q.shape[0]")
    check_dim(op, "kv.shape[1]", kv.shape[1], H, "q.shape[1]")
    check_dim(op, "k_pe.shape[0]", k_pe.shape[0], T, "q.shape[0]")
    check_dim(op, "out.shape[0]", out.shape[0], T, "q.shape[0]")
    check_dim(op, "out.shape[1]", out.shape[1], H, "q.shape[1]")
    if Dn < 0:
        raise ValueError(f"{op}: kv.shape[2]={kv.shape[2]} < out.shape[2]={Dv}")
    check_dim(op, "q.shape[2]", Dq, Dn + Dr, "Dn + k_pe.shape[1] (Dn = kv.shape[2] - out.shape[2])")
    cu = read_index(cu_seqlens)
    if len(cu) < 1 or cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
        raise ValueError(f"{op}: cu_seqlens={cu.tolist()} must rise from 0 to T={T}")

    qv, kvv, kpe = read(q), read(kv), read(k_pe)
    y = np.zeros((T, H, Dv))
    for start, end in zip(cu[:-1], cu[1:]):
        if end == start:
            continue
        qs, ks, vs, ps = qv[start:end], kvv[start:end, :, :Dn], kvv[start:end, :, Dn:], kpe[start:end]
        # score[h, i, j] = scale * (q_nope . k_nope + q_pe . k_pe)
        score = np.einsum("ihd,jhd->hij", qs[..., :Dn], ks) + np.einsum("ihd,jd->hij", qs[..., Dn:], ps)
        score *= scale
        n = end - start
        score[:, ~np.tri(n, dtype=bool)] = -np.inf   # j > i is the future
        y[start:end] = np.einsum("hij,jhd->ihd", softmax(score), vs)
    write(out, y)


def mla_decode(q=None, wkv_b=None, cache=None, block_table=None, token_seq=None, kv_len=None, out=None,
               scale=None, indices=None) -> None:
    """Attention of each query token over its sequence's paged latent cache, kv_b_proj absorbed; with
    indices (1.3, V3.2's sparse attention) only over the listed positions below kv_len[t]."""
    op = "mla_decode"
    check_arg(op, "q", q)
    check_arg(op, "wkv_b", wkv_b)
    check_arg(op, "cache", cache)
    check_arg(op, "block_table", block_table)
    check_arg(op, "token_seq", token_seq)
    check_arg(op, "kv_len", kv_len)
    check_arg(op, "out", out)
    scale = f32(scale, op, "scale")
    T, H, Dq = q.shape
    NB, BS, W = cache.shape
    S, MB = block_table.shape
    Dv = out.shape[2]
    Dc = wkv_b.shape[1]
    Dr = W - Dc
    Dn = Dq - Dr
    check_dim(op, "out.shape[0]", out.shape[0], T, "q.shape[0]")
    check_dim(op, "out.shape[1]", out.shape[1], H, "q.shape[1]")
    check_dim(op, "token_seq.shape[0]", token_seq.shape[0], T, "q.shape[0]")
    check_dim(op, "kv_len.shape[0]", kv_len.shape[0], T, "q.shape[0]")
    if Dr < 0 or Dn < 0:
        raise ValueError(f"{op}: cache.shape[2]={W}, wkv_b.shape[1]={Dc} and q.shape[2]={Dq} do not split into "
                         f"Dc + Dr and Dn + Dr")
    check_dim(op, "wkv_b.shape[0]", wkv_b.shape[0], H * (Dn + Dv), "H * (Dn + Dv)")
    if indices is not None:
        check_arg(op, "indices", indices)
        check_dim(op, "indices.shape[0]", indices.shape[0], T, "q.shape[0]")
    seq, length = read_index(token_seq), read_index(kv_len)
    table = read_index(block_table)
    for t in range(T):
        if not 0 <= seq[t] < S:
            raise ValueError(f"{op}: token_seq[{t}]={seq[t]} outside [0, {S})")
        if not 0 <= length[t] <= MB * BS:
            raise ValueError(f"{op}: kv_len[{t}]={length[t]} outside [0, MB*BS={MB * BS}]")
        used = table[seq[t], : -(-length[t] // BS)]
        if np.any((used < 0) | (used >= NB)):
            raise ValueError(f"{op}: block_table[{seq[t]}] holds a block outside [0, {NB}) for kv_len[{t}]={length[t]}")

    W_kv = read(wkv_b).reshape(H, Dn + Dv, Dc)
    W_uk, W_uv = W_kv[:, :Dn], W_kv[:, Dn:]      # [H, Dn, Dc], [H, Dv, Dc]
    qv, cv = read(q), read(cache)
    idx = read_index(indices) if indices is not None else None
    y = np.zeros((T, H, Dv))
    for t in range(T):
        n = length[t]
        if idx is None:
            p = np.arange(n)
        else:   # entries < 0 or >= kv_len are skipped, a position listed twice counts once
            p = np.unique(idx[t][(idx[t] >= 0) & (idx[t] < n)])
        if len(p) == 0:
            continue   # no keys: a zero row
        rows = cv[table[seq[t], p // BS], p % BS]          # [len(p), Dc + Dr]
        c, kpe = rows[:, :Dc], rows[:, Dc:]
        q_lat = np.einsum("hd,hdc->hc", qv[t, :, :Dn], W_uk)   # [H, Dc]
        score = scale * (q_lat @ c.T + qv[t, :, Dn:] @ kpe.T)   # [H, len(p)]
        o_lat = softmax(score) @ c                                # [H, Dc]
        y[t] = np.einsum("hvc,hc->hv", W_uv, o_lat)
    write(out, y)
