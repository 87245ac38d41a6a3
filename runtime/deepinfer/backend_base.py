"""The Backend interface: one shape for every backend, the NumPy reference and any ABI library.

Ops are called by name with the keyword arguments of their args struct in deepinfer_abi.h
(`backend.linear(x=x, w=w, out=y)`); absent optional tensors are simply left out. The header is
the only place those names are written down: NativeBackend (native_backend.py) marshals keywords
into the C struct by walking the struct's fields, and the reference backend's functions are
checked against the same field lists by the tests.

Backend holds the host defaults (a host backend runs each op to completion, so its streams are
names and its copies are done when they return); the handles a backend creates (Stream, Event,
Graph, Comm, HostRegistration) are below it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import abi
from .errors import UnsupportedOpError
from .host_memory import read_meminfo
from .tensor import Tensor


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
        check_copy(dst, src)
        dst.numpy()[...] = src.numpy()

    def prepare_copy(self, dst: Tensor, src: Tensor, stream: Optional["Stream"] = None) -> Callable[[], None]:
        """copy_async(dst, src, stream) checked and bound once, for a copy a hot loop repeats between
        the same two buffers (an expert cache pause's routing and slot table)."""
        check_copy(dst, src)
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
        found = read_meminfo(("MemAvailable", "MemTotal"))
        total = found.get("MemTotal", 0)
        return found.get("MemAvailable", total), total


def check_copy(dst: Tensor, src: Tensor) -> None:
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
