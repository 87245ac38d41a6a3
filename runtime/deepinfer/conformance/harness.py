"""Run one Case on a backend and compare it with the reference.

materialize.py turns the case into the call's arguments (poisoned outputs, padded views, aliases);
compare.py judges the outputs. Here: the outcome of a check, the recorder that keeps outcomes across
a crashed child, the reference's cached results, and check_case, which runs a case and decides.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from .. import abi
from ..errors import BackendCallError, UnsupportedOpError
from .cases import Case
# some of these only for callers that import them from here, where they used to live
from .compare import (_cmp_indexer, _cmp_router, _cmp_sample, _cmp_spec_verify, _indexer_scores, compare_close,
                      compare_exact, compare_outputs, counted_rows)
from .materialize import (PAD_BYTE, POISON_BYTE, Materialized, comm_unavailable, one_rank_comm,
                          release_comm)


# ====================================================================== recording (crash-resumable runs)


class Recorder:
    """Collects outcomes; in a child process it also appends each one to a file as it happens, so that
    after a crash the parent knows what finished and which check was running, and can resume after it."""

    def __init__(self, progress=None, previous: dict | None = None, sink_path: str | None = None):
        self.progress = progress or (lambda m: None)
        self.previous = previous or {}        # key -> status of a check done by an earlier (crashed) run
        self.sink = open(sink_path, "a", buffering=1) if sink_path else None
        self.level = "L?"
        self.outcomes: list = []

    @staticmethod
    def key(op: str, name: str, seed: int = 0) -> str:
        return f"{op}|{name}|{seed}"

    def start(self, key: str) -> Optional[str]:
        """None: run the check; otherwise the status it got before (the caller skips it)."""
        key = f"{self.level}|{key}"
        if key in self.previous:
            return self.previous[key]
        self.progress(f"START {key}")
        return None

    def done(self, o: "Outcome") -> None:
        self.outcomes.append(o)
        if self.sink:
            import json
            key = f"{self.level}|{self.key(o.op, o.case, o.seed)}"
            self.sink.write(json.dumps({"key": key, "level": self.level, **o.as_dict()}, default=str) + "\n")
            self.sink.flush()


# ====================================================================== results


@dataclass
class Outcome:
    op: str
    case: str
    fmt: str
    status: str                    # pass | fail | unsupported | error
    message: str = ""
    seed: int = 0
    max_err: float = 0.0
    nmse: float = 0.0
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {"op": self.op, "case": self.case, "format": self.fmt, "status": self.status, "seed": self.seed}
        if self.message:
            d["message"] = self.message
        if self.status in ("pass", "fail") and (self.max_err or self.nmse):
            d["max_err"] = float(self.max_err)
            d["nmse"] = float(self.nmse)
        return d


# ====================================================================== running


def _status_name(e: BackendCallError) -> str:
    return e.status_name


def run_on(backend, case: Case, m: Optional[Materialized] = None) -> tuple[Materialized, Optional[BackendCallError]]:
    m = m or Materialized(backend, case)
    try:
        backend.call(case.op, **m.kwargs)
        backend.synchronize()
    except BackendCallError as e:
        return m, e
    return m, None


class ReferenceCache:
    """The reference's results of each case, computed once per run."""

    def __init__(self, reference):
        self.reference = reference
        self._cache: dict[int, tuple[Case, dict]] = {}

    def outcome(self, case: Case) -> tuple[Optional[dict], Optional[Exception]]:
        """(results, None), or (None, the exception) when the reference rejects the call."""
        key = id(case)
        if key not in self._cache:
            try:
                m, err = run_on(self.reference, case)
            except (ValueError, TypeError) as e:   # the reference's INVALID_ARGUMENT
                m, err = None, e
            # the case is kept alive with its results, so its id cannot be reused by another case
            self._cache[key] = (case, None if err else {n: m.read(n) for n in case.check}, err)
        return self._cache[key][1], self._cache[key][2]

    def results(self, case: Case) -> dict:
        res, err = self.outcome(case)
        if err is not None:
            raise RuntimeError(f"the reference backend failed on '{case.name}': {err}")
        return res


