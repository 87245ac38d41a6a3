"""Execution plans: the model graph traced once per batch shape into a flat list of op calls over
buffers that a liveness-based planner places in one arena.

How it works: the graph code calls ops on a `Tracer` exactly as it would on a Backend. Activations
it asks for (`tracer.empty`) are Tensors whose buffer is a symbolic `SymBuf`; views of them
(`view`, `narrow`) are ordinary Tensor views of that symbol. Tracing records (op, kwargs). The
planner then gives every activation symbol the interval [first op that mentions it, last op that
mentions it] and places symbols in one arena by first fit over the live ones, so buffers of
different layers with the same shape land on the same bytes. Binding swaps each symbolic Tensor
for a view into the arena; executing is a loop of backend calls with no allocation at all.

Per-step inputs (token ids, positions, slots, block tables...) are small int32 buffers outside
the arena, all in one input store. The host writes them through `host_input` views: on a host
backend those views are the store itself; on a device backend they are views of one pinned
staging buffer with the store's layout, which `run` sends in one asynchronous copy.
Constant inputs (`tracer.constant`) live in the same store, written once at bind: ops may write
parts of them in a step (the router writes its columns of the shared experts' routing), and the next
run's input copy restores them.

A plan can also be captured as a graph (`capture`): the bound calls are recorded once on the
backend's working stream and every later `run` is the input copy plus one graph launch. The
buffers never move while the plan stays bound, which is what makes a replay valid; rebinding (the
arena grew) drops the graph.

Pauses: the graph code may put `tracer.pause(tag, **tensors)` between ops where the host must act in
the middle of a step (the expert cache reads a layer's routing, loads the experts it misses and
writes their slots). A pause splits the plan into segments; `run` executes a segment (one graph
each when captured), then calls `on_pause(Pause)` with the pause's tensors bound, then the next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import abi
from .. import dtypes as D
from ..tensor import Quant, Tensor

ALIGN = 256
# fields that ops write (role OUT or INOUT in the op table); a symbol first seen in any other field
# is read before it was written
OUTPUT_FIELDS = {op: frozenset(abi.output_fields(op)) for op in abi.OP_NAMES}


PAUSE = "__pause__"     # the op name of a pause entry in a plan's call list


_UNSET = object()      # a cached property not computed yet


@dataclass
class Pause:
    """A bound pause: its tag and its tensors (views of real memory)."""

    tag: object
    tensors: dict


class SymBuf:
    """A symbolic activation buffer (bytes are assigned by the planner)."""

    __slots__ = ("id", "nbytes", "kind", "name", "first", "last", "offset")

    def __init__(self, id: int, nbytes: int, kind: str, name: str):
        self.id, self.nbytes, self.kind, self.name = id, nbytes, kind, name
        self.first = self.last = -1
        self.offset = -1

    def __repr__(self):
        return f"SymBuf({self.name}#{self.id}, {self.nbytes}B, [{self.first},{self.last}])"


class Tracer:
    """Records op calls; looks like a Backend to the graph code."""

    def __init__(self, backend):
        self.backend = backend
        self.calls: list[tuple[str, dict]] = []
        self.syms: list[SymBuf] = []
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.constants: dict[str, np.ndarray] = {}

    # -- buffers
    def empty(self, shape, dtype, name: str = "act") -> Tensor:
        t = Tensor(None, shape, dtype)
        sb = SymBuf(len(self.syms), t.nbytes, "act", name)
        self.syms.append(sb)
        t.buffer = sb
        return t

    def input(self, name: str, shape, dtype="int32") -> Tensor:
        t = Tensor(None, shape, dtype)
        sb = SymBuf(len(self.syms), t.nbytes, "input", name)
        sb.first = -1  # written by the host before the run
        self.syms.append(sb)
        t.buffer = sb
        self.inputs[name] = t
        return t

    def constant(self, name: str, value: np.ndarray, dtype="int32") -> Tensor:
        """An input whose value never changes (written once when the plan is bound, then sent with
        the other inputs on every run): ops may write parts of it during the step, which the next
        run's input copy puts back. The same name gives the same tensor."""
        t = self.inputs.get(name)
        if t is None:
            t = self.input(name, value.shape, dtype)
            self.constants[name] = np.asarray(value, dtype=t.dtype.np)
        elif tuple(t.shape) != tuple(value.shape) or not np.array_equal(self.constants.get(name), value):
            raise RuntimeError(f"plan: constant {name!r} traced twice with different values")
        return t

    def output(self, name: str, t: Tensor) -> None:
        self.outputs[name] = t

    def pause(self, tag, **tensors) -> None:
        """A point where the step stops for the host (`Plan.run`'s on_pause); `tensors` (read there,
        or written by the host there when they are inputs) stay live up to it."""
        i = len(self.calls)
        for t in tensors.values():
            if isinstance(t, Tensor) and isinstance(t.buffer, SymBuf):
                if t.buffer.kind == "act" and t.buffer.first < 0:
                    raise RuntimeError(f"plan: pause {tag!r} reads {t.buffer.name} before any op wrote it")
                t.buffer.last = i
        self.calls.append((PAUSE, {"tag": tag, **tensors}))

    # -- ops
    def call(self, op: str, **kwargs) -> None:
        if op not in abi.OPS:
            raise AttributeError(f"unknown op {op!r}")
        unknown = set(kwargs) - set(abi.op_fields(op))
        if unknown:
            raise TypeError(f"{op}() got unknown argument(s) {sorted(unknown)}")
        i = len(self.calls)
        for k, v in kwargs.items():
            ts = []
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, Tensor):
                    ts.append(t)
                    if t.quant is not None:   # an activation quantized at run time has symbolic scales
                        ts += [x for x in (t.quant.scales, t.quant.zeros) if x is not None]
            for t in ts:
                if isinstance(t.buffer, SymBuf):
                    sb = t.buffer
                    if sb.kind == "act" and sb.first < 0:
                        if k not in OUTPUT_FIELDS[op]:
                            raise RuntimeError(f"plan: {op}.{k} reads {sb.name} before any op wrote it")
                        sb.first = i
                    sb.last = i
        self.calls.append((op, kwargs))

    def __getattr__(self, name):
        if name in abi.OPS:
            return lambda **kw: self.call(name, **kw)
        raise AttributeError(name)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def place(syms: list[SymBuf], end: int) -> int:
    """First-fit placement of activation symbols by liveness; returns the arena size in bytes."""
    order = sorted((s for s in syms if s.kind == "act" and s.first >= 0), key=lambda s: (s.first, -s.nbytes))
    live: list[SymBuf] = []
    size = 0
    for s in order:
        live = [x for x in live if x.last >= s.first]
        need = _align(max(s.nbytes, 1))
        off = 0
        for x in sorted(live, key=lambda x: x.offset):
            if off + need <= x.offset:
                break
            off = max(off, x.offset + _align(max(x.nbytes, 1)))
        s.offset = off
        live.append(s)
        size = max(size, off + need)
    return size


