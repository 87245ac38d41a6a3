"""Cases of the fused ops (ABI 1.6): mla_rope_cache_write, MLA's prologue (q's and k_pe's rope, the
latent's rmsnorm, the cache write) in one call, on the shapes and views the runtime passes it."""
from __future__ import annotations

import numpy as np

from .common import FLOATS, Case, OpCases, TSpec, _shape_str, ints, np_dtype, out, plain
from .rope import YARN


# ====================================================================== builders


def mla_rope_cache_write(seed, T, H, Dn, Dr, Dc, NB, BS, dtype, cache_dtype=None, interleaved=1, yarn=False,
                         kv_out="none", row_pad=0, max_pos=1024) -> Case:
    """kv_out: "none" (absent: decode), "separate" (its own buffer) or "alias" (kv itself: prefill).
    row_pad > 0: q is [T, H, Dq] inside rows of H * Dq + row_pad (the runtime's x_proj view).
    Slots mix valid ones with -1 and out-of-range ones (NB * BS and beyond), which write nothing."""
    rng = np.random.default_rng(seed)
    cache_dtype = cache_dtype or dtype
    W = Dc + Dr
    q = plain(rng, (T, H, Dn + Dr), dtype)
    q.out, q.row_pad = True, row_pad
    # a weight around 1, as trained norm weights are, so the normed latent keeps unit scale
    weight = TSpec(dtype, (Dc,), (1.0 + 0.2 * rng.standard_normal(Dc)).astype(np.float32).astype(np_dtype(dtype)))
    pos = rng.integers(0, max_pos, T)
    if T:
        pos[0] = 0
    slots = rng.permutation(NB * BS)[:T].astype(np.int64)
    if T > 1:
        slots[int(rng.integers(0, T))] = -1
    if T > 2:
        slots[int(rng.integers(0, T))] = NB * BS + int(rng.integers(0, 2)) * (2**30)
    cache = plain(rng, (NB, BS, W), cache_dtype)
    cache.out = True
    t = {"q": q, "kv": plain(rng, (T, W), dtype), "norm_weight": weight, "positions": ints(pos),
         "slots": ints(slots), "cache": cache}
    check = ["q", "cache"]
    if kv_out != "none":
        t["kv_out"] = out((T, W), dtype, alias="kv" if kv_out == "alias" else None)
        check.append("kv_out")
    scal = dict(eps=1e-6, interleaved=interleaved, scaling=0, theta=10000.0, factor=1.0, original_max_position=0,
                beta_fast=0.0, beta_slow=0.0, attn_factor=1.0)
    if yarn:
        scal.update(YARN, attn_factor=1.1)
    fmt = dtype if cache_dtype == dtype else f"{dtype}->{cache_dtype}"
    name = (f"mla_rope_cache_write {fmt} {_shape_str(T=T, H=H, Dn=Dn, Dr=Dr, Dc=Dc, NB=NB, BS=BS)} "
            f"{'interleaved' if interleaved else 'half'}{' yarn' if yarn else ''} kv_out={kv_out}"
            f"{f' q_row_pad={row_pad}' if row_pad else ''}")
    return Case("mla_rope_cache_write", name, fmt, t, scal, check=check, tol_key=dtype,
                tol_keys={"cache": cache_dtype}, seed=seed)


# ====================================================================== generators


def gen_mla_rope_cache_write(p, s):
    for dt in FLOATS:
        yield mla_rope_cache_write(s(), 0, 2, 4, 4, 8, 2, 4, dt)
        yield mla_rope_cache_write(s(), 1, 2, 4, 4, 8, 2, 4, dt)                       # one decode token
        yield mla_rope_cache_write(s(), 5, 3, 8, 8, 16, 3, 4, dt, yarn=True)
        yield mla_rope_cache_write(s(), 5, 3, 8, 8, 16, 3, 4, dt, interleaved=0, kv_out="separate")
        yield mla_rope_cache_write(s(), 6, 2, 8, 4, 12, 2, 4, dt, yarn=True, kv_out="alias")
        # q inside the rows of a fused projection whose kv_a columns follow (x_proj), and Dn = 0
        yield mla_rope_cache_write(s(), 4, 2, 6, 8, 16, 2, 4, dt, interleaved=0, yarn=True, row_pad=24)
        yield mla_rope_cache_write(s(), 3, 1, 0, 2, 6, 1, 4, dt, kv_out="separate")
        for _ in range(p.random_draws):
            r = s.rng
            T, BS = int(r.integers(1, 9)), int(r.integers(1, 5))
            yield mla_rope_cache_write(s(), T, int(r.integers(1, 4)), int(r.integers(0, 9)), 2 * int(r.integers(1, 9)),
                                       int(r.integers(1, 40)), (T + BS - 1) // BS + 1, BS, dt,
                                       interleaved=int(r.integers(0, 2)), yarn=bool(r.integers(0, 2)),
                                       kv_out=("none", "separate", "alias")[int(r.integers(0, 3))],
                                       row_pad=int(r.integers(0, 2)) * 7)
    # an f32 model's rows into a bf16 cache: the cache rounded once, kv_out kept in f32
    yield mla_rope_cache_write(s(), 5, 2, 8, 8, 16, 3, 4, "f32", cache_dtype="bf16", yarn=True, kv_out="separate")


# ====================================================================== large cases


def large_mla_rope_cache_write(s):
    # DeepSeek V3's MLA: 16 heads of 128 + 64, latent 512, YaRN; a prefill chunk and a decode batch
    yield mla_rope_cache_write(s(), 33, 16, 128, 64, 512, 4, 16, "bf16", yarn=True, kv_out="alias", row_pad=576)
    yield mla_rope_cache_write(s(), 8, 16, 128, 64, 512, 4, 16, "f32", yarn=True, max_pos=8192)


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "mla_rope_cache_write": OpCases(gen_mla_rope_cache_write, lambda: mla_rope_cache_write(1, 3, 2, 4, 4, 8, 2, 4, "f32"),
                                    large_mla_rope_cache_write),
}
