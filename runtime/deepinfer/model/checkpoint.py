"""Reading a hub checkpoint: config.json plus model.safetensors or shards listed in
model.safetensors.index.json.

Files are memory-mapped read-only (never unpickled, never written). Each safetensors header is
checked against the file before anything is mapped: the 8-byte length, the JSON, every tensor's
dtype, shape and data offsets, and that the data lies inside the file; so a truncated download is
reported by name instead of crashing a kernel later. FP8 weights of the official DeepSeek format
(`weight` in e4m3 plus `weight_scale_inv`, one f32 per 128x128 block) become one quantized Tensor
with Quant(scales, (128, 128)), which backends consume as is. DeepSeek V4's release adds ue8m0
scales (F8_E8M0) and fp4 routed experts (I8 [N, K/2], two e2m1 per byte, with F8_E8M0 scales per
row and 32 columns); quant_formats describes both.

Two layouts of routed experts are read, and the rest of the engine sees only the first:
  hub    one tensor per expert: `mlp.experts.{e}.{gate,up,down}_proj.weight` (+ `weight_scale_inv`
         for fp8), as DeepSeek publishes and as transformers 5 writes by default;
  fused  one tensor per layer, as transformers 5 holds them in memory and writes with
         `save_pretrained(..., save_original_format=False)` (and early 5.x releases by default):
         `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
         `mlp.experts.down_proj` [E, H, I]; fp8 adds `gate_up_proj_scale_inv` [E, 2I/128, H/128]
         and `down_proj_scale_inv` [E, H/128, I/128] (transformers' integrations/finegrained_fp8.py);
         fp4 experts (I8 [E, 2I, H/2], [E, H, I/2]) have a scale row per weight row
         ([E, 2I, H/32], [E, H, I/32]).
A fused tensor is presented under the hub names of its experts, each a view into the memory map
(`gate_up_proj[e, :I]` is contiguous), so one expert loads alone without reading the others.
"""
from __future__ import annotations

import functools
import math
import os
import re
import reprlib
import stat
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

import ml_dtypes
import numpy as np

from .. import dtypes as D
from .. import quant_formats as QF
from .. import validate as V
from ..errors import CheckpointError
from ..tensor import Quant, Tensor
from . import v4_names
from .config import ModelConfig

_ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    # ue8m0 block scales (DeepSeek V4, transformers' scale_fmt "ue8m0"): torch.float8_e8m0fnu
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024
# numpy 1.x's limit on dimensions; model tensors have a handful
_MAX_NDIM = 32
# numpy's arrays hold fewer than 2^63 bytes, counting the non-zero dims of an empty one too
_MAX_BYTES = 2 ** 62
_REDOWNLOAD = "the file is damaged or not a safetensors file: download it again"


