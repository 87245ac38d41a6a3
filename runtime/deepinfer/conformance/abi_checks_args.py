"""L0's per-op argument checks: every op's args struct mangled (NULL context, struct_size smaller,
larger, older; ext; bad tensors, dtypes, shapes, absent optional fields) must be rejected with the
right status before anything is written; and the quantization descriptor's own rules.
"""
from __future__ import annotations

import numpy as np

from .. import abi
from .. import dtypes as D
from . import cases as C
from .abi_checks_base import INVALID, UNIMPL, CheckFailed, L0Base, _name, ffi
from .materialize import Materialized


class ArgumentChecks(L0Base):
    """The per-op argument and quantization-descriptor checks of L0 (mixed into abi_checks.L0)."""

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
        if D.get(name).is_float:
            w = D.get("int8") if output else D.get("int32")
        else:
            w = D.get("f32") if D.get(name).bits >= 32 else D.get("uint8") if name == "int8" else D.get("int8")
        return w.name, w.code, w.bits

    # ops whose output's last dimension no input fixes (indexer_topk's K, mla_rope_cache_write's Dq >= Dr):
    # the shape check shrinks another dimension of theirs
    FREE_LAST_DIM = ("indexer_topk", "mla_rope_cache_write")

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
