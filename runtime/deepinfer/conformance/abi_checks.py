"""L0: the ABI's behavioural rules (abi/README.md sections 1-7 and 9), called through cffi directly.

The Backend wrapper would hide exactly what is checked here (it always fills struct_size, never
passes NULL), so every call below builds or mangles the C structs itself. Each check is one
Outcome; a check that the library fails never stops the others.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .. import abi
from ..backend import BackendInfo, NativeBackend
from ..errors import BackendCallError, UnsupportedOpError
from ..loader import open_library, probe
from . import cases as C
from .harness import Outcome, Recorder
from .materialize import Materialized, comm_unavailable, release_comm

ffi = abi.ffi
S = abi.STATUS_NAMES
INVALID = abi.INVALID_ARGUMENT
UNIMPL = abi.UNIMPLEMENTED


class CheckFailed(Exception):
    pass




def _name(status: int) -> str:
    return S.get(status, f"status {status}")


class L0:
    def __init__(self, lib_path: str, recorder: Recorder):
        self.path = lib_path
        self.rec = recorder
        self.progress = recorder.progress
        self.results: list[Outcome] = []
        self.lib = self.info = self.api = None
        self.be: Optional[NativeBackend] = None
        self._comm_why: Optional[str] = None   # why the collectives cannot be called here (1.4)
        self._comm_failed = False              # ... because making a one-rank communicator failed
        self._comm_known = False

    # ------------------------------------------------------------------ plumbing
    def check(self, op: str, name: str, fn: Callable[[], Optional[str]], fmt: str = "abi",
              setup: bool = False) -> bool:
        prev = None if setup else self.rec.start(Recorder.key(op, name))
        if prev is not None:
            return prev == "pass"
        o = Outcome(op, name, fmt, "fail")
        try:
            note = fn()
            o.status = "pass"
            if note:
                o.message = note
        except CheckFailed as e:
            o.message = str(e)
        except BackendCallError as e:
            o.message = f"unexpected error: {e}"
        except Exception as e:
            o.status = "error"
            o.message = f"{type(e).__name__}: {e}"
        self.results.append(o)
        if not setup or o.status != "pass" or not self.rec.previous:
            self.rec.done(o)
        return o.status == "pass"

    def has(self, entry: str) -> bool:
        return ffi.offsetof("DI_Api", entry) < self.api.struct_size and getattr(self.api, entry) != ffi.NULL

    def err(self, ctx) -> str:
        m = self.api.last_error(ctx if ctx is not None else ffi.NULL)
        if m == ffi.NULL:
            raise CheckFailed("last_error returned NULL (it must never be NULL)")
        return ffi.string(m).decode("utf-8", "replace")

    def expect(self, status: int, want, what: str, ctx=None, need_message=True) -> str:
        """status must be one of want; a failure status must come with a message."""
        want = (want,) if isinstance(want, int) else tuple(want)
        msg = self.err(ctx) if status != abi.OK else ""
        if status not in want:
            extra = f" ({msg})" if msg else ""
            raise CheckFailed(f"{what}: got {_name(status)}{extra}, expected {' or '.join(_name(w) for w in want)}")
        if status != abi.OK and need_message and not msg:
            raise CheckFailed(f"{what}: {_name(status)} but last_error is empty")
        return msg

    def new_ctx(self):
        opts = ffi.new("DI_ContextOptions*")
        opts.struct_size = ffi.sizeof("DI_ContextOptions")
        out = ffi.new("DI_Context**")
        st = self.api.context_create(opts, out)
        if st != abi.OK:
            raise CheckFailed(f"context_create failed: {_name(st)}: {self.err(None)}")
        if out[0] == ffi.NULL:
            raise CheckFailed("context_create returned OK and a NULL context")
        return out[0]

    # ------------------------------------------------------------------ the checks
    def run(self) -> list[Outcome]:
        if not self.check("*", "bootstrap: deepinfer_plugin_info and version negotiation", self.c_bootstrap,
                          setup=True):
            return self.results   # nothing else can be called
        self.be = NativeBackend(self.lib, self.api, BackendInfo(self.name, self.version, self.device, self.path))
        try:
            self.check("*", "get_api(0) and get_api(2) return NULL", self.c_other_majors)
            self.check("*", "required table entries", self.c_required)
            self.check("*", "context_create: NULL out, struct_size smaller/larger, ext", self.c_context_create)
            self.check("*", "two contexts at once", self.c_two_contexts)
            self.check("*", "get_attribute: required keys, unknown key, small buffer, NULLs", self.c_attributes)
            self.check("*", "mem_alloc / mem_copy / mem_free, alignment, out of memory", self.c_memory)
            self.check("*", "streams", self.c_streams)
            self.check("*", "op_query: every op id, unknown op id, NULL out, struct_size", self.c_op_query)
            self.v11_checks()
            self.v14_checks()
            for op in abi.OP_NAMES:
                if self.has(op) and op in self.COLLECTIVES and self.comm_why():
                    self.check(op, "a collective: its checks need a one-rank communicator",
                               lambda op=op: self.c_collective_without_comm(op))
                elif self.has(op):
                    self.op_checks(op)
                else:
                    self.check(op, "NULL entry: the Backend reports UNIMPLEMENTED and never calls it",
                               lambda op=op: self.c_null_entry(op))
            if self.has("dequantize"):
                self.quant_checks("dequantize", C.dequantize(3, (2, 64), "int4/g32/sym/f32"), "x")
            elif self.has("linear"):
                self.quant_checks("linear", C.linear(3, 2, 64, 4, "f32", "int4/g32/sym/f32"), "w")
            self.check("*", "unload and reload (fresh process: dlopen, contexts, dlclose, dlopen again)",
                       self.c_reload)
        finally:
            release_comm(self.be)
            self.be.close()
        return self.results

    def c_bootstrap(self):
        self.lib, self.info, self.api = open_library(Path(self.path))   # raises BackendLoadError with the reason
        info = self.info
        if info.struct_size != ffi.sizeof("DI_PluginInfo"):
            raise CheckFailed(f"DI_PluginInfo.struct_size={info.struct_size}, must be {ffi.sizeof('DI_PluginInfo')} "
                              f"(the struct is frozen)")
        if info.name == ffi.NULL or not ffi.string(info.name):
            raise CheckFailed("DI_PluginInfo.name is NULL or empty")
        if info.version == ffi.NULL:
            raise CheckFailed("DI_PluginInfo.version is NULL")
        self.name = ffi.string(info.name).decode()
        self.version = ffi.string(info.version).decode()
        self.device = probe(Path(self.path)).device
        api = self.api
        if api.abi_minor != info.abi_minor:
            raise CheckFailed(f"DI_Api.abi_minor={api.abi_minor} but DI_PluginInfo.abi_minor={info.abi_minor}")
        if info.abi_minor == abi.ABI_MINOR and api.struct_size < ffi.sizeof("DI_Api"):
            raise CheckFailed(f"the library says ABI 1.{info.abi_minor} but DI_Api.struct_size={api.struct_size} < "
                              f"{ffi.sizeof('DI_Api')}")
        note = f"ABI {info.abi_major}.{info.abi_minor}, DI_Api.struct_size {api.struct_size}"
        if info.score != ffi.NULL:
            note += f", score() = {int(info.score())}"
        return note

    def c_other_majors(self):
        for major in (0, 2, 0xFFFFFFFF):
            p = self.info.get_api(major)
            if p != ffi.NULL:
                raise CheckFailed(f"get_api({major}) returned a table; it must return NULL for a major it lacks")

    def c_required(self):
        missing = [e for e in ("context_create", "context_destroy", "last_error", "get_attribute") if not self.has(e)]
        if self.device != "cpu":
            missing += [e for e in ("mem_alloc", "mem_free", "mem_copy", "stream_synchronize") if not self.has(e)]
        if missing:
            raise CheckFailed(f"required entries are NULL: {', '.join(missing)}")
        graph = [self.has(e) for e in ("graph_begin", "graph_end", "graph_launch", "graph_destroy")]
        if any(graph) and not all(graph):
            raise CheckFailed("graph capture entries must be all four or none")
        ops = [op for op in abi.OP_NAMES if self.has(op)]
        return f"{len(ops)} of {len(abi.OP_NAMES)} ops: {', '.join(ops) or 'none'}"

    def c_context_create(self):
        api = self.api
        opts = ffi.new("DI_ContextOptions*")
        opts.struct_size = ffi.sizeof("DI_ContextOptions")
        self.expect(api.context_create(opts, ffi.NULL), INVALID, "context_create(options, out=NULL)")
        out = ffi.new("DI_Context**")
        small = ffi.new("DI_ContextOptions*")
        small.struct_size = 4
        self.expect(api.context_create(small, out), INVALID, "context_create with options.struct_size=4")
        size = ffi.sizeof("DI_ContextOptions")
        big = ffi.new("char[]", size + 32)
        ffi.memmove(big, opts, size)
        bigp = ffi.cast("DI_ContextOptions*", big)
        bigp.struct_size = size + 32
        self.expect(api.context_create(bigp, out), abi.OK, "context_create with a larger struct_size, zero tail")
        self.expect(api.context_destroy(out[0]), abi.OK, "context_destroy")
        big[size + 5] = b"\x01"
        out[0] = ffi.NULL
        self.expect(api.context_create(bigp, out), UNIMPL, "context_create with a larger struct_size and non-zero "
                    "bytes past the library's size")
        ext = ffi.new("int*")
        opts.ext = ext
        self.expect(api.context_create(opts, out), UNIMPL, "context_create with options.ext != NULL")
        self.expect(api.context_destroy(ffi.NULL), INVALID, "context_destroy(NULL)")

    def _valid_op(self):
        for op in abi.OP_NAMES:
            if self.has(op):
                return op
        return None

    def c_two_contexts(self):
        a, b = self.new_ctx(), self.new_ctx()
        try:
            if a == b:
                raise CheckFailed("two context_create calls returned the same context")
            op = self._valid_op()
            if op is None:
                return "no op to run"
            case = C.a_valid_case(op)
            outs = []
            for ctx in (a, b):
                m = Materialized(self.be, case)
                args, keep = self.be._marshal(op, m.kwargs)
                self.expect(getattr(self.api, op)(ctx, args), abi.OK, f"{op} on context {len(outs) + 1}", ctx)
                outs.append(np.ascontiguousarray(m.read(case.check[0])).tobytes())
            if outs[0] != outs[1]:
                raise CheckFailed(f"{op} gave different results on two contexts")
            # an error on one context leaves the other usable
            self.expect(getattr(self.api, op)(a, ffi.NULL), INVALID, f"{op}(ctx_a, NULL)", a)
            m = Materialized(self.be, case)
            args, keep = self.be._marshal(op, m.kwargs)
            self.expect(getattr(self.api, op)(b, args), abi.OK, f"{op} on context b after an error on a", b)
            self.expect(self.api.context_destroy(a), abi.OK, "context_destroy(a)")
            a = None
            m = Materialized(self.be, case)
            args, keep = self.be._marshal(op, m.kwargs)
            self.expect(getattr(self.api, op)(b, args), abi.OK, f"{op} on context b after destroying a", b)
        finally:
            if a is not None:
                self.api.context_destroy(a)
            self.api.context_destroy(b)

    def c_attributes(self):
        api, ctx = self.api, self.be._ctx
        buf = ffi.new("char[]", 256)
        got = {}
        for key in ("name", "version", "abi.version", "device.name"):
            self.expect(api.get_attribute(ctx, key.encode(), buf, 256), abi.OK, f"get_attribute({key!r})", ctx)
            got[key] = ffi.string(buf).decode("utf-8", "replace")
            if not got[key]:
                raise CheckFailed(f"get_attribute({key!r}) is empty")
        if got["abi.version"] != f"{abi.ABI_MAJOR}.{self.info.abi_minor}":
            raise CheckFailed(f"abi.version attribute {got['abi.version']!r} != '{abi.ABI_MAJOR}.{self.info.abi_minor}'")
        if got["name"] != self.name:
            raise CheckFailed(f"name attribute {got['name']!r} != DI_PluginInfo.name {self.name!r}")
        self.expect(api.get_attribute(ctx, b"no.such.key", buf, 256), UNIMPL, "get_attribute('no.such.key')", ctx)
        self.expect(api.get_attribute(ctx, b"name", buf, 1), INVALID, "get_attribute('name') into a 1-byte buffer",
                    ctx)
        self.expect(api.get_attribute(ctx, ffi.NULL, buf, 256), INVALID, "get_attribute(key=NULL)", ctx)
        self.expect(api.get_attribute(ctx, b"name", ffi.NULL, 256), INVALID, "get_attribute(buf=NULL)", ctx)
        self.expect(api.get_attribute(ffi.NULL, b"name", buf, 256), (abi.OK, INVALID), "get_attribute(ctx=NULL)",
                    None)
        return ", ".join(f"{k}={v}" for k, v in got.items())

    def c_memory(self):
        api, ctx = self.api, self.be._ctx
        if not self.has("mem_alloc"):
            return "no mem_alloc (host-memory library)"
        p = ffi.new("void**")
        self.expect(api.mem_alloc(ctx, 1000, p), abi.OK, "mem_alloc(1000)", ctx)
        addr = int(ffi.cast("uintptr_t", p[0]))
        if addr == 0 or addr % 256:
            raise CheckFailed(f"mem_alloc returned {addr:#x}, which is not 256-byte aligned")
        if self.has("mem_copy"):
            src = np.arange(1000, dtype=np.uint8)
            dst = np.zeros(1000, np.uint8)
            h2d = abi.const("DI_COPY_HOST_TO_DEVICE")
            d2h = abi.const("DI_COPY_DEVICE_TO_HOST")
            self.expect(api.mem_copy(ctx, p[0], ffi.cast("void*", src.ctypes.data), 1000, h2d, ffi.NULL), abi.OK,
                        "mem_copy host->device", ctx)
            self.expect(api.mem_copy(ctx, ffi.cast("void*", dst.ctypes.data), p[0], 1000, d2h, ffi.NULL), abi.OK,
                        "mem_copy device->host", ctx)
            if self.has("stream_synchronize"):
                self.expect(api.stream_synchronize(ctx, ffi.NULL), abi.OK, "stream_synchronize(NULL)", ctx)
            if not np.array_equal(src, dst):
                raise CheckFailed("mem_copy round trip changed the bytes")
            self.expect(api.mem_copy(ctx, p[0], ffi.cast("void*", src.ctypes.data), 10, 99, ffi.NULL), INVALID,
                        "mem_copy with kind=99", ctx)
        if self.has("mem_free"):
            self.expect(api.mem_free(ctx, p[0]), abi.OK, "mem_free", ctx)
        self.expect(api.mem_alloc(ctx, 1000, ffi.NULL), INVALID, "mem_alloc(out=NULL)", ctx)
        q = ffi.new("void**")
        st = api.mem_alloc(ctx, 1 << 62, q)
        self.expect(st, abi.RESOURCE_EXHAUSTED, "mem_alloc(2^62 bytes)", ctx)

    def c_streams(self):
        api, ctx = self.api, self.be._ctx
        notes = []
        if self.has("stream_create"):
            s = ffi.new("DI_Stream*")
            self.expect(api.stream_create(ctx, s), abi.OK, "stream_create", ctx)
            if self.has("stream_synchronize"):
                self.expect(api.stream_synchronize(ctx, s[0]), abi.OK, "stream_synchronize(new stream)", ctx)
            if self.has("stream_destroy"):
                self.expect(api.stream_destroy(ctx, s[0]), abi.OK, "stream_destroy", ctx)
            self.expect(api.stream_create(ctx, ffi.NULL), INVALID, "stream_create(out=NULL)", ctx)
            notes.append("stream_create/destroy")
        if self.has("stream_synchronize"):
            self.expect(api.stream_synchronize(ctx, ffi.NULL), abi.OK, "stream_synchronize(default stream)", ctx)
            self.expect(api.stream_synchronize(ffi.NULL, ffi.NULL), INVALID, "stream_synchronize(ctx=NULL)", None)
            notes.append("stream_synchronize")
        return ", ".join(notes) or "no stream entries"

    # ------------------------------------------------------------------ ABI 1.1 entries
    def v11_checks(self):
        """Events, host memory, async copies, device_count, memory attributes, per-thread errors. A 1.0
        library's table ends before these entries: each check then passes with that note."""
        if self.info.abi_minor < 1:
            self.check("*", "1.1 entries: not offered by a 1.0 library", lambda: f"ABI 1.{self.info.abi_minor}")
            return
        self.check("*", "1.1 entry groups: events all six or none, host memory all four or none", self.c_v11_groups)
        self.check("*", "events: create, record, wait, query, synchronize, destroy, NULLs", self.c_events)
        self.check("*", "host_alloc / host_free: alignment, host access, NULL out, out of memory", self.c_host_alloc)
        self.check("*", "host_register / host_unregister: overlap and double unregister rejected", self.c_host_register)
        self.check("*", "mem_copy_async: host -> device -> host through pinned memory on a stream", self.c_copy_async)
        self.check("*", "device_count", self.c_device_count)
        self.check("*", "device.memory_free_bytes / device.memory_total_bytes", self.c_memory_attributes)
        self.check("*", "last_error is per thread: two threads failing on one context keep their own message",
                   self.c_thread_errors)

    # ------------------------------------------------------------------ ABI 1.4 entries
    COMM_ENTRIES = ("comm_unique_id", "comm_create", "comm_destroy")
    COLLECTIVES = ("all_reduce", "all_gather", "all_to_all")

    def v14_checks(self):
        """Communicators (README section 9). A 1.3 library's table ends before these entries."""
        if self.info.abi_minor < 4:
            self.check("*", "1.4 entries: not offered by an older library", lambda: f"ABI 1.{self.info.abi_minor}")
            return
        self.check("*", "1.4 communicators: comm_unique_id, comm_create, comm_destroy and the three collectives "
                        "all six or none", self.c_v14_group)
        self.check("*", "comm_unique_id / comm_create / comm_destroy: NULLs, nranks and rank out of range, "
                        "one-rank communicators", self.c_comm)

    def comm_why(self) -> Optional[str]:
        """Why the collectives cannot be called through the Backend here (None: they can); asked once."""
        if not self._comm_known:
            try:
                self._comm_why = comm_unavailable(self.be)
            except BackendCallError as e:
                self._comm_why, self._comm_failed = f"comm_create of one rank failed: {e}", True
            self._comm_known = True
        return self._comm_why

    def c_v14_group(self):
        have = {e: self.has(e) for e in self.COMM_ENTRIES + self.COLLECTIVES}
        if any(have.values()) and not all(have.values()):
            missing = [e for e, h in have.items() if not h]
            raise CheckFailed(f"{', '.join(missing)} NULL while others are set: comm_unique_id, comm_create, "
                              f"comm_destroy, all_reduce, all_gather and all_to_all are all six or none")
        local = [op for op in ("moe_dispatch", "moe_combine") if self.has(op)]
        return f"communicators {'yes' if all(have.values()) else 'no'}; moe_dispatch/moe_combine: " \
               f"{', '.join(local) or 'none'}"

    def c_comm(self):
        if not all(self.has(e) for e in self.COMM_ENTRIES):
            return "no communicators"
        api, ctx = self.api, self.be._ctx
        cid, cid2 = ffi.new("DI_CommId*"), ffi.new("DI_CommId*")
        self.expect(api.comm_unique_id(ctx, ffi.NULL), INVALID, "comm_unique_id(out=NULL)", ctx)
        self.expect(api.comm_unique_id(ffi.NULL, cid), INVALID, "comm_unique_id(ctx=NULL)", None)
        st = api.comm_unique_id(ctx, cid)
        if st == UNIMPL:   # e.g. a GPU library whose transport (NCCL) is not installed
            return f"comm_unique_id is UNIMPLEMENTED here: {self.err(ctx)}"
        self.expect(st, abi.OK, "comm_unique_id", ctx)
        self.expect(api.comm_unique_id(ctx, cid2), abi.OK, "comm_unique_id (a second id)", ctx)
        if ffi.buffer(cid)[:] == ffi.buffer(cid2)[:]:
            raise CheckFailed("two comm_unique_id calls returned the same bytes (each names a new communicator)")
        out = ffi.new("DI_Comm**")
        # refused before joining anything: none of these may block waiting for other ranks
        for nranks, rank in ((0, 0), (-1, 0), (1, 1), (1, -1), (2, 2), (2, -1)):
            self.expect(api.comm_create(ctx, cid, nranks, rank, out), INVALID,
                        f"comm_create(nranks={nranks}, rank={rank})", ctx)
        self.expect(api.comm_create(ctx, ffi.NULL, 1, 0, out), INVALID, "comm_create(id=NULL)", ctx)
        self.expect(api.comm_create(ctx, cid, 1, 0, ffi.NULL), INVALID, "comm_create(out=NULL)", ctx)
        self.expect(api.comm_create(ffi.NULL, cid, 1, 0, out), INVALID, "comm_create(ctx=NULL)", None)
        comms = []
        try:
            for i, c in enumerate((cid, cid2)):   # two communicators alive at once
                out[0] = ffi.NULL
                st = api.comm_create(ctx, c, 1, 0, out)
                if st == UNIMPL:
                    return f"comm_create of one rank is UNIMPLEMENTED here: {self.err(ctx)}"
                self.expect(st, abi.OK, f"comm_create(nranks=1, rank=0) #{i + 1}", ctx)
                if out[0] == ffi.NULL:
                    raise CheckFailed("comm_create returned OK and a NULL communicator")
                comms.append(out[0])
            if comms[0] == comms[1]:
                raise CheckFailed("two comm_create calls returned the same communicator")
            self.expect(api.comm_destroy(ctx, ffi.NULL), INVALID, "comm_destroy(NULL)", ctx)
            self.expect(api.comm_destroy(ffi.NULL, comms[0]), INVALID, "comm_destroy(ctx=NULL)", None)
        finally:
            failed = [c for c in comms if api.comm_destroy(ctx, c) != abi.OK]
        if failed:
            raise CheckFailed(f"comm_destroy of a one-rank communicator failed: {self.err(ctx)}")
        return "two one-rank communicators created and destroyed"

    def c_collective_without_comm(self, op):
        if self._comm_failed:
            raise CheckFailed(f"{op}: not called, {self.comm_why()}")
        if self.has("comm_create"):
            return f"not called: {self.comm_why()}"   # the library said UNIMPLEMENTED (e.g. no transport here)
        raise CheckFailed(f"{op} is in the table but the library has no communicators to call it with")

    def _comm_checks(self, op: str):
        """A collective's comm: NULL, or a pointer comm_create never returned, is INVALID_ARGUMENT (a library
        recognizes its own communicators), never a crash. And its tensors must be contiguous."""
        def null(args, keep, case):
            args.comm = ffi.NULL

        def forged(args, keep, case):
            fake = ffi.new("char[]", 4096)   # zero-filled, readable: no communicator a library made
            keep.append(fake)
            args.comm = ffi.cast("DI_Comm*", fake)

        def garbage(args, keep, case):
            fake = ffi.new("char[]", bytes(range(256)) * 16)
            keep.append(fake)
            args.comm = ffi.cast("DI_Comm*", fake)

        def strided(args, keep, case):   # every data tensor a column slice of itself: same shapes, not contiguous
            for name in ("x", "out", "send", "recv"):
                if hasattr(args, name):
                    t = getattr(args, name)
                    t.shape[t.ndim - 1] //= 2
        self.check(op, "comm NULL -> INVALID_ARGUMENT", lambda: self._expect_rejected(op, null, INVALID, "comm=NULL"))
        self.check(op, "tensors that are not contiguous (column slices) -> INVALID_ARGUMENT",
                   lambda: self._expect_rejected(op, strided, INVALID, "column slices of the inputs and outputs"))
        self.check(op, "comm not made by comm_create (zero-filled, or arbitrary bytes) -> INVALID_ARGUMENT",
                   lambda: (self._expect_rejected(op, forged, INVALID, "a zero-filled buffer as comm"),
                            self._expect_rejected(op, garbage, INVALID, "arbitrary bytes as comm"))[0])

    EVENT_ENTRIES = ("event_create", "event_destroy", "event_record", "stream_wait_event", "event_query",
                     "event_synchronize")
    HOST_ENTRIES = ("host_alloc", "host_free", "host_register", "host_unregister")

    def c_v11_groups(self):
        notes = []
        for group, entries in (("events", self.EVENT_ENTRIES), ("host memory", self.HOST_ENTRIES)):
            have = [self.has(e) for e in entries]
            if any(have) and not all(have):
                missing = [e for e, h in zip(entries, have) if not h]
                raise CheckFailed(f"{group}: {', '.join(missing)} NULL while others are set (all or none)")
            notes.append(f"{group} {'yes' if all(have) else 'no'}")
        for e in ("mem_copy_async", "device_count"):
            notes.append(f"{e} {'yes' if self.has(e) else 'no'}")
        return ", ".join(notes)

    def _stream(self):
        if not self.has("stream_create"):
            return ffi.NULL
        s = ffi.new("DI_Stream*")
        self.expect(self.api.stream_create(self.be._ctx, s), abi.OK, "stream_create", self.be._ctx)
        return s[0]

    def _drop_stream(self, s):
        if s != ffi.NULL and self.has("stream_destroy"):
            self.api.stream_destroy(self.be._ctx, s)

    def c_events(self):
        if not self.has("event_create"):
            return "no events"
        api, ctx = self.api, self.be._ctx
        self.expect(api.event_create(ctx, ffi.NULL), INVALID, "event_create(out=NULL)", ctx)
        self.expect(api.event_create(ffi.NULL, ffi.new("DI_Event*")), INVALID, "event_create(ctx=NULL)", None)
        e = ffi.new("DI_Event*")
        self.expect(api.event_create(ctx, e), abi.OK, "event_create", ctx)
        done = ffi.new("int32_t*")
        s = self._stream()
        try:
            self.expect(api.event_query(ctx, e[0], done), abi.OK, "event_query before any record", ctx)
            if done[0] != 1:
                raise CheckFailed("event_query of an event never recorded said not reached (it has nothing to wait for)")
            for stream, what in ((ffi.NULL, "the default stream"), (s, "a created stream")):
                self.expect(api.event_record(ctx, e[0], stream), abi.OK, f"event_record on {what}", ctx)
                self.expect(api.stream_wait_event(ctx, stream, e[0]), abi.OK, f"stream_wait_event on {what}", ctx)
                self.expect(api.event_synchronize(ctx, e[0]), abi.OK, "event_synchronize", ctx)
                done[0] = -1
                self.expect(api.event_query(ctx, e[0], done), abi.OK, "event_query after event_synchronize", ctx)
                if done[0] != 1:
                    raise CheckFailed(f"event_query after event_synchronize wrote {done[0]}, expected 1")
            self.expect(api.event_query(ctx, e[0], ffi.NULL), INVALID, "event_query(done=NULL)", ctx)
            for name, st in (("event_record(NULL)", api.event_record(ctx, ffi.NULL, ffi.NULL)),
                             ("event_query(NULL)", api.event_query(ctx, ffi.NULL, done)),
                             ("event_synchronize(NULL)", api.event_synchronize(ctx, ffi.NULL)),
                             ("stream_wait_event(event=NULL)", api.stream_wait_event(ctx, ffi.NULL, ffi.NULL)),
                             ("event_destroy(NULL)", api.event_destroy(ctx, ffi.NULL))):
                self.expect(st, INVALID, name, ctx)
        finally:
            self.expect(api.event_destroy(ctx, e[0]), abi.OK, "event_destroy", ctx)
            self._drop_stream(s)
        return "record / wait / query / synchronize on the default and a created stream"

    def c_host_alloc(self):
        if not self.has("host_alloc"):
            return "no host memory entries"
        api, ctx = self.api, self.be._ctx
        p = ffi.new("void**")
        self.expect(api.host_alloc(ctx, 4096, p), abi.OK, "host_alloc(4096)", ctx)
        addr = int(ffi.cast("uintptr_t", p[0]))
        try:
            if addr == 0 or addr % 256:
                raise CheckFailed(f"host_alloc returned {addr:#x}, not 256-byte aligned")
            view = np.frombuffer(ffi.buffer(ffi.cast("char*", p[0]), 4096), np.uint8)
            view[:] = np.arange(4096) % 251          # the host reads and writes it directly
            if not np.array_equal(view, np.arange(4096) % 251):
                raise CheckFailed("host_alloc memory did not keep what the host wrote")
        finally:
            self.expect(api.host_free(ctx, p[0]), abi.OK, "host_free", ctx)
        self.expect(api.host_free(ctx, ffi.NULL), abi.OK, "host_free(NULL)", ctx)
        self.expect(api.host_alloc(ctx, 64, ffi.NULL), INVALID, "host_alloc(out=NULL)", ctx)
        self.expect(api.host_alloc(ctx, 1 << 62, p), abi.RESOURCE_EXHAUSTED, "host_alloc(2^62 bytes)", ctx)

    def c_host_register(self):
        if not self.has("host_register"):
            return "no host memory entries"
        api, ctx = self.api, self.be._ctx
        buf = np.zeros(1 << 16, np.uint8)
        ptr = ffi.cast("void*", buf.ctypes.data)
        self.expect(api.host_register(ctx, ptr, buf.nbytes), abi.OK, "host_register(64 KiB)", ctx)
        try:
            self.expect(api.host_register(ctx, ptr, buf.nbytes), INVALID, "host_register of a registered range", ctx)
        finally:
            self.expect(api.host_unregister(ctx, ptr), abi.OK, "host_unregister", ctx)
        self.expect(api.host_unregister(ctx, ptr), INVALID, "host_unregister of a range no longer registered", ctx)
        self.expect(api.host_register(ctx, ffi.NULL, 64), INVALID, "host_register(NULL)", ctx)

    def c_copy_async(self):
        if not self.has("mem_copy_async"):
            return "no mem_copy_async"
        api, ctx = self.api, self.be._ctx
        n = 1 << 20
        src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
        back = np.zeros(n, np.uint8)
        dev = ffi.new("void**")
        s = self._stream()
        regs = []
        try:
            if self.has("mem_alloc"):
                self.expect(api.mem_alloc(ctx, n, dev), abi.OK, "mem_alloc", ctx)
            else:
                dev[0] = ffi.cast("void*", np.zeros(n, np.uint8).ctypes.data)
            if self.has("host_register"):
                for a in (src, back):
                    self.expect(api.host_register(ctx, ffi.cast("void*", a.ctypes.data), n), abi.OK, "host_register",
                                ctx)
                    regs.append(a)
            h2d, d2h = abi.const("DI_COPY_HOST_TO_DEVICE"), abi.const("DI_COPY_DEVICE_TO_HOST")
            self.expect(api.mem_copy_async(ctx, dev[0], ffi.cast("void*", src.ctypes.data), n, h2d, s), abi.OK,
                        "mem_copy_async host->device", ctx)
            self.expect(api.mem_copy_async(ctx, ffi.cast("void*", back.ctypes.data), dev[0], n, d2h, s), abi.OK,
                        "mem_copy_async device->host", ctx)
            self.expect(api.stream_synchronize(ctx, s), abi.OK, "stream_synchronize", ctx)
            if not np.array_equal(src, back):
                raise CheckFailed("a host -> device -> host round trip of mem_copy_async changed the bytes")
            self.expect(api.mem_copy_async(ctx, dev[0], ffi.cast("void*", src.ctypes.data), 16, 99, s), INVALID,
                        "mem_copy_async with kind=99", ctx)
        finally:
            for a in regs:
                api.host_unregister(ctx, ffi.cast("void*", a.ctypes.data))
            if self.has("mem_alloc") and dev[0] != ffi.NULL:
                api.mem_free(ctx, dev[0])
            self._drop_stream(s)
        return f"{n >> 20} MiB round trip" + (" from registered host memory" if regs else "")

    def c_device_count(self):
        if not self.has("device_count"):
            return "no device_count"
        n = ffi.new("int32_t*")
        self.expect(self.api.device_count(n), abi.OK, "device_count", None)
        if n[0] < 1:
            raise CheckFailed(f"device_count said {n[0]} although a context was created")
        self.expect(self.api.device_count(ffi.NULL), INVALID, "device_count(NULL)", None)
        return f"{n[0]} device(s)"

    def c_memory_attributes(self):
        api, ctx = self.api, self.be._ctx
        buf = ffi.new("char[]", 64)
        got = {}
        for key in ("device.memory_free_bytes", "device.memory_total_bytes"):
            self.expect(api.get_attribute(ctx, key.encode(), buf, 64), abi.OK, f"get_attribute({key!r})", ctx)
            text = ffi.string(buf).decode()
            if not text.isdigit():
                raise CheckFailed(f"{key} = {text!r} is not a decimal byte count")
            got[key] = int(text)
        free, total = got["device.memory_free_bytes"], got["device.memory_total_bytes"]
        if not 0 < total or not 0 <= free <= total:
            raise CheckFailed(f"free {free} / total {total} bytes is not a plausible pair")
        return f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"

    def c_thread_errors(self):
        import threading
        api, ctx = self.api, self.be._ctx
        first_failed, second_failed = threading.Event(), threading.Event()
        seen: dict = {}

        def one():
            api.get_attribute(ctx, b"thread.one.key", ffi.new("char[]", 8), 8)     # UNIMPLEMENTED
            first_failed.set()
            second_failed.wait(30)
            seen["one"] = self.err(ctx)

        def two():
            first_failed.wait(30)
            api.get_attribute(ctx, b"thread.two.key", ffi.new("char[]", 8), 8)
            seen["two"] = self.err(ctx)
            second_failed.set()

        ts = [threading.Thread(target=one), threading.Thread(target=two)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        if "thread.one.key" not in seen.get("one", "") or "thread.two.key" not in seen.get("two", ""):
            raise CheckFailed(f"each thread must read its own last error; thread one read {seen.get('one')!r}, "
                              f"thread two {seen.get('two')!r}")

    def c_op_query(self):
        api, ctx = self.api, self.be._ctx
        if not self.has("op_query"):
            return "no op_query: the host assumes YES for every non-NULL op"
        res = ffi.new("DI_OpQuery*")
        res.struct_size = ffi.sizeof("DI_OpQuery")
        for op in abi.OP_NAMES:
            op_id, struct, _ = abi.OPS[op]
            if self.has(op) and op in self.COLLECTIVES and self.comm_why():
                continue   # no communicator to call it with: c_collective_without_comm says why
            if self.has(op):
                m = Materialized(self.be, C.a_valid_case(op))
                args, keep = self.be._marshal(op, m.kwargs)
                res.support = -1
                self.expect(api.op_query(ctx, op_id, args, res), abi.OK, f"op_query({op}, a valid call)", ctx)
                if res.support not in (abi.SUPPORT_YES, abi.SUPPORT_SLOW):
                    raise CheckFailed(f"op_query({op}) of an ordinary f32 call said {res.support}, not YES/SLOW")
            else:
                args = ffi.new(struct + "*")
                args.header.struct_size = ffi.sizeof(struct)
                res.support = -1
                self.expect(api.op_query(ctx, op_id, args, res), abi.OK, f"op_query({op}) of an op it lacks", ctx)
                if res.support != abi.SUPPORT_NO:
                    raise CheckFailed(f"op_query({op}) said {res.support} for an op whose entry is NULL")
        hdr = ffi.new("DI_ArgsHeader*")
        hdr.struct_size = ffi.sizeof("DI_ArgsHeader")
        res.support = -1
        st = api.op_query(ctx, 999, hdr, res)
        if st == abi.OK and res.support != abi.SUPPORT_NO:
            raise CheckFailed(f"op_query(op=999) said support={res.support}; an op id this library does not know is NO")
        self.expect(st, (abi.OK, INVALID, UNIMPL), "op_query(op=999)", ctx)
        op = self._valid_op()
        if op:
            m = Materialized(self.be, C.a_valid_case(op))
            args, keep = self.be._marshal(op, m.kwargs)
            self.expect(api.op_query(ctx, abi.OPS[op][0], args, ffi.NULL), INVALID, "op_query(out=NULL)", ctx)
            small = ffi.new("DI_OpQuery*")
            small.struct_size = 4
            self.expect(api.op_query(ctx, abi.OPS[op][0], args, small), INVALID, "op_query with out.struct_size=4",
                        ctx)
            self.expect(api.op_query(ctx, abi.OPS[op][0], ffi.NULL, res), INVALID, "op_query(args=NULL)", ctx)

    def c_null_entry(self, op):
        m = Materialized(self.be, C.a_valid_case(op))
        try:
            self.be.call(op, **m.kwargs)
        except UnsupportedOpError as e:
            if e.status != UNIMPL:
                raise CheckFailed(f"status {e.status_name}, expected UNIMPLEMENTED")
            return "UNIMPLEMENTED"
        raise CheckFailed(f"calling {op} through the Backend did not raise UnsupportedOpError")

    # ------------------------------------------------------------------ per-op argument checks
    def _call_raw(self, op: str, args, ctx=None) -> int:
        return getattr(self.api, op)(self.be._ctx if ctx is None else ctx, args)

    def _fresh(self, op: str, case=None):
        case = case or C.a_valid_case(op)
        m = Materialized(self.be, case)
        args, keep = self.be._marshal(op, m.kwargs)
        return case, m, args, keep

    def _snapshot(self, m: Materialized, case) -> bytes:
        names = [n for n, s in case.tensors.items() if isinstance(s, C.TSpec) and s.out and not s.alias]
        return b"".join(np.ascontiguousarray(m.read(n)).tobytes() for n in names)

    def _expect_rejected(self, op, mutate, want, what, touch_check=True, case=None):
        case, m, args, keep = self._fresh(op, case)
        mutate(args, keep, case)
        before = self._snapshot(m, case) if touch_check and self.device == "cpu" else None
        msg = self.expect(self._call_raw(op, args), want, f"{op} with {what}", self.be._ctx)
        if before is not None and self._snapshot(m, case) != before:
            raise CheckFailed(f"{op} with {what}: returned an error but wrote its output (validate before writing)")
        return msg

    def _first_input(self, case) -> str:
        for n, s in case.tensors.items():
            if isinstance(s, C.TSpec) and not s.out and not s.alias and s.values is not None:
                return n
        raise RuntimeError("case without a tensor input")

    def op_checks(self, op: str):
        _, struct, _ = abi.OPS[op]
        # the args struct as this library knows it (a 1.1 library's DI_SampleArgs ends before probs)
        size = abi.args_struct_size(op, min(self.info.abi_minor, abi.ABI_MINOR))
        ctx = self.be._ctx
        case0 = C.a_valid_case(op)
        x = self._first_input(case0)
        o = [n for n, s in case0.tensors.items() if isinstance(s, C.TSpec) and s.out][0]

        def baseline():
            case, m, args, keep = self._fresh(op)
            self.expect(self._call_raw(op, args), abi.OK, f"{op} on a valid call", ctx)
            return np.ascontiguousarray(m.read(case.check[0])).tobytes()

        ok = self.check(op, "valid call", lambda: baseline() and None)
        if op in self.COLLECTIVES:
            self._comm_checks(op)
        self.check(op, "NULL ctx -> INVALID_ARGUMENT, message in last_error(NULL)", lambda: self._null_ctx(op))
        self.check(op, "NULL args -> INVALID_ARGUMENT with a message",
                   lambda: self.expect(self._call_raw(op, ffi.NULL), INVALID, f"{op}(ctx, NULL)", ctx) and None)

        def set_size(n):
            def f(args, keep, case):
                args.header.struct_size = n
            return f

        self.check(op, "struct_size smaller than v1 -> INVALID_ARGUMENT",
                   lambda: (self._expect_rejected(op, set_size(size - 4), INVALID, f"struct_size={size - 4} < {size}"),
                            self._expect_rejected(op, set_size(0), INVALID, "struct_size=0"))[0])

        # DI_ARGS_SINCE: a caller of an older minor sends that minor's (smaller) struct_size; the library
        # must accept it and treat the fields past it as absent, never writing an output it names there
        spec = abi.OP_SPECS[op]
        for minor in sorted({m for _, m in spec.appended if m <= self.info.abi_minor}):
            older = abi.args_struct_size(op, minor - 1)
            self.check(op, f"struct_size of ABI 1.{minor - 1} ({older}) -> accepted, fields of 1.{minor} ignored",
                       lambda older=older, minor=minor: self._older_struct(op, older, minor))

        def larger(nonzero: bool):
            case, m, args, keep = self._fresh(op)
            big = ffi.new("char[]", size + 64)
            ffi.memmove(big, args, size)
            p = ffi.cast(struct + "*", big)
            p.header.struct_size = size + 64
            if nonzero:
                big[size + 17] = b"\x01"
                before = self._snapshot(m, case) if self.device == "cpu" else None
                self.expect(self._call_raw(op, p), UNIMPL, f"{op} with struct_size {size + 64} and a non-zero byte "
                            "past the library's size", ctx)
                if before is not None and self._snapshot(m, case) != before:
                    raise CheckFailed("returned UNIMPLEMENTED but wrote its output")
                return None
            self.expect(self._call_raw(op, p), abi.OK, f"{op} with struct_size {size + 64}, zero tail", ctx)
            if ok and np.ascontiguousarray(m.read(case.check[0])).tobytes() != baseline():
                raise CheckFailed("a larger struct with a zero tail gave a different result")

        self.check(op, "struct_size larger, zero trailing bytes -> accepted", lambda: larger(False))
        self.check(op, "struct_size larger, non-zero trailing bytes -> UNIMPLEMENTED", lambda: larger(True))

        def ext(args, keep, case):
            e = ffi.new("int*")
            keep.append(e)
            args.header.ext = e
        self.check(op, "header.ext != NULL -> UNIMPLEMENTED", lambda: self._expect_rejected(op, ext, UNIMPL,
                                                                                            "header.ext != NULL"))

        def tensor_mut(name, fn):
            def f(args, keep, case):
                fn(getattr(args, name))
            return f

        def dtype_code(t):
            t.dtype.code, t.dtype.bits = 99, 7
        bad = [
            (x, "an unknown dtype code (99, 7 bits)", dtype_code, (INVALID, UNIMPL)),
            (x, "dtype lanes=2", lambda t: setattr(t.dtype, "lanes", 2), (INVALID, UNIMPL)),
            (x, "ndim=7 (> DI_MAX_DIMS)", lambda t: setattr(t, "ndim", 7), INVALID),
            (x, "ndim=-1", lambda t: setattr(t, "ndim", -1), INVALID),
            (x, "last stride 2", lambda t: t.strides.__setitem__(t.ndim - 1, 2), INVALID),
            (x, "data NULL for a required input", lambda t: setattr(t, "data", ffi.NULL), INVALID),
            (x, "a foreign device_type", lambda t: setattr(t, "device_type", 2 if self.device == "cpu" else 1),
             (INVALID, UNIMPL)),
            (o, "a shape that disagrees with the inputs",
             (lambda t: self._shrink(t, range(t.ndim - 1))) if op in self.FREE_LAST_DIM else self._shrink, INVALID),
        ]
        for name, what, fn, want in bad:
            self.check(op, f"{name}: {what} -> {' or '.join(_name(w) for w in ((want,) if isinstance(want, int) else want))}",
                       lambda name=name, what=what, fn=fn, want=want:
                       self._expect_rejected(op, tensor_mut(name, fn), want, f"{name} with {what}"))
        if len(case0.tensors[x].shape) >= 2:
            self.check(op, f"{x}: a negative stride -> INVALID_ARGUMENT",
                       lambda: self._expect_rejected(op, tensor_mut(x, lambda t: t.strides.__setitem__(0, -t.strides[0])),
                                                     INVALID, f"{x} with a negative stride"))
        if not abi.OP_SPECS[op].arg(x).quant:   # the op table says plain values only
            self.check(op, f"{x}: a quantized operand where the op takes plain values -> UNIMPLEMENTED",
                       lambda: self._expect_rejected(op, self._attach_quant(x), UNIMPL, f"a quantized {x}"))
        if op == "mla_cache_write":
            def far_slot(args, keep, case):
                slots = np.array([10**6, 0], np.int32)[: args.slots.shape[0]]
                keep.append(slots)
                args.slots.data = ffi.cast("void*", slots.ctypes.data)
            # a host library can check this cheaply (README); a device one may skip the slot silently
            self.check(op, "a slot past the cache -> INVALID_ARGUMENT, never a write out of bounds",
                       lambda: self._expect_rejected(op, far_slot, INVALID if self.device == "cpu" else (INVALID, abi.OK),
                                                     "slot 1000000 >= NB*BS"))
        if op == "spec_verify":
            def far_draft(args, keep, case):
                ids = np.array([args.logits.shape[1], 0], np.int32)[: args.draft_ids.shape[0]]
                keep.append(ids)
                args.draft_ids.data = ffi.cast("void*", ids.ctypes.data)
            # the host sees the ids on a CPU library; a device library treats the row as draftless (README)
            self.check(op, "a draft id >= V -> INVALID_ARGUMENT, never a read out of bounds",
                       lambda: self._expect_rejected(op, far_draft, INVALID if self.device == "cpu" else (INVALID, abi.OK),
                                                     "draft_ids[0] = V"))
        if op == "moe_experts" and self.info.abi_minor >= 5:
            # 1.5: expert_map and misses are both or neither (a map without misses would skip pairs unseen);
            # the other one absent (data NULL) in an otherwise valid call with both
            def absent(name):
                def f(args, keep, case):
                    getattr(args, name).data = ffi.NULL
                return f
            for given, gone in (("expert_map", "misses"), ("misses", "expert_map")):
                self.check(op, f"{given} without {gone} -> INVALID_ARGUMENT (1.5: both or neither)",
                           lambda given=given, gone=gone: self._expect_rejected(
                               op, absent(gone), INVALID, f"{given} but no {gone}", case=C.a_full_case(op)))
        # a quantized input's storage dtype is checked by quant_checks; plain inputs and every output here
        wrong = [] if case0.tensors[x].quant is not None else [(x, self._wrong_dtype(case0.tensors[x].dtype, False))]
        wrong.append((o, self._wrong_dtype(case0.tensors[o].dtype, True)))
        for name, dt in wrong:
            self.check(op, f"{name}: a wrong dtype ({dt[0]}) -> INVALID_ARGUMENT or UNIMPLEMENTED",
                       lambda name=name, dt=dt: self._expect_rejected(
                           op, tensor_mut(name, lambda t: (setattr(t.dtype, "code", dt[1]), setattr(t.dtype, "bits", dt[2]))),
                           (INVALID, UNIMPL), f"{name} of dtype {dt[0]}"))

    def _older_struct(self, op: str, size: int, minor: int):
        case = C.a_full_case(op)
        m = Materialized(self.be, case)
        args, keep = self.be._marshal(op, m.kwargs)
        args.header.struct_size = size
        self.expect(self._call_raw(op, args), abi.OK, f"{op} with struct_size {size} (ABI 1.{minor - 1}'s)",
                    self.be._ctx)
        newer = {name for name, m_ in abi.OP_SPECS[op].appended if m_ >= minor}
        for name in newer:
            spec = case.tensors.get(name)
            if isinstance(spec, C.TSpec) and spec.out:
                got = np.ascontiguousarray(m.read(name))
                poisoned = np.all(np.isnan(got)) if got.dtype.kind == "f" else np.all(got.view(np.uint8) == 0x7F)
                if not poisoned:
                    raise CheckFailed(f"{op}: {name} lies past struct_size {size} (a 1.{minor - 1} caller does not "
                                      f"know it) but was written")
        # the fields past struct_size are absent: the outputs the older caller knows are exactly those of
        # the same call without them (1.3's mla_decode.indices, hash routing, SwiGLU limits change them)
        plain = C.without_fields(case, newer)
        m2 = Materialized(self.be, plain)
        args2, keep2 = self.be._marshal(op, m2.kwargs)
        self.expect(self._call_raw(op, args2), abi.OK, f"{op} without its 1.{minor} fields", self.be._ctx)
        for name in plain.check:
            if np.ascontiguousarray(m.read(name)).tobytes() != np.ascontiguousarray(m2.read(name)).tobytes():
                raise CheckFailed(f"{op}: with struct_size {size} the fields of 1.{minor} and later ({', '.join(sorted(newer))}) "
                                  f"must be absent, but {name} differs from the same call without them")

    @staticmethod
    def _attach_quant(name: str):
        """Give argument `name` a valid-looking block descriptor (one f32 scale per row)."""
        def mutate(args, keep, case):
            t = getattr(args, name)
            nd = t.ndim
            shape = [t.shape[i] for i in range(nd - 1)] + [1]
            scales = np.ones(shape, np.float32)
            q = ffi.new("DI_Quant*")
            keep += [q, scales]
            q.struct_size = ffi.sizeof("DI_Quant")
            q.scheme = abi.const("DI_QUANT_BLOCK")
            q.block_rows, q.block_cols = 1, 0
            s = q.scales
            s.data = ffi.cast("void*", scales.ctypes.data)
            s.device_type, s.ndim = t.device_type, nd
            s.dtype.code, s.dtype.bits, s.dtype.lanes = abi.const("DI_DTYPE_FLOAT"), 32, 1
            for i, n in enumerate(shape):
                s.shape[i] = n
                s.strides[i] = scales.strides[i] // 4
            t.quant = q
        return mutate

    @staticmethod
    def _wrong_dtype(name: str, output: bool):
        """A dtype the argument never takes; for outputs one no wider than the right one, so that a
        library that fails to check it cannot be led into writing past the buffer."""
        from .. import dtypes as D
        if D.get(name).is_float:
            w = D.get("int8") if output else D.get("int32")
        else:
            w = D.get("f32") if D.get(name).bits >= 32 else D.get("uint8") if name == "int8" else D.get("int8")
        return w.name, w.code, w.bits

    # ops whose output's last dimension no input fixes (indexer_topk's K): the shape check shrinks
    # another dimension of theirs
    FREE_LAST_DIM = ("indexer_topk",)

    @staticmethod
    def _shrink(t, dims=None):
        # smaller, never larger: a library that fails to validate must not be led into writing past a buffer
        for d in (range(t.ndim - 1, -1, -1) if dims is None else dims):
            if t.shape[d] > 1:
                t.shape[d] -= 1
                return

    def _null_ctx(self, op):
        case, m, args, keep = self._fresh(op)
        st = self._call_raw(op, args, ctx=ffi.NULL)
        self.expect(st, INVALID, f"{op}(NULL, args)", None)

    # ------------------------------------------------------------------ quantization descriptor checks
    def quant_checks(self, op: str, case, field: str):
        """The quantization descriptor's own rules, on a quantized operand (`field`) of `op`."""

        def run(mut, want, what):
            c, m, args, keep = self._fresh(op, case)
            q = ffi.cast("DI_Quant*", getattr(args, field).quant)
            mut(q, keep, args)
            before = self._snapshot(m, c) if self.device == "cpu" else None
            st = self._call_raw(op, args)
            msg = self.expect(st, want, f"{op} with {what}", self.be._ctx)
            if before is not None and st != abi.OK and self._snapshot(m, c) != before:
                raise CheckFailed(f"{op} with {what}: failed but wrote its output")
            return msg

        supported = self.check(op, f"int4 g32 symmetric {field} works (baseline for the quant checks)",
                               lambda: run(lambda q, k, a: None, abi.OK, "a valid int4 descriptor") and None,
                               fmt="quant")
        if not supported:
            return
        self.check(op, "quant.scheme=99 (unknown format) -> UNIMPLEMENTED",
                   lambda: run(lambda q, k, a: setattr(q, "scheme", 99), UNIMPL, "scheme 99"), fmt="quant")
        self.check(op, "quant.nibble_order=1 (unknown) -> UNIMPLEMENTED",
                   lambda: run(lambda q, k, a: setattr(q, "nibble_order", 1), UNIMPL, "nibble_order 1"), fmt="quant")

        def qext(q, keep, a):
            e = ffi.new("int*")
            keep.append(e)
            q.ext = e
        self.check(op, "quant.ext != NULL -> UNIMPLEMENTED", lambda: run(qext, UNIMPL, "quant.ext"), fmt="quant")
        self.check(op, "quant.struct_size=8 -> INVALID_ARGUMENT",
                   lambda: run(lambda q, k, a: setattr(q, "struct_size", 8), INVALID, "quant.struct_size 8"),
                   fmt="quant")

        def bigger(nonzero):
            def mut(q, keep, a):
                size = ffi.sizeof("DI_Quant")
                big = ffi.new("char[]", size + 64)
                keep.append(big)
                ffi.memmove(big, q, size)
                p = ffi.cast("DI_Quant*", big)
                p.struct_size = size + 64
                if nonzero:
                    big[size + 3] = b"\x01"
                getattr(a, field).quant = p
            return mut
        self.check(op, "quant.struct_size larger, zero tail -> accepted",
                   lambda: run(bigger(False), abi.OK, "a larger DI_Quant, zero tail") and None, fmt="quant")
        self.check(op, "quant.struct_size larger, non-zero tail -> UNIMPLEMENTED",
                   lambda: run(bigger(True), UNIMPL, "a larger DI_Quant, non-zero tail"), fmt="quant")
        self.check(op, "scales of the wrong shape -> INVALID_ARGUMENT",
                   lambda: run(lambda q, k, a: q.scales.shape.__setitem__(1, q.scales.shape[1] - 1), INVALID,
                               "scales.shape[1] one short"), fmt="quant")
        self.check(op, "scales of an integer dtype -> INVALID_ARGUMENT or UNIMPLEMENTED",
                   lambda: run(lambda q, k, a: (setattr(q.scales.dtype, "code", 0), setattr(q.scales.dtype, "bits", 32)),
                               (INVALID, UNIMPL), "int32 scales"), fmt="quant")
        self.check(op, "scales data NULL -> INVALID_ARGUMENT",
                   lambda: run(lambda q, k, a: setattr(q.scales, "data", ffi.NULL), INVALID, "scales.data NULL"),
                   fmt="quant")
        self.check(op, "q dtype e5m2 (no such weight format) -> UNIMPLEMENTED or OK",
                   lambda: run(lambda q, k, a: (setattr(getattr(a, field).dtype, "code", 12),
                                                setattr(getattr(a, field).dtype, "bits", 8)),
                               (UNIMPL, abi.OK), "e5m2 codes"), fmt="quant")

    # ------------------------------------------------------------------ unload / reload
    def c_reload(self):
        script = textwrap.dedent(f"""
            import sys
            from deepinfer import abi
            ffi = abi.ffi
            path = {str(Path(self.path).resolve())!r}
            for round_ in range(2):
                lib = ffi.dlopen(path)
                info = lib.deepinfer_plugin_info()
                api = info.get_api(abi.ABI_MAJOR)
                assert api != ffi.NULL, "get_api failed after reload"
                ctxs = []
                for _ in range(2):
                    opts = ffi.new("DI_ContextOptions*")
                    opts.struct_size = ffi.sizeof("DI_ContextOptions")
                    out = ffi.new("DI_Context**")
                    st = api.context_create(opts, out)
                    assert st == 0, f"context_create failed in round {{round_}}: {{st}}"
                    ctxs.append(out[0])
                for c in ctxs:
                    assert api.context_destroy(c) == 0, "context_destroy failed"
                ffi.dlclose(lib)
            print("reload ok")
        """)
        env = None
        import os
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        if p.returncode != 0 or "reload ok" not in p.stdout:
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
            raise CheckFailed(f"unload/reload failed ({how}): {(p.stderr or p.stdout).strip()[-400:]}")


def run_l0(lib_path: str, recorder: Recorder) -> list[Outcome]:
    return L0(lib_path, recorder).run()
