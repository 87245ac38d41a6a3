"""MLA attention ops against torch's scaled_dot_product_attention on the un-absorbed form."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor

ref = ReferenceBackend()


def T_(a, dtype=np.float32):
    return Tensor.from_numpy(np.asarray(a, dtype=dtype))


def i32(a):
    return Tensor.from_numpy(np.asarray(a, dtype=np.int32))


# ---------------------------------------------------------------------------- mla_cache_write


def test_cache_write_slots_and_skips():
    NB, BS, Dc, Dr = 3, 4, 5, 2
    cache = Tensor.empty((NB, BS, Dc + Dr), "bf16", fill=-7.0)
    latent = np.arange(3 * Dc, dtype=np.float32).reshape(3, Dc) + 0.001   # rounds in bf16
    k_pe = -np.arange(3 * Dr, dtype=np.float32).reshape(3, Dr)
    ref.mla_cache_write(latent=T_(latent), k_pe=T_(k_pe), slots=i32([9, -1, 0]), cache=cache)
    c = cache.numpy().astype(np.float32)
    want0 = np.concatenate([latent[0], k_pe[0]]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(c[2, 1], want0)          # slot 9 = block 2, row 1
    np.testing.assert_array_equal(c[0, 0], np.concatenate([latent[2], k_pe[2]]).astype(ml_dtypes.bfloat16))
    written = np.zeros((NB, BS), bool)
    written[2, 1] = written[0, 0] = True
    assert (c[~written] == -7.0).all()                     # slot -1 wrote nothing


def test_cache_write_rejects_out_of_range_slot():
    cache = Tensor.empty((2, 4, 3), "f32", fill=0.0)
    with pytest.raises(ValueError, match=r"mla_cache_write: slots\[1\]=8 >= NB\*BS=8"):
        ref.mla_cache_write(latent=T_(np.ones((2, 2))), k_pe=T_(np.ones((2, 1))), slots=i32([0, 8]), cache=cache)
    assert (cache.numpy() == 0).all()
    with pytest.raises(ValueError, match=r"cache.shape\[2\]=3 != latent.shape\[1\] \+ k_pe.shape\[1\]=4"):
        ref.mla_cache_write(latent=T_(np.ones((2, 2))), k_pe=T_(np.ones((2, 2))), slots=i32([0, 1]), cache=cache)


# ---------------------------------------------------------------------------- mla_prefill


def torch_prefill(q, kv, k_pe, cu, scale, Dv):
    T, H, _ = q.shape
    Dn = kv.shape[-1] - Dv
    k = torch.cat([kv[..., :Dn], k_pe[:, None, :].expand(T, H, -1)], dim=-1)
    v = kv[..., Dn:]
    out = torch.zeros(T, H, Dv, dtype=torch.float64)
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                               v[s:e].transpose(0, 1), is_causal=True, scale=scale)
            out[s:e] = o.transpose(0, 1)
    return out


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(0, 7), min_size=1, max_size=4), H=st.integers(1, 3), Dn=st.integers(1, 8),
       Dr=st.integers(1, 4), Dv=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_prefill_matches_sdpa(lens, H, Dn, Dr, Dv, seed):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    q = rng.standard_normal((T, H, Dn + Dr))
    kv = rng.standard_normal((T, H, Dn + Dv))
    k_pe = rng.standard_normal((T, Dr))
    scale = float(np.float32((Dn + Dr) ** -0.5 * 1.3))
    out = Tensor.empty((T, H, Dv), "f32", fill=np.nan)
    ref.mla_prefill(q=T_(q), kv=T_(kv), k_pe=T_(k_pe), cu_seqlens=i32(cu), out=out, scale=scale)
    as64 = lambda a: torch.from_numpy(a.astype(np.float32).astype(np.float64))  # noqa: E731
    want = torch_prefill(as64(q), as64(kv), as64(k_pe), cu.tolist(), scale, Dv)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_prefill_validation():
    q, kv, kpe = T_(np.ones((4, 2, 5))), T_(np.ones((4, 2, 7))), T_(np.ones((4, 2)))
    out = Tensor.empty((4, 2, 4), "f32")
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 3\] must rise from 0 to T=4"):
        ref.mla_prefill(q=q, kv=kv, k_pe=kpe, cu_seqlens=i32([0, 3]), out=out, scale=1.0)
    with pytest.raises(ValueError, match=r"mla_prefill: q.shape\[2\]=5 != Dn \+ k_pe.shape\[1\]"):
        ref.mla_prefill(q=q, kv=kv, k_pe=kpe, cu_seqlens=i32([0, 4]), out=Tensor.empty((4, 2, 3), "f32"), scale=1.0)


# ---------------------------------------------------------------------------- mla_decode


def torch_decode_unabsorbed(q, wkv_b, cache, table, seq, kv_len, scale, Dv):
    """Per token: rebuild k and v from the latent cache with kv_b_proj (the un-absorbed form), then SDPA."""
    T, H, _ = q.shape
    BS = cache.shape[1]
    Dc = wkv_b.shape[1]
    Dr = cache.shape[2] - Dc
    Dn = q.shape[2] - Dr
    W = wkv_b.view(H, Dn + Dv, Dc)
    out = torch.zeros(T, H, Dv, dtype=torch.float64)
    for t in range(T):
        n = int(kv_len[t])
        if n == 0:
            continue
        rows = torch.stack([cache[table[seq[t], p // BS], p % BS] for p in range(n)])   # [n, Dc + Dr]
        latent, kpe = rows[:, :Dc], rows[:, Dc:]
        k_nope = torch.einsum("nc,hdc->hnd", latent, W[:, :Dn])                      # [H, n, Dn]
        v = torch.einsum("nc,hdc->hnd", latent, W[:, Dn:])                           # [H, n, Dv]
        k = torch.cat([k_nope, kpe[None].expand(H, n, Dr)], dim=-1)
        o = F.scaled_dot_product_attention(q[t][:, None, :], k, v, scale=scale)      # [H, 1, Dv]
        out[t] = o[:, 0]
    return out


@pytest.mark.parametrize("cache_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_absorbed_matches_unabsorbed(cache_dtype, seed):
    rng = np.random.default_rng(seed)
    H, Dn, Dr, Dv, Dc = 3, 6, 4, 5, 16
    NB, BS, MB, S = 10, 4, 3, 3
    cache_np = rng.standard_normal((NB, BS, Dc + Dr)).astype(np.float32)
    table = rng.permutation(NB)[: S * MB].reshape(S, MB)            # scattered blocks
    # decode, speculative verification (seq 1 three times, growing), an empty one, a full one
    seq = np.array([0, 1, 1, 1, 2, 2])
    kv_len = np.array([5, 7, 8, 9, 0, MB * BS])
    T = len(seq)
    q = rng.standard_normal((T, H, Dn + Dr)).astype(np.float32)
    wkv_b = (rng.standard_normal((H * (Dn + Dv), Dc)) / 4).astype(np.float32)
    cache = Tensor.from_numpy(cache_np.astype(ml_dtypes.bfloat16) if cache_dtype == "bf16" else cache_np)
    scale = float(np.float32(0.3))
    out = Tensor.empty((T, H, Dv), "f32", fill=np.nan)
    ref.mla_decode(q=T_(q), wkv_b=T_(wkv_b), cache=cache, block_table=i32(table), token_seq=i32(seq),
                   kv_len=i32(kv_len), out=out, scale=scale)
    as64 = lambda a: torch.from_numpy(np.asarray(a).astype(np.float64))  # noqa: E731
    want = torch_decode_unabsorbed(as64(q), as64(wkv_b), as64(cache.numpy().astype(np.float32)), table, seq, kv_len,
                                   scale, Dv)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert (out.numpy()[4] == 0).all()


def test_decode_validation():
    q, w = T_(np.ones((1, 2, 6))), T_(np.ones((2 * (4 + 3), 8)))
    cache = T_(np.ones((2, 4, 10)))
    out = Tensor.empty((1, 2, 3), "f32")
    args = dict(q=q, wkv_b=w, cache=cache, out=out, scale=1.0)
    with pytest.raises(ValueError, match=r"kv_len\[0\]=9 outside \[0, MB\*BS=8\]"):
        ref.mla_decode(block_table=i32([[0, 1]]), token_seq=i32([0]), kv_len=i32([9]), **args)
    with pytest.raises(ValueError, match=r"token_seq\[0\]=1 outside \[0, 1\)"):
        ref.mla_decode(block_table=i32([[0, 1]]), token_seq=i32([1]), kv_len=i32([3]), **args)
    with pytest.raises(ValueError, match=r"block_table\[0\] holds a block outside \[0, 2\)"):
        ref.mla_decode(block_table=i32([[0, 5]]), token_seq=i32([0]), kv_len=i32([5]), **args)
    with pytest.raises(ValueError, match=r"wkv_b.shape\[0\]=14 != H \* \(Dn \+ Dv\)=12"):
        ref.mla_decode(q=T_(np.ones((1, 2, 5))), wkv_b=w, cache=cache, out=out, scale=1.0,
                       block_table=i32([[0, 1]]), token_seq=i32([0]), kv_len=i32([3]))
    # kv_len only reaches block 0, so a garbage entry in column 1 is never read and is fine
    ref.mla_decode(block_table=i32([[0, -1]]), token_seq=i32([0]), kv_len=i32([4]), **args)
