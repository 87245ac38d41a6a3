"""L3: streams, graph capture and concurrent contexts (abi/README.md section 6).

Only libraries with graph_* entries or a non-CPU device are checked; for a host library without
graphs every op runs synchronously on the caller's thread and there is nothing stream-specific to
observe, so the level is skipped with that reason.

  - work lands on the given stream: each claimed op runs on a stream of its own, only that stream is
    synchronized, and the result equals the default-stream result;
  - capture and replay: the ops issued on a stream between graph_begin and graph_end replay to the
    same results, and a replay after the inputs changed in place computes on the new inputs;
  - two contexts at once, from two threads, give the results of one.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import abi
from ..loader import load_library
from . import cases as C
from .abi_checks_base import CheckFailed, _name
from .harness import Outcome, Recorder
from .materialize import POISON_BYTE, Materialized, _host, release_comm

ffi = abi.ffi


def _has(be, entry):
    return be._has(entry)


def _set_host_or_device(be, held, host: np.ndarray) -> None:
    """Overwrite a tensor's whole buffer in place (same pointer) with host bytes."""
    host = np.ascontiguousarray(host)
    if held.base.on_host:
        held.base.buffer.view(np.uint8).reshape(-1)[: host.nbytes] = host.view(np.uint8).reshape(-1)
    else:
        be._copy(held.base.buffer.ptr, host.ctypes.data, host.nbytes, "DI_COPY_HOST_TO_DEVICE")
        be.synchronize()


def _poison_outputs(be, m: Materialized) -> None:
    """Outputs poisoned and in-place ones (INOUT with values: mla_rope_cache_write's q) set back to the
    case's values, before each run of a captured graph: a replay then starts where the eager call did,
    as a step's inputs are rewritten before each step."""
    for name, spec in m.case.tensors.items():
        if isinstance(spec, C.TSpec) and spec.out and not spec.alias and spec.values is not None:
            _set_host_or_device(be, m.held[name], np.asarray(_host(spec)[1].numpy()))
    for name, spec in m.case.tensors.items():
        if isinstance(spec, C.TSpec) and spec.out and not spec.alias and spec.values is None:
            h = m.held[name]
            cur = np.array(be.to_numpy(h.base))
            raw = np.full(cur.nbytes, POISON_BYTE, np.uint8)
            if cur.dtype.kind == "f" or "float" in cur.dtype.name:
                nan = np.full(cur.shape, np.nan, cur.dtype)
                raw = nan.view(np.uint8).reshape(-1)
            _set_host_or_device(be, h, raw)


def _outputs(m: Materialized) -> bytes:
    return b"".join(np.ascontiguousarray(m.read(n)).tobytes() for n in m.case.check)


