"""Fused ops (ABI 1.6, abi/README.md section 8): each one is literally the composition of the unfused
ops it stands for, so the oracle's output is theirs bit for bit and a library's fused kernel is judged
against exactly what the runtime computes without it.
"""
from __future__ import annotations

import numpy as np

from deepinfer.tensor import Tensor

from .attention import mla_cache_write
from .common import check_arg, check_dim, check_shape, f32, read_index
from .norm import rmsnorm
from .rope import rope


def _as_op(op: str, call, **kwargs) -> None:
    """Runs an unfused op, its argument errors named after the fused op that passed them on."""
    try:
        call(**kwargs)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{op} ({e})") from None


def mla_rope_cache_write(q=None, kv=None, norm_weight=None, positions=None, slots=None, cache=None, kv_out=None,
                         eps=None, interleaved=None, scaling=None, theta=None, factor=None,
                         original_max_position=None, beta_fast=None, beta_slow=None, attn_factor=None) -> None:
    """rope(q[..., Dq-Dr:]) in place; latent = rmsnorm(kv[:, :Dc]) * norm_weight; k_pe = rope(kv[:, Dc:]);
    cache[slot // BS, slot % BS] = [latent, k_pe] for slots in [0, NB*BS); kv_out = [latent, k_pe]."""
    op = "mla_rope_cache_write"
    for name, t in (("q", q), ("kv", kv), ("norm_weight", norm_weight), ("positions", positions),
                    ("slots", slots), ("cache", cache), ("kv_out", kv_out)):
        check_arg(op, name, t)
    T, H, Dq = q.shape
    W, Dc = kv.shape[1], norm_weight.shape[0]
    Dr = W - Dc
    NB, BS, CW = cache.shape
    check_dim(op, "kv.shape[0]", kv.shape[0], T, "q.shape[0]")
    check_dim(op, "positions.shape[0]", positions.shape[0], T, "q.shape[0]")
    check_dim(op, "slots.shape[0]", slots.shape[0], T, "q.shape[0]")
    check_dim(op, "cache.shape[2]", CW, W, "kv.shape[1]")
    if kv_out is not None:
        check_shape(op, "kv_out", kv_out, (T, W))
    if Dr < 0 or Dr % 2:
        raise ValueError(f"{op}: Dr = kv.shape[1] - norm_weight.shape[0] = {Dr} must be even and >= 0")
    if Dq < Dr:
        raise ValueError(f"{op}: q.shape[2]={Dq} < Dr={Dr}")
    f32(eps, op, "eps")
    rot = dict(interleaved=interleaved, scaling=scaling, theta=theta, factor=factor,
               original_max_position=original_max_position, beta_fast=beta_fast, beta_slow=beta_slow,
               attn_factor=attn_factor)
    latent_in, kpe_in = kv.narrow(1, 0, Dc), kv.narrow(1, Dc, Dr)

    # the cache rows first (kv_out may alias kv), each part written by its op in the cache's dtype,
    # which is then the one rounding mla_cache_write's copy leaves them with
    # (a NumPy scratch like every reference op's, not a Tensor.empty: a decode step allocates no tensor)
    rows = Tensor(np.empty((T, W), cache.dtype.np), (T, W), cache.dtype)
    _as_op(op, rmsnorm, x=latent_in, weight=norm_weight, out=rows.narrow(1, 0, Dc), eps=eps)
    _as_op(op, rope, x=kpe_in, positions=positions, out=rows.narrow(1, Dc, Dr), **rot)
    if kv_out is not None:
        # rmsnorm reads only kv[:, :Dc] and rope only kv[:, Dc:]: in place on kv is safe part by part
        _as_op(op, rmsnorm, x=latent_in, weight=norm_weight, out=kv_out.narrow(1, 0, Dc), eps=eps)
        _as_op(op, rope, x=kpe_in, positions=positions, out=kv_out.narrow(1, Dc, Dr), **rot)
    q_pe = q.narrow(2, Dq - Dr, Dr)
    _as_op(op, rope, x=q_pe, positions=positions, out=q_pe, **rot)
    # an out-of-range slot is skipped here (mla_cache_write would refuse it)
    slot = read_index(slots)
    slot = np.where((slot >= 0) & (slot < NB * BS), slot, -1).astype(np.int32)
    mla_cache_write(latent=rows.narrow(1, 0, Dc), k_pe=rows.narrow(1, Dc, Dr), slots=Tensor.from_numpy(slot),
                    cache=cache)