def _is_count(v) -> bool:
    """A size or offset as the format stores it: an integer (not a bool) in [0, 2^63)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63


class SafetensorsFile:
    """One validated, memory-mapped safetensors file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size, raw = self._read_header()
        header = V.parse_json(raw, f"{self.path}: corrupt safetensors header", err=CheckpointError, fix=_REDOWNLOAD)
        if not isinstance(header, dict):
            raise self._corrupt(f"the header is {V.json_kind(header)}, not a JSON object")
        self.metadata = self._metadata(header.pop("__metadata__", None))
        self.data_start = 8 + len(raw)
        data_len = size - self.data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            self.entries[name] = self._entry(name, e, data_len, size)
        self._check_overlaps()
        self._map: Optional[np.memmap] = None
        self._size = size

    def _corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors header: {what}; {_REDOWNLOAD}")

    def _read_header(self) -> tuple[int, bytes]:
        """(file size, header bytes), after checking the 8-byte length against the file."""
        try:
            info = self.path.stat()
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{self.path}: not a regular file; a weight shard must be a safetensors file")
            size = info.st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header length); "
                                      f"download it again")
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > _MAX_HEADER or 8 + n > size:
                    raise CheckpointError(f"{self.path}: corrupt or truncated safetensors file (header length {n} "
                                          f"does not fit in {size} bytes); download it again")
                return size, f.read(n)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read it ({e.strerror})") from None

    def _metadata(self, m) -> dict:
        # the format's __metadata__ maps strings to strings
        if m is None:
            return {}
        if not isinstance(m, dict) or not all(isinstance(v, str) for v in m.values()):
            raise self._corrupt(f"__metadata__ must be an object of strings, not {reprlib.repr(m)}")
        return m

    def _entry(self, name: str, e, data_len: int, size: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of one header entry, each field checked by type and range."""
        if not isinstance(e, dict):
            raise self._corrupt(f"tensor {name!r} has a malformed header entry {reprlib.repr(e)} (not an object)")
        dt_name, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt_name == "F4":
            # torch.float4_e2m1fn_x2 as safetensors writes it: the shape counts elements, two per byte
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype F4 (packed float4_e2m1fn_x2), which "
                                  f"deepinfer does not read; DeepSeek publishes fp4 weights as I8 [N, K/2] (two "
                                  f"e2m1 per byte, element 2i in the low nibble): store them that way")
        if not isinstance(dt_name, str) or dt_name not in _ST_DTYPES:
            raise self._corrupt(f"tensor {name!r} has unknown dtype {reprlib.repr(dt_name)}")
        if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(_is_count(s) for s in shape)):
            raise self._corrupt(f"tensor {name!r} has a malformed shape {reprlib.repr(shape)} (expected a list of at "
                                f"most {_MAX_NDIM} integers >= 0)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise self._corrupt(f"tensor {name!r} has malformed data_offsets {reprlib.repr(offsets)} (expected "
                                f"[begin, end] with 0 <= begin <= end)")
        dt, (b, end) = _ST_DTYPES[dt_name], offsets
        if math.prod(d for d in shape if d) * dt.itemsize >= _MAX_BYTES:
            raise self._corrupt(f"tensor {name!r} has an impossible shape {reprlib.repr(shape)} (over 2^62 bytes)")
        need = math.prod(shape) * dt.itemsize
        if end - b != need:
            raise self._corrupt(f"tensor {name!r}: data_offsets [{b}, {end}) hold {end - b} bytes, but "
                                f"{dt_name}{list(shape)} needs {need}")
        if end > data_len:
            raise CheckpointError(f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte "
                                  f"{self.data_start + end} but the file has {size} bytes; download it again")
        return dt, tuple(shape), b, end

    def _check_overlaps(self) -> None:
        """Each byte of data belongs to one tensor: a header whose tensors share bytes is corrupt
        (or made to alias weights). Sorted by offset, a tensor must start at or after the end of
        every one before it."""
        spans = sorted((b, end, name) for name, (_, _, b, end) in self.entries.items() if end > b)
        for (_, prev_end, prev), (b, end, name) in zip(spans, spans[1:]):
            if b < prev_end:
                raise self._corrupt(f"tensors {prev!r} and {name!r} overlap (bytes [{b}, {min(end, prev_end)}) "
                                    f"belong to both)")

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
_MAX_EXPERTS = 1 << 16     # DeepSeek V3 routes over 256


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

    def __init__(self, model_dir, quant_scheme=None, rename=None):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model directory {self.dir} does not exist")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}     # stored name -> file
        self.used: set[str] = set()                     # names array() has been asked for
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if os.path.lexists(index):
            for name, fname in _weight_map(confined(self.dir, index.name, str(index))).items():
                f = self.files.get(fname) or self._open_shard(index, fname, name)
                if name not in f.entries:
                    raise CheckpointError(f"{f.path}: tensor {name!r} listed in {index.name} is not in the file; the "
                                          f"index does not belong to this shard (download both again)")
                self.where[name] = f
            self.weight_files = {index.name, *self.files}
        elif os.path.lexists(single):
            f = SafetensorsFile(confined(self.dir, single.name, str(single)))
            self.files[single.name] = f
            for name in f.keys():
                self.where[name] = f
            self.weight_files = {single.name}
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        if rename is not None:
            self._rename(rename(list(self.where)))
        self.views: dict[str, _ExpertView] = {}
        self._fused: set[str] = set()
        fp8 = quant_scheme is not None and quant_scheme.format == "fp8"
        block_rows = int(quant_scheme.block[0]) if fp8 else 128
        for name in list(self.where):
            m = _FUSED.match(name)
            if m is not None:
                # fp4 experts (I8 in an fp8 checkpoint, DeepSeek V4) have one scale row per weight row
                fp4 = fp8 and self.where[name].entries[name][0] == np.int8
                self._add_fused(name, m["prefix"], m["proj"], 1 if fp4 else block_rows)
        self._names = [n for n in self.where if n not in self._fused] + list(self.views)

    def _rename(self, renames: dict) -> None:
        """Present stored tensors under other names ({stored: logical}; DeepSeek V4's own layout,
        model.v4_names): each file's entries are re-keyed, so every lookup sees the logical name."""
        if not renames:
            return
        where = {}
        for stored, f in self.where.items():
            name = renames.get(stored, stored)
            if name in where:
                raise CheckpointError(f"{self.dir}: tensors {stored!r} and another one both stand for {name!r}; "
                                      f"keep one layout of the checkpoint")
            where[name] = f
        for f in self.files.values():
            f.entries = {renames.get(n, n): e for n, e in f.entries.items()}
        self.where = where

    # ------------------------------------------------------------------ files
    def _open_shard(self, index: Path, fname: str, name: str) -> SafetensorsFile:
        p = confined(self.dir, fname, f"{index}: shard {fname!r} (holding {name!r})")
        if not os.path.isfile(p):     # False for any name the OS refuses too (one too long)
            raise CheckpointError(f"{index}: shard {fname} (holding {name}) is missing; download the model again")
        self.files[fname] = SafetensorsFile(p)
        return self.files[fname]

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
        if E > _MAX_EXPERTS:     # each expert gets a view: an absurd count would exhaust memory here
            raise CheckpointError(f"{path}: fused expert tensor {name!r} has shape {list(shape)}: {E} experts is no "
                                  f"model (at most {_MAX_EXPERTS}); the file is damaged, download it again")
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
        self.used.add(name)
        if v is None:
            a = self.where[name].array(name)
        else:
            a = self.where[v.stored].array(v.stored)[v.expert, v.rows[0]:v.rows[1]]
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r}{self._origin(name)} has shape "
                                  f"{list(a.shape)}, the config needs {list(shape)}")
        return a

    def file_range(self, a: np.ndarray):
        """(path, byte offset in the file) of a C-contiguous array that lies inside one of this
        checkpoint's memory maps (an `array()` view), else None (a copy, a cast, a repack): what lets
        the expert cache read a tensor's bytes straight from the file."""
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return None
        ptr, n = a.__array_interface__["data"][0], a.nbytes
        for f in self.files.values():
            m = f._map
            if m is None or not m.size:
                continue
            base = m.__array_interface__["data"][0]
            if base <= ptr and ptr + n <= base + m.nbytes:
                return f.path, f.data_start + (ptr - base)
        return None

    def _origin(self, name: str) -> str:
        v = self.views.get(name)
        return "" if v is None else f" (expert {v.expert} of the fused {v.stored!r} {list(self._stored_shape(v.stored))})"