class L3:
    def __init__(self, lib_path, recorder: Recorder):
        self.path = lib_path
        self.rec = recorder
        self.results: list[Outcome] = []

    def check(self, op, name, fn):
        if self.rec.start(Recorder.key(op, name)) is not None:
            return
        o = Outcome(op, name, "device", "fail")
        try:
            note = fn()
            o.status = "pass"
            o.message = note or ""
        except CheckFailed as e:
            o.message = str(e)
        except Exception as e:
            o.status = "error"
            o.message = f"{type(e).__name__}: {e}"
        self.results.append(o)
        self.rec.done(o)

    def expect(self, be, st, what):
        if st != abi.OK:
            raise CheckFailed(f"{what}: {_name(st)}: {be._error_message(be._ctx)}")

    def run(self):
        be = load_library(self.path)
        try:
            graphs = all(_has(be, e) for e in ("graph_begin", "graph_end", "graph_launch", "graph_destroy"))
            events = all(_has(be, e) for e in ("event_create", "event_record", "stream_wait_event",
                                                "event_synchronize", "event_destroy", "mem_copy_async"))
            if not graphs and not events and be.device == "cpu":
                o = Outcome("*", "L3", "*", "skipped",
                            "host CPU library without graph_* or event entries: streams and graphs do not apply")
                self.results.append(o)
                self.rec.done(o)
                return self.results
            ops = be.ops()
            if _has(be, "stream_create"):
                for op in ops:
                    self.check(op, "runs on the given stream", lambda op=op: self.on_stream(be, op))
            if graphs:
                self.check("*", "graph capture and replay", lambda: self.graph(be, ops))
                self.check("*", "graph entries reject NULLs", lambda: self.graph_nulls(be))
            if ops:
                self.check(ops[0], "two contexts from two threads at once", lambda: self.two_threads(ops[0]))
            if events and _has(be, "stream_create"):
                op = next((o for o in ops if o in ("add", "mul", "silu_mul", "rmsnorm")), None)
                if op:
                    self.check(op, "an event orders an async upload on one stream before an op on another",
                               lambda: self.event_order(be, op))
        finally:
            release_comm(be)
            be.close()
        return self.results

    def _eager(self, be, op, case):
        m = Materialized(be, case)
        be.call(op, **m.kwargs)
        be.synchronize()
        return _outputs(m)

    def on_stream(self, be, op):
        case = C.a_valid_case(op)
        want = self._eager(be, op, case)
        s = ffi.new("DI_Stream*")
        self.expect(be, be._api.stream_create(be._ctx, s), "stream_create")
        try:
            m = Materialized(be, case)
            args, keep = be._marshal(op, m.kwargs)
            args.header.stream = s[0]
            self.expect(be, getattr(be._api, op)(be._ctx, args), f"{op} on a stream")
            self.expect(be, be._api.stream_synchronize(be._ctx, s[0]), "stream_synchronize(stream)")
            if _outputs(m) != want:
                raise CheckFailed(f"{op} on a created stream gave a different result than on the default stream")
        finally:
            if _has(be, "stream_destroy"):
                be._api.stream_destroy(be._ctx, s[0])

    def graph(self, be, ops):
        api, ctx = be._api, be._ctx
        stream = ffi.NULL
        s = ffi.new("DI_Stream*")
        if _has(be, "stream_create"):
            self.expect(be, api.stream_create(ctx, s), "stream_create")
            stream = s[0]
        cases = [(op, C.a_valid_case(op)) for op in ops]
        eager = [self._eager(be, op, c) for op, c in cases]
        mats, keeps = [], []
        self.expect(be, api.graph_begin(ctx, stream), "graph_begin")
        try:
            for op, c in cases:
                m = Materialized(be, c)
                _poison_outputs(be, m)
                args, keep = be._marshal(op, m.kwargs)
                args.header.stream = stream
                self.expect(be, getattr(api, op)(ctx, args), f"{op} while capturing")
                mats.append(m)
                keeps.append((args, keep))
        finally:
            g = ffi.new("DI_Graph**")
            st_end = api.graph_end(ctx, stream, g)
        self.expect(be, st_end, "graph_end")
        if g[0] == ffi.NULL:
            raise CheckFailed("graph_end returned OK and a NULL graph")
        try:
            for replay in range(2):
                for m in mats:
                    _poison_outputs(be, m)
                self.expect(be, api.graph_launch(ctx, g[0], stream), f"graph_launch #{replay + 1}")
                self.expect(be, api.stream_synchronize(ctx, stream), "stream_synchronize")
                for (op, _), m, want in zip(cases, mats, eager):
                    if _outputs(m) != want:
                        raise CheckFailed(f"replay #{replay + 1}: {op} differs from the eager result")
            # new inputs in the same buffers: the replay must read them
            for (op, c), m in zip(cases, mats):
                c2 = C.a_valid_case(op)
                c2.seed = c.seed + 1
                rng = np.random.default_rng(99)
                for name, spec in c.tensors.items():
                    if isinstance(spec, C.TSpec) and not spec.out and spec.values is not None and \
                            np.asarray(spec.values).dtype.kind == "f" and not spec.quant and spec.pad == (0, 0):
                        new = (np.asarray(spec.values, np.float32) + rng.standard_normal(spec.shape)
                               .astype(np.float32)).astype(np.asarray(spec.values).dtype)
                        c2.tensors[name] = C.TSpec(spec.dtype, spec.shape, new)
                        _set_host_or_device(be, m.held[name], new)
                m.new_want = self._eager(be, op, c2)
                m.case_new = c2
                _poison_outputs(be, m)
            self.expect(be, api.graph_launch(ctx, g[0], stream), "graph_launch after new inputs")
            self.expect(be, api.stream_synchronize(ctx, stream), "stream_synchronize")
            for (op, _), m in zip(cases, mats):
                if _outputs(m) != m.new_want:
                    raise CheckFailed(f"{op}: a replay after writing new inputs did not compute on them")
        finally:
            api.graph_destroy(ctx, g[0])
            if stream != ffi.NULL and _has(be, "stream_destroy"):
                api.stream_destroy(ctx, stream)
        return f"{len(cases)} op(s) captured, replayed 3 times"

    def event_order(self, be, op):
        """Stream A uploads new input values from pinned memory (mem_copy_async) and records an event;
        stream B waits for it and runs the op. B must see the new values: the wait orders the streams,
        and nothing synchronizes the host in between. Repeated, so a missing wait shows as a race."""
        api, ctx = be._api, be._ctx
        rng = np.random.default_rng(3)
        sa, sb, ev = ffi.new("DI_Stream*"), ffi.new("DI_Stream*"), ffi.new("DI_Event*")
        self.expect(be, api.stream_create(ctx, sa), "stream_create")
        self.expect(be, api.stream_create(ctx, sb), "stream_create")
        self.expect(be, api.event_create(ctx, ev), "event_create")
        pinned = None
        try:
            for rep in range(8):
                case = C.a_valid_case(op)
                first = next(n for n, sp in case.tensors.items() if isinstance(sp, C.TSpec) and not sp.out
                             and not sp.alias and sp.values is not None and not sp.quant)
                spec = case.tensors[first]
                m = Materialized(be, case)
                new = (rng.standard_normal(spec.shape) * 4).astype(np.asarray(spec.values).dtype)
                c2 = C.a_valid_case(op)
                c2.tensors[first] = C.TSpec(spec.dtype, spec.shape, new)
                want = self._eager(be, op, c2)
                held = m.held[first]
                raw = np.ascontiguousarray(new).view(np.uint8).reshape(-1)
                if pinned is None and _has(be, "host_alloc"):
                    pinned = be.host_empty((raw.nbytes,), "uint8")
                src = raw if pinned is None else pinned.numpy()[: raw.nbytes]
                src[...] = raw
                dst = held.base.buffer.ptr if not held.base.on_host else held.base.data_ptr
                dst += held.base.offset
                _poison_outputs(be, m)
                self.expect(be, api.mem_copy_async(ctx, ffi.cast("void*", dst), ffi.cast("void*", src.ctypes.data),
                                                   raw.nbytes, abi.const("DI_COPY_HOST_TO_DEVICE" if not held.base.on_host
                                                                         else "DI_COPY_HOST_TO_HOST"), sa[0]),
                            "mem_copy_async on stream A")
                self.expect(be, api.event_record(ctx, ev[0], sa[0]), "event_record on stream A")
                self.expect(be, api.stream_wait_event(ctx, sb[0], ev[0]), "stream_wait_event on stream B")
                args, keep = be._marshal(op, m.kwargs)
                args.header.stream = sb[0]
                self.expect(be, getattr(api, op)(ctx, args), f"{op} on stream B")
                self.expect(be, api.stream_synchronize(ctx, sb[0]), "stream_synchronize(B)")
                if _outputs(m) != want:
                    raise CheckFailed(f"round {rep}: {op} on stream B did not see the values uploaded on stream A "
                                      f"before the event it waited for")
        finally:
            api.event_destroy(ctx, ev[0])
            api.stream_destroy(ctx, sa[0])
            api.stream_destroy(ctx, sb[0])
        return "8 rounds" + (", from pinned host memory" if pinned is not None else "")

    def graph_nulls(self, be):
        api, ctx = be._api, be._ctx
        for what, st in (("graph_launch(graph=NULL)", api.graph_launch(ctx, ffi.NULL, ffi.NULL)),
                         ("graph_destroy(graph=NULL)", api.graph_destroy(ctx, ffi.NULL)),
                         ("graph_end(out=NULL)", api.graph_end(ctx, ffi.NULL, ffi.NULL)),
                         ("graph_begin(ctx=NULL)", api.graph_begin(ffi.NULL, ffi.NULL))):
            if st != abi.INVALID_ARGUMENT:
                raise CheckFailed(f"{what}: {_name(st)}, expected INVALID_ARGUMENT")

    def two_threads(self, op):
        bes = [load_library(self.path), load_library(self.path)]
        case = C.a_valid_case(op)
        results: list[list[bytes]] = [[], []]
        errors: list[str] = []

        def work(i):
            try:
                for _ in range(20):
                    results[i].append(self._eager(bes[i], op, case))
            except Exception as e:
                errors.append(f"context {i}: {e}")
        try:
            ths = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(120)
        finally:
            for b in bes:
                release_comm(b)
                b.close()
        if errors:
            raise CheckFailed("; ".join(errors))
        allres = set(results[0]) | set(results[1])
        if len(allres) != 1:
            raise CheckFailed(f"{op} gave {len(allres)} different results across two concurrent contexts")


def run_l3(lib_path: str, recorder: Recorder) -> list[Outcome]:
    return L3(lib_path, recorder).run()
