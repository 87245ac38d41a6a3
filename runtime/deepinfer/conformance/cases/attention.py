"""Cases of MLA attention: mla_cache_write, mla_prefill and mla_decode (with V3.2's sparse indices, 1.3)."""
from __future__ import annotations

import math

import numpy as np

from .common import FLOATS, Case, OpCases, _shape_str, _sparse_indices, ints, out, plain


# ====================================================================== builders


def mla_cache_write(seed, T, Dc, Dr, NB, BS, dtype, cache_dtype=None, view=True) -> Case:
    rng = np.random.default_rng(seed)
    cache_dtype = cache_dtype or dtype
    slots = rng.permutation(NB * BS)[:T].astype(np.int64)
    if T > 1:
        slots[rng.integers(0, T)] = -1
    cache = plain(rng, (NB, BS, Dc + Dr), cache_dtype)
    cache.out = True
    t = {"latent": plain(rng, (T, Dc), dtype, pad=(0, Dr) if view else (0, 0)),
         "k_pe": plain(rng, (T, Dr), dtype, pad=(Dc, 0) if view else (0, 0)),
         "slots": ints(slots[:T]), "cache": cache}
    return Case("mla_cache_write", f"mla_cache_write {dtype}->{cache_dtype} {_shape_str(T=T, Dc=Dc, Dr=Dr, NB=NB, BS=BS)}",
                f"{dtype}->{cache_dtype}", t, check=["cache"], tol_key="exact", compare="exact", seed=seed)


def mla_prefill(seed, seqlens, H, Dn, Dr, Dv, dtype) -> Case:
    rng = np.random.default_rng(seed)
    T = int(sum(seqlens))
    cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    t = {"q": plain(rng, (T, H, Dn + Dr), dtype), "kv": plain(rng, (T, H, Dn + Dv), dtype),
         "k_pe": plain(rng, (T, Dr), dtype), "cu_seqlens": ints(cu), "out": out((T, H, Dv), dtype)}
    return Case("mla_prefill", f"mla_prefill {dtype} seqlens={list(seqlens)} {_shape_str(H=H, Dn=Dn, Dr=Dr, Dv=Dv)}",
                dtype, t, {"scale": 1.0 / math.sqrt(Dn + Dr)}, tol_key=dtype, seed=seed)


def mla_decode(seed, T, S, H, Dn, Dr, Dv, Dc, NB, BS, MB, dtype, zero_len=True, indices=0) -> Case:
    """indices=K > 0: V3.2's sparse form (1.3), K positions per token, with -1, out-of-range and repeated
    entries mixed in and one row whose entries are all invalid (a zero row)."""
    rng = np.random.default_rng(seed)
    table = rng.permutation(NB)[: S * MB] if NB >= S * MB else rng.integers(0, NB, S * MB)
    table = table.reshape(S, MB)
    token_seq = rng.integers(0, S, T)
    kv_len = rng.integers(1, MB * BS + 1, T)
    if zero_len and T > 1:
        kv_len[-1] = 0
    t = {"q": plain(rng, (T, H, Dn + Dr), dtype),
         "wkv_b": plain(rng, (H * (Dn + Dv), Dc), dtype, scale=1 / math.sqrt(Dc)),
         "cache": plain(rng, (NB, BS, Dc + Dr), dtype),
         "block_table": ints(table), "token_seq": ints(token_seq), "kv_len": ints(kv_len),
         "out": out((T, H, Dv), dtype)}
    if indices:
        t["indices"] = ints(_sparse_indices(rng, kv_len, indices))
    name = f"mla_decode {dtype} {_shape_str(T=T, S=S, H=H, Dn=Dn, Dr=Dr, Dv=Dv, Dc=Dc, BS=BS, MB=MB)}" + \
        (f" indices K={indices}" if indices else "")
    return Case("mla_decode", name, f"{dtype}+indices" if indices else dtype, t, {"scale": 1.0 / math.sqrt(Dn + Dr)},
                tol_key=dtype, seed=seed)


