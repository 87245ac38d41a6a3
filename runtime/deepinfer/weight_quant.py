"""The quantize math of `deepinfer quantize`: one weight [N, K] in one format (int8, int4, fp8),
with the clip search and the activation-aware variant; no files.

Rounding is not the only choice: for int8 and int4 each scale group's clipping range is searched
over a grid of shrink factors (AWQ's clip search), keeping the factor with the least squared
reconstruction error. The grid contains 1.0, computed exactly as plain absmax quantization, so the
search can never do worse than absmax. With calibration statistics, the error is weighted per input
channel by an activation importance (mean |x|)^(2*alpha), alpha searched per layer on real
activations: see quantize_weight_calibrated for why weighting was chosen over folding scales into
norms. Dequantization is the reference backend's (the definition of each format).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

import ml_dtypes
import numpy as np

from . import abi
from . import dtypes as D
from . import quant_formats as QF
from .reference.quant import dequantize_array
from .tensor import Quant, Tensor, pack_4bit

INT4_CLIP_GRID = tuple(np.round(np.linspace(1.0, 0.5, 11), 4))    # 1.0, 0.95, ..., 0.5
INT8_CLIP_GRID = tuple(np.round(np.linspace(1.0, 0.8, 11), 4))    # int8 has 16x the levels: clip less
AWQ_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_CALIB_TOKENS = 16             # fewer tokens than this (a rarely routed expert): too few to fit alpha on
ROW_CHUNK = 512                    # rows quantized at a time: bounds the search's temporaries


def as_f32(w) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w, dtype=np.float32))


def _store(scale: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Scales rounded to their stored dtype and read back as f32 (q is computed with these)."""
    return scale.astype(D.get(scale_dtype).np).astype(np.float32)


