"""L0: the ABI's behavioural rules (abi/README.md sections 1-7 and 9), called through cffi directly.

The Backend wrapper would hide exactly what is checked here (it always fills struct_size, never
passes NULL), so every call below builds or mangles the C structs itself. Each check is one
Outcome; a check that the library fails never stops the others.

The checks are in three parts on one plumbing (abi_checks_base.L0Base): here the library as a whole
(bootstrap and version negotiation, the table, contexts, attributes, memory, streams, op_query, NULL
entries, unload and reload); abi_checks_entries.py the entries added after 1.0; abi_checks_args.py
every op's bad arguments and the quantization descriptor.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from .. import abi
from ..backend import BackendInfo, NativeBackend
from ..errors import UnsupportedOpError
from ..loader import open_library, probe
from . import cases as C
from .abi_checks_args import ArgumentChecks
from .abi_checks_base import INVALID, UNIMPL, CheckFailed, ffi
from .abi_checks_entries import EntryChecks
from .harness import Outcome, Recorder
from .materialize import Materialized, release_comm


class L0(EntryChecks, ArgumentChecks):
    """Level L0 of one library: run() makes every check and returns their outcomes."""

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
