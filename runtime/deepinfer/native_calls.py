"""How NativeBackend turns an op call into one C call: keyword arguments marshalled into the op's
args struct (tensor descriptors filled once per tensor and cached), the workspace asked from
op_query, and calls prepared once for a plan to run many times.

NativeOpCalls is a part of NativeBackend (native_backend.py) and reads its state: _api, _ctx,
_lock, _check, _has, _alloc, _workspace, _stream_h, _device_type, _device_id, _desc_cache and
_array_cache.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

from . import abi
from .backend_base import Comm
from .errors import UnsupportedOpError
from .tensor import Tensor

ffi = abi.ffi
_DESC_SIZE = ffi.sizeof("DI_Tensor")


class NativeOpCalls:
    """Marshalling and calling ops on an ABI library (mixed into NativeBackend)."""

    # -- marshalling keyword arguments into the op's args struct
    def _fill_tensor(self, c, t: Optional[Tensor], keep: list, what: str) -> None:
        if t is None:
            return  # ffi.new zero-fills: data NULL = absent
        if not isinstance(t, Tensor):
            raise TypeError(f"{what} must be a deepinfer Tensor, got {type(t).__name__}")
        # every tensor's descriptor is filled once for its life (tensors are immutable views): a plan
        # for a new batch shape copies the weights' descriptors instead of marshalling them again
        hit = self.descriptor(t, what)
        ffi.memmove(ffi.addressof(c), hit[0], _DESC_SIZE)
        keep.append(hit)

    def descriptor(self, t: Tensor, what: str = "tensor"):
        """(DI_Tensor*, keep) of a tensor, marshalled once and cached for the tensor's life."""
        hit = self._desc_cache.get(t)
        if hit is None:
            d = ffi.new("DI_Tensor*")
            keep: list = []
            self._fill_new(d, t, keep, what)
            hit = (d, keep)
            self._desc_cache[t] = hit
        return hit

    def descriptor_array(self, ts: list, what: str):
        """A DI_Tensor[] of many long-lived tensors (an op's per-expert weights), shared by every plan
        that passes the same tensors; entries for None stay zero (data NULL: not resident)."""
        key = tuple(id(t) for t in ts)
        hit = self._array_cache.get(key)
        if hit is not None and all((r() if r is not None else None) is t for r, t in zip(hit[2], ts)):
            return hit
        arr = ffi.new("DI_Tensor[]", max(len(ts), 1))
        keep: list = [arr]
        refs = []
        for i, t in enumerate(ts):
            refs.append(weakref.ref(t) if t is not None else None)
            if t is None:
                continue
            d = self.descriptor(t, f"{what}[{i}]")
            ffi.memmove(ffi.addressof(arr, i), d[0], _DESC_SIZE)
            keep.append(d)
        hit = (arr, keep, refs)
        if len(self._array_cache) >= 256:   # drop arrays of tensors that are gone (a model closed)
            self._array_cache = {k: v for k, v in self._array_cache.items()
                                 if all(r is None or r() is not None for r in v[2])}
        self._array_cache[key] = hit
        return hit

    def _fill_new(self, c, t: Tensor, keep: list, what: str) -> None:
        if t.ndim > abi.MAX_DIMS:
            raise ValueError(f"{what} has {t.ndim} dims; the ABI allows {abi.MAX_DIMS}")
        c.data = ffi.cast("void*", t.data_ptr)
        c.device_type = abi.const("DI_DEVICE_CPU") if t.on_host else self._device_type
        c.device_id = 0 if t.on_host else self._device_id
        c.ndim = t.ndim
        c.dtype.code, c.dtype.bits, c.dtype.lanes = t.dtype.code, t.dtype.bits, 1
        for i, (n, s) in enumerate(zip(t.shape, t.strides)):
            c.shape[i], c.strides[i] = n, s
        c.byte_offset = t.offset
        if t.quant is not None:
            q = ffi.new("DI_Quant*")
            keep.append(q)
            q.struct_size = ffi.sizeof("DI_Quant")
            q.scheme = abi.const("DI_QUANT_BLOCK")
            q.block_rows, q.block_cols = t.quant.block
            q.nibble_order = abi.const("DI_NIBBLE_LOW_FIRST")
            self._fill_new(q.scales, t.quant.scales, keep, what + ".scales")
            if t.quant.zeros is not None:
                self._fill_new(q.zeros, t.quant.zeros, keep, what + ".zeros")
            c.quant = q

    @property
    def abi_minor(self) -> int:
        return int(self._api.abi_minor) if self._api.abi_major == abi.ABI_MAJOR else 0

    def _marshal(self, op: str, kwargs: dict):
        _, struct, fields = abi.OPS[op]
        spec = abi.OP_SPECS[op]
        minor = self.abi_minor
        for name, _minor in spec.appended:
            # a library of an older minor knows its struct only up to that minor's size: it would
            # answer UNIMPLEMENTED for the bytes past it (or, if careless, ignore them); refuse here.
            # A scalar field left at 0 (silu_mul.limit = 0: no clipping) is what an older caller sends.
            if _minor > minor and abi.field_is_set(kwargs.get(name)):
                what = "write" if name in {a.name for a in spec.args if a.written} else "read"
                raise UnsupportedOpError(op, abi.UNIMPLEMENTED, "UNIMPLEMENTED",
                                         f"{op}: `{name}` is ABI 1.{_minor}; backend {self.name!r} implements ABI "
                                         f"1.{minor} and cannot {what} it (leave {name} out)")
        args = ffi.new(struct + "*")
        keep: list = [args]
        args.header.struct_size = ffi.sizeof(struct)
        for name, ctype in fields:
            v = kwargs.get(name)
            if ctype.cname == "DI_Tensor":
                self._fill_tensor(getattr(args, name), v, keep, name)
            elif ctype.kind == "pointer" and ctype.item.cname == "DI_Tensor":
                if v is None:
                    continue
                for i, t in enumerate(v):
                    if t is not None and not isinstance(t, Tensor):
                        raise TypeError(f"{name}[{i}] must be a deepinfer Tensor, got {type(t).__name__}")
                hit = self.descriptor_array(list(v), name)
                keep.append(hit)
                setattr(args, name, hit[0])
            elif isinstance(v, Comm):
                if v.backend is not self or v.handle is None:
                    raise ValueError(f"{op}: comm belongs to {v.backend.name!r}" if v.handle is not None
                                     else f"{op}: comm was destroyed")
                setattr(args, name, v.handle)
            elif v is not None:
                setattr(args, name, v)
        if op == "moe_experts" and "num_experts" not in kwargs and kwargs.get("w_gate") is not None:
            args.num_experts = len(kwargs["w_gate"])
        return args, keep

    def query(self, op: str, **kwargs) -> tuple[int, int]:
        if not self._has(op):
            return abi.SUPPORT_NO, 0
        if not self._has("op_query"):
            return abi.SUPPORT_YES, 0
        args, _keep = self._marshal(op, kwargs)
        res = ffi.new("DI_OpQuery*")
        res.struct_size = ffi.sizeof("DI_OpQuery")
        with self._lock:   # a 1.0 library keeps one message per context: read it before another call
            self._check(f"op_query({op})", self._api.op_query(self._ctx, abi.OPS[op][0], args, res))
        return res.support, res.workspace_size

    def _bind(self, op: str, kwargs: dict):
        """Marshal one call, with its workspace, into a ready C args struct."""
        if not self._has(op):
            raise UnsupportedOpError(op, abi.UNIMPLEMENTED, "UNIMPLEMENTED",
                                     f"backend {self.name!r} does not implement {op}")
        args, keep = self._marshal(op, kwargs)
        args.header.stream = self._stream_h
        if self.device != "cpu" and self._has("op_query"):
            res = ffi.new("DI_OpQuery*")
            res.struct_size = ffi.sizeof("DI_OpQuery")
            if self._api.op_query(self._ctx, abi.OPS[op][0], args, res) == abi.OK and res.workspace_size:
                if self._workspace is None or self._workspace.nbytes < res.workspace_size:
                    self._workspace = self._alloc(res.workspace_size)
                args.header.workspace = ffi.cast("void*", self._workspace.ptr)
                args.header.workspace_size = res.workspace_size
                keep.append(self._workspace)
        return args, keep

    def _run(self, op: str, kwargs: dict) -> None:
        args, _keep = self._bind(op, kwargs)
        with self._lock:
            status = getattr(self._api, op)(self._ctx, args)
            self._check(op, status)

    def prepare(self, op: str, **kwargs) -> Callable[[], None]:
        if op not in abi.OPS:
            raise AttributeError(f"unknown op {op!r}")
        args, keep = self._bind(op, {k: v for k, v in kwargs.items() if v is not None})
        fn, ctx, lock, check = getattr(self._api, op), self._ctx, self._lock, self._check

        def run(_keep=keep):  # _keep holds the structs and buffers the args point into
            with lock:
                status = fn(ctx, args)
                if status:
                    check(op, status)   # under the lock: the message is read before another call runs

        return run
