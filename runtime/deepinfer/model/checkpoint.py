"""Reading a hub checkpoint: config.json plus model.safetensors or shards listed in
model.safetensors.index.json.

Files are memory-mapped read-only (never unpickled, never written). Each safetensors header is
checked against the file before anything is mapped: the 8-byte length, the JSON, every tensor's
dtype, shape and data offsets, and that the data lies inside the file; so a truncated download is
reported by name instead of crashing a kernel later. FP8 weights of the official DeepSeek format
(`weight` in e4m3 plus `weight_scale_inv`, one f32 per 128x128 block) become one quantized Tensor
with Quant(scales, (128, 128)), which backends consume as is.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Optional

import ml_dtypes
import numpy as np

from .. import dtypes as D
from ..errors import CheckpointError
from ..tensor import Quant, Tensor
from .config import ModelConfig

_ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One validated, memory-mapped safetensors file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        if size < 8:
            raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header length)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{self.path}: corrupt or truncated safetensors file (header length {n} "
                                      f"does not fit in {size} bytes)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dt_name, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has a malformed header entry") from None
            if dt_name not in _ST_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unknown dtype {dt_name!r}")
            dt = _ST_DTYPES[dt_name]
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape) or not (0 <= b <= end):
                raise CheckpointError(f"{self.path}: tensor {name!r} has a malformed shape or offsets")
            if end - b != math.prod(shape) * dt.itemsize:
                raise CheckpointError(f"{self.path}: tensor {name!r}: data_offsets [{b}, {end}) hold {end - b} bytes, "
                                      f"but {dt_name}{list(shape)} needs {math.prod(shape) * dt.itemsize}")
            if end > data_len:
                raise CheckpointError(f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte "
                                      f"{self.data_start + end} but the file has {size} bytes")
            self.entries[name] = (dt, shape, b, end)
        self._map: Optional[np.memmap] = None
        self._size = size

    def _mapped(self) -> np.ndarray:
        if self._map is None:
            if self._size > self.data_start:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start)
            else:
                self._map = np.zeros(0, np.uint8)
        return self._map

    def array(self, name: str) -> np.ndarray:
        dt, shape, b, end = self.entries[name]
        if end == b:
            return np.zeros(shape, dt)
        return self._mapped()[b:end].view(dt).reshape(shape)

    def keys(self):
        return self.entries.keys()


class Checkpoint:
    """A model directory: the config and every tensor by name, without reading data up front."""

    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model directory {self.dir} does not exist")
        self.config = ModelConfig.from_file(self.dir / "config.json")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            for name, fname in weight_map.items():
                if fname not in self.files:
                    p = self.dir / fname
                    if not p.is_file():
                        raise CheckpointError(f"{index}: shard {fname} (holding {name}) is missing")
                    self.files[fname] = SafetensorsFile(p)
                f = self.files[fname]
                if name not in f.entries:
                    raise CheckpointError(f"{f.path}: tensor {name!r} listed in {index.name} is not in the file")
                self.where[name] = f
        elif single.is_file():
            f = SafetensorsFile(single)
            self.files[single.name] = f
            for name in f.keys():
                self.where[name] = f
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self):
        return self.where.keys()

    def array(self, name: str, shape=None) -> np.ndarray:
        """The raw (memory-mapped, read-only) array of a tensor; checks its shape when given."""
        f = self.where.get(name)
        if f is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        a = f.array(name)
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{f.path}: tensor {name!r} has shape {list(a.shape)}, the config needs "
                                  f"{list(shape)}")
        return a

    def file_of(self, name: str) -> Path:
        return self.where[name].path

    def tensor(self, name: str, shape, dtype: Optional[str] = None) -> Tensor:
        """A plain float tensor (norms, embeddings, biases), cast to `dtype` when it differs."""
        a = self.array(name, shape)
        if a.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r} has dtype {a.dtype}, expected a float")
        if dtype is not None and a.dtype != D.get(dtype).np:
            # a load-time format conversion, not model math: the backend sees one dtype per model
            a = a.astype(D.get(dtype).np)
        return Tensor.from_numpy(a)

    def weight(self, name: str, shape, dtype: Optional[str] = None) -> Tensor:
        """A linear weight [N, K]: plain float (cast to `dtype` when given), or quantized as stored
        (official fp8 e4m3 with 128x128 scales, or deepinfer's int8 / int4 formats; see
        quant_formats) with its Quant, consumed by backends as is."""
        from .. import quant_formats as QF

        if name not in self.where:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            t = QF.weight_from_checkpoint(self.array, name, self.config.quant_scheme, shape=shape,
                                          has_tensor=self.__contains__)
        except CheckpointError as e:
            raise CheckpointError(f"{self.file_of(name)}: {e}") from None
        if t.quant is None and dtype is not None and t.dtype.name != D.get(dtype).name:
            return self.tensor(name, shape, dtype)
        return t
