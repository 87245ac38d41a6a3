"""The plumbing of level L0 (abi_checks.py): how a check is run and recorded, and the raw-call helpers
the checks share (a table entry's presence, last_error, an expected status, a fresh context, a valid
call's args struct to mutate and send as it is).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import abi
from ..backend import NativeBackend
from ..errors import BackendCallError
from . import cases as C
from .harness import Outcome, Recorder
from .materialize import Materialized

ffi = abi.ffi
S = abi.STATUS_NAMES
INVALID = abi.INVALID_ARGUMENT
UNIMPL = abi.UNIMPLEMENTED


class CheckFailed(Exception):
    pass


def _name(status: int) -> str:
    return S.get(status, f"status {status}")


class L0Base:
    """What every part of L0 (abi_checks.L0) stands on."""

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

    def _valid_op(self):
        for op in abi.OP_NAMES:
            if self.has(op):
                return op
        return None

    # ------------------------------------------------------------------ raw calls of one op
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
