"""`deepinfer quantize SRC DST --format int4|int8|fp8 [--group N] [--asym] [--calibration FILE]`.

Writes a new hub-style directory: config.json with `quantization_config` (see quant_formats),
the tokenizer and every other non-weight file copied byte for byte, and safetensors shards with
`model.safetensors.index.json`. The linear weights of attention, MLP / experts and the MTP
projection are quantized; embeddings, norms, the router, its correction bias and lm_head keep
their dtype. SRC is only read. DST is built in a hidden sibling directory and renamed into place
as the very last step, so an interrupted run leaves nothing at DST that a loader would accept;
an existing DST is never overwritten.

Rounding is not the only choice: for int8 and int4 each scale group's clipping range is searched
over a grid of shrink factors (AWQ's clip search), keeping the factor with the least squared
reconstruction error. The grid contains 1.0, computed exactly as plain absmax quantization, so the
search can never do worse than absmax. With --calibration, the error is weighted per input channel
by an activation importance (mean |x|)^(2*alpha), alpha searched per layer on real activations:
see quantize_weight_calibrated for why weighting was chosen over folding scales into norms.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import secrets
import shutil
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import ml_dtypes
import numpy as np

from . import abi
from . import dtypes as D
from . import quant_formats as QF
from . import validate as V
from .errors import CheckpointError, ConfigError, DeepinferError, InputError
from .model.checkpoint import TensorStore
from .tensor import Quant, Tensor, pack_4bit


INT4_CLIP_GRID = tuple(np.round(np.linspace(1.0, 0.5, 11), 4))    # 1.0, 0.95, ..., 0.5
INT8_CLIP_GRID = tuple(np.round(np.linspace(1.0, 0.8, 11), 4))    # int8 has 16x the levels: clip less
AWQ_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_CALIB_TOKENS = 16             # fewer tokens than this (a rarely routed expert): too few to fit alpha on
ROW_CHUNK = 512                    # rows quantized at a time: bounds the search's temporaries
DEFAULT_SHARD_BYTES = 2 * 1024**3

# ============================================================================ the math


def _as_f32(w) -> np.ndarray:
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
    w = _as_f32(w)
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
    w = _as_f32(w)
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
    from deepinfer.reference.quant import dequantize_array

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
    w = _as_f32(w)
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


# ============================================================================ checkpoints

_ST_NAME = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
}


def write_safetensors(path: Path, tensors: dict, metadata: Optional[dict] = None) -> int:
    """Writes a safetensors file (8-byte header length, JSON header padded to 8 bytes, data).
    Returns the bytes of tensor data written."""
    header, off, order = {}, 0, []
    for name, a in tensors.items():
        a = np.asarray(a)
        if a.dtype not in _ST_NAME:
            raise ValueError(f"{name}: dtype {a.dtype} has no safetensors name")
        nb = a.size * a.dtype.itemsize
        header[name] = {"dtype": _ST_NAME[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + nb]}
        order.append((name, a))
        off += nb
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, a in order:
            f.write(np.ascontiguousarray(a).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return off


class _ShardWriter:
    """Collects tensors into shards of at most `shard_bytes` and writes the index at the end."""

    def __init__(self, out_dir: Path, shard_bytes: int):
        self.dir, self.limit = out_dir, shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, a: np.ndarray) -> None:
        nb = a.size * a.dtype.itemsize
        if self.pending and self.pending_bytes + nb > self.limit:
            self._flush()
        self.pending[name] = a
        self.pending_bytes += nb

    def _flush(self) -> None:
        if not self.pending:
            return
        i = len(self.shards)
        write_safetensors(self.dir / f"shard-{i:05d}.tmp", self.pending, {"format": "pt"})
        self.shards.append(list(self.pending))
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict:
        self._flush()
        n = max(len(self.shards), 1)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f"shard-{i:05d}.tmp", self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return index


def _source_weight(src, name: str, src_scheme) -> np.ndarray:
    """A weight's real values in f32 (an fp8 / deepinfer-quantized source is dequantized first)."""
    a = src.array(name)
    if a.dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        return _as_f32(a)
    t = QF.weight_from_checkpoint(src.array, name, src_scheme, has_tensor=src.__contains__)
    return dequantize(t)


_QUANT_SIDE_SUFFIXES = ("_scale_inv", "_scale", "_zero", "_shape")


