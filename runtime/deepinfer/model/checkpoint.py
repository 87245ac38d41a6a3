"""Reading a hub checkpoint: config.json plus model.safetensors or shards listed in
model.safetensors.index.json.

Files are memory-mapped read-only (never unpickled, never written). Each safetensors header is
checked against the file before anything is mapped: the 8-byte length, the JSON, every tensor's
dtype, shape and data offsets, and that the data lies inside the file; so a truncated download is
reported by name instead of crashing a kernel later. FP8 weights of the official DeepSeek format
(`weight` in e4m3 plus `weight_scale_inv`, one f32 per 128x128 block) become one quantized Tensor
with Quant(scales, (128, 128)), which backends consume as is.

Two layouts of routed experts are read, and the rest of the engine sees only the first:
  hub    one tensor per expert: `mlp.experts.{e}.{gate,up,down}_proj.weight` (+ `weight_scale_inv`
         for fp8), as DeepSeek publishes and as transformers 5 writes by default;
  fused  one tensor per layer, as transformers 5 holds them in memory and writes with
         `save_pretrained(..., save_original_format=False)` (and early 5.x releases by default):
         `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
         `mlp.experts.down_proj` [E, H, I]; fp8 adds `gate_up_proj_scale_inv` [E, 2I/128, H/128]
         and `down_proj_scale_inv` [E, H/128, I/128] (transformers' integrations/finegrained_fp8.py).
A fused tensor is presented under the hub names of its experts, each a view into the memory map
(`gate_up_proj[e, :I]` is contiguous), so one expert loads alone without reading the others.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
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


_FUSED = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)$")
_SCALE = "_scale_inv"


@dataclass(frozen=True)
class _ExpertView:
    """A hub-layout name that is a slice of a fused tensor: stored[expert, rows[0]:rows[1]]."""

    stored: str
    expert: int
    rows: tuple[int, int]


class TensorStore:
    """Every tensor of a model directory by its hub-layout name, without reading data up front.

    `names()` are the logical names (fused expert tensors appear as their per-expert names);
    `array(name)` is a read-only memory-mapped view. `quant_scheme` (the checkpoint's QuantScheme,
    None for float weights) gives the row height of fp8 scale blocks, needed to split fused
    gate_up scales between gate and up.
    """

    def __init__(self, model_dir, quant_scheme=None):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model directory {self.dir} does not exist")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}     # stored name -> file
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
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
            self.weight_files = {index.name, *self.files}
        elif single.is_file():
            f = SafetensorsFile(single)
            self.files[single.name] = f
            for name in f.keys():
                self.where[name] = f
            self.weight_files = {single.name}
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self.views: dict[str, _ExpertView] = {}
        self._fused: set[str] = set()
        fp8 = quant_scheme is not None and quant_scheme.format == "fp8"
        block_rows = int(quant_scheme.block[0]) if fp8 else 128
        for name in list(self.where):
            m = _FUSED.match(name)
            if m is not None:
                self._add_fused(name, m["prefix"], m["proj"], block_rows)
        self._names = [n for n in self.where if n not in self._fused] + list(self.views)

    # ------------------------------------------------------------------ fused experts
    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].entries[name][1]

    def _add_fused(self, name: str, prefix: str, proj: str, block_rows: int) -> None:
        shape = self._stored_shape(name)
        path = self.where[name].path
        if len(shape) != 3:
            raise CheckpointError(f"{path}: fused expert tensor {name!r} has shape {list(shape)}; expected "
                                  f"[experts, rows, cols]")
        E, R, _ = shape
        if proj == "gate_up_proj":
            if R % 2:
                raise CheckpointError(f"{path}: fused expert tensor {name!r} has {R} rows; gate_up_proj holds "
                                      f"the gate rows then the up rows, so it needs an even count")
            I = R // 2
            parts = {"gate_proj": (0, I), "up_proj": (I, R)}
        else:
            parts = {proj: (0, R)}
        scale = name + _SCALE
        sshape = self._stored_shape(scale) if scale in self.where else None
        if sshape is not None:
            if len(sshape) != 3 or sshape[0] != E:
                raise CheckpointError(f"{self.where[scale].path}: {scale!r} has shape {list(sshape)}; expected "
                                      f"[{E}, row blocks, column blocks] for {name!r} {list(shape)}")
            if proj == "gate_up_proj":
                if I % block_rows or sshape[1] != R // block_rows:
                    raise CheckpointError(
                        f"{path}: fused fp8 expert tensor {name!r} {list(shape)}: its gate and up halves ({I} rows "
                        f"each) do not fall on separate {block_rows}-row scale blocks ({scale!r} has shape "
                        f"{list(sshape)}), so an expert's gate and up scales cannot be told apart. Save this model "
                        f"per expert (transformers: save_pretrained(..., save_original_format=True)).")
            elif sshape[1] != -(-R // block_rows):
                raise CheckpointError(f"{self.where[scale].path}: {scale!r} has {sshape[1]} row blocks; {name!r} "
                                      f"with {R} rows needs {-(-R // block_rows)} of {block_rows} rows")
            self._fused.add(scale)
        self._fused.add(name)
        for part, (lo, hi) in parts.items():
            for e in range(E):
                hub = f"{prefix}{e}.{part}.weight"
                views = {hub: _ExpertView(name, e, (lo, hi))}
                if sshape is not None:
                    views[hub + _SCALE] = _ExpertView(scale, e, (lo // block_rows, -(-hi // block_rows)))
                for v, view in views.items():
                    if v in self.where:
                        raise CheckpointError(f"{self.dir}: expert tensor {v!r} is stored both on its own (in "
                                              f"{self.where[v].path.name}) and inside the fused {view.stored!r}; "
                                              f"keep one layout")
                    self.views[v] = view

    # ------------------------------------------------------------------ lookup
    def __contains__(self, name: str) -> bool:
        return name in self.views or (name in self.where and name not in self._fused)

    def names(self) -> list[str]:
        """Logical (hub-layout) tensor names, fused expert tensors split per expert."""
        return list(self._names)

    keys = names

    @property
    def layout(self) -> str:
        """'hub', 'fused', or 'mixed' (some layers fused): how routed experts are stored."""
        per_expert = any(".experts." in n and n not in self.views for n in self._names)
        if not self.views:
            return "hub"
        return "mixed" if per_expert else "fused"

    def _resolve(self, name: str):
        if name in self.views:
            return self.views[name]
        if name in self.where and name not in self._fused:
            return None
        raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")

    def file_of(self, name: str) -> Path:
        v = self._resolve(name)
        return self.where[v.stored if v is not None else name].path

    def shape(self, name: str) -> tuple[int, ...]:
        v = self._resolve(name)
        if v is None:
            return self._stored_shape(name)
        return (v.rows[1] - v.rows[0],) + self._stored_shape(v.stored)[2:]

    def entries(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """{logical name: (dtype, shape)}, read from the headers only."""
        out = {}
        for n in self._names:
            v = self.views.get(n)
            stored = v.stored if v is not None else n
            out[n] = (self.where[stored].entries[stored][0], self.shape(n))
        return out

    def array(self, name: str, shape=None) -> np.ndarray:
        """The raw (memory-mapped, read-only) array of a tensor; checks its shape when given. An
        expert of a fused tensor is a view into the fused tensor's mapping, never a copy."""
        v = self._resolve(name)
        if v is None:
            a = self.where[name].array(name)
        else:
            a = self.where[v.stored].array(v.stored)[v.expert, v.rows[0]:v.rows[1]]
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r}{self._origin(name)} has shape "
                                  f"{list(a.shape)}, the config needs {list(shape)}")
        return a

    def _origin(self, name: str) -> str:
        v = self.views.get(name)
        return "" if v is None else f" (expert {v.expert} of the fused {v.stored!r} {list(self._stored_shape(v.stored))})"


class Checkpoint(TensorStore):
    """A model directory: the config and every tensor by (hub-layout) name."""

    def __init__(self, model_dir):
        d = Path(model_dir)
        if not d.is_dir():
            raise CheckpointError(f"model directory {d} does not exist")
        self.config = ModelConfig.from_file(d / "config.json")
        super().__init__(d, self.config.quant_scheme)

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

        if name not in self:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            t = QF.weight_from_checkpoint(self.array, name, self.config.quant_scheme, shape=shape,
                                          has_tensor=self.__contains__)
        except CheckpointError as e:
            raise CheckpointError(f"{self.file_of(name)}: {e}{self._origin(name)}") from None
        if t.quant is None and dtype is not None and t.dtype.name != D.get(dtype).name:
            return self.tensor(name, shape, dtype)
        return t