def confined(model_dir: Path, rel: str, what: str) -> Path:
    """model_dir / rel, refused unless it is a file name inside the model directory whose target
    (through links too) is inside it: a downloaded model must not make deepinfer read other files
    of the machine. `what` names the reference in messages."""
    pure = PurePosixPath(rel)
    if not rel or "\0" in rel or pure.is_absolute() or ".." in pure.parts or not _encodable(rel):
        raise CheckpointError(f"{what}: not a file name inside the model directory {model_dir}; an index lists "
                              f"files of its own directory (fix the index or download the model again)")
    p = model_dir / rel
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:     # a link loop (RuntimeError before Python 3.13)
        raise CheckpointError(f"{what}: cannot resolve {p} ({e})") from None
    if not any(real == root or real.is_relative_to(root) for root in _weight_roots(model_dir)):
        raise CheckpointError(f"{what}: {p} links to {real}, outside the model directory {model_dir}; deepinfer "
                              f"reads a model only from inside its directory (copy the file there instead)")
    return p


def _encodable(name: str) -> bool:
    """Whether the OS can take `name` (a lone surrogate from JSON's \\ud800 cannot)."""
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


def _weight_roots(model_dir: Path) -> list[Path]:
    """Where the files of `model_dir` may really be: inside it, and for a snapshot of the Hugging
    Face cache (models--org--name/snapshots/<commit>, whose files are links to ../../blobs/<hash>)
    in the blobs of the same repository."""
    root = model_dir.resolve()
    if root.parent.name == "snapshots":
        return [root, root.parent.parent / "blobs"]
    return [root]


def _weight_map(index: Path) -> dict:
    """The index's {tensor name: shard file name}, checked for shape and types."""
    fix = f"fix {index.name} or download the model again"
    d = V.read_json(index, index.name, err=CheckpointError, fix=fix)
    if not isinstance(d, dict):
        raise CheckpointError(f"{index}: must hold a JSON object with a weight_map, not {V.json_kind(d)}; {fix}")
    wm = d.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        got = "it is missing" if wm is None else "it is empty" if wm == {} else f"not {V.json_kind(wm)}"
        raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file ({got}); "
                              f"{fix}")
    for name, fname in wm.items():
        if not isinstance(fname, str):
            raise CheckpointError(f"{index}: weight_map[{name!r}] = {reprlib.repr(fname)} is not a file name; {fix}")
    return wm


class Checkpoint(TensorStore):
    """A model directory: the config and every tensor by (hub-layout) name."""

    def __init__(self, model_dir):
        d = Path(model_dir)
        if not d.is_dir():
            raise CheckpointError(f"model directory {d} does not exist")
        self.config = ModelConfig.from_file(confined(d, "config.json", str(d / "config.json")))
        rename = None
        if self.config.v4 is not None:      # DeepSeek's own names; its MTP layers numbered after the main ones
            rename = functools.partial(v4_names.renames, num_layers=self.config.num_hidden_layers)
        super().__init__(d, self.config.quant_scheme, rename=rename)

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
        (official fp8 e4m3 with 128x128 scales, DeepSeek V4's fp4 e2m1 experts with e8m0 scales per
        32 columns, or deepinfer's int8 / int4 formats; see quant_formats) with its Quant, consumed
        by backends as is."""
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