def quantize_model(src, dst, format: str, group: int = 64, symmetric: bool = True, calibration=None,
                   scale_dtype: str = "f32", clip_search: bool = True, shard_bytes: int = DEFAULT_SHARD_BYTES,
                   activation_stats: Optional[dict] = None, progress: bool = False,
                   source_name: Optional[str] = None) -> dict:
    """Writes a quantized copy of the model directory `src` to the new directory `dst`.

    calibration: a text file; its tokens are run through the source model to get each linear's
    input statistics (see collect_activation_stats). activation_stats: the same statistics given
    directly ({weight name: ActivationStats}); used as is when given. source_name: what the user
    called SRC (a hub id), recorded beside its path in quantization_config.source so that
    `deepinfer eval-ppl DST` measures against it. Returns a summary dict.
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if format not in QF.FORMATS:
        raise ConfigError(f"--format must be one of {QF.FORMATS}, not {format!r}")
    if format == "int4" and group not in QF.GROUP_SIZES:
        raise ConfigError(f"--group must be one of {QF.GROUP_SIZES}, not {group}")
    if not symmetric and format != "int4":
        raise ConfigError("--asym applies to int4 only (int8 and fp8 are symmetric)")
    if not src.is_dir():
        raise CheckpointError(f"source model directory {src} does not exist")
    if dst.exists() or dst.is_symlink():
        raise ConfigError(f"destination {dst} already exists; deepinfer quantize never overwrites (remove it or "
                          f"choose another path)")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise ConfigError(f"destination {dst} must not be inside the source directory {src}")
    cfg_path = src / "config.json"
    config = V.read_json(cfg_path, "config.json", err=CheckpointError, fix="SRC must be a model directory")
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object, not {V.json_kind(config)}")
    src_scheme = QF.parse_quantization_config(config.get("quantization_config"), f"{cfg_path}: quantization_config")
    scheme = QF.make_scheme(format, group if format == "int4" else 64, symmetric, scale_dtype)
    # SRC's tensors by hub-layout name: routed experts stored per expert or fused alike
    ckpt = TensorStore(src, src_scheme)

    stats = dict(activation_stats or {})
    if calibration is not None and not activation_stats:
        stats = collect_activation_stats(src, Path(calibration))

    try:
        return _write_quantized(src, dst, config, scheme, src_scheme, ckpt, stats, calibration, clip_search,
                                shard_bytes, progress, source_name)
    except OSError as e:
        raise _io_error(e, src, dst) from None


def _write_quantized(src: Path, dst: Path, config: dict, scheme, src_scheme, ckpt, stats: dict, calibration,
                     clip_search: bool, shard_bytes: int, progress: bool, source_name: Optional[str]) -> dict:
    """quantize_model's output: built in a partial directory beside DST, renamed into place last."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(dst)
    tmp = _new_partial_dir(dst)
    t0 = time.time()
    summary = {"format": scheme.describe(), "quantized": 0, "kept": 0, "alphas": {}, "source_bytes": 0,
               "dest_bytes": 0}
    try:
        # every file that is not a weight shard is copied as is (tokenizer, generation config, code, ...)
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_dir() or rel.as_posix() in ckpt.weight_files or rel.as_posix() == "config.json":
                continue
            if len(rel.parts) == 1 and (p.suffix == ".safetensors" or p.name.startswith("pytorch_model")
                                        or p.name.startswith("consolidated.")):
                continue  # other copies of the weights (stray shards, .bin, .pth) would be stale and large
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, tmp / rel)
        writer = _ShardWriter(tmp, shard_bytes)
        names = ckpt.names()
        side = {n + s for n in names for s in _QUANT_SIDE_SUFFIXES if n.endswith(".weight")}
        todo = [n for n in names if n not in side]
        for i, name in enumerate(todo):
            shape = ckpt.shape(name)
            summary["source_bytes"] += sum(ckpt.array(n).nbytes for n in (name, *(name + x for x in _QUANT_SIDE_SUFFIXES))
                                           if n in ckpt)
            if QF.is_quantizable(name, shape) and QF.is_converted(name, scheme):
                w = _source_weight(ckpt, name, src_scheme)
                st = stats.get(name)
                try:
                    if st is not None and st.tokens >= MIN_CALIB_TOKENS:
                        t, alpha = quantize_weight_calibrated(w, scheme, st)
                        summary["alphas"][name] = alpha
                    else:
                        t = quantize_weight(w, scheme, clip_search=clip_search)
                except ValueError as e:
                    raise CheckpointError(f"{src}: cannot quantize {name!r} {list(w.shape)}: {e}") from None
                for k, a in QF.weight_to_checkpoint(name, t).items():
                    writer.add(k, a)
                    summary["dest_bytes"] += a.nbytes
                summary["quantized"] += 1
            else:
                a = ckpt.array(name)
                if a.dtype in (ml_dtypes.float8_e4m3fn, np.int8, np.uint8) and name.endswith(".weight") and (
                        name + "_scale_inv" in ckpt or name + "_scale" in ckpt):
                    # a quantized source weight we do not re-quantize (not a linear we convert): dequantize to bf16
                    a = _source_weight(ckpt, name, src_scheme).astype(ml_dtypes.bfloat16)
                writer.add(name, np.asarray(a))
                summary["kept"] += 1
                summary["dest_bytes"] += a.nbytes
            if progress and (i % 50 == 0 or i == len(todo) - 1):
                print(f"deepinfer quantize: {i + 1}/{len(todo)} tensors ({time.time() - t0:.0f} s)", file=sys.stderr,
                      flush=True)
        writer.finish()
        new_cfg = dict(config)
        new_cfg["quantization_config"] = scheme.to_config()
        if stats:
            new_cfg["quantization_config"]["calibration"] = {
                "file": Path(calibration).name if calibration else None, "layers": len(summary["alphas"])}
        # what DST was made from: eval-ppl compares against it (the quantization's error included)
        new_cfg["quantization_config"]["source"] = {"model": source_name or str(src), "path": str(src.resolve())}
        (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
        _fsync_dir(tmp)
        # the one step that makes DST exist: atomic on one filesystem, and it fails if DST appeared
        # meanwhile, even as an empty directory (which a plain rename would silently replace)
        try:
            _rename_noreplace(tmp, dst)
        except FileExistsError:
            raise ConfigError(f"destination {dst} appeared while quantizing; the result was discarded") from None
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary["seconds"] = round(time.time() - t0, 2)
    return summary


# ---------------------------------------------------------------------------- the output directory
# A run writes into `.DST.partial-HOST.PID.TOKEN` beside DST. The name says whose it is, so a later
# run can remove what a killed one left (same host, process gone) without touching a live run's.

def _partial_prefix(dst: Path) -> str:
    return f".{dst.name}.partial-"


def _new_partial_dir(dst: Path) -> Path:
    """A fresh partial directory; os.mkdir applies the umask (tempfile.mkdtemp would force 0700)."""
    p = dst.parent / f"{_partial_prefix(dst)}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    os.mkdir(p, 0o777)
    return p


def _remove_stale_partials(dst: Path) -> None:
    """Removes partial directories of earlier runs for DST whose process is gone; names the ones
    whose owner cannot be told (another host, or an older deepinfer's nameless ones)."""
    prefix, host = _partial_prefix(dst), socket.gethostname()
    unknown = []
    for p in dst.parent.glob(glob.escape(prefix) + "*"):
        h, _, rest = p.name[len(prefix):].rpartition(".")[0].rpartition(".")
        pid = int(rest) if rest.isdigit() else None
        if h != host or pid is None:
            unknown.append(p)
        elif not _process_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            print(f"deepinfer quantize: removed {p}, left by a run that was stopped (process {pid})",
                  file=sys.stderr)
    if unknown:
        print(f"deepinfer quantize: partial output of other runs: {', '.join(map(str, unknown))} (remove them "
              f"if no deepinfer quantize to {dst} is running)", file=sys.stderr)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # it exists, under another user
        return True
    return True


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails with FileExistsError if DST exists, even as an empty directory.

    Linux's renameat2(RENAME_NOREPLACE) closes the race atomically; where it is missing (another
    OS, a filesystem without the flag) a check just before the rename leaves a gap of microseconds."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd, rename_noreplace = -100, 1
        if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _io_error(e: OSError, src: Path, dst: Path) -> DeepinferError:
    """An OSError of a run as an error that says what to do (nothing is left at DST)."""
    where = f" ({e.filename})" if e.filename else ""
    if e.filename and Path(os.fsdecode(e.filename)).resolve().is_relative_to(src.resolve()):
        return CheckpointError(f"cannot read the source {e.filename}: {e.strerror or e}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DeepinferError(f"no space left on the device while writing {dst}{where}; free space or choose "
                              f"another destination (nothing was written at {dst})")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT, errno.ENAMETOOLONG,
                   errno.EEXIST):   # EEXIST: mkdir of a parent that is a file
        return InputError(f"cannot write {dst}: {e.strerror}{where}; choose a writable destination")
    return DeepinferError(f"writing {dst} failed: {e.strerror or e}{where} (nothing was written at {dst})")


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ============================================================================ calibration