def _grouped(w: np.ndarray, g: int) -> np.ndarray:
    """[N, K] -> [N, G, g], zero-padded; a padded zero quantizes exactly to 0 in both schemes
    (symmetric: q = 0; asymmetric: the range always includes 0 and 0 maps to the zero point), so
    the padding adds no error and never changes a group's range."""
    n, k = w.shape
    groups = -(-k // g)
    if groups * g != k:
        w = np.concatenate([w, np.zeros((n, groups * g - k), np.float32)], axis=1)
    return w.reshape(n, groups, g)


def _sym_candidate(x, amax, ratio, qmax, scale_dtype):
    """x [n, G, g]; the same f32 operations as the reference's quantize at ratio 1.0."""
    a = amax if ratio == 1.0 else (amax * np.float32(ratio)).astype(np.float32)
    scale = (a / np.float32(qmax)).astype(np.float32)
    scale = np.where(a == 0, np.float32(1), scale).astype(np.float32)
    s = _store(scale, scale_dtype)
    s = np.where(s == 0, np.float32(1), s)          # a scale that underflowed its dtype
    q = np.clip(np.rint((x / s[..., None]).astype(np.float32)), -qmax, qmax)
    return q, s, None


def _asym_candidate(x, hi, lo, ratio, levels, scale_dtype):
    h = hi if ratio == 1.0 else (hi * np.float32(ratio)).astype(np.float32)
    l = lo if ratio == 1.0 else (lo * np.float32(ratio)).astype(np.float32)
    scale = ((h - l) / np.float32(levels)).astype(np.float32)
    scale = np.where(h == l, np.float32(1), scale).astype(np.float32)
    s = _store(scale, scale_dtype)
    s = np.where(s == 0, np.float32(1), s)
    zero = np.clip(np.rint(-l / s), 0, levels).astype(np.float32)
    q = np.clip(np.rint((x / s[..., None]).astype(np.float32)) + zero[..., None], 0, levels)
    return q, s, zero


def _recon(q, s, zero):
    if zero is not None:
        q = q - zero[..., None]
    return (q * s[..., None]).astype(np.float32)


def quantize_groups(w, group: int, symmetric: bool, bits: int, scale_dtype: str = "f32",
                    ratios: Iterable[float] = (1.0,), importance: Optional[np.ndarray] = None):
    """Group-wise integer quantization of w [N, K] with a per-group clip search.

    For each group (1 x `group` elements of a row) every ratio r in `ratios` scales the range
    (absmax * r, or [min, max] * r for asymmetric) and the r with the least
    sum_k importance[k] * (w - dequant(q))^2 wins (ties keep the earlier ratio, so list 1.0 first).
    Returns (q [N, K] integer values, scales [N, G] as stored, zeros [N, G] or None).
    """
    w = as_f32(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_groups: expected a 2-d weight, got shape {list(w.shape)}")
    if not np.all(np.isfinite(w)):
        raise ValueError("quantize_groups: the weight holds NaN or infinity")
    n, k = w.shape
    ratios = [float(r) for r in ratios] or [1.0]
    if any(not 0 < r <= 1 for r in ratios):
        raise ValueError(f"clip ratios must lie in (0, 1], got {ratios}")
    qmax = abi.QMAX[{4: "int4", 8: "int8"}[bits]]   # 7 / 127 (DI_QMAX)
    levels = float(2 ** bits - 1)           # 15 / 255
    imp = None
    if importance is not None:
        imp = np.asarray(importance, np.float32).reshape(-1)
        if imp.shape[0] != k or np.any(imp < 0) or not np.all(np.isfinite(imp)):
            raise ValueError(f"importance must be {k} finite non-negative values, got shape {list(imp.shape)}")
        imp = _grouped(imp[None, :], group)[0]                    # [G, g]
    groups = -(-k // group)
    q_out = np.empty((n, groups * group), np.float32)
    s_out = np.empty((n, groups), np.float32)
    z_out = None if symmetric else np.empty((n, groups), np.float32)

    def chunk(r0: int) -> None:
        x = _grouped(w[r0:r0 + ROW_CHUNK], group)                 # [n, G, g]
        if symmetric:
            amax = np.max(np.abs(x), axis=-1)
        else:
            hi = np.maximum(np.max(x, axis=-1), np.float32(0))
            lo = np.minimum(np.min(x, axis=-1), np.float32(0))
        best_err = best_q = best_s = best_z = None
        for r in ratios:
            if symmetric:
                q, s, z = _sym_candidate(x, amax, r, qmax, scale_dtype)
            else:
                q, s, z = _asym_candidate(x, hi, lo, r, levels, scale_dtype)
            d = _recon(q, s, z) - x
            d = d * d
            err = np.sum(d * imp if imp is not None else d, axis=-1, dtype=np.float64)   # [n, G]
            if best_err is None:
                best_err, best_q, best_s, best_z = err, q, s, z
                continue
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_q = np.where(better[..., None], q, best_q)
            best_s = np.where(better, s, best_s)
            if z is not None:
                best_z = np.where(better, z, best_z)
        q_out[r0:r0 + x.shape[0]] = best_q.reshape(x.shape[0], -1)
        s_out[r0:r0 + x.shape[0]] = best_s
        if z_out is not None:
            z_out[r0:r0 + x.shape[0]] = best_z

    starts = range(0, n, ROW_CHUNK)
    workers = min(len(starts), os.cpu_count() or 1)
    if workers > 1 and n * k * len(ratios) > 1 << 22:
        # NumPy drops the GIL inside its loops: row chunks are independent, so threads scale
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(chunk, starts))
    else:
        for r0 in starts:
            chunk(r0)
    return q_out[:, :k], s_out, z_out


def quantize_weight(w, scheme: QF.QuantScheme, clip_search: bool = True,
                    importance: Optional[np.ndarray] = None) -> Tensor:
    """A weight [N, K] (any float array) as a quantized host Tensor in `scheme`'s format."""
    w = as_f32(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_weight: expected a 2-d weight, got shape {list(w.shape)}")
    if not np.all(np.isfinite(w)):
        raise ValueError("quantize_weight: the weight holds NaN or infinity")
    if scheme.format == "fp8":
        return _quantize_fp8(w, scheme.block)
    if scheme.format == "int8":
        ratios = INT8_CLIP_GRID if clip_search else (1.0,)
        q, s, _ = quantize_groups(w, max(w.shape[1], 1), True, 8, "f32", ratios, importance)
        return Tensor.from_numpy(q.astype(np.int8), "int8", quant=Quant(Tensor.from_numpy(s.reshape(-1, 1)), (1, 0)))
    if scheme.format == "int4":
        ratios = INT4_CLIP_GRID if clip_search else (1.0,)
        g = scheme.group_size
        q, s, z = quantize_groups(w, g, scheme.symmetric, 4, scheme.scale_dtype, ratios, importance)
        scales = Tensor.from_numpy(s.astype(D.get(scheme.scale_dtype).np))
        n, k = w.shape
        if scheme.symmetric:
            packed = pack_4bit(q.astype(np.int64))                  # two's complement nibbles
            return Tensor(packed, (n, k), "int4", quant=Quant(scales, (1, g)))
        packed = pack_4bit(q.astype(np.int64))
        zeros = Tensor.from_numpy(z.astype(np.uint8))
        return Tensor(packed, (n, k), "uint4", quant=Quant(scales, (1, g), zeros))
    raise ValueError(f"quantize_weight: unknown format {scheme.format!r}")


def _quantize_fp8(w: np.ndarray, block) -> Tensor:
    """DeepSeek's recipe: scale = amax / 448 (DI_QMAX of e4m3) per block, e4m3 round-to-nearest-even, saturating."""
    qmax = np.float32(abi.QMAX["e4m3"])
    n, k = w.shape
    br, bc = block
    nr, nc = -(-n // br), -(-k // bc)
    pad = np.zeros((nr * br, nc * bc), np.float32)
    pad[:n, :k] = w
    blocks = pad.reshape(nr, br, nc, bc)
    amax = np.max(np.abs(blocks), axis=(1, 3))
    scale = np.where(amax == 0, np.float32(1), (amax / qmax).astype(np.float32)).astype(np.float32)
    v = blocks / scale[:, None, :, None]
    q = np.clip(v, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn).reshape(nr * br, nc * bc)[:n, :k]
    return Tensor.from_numpy(np.ascontiguousarray(q), "e4m3", quant=Quant(Tensor.from_numpy(scale), (br, bc)))


def dequantize(t: Tensor) -> np.ndarray:
    """f32 values of a plain or quantized host weight: the reference's dequantization (the definition)."""
    if t.quant is None:
        return np.asarray(t.numpy(), dtype=np.float32)
    return dequantize_array(t)


def weighted_error(w, t: Tensor, importance: Optional[np.ndarray] = None) -> float:
    """sum (w - dequant(t))^2, each column weighted by importance (None: 1)."""
    d = dequantize(t).astype(np.float64) - np.asarray(w, np.float64)
    d = d * d
    if importance is not None:
        d = d * np.asarray(importance, np.float64)[None, :]
    return float(d.sum())


@dataclass
class ActivationStats:
    """What the calibration pass records about the input x of one linear layer."""

    mean_abs: np.ndarray                 # [K] mean |x_k| over calibration tokens
    sample: Optional[np.ndarray] = None  # [S, K] a subsample of input rows, for the output error
    tokens: int = 0


def quantize_weight_calibrated(w, scheme: QF.QuantScheme, stats: ActivationStats,
                               alphas=AWQ_ALPHAS) -> tuple[Tensor, float]:
    """Activation-aware quantization (AWQ's per-input-channel scale s = mean|x|^alpha).

    AWQ multiplies W's columns by s and the input by 1/s, folding 1/s into the previous op. That
    changes weights outside the quantized set (the RMSNorm before q_a/kv_a/gate/up/experts, which
    the router `mlp.gate` also reads, so it would need rescaling too) and makes them round again in
    their bf16 storage; o_proj and down_proj have no foldable predecessor at all. Instead we keep
    every non-quantized tensor bit-identical and the graph unchanged, and use s where it matters:
    a quantization error on column k reaches the output multiplied by x_k, so the expected output
    error of a row is ~ sum_k (dW_k)^2 E[x_k^2]. Each group's clip range is therefore chosen to
    minimize sum_k s_k^2 (dW_k)^2, and alpha (0 = plain weight error) is picked per layer by the
    real output error ||(W - W_q) X^T||^2 on the sampled calibration rows X. Returns
    (tensor, alpha chosen).
    """
    w = as_f32(w)
    mean_abs = np.asarray(stats.mean_abs, np.float64).reshape(-1)
    if mean_abs.shape[0] != w.shape[1]:
        raise ValueError(f"activation stats have {mean_abs.shape[0]} channels, the weight has K={w.shape[1]}")
    if scheme.format == "fp8":
        return quantize_weight(w, scheme), 0.0   # fp8 has no clip range to search
    m = np.maximum(mean_abs, 1e-8)
    x = stats.sample
    best = None
    for a in alphas:
        s = m ** a
        imp = (s * s / np.mean(s * s)).astype(np.float32)   # normalized: only ratios between channels matter
        t = quantize_weight(w, scheme, clip_search=True, importance=None if a == 0 else imp)
        if x is None or len(x) == 0:
            err = weighted_error(w, t, m * m)
        else:
            d = (dequantize(t) - w).astype(np.float64) @ np.asarray(x, np.float64).T
            err = float(np.sum(d * d))
        if best is None or err < best[0]:
            best = (err, t, float(a))
    return best[1], best[2]
