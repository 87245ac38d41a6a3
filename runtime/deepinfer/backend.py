"""The Backend object: one shape for every backend, the NumPy reference and any ABI library.

Ops are called by name with the keyword arguments of their args struct in deepinfer_abi.h
(`backend.linear(x=x, w=w, out=y)`); absent optional tensors are simply left out. The header is
the only place those names are written down: NativeBackend marshals keywords into the C struct by
walking the struct's fields, and the reference backend's functions are checked against the same
field lists by the tests.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import abi
from . import dtypes as D
from .errors import BackendCallError, UnsupportedOpError
from .tensor import DeviceBuffer, Quant, Tensor

log = logging.getLogger("deepinfer")

ffi = abi.ffi
_DESC_SIZE = ffi.sizeof("DI_Tensor")
FILL_CHUNK = 64 << 20     # host bytes NativeBackend.empty stages a fill through


@dataclass
class BackendInfo:
    name: str
    version: str
    device: str                      # "cpu", "cuda", ...
    path: Optional[str] = None       # the shared library, None for the reference
    abi_version: str = f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"
    attributes: dict = field(default_factory=dict)


class Backend:
    """Base class. Subclasses implement `_run(op, kwargs)` and memory handling."""

    info: BackendInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def device(self) -> str:
        return self.info.device

    # ------------------------------------------------------------------ ops
    def ops(self) -> list[str]:
        """The ops this backend implements (others are UNIMPLEMENTED)."""
        raise NotImplementedError

    def has_op(self, op: str) -> bool:
        return op in self.ops()

    @property
    def abi_minor(self) -> int:
        """The ABI minor version this backend implements: fields of later minors (DI_ARGS_SINCE) are refused."""
        return abi.ABI_MINOR

    def query(self, op: str, **kwargs) -> tuple[int, int]:
        """(support, workspace bytes) for this concrete call; support is abi.SUPPORT_*."""
        return (abi.SUPPORT_YES if self.has_op(op) else abi.SUPPORT_NO), 0

    def call(self, op: str, **kwargs) -> None:
        if op not in abi.OPS:
            raise AttributeError(f"unknown op {op!r}; the ABI has: {', '.join(abi.OP_NAMES)}")
        unknown = set(kwargs) - set(abi.op_fields(op))
        if unknown:
            raise TypeError(f"{op}() got unknown argument(s) {sorted(unknown)}; it takes {abi.op_fields(op)}")
        self._run(op, kwargs)

    def _run(self, op: str, kwargs: dict) -> None:
        raise NotImplementedError

    def prepare(self, op: str, **kwargs) -> Callable[[], None]:
        """The call bound once, to be run many times over the same buffers (a plan's steps).
        Native backends marshal the C args struct here, so running it is one C call."""
        return lambda: self.call(op, **kwargs)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name in abi.OPS:
            return lambda **kw: self.call(name, **kw)
        raise AttributeError(name)

    # ------------------------------------------------------------------ memory
    def empty(self, shape, dtype, fill: Optional[float] = None) -> Tensor:
        """A new tensor in this backend's memory (host memory for host backends)."""
        return Tensor.empty(shape, dtype, fill)

    def upload(self, t) -> Tensor:
        """Make a host tensor (or NumPy array) usable by this backend; no copy on host backends."""
        return t if isinstance(t, Tensor) else Tensor.from_numpy(np.asarray(t))

    def to_numpy(self, t: Tensor) -> np.ndarray:
        """Elements of a tensor as a host NumPy array (a copy)."""
        return np.array(t.numpy())

    def write(self, t: Tensor, arr: np.ndarray) -> None:
        """Copy host values into an existing tensor (same shape and dtype)."""
        t.numpy()[...] = arr

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ streams, events, host memory (ABI 1.1)
    # A host backend runs every op to completion before returning, so its streams are names, its
    # events are reached the moment they are recorded and every copy is done when it returns.
    def create_stream(self) -> "Stream":
        return Stream(self, None)

    def create_event(self) -> "Event":
        return Event(self, None)

    def host_empty(self, shape, dtype) -> Tensor:
        """Host memory the device copies from asynchronously (pinned where the backend has it)."""
        return Tensor.empty(shape, dtype)

    def register_host(self, arr: np.ndarray) -> "HostRegistration":
        """Lets the device copy from an existing host range (an mmap'd checkpoint) asynchronously."""
        return HostRegistration(self, arr, None)

    def copy_async(self, dst: Tensor, src: Tensor, stream: Optional["Stream"] = None) -> None:
        """Copy src into dst (same bytes, both contiguous) on `stream`; returns at once. Both must stay
        alive and unchanged until an event recorded after it on that stream is reached."""
        _check_copy(dst, src)
        dst.numpy()[...] = src.numpy()

    def prepare_copy(self, dst: Tensor, src: Tensor, stream: Optional["Stream"] = None) -> Callable[[], None]:
        """copy_async(dst, src, stream) checked and bound once, for a copy a hot loop repeats between
        the same two buffers (an expert cache pause's routing and slot table)."""
        _check_copy(dst, src)
        if type(self).copy_async is not Backend.copy_async:
            return lambda: self.copy_async(dst, src, stream)
        d, s = dst.numpy(), src.numpy()
        return lambda: np.copyto(d, s)

    def device_count(self) -> int:
        return 1

    def native_copy_entries(self, stream: Optional["Stream"]) -> Optional[dict]:
        """What a native helper needs to issue asynchronous copies and record events itself, from
        its own threads (the expert cache's disk readers): the library's context, its
        mem_copy_async, event_record and last_error entries and `stream`'s handle, as integers,
        plus the host-to-device copy kind. None where the backend is not an ABI library with
        those entries (the helper is then not used)."""
        return None

    # ------------------------------------------------------------------ communicators (ABI 1.4)
    # Several processes (one per GPU, or per CPU rank) run one model together: rank 0 makes an id,
    # the runtime hands it to every rank (deepinfer.parallel), each creates its Comm from it, and the
    # collective ops take it as their `comm` argument.
    @property
    def supports_comm(self) -> bool:
        return False

    def comm_unique_id(self) -> bytes:
        """128 bytes naming a new communicator (made on one rank, handed to all)."""
        raise UnsupportedOpError("comm_unique_id", abi.UNIMPLEMENTED, "UNIMPLEMENTED",
                                 f"backend {self.name!r} has no communicators (ABI 1.4 comm_create)")

    def comm_create(self, comm_id: bytes, nranks: int, rank: int) -> "Comm":
        """Join the communicator `comm_id` as `rank` of `nranks` (collective: blocks until all joined)."""
        raise UnsupportedOpError("comm_create", abi.UNIMPLEMENTED, "UNIMPLEMENTED",
                                 f"backend {self.name!r} has no communicators (ABI 1.4 comm_create)")

    # ------------------------------------------------------------------ the working stream and graphs
    # Every op, copy and synchronize() of a backend goes to its working stream (None: the default
    # stream). A runner that captures graphs gives it a stream of its own (the default stream
    # cannot be captured); host backends have nothing to capture.
    @property
    def supports_graphs(self) -> bool:
        return False

    def set_stream(self, stream: Optional["Stream"]) -> None:
        self._working_stream = stream

    @property
    def stream(self) -> Optional["Stream"]:
        return getattr(self, "_working_stream", None)

    def capture(self, calls) -> "Graph":
        """Run `calls` (prepared ops) under graph capture on the working stream; the Graph replays them."""
        raise UnsupportedOpError("graph_begin", abi.UNIMPLEMENTED, "UNIMPLEMENTED",
                                 f"backend {self.name!r} has no graph capture")

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory this backend allocates from (host: MemAvailable, MemTotal)."""
        found = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("MemAvailable", "MemTotal"):
                        found[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        total = found.get("MemTotal", 0)
        return found.get("MemAvailable", total), total


def _check_copy(dst: Tensor, src: Tensor) -> None:
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes != src.nbytes:
        raise ValueError(f"copy_async: {src!r} -> {dst!r} needs two contiguous tensors of the same size")


class _Handle:
    """Something a backend created and must release once: on close(), or when it is collected."""

    def __init__(self, backend: "Backend", handle):
        self.backend, self.handle = backend, handle

    def _release(self, handle) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._release(handle)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Stream(_Handle):
    """A backend's stream (handle None: the default stream)."""

    def _release(self, handle) -> None:
        self.backend._stream_destroy(handle)

    def synchronize(self) -> None:
        if self.handle is not None:
            self.backend._stream_sync(self.handle)

    def wait(self, event: "Event") -> None:
        """Work issued on this stream after this call starts only once `event` is reached."""
        if event.handle is not None:
            self.backend._stream_wait(self.handle, event.handle)


class Event(_Handle):
    """A point in a stream's work: record it, make other streams wait for it, or test it."""

    def _release(self, handle) -> None:
        self.backend._event_destroy(handle)

    def record(self, stream: Optional[Stream] = None) -> None:
        if self.handle is not None:
            self.backend._event_record(self.handle, stream.handle if stream else None)

    def query(self) -> bool:
        return True if self.handle is None else self.backend._event_query(self.handle)

    def synchronize(self) -> None:
        if self.handle is not None:
            self.backend._event_sync(self.handle)


class Graph(_Handle):
    """A captured sequence of ops; launch() replays it on the backend's working stream."""

    def _release(self, handle) -> None:
        self.backend._graph_destroy(handle)

    def launch(self) -> None:
        self.backend._graph_launch(self.handle)


class Comm(_Handle):
    """A communicator of `nranks` processes, this one being `rank` (ABI 1.4); the collective ops
    take it as their `comm` argument."""

    def __init__(self, backend: "Backend", nranks: int, rank: int, handle):
        super().__init__(backend, handle)
        self.nranks, self.rank = int(nranks), int(rank)

    def _release(self, handle) -> None:
        self.backend._comm_destroy(handle)

    def __repr__(self) -> str:
        return f"Comm(rank {self.rank} of {self.nranks}, {self.backend.name})"


class HostRegistration(_Handle):
    """A host range registered with a backend; unregistered by close() or on leaving a `with` block."""

    def __init__(self, backend: "Backend", arr: np.ndarray, ptr):
        super().__init__(backend, ptr)
        self.array = arr

    @property
    def ptr(self):
        return self.handle

    def _release(self, handle) -> None:
        self.backend._host_unregister(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ====================================================================== native (ABI) backends


class NativeBackend(Backend):
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
        _check_copy(dst, src)
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


# ====================================================================== fallback policy


class FallbackBackend(Backend):
    """Runs ops the primary backend lacks on the reference backend; only when the user asks for it.

    Host backends only (the reference cannot read device memory). Every fallback is logged once.
    """

    def __init__(self, primary: Backend, reference: Backend):
        if primary.device != "cpu":
            raise ValueError("per-op fallback to the reference needs a host-memory backend")
        self.primary, self.reference = primary, reference
        self.info = primary.info
        self._warned: set[str] = set()

    def ops(self) -> list[str]:
        return sorted(set(self.primary.ops()) | set(self.reference.ops()), key=abi.OP_NAMES.index)

    def _run(self, op: str, kwargs: dict) -> None:
        if self.primary.has_op(op):
            return self.primary._run(op, kwargs)
        if op not in self._warned:
            log.warning("backend %s lacks %s: falling back to the reference backend (config fallback=true)",
                        self.primary.name, op)
            self._warned.add(op)
        self.reference._run(op, kwargs)

    # communicators are the primary's (a collective cannot fall back: the reference has its own)
    @property
    def supports_comm(self) -> bool:
        return self.primary.supports_comm

    def comm_unique_id(self) -> bytes:
        return self.primary.comm_unique_id()

    def comm_create(self, comm_id: bytes, nranks: int, rank: int) -> Comm:
        return self.primary.comm_create(comm_id, nranks, rank)

    def synchronize(self) -> None:
        self.primary.synchronize()

    def close(self) -> None:
        self.primary.close()