# ====================================================================== generators


def gen_mla_cache_write(p, s):
    for dt in FLOATS:
        yield mla_cache_write(s(), 0, 16, 8, 2, 4, dt)
        yield mla_cache_write(s(), 6, 16, 8, 3, 4, dt)
        yield mla_cache_write(s(), 5, 12, 4, 2, 3, dt, view=False)
    yield mla_cache_write(s(), 5, 16, 8, 3, 4, "f32", cache_dtype="bf16")


def gen_mla_prefill(p, s):
    for dt in FLOATS:
        yield mla_prefill(s(), [0], 2, 8, 4, 8, dt)
        yield mla_prefill(s(), [3, 0, 5], 2, 8, 4, 8, dt)
        yield mla_prefill(s(), [1], 1, 4, 2, 6, dt)
        # DeepSeek's head shape (libraries' tensor-core path): sequences straddling 64-token tiles
        yield mla_prefill(s(), [70, 1, 33, 130], 2, 128, 64, 128, dt)
        for _ in range(p.random_draws):
            r = s.rng
            yield mla_prefill(s(), list(r.integers(0, 9, int(r.integers(1, 4)))), int(r.integers(1, 4)),
                              int(r.integers(1, 17)), 2 * int(r.integers(1, 5)), int(r.integers(1, 17)), dt)


def gen_mla_decode(p, s):
    for dt in FLOATS:
        yield mla_decode(s(), 0, 1, 2, 8, 4, 8, 16, 4, 4, 2, dt)
        yield mla_decode(s(), 5, 2, 2, 8, 4, 8, 16, 8, 4, 3, dt)
        yield mla_decode(s(), 3, 1, 3, 4, 2, 6, 12, 5, 5, 4, dt)
        # DeepSeek's latent shape: more tokens than one 16-token tile, contexts over many chunks
        yield mla_decode(s(), 20, 3, 3, 128, 64, 128, 512, 64, 16, 20, dt)
        # 1.3: V3.2's sparse attention over listed positions (-1, out of range and repeats among them)
        yield mla_decode(s(), 6, 2, 2, 8, 4, 8, 16, 8, 4, 3, dt, indices=5)
        yield mla_decode(s(), 5, 2, 2, 8, 4, 8, 16, 12, 4, 5, dt, indices=32)   # K > kv_len: every position once
        yield mla_decode(s(), 12, 3, 3, 128, 64, 128, 512, 64, 16, 20, dt, indices=64)
        for _ in range(p.random_draws):
            r = s.rng
            S = int(r.integers(1, 4))
            MB = int(r.integers(1, 4))
            yield mla_decode(s(), int(r.integers(1, 8)), S, int(r.integers(1, 4)), int(r.integers(1, 12)),
                             2 * int(r.integers(1, 5)), int(r.integers(1, 12)), int(r.integers(4, 33)),
                             S * MB + 1, int(r.integers(1, 6)), MB, dt)


# ====================================================================== large cases


def large_mla_prefill(s):
    yield mla_prefill(s(), [70, 1, 33], 4, 16, 8, 16, "f32")


def large_mla_decode(s):
    yield mla_decode(s(), 8, 2, 4, 16, 8, 16, 64, 20, 16, 8, "f32")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "mla_cache_write": OpCases(gen_mla_cache_write, lambda: mla_cache_write(1, 2, 8, 4, 2, 2, "f32", view=False)),
    "mla_prefill": OpCases(gen_mla_prefill, lambda: mla_prefill(1, [2], 1, 4, 2, 4, "f32"), large_mla_prefill),
    "mla_decode": OpCases(gen_mla_decode, lambda: mla_decode(1, 2, 1, 1, 4, 2, 4, 8, 2, 2, 2, "f32", zero_len=False),
                          large_mla_decode,
                          # 1.3's appended fields
                          full=lambda: mla_decode(1, 3, 1, 1, 4, 2, 4, 8, 2, 2, 2, "f32", zero_len=False, indices=3)),
}
