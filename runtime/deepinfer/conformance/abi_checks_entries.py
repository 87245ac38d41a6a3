"""L0's checks of the table entries added after 1.0: events, host memory, async copies, device
count, memory attributes and per-thread errors (1.1), communicators and the collectives' comm
argument (1.4).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import abi
from ..errors import BackendCallError
from .abi_checks_base import INVALID, UNIMPL, CheckFailed, L0Base, ffi
from .materialize import comm_unavailable


class EntryChecks(L0Base):
    """The 1.1 and 1.4 entry checks of L0 (mixed into abi_checks.L0)."""

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
