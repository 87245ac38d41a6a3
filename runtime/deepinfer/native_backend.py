"""NativeBackend: a validated ABI library bound through cffi (ABI mode: no compiler needed).

This file is the library's memory and stream API: its context, device memory (alloc, fill,
upload, download), the working stream and graph capture, streams, events, pinned and registered
host memory, asynchronous copies and communicators. How op calls are marshalled into the C args
structs is native_calls.py (NativeOpCalls, which NativeBackend inherits).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import numpy as np

from . import abi
from .backend_base import Backend, BackendInfo, Comm, Event, Graph, HostRegistration, Stream, check_copy
from .errors import BackendCallError, UnsupportedOpError
from .native_calls import NativeOpCalls
from .tensor import DeviceBuffer, Quant, Tensor

ffi = abi.ffi
FILL_CHUNK = 64 << 20     # host bytes NativeBackend.empty stages a fill through


class NativeBackend(NativeOpCalls, Backend):
    """A validated ABI library bound through cffi (ABI mode: no compiler needed)."""

    def __init__(self, lib, api, info: BackendInfo, device_id: int = 0, num_threads: int = 0):
        self._lib = lib          # keeps the library mapped for as long as this object lives
        self._api = api
        self.info = info
        self._lock = threading.Lock()
        opts = ffi.new("DI_ContextOptions*")
        opts.struct_size = ffi.sizeof("DI_ContextOptions")
        opts.device_id = device_id
        opts.num_threads = num_threads
        ctx = ffi.new("DI_Context**")
        self._check("context_create", api.context_create(opts, ctx), ctx=ffi.NULL)
        self._ctx = ctx[0]
        self._device_id = device_id
        # marshalled descriptors of long-lived tensors (weights): filled once, shared by every plan
        self._desc_cache: "weakref.WeakKeyDictionary[Tensor, tuple]" = weakref.WeakKeyDictionary()
        self._array_cache: dict = {}
        self._device_type = abi.const("DI_DEVICE_CPU") if info.device == "cpu" else None
        self._workspace: Optional[DeviceBuffer] = None
        self._stream_h = ffi.NULL     # the working stream's handle (ops, copies, synchronize)
        info.attributes = self.attributes()
        if info.device != "cpu":
            self._device_type = {"cuda": abi.const("DI_DEVICE_CUDA"), "rocm": abi.const("DI_DEVICE_ROCM")}.get(
                info.device, abi.const("DI_DEVICE_EXT")
            )

    # -- plumbing
    def _has(self, entry: str) -> bool:
        return abi.has_entry(self._api, entry)

    def _error_message(self, ctx) -> str:
        if not self._has("last_error"):
            return "(library has no last_error)"
        msg = self._api.last_error(ctx)
        return ffi.string(msg).decode("utf-8", "replace") if msg != ffi.NULL else ""

    def _check(self, what: str, status: int, ctx=None) -> None:
        if status != abi.OK:
            ctx = self._ctx if ctx is None else ctx
            name = abi.STATUS_NAMES.get(status, f"status {status}")
            cls = UnsupportedOpError if status == abi.UNIMPLEMENTED else BackendCallError
            raise cls(what, status, name, self._error_message(ctx))

    def attributes(self) -> dict:
        return abi.read_attributes(self._api, self._ctx)

    def ops(self) -> list[str]:
        return [op for op in abi.OP_NAMES if self._has(op)]

    # -- memory
    def _free(self, ptr: int) -> None:
        self._api.mem_free(self._ctx, ffi.cast("void*", ptr))

    def _alloc(self, nbytes: int) -> DeviceBuffer:
        p = ffi.new("void**")
        self._check("mem_alloc", self._api.mem_alloc(self._ctx, max(int(nbytes), 1), p))
        return DeviceBuffer(int(ffi.cast("uintptr_t", p[0])), nbytes, self)

    def empty(self, shape, dtype, fill: Optional[float] = None) -> Tensor:
        if self.device == "cpu":
            return Tensor.empty(shape, dtype, fill)
        t = Tensor(None, shape, dtype)
        t.buffer = self._alloc(t.nbytes)
        if fill is not None:
            self._fill(t, fill)
        return t

    def _fill(self, t: Tensor, value: float) -> None:
        """Every element of device tensor t set to value. At most FILL_CHUNK bytes come from the host;
        the rest is copied on the device from the part already filled, doubling it each time. The
        KV cache takes most of a GPU's memory (128 GiB on an H200), which as one host buffer would
        exhaust the host's RAM."""
        dt = t.dtype
        n = t.nbytes
        if n == 0:
            return
        if dt.packed:       # 4-bit types: Tensor.empty's fill is zero bytes
            pattern = np.zeros(min(n, FILL_CHUNK), np.uint8)
        else:
            item = dt.np.itemsize
            pattern = np.full(min(n, FILL_CHUNK) // item, value, dt.np)
        self._copy(t.buffer.ptr, pattern.ctypes.data, pattern.nbytes, "DI_COPY_HOST_TO_DEVICE")
        done = pattern.nbytes       # a whole number of elements, so each doubling copies whole ones
        while done < n:
            k = min(done, n - done)
            self._copy(t.buffer.ptr + done, t.buffer.ptr, k, "DI_COPY_DEVICE_TO_DEVICE")
            done += k

    def _copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        self._check("mem_copy", self._api.mem_copy(
            self._ctx, ffi.cast("void*", dst), ffi.cast("void*", src), nbytes, abi.const(kind), self._stream_h))

    def upload(self, t) -> Tensor:
        t = t if isinstance(t, Tensor) else Tensor.from_numpy(np.asarray(t))
        if self.device == "cpu":
            return t
        if not t.on_host:
            return t
        if not t.is_contiguous() or t.offset:
            raise ValueError("upload needs a contiguous host tensor")
        quant = None
        if t.quant is not None:
            quant = Quant(self.upload(t.quant.scales), t.quant.block,
                          self.upload(t.quant.zeros) if t.quant.zeros is not None else None)
        d = Tensor(None, t.shape, t.dtype, t.strides, 0, quant)
        d.buffer = self._alloc(t.nbytes)
        self._copy(d.buffer.ptr, t.data_ptr, t.nbytes, "DI_COPY_HOST_TO_DEVICE")
        self.synchronize()
        return d

    def to_numpy(self, t: Tensor) -> np.ndarray:
        if t.on_host:
            return np.array(t.numpy())
        if not t.is_contiguous():
            raise ValueError("to_numpy of a strided device tensor")
        host = Tensor.empty(t.shape, t.dtype)
        self.synchronize()
        self._copy(host.data_ptr, t.buffer.ptr + t.offset, t.nbytes, "DI_COPY_DEVICE_TO_HOST")
        self.synchronize()
        return np.array(host.numpy())

    def write(self, t: Tensor, arr: np.ndarray) -> None:
        if t.on_host:
            t.numpy()[...] = arr
            return
        src = np.ascontiguousarray(arr, dtype=t.dtype.np)
        if not t.is_contiguous() or src.nbytes != t.nbytes:
            raise ValueError(f"write: {src.shape} {src.dtype} does not fill contiguous {t!r}")
        self._copy(t.data_ptr + t.offset, src.ctypes.data, src.nbytes, "DI_COPY_HOST_TO_DEVICE")

    def synchronize(self) -> None:
        if self._has("stream_synchronize"):
            self._check("stream_synchronize", self._api.stream_synchronize(self._ctx, self._stream_h))

    # -- the working stream and graph capture
    @property
    def supports_graphs(self) -> bool:
        return all(self._has(e) for e in ("graph_begin", "graph_end", "graph_launch", "graph_destroy"))

    def set_stream(self, stream: Optional[Stream]) -> None:
        """Make `stream` the working stream of every later op, copy and synchronize(); work already
        issued on the previous one is finished first, so nothing reorders. Prepared calls keep the
        stream they were prepared with."""
        self.synchronize()
        self._working_stream = stream
        self._stream_h = stream.handle if stream is not None and stream.handle is not None else ffi.NULL

    def capture(self, calls) -> Graph:
        self._need("graph_begin", "graph_end", "graph_launch", "graph_destroy")
        if self._stream_h == ffi.NULL:
            raise ValueError("graph capture needs a working stream of its own (set_stream(create_stream()))")
        self._check("graph_begin", self._api.graph_begin(self._ctx, self._stream_h))
        try:
            for call in calls:
                call()
        except BaseException:
            g = ffi.new("DI_Graph**")
            if self._api.graph_end(self._ctx, self._stream_h, g) == abi.OK and g[0] != ffi.NULL:
                self._api.graph_destroy(self._ctx, g[0])
            raise
        g = ffi.new("DI_Graph**")
        self._check("graph_end", self._api.graph_end(self._ctx, self._stream_h, g))
        return Graph(self, g[0])

    def _graph_launch(self, h) -> None:
        self._check("graph_launch", self._api.graph_launch(self._ctx, h, self._stream_h))

    def _graph_destroy(self, h) -> None:
        if self._ctx is not None:
            self._check("graph_destroy", self._api.graph_destroy(self._ctx, h))

    # -- streams, events, host memory, async copies (ABI 1.1)
    def _need(self, *entries: str) -> None:
        missing = [e for e in entries if not self._has(e)]
        if missing:
            raise UnsupportedOpError(missing[0], abi.UNIMPLEMENTED, "UNIMPLEMENTED",
                                     f"backend {self.name!r} (ABI {self.info.abi_version}) lacks {', '.join(missing)}")

    def create_stream(self) -> Stream:
        self._need("stream_create", "stream_destroy")
        p = ffi.new("DI_Stream*")
        self._check("stream_create", self._api.stream_create(self._ctx, p))
        return Stream(self, p[0])

    def _stream_sync(self, h) -> None:
        self._check("stream_synchronize", self._api.stream_synchronize(self._ctx, h))

    def _stream_destroy(self, h) -> None:
        if self._ctx is not None:
            self._check("stream_destroy", self._api.stream_destroy(self._ctx, h))

    def _stream_wait(self, h, ev) -> None:
        self._check("stream_wait_event", self._api.stream_wait_event(self._ctx, h, ev))

    def create_event(self) -> Event:
        self._need("event_create", "event_destroy", "event_record", "stream_wait_event", "event_query",
                   "event_synchronize")
        p = ffi.new("DI_Event*")
        self._check("event_create", self._api.event_create(self._ctx, p))
        return Event(self, p[0])

    def _event_record(self, ev, stream) -> None:
        self._check("event_record", self._api.event_record(self._ctx, ev, stream if stream is not None else ffi.NULL))

    def _event_query(self, ev) -> bool:
        done = ffi.new("int32_t*")
        self._check("event_query", self._api.event_query(self._ctx, ev, done))
        return bool(done[0])

    def _event_sync(self, ev) -> None:
        self._check("event_synchronize", self._api.event_synchronize(self._ctx, ev))

    def _event_destroy(self, ev) -> None:
        if self._ctx is not None:
            self._check("event_destroy", self._api.event_destroy(self._ctx, ev))

    def host_empty(self, shape, dtype) -> Tensor:
        """Pinned host memory (host_alloc); freed when the last view of it goes."""
        self._need("host_alloc", "host_free")
        t = Tensor(None, shape, dtype)
        n = max(t.nbytes, 1)
        p = ffi.new("void**")
        self._check("host_alloc", self._api.host_alloc(self._ctx, n, p))
        api, me = self._api, self

        def free(ptr):
            if me._ctx is not None:
                api.host_free(me._ctx, ptr)

        owned = ffi.gc(ffi.cast("char*", p[0]), free)
        raw = np.frombuffer(ffi.buffer(owned, n), np.uint8)   # the buffer keeps `owned` alive
        t.buffer = raw
        return t

    def register_host(self, arr: np.ndarray) -> HostRegistration:
        self._need("host_register", "host_unregister")
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
            raise ValueError("register_host needs a contiguous NumPy array")
        ptr = ffi.cast("void*", arr.ctypes.data)
        self._check("host_register", self._api.host_register(self._ctx, ptr, max(arr.nbytes, 1)))
        return HostRegistration(self, arr, ptr)

    def _host_unregister(self, ptr) -> None:
        if self._ctx is not None:
            self._check("host_unregister", self._api.host_unregister(self._ctx, ptr))

    def _copy_call(self, dst: Tensor, src: Tensor, stream: Optional[Stream]) -> tuple:
        """(entry name, C function, its arguments) of one copy: what copy_async calls at once and
        prepare_copy binds."""
        check_copy(dst, src)
        kind = {(True, False): "DI_COPY_HOST_TO_DEVICE", (False, True): "DI_COPY_DEVICE_TO_HOST",
                (False, False): "DI_COPY_DEVICE_TO_DEVICE", (True, True): "DI_COPY_HOST_TO_HOST"}[
            (src.on_host, dst.on_host)]
        if stream is None:
            h = self._stream_h
        else:
            h = stream.handle if stream.handle is not None else ffi.NULL
        entry = "mem_copy_async" if self._has("mem_copy_async") else "mem_copy"
        return entry, getattr(self._api, entry), (
            self._ctx, ffi.cast("void*", dst.data_ptr + dst.offset), ffi.cast("void*", src.data_ptr + src.offset),
            dst.nbytes, abi.const(kind), h)

    def native_copy_entries(self, stream: Optional[Stream]) -> Optional[dict]:
        if not all(self._has(e) for e in ("mem_copy_async", "event_record", "last_error")):
            return None

        def addr(x) -> int:
            return int(ffi.cast("uintptr_t", x))

        h = stream.handle if stream is not None and stream.handle is not None else ffi.NULL
        return {"ctx": addr(self._ctx), "copy": addr(self._api.mem_copy_async), "record": addr(self._api.event_record),
                "last_error": addr(self._api.last_error), "stream": addr(h),
                "h2d": abi.const("DI_COPY_HOST_TO_DEVICE")}

    def copy_async(self, dst: Tensor, src: Tensor, stream: Optional[Stream] = None) -> None:
        entry, fn, args = self._copy_call(dst, src, stream)
        self._check(entry, fn(*args))

    def prepare_copy(self, dst: Tensor, src: Tensor, stream: Optional[Stream] = None) -> Callable[[], None]:
        entry, fn, args = self._copy_call(dst, src, stream)
        check = self._check

        def run(_keep=(dst, src)):   # _keep: the tensors (and so their memory) live as long as the call
            status = fn(*args)
            if status:
                check(entry, status)

        return run

    @property
    def supports_comm(self) -> bool:
        return self.abi_minor >= 4 and all(self._has(e) for e in ("comm_unique_id", "comm_create", "comm_destroy"))

    def comm_unique_id(self) -> bytes:
        self._need("comm_unique_id", "comm_create", "comm_destroy")
        out = ffi.new("DI_CommId*")
        with self._lock:
            self._check("comm_unique_id", self._api.comm_unique_id(self._ctx, out))
        return bytes(ffi.buffer(out.bytes))

    def comm_create(self, comm_id: bytes, nranks: int, rank: int) -> Comm:
        self._need("comm_unique_id", "comm_create", "comm_destroy")
        comm_id = bytes(comm_id)
        if len(comm_id) != ffi.sizeof("DI_CommId"):
            raise ValueError(f"comm_create: an id is {ffi.sizeof('DI_CommId')} bytes (comm_unique_id), got {len(comm_id)}")
        cid = ffi.new("DI_CommId*")
        ffi.memmove(cid.bytes, comm_id, len(comm_id))
        out = ffi.new("DI_Comm**")
        # not under the lock: every rank blocks here until all have joined
        self._check("comm_create", self._api.comm_create(self._ctx, cid, int(nranks), int(rank), out))
        return Comm(self, nranks, rank, out[0])

    def _comm_destroy(self, handle) -> None:
        with self._lock:
            self._check("comm_destroy", self._api.comm_destroy(self._ctx, handle))

    def device_count(self) -> int:
        if not self._has("device_count"):
            return 1
        n = ffi.new("int32_t*")
        self._check("device_count", self._api.device_count(n), ctx=ffi.NULL)
        return int(n[0])

    def memory_info(self) -> tuple[int, int]:
        a = self.attributes()
        total = int(a.get("device.memory_total_bytes", a.get("device.memory_bytes", 0)))
        free = int(a.get("device.memory_free_bytes", total))
        return free, total

    def close(self) -> None:
        if getattr(self, "_ctx", None) is not None:
            self._workspace = None
            self._api.context_destroy(self._ctx)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
