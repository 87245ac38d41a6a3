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
    compare: str = "close"     # close | exact | router | sample
    expect: str = "OK"         # a status name for cases that must fail (FAILED_PRECONDITION, ...)
    seed: int = 0

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


def mla_decode(seed, T, S, H, Dn, Dr, Dv, Dc, NB, BS, MB, dtype, zero_len=True) -> Case:
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
    return Case("mla_decode", f"mla_decode {dtype} {_shape_str(T=T, S=S, H=H, Dn=Dn, Dr=Dr, Dv=Dv, Dc=Dc, BS=BS, MB=MB)}",
                dtype, t, {"scale": 1.0 / math.sqrt(Dn + Dr)}, tol_key=dtype, seed=seed)


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
}


def moe_router(seed, T, config="v3") -> Case:
    rng = np.random.default_rng(seed)
    c = dict(ROUTER_CONFIGS[config])
    E, K, has_bias = c.pop("E"), c.pop("K"), c.pop("bias")
    t = {"logits": plain(rng, (T, E), "f32", scale=2.0)}
    if has_bias:
        t["bias"] = plain(rng, (E,), "f32", scale=0.3)
    t["topk_ids"] = out((T, K), "int32")
    t["topk_weights"] = out((T, K), "f32")
    return Case("moe_router", f"moe_router {config} T={T} E={E} K={K}", config, t, c,
                check=["topk_ids", "topk_weights"], tol_key="f32", compare="router", seed=seed)


def moe_experts(seed, T, E, K, H, I, dtype, wfmt=None, routing="random", accumulate=0,
                absent=(), expect="OK") -> Case:
    """routing: random | one (every token to expert 0) | skip (ids -1 and E mixed in);
    absent: experts whose weights are not resident (data NULL)."""
    rng = np.random.default_rng(seed)
    wfmt = wfmt or dtype
    quantized = wfmt in WEIGHT_FORMATS

    def weight(shape):
        if quantized:
            return WEIGHT_FORMATS[wfmt].random(rng, shape)
        return plain(rng, shape, wfmt, scale=1 / math.sqrt(shape[1]))

    resident = [e for e in range(E) if e not in absent]
    if routing == "one":
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
    name = f"moe_experts {dtype} w={wfmt} {_shape_str(T=T, E=E, K=K, H=H, I=I)} routing={routing}" \
           f"{' accumulate' if accumulate else ''}{' absent=' + str(list(absent)) if absent else ''}"
    return Case("moe_experts", name, f"x={dtype} w={wfmt}", t, {"num_experts": E, "accumulate": accumulate},
                tol_key=_tol(dtype, quantized), expect=expect, seed=seed)


def binary(op, seed, shape, dtype, alias=None, view=False) -> Case:
    rng = np.random.default_rng(seed)
    pad = (2, 3) if view else (0, 0)
    t = {"a": plain(rng, shape, dtype, pad=pad), "b": plain(rng, shape, dtype),
         "out": out(shape, dtype, alias=alias, pad=(0, 0) if alias else pad)}
    return Case(op, f"{op} {dtype} shape={list(shape)}{' out=' + alias if alias else ''}{' view' if view else ''}",
                dtype, t, tol_key=dtype, seed=seed)


def silu_mul(seed, T, I, dtype, view=False) -> Case:
    rng = np.random.default_rng(seed)
    t = {"gate": plain(rng, (T, I), dtype, scale=3.0, pad=(0, I) if view else (0, 0)),
         "up": plain(rng, (T, I), dtype, pad=(I, 0) if view else (0, 0)),
         "out": out((T, I), dtype)}
    return Case("silu_mul", f"silu_mul {dtype} {_shape_str(T=T, I=I)}{' view' if view else ''}", dtype, t,
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
        self.rng = np.random.default_rng(base)

    def __call__(self) -> int:
        return int(self.rng.integers(0, 2**31))


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
    for _ in range(p.random_draws):
        r = s.rng
        yield moe_experts(s(), int(r.integers(1, 10)), int(r.integers(1, 8)), int(r.integers(1, 3)),
                          int(r.integers(1, 40)), int(r.integers(1, 40)), FLOATS[int(r.integers(0, 2))],
                          routing=["random", "skip", "all"][int(r.integers(0, 3))], accumulate=int(r.integers(0, 2)))


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


def a_full_case(op: str) -> Case:
    """A small successful call that also sets every field appended after the op (DI_ARGS_SINCE)."""
    full = {"sample": lambda: sample(1, 3, 8, "mixed", probs=True)}
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
    }
    return small[op]()
