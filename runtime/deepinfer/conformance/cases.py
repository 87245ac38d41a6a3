"""Test cases as data: for each op, a builder that turns explicit parameters (shapes, dtypes, format,
flags) into a Case, and a generator that draws those parameters (edge cases first, then seeded
random draws). The harness runs a Case on the library and on the reference and compares.

Everything here is host NumPy data; nothing touches a backend. Values are drawn fresh for every
case from the case's own seed, so a failure names a seed that reproduces it exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import ml_dtypes
import numpy as np

from .. import abi
from .. import dtypes as D

# ====================================================================== data model


@dataclass
class QSpec:
    block: tuple[int, int]
    scales: "TSpec"
    zeros: Optional["TSpec"] = None


@dataclass
class TSpec:
    """One tensor argument. values: logical elements (dtype's NumPy type, 4-bit types unpacked);
    None for an output, which the harness poisons. pad=(lo, hi): the tensor is a column slice of a
    buffer lo + C + hi wide (a strided view); alias: the name of another argument this one *is*."""

    dtype: str
    shape: tuple
    values: Optional[np.ndarray] = None
    quant: Optional[QSpec] = None
    out: bool = False
    pad: tuple[int, int] = (0, 0)
    alias: Optional[str] = None


TArg = Union[TSpec, list]   # a list of Optional[TSpec] for the expert arrays of moe_experts


@dataclass
class Case:
    op: str
    name: str                  # human-readable, includes the shapes
    fmt: str                   # the format label the certificate groups results by
    tensors: dict[str, TArg]
    scalars: dict = field(default_factory=dict)
    check: list = field(default_factory=lambda: ["out"])   # outputs compared ("out.scales": quantize)
    tol_key: str = "f32"
    tol_keys: dict = field(default_factory=dict)   # per-output overrides of tol_key (hc_pre's f32 post, comb)
    compare: str = "close"     # close | exact | router | sample | spec_verify | indexer
    expect: str = "OK"         # a status name for cases that must fail (FAILED_PRECONDITION, ...)
    seed: int = 0
    # 1.4: the op takes a communicator; the harness passes a one-rank one of the backend it runs on
    comm: bool = False
    # 1.4: outputs [N, C, ...] compared only on the rows below a counts output ([N], the reference's):
    # {"recv": "recv_counts"}; the rows past the counts are unspecified
    counted: dict = field(default_factory=dict)

    def kwargs_names(self) -> list[str]:
        return list(self.tensors) + list(self.scalars)


# ====================================================================== value helpers

QMAX = abi.QMAX   # DI_QMAX of deepinfer_abi.h


def np_dtype(name: str) -> np.dtype:
    return D.get(name).np


def randn(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def _random_codes(rng, shape, qdtype: str) -> np.ndarray:
    """Random elements of a quantized storage type covering its whole code space."""
    shape = tuple(shape)
    if qdtype == "int4":
        return rng.integers(-8, 8, shape).astype(ml_dtypes.int4)
    if qdtype == "uint4":
        return rng.integers(0, 16, shape).astype(ml_dtypes.uint4)
    if qdtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if qdtype == "e4m3":
        b = rng.integers(0, 256, shape).astype(np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C          # no NaNs among the weights
        return b.view(ml_dtypes.float8_e4m3fn)
    if qdtype == "e2m1":
        return rng.integers(0, 16, shape).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
    raise ValueError(qdtype)


def _random_scales(rng, shape, sdtype: str, qdtype: str) -> np.ndarray:
    shape = tuple(shape)
    if sdtype == "e8m0":
        return rng.integers(122, 130, shape).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    if sdtype == "e4m3":
        v = rng.uniform(0.05, 2.0, shape)
    else:
        # keeps dequantized weights around unit size whatever the code range
        mag = {"int4": 1 / 8, "uint4": 1 / 8, "int8": 1 / 64, "e4m3": 1 / 64, "e2m1": 1 / 4}[qdtype]
        v = rng.uniform(0.5, 1.5, shape) * mag
    return v.astype(np.float32).astype(np_dtype(sdtype))


def scale_shape(shape, block) -> tuple:
    br, bc = block
    if len(shape) == 1:
        return (math.ceil(shape[0] / (bc or shape[0])) if shape[0] else 0,)
    r, c = shape[-2], shape[-1]
    nr = math.ceil(r / (br or r)) if r else 0
    nc = math.ceil(c / (bc or c)) if c else 0
    return tuple(shape[:-2]) + (nr, nc)


@dataclass(frozen=True)
class Format:
    """A quantized storage format: q dtype, block, scale dtype, and zero points for asymmetric ones."""

    label: str
    qdtype: str
    block: tuple[int, int]
    sdtype: str
    zdtype: Optional[str] = None

    def random(self, rng, shape) -> TSpec:
        codes = _random_codes(rng, shape, self.qdtype)
        ss = scale_shape(shape, self.block)
        scales = TSpec(self.sdtype, ss, _random_scales(rng, ss, self.sdtype, self.qdtype))
        zeros = None
        if self.zdtype is not None:
            z = rng.uniform(4.0, 11.0, ss)
            z = np.round(z) if D.get(self.zdtype).is_float is False else z
            zeros = TSpec(self.zdtype, ss, z.astype(np.float32).astype(np_dtype(self.zdtype)))
        return TSpec(self.qdtype, tuple(shape), codes, QSpec(self.block, scales, zeros))

    def poisoned_output(self, shape) -> TSpec:
        ss = scale_shape(shape, self.block)
        return TSpec(self.qdtype, tuple(shape), None, QSpec(self.block, TSpec(self.sdtype, ss, None, out=True)),
                     out=True)


# every weight format of abi/README.md section 5, with the scale dtypes it lists
WEIGHT_FORMATS: dict[str, Format] = {f.label: f for f in [
    Format("int4/g32/sym/f32", "int4", (1, 32), "f32"),
    Format("int4/g64/sym/bf16", "int4", (1, 64), "bf16"),
    Format("int4/g128/sym/f16", "int4", (1, 128), "f16"),
    Format("uint4/g32/asym/f32", "uint4", (1, 32), "f32", "f32"),
    Format("uint4/g64/asym/bf16", "uint4", (1, 64), "bf16", "bf16"),
    Format("uint4/g128/asym/f16+u8", "uint4", (1, 128), "f16", "uint8"),
    Format("int8/channel/f32", "int8", (1, 0), "f32"),
    Format("e4m3/128x128/f32", "e4m3", (128, 128), "f32"),
    Format("e2m1/g16/e4m3", "e2m1", (1, 16), "e4m3"),
    Format("e2m1/g32/e8m0", "e2m1", (1, 32), "e8m0"),
]}
ACT_FORMATS: dict[str, Format] = {f.label: f for f in [
    Format("int8/token/f32", "int8", (1, 0), "f32"),
    Format("e4m3/1x128/f32", "e4m3", (1, 128), "f32"),
]}
# formats the quantize op writes (symmetric only)
QUANTIZE_FORMATS: dict[str, Format] = {f.label: f for f in [
    Format("int8/token/f32", "int8", (1, 0), "f32"),
    Format("int4/g32/f32", "int4", (1, 32), "f32"),
    Format("int4/g128/bf16", "int4", (1, 128), "bf16"),
    Format("e4m3/1x128/f32", "e4m3", (1, 128), "f32"),
    Format("e4m3/128x128/f32", "e4m3", (128, 128), "f32"),
    Format("e2m1/g16/e4m3", "e2m1", (1, 16), "e4m3"),
    Format("e2m1/g32/e8m0", "e2m1", (1, 32), "e8m0"),
]}


def plain(rng, shape, dtype, scale=1.0, pad=(0, 0)) -> TSpec:
    return TSpec(dtype, tuple(shape), randn(rng, shape, dtype, scale), pad=pad)


def out(shape, dtype, pad=(0, 0), alias=None) -> TSpec:
    return TSpec(dtype, tuple(shape), None, out=True, pad=pad, alias=alias)


def ints(values, dtype="int32") -> TSpec:
    a = np.asarray(values, dtype=np_dtype(dtype))
    return TSpec(dtype, a.shape, a)


def _shape_str(**dims) -> str:
    return " ".join(f"{k}={v}" for k, v in dims.items())


def _tol(op_out: str, quantized: bool) -> str:
    return ("q/" if quantized else "") + op_out


# ====================================================================== builders (one per op)


def embedding(seed, T, V, H, dtype, view=False) -> Case:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2, V + 3, T) if V else np.full(T, -1)
    pad = (1, 2) if view else (0, 0)
    return Case("embedding", f"embedding {dtype} {_shape_str(T=T, V=V, H=H)}{' view' if view else ''}", dtype,
                {"ids": ints(ids), "table": plain(rng, (V, H), dtype, pad=pad), "out": out((T, H), dtype, pad=pad)},
                tol_key="exact", compare="exact", seed=seed)


def rmsnorm(seed, T, H, dtype, variant="plain", view=False, eps=1e-6) -> Case:
    """variant: plain | residual | residual_out_alias_residual | residual_out_alias_x | out_alias_x"""
    rng = np.random.default_rng(seed)
    pad = (3, 1) if view else (0, 0)
    t = {"x": plain(rng, (T, H), dtype, pad=pad), "weight": plain(rng, (H,), dtype)}
    check = ["out"]
    if variant == "plain":
        t["out"] = out((T, H), dtype)
    elif variant == "out_alias_x":
        t["out"] = out((T, H), dtype, alias="x")
    else:
        t["residual"] = plain(rng, (T, H), dtype)
        t["out"] = out((T, H), dtype, pad=pad)
        if variant == "residual":
            t["residual_out"] = out((T, H), dtype)
        elif variant == "residual_out_alias_residual":
            t["residual_out"] = out((T, H), dtype, alias="residual")
        elif variant == "residual_out_alias_x":
            t["residual_out"] = out((T, H), dtype, alias="x")
        else:
            raise ValueError(variant)
        check.append("residual_out")
    return Case("rmsnorm", f"rmsnorm {dtype} {_shape_str(T=T, H=H)} {variant}{' view' if view else ''}", dtype, t,
                {"eps": eps}, check=check, tol_key=dtype, seed=seed)


def linear(seed, M, K, N, xfmt="f32", wfmt="f32", bias=False, out_dtype=None, view=False) -> Case:
    """xfmt: f32 | bf16 | an ACT_FORMATS label; wfmt: f32 | bf16 | a WEIGHT_FORMATS label."""
    rng = np.random.default_rng(seed)
    quantized = False
    if xfmt in ACT_FORMATS:
        x = ACT_FORMATS[xfmt].random(rng, (M, K))
        quantized = True
        out_dtype = out_dtype or "bf16"
    else:
        x = plain(rng, (M, K), xfmt, pad=(2, 5) if view else (0, 0))
        out_dtype = out_dtype or xfmt
    if wfmt in WEIGHT_FORMATS:
        w = WEIGHT_FORMATS[wfmt].random(rng, (N, K))
        quantized = True
    else:
        w = plain(rng, (N, K), wfmt, scale=1 / math.sqrt(max(K, 1)))
    t = {"x": x, "w": w}
    if bias:
        t["bias"] = plain(rng, (N,), out_dtype)
    t["out"] = out((M, N), out_dtype)
    name = f"linear x={xfmt} w={wfmt} out={out_dtype} {_shape_str(M=M, K=K, N=N)}{' bias' if bias else ''}" \
           f"{' view' if view else ''}"
    return Case("linear", name, f"x={xfmt} w={wfmt}", t, tol_key=_tol(out_dtype, quantized), seed=seed)


def quantize(seed, shape, xdtype, qfmt, scale_pow2=0, zero_row=False) -> Case:
    rng = np.random.default_rng(seed)
    f = QUANTIZE_FORMATS[qfmt]
    x = plain(rng, shape, xdtype, scale=3.0)
    # an e4m3-stored scale underflows to 0 below amax = qmax * 2^-9; such a block is a malformed
    # request (INVALID_ARGUMENT), so keep every value well above it
    v = np.asarray(x.values, np.float32)
    x.values = (np.sign(v) * (np.abs(v) + 0.1)).astype(np_dtype(xdtype))
    if zero_row and shape[-2] > 0:
        x.values[..., 0, :] = 0
    return Case("quantize", f"quantize {xdtype} -> {qfmt}{' pow2' if scale_pow2 else ''} shape={list(shape)}"
                f"{' zero-row' if zero_row else ''}", f"{qfmt}{' pow2' if scale_pow2 else ''}",
                {"x": x, "out": f.poisoned_output(shape)}, {"scale_pow2": scale_pow2},
                check=["out", "out.scales"], tol_key="exact", compare="exact", seed=seed)


def dequantize(seed, shape, fmt, out_dtype="f32", act=False) -> Case:
    rng = np.random.default_rng(seed)
    f = (ACT_FORMATS if act else WEIGHT_FORMATS)[fmt]
    return Case("dequantize", f"dequantize {fmt} -> {out_dtype} shape={list(shape)}", f"{fmt} -> {out_dtype}",
                {"x": f.random(rng, shape), "out": out(shape, out_dtype)}, tol_key="exact", compare="exact",
                seed=seed)


YARN = dict(scaling=1, factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)


def rope(seed, T, H, D, dtype, interleaved=1, yarn=False, alias=False, view=False, max_pos=1024,
         attn_factor=1.0) -> Case:
    rng = np.random.default_rng(seed)
    shape = (T, H, D) if H else (T, D)
    pad = (16, 0) if view else (0, 0)     # q_pe = q[..., Dn:], k_pe = kv_a[:, Dc:]
    x = plain(rng, shape, dtype, pad=pad)
    pos = rng.integers(0, max_pos, T)
    if T:
        pos[0] = 0
    scal = dict(interleaved=interleaved, scaling=0, theta=10000.0, factor=1.0, original_max_position=0,
                beta_fast=0.0, beta_slow=0.0, attn_factor=attn_factor)
    if yarn:
        scal.update(YARN)
    o = out(shape, dtype, alias="x") if alias else out(shape, dtype)
    name = f"rope {dtype} shape={list(shape)} {'interleaved' if interleaved else 'half'}{' yarn' if yarn else ''}" \
           f"{' in-place' if alias else ''}{' view' if view else ''}"
    return Case("rope", name, dtype, {"x": x, "positions": ints(pos), "out": o}, scal, tol_key=dtype, seed=seed)


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


def _sparse_indices(rng, visible, K: int) -> np.ndarray:
    """[T, K] int32 selections of positions (or entries) below visible[t]: mostly valid ones, plus -1,
    values at and far past visible[t] and repeats, which every consumer skips or counts once. The last
    row of several holds no valid entry at all (a zero row without a window or a sink)."""
    T = len(visible)
    idx = np.empty((T, K), np.int64)
    for t in range(T):
        n = int(visible[t])
        row = list(rng.permutation(n)[: K - K // 4])
        while len(row) < K:
            junk = [-1, n, n + 3, 10**6] + ([row[int(rng.integers(0, len(row)))]] if row else [])
            row.append(junk[int(rng.integers(0, len(junk)))])
        idx[t] = rng.permutation(np.asarray(row, np.int64))
    if T > 2:
        idx[-1] = rng.choice(np.array([-1, -5, int(visible[-1]), 2**31 - 1]), K)
    return idx.astype(np.int32)


ROUTER_CONFIGS = {
    # DeepSeek-V2-Lite: softmax, no groups, no normalisation
    "v2lite": dict(E=16, K=4, scoring=0, n_group=1, topk_group=1, group_score=0, norm_topk_prob=0,
                   routed_scaling_factor=1.0, bias=False),
    # DeepSeek-V2: softmax, group-limited by the group max
    "v2": dict(E=16, K=3, scoring=0, n_group=4, topk_group=2, group_score=0, norm_topk_prob=0,
               routed_scaling_factor=16.0, bias=False),
    # DeepSeek-V3: sigmoid, correction bias, top-2-sum group score, normalised, scaled
    "v3": dict(E=32, K=4, scoring=1, n_group=4, topk_group=2, group_score=1, norm_topk_prob=1,
               routed_scaling_factor=2.5, bias=True),
    # DeepSeek-V4 (1.3): sqrt(softplus) scores, correction bias, no groups, normalised, scaled
    "v4": dict(E=32, K=6, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
               routed_scaling_factor=1.5, bias=True),
    # the same with logits past softplus's threshold of 20 (softplus(v) = v there)
    "v4-large-logits": dict(E=16, K=4, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                            routed_scaling_factor=1.5, bias=True, logit_scale=15.0),
    # V4's first layers (1.3): hash routing, the experts of each token id from a table (the bias is given,
    # as the model has one, and must not be used)
    "v4-hash": dict(E=32, K=6, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                    routed_scaling_factor=1.5, bias=True, vocab=50),
    # hash routing with softmax scores and no normalisation
    "hash-softmax": dict(E=16, K=3, scoring=0, n_group=1, topk_group=1, group_score=0, norm_topk_prob=0,
                         routed_scaling_factor=1.0, bias=False, vocab=7),
}


def moe_router(seed, T, config="v3") -> Case:
    rng = np.random.default_rng(seed)
    c = dict(ROUTER_CONFIGS[config])
    E, K, has_bias = c.pop("E"), c.pop("K"), c.pop("bias")
    vocab, logit_scale = c.pop("vocab", 0), c.pop("logit_scale", 2.0)
    t = {"logits": plain(rng, (T, E), "f32", scale=logit_scale)}
    if has_bias:
        t["bias"] = plain(rng, (E,), "f32", scale=0.3)
    t["topk_ids"] = out((T, K), "int32")
    t["topk_weights"] = out((T, K), "f32")
    if vocab:   # every token id of the vocabulary maps to K distinct experts, in no particular order
        t["token_ids"] = ints(rng.integers(0, vocab, T))
        t["hash_table"] = ints(np.stack([rng.permutation(E)[:K] for _ in range(vocab)]))
    return Case("moe_router", f"moe_router {config} T={T} E={E} K={K}", config, t, c,
                check=["topk_ids", "topk_weights"], tol_key="f32", compare="router", seed=seed)


def moe_experts(seed, T, E, K, H, I, dtype, wfmt=None, routing="random", accumulate=0,
                absent=(), expect="OK", limit=0.0, mapped=None) -> Case:
    """routing: random | one (every token to expert 0) | skip (ids -1 and E mixed in);
    absent: experts whose weights are not resident (data NULL); limit > 0: V4's clipped SwiGLU (1.3).
    mapped (1.5): an expert cache's table, expert_map [M] with M = E + mapped model experts, and its
    misses output; see _expert_map for what routing means then."""
    rng = np.random.default_rng(seed)
    wfmt = wfmt or dtype
    quantized = wfmt in WEIGHT_FORMATS

    def weight(shape):
        if quantized:
            return WEIGHT_FORMATS[wfmt].random(rng, shape)
        return plain(rng, shape, wfmt, scale=1 / math.sqrt(shape[1]))

    resident = [e for e in range(E) if e not in absent]
    table = None
    if mapped is not None:
        table, ids = _expert_map(rng, T, E, K, E + mapped, absent, routing)
    elif routing == "one":
        ids = np.zeros((T, K), np.int64)
        ids[:, 1:] = -1
    else:
        # experts with no token at all are wanted: draw from half the resident experts
        pool = resident[: max(1, len(resident) // 2)] if routing != "all" else resident
        ids = np.stack([rng.choice(pool, K, replace=len(pool) < K) for _ in range(T)]) if T else np.zeros((0, K))
        if routing == "skip" and T:
            ids[rng.integers(0, T), rng.integers(0, K)] = -1
            ids[rng.integers(0, T), rng.integers(0, K)] = E
    if expect == "FAILED_PRECONDITION" and T:
        ids[0, 0] = absent[0]
    t = {"x": plain(rng, (T, H), dtype),
         "topk_ids": ints(ids.astype(np.int32)),
         "topk_weights": TSpec("f32", (T, K), rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)),
         "w_gate": [None if e in absent else weight((I, H)) for e in range(E)],
         "w_up": [None if e in absent else weight((I, H)) for e in range(E)],
         "w_down": [None if e in absent else weight((H, I)) for e in range(E)]}
    if accumulate:
        t["out"] = plain(rng, (T, H), dtype)
        t["out"].out = True
    else:
        t["out"] = out((T, H), dtype)
    check, tol_keys = ["out"], {}
    if table is not None:
        t["expert_map"] = ints(table)
        t["misses"] = out((T, K), "int32")
        check, tol_keys = ["out", "misses"], {"misses": "exact"}   # misses: integers, exactly the reference's
    name = f"moe_experts {dtype} w={wfmt} {_shape_str(T=T, E=E, K=K, H=H, I=I)} routing={routing}" \
           f"{' accumulate' if accumulate else ''}{' absent=' + str(list(absent)) if absent else ''}" \
           f"{f' swiglu_limit={limit:g}' if limit else ''}" \
           f"{f' expert_map M={E + mapped}' if table is not None else ''}"
    scal = {"num_experts": E, "accumulate": accumulate}
    if limit:   # only when set: a 1.2 library runs every other case
        scal["swiglu_limit"] = limit
    return Case("moe_experts", name, f"x={dtype} w={wfmt}" + (" limit" if limit else "") +
                (" map" if table is not None else ""), t, scal, check=check, tol_key=_tol(dtype, quantized),
                tol_keys=tol_keys, expect=expect, seed=seed)


def _expert_map(rng, T, E, K, M, absent, routing) -> tuple[np.ndarray, np.ndarray]:
    """(expert_map [M], topk_ids [T, K]) of an expert cache (1.5): model experts 0..M-1, E descriptors.

    The map permutes: each descriptor (resident or not) is named by one model expert, chosen at random
    (never the identity when E > 1, so a library that ignores the map is caught), and the M - E other
    entries are -1, E, 2^30, -5, -1, ... (not resident). routing "all": ids only of model experts whose
    descriptor is resident, so no pair misses. "random": ids of half of those (descriptors with no pair
    are wanted, and the others get many pairs each), then one pair (in a random place, as far as there
    are pairs) forced to an entry of each kind that misses: -1, >= E, a non-resident descriptor. "cold":
    ids drawn from all M model experts (most pairs miss), then the same. "skip": as random, and ids
    outside [0, M) (-1 and M), skipped but not flagged. "one": every token's k = 0 to the model expert
    of descriptor 0, the other k to -1."""
    table = np.full(M, -1, np.int64)
    owners = rng.permutation(M)[:E]                 # owners[d]: the model expert of descriptor d
    if E > 1 and np.all(owners == np.arange(E)):
        owners = np.roll(owners, 1)
    table[owners] = np.arange(E)
    spare = [i for i in range(M) if i not in set(owners.tolist())]
    for j, i in enumerate(spare):      # not resident: -1, E itself, far past E (never read), below -1
        table[i] = (-1, E, 1 << 30, -5)[j % 4]
    here = [int(owners[d]) for d in range(E) if d not in absent]
    if routing == "one":
        ids = np.full((T, K), -1, np.int64)
        ids[:, :1] = owners[0]
        return table.astype(np.int32), ids
    pool = list(range(M)) if routing == "cold" else here if routing == "all" else here[: max(1, len(here) // 2)]
    ids = rng.choice(pool, (T, K)) if pool and T * K else np.full((T, K), -1, np.int64)
    if routing != "all":
        kinds = [[i for i in spare if table[i] < 0], [i for i in spare if table[i] >= E],
                 [int(owners[d]) for d in absent]]
        forced = [int(rng.choice(k)) for k in kinds if k]
        if routing == "skip":
            forced += [-1, M]
        places = rng.permutation(T * K)[:len(forced)]
        ids.reshape(-1)[places] = forced[:len(places)]
    return table.astype(np.int32), ids


def binary(op, seed, shape, dtype, alias=None, view=False) -> Case:
    rng = np.random.default_rng(seed)
    pad = (2, 3) if view else (0, 0)
    t = {"a": plain(rng, shape, dtype, pad=pad), "b": plain(rng, shape, dtype),
         "out": out(shape, dtype, alias=alias, pad=(0, 0) if alias else pad)}
    return Case(op, f"{op} {dtype} shape={list(shape)}{' out=' + alias if alias else ''}{' view' if view else ''}",
                dtype, t, tol_key=dtype, seed=seed)


def silu_mul(seed, T, I, dtype, view=False, limit=0.0) -> Case:
    """limit > 0: V4's clipped SwiGLU (1.3); gate and up are drawn wide enough that many values clip."""
    rng = np.random.default_rng(seed)
    t = {"gate": plain(rng, (T, I), dtype, scale=3.0, pad=(0, I) if view else (0, 0)),
         "up": plain(rng, (T, I), dtype, scale=2.0 if limit else 1.0, pad=(I, 0) if view else (0, 0)),
         "out": out((T, I), dtype)}
    scal = {"limit": limit} if limit else {}
    return Case("silu_mul", f"silu_mul {dtype} {_shape_str(T=T, I=I)}{' view' if view else ''}"
                f"{f' limit={limit:g}' if limit else ''}", dtype + (" limit" if limit else ""), t, scal,
                tol_key=dtype, seed=seed)


def concat(seed, T, A, B, dtype, view=False) -> Case:
    rng = np.random.default_rng(seed)
    t = {"a": plain(rng, (T, A), dtype, pad=(0, 3) if view else (0, 0)),
         "b": plain(rng, (T, B), dtype, pad=(5, 0) if view else (0, 0)),
         "out": out((T, A + B), dtype, pad=(1, 1) if view else (0, 0))}
    return Case("concat", f"concat {dtype} {_shape_str(T=T, A=A, B=B)}{' view' if view else ''}", dtype, t,
                tol_key="exact", compare="exact", seed=seed)


def sample(seed, B, V, mode="mixed", ties=False, probs=False) -> Case:
    """mode: greedy (every temperature 0) | mixed (greedy and sampled rows, various top-k/top-p).
    probs: also pass the 1.2 output `probs` (its own format, so a 1.1 library reports it unsupported)."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    if ties and V > 3:
        for b in range(B):
            m = logits[b].max() + 1.0
            logits[b, rng.choice(V, 3, replace=False)] = m
    if mode == "greedy":
        temp = np.zeros(B, np.float32)
    else:
        temp = rng.choice(np.array([0.0, 0.6, 1.0, 1.5], np.float32), B)
    top_k = rng.choice(np.array([0, 0, 1, 5, 50], np.int32), B)
    top_p = rng.choice(np.array([1.0, 0.95, 0.5], np.float32), B)
    seeds = rng.integers(0, 2**64, B, dtype=np.uint64)
    t = {"logits": TSpec("f32", (B, V), logits), "temperature": TSpec("f32", (B,), temp),
         "top_k": ints(top_k), "top_p": TSpec("f32", (B,), top_p.astype(np.float32)),
         "seeds": TSpec("uint64", (B,), seeds), "out": out((B,), "int32")}
    if probs:
        t["probs"] = out((B,), "f32")
    return Case("sample", f"sample {mode}{' ties' if ties else ''}{' probs' if probs else ''} B={B} V={V}",
                f"{mode}+probs" if probs else mode, t, check=["out", "probs"] if probs else ["out"],
                tol_key="exact", compare="sample", seed=seed)


def spec_verify(seed, T, V, mode="mixed", draft="logits", ties=False) -> Case:
    """mode: greedy (every temperature 0) | mixed (greedy and sampled rows, various top-k/top-p).
    draft: logits (draft_logits given: the target's logits plus noise, drafts drawn from that q) |
    greedy (no draft_logits: q is one-hot at the draft). Rows mix bonus rows (draft -1), drafts drawn
    from q, the target's own argmax and arbitrary ids (a draft id >= V is L0's business: abi_checks)."""
    from ..reference.sampling import distribution   # the spec's q, to draw drafts that get accepted

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    if ties and V > 3:
        for r in range(T):
            logits[r, rng.choice(V, 3, replace=False)] = logits[r].max() + 1.0
    noise = rng.choice(np.array([0.0, 0.3, 1.0, 3.0]), (T, 1))   # how far the draft model is from the target
    dlogits = (logits + noise * rng.standard_normal((T, V))).astype(np.float32)
    temp = np.zeros(T, np.float32) if mode == "greedy" else rng.choice(np.array([0.0, 0.6, 1.0, 1.5], np.float32), T)
    top_k = rng.choice(np.array([0, 0, 1, 5, 50], np.int32), T)
    top_p = rng.choice(np.array([1.0, 0.95, 0.5], np.float32), T)
    ids = np.empty(T, np.int32)
    for r in range(T):
        kind = rng.choice(["bonus", "drawn", "argmax", "any"], p=[0.15, 0.5, 0.2, 0.15])
        src = dlogits[r] if draft == "logits" else logits[r]
        if kind == "bonus":
            ids[r] = -1
        elif kind == "argmax":
            ids[r] = int(np.argmax(src))
        elif kind == "drawn" and temp[r] > 0:
            q = distribution(src.astype(np.float64), float(temp[r]), int(top_k[r]), float(top_p[r]))
            ids[r] = int(rng.choice(V, p=q / q.sum()))
        else:
            ids[r] = int(rng.integers(0, V))
    seeds = rng.integers(0, 2**64, T, dtype=np.uint64)
    t = {"logits": TSpec("f32", (T, V), logits)}
    if draft == "logits":
        t["draft_logits"] = TSpec("f32", (T, V), dlogits)
    t.update({"draft_ids": ints(ids), "temperature": TSpec("f32", (T,), temp), "top_k": ints(top_k),
              "top_p": TSpec("f32", (T,), top_p.astype(np.float32)), "seeds": TSpec("uint64", (T,), seeds),
              "out": out((T,), "int32"), "accepted": out((T,), "int32")})
    name = f"spec_verify {mode} draft={draft}{' ties' if ties else ''} T={T} V={V}"
    return Case("spec_verify", name, f"{mode}/{draft}", t, check=["out", "accepted"], tol_key="exact",
                compare="spec_verify", seed=seed)


# ====================================================================== 1.3: DeepSeek V4 and V3.2


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


def hc_pre(seed, T, N, H, dtype, head=False, iters=20, view=False, hc_eps=1e-6) -> Case:
    """A block's hyper-connection (M = (2 + N) * N: pre, post, comb) or the head's (M = N: pre only).
    fn is scaled so that the mixes are O(1): the sigmoids and the softmax stay away from saturation.
    hc_eps: V4's 1e-6 is below f32 resolution in every term it enters; a larger one makes it count."""
    rng = np.random.default_rng(seed)
    M = N if head else (2 + N) * N
    t = {"x": plain(rng, (T, N, H), dtype, pad=(2, 3) if view else (0, 0)),
         "fn": plain(rng, (M, N * H), "f32", scale=1 / math.sqrt(N * H)),
         "base": plain(rng, (M,), "f32", scale=0.5),
         "scale": TSpec("f32", (1 if head else 3,), rng.uniform(0.5, 2.0, 1 if head else 3).astype(np.float32)),
         "out": out((T, H), dtype)}
    check = ["out"]
    if not head:
        t["post"] = out((T, N), "f32")
        t["comb"] = out((T, N, N), "f32")
        check += ["post", "comb"]
    # the head passes the model's Sinkhorn count too (the runtime fills it from the config); it is unused
    name = f"hc_pre {dtype} {_shape_str(T=T, N=N, H=H)} {'head' if head else f'block iters={iters}'}" \
           f"{' view' if view else ''}{f' hc_eps={hc_eps:g}' if hc_eps != 1e-6 else ''}"
    return Case("hc_pre", name, f"{dtype} {'head' if head else 'block'}", t,
                {"eps": 1e-6, "hc_eps": hc_eps, "sinkhorn_iters": iters}, check=check, tol_key=dtype,
                tol_keys={"post": "f32", "comb": "f32"}, seed=seed)


def hc_post(seed, T, N, H, dtype, ydtype=None, view=False) -> Case:
    rng = np.random.default_rng(seed)
    ydtype = ydtype or dtype
    comb = rng.uniform(0.0, 1.0, (T, N, N))
    comb = comb / comb.sum(axis=1, keepdims=True)      # roughly what Sinkhorn leaves (not symmetric)
    t = {"x": plain(rng, (T, N, H), dtype, pad=(1, 4) if view else (0, 0)),
         "y": plain(rng, (T, H), ydtype, pad=(3, 0) if view else (0, 0)),
         "post": TSpec("f32", (T, N), rng.uniform(0.0, 2.0, (T, N)).astype(np.float32)),
         "comb": TSpec("f32", (T, N, N), comb.astype(np.float32)),
         "out": out((T, N, H), dtype, pad=(0, 2) if view else (0, 0))}
    name = f"hc_post x={dtype} y={ydtype} {_shape_str(T=T, N=N, H=H)}{' view' if view else ''}"
    return Case("hc_post", name, f"{dtype} y={ydtype}", t, tol_key=dtype, seed=seed)


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


def layernorm(seed, T, H, dtype, bias=True, wdtype=None, offset=0.0, view=False, eps=1e-6) -> Case:
    """offset: added to every x (a mean far from zero: a one-pass variance loses precision)."""
    rng = np.random.default_rng(seed)
    wdtype = wdtype or dtype
    x = plain(rng, (T, H), dtype, pad=(3, 1) if view else (0, 0))
    if offset:
        x.values = (np.asarray(x.values, np.float32) + offset).astype(np_dtype(dtype))
    t = {"x": x, "weight": plain(rng, (H,), wdtype)}
    if bias:
        t["bias"] = plain(rng, (H,), wdtype)
    t["out"] = out((T, H), dtype)
    name = f"layernorm {dtype} w={wdtype} {_shape_str(T=T, H=H)}{' bias' if bias else ''}" \
           f"{f' offset={offset:g}' if offset else ''}{' view' if view else ''}"
    return Case("layernorm", name, dtype, t, {"eps": eps}, tol_key=dtype, seed=seed)


# ====================================================================== 1.4: communicators and expert parallelism
# The suite runs in one process, so the collectives run on a one-rank communicator of the backend under
# test (the reference its own): a sum over one rank, a gather of one, an exchange with oneself. That
# checks arguments, dtypes, shapes, counts and strides; sums over several ranks and agreement between
# ranks are level L4's business (multi_rank.py under mpirun, `deepinfer conformance LIB --ranks N`).
# moe_dispatch and moe_combine are local ops and are checked in full: the number of ranks is only a
# dimension of their tensors.

# DI_DTS_COMM: what all_gather and all_to_all move (fp8 activations, ids and counts too)
COMM_DTYPES = ("f32", "bf16", "f16", "int32", "int8", "uint8", "e4m3")


def comm_values(rng, shape, dtype: str) -> np.ndarray:
    """Random elements over much of a dtype's range (the collectives move bytes; no NaN)."""
    shape = tuple(shape)
    if dtype == "int32":
        return rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    if dtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if dtype == "uint8":
        return rng.integers(0, 256, shape).astype(np.uint8)
    if dtype == "e4m3":
        return _random_codes(rng, shape, "e4m3")
    return randn(rng, shape, dtype, 4.0)


def all_reduce(seed, shape, dtype, alias=False) -> Case:
    rng = np.random.default_rng(seed)
    t = {"x": plain(rng, shape, dtype, scale=3.0), "out": out(shape, dtype, alias="x" if alias else None)}
    return Case("all_reduce", f"all_reduce {dtype} shape={list(shape)}{' in-place' if alias else ''}", dtype, t,
                tol_key=dtype, comm=True, seed=seed)


def all_gather(seed, shape, dtype) -> Case:
    rng = np.random.default_rng(seed)
    t = {"x": TSpec(dtype, tuple(shape), comm_values(rng, shape, dtype)), "out": out((1,) + tuple(shape), dtype)}
    return Case("all_gather", f"all_gather {dtype} shape={list(shape)}", dtype, t, tol_key="exact",
                compare="exact", comm=True, seed=seed)


def all_to_all(seed, C, inner, dtype, counts=None) -> Case:
    """send [1, C, *inner]: slot 0 goes to this rank itself. counts: None (whole slots), n (the first n
    rows travel) or "random" (n drawn in [0, C])."""
    rng = np.random.default_rng(seed)
    shape = (1, C) + tuple(inner)
    t = {"send": TSpec(dtype, shape, comm_values(rng, shape, dtype)), "recv": out(shape, dtype)}
    check, counted, label = ["recv"], {}, "whole slots"
    if counts is not None:
        n = int(rng.integers(0, C + 1)) if counts == "random" else int(counts)
        t["send_counts"] = ints([n])
        t["recv_counts"] = out((1,), "int32")
        check, counted, label = ["recv_counts", "recv"], {"recv": "recv_counts"}, f"send_counts=[{n}]"
    return Case("all_to_all", f"all_to_all {dtype} send={list(shape)} {label}",
                dtype + (" counts" if counts is not None else ""), t, check=check, tol_key="exact",
                compare="exact", comm=True, counted=counted, seed=seed)


def _expert_ids(rng, T: int, K: int, E: int) -> np.ndarray:
    """[T, K] global expert ids, distinct in a row where E allows (a router's top-k), about one in six
    replaced by an id every consumer skips (-1, E, past E, below -1); with three rows or more the last
    holds only such ids (a token with no expert anywhere)."""
    ids = np.stack([rng.choice(E, K, replace=E < K) for _ in range(T)]) if T else np.zeros((0, K), np.int64)
    junk = np.array([-1, -1, E, E + 7, -3, 2**31 - 1])
    bad = rng.random((T, K)) < 1 / 6
    ids[bad] = rng.choice(junk, int(bad.sum()))
    if T > 2:
        ids[-1] = rng.choice(junk, K)
    return ids.astype(np.int32)


def moe_dispatch(seed, T, K, N, Er, H, dtype, extra=0, spread="random") -> Case:
    """T tokens, each with top-K experts of N ranks x Er experts, packed into slots of C = T + extra rows.
    spread "one-rank": every expert on rank 0 (slot 0 holds every token with one, C = T fills it)."""
    rng = np.random.default_rng(seed)
    C = T + extra
    if spread == "one-rank":
        ids = _expert_ids(rng, T, K, Er)
        ids[ids >= Er] = -1             # junk ids past E = Er would belong to rank 1
    else:
        ids = _expert_ids(rng, T, K, N * Er)
    t = {"x": plain(rng, (T, H), dtype),
         "topk_ids": ints(ids),
         "topk_weights": TSpec("f32", (T, K), rng.uniform(0.05, 1.0, (T, K)).astype(np.float32)),
         "send_x": out((N, C, H), dtype),
         "send_ids": out((N, C, K), "int32"),
         "send_weights": out((N, C, K), "f32"),
         "send_counts": out((N,), "int32"),
         "route": out((T, N), "int32")}
    name = f"moe_dispatch {dtype} {_shape_str(T=T, K=K, N=N, experts_per_rank=Er, H=H, C=C)}" + \
        (" one-rank" if spread == "one-rank" else "")
    return Case("moe_dispatch", name, dtype, t, {"experts_per_rank": Er},
                check=["send_counts", "route", "send_ids", "send_weights", "send_x"], tol_key="exact",
                compare="exact", counted={"send_x": "send_counts"}, seed=seed)


def moe_combine(seed, T, N, C, H, dtype, out_dtype=None, accumulate=0, route="dispatch") -> Case:
    """route "dispatch": what moe_dispatch writes (the tokens of slot p on its rows 0, 1, ... in token
    order; C >= T); "scattered": any distinct rows of each slot, in any order. The rows of back that no
    token routes to hold NaN (an all_to_all leaves them unspecified): a library must not read them."""
    rng = np.random.default_rng(seed)
    out_dtype = out_dtype or dtype
    r = np.full((T, N), -1, np.int64)
    for p in range(N):
        if route == "dispatch":
            tok = np.nonzero(rng.random(T) < 0.6)[0]
            r[tok, p] = np.arange(len(tok))
        else:
            k = int(rng.integers(0, min(T, C) + 1))
            r[rng.choice(T, k, replace=False), p] = rng.choice(C, k, replace=False)
    back = randn(rng, (N, C, H), dtype)
    used = np.zeros((N, C), bool)
    for p in range(N):
        used[p, r[r[:, p] >= 0, p]] = True
    back[~used] = np.nan
    t = {"back": TSpec(dtype, (N, C, H), back), "route": ints(r)}
    if accumulate:
        t["out"] = plain(rng, (T, H), out_dtype)
        t["out"].out = True
    else:
        t["out"] = out((T, H), out_dtype)
    name = f"moe_combine back={dtype} out={out_dtype} {_shape_str(T=T, N=N, C=C, H=H)} route={route}" + \
        (" accumulate" if accumulate else "")
    return Case("moe_combine", name, f"back={dtype} out={out_dtype}", t, {"accumulate": accumulate},
                tol_key=out_dtype, seed=seed)


# ====================================================================== generators


@dataclass(frozen=True)
class Profile:
    name: str
    random_draws: int      # random shapes per (op, dtype/format) on top of the fixed edge cases
    formats: str           # "some": one group size per family; "all": every format


PROFILES = {
    "quick": Profile("quick", 0, "some"),
    "default": Profile("default", 1, "all"),
    "thorough": Profile("thorough", 4, "all"),
}

FLOATS = ("f32", "bf16")


def _pick(profile: Profile, labels):
    labels = list(labels)
    if profile.formats == "all":
        return labels
    seen, out = set(), []
    for lab in labels:  # one per family in the quick profile
        fam = lab.split("/")[0]
        if fam not in seen:
            seen.add(fam)
            out.append(lab)
    return out


class _Seeds:
    def __init__(self, base: int):
        self.base = base
        self.rng = np.random.default_rng(base)

    def __call__(self) -> int:
        return int(self.rng.integers(0, 2**31))

    def fork(self, tag: int) -> "_Seeds":
        """Seeds of their own for cases a later ABI minor added to a generator, drawn without touching
        this sequence: every case that was there before keeps its seed (and a certificate's names)."""
        return _Seeds(self.base * 1000 + tag)


def gen_embedding(p: Profile, s: _Seeds):
    for dt in FLOATS:
        yield embedding(s(), 0, 5, 8, dt)
        yield embedding(s(), 7, 11, 33, dt, view=True)
        yield embedding(s(), 1, 1, 1, dt)
        for _ in range(p.random_draws):
            r = s.rng
            yield embedding(s(), int(r.integers(1, 20)), int(r.integers(1, 50)), int(r.integers(1, 70)), dt,
                            view=bool(r.integers(0, 2)))


def gen_rmsnorm(p, s):
    for dt in FLOATS:
        yield rmsnorm(s(), 0, 16, dt)
        yield rmsnorm(s(), 1, 1, dt)
        yield rmsnorm(s(), 3, 67, dt, view=True)
        for v in ("residual", "residual_out_alias_residual", "residual_out_alias_x", "out_alias_x"):
            yield rmsnorm(s(), 5, 40, dt, v)
        for _ in range(p.random_draws):
            r = s.rng
            yield rmsnorm(s(), int(r.integers(1, 12)), int(r.integers(1, 300)), dt,
                          ["plain", "residual"][int(r.integers(0, 2))], view=bool(r.integers(0, 2)))


def gen_linear(p, s):
    for dt in FLOATS:
        yield linear(s(), 0, 16, 8, dt, dt)
        yield linear(s(), 1, 1, 1, dt, dt)
        yield linear(s(), 3, 37, 19, dt, dt, bias=True, view=True)
        for _ in range(p.random_draws):
            r = s.rng
            yield linear(s(), int(r.integers(1, 9)), int(r.integers(1, 150)), int(r.integers(1, 40)), dt, dt,
                         bias=bool(r.integers(0, 2)), view=bool(r.integers(0, 2)))
    # every weight format with float activations; K never a multiple of the group, N a partial fp8 block
    for wf in _pick(p, WEIGHT_FORMATS):
        f = WEIGHT_FORMATS[wf]
        g = f.block[1] or 64
        K = g * 2 + g // 2 + 3 if f.block[0] != 128 else 200
        N = 130 if f.block[0] == 128 else 7
        for dt in FLOATS:
            yield linear(s(), 3, K, N, dt, wf, bias=dt == "f32")
        yield linear(s(), 1, K, N + 2, "f32", wf)   # decode: rows in fours (GEMV kernels) and a tail
        yield linear(s(), 0, K, N, "bf16", wf)
        for _ in range(p.random_draws):
            r = s.rng
            yield linear(s(), int(r.integers(1, 6)), int(r.integers(1, 3 * g)), int(r.integers(1, 20)), "bf16", wf)
    # the shapes GPU libraries run on tensor cores (bf16 activations, K a multiple of 128, N of 16):
    # decode widths 1 / 8 / 16, a batch above 16, split K (few rows, long K), and sizes past the
    # point where a library switches to a GEMM (M = 300 with a quantized weight: dequantize + GEMM)
    for wf in ("bf16", "e4m3/128x128/f32", "int8/channel/f32", "int4/g128/sym/f16", "int4/g64/sym/bf16",
               "int4/g32/sym/f32", "uint4/g32/asym/f32"):
        for M in (1, 8, 13, 40):
            yield linear(s(), M, 256, 48, "bf16", wf, bias=M == 13, out_dtype="f32" if M == 8 else None)
        yield linear(s(), 2, 4096, 32, "bf16", wf)
    # decode GEMV with f32 activations and output (the tight tolerance): rows in fours, K tails
    for wf in ("bf16", "f32"):
        yield linear(s(), 1, 300, 37, "f32", wf)
        yield linear(s(), 1, 2048, 8, "f32", wf)
    yield linear(s(), 5, 192, 32, "bf16", "int4/g128/sym/f16")  # K = 1.5 groups: 64-column k-steps
    yield linear(s(), 300, 256, 272, "bf16", "e4m3/128x128/f32")
    yield linear(s(), 260, 384, 144, "bf16", "int4/g128/sym/f16", bias=True)
    yield linear(s(), 64, 200, 264, "bf16", "bf16", bias=True, out_dtype="f32")
    yield linear(s(), 300, 136, 40, "bf16", "bf16")
    yield linear(s(), 128, 2048, 64, "f32", "f32", bias=True)  # the MoE router's shape: few tiles, long K
    # activation-quantized paths (integer GEMM, fp8 GEMM)
    yield linear(s(), 4, 100, 9, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 40, 256, 48, "int8/token/f32", "int8/channel/f32", bias=True)  # integer tensor cores
    yield linear(s(), 1, 256, 48, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 300, 272, 136, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 4, 100, 9, "int8/token/f32", "int4/g32/sym/f32")
    # K and blocks on 64-column chunks: the integer-dot (VNNI / dp4a) kernels, 1 to 17 rows of x,
    # an odd number of chunks, groups of 64 and 128, per-channel rows
    yield linear(s(), 1, 256, 40, "int8/token/f32", "int4/g64/sym/bf16")
    yield linear(s(), 9, 384, 70, "int8/token/f32", "int4/g128/sym/f16")
    yield linear(s(), 17, 320, 33, "int8/token/f32", "int4/g64/sym/bf16", bias=True)
    yield linear(s(), 2, 320, 24, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 8, 1024, 20, "int8/token/f32", "int8/channel/f32")
    # 32 rows and more: integer matrix units (AMX tiles), partial row blocks and column strips
    yield linear(s(), 33, 384, 45, "int8/token/f32", "int4/g64/sym/bf16")
    yield linear(s(), 70, 256, 40, "int8/token/f32", "int4/g128/sym/f16", bias=True)
    yield linear(s(), 64, 192, 33, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 3, 200, 130, "e4m3/1x128/f32", "e4m3/128x128/f32")
    yield linear(s(), 0, 200, 130, "e4m3/1x128/f32", "e4m3/128x128/f32")
    for M in (1, 40, 300):  # whole 128 x 128 blocks: the fp8 tensor-core GEMM of a GPU library
        yield linear(s(), M, 384, 256, "e4m3/1x128/f32", "e4m3/128x128/f32", bias=M == 40)


def gen_quantize(p, s):
    for qf in _pick(p, QUANTIZE_FORMATS):
        for xd in FLOATS:
            yield quantize(s(), (5, 200), xd, qf, zero_row=True)
        yield quantize(s(), (2, 3, 70), "f32", qf)
        if qf.startswith("e4m3") or qf.startswith("int8"):
            yield quantize(s(), (130, 150) if "128x128" in qf else (4, 150), "f32", qf, scale_pow2=1)
        for _ in range(p.random_draws):
            r = s.rng
            yield quantize(s(), (int(r.integers(1, 9)), int(r.integers(1, 300))), "bf16", qf)


def gen_dequantize(p, s):
    # L1 keeps a few; L2 (gen_dequantize_l2) is the exhaustive bit-exact sweep
    for wf in _pick(p, WEIGHT_FORMATS):
        yield dequantize(s(), (3, 100), wf, "f32")


def gen_dequantize_l2(p, s):
    for wf, f in WEIGHT_FORMATS.items():
        g = f.block[1] or 50
        shapes = [(130, 300), (1, 1), (0, 64)] if f.block[0] == 128 else [(5, 2 * g + 7), (3, g), (2, 1), (0, 8)]
        shapes.append((2, 3, 2 * g + 1) if f.block[0] != 128 else (2, 129, 131))
        for shape in shapes:
            for od in FLOATS:
                yield dequantize(s(), shape, wf, od)
    for af in ACT_FORMATS:
        for od in FLOATS:
            yield dequantize(s(), (4, 300), af, od, act=True)
    for _ in range(p.random_draws):
        for wf in WEIGHT_FORMATS:
            r = s.rng
            lead = tuple(int(d) for d in r.integers(1, 3, int(r.integers(0, 2))))
            yield dequantize(s(), lead + (int(r.integers(0, 260)), int(r.integers(1, 400))), wf,
                             FLOATS[int(r.integers(0, 2))])


def gen_rope(p, s):
    for dt in FLOATS:
        yield rope(s(), 0, 2, 8, dt)
        yield rope(s(), 5, 3, 64, dt, interleaved=1, yarn=True, attn_factor=1.1)
        yield rope(s(), 5, 3, 64, dt, interleaved=0)
        yield rope(s(), 4, 0, 8, dt, interleaved=1, alias=True)
        yield rope(s(), 6, 2, 16, dt, interleaved=1, yarn=True, view=True)
        yield rope(s(), 3, 1, 2, dt, interleaved=0, yarn=True)
        for _ in range(p.random_draws):
            r = s.rng
            yield rope(s(), int(r.integers(1, 9)), int(r.integers(0, 4)), 2 * int(r.integers(1, 40)), dt,
                       interleaved=int(r.integers(0, 2)), yarn=bool(r.integers(0, 2)), view=bool(r.integers(0, 2)))


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


def gen_moe_router(p, s):
    for cfg in ROUTER_CONFIGS:
        yield moe_router(s(), 0, cfg)
        yield moe_router(s(), 9, cfg)
        for _ in range(p.random_draws):
            yield moe_router(s(), int(s.rng.integers(1, 40)), cfg)


def gen_moe_experts(p, s):
    for dt in FLOATS:
        yield moe_experts(s(), 0, 4, 2, 16, 8, dt)
        yield moe_experts(s(), 6, 5, 2, 24, 40, dt, routing="skip")
        yield moe_experts(s(), 5, 4, 2, 16, 24, dt, routing="one", accumulate=1)
        yield moe_experts(s(), 4, 6, 2, 16, 8, dt, absent=(5,))
    for wf in _pick(p, ["int4/g32/sym/f32", "e4m3/128x128/f32", "uint4/g32/asym/f32", "int8/channel/f32",
                        "e2m1/g32/e8m0"]):
        yield moe_experts(s(), 4, 4, 2, 40, 24, "bf16", wf)
    # On the tensor-core grid of the GPU backends (rows a multiple of 16, K of 128), each weight
    # format they take: decode-sized (T=3, a token or two per expert) and prefill-sized (T=150 over
    # 4 of 8 experts, about 75 tokens each: more than one 64-token work item per expert).
    for wf in ["bf16"] + _pick(p, ["int4/g32/sym/f32", "int4/g64/sym/bf16", "int4/g128/sym/f16",
                                   "uint4/g32/asym/f32", "uint4/g128/asym/f16+u8", "int8/channel/f32",
                                   "e4m3/128x128/f32"]):
        yield moe_experts(s(), 3, 8, 2, 256, 128, "bf16", wf)
        yield moe_experts(s(), 150, 8, 2, 256, 128, "bf16", wf)
    yield moe_experts(s(), 40, 8, 3, 256, 160, "bf16", routing="skip", accumulate=1, absent=(7,))
    yield moe_experts(s(), 3, 8, 0, 256, 128, "bf16", accumulate=1)   # top-k of 0: out keeps its values
    # 1.3: V4's clipped SwiGLU (limits at which many of the unit-sized activations clip, and V4's 10)
    for dt in FLOATS:
        yield moe_experts(s(), 6, 5, 2, 24, 40, dt, routing="skip", limit=0.5)
    yield moe_experts(s(), 4, 4, 2, 40, 24, "bf16", "int4/g32/sym/f32", limit=0.7, accumulate=1)
    yield moe_experts(s(), 150, 8, 2, 256, 128, "bf16", "e4m3/128x128/f32", limit=0.7)
    yield moe_experts(s(), 5, 4, 2, 16, 24, "f32", limit=10.0)
    for _ in range(p.random_draws):
        r = s.rng
        yield moe_experts(s(), int(r.integers(1, 10)), int(r.integers(1, 8)), int(r.integers(1, 3)),
                          int(r.integers(1, 40)), int(r.integers(1, 40)), FLOATS[int(r.integers(0, 2))],
                          routing=["random", "skip", "all"][int(r.integers(0, 3))], accumulate=int(r.integers(0, 2)))
    # 1.5: an expert cache's table, on seeds of their own (every earlier case keeps its seed). A
    # permuting map over more model experts than descriptors, with entries -1, -5, E, 2^30 and descriptors
    # not resident (misses), ids -1 and M (skipped, not flagged); a pure permutation with every pair resident
    # (misses all 0: what a complete step of the cache computes); every kind of weight the GPU libraries
    # take on their tensor-core grid, decode- and prefill-sized; a limit, accumulate, no tokens.
    s5 = s.fork(5)
    for dt in FLOATS:
        yield moe_experts(s5(), 6, 5, 2, 24, 40, dt, routing="skip", absent=(1,), mapped=3)
        yield moe_experts(s5(), 5, 4, 2, 16, 24, dt, routing="cold", accumulate=1, absent=(0, 3), mapped=4)
        yield moe_experts(s5(), 4, 6, 2, 16, 8, dt, routing="all", mapped=0)
        yield moe_experts(s5(), 3, 4, 3, 16, 8, dt, routing="one", absent=(0,), mapped=2)
    yield moe_experts(s5(), 0, 4, 2, 16, 8, "bf16", mapped=3)
    yield moe_experts(s5(), 6, 5, 2, 24, 40, "f32", routing="skip", absent=(4,), limit=0.5, mapped=3)
    for wf in ["bf16"] + _pick(p, ["int4/g32/sym/f32", "e4m3/128x128/f32"]):
        yield moe_experts(s5(), 3, 8, 2, 256, 128, "bf16", wf, routing="skip", absent=(5,), mapped=8)
        yield moe_experts(s5(), 150, 8, 2, 256, 128, "bf16", wf, absent=(2, 7), mapped=8)
    yield moe_experts(s5(), 150, 8, 2, 256, 128, "bf16", routing="cold", absent=(6,), mapped=8)
    yield moe_experts(s5(), 40, 8, 3, 256, 160, "bf16", routing="all", accumulate=1, mapped=0)
    for _ in range(p.random_draws):
        r = s5.rng
        E = int(r.integers(1, 8))
        yield moe_experts(s5(), int(r.integers(1, 10)), E, int(r.integers(1, 3)), int(r.integers(1, 40)),
                          int(r.integers(1, 40)), FLOATS[int(r.integers(0, 2))],
                          routing=["random", "skip", "all", "cold"][int(r.integers(0, 4))],
                          accumulate=int(r.integers(0, 2)),
                          absent=tuple(int(e) for e in np.nonzero(r.random(E) < 0.3)[0]), mapped=int(r.integers(0, 6)))


def gen_moe_experts_errors(p, s):
    yield moe_experts(s(), 3, 4, 2, 16, 8, "f32", absent=(2,), expect="FAILED_PRECONDITION")


def _gen_binary(op):
    def gen(p, s):
        for dt in FLOATS:
            yield binary(op, s(), (0, 4), dt)
            yield binary(op, s(), (3, 37), dt, view=True)
            yield binary(op, s(), (2, 3, 5), dt)
            yield binary(op, s(), (7,), dt)
            yield binary(op, s(), (4, 9), dt, alias="a")
            yield binary(op, s(), (4, 9), dt, alias="b")
            for _ in range(p.random_draws):
                r = s.rng
                yield binary(op, s(), (int(r.integers(1, 9)), int(r.integers(1, 200))), dt,
                             view=bool(r.integers(0, 2)))
    return gen


def gen_silu_mul(p, s):
    for dt in FLOATS:
        yield silu_mul(s(), 0, 8, dt)
        yield silu_mul(s(), 3, 33, dt, view=True)
        yield silu_mul(s(), 1, 1, dt)
        yield silu_mul(s(), 5, 70, dt, limit=1.5)    # 1.3: V4's clipped SwiGLU
        yield silu_mul(s(), 3, 33, dt, view=True, limit=0.25)
        for _ in range(p.random_draws):
            yield silu_mul(s(), int(s.rng.integers(1, 9)), int(s.rng.integers(1, 200)), dt,
                           view=bool(s.rng.integers(0, 2)))


def gen_concat(p, s):
    for dt in FLOATS:
        yield concat(s(), 0, 3, 4, dt)
        yield concat(s(), 4, 512, 64, dt, view=True)
        yield concat(s(), 3, 1, 7, dt)
        for _ in range(p.random_draws):
            yield concat(s(), int(s.rng.integers(1, 9)), int(s.rng.integers(1, 50)), int(s.rng.integers(1, 50)), dt,
                         view=bool(s.rng.integers(0, 2)))


def gen_sample(p, s):
    yield sample(s(), 4, 7, "greedy", ties=True)
    yield sample(s(), 0, 10, "mixed")
    yield sample(s(), 12, 100, "mixed")
    yield sample(s(), 8, 1000, "mixed", ties=True)
    yield sample(s(), 3, 1, "mixed")
    for _ in range(p.random_draws):
        yield sample(s(), int(s.rng.integers(1, 16)), int(s.rng.integers(1, 3000)), "mixed",
                     ties=bool(s.rng.integers(0, 2)))
    # the 1.2 output probs
    yield sample(s(), 4, 7, "greedy", ties=True, probs=True)
    yield sample(s(), 12, 100, "mixed", probs=True)
    yield sample(s(), 8, 1000, "mixed", ties=True, probs=True)
    for _ in range(p.random_draws):
        yield sample(s(), int(s.rng.integers(1, 16)), int(s.rng.integers(1, 3000)), "mixed", probs=True)


def gen_spec_verify(p, s):
    yield spec_verify(s(), 4, 7, "greedy", "greedy", ties=True)
    yield spec_verify(s(), 6, 9, "greedy", "logits", ties=True)
    yield spec_verify(s(), 0, 10, "mixed", "logits")
    yield spec_verify(s(), 3, 1, "mixed", "logits")
    for draft in ("logits", "greedy"):
        yield spec_verify(s(), 24, 16, "mixed", draft)
        yield spec_verify(s(), 16, 100, "mixed", draft)
        yield spec_verify(s(), 8, 1000, "mixed", draft, ties=True)
        for _ in range(p.random_draws):
            yield spec_verify(s(), int(s.rng.integers(1, 24)), int(s.rng.integers(1, 3000)), "mixed", draft,
                              ties=bool(s.rng.integers(0, 2)))


def gen_hc_pre(p, s):
    for dt in FLOATS:
        yield hc_pre(s(), 0, 4, 16, dt)
        yield hc_pre(s(), 5, 4, 64, dt)                     # V4's N = 4
        yield hc_pre(s(), 5, 4, 64, dt, head=True)
        yield hc_pre(s(), 3, 1, 8, dt)                      # one stream: comb is 1x1
        yield hc_pre(s(), 4, 2, 33, dt, iters=1, view=True)  # Sinkhorn's first column pass only
        yield hc_pre(s(), 2, 3, 40, dt, iters=3, head=True, view=True)
        yield hc_pre(s(), 4, 4, 24, dt, iters=4, hc_eps=0.02)
        yield hc_pre(s(), 3, 4, 24, dt, head=True, hc_eps=0.02)
        for _ in range(p.random_draws):
            r = s.rng
            yield hc_pre(s(), int(r.integers(1, 9)), int(r.integers(1, 6)), int(r.integers(1, 130)), dt,
                         head=bool(r.integers(0, 2)), iters=int(r.integers(1, 25)), view=bool(r.integers(0, 2)))


def gen_hc_post(p, s):
    for dt in FLOATS:
        yield hc_post(s(), 0, 4, 16, dt)
        yield hc_post(s(), 5, 4, 64, dt)
        yield hc_post(s(), 3, 1, 7, dt, view=True)
        yield hc_post(s(), 4, 3, 33, dt, ydtype="f32" if dt == "bf16" else "bf16", view=True)
        for _ in range(p.random_draws):
            r = s.rng
            yield hc_post(s(), int(r.integers(1, 9)), int(r.integers(1, 6)), int(r.integers(1, 200)), dt,
                          view=bool(r.integers(0, 2)))


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


def gen_layernorm(p, s):
    for dt in FLOATS:
        yield layernorm(s(), 0, 16, dt)
        yield layernorm(s(), 1, 1, dt)
        yield layernorm(s(), 3, 67, dt, view=True)
        yield layernorm(s(), 5, 40, dt, bias=False)
        yield layernorm(s(), 4, 128, dt, wdtype="f32" if dt == "bf16" else "bf16")   # V3.2: f32 weights
        yield layernorm(s(), 4, 96, dt, offset=8.0)
        for _ in range(p.random_draws):
            r = s.rng
            yield layernorm(s(), int(r.integers(1, 12)), int(r.integers(1, 300)), dt, bias=bool(r.integers(0, 2)),
                            view=bool(r.integers(0, 2)))


def gen_all_reduce(p, s):
    for dt in FLOATS:
        yield all_reduce(s(), (0, 8), dt)
        yield all_reduce(s(), (7,), dt)
        yield all_reduce(s(), (5, 33), dt)
        yield all_reduce(s(), (4, 9), dt, alias=True)          # out may alias x
        yield all_reduce(s(), (2, 1, 3, 1, 2, 5), dt)          # six dims
        for _ in range(p.random_draws):
            r = s.rng
            yield all_reduce(s(), tuple(int(d) for d in r.integers(1, 40, int(r.integers(1, 4)))), dt,
                             alias=bool(r.integers(0, 2)))


def gen_all_gather(p, s):
    for dt in COMM_DTYPES:
        yield all_gather(s(), (3, 17), dt)
    for dt in FLOATS:
        yield all_gather(s(), (0, 8), dt)
        yield all_gather(s(), (9,), dt)
        yield all_gather(s(), (2, 1, 3, 2, 2), dt)             # five dims (out has six)
        for _ in range(p.random_draws):
            r = s.rng
            yield all_gather(s(), tuple(int(d) for d in r.integers(1, 40, int(r.integers(1, 4)))), dt)


def gen_all_to_all(p, s):
    for dt in COMM_DTYPES:
        yield all_to_all(s(), 5, (16,), dt)
        yield all_to_all(s(), 6, (7,), dt, counts="random")
    for dt in FLOATS:
        yield all_to_all(s(), 4, (8,), dt, counts=0)
        yield all_to_all(s(), 4, (8,), dt, counts=4)
        yield all_to_all(s(), 0, (8,), dt, counts=0)           # empty slots
        yield all_to_all(s(), 9, (), dt, counts="random")      # send [1, C]: a row is one element
        yield all_to_all(s(), 5, (2, 3, 4), dt, counts="random")   # six dims
        for _ in range(p.random_draws):
            r = s.rng
            yield all_to_all(s(), int(r.integers(0, 30)), (int(r.integers(1, 70)),), dt,
                             counts="random" if r.integers(0, 2) else None)


def gen_moe_dispatch(p, s):
    for dt in FLOATS:
        yield moe_dispatch(s(), 0, 2, 2, 2, 8, dt)                 # no tokens
        yield moe_dispatch(s(), 0, 2, 2, 2, 8, dt, extra=3)
        yield moe_dispatch(s(), 1, 1, 1, 1, 5, dt)
        yield moe_dispatch(s(), 7, 2, 4, 2, 16, dt)
        yield moe_dispatch(s(), 9, 4, 3, 3, 24, dt, extra=3)
        yield moe_dispatch(s(), 6, 3, 1, 8, 8, dt)                 # one rank: every expert is local
        yield moe_dispatch(s(), 8, 4, 4, 1, 8, dt)                 # an expert per rank
        yield moe_dispatch(s(), 5, 4, 2, 4, 16, dt, spread="one-rank")   # slot 0 full (C = T)
        for _ in range(2 + p.random_draws):
            r = s.rng
            yield moe_dispatch(s(), int(r.integers(0, 20)), int(r.integers(1, 5)), int(r.integers(1, 5)),
                               int(r.integers(1, 5)), int(r.integers(1, 40)), dt, extra=int(r.integers(0, 4)))


def gen_moe_combine(p, s):
    for dt in FLOATS:
        other = "f32" if dt == "bf16" else "bf16"
        yield moe_combine(s(), 0, 2, 0, 8, dt)
        yield moe_combine(s(), 0, 2, 3, 8, dt, accumulate=1)
        yield moe_combine(s(), 1, 1, 1, 5, dt)
        yield moe_combine(s(), 7, 4, 7, 16, dt)
        yield moe_combine(s(), 9, 3, 12, 24, dt, route="scattered")
        yield moe_combine(s(), 6, 2, 8, 33, dt, accumulate=1)
        yield moe_combine(s(), 5, 3, 5, 16, dt, out_dtype=other)
        yield moe_combine(s(), 5, 3, 6, 16, dt, out_dtype=other, accumulate=1, route="scattered")
        for _ in range(2 + p.random_draws):
            r = s.rng
            T = int(r.integers(0, 20))
            yield moe_combine(s(), T, int(r.integers(1, 5)), T + int(r.integers(0, 4)), int(r.integers(1, 40)), dt,
                              accumulate=int(r.integers(0, 2)), route=["dispatch", "scattered"][int(r.integers(0, 2))])


def _large(op: str, s: _Seeds):
    """A few cases big enough to reach a library's threaded and vectorised paths (blocked loops,
    work split across threads, tails of SIMD widths)."""
    if op == "linear":
        yield linear(s(), 33, 1000, 300, "f32", "f32", bias=True)
        yield linear(s(), 17, 1000, 257, "bf16", "int4/g128/sym/f16")
        yield linear(s(), 9, 1000, 300, "bf16", "e4m3/128x128/f32")
        yield linear(s(), 20, 1000, 130, "int8/token/f32", "int8/channel/f32")
        yield linear(s(), 20, 1000, 512, "int8/token/f32", "int4/g128/sym/f16")
    elif op == "rmsnorm":
        yield rmsnorm(s(), 64, 2049, "bf16", "residual")
    elif op == "rope":
        yield rope(s(), 64, 16, 64, "f32", interleaved=1, yarn=True)
    elif op == "moe_experts":
        yield moe_experts(s(), 64, 8, 2, 128, 96, "bf16", "int4/g32/sym/f32", routing="all")
    elif op == "mla_decode":
        yield mla_decode(s(), 8, 2, 4, 16, 8, 16, 64, 20, 16, 8, "f32")
    elif op == "mla_prefill":
        yield mla_prefill(s(), [70, 1, 33], 4, 16, 8, 16, "f32")
    elif op == "dequantize":
        yield dequantize(s(), (300, 1000), "e4m3/128x128/f32", "bf16")
    elif op == "quantize":
        yield quantize(s(), (260, 1000), "f32", "e4m3/128x128/f32")
    elif op in ("add", "mul"):
        yield binary(op, s(), (64, 4099), "bf16")
    elif op == "silu_mul":
        yield silu_mul(s(), 64, 4099, "f32")
    elif op == "sample":
        yield sample(s(), 16, 32000, "mixed")
    elif op == "spec_verify":
        yield spec_verify(s(), 16, 32000, "mixed", "logits")
    elif op == "moe_router":
        yield moe_router(s(), 512, "v3")
    elif op == "embedding":
        yield embedding(s(), 300, 1000, 513, "bf16")
    elif op == "hc_pre":
        yield hc_pre(s(), 16, 4, 4096, "bf16")                      # V4-Flash's hidden size
    elif op == "hc_post":
        yield hc_post(s(), 16, 4, 4096, "bf16")
    elif op == "kv_compress":
        yield kv_compress(s(), 4, 1, 64, 1024, [300, 77], "bf16", rows="all")   # V4's CSA: 2 x 512
        yield kv_compress(s(), 128, 0, 64, 512, [520], "bf16")
    elif op == "indexer_topk":
        yield indexer_topk(s(), 12, [3000, 1200], 64, 128, 512, 4, 64, "bf16")  # V4's indexer shapes
    elif op == "sparse_attention":
        yield sparse_attention(s(), 8, [900, 400], 16, 512, 64, 128, "bf16", ratio=4, indices=64, sinks=True)
    elif op == "layernorm":
        yield layernorm(s(), 64, 2049, "bf16")
    elif op == "all_reduce":
        yield all_reduce(s(), (64, 4099), "bf16")
        yield all_reduce(s(), (64, 4099), "f32", alias=True)
    elif op == "all_gather":
        yield all_gather(s(), (64, 1031), "bf16")
    elif op == "all_to_all":
        yield all_to_all(s(), 300, (1031,), "bf16", counts="random")
        yield all_to_all(s(), 300, (128,), "e4m3", counts=300)
    elif op == "moe_dispatch":
        yield moe_dispatch(s(), 256, 8, 4, 64, 1031, "bf16", extra=16)   # V3-sized top-8 over 4 ranks
    elif op == "moe_combine":
        yield moe_combine(s(), 256, 4, 272, 1031, "bf16", accumulate=1)


GENERATORS: dict[str, Callable] = {
    "embedding": gen_embedding,
    "rmsnorm": gen_rmsnorm,
    "linear": gen_linear,
    "quantize": gen_quantize,
    "dequantize": gen_dequantize,
    "rope": gen_rope,
    "mla_cache_write": gen_mla_cache_write,
    "mla_prefill": gen_mla_prefill,
    "mla_decode": gen_mla_decode,
    "moe_router": gen_moe_router,
    "moe_experts": gen_moe_experts,
    "add": _gen_binary("add"),
    "mul": _gen_binary("mul"),
    "silu_mul": gen_silu_mul,
    "concat": gen_concat,
    "sample": gen_sample,
    "spec_verify": gen_spec_verify,
    "hc_pre": gen_hc_pre,
    "hc_post": gen_hc_post,
    "kv_compress": gen_kv_compress,
    "indexer_topk": gen_indexer_topk,
    "sparse_attention": gen_sparse_attention,
    "layernorm": gen_layernorm,
    "all_reduce": gen_all_reduce,
    "all_gather": gen_all_gather,
    "all_to_all": gen_all_to_all,
    "moe_dispatch": gen_moe_dispatch,
    "moe_combine": gen_moe_combine,
}
# the suite covers every op of the header; a new op without a generator fails here, not silently
_missing = set(abi.OP_NAMES) - set(GENERATORS)
if _missing:
    raise RuntimeError(f"conformance has no case generator for op(s) {sorted(_missing)}")

# a stable base seed per op so that a case name + seed reproduces across runs and machines
_OP_SEED = {op: 1000 + 97 * i for i, op in enumerate(abi.OP_NAMES)}


def cases_for(op: str, profile: str | Profile = "default", seed: int = 0) -> list[Case]:
    p = PROFILES[profile] if isinstance(profile, str) else profile
    s = _Seeds(_OP_SEED[op] + seed)
    return list(GENERATORS[op](p, s)) + list(_large(op, s))


def error_cases(profile="default", seed: int = 0) -> list[Case]:
    p = PROFILES[profile] if isinstance(profile, str) else profile
    return list(gen_moe_experts_errors(p, _Seeds(7 + seed)))


def l2_cases(profile="default", seed: int = 0) -> list[Case]:
    p = PROFILES[profile] if isinstance(profile, str) else profile
    return list(gen_dequantize_l2(p, _Seeds(4242 + seed)))


def without_fields(case: Case, fields) -> Case:
    """The same call with some args-struct fields left out (absent tensors, zero scalars) and their
    outputs no longer compared: what a caller that does not know those fields sends."""
    import dataclasses

    fields = set(fields)
    return dataclasses.replace(case, name=f"{case.name} without {', '.join(sorted(fields))}",
                               tensors={k: v for k, v in case.tensors.items() if k not in fields},
                               scalars={k: v for k, v in case.scalars.items() if k not in fields},
                               check=[c for c in case.check if c not in fields])


def a_full_case(op: str) -> Case:
    """A small successful call that also sets every field appended after the op (DI_ARGS_SINCE)."""
    full = {"sample": lambda: sample(1, 3, 8, "mixed", probs=True),
            # 1.3's appended fields
            "mla_decode": lambda: mla_decode(1, 3, 1, 1, 4, 2, 4, 8, 2, 2, 2, "f32", zero_len=False, indices=3),
            "moe_router": lambda: moe_router(1, 3, "hash-softmax"),
            # and 1.5's: a permuting map of every descriptor, resident (a 1.4 caller's call is valid too)
            "moe_experts": lambda: moe_experts(1, 2, 2, 1, 8, 4, "f32", routing="all", limit=0.3, mapped=0),
            "silu_mul": lambda: silu_mul(1, 2, 8, "f32", limit=1.0)}
    return full[op]() if op in full else a_valid_case(op)


def a_valid_case(op: str) -> Case:
    """A small, ordinary, successful call of an op (the L0 checks mutate it)."""
    small = {
        "embedding": lambda: embedding(1, 3, 5, 8, "f32"),
        "rmsnorm": lambda: rmsnorm(1, 3, 16, "f32"),
        "linear": lambda: linear(1, 2, 16, 4, "f32", "f32"),
        "quantize": lambda: quantize(1, (2, 64), "f32", "int8/token/f32"),
        "dequantize": lambda: dequantize(1, (2, 64), "int8/channel/f32"),
        "rope": lambda: rope(1, 2, 2, 8, "f32"),
        "mla_cache_write": lambda: mla_cache_write(1, 2, 8, 4, 2, 2, "f32", view=False),
        "mla_prefill": lambda: mla_prefill(1, [2], 1, 4, 2, 4, "f32"),
        "mla_decode": lambda: mla_decode(1, 2, 1, 1, 4, 2, 4, 8, 2, 2, 2, "f32", zero_len=False),
        "moe_router": lambda: moe_router(1, 2, "v2lite"),
        "moe_experts": lambda: moe_experts(1, 2, 2, 1, 8, 4, "f32", routing="all"),
        "add": lambda: binary("add", 1, (2, 8), "f32"),
        "mul": lambda: binary("mul", 1, (2, 8), "f32"),
        "silu_mul": lambda: silu_mul(1, 2, 8, "f32"),
        "concat": lambda: concat(1, 2, 3, 4, "f32"),
        "sample": lambda: sample(1, 2, 8, "greedy"),
        "spec_verify": lambda: spec_verify(1, 2, 8, "greedy", "greedy"),
        # 1.3's ops, with every optional argument (so that the checks reach them)
        "hc_pre": lambda: hc_pre(1, 2, 2, 8, "f32", iters=3),
        "hc_post": lambda: hc_post(1, 2, 2, 8, "f32"),
        "kv_compress": lambda: kv_compress(1, 2, 1, 2, 4, [8], "f32", rows="all"),
        "indexer_topk": lambda: indexer_topk(1, 3, [16], 2, 8, 3, 2, 4, "f32"),
        "sparse_attention": lambda: sparse_attention(1, 3, [12], 2, 8, 4, 6, "f32", ratio=2, indices=3, sinks=True),
        "layernorm": lambda: layernorm(1, 3, 16, "f32"),
        # 1.4's ops (the collectives on a one-rank communicator; all_to_all with its counts)
        "all_reduce": lambda: all_reduce(1, (2, 8), "f32"),
        "all_gather": lambda: all_gather(1, (2, 8), "f32"),
        "all_to_all": lambda: all_to_all(1, 3, (8,), "f32", counts=2),
        "moe_dispatch": lambda: moe_dispatch(1, 3, 2, 2, 2, 8, "f32"),
        "moe_combine": lambda: moe_combine(1, 3, 2, 3, 8, "f32"),
    }
    return small[op]()