def collect_activation_stats(src: Path, text_file: Path, max_tokens: int = 512, sample_rows: int = 128,
                             seq_len: int = 256) -> dict:
    """Runs `text_file` through the source model and records, for each linear we quantize, the
    mean |x| of its input channels and a subsample of input rows ({weight name: ActivationStats}).

    The forward pass is transformers' implementation of the same checkpoint (an independent
    implementation that loads DeepSeek V2/V3 hub directories on the CPU). Routed experts, which
    transformers 5 stores fused, are measured on the tokens actually routed to each expert.
    """
    text = V.read_text_file(text_file, "calibration file", err=ConfigError)
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError(f"--calibration needs torch and transformers to run the source model ({e})") from None
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{src}: calibration needs tokenizer.json")
    ids = Tokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids[:max_tokens]
    if not ids:
        raise ConfigError(f"calibration file {text_file} gives no tokens")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report lists our MTP layer as "unexpected": it is, for it
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    except Exception as e:  # transformers raises many types for checkpoints it cannot read
        raise CheckpointError(f"calibration: transformers cannot load {src} ({type(e).__name__}: {e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    acc: dict[str, list] = {}
    rng = np.random.default_rng(0)

    def record(name: str, x) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().numpy()
        if x.shape[0] == 0:
            return
        e = acc.setdefault(name, [np.zeros(x.shape[1]), 0, []])
        e[0] += np.abs(x).sum(0)
        e[1] += x.shape[0]
        e[2].append(x[rng.permutation(x.shape[0])[:sample_rows]])

    hooks = []
    for mod_name, mod in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf in QF.QUANTIZED_LINEARS:
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, n=mod_name + ".weight": record(n, args[0])))
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and not isinstance(mod, torch.nn.Linear):
            def experts_hook(m, args, prefix=mod_name):
                hidden, top_idx = args[0], args[1]
                for e in range(m.gate_up_proj.shape[0]):
                    rows = (top_idx == e).any(-1).nonzero().flatten()
                    if rows.numel() == 0:
                        continue
                    x = hidden[rows]
                    record(f"{prefix}.{e}.gate_proj.weight", x)
                    record(f"{prefix}.{e}.up_proj.weight", x)
                    gate, up = torch.nn.functional.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
                    record(f"{prefix}.{e}.down_proj.weight", m.act_fn(gate) * up)
            hooks.append(mod.register_forward_pre_hook(experts_hook))
    try:
        with torch.no_grad():
            for s in range(0, len(ids), seq_len):
                model(torch.tensor([ids[s:s + seq_len]]))
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, (sum_abs, count, samples) in acc.items():
        sample = np.concatenate(samples)
        sample = sample[rng.permutation(sample.shape[0])[:sample_rows]]
        out[name] = ActivationStats((sum_abs / count).astype(np.float32), sample.astype(np.float32), count)
    return out


# ============================================================================ CLI


def main(args) -> int:
    """Entry of `deepinfer quantize` (args: src (a directory or hub id), dst, format, group, asym,
    calibration, revision)."""
    from .model.hub import resolve_model

    src = resolve_model(args.src, getattr(args, "revision", None))
    summary = quantize_model(src, args.dst, args.format, group=args.group, symmetric=not args.asym,
                             calibration=args.calibration, progress=True, source_name=args.src)
    gb = lambda b: b / 1e9  # noqa: E731
    print(f"deepinfer quantize: wrote {args.dst} ({summary['format']}): {summary['quantized']} weights "
          f"quantized, {summary['kept']} tensors kept; {gb(summary['source_bytes']):.3f} GB -> "
          f"{gb(summary['dest_bytes']):.3f} GB in {summary['seconds']} s")
    if summary["alphas"]:
        vals, counts = np.unique(list(summary["alphas"].values()), return_counts=True)
        print("  activation-aware alpha per layer: " + ", ".join(f"{v:g} x{c}" for v, c in zip(vals, counts)))
    return 0