@dataclass
class Plan:
    """A traced, placed and bound list of op calls for one batch shape."""

    key: tuple
    calls: list = field(default_factory=list)          # (op, kwargs) with symbolic tensors
    syms: list = field(default_factory=list)
    inputs: dict = field(default_factory=dict)         # name -> symbolic Tensor
    constants: dict = field(default_factory=dict)      # name -> the value of a constant input
    outputs: dict = field(default_factory=dict)
    arena_bytes: int = 0
    total_activation_bytes: int = 0
    input_bytes: int = 0
    bound: list = field(default_factory=list)          # (op, kwargs) with concrete tensors
    bound_inputs: dict = field(default_factory=dict)
    bound_outputs: dict = field(default_factory=dict)
    _arena_gen: int = -1
    _prepared: Optional[list] = None
    _host_inputs: dict = field(default_factory=dict)
    _staging: Optional[Tensor] = None      # pinned host copy of the input store (device backends)
    _staged: object = None                 # event after the last input copy (None: nothing in flight)
    _pending: bool = False
    graph: object = None                   # one backend.Graph per segment (None: run op by op)
    _has_pauses: Optional[bool] = None
    _first_pause: object = _UNSET          # the first pause's tag, once read (first_pause)
    runs: int = 0

    @classmethod
    def from_tracer(cls, key, tr: Tracer) -> "Plan":
        p = cls(key=key, calls=tr.calls, syms=tr.syms, inputs=tr.inputs, outputs=tr.outputs,
                constants=tr.constants)
        n = len(tr.calls)
        # outputs stay live to the end of the plan (the caller reads them after the run)
        for t in tr.outputs.values():
            t.buffer.last = n
        p.arena_bytes = place(tr.syms, n)
        p.total_activation_bytes = sum(s.nbytes for s in tr.syms if s.kind == "act")
        off = 0
        for s in tr.syms:
            if s.kind == "input":
                s.offset = off
                off += _align(max(s.nbytes, 1))
        p.input_bytes = off
        return p

    # -- binding: symbolic tensors -> views of real memory
    def bind(self, arena: "Arena", backend) -> None:
        if self._arena_gen == arena.generation and self.bound:
            return
        if not self.bound_inputs:
            n = max(self.input_bytes, 1)
            self._input_store = backend.empty((n,), "uint8")
            if backend.device != "cpu":
                try:
                    self._staging = backend.host_empty((n,), "uint8")
                    self._staged = backend.create_event()
                except Exception:   # a library without pinned memory or events: a pageable staging copy
                    self._staging, self._staged = Tensor.empty((n,), "uint8"), None
        memo: dict = {}

        def real(t):
            if isinstance(t, (list, tuple)):
                return [real(x) for x in t]
            if not isinstance(t, Tensor) or not isinstance(t.buffer, SymBuf):
                return t
            key = id(t)
            if key in memo:
                return memo[key]
            sb = t.buffer
            base = arena.tensor if sb.kind == "act" else self._input_store
            q = t.quant
            if q is not None:
                q = Quant(real(q.scales), q.block, real(q.zeros) if q.zeros is not None else None)
            r = Tensor(base.buffer, t.shape, t.dtype, t.strides, base.offset + sb.offset + t.offset, q)
            memo[key] = r
            return r

        self.bound = [(op, {k: real(v) for k, v in kw.items()}) for op, kw in self.calls]
        self.bound_inputs = {k: real(v) for k, v in self.inputs.items()}
        self.bound_outputs = {k: real(v) for k, v in self.outputs.items()}
        self._arena_gen = arena.generation
        self._prepared = None
        self.graph = None
        # host views of the inputs: the store itself on a host backend, else the pinned staging
        host = self._input_store if self._staging is None else self._staging
        raw = host.numpy()
        self._host_inputs = {}
        self._send = {}          # pause-written inputs: name -> (their copy, bound once; its stream)
        for k, v in self.inputs.items():
            off = v.buffer.offset
            self._host_inputs[k] = raw[off:off + v.nbytes].view(v.dtype.np).reshape(v.shape)
        for k, value in self.constants.items():
            self._host_inputs[k][...] = value

    def host_input(self, name: str) -> np.ndarray:
        """The host view of an input; fill it, then `run` makes it the device's."""
        if self._pending:
            # the previous run's input copy may still be reading the staging buffer
            self._staged.synchronize()
            self._pending = False
        return self._host_inputs[name]

    def prepared(self, backend) -> list:
        """The segments of the plan: [(prepared calls, Pause that ends the segment or None)]."""
        if self._prepared is None:
            # the buffers never move between runs of a plan, so each call is bound once
            segs, cur = [], []
            for op, kw in self.bound:
                if op == PAUSE:
                    kw = dict(kw)
                    segs.append((cur, Pause(kw.pop("tag"), kw)))
                    cur = []
                else:
                    cur.append(backend.prepare(op, **kw))
            segs.append((cur, None))
            self._prepared = segs
        return self._prepared

    @property
    def has_pauses(self) -> bool:
        if self._has_pauses is None:
            self._has_pauses = any(op == PAUSE for op, _ in self.calls)
        return self._has_pauses

    @property
    def first_pause(self):
        """The tag of the plan's first pause (None: it has none); read before every paused step."""
        if self._first_pause is _UNSET:
            self._first_pause = next((kw["tag"] for op, kw in self.calls if op == PAUSE), None)
        return self._first_pause

    def input_region(self, name: str) -> tuple:
        """(device view, host view) of one input's bytes, for an input the host writes in a pause
        (the store was sent at the start of the step): copy the host view over after writing it."""
        v = self.inputs[name]
        off, n = v.buffer.offset, v.nbytes
        dev = self._input_store.byte_view(off, n)
        if self._staging is None:
            return dev, dev
        return dev, self._staging.byte_view(off, n)

    def pause_input(self, name: str) -> np.ndarray:
        """The host view of an input written in a pause (then `send_pause_input`). The step-start
        copy already read the staging buffer: the pause's host synchronized before it got here."""
        return self._host_inputs[name]

    def send_pause_input(self, name: str, backend) -> None:
        """Make a pause-written input the device's (a copy on the working stream, ordered before
        the rest of the step); nothing to do on a host backend."""
        if self._staging is not None:
            send = self._send.get(name)
            if send is None or send[1] is not backend.stream:
                dev, host = self.input_region(name)
                send = self._send[name] = (backend.prepare_copy(dev, host), backend.stream)
            send[0]()

    def run(self, backend, on_pause=None) -> None:
        if self._staging is not None:
            backend.copy_async(self._input_store, self._staging)
            if self._staged is not None:
                self._staged.record(backend.stream)
                self._pending = True
        segs = self.prepared(backend)
        if len(segs) > 1 and on_pause is None:
            raise RuntimeError(f"plan {self.key} pauses for the host (expert streaming) but run() got no on_pause")
        graphs = self.graph if self.graph is not None else [None] * len(segs)
        for (calls, pause), graph in zip(segs, graphs):
            if graph is not None:
                graph.launch()
            else:
                for call in calls:
                    call()
            if pause is not None:
                on_pause(pause)
        self.runs += 1

    def capture(self, backend) -> None:
        """Record each segment's calls as one graph; later runs replay them (the plan must have run
        once, so that libraries have done their first-call set-up outside the capture)."""
        self.graph = [backend.capture(calls) if calls else None for calls, _ in self.prepared(backend)]


class Arena:
    """One activation buffer shared by every plan of a model (plans never run concurrently).

    It grows only when a plan needs more than any before it; growing bumps `generation` so that
    plans rebind their views (descriptor work only)."""

    def __init__(self, backend):
        self.backend = backend
        self.tensor: Optional[Tensor] = None
        self.nbytes = 0
        self.generation = 0

    def ensure(self, nbytes: int) -> None:
        if self.tensor is None or nbytes > self.nbytes:
            self.nbytes = max(_align(nbytes), ALIGN)
            self.tensor = self.backend.empty((self.nbytes,), "uint8")
            self.generation += 1
