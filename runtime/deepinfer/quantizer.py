"""`deepinfer quantize SRC DST --format int4|int8|fp8 [--group N] [--asym] [--calibration FILE]`.

Writes a new hub-style directory: config.json with `quantization_config` (see quant_formats),
the tokenizer and every other non-weight file copied byte for byte, and safetensors shards with
`model.safetensors.index.json`. The linear weights of attention, MLP / experts and the MTP
projection are quantized; embeddings, norms, the router, its correction bias and lm_head keep
their dtype. SRC is only read. DST is built in a hidden sibling directory and renamed into place
as the very last step, so an interrupted run leaves nothing at DST that a loader would accept;
an existing DST is never overwritten.

The quantize math of one weight is weight_quant.py, the calibration pass calibration.py; their
names stay importable from here.
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
from pathlib import Path
from typing import Optional

import ml_dtypes
import numpy as np

from . import quant_formats as QF
from . import validate as V
from .calibration import collect_activation_stats
from .errors import CheckpointError, ConfigError, DeepinferError, InputError
from .model.checkpoint import TensorStore
from .model.hub import resolve_model
from .weight_quant import (AWQ_ALPHAS, INT4_CLIP_GRID, INT8_CLIP_GRID, MIN_CALIB_TOKENS, ROW_CHUNK, ActivationStats,
                           as_f32, dequantize, quantize_groups, quantize_weight, quantize_weight_calibrated,
                           weighted_error)

__all__ = [
    "AWQ_ALPHAS", "DEFAULT_SHARD_BYTES", "INT4_CLIP_GRID", "INT8_CLIP_GRID", "MIN_CALIB_TOKENS", "ROW_CHUNK",
    "ActivationStats", "collect_activation_stats", "dequantize", "main", "quantize_groups", "quantize_model",
    "quantize_weight", "quantize_weight_calibrated", "weighted_error", "write_safetensors",
]

DEFAULT_SHARD_BYTES = 2 * 1024**3

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
        return as_f32(a)
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


# ============================================================================ CLI


def main(args) -> int:
    """Entry of `deepinfer quantize` (args: src (a directory or hub id), dst, format, group, asym,
    calibration, revision)."""
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