def check_case(target, case: Case, ref: ReferenceCache, tolerances=None) -> Outcome:
    t0 = time.perf_counter()
    o = Outcome(case.op, case.name, case.fmt, "fail", seed=case.seed)
    try:
        _check_case(target, case, ref, tolerances, o)
    except Exception as e:  # a harness or reference bug must show up as a result, not end the run
        o.status = "error"
        o.message = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    o.seconds = time.perf_counter() - t0
    return o


def _has_op_query(backend) -> bool:
    has = getattr(backend, "_has", None)
    return bool(has and has("op_query"))


def _check_case(target, case, ref, tolerances, o: Outcome) -> None:
    if not target.has_op(case.op):
        o.status, o.message = "unsupported", f"{case.op} not in the library's table"
        return
    minor = getattr(target, "abi_minor", abi.ABI_MINOR)
    given = {**case.tensors, **case.scalars}
    newer = [f for f, m in abi.OP_SPECS[case.op].appended if m > minor and abi.field_is_set(given.get(f))]
    if newer:   # e.g. sample's probs (1.2) for a 1.1 library, silu_mul's limit (1.3) for a 1.2 one
        o.status, o.message = "unsupported", (f"{', '.join(newer)}: newer than the library's ABI 1.{minor} "
                                              f"(DI_ARGS_SINCE)")
        return
    if case.comm:
        try:
            why = comm_unavailable(target)
        except BackendCallError as e:   # a library with communicators must make one of one rank
            o.message = f"comm_create of a one-rank communicator failed: {e}"
            return
        if why:
            o.status, o.message = "unsupported", why
            return
    m = Materialized(target, case)
    try:
        support, _ws = target.query(case.op, **m.kwargs)
    except BackendCallError as e:
        o.message = f"op_query failed instead of answering: {e}"
        return
    try:
        m, err = run_on(target, case, m)
    except (ValueError, TypeError) as e:   # the reference (self-check) says INVALID_ARGUMENT this way
        err = BackendCallError(case.op, abi.INVALID_ARGUMENT, "INVALID_ARGUMENT", str(e))
    if case.expect != "OK":
        if err is None:
            o.message = f"expected {case.expect}, the call returned OK"
        elif err.status_name != case.expect:
            o.message = f"expected {case.expect}, got {err.status_name}: {err.message}"
        elif not err.message:
            o.message = f"{case.expect} without a last_error message"
        else:
            o.status, o.message = "pass", f"{err.status_name}: {err.message}"
        return
    if err is not None:
        if isinstance(err, UnsupportedOpError):
            if support in (abi.SUPPORT_YES, abi.SUPPORT_SLOW) and _has_op_query(target):
                o.message = f"op_query said {'YES' if support == abi.SUPPORT_YES else 'SLOW'} but the call " \
                            f"returned UNIMPLEMENTED: {err.message}"
            else:
                o.status, o.message = "unsupported", err.message or "UNIMPLEMENTED (no message)"
                if not err.message:
                    o.status, o.message = "fail", "UNIMPLEMENTED without a last_error message"
            return
        if err.status_name == "INVALID_ARGUMENT":
            _, ref_err = ref.outcome(case)
            if isinstance(ref_err, (ValueError, TypeError)) or getattr(ref_err, "status_name", "") == "INVALID_ARGUMENT":
                o.status, o.message = "pass", f"both reject the input as INVALID_ARGUMENT: {err.message}"
                return
        o.message = f"call failed: {err.status_name}: {err.message}"
        return
    want, ref_err = ref.outcome(case)
    if ref_err is not None:
        o.message = f"the library returned OK but the reference rejects the call: {ref_err}"
        return
    got = {n: m.read(n) for n in case.check}
    problems, o.max_err, o.nmse = compare_outputs(case, got, want, tolerances)
    dmg = m.padding_damage()
    if dmg:
        problems.append(f"wrote outside the view of {', '.join(dmg)} (padding columns changed)")
    changed = m.inputs_changed()
    if changed:
        problems.append(f"modified read-only input(s) {', '.join(changed)}")
    if problems:
        o.message = "; ".join(problems)
    else:
        o.status = "pass"
        if support == abi.SUPPORT_NO:
            o.message = "op_query said NO for this call, yet it ran correctly"
