"""run_conformance: the levels, the certificate, the summary.

  L0  ABI behaviour through cffi directly (abi_checks.py)
  L1  every claimed op and format against the reference on generated shapes (cases/)
  L2  bit-exact dequantization of every quantized format
  L3  streams and graph capture, for libraries that have them (device_checks.py)
  L4  the collectives across N ranks, asked for with ranks=N (multi_rank.py, an mpirun job of its own)

A level that crashes the process would take the certificate with it, so by default the levels run
in a child Python process; a crash is then an error of the check it was in, and a new child resumes
after that check. A check that runs past its budget (CHECK_BUDGETS per level, or check_timeout) is
killed the same way and recorded as an error "timed out after N s". In-process runs (isolate=False)
have neither protection: a crash ends the run and a hanging op hangs it. L4 is always a job of N
processes under mpirun, stopped after check_timeout (default CHECK_BUDGETS["L4"]) seconds in all.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from .. import abi
from .._version import __version__
from ..errors import InputError
from ..loader import child_env, file_sha256, kill_process_group, load_library, probe, probe_isolated
from ..reference import ReferenceBackend
from . import cases as C
from . import tolerances as TOL
from .abi_checks import run_l0
from .device_checks import run_l3
from .harness import Outcome, Recorder, ReferenceCache, check_case
# the levels' names and budgets, also for callers that import them from here, where they used to live
from .levels import CHECK_BUDGETS, LEVELS, MULTI_RANK, REFERENCE
from .materialize import release_comm
from .multi_rank_launch import run_l4

NO_CHECK_RAN = "no check ran: every outcome was skipped or unsupported, so nothing was certified"

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


# ====================================================================== targets


def open_target(lib_path: str):
    """The backend under test: the reference itself (self-check) or a library bound by the loader."""
    if lib_path == REFERENCE:
        return ReferenceBackend()
    return load_library(lib_path)


def reference_backend():
    return ReferenceBackend()


# ====================================================================== L1 and L2


def _ops_to_test(target, only_ops: Optional[Iterable[str]]) -> list[str]:
    ops = [op for op in abi.OP_NAMES if target.has_op(op)]
    if only_ops:
        ops = [op for op in ops if op in set(only_ops)]
    return ops


def _unclaimed(target, only_ops: Optional[Iterable[str]], rec: Recorder) -> list[Outcome]:
    """An op asked for by name that the library lacks gets an outcome, so that it is not silently absent."""
    out = []
    for op in [op for op in abi.OP_NAMES if op in set(only_ops or ()) and not target.has_op(op)]:
        o = Outcome(op, "not claimed", "*", "unsupported",
                    f"the library does not claim {op} (its DI_Api entry is NULL): nothing to test")
        rec.done(o)
        out.append(o)
    return out


def _run_cases(target, cs, rec: Recorder) -> list[Outcome]:
    ref = ReferenceCache(reference_backend())
    out = []
    for case in cs:
        key = Recorder.key(case.op, case.name, case.seed)
        if rec.start(key) is not None:
            continue
        o = check_case(target, case, ref)
        rec.done(o)
        out.append(o)
        if o.status in ("fail", "error"):
            rec.progress(f"  FAIL {case.name} (seed {case.seed}): {o.message.splitlines()[0] if o.message else ''}")
    release_comm(ref.reference)
    return out


def run_l1(target, profile="default", seed=0, only_ops=None, rec: Optional[Recorder] = None) -> list[Outcome]:
    rec = rec or Recorder()
    out: list[Outcome] = _unclaimed(target, only_ops, rec)
    for op in _ops_to_test(target, only_ops):
        cs = C.cases_for(op, profile, seed)
        if op == "moe_experts":
            cs += C.error_cases(profile, seed)
        rec.progress(f"L1 {op}: {len(cs)} cases")
        out += _run_cases(target, cs, rec)
    return out


def run_l2(target, profile="default", seed=0, rec: Optional[Recorder] = None) -> list[Outcome]:
    rec = rec or Recorder()
    if not target.has_op("dequantize"):
        o = Outcome("dequantize", "L2", "*", "unsupported", "dequantize not in the library's table")
        rec.done(o)
        return [o]
    cs = C.l2_cases(profile, seed)
    rec.progress(f"L2 dequantize: {len(cs)} cases")
    return _run_cases(target, cs, rec)


# ====================================================================== one level, in or out of process


def _skipped(rec: Recorder, level: str, why: str) -> list[dict]:
    o = Outcome("*", level, "*", "skipped", why)
    rec.done(o)
    return [o.as_dict()]


def run_level(level: str, lib_path: str, profile: str = "default", seed: int = 0, only_ops=None,
              progress: Progress = _quiet, rec: Optional[Recorder] = None) -> list[dict]:
    """One level in this process; returns its results as plain dicts."""
    rec = rec or Recorder(progress)
    rec.level = level
    if level == "L0":
        if lib_path == REFERENCE:
            return _skipped(rec, "L0", "the reference is not a library: no ABI to check")
        return [o.as_dict() for o in run_l0(lib_path, rec)]
    if level == "L3":
        if lib_path == REFERENCE:
            return _skipped(rec, "L3", "the reference has no streams or graphs")
        return [o.as_dict() for o in run_l3(lib_path, rec)]
    if level == MULTI_RANK:
        raise ValueError(f"{MULTI_RANK} runs as an mpirun job of several processes: run_conformance(..., ranks=N)")
    target = open_target(lib_path)
    try:
        if level == "L1":
            res = run_l1(target, profile, seed, only_ops, rec)
        elif level == "L2":
            res = run_l2(target, profile, seed, rec)
        else:
            raise ValueError(f"unknown level {level!r}; levels are {', '.join(LEVELS)}")
    finally:
        release_comm(target)    # the collectives' one-rank communicator, before its context goes
        target.close()
    return [o.as_dict() for o in res]


MAX_CRASHES = 25   # crashes and timed-out checks of one run: each one costs a new child


def _error(op: str, case: str, fmt: str, message: str, seed: int = 0) -> dict:
    """An error result of the run itself (the child crashed, timed out, or the library cannot load)."""
    return Outcome(op, case, fmt, "error", message, seed=seed).as_dict()


def _parse_key(key: str) -> tuple[str, str, str, int]:
    """level|op|check name|seed (a check's name may itself hold a '|')."""
    level, op, rest = key.split("|", 2)
    name, seed = rest.rsplit("|", 1)
    return level, op, name, int(seed)


@dataclass
class _ChildEnd:
    rc: int                    # the child's exit status (negative: the signal that ended it)
    running: Optional[str]     # the check it was in when it ended; None: between checks
    last: Optional[str]        # the last check it started
    killed: str                # "" (ended by itself), "check" (past its budget), "stalled", "run" (past the deadline)
    budget: float              # the budget that ran out, when killed
    tail: str                  # its last lines of output


def _pump(stream, lines: "queue.Queue[Optional[str]]") -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _watch(proc: subprocess.Popen, levels: list[str], check_timeout: Optional[float], deadline: float,
           progress: Progress) -> _ChildEnd:
    """Relay the child's output until it ends, killing it when the check it announced (START key ...
    DONE key) runs past its budget, when it makes no progress between checks, or at the deadline."""
    lines: "queue.Queue[Optional[str]]" = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    running: Optional[str] = None
    last: Optional[str] = None
    since = time.monotonic()
    output: list[str] = []
    while True:
        level = _parse_key(last)[0] if last else levels[0]
        # between checks the child builds cases and reference results: the level's own budget, never less
        budget = (check_timeout or CHECK_BUDGETS[level]) if running else max(CHECK_BUDGETS[level], check_timeout or 0)
        try:
            line = lines.get(timeout=max(0.0, min(since + budget, deadline) - time.monotonic()))
        except queue.Empty:
            killed = "run" if time.monotonic() >= deadline else "check" if running else "stalled"
            kill_process_group(proc)
            return _ChildEnd(proc.wait(), running, last, killed, budget, "\n".join(output[-6:]).strip())
        if line is None:
            return _ChildEnd(proc.wait(), running, last, "", budget, "\n".join(output[-6:]).strip())
        if line.startswith("START "):
            running = last = line[len("START "):]
            since = time.monotonic()
        elif line.startswith("DONE "):
            if line[len("DONE "):] == running:
                running = None
            since = time.monotonic()
        else:
            output.append(line)
            progress(line)
            if running is None:
                since = time.monotonic()


def _collect(sink: Path, statuses: dict[str, str], done: dict[str, list[dict]]) -> None:
    """The outcomes a child wrote before it ended (a line cut short by a kill is dropped)."""
    for x in (sink.read_text().splitlines() if sink.exists() else []):
        try:
            r = json.loads(x)
        except ValueError:
            continue
        statuses[r.pop("key")] = r["status"]
        done.setdefault(r.pop("level"), []).append(r)


def _child_command(levels, lib_path, profile, seed, only_ops, prev: Path, sink: Path) -> list[str]:
    return [sys.executable, "-m", "deepinfer.conformance._child", ",".join(levels), lib_path, profile, str(seed),
            ",".join(only_ops or []), str(prev), str(sink)]


def _run_error(end: _ChildEnd, levels, timeout: float) -> tuple[str, dict]:
    """(level, outcome) of a child that ended where no check can be blamed: the run stops there."""
    how = f"signal {-end.rc}" if end.rc < 0 else f"exit status {end.rc}"
    if end.killed == "run":
        why = f"timed out after {timeout:g} s"
    elif end.killed == "stalled":
        why = f"made no progress for {end.budget:g} s outside any check"
    else:
        why = f"died ({how})"
    where = f" during {end.running}" if end.running else f" after {end.last}" if end.last else ""
    lv = _parse_key(end.running or end.last)[0] if (end.running or end.last) else levels[0]
    return lv, _error("*", lv, "*", f"the conformance run {why}{where}" + (f"\n{end.tail}" if end.tail else ""))


def _blamed_check(end: _ChildEnd) -> tuple[str, dict, str]:
    """(level, error outcome, progress note) of the check a child crashed or ran out of time in."""
    lv, op, name, seed = _parse_key(end.running)
    if end.killed == "check":
        fmt, what = "timeout", f"TIMEOUT after {end.budget:g} s"
        message = f"timed out after {end.budget:g} s: the check did not return, so its process was killed"
    else:
        how = f"signal {-end.rc}" if end.rc < 0 else f"exit status {end.rc}"
        fmt, what = "crash", f"CRASH ({how})"
        message = f"the library crashed the process ({how}) in this check" + (f"\n{end.tail}" if end.tail else "")
    return lv, _error(op, name, fmt, message, seed), f"  {what} in {lv} {op}: {name}; resuming after it"


def _run_isolated(levels, lib_path, profile, seed, only_ops, progress: Progress, timeout: float,
                  check_timeout: Optional[float] = None) -> dict:
    """The levels in one child process; after a crash or a timed-out check a new child resumes after it."""
    done: dict[str, list[dict]] = {lv: [] for lv in levels}
    statuses: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="di-conf-") as tmp:
        for attempt in range(MAX_CRASHES + 1):
            sink = Path(tmp) / f"results{attempt}.jsonl"
            prev = Path(tmp) / f"previous{attempt}.json"
            prev.write_text(json.dumps(statuses))
            # a session of its own: a timeout kills the child and anything it started (L0's reload check)
            proc = subprocess.Popen(_child_command(levels, lib_path, profile, seed, only_ops, prev, sink),
                                    env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", start_new_session=True)
            end = _watch(proc, levels, check_timeout, deadline, progress)
            _collect(sink, statuses, done)
            if end.rc == 0 and not end.killed:
                return done
            if end.killed == "check" and end.running in statuses:
                continue                  # it finished just as its time ran out: resume after it
            if end.killed not in ("", "check") or end.running is None or end.running in statuses:
                lv, outcome = _run_error(end, levels, timeout)
                done.setdefault(lv, []).append(outcome)
                return done
            lv, outcome, note = _blamed_check(end)
            statuses[end.running] = "error"
            done.setdefault(lv, []).append(outcome)
            progress(note)
        done[levels[-1]].append(_error("*", "run", "*", f"gave up after {MAX_CRASHES} crashes or timeouts"))
        return done


# ====================================================================== the certificate


def _library_facts(lib_path: str, isolate: bool) -> dict:
    if lib_path == REFERENCE:
        be = ReferenceBackend()
        return {"path": None, "sha256": None, "name": "reference", "version": __version__,
                "abi_version": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", "device": "cpu", "attributes": {},
                "ops_claimed": be.ops()}
    # reading the facts runs the library's code: a child process, unless the whole run is in-process
    c = probe_isolated(Path(lib_path)) if isolate else probe(Path(lib_path))
    facts = {"path": str(Path(lib_path).resolve()), "sha256": file_sha256(lib_path) if Path(lib_path).is_file() else None,
             "name": c.name, "version": c.version, "abi_version": c.abi_version, "device": c.device,
             "attributes": c.attributes, "ops_claimed": c.ops, "loadable": c.ok,
             # the non-op DI_Api entries the library fills (1.1: events, host memory, async copies, ...)
             "entries": c.entries}
    if not c.ok:
        facts["load_error"] = c.reason
    return facts


def _summarise_level(results: list[dict]) -> dict:
    counts: dict[str, int] = {}
    per_op: dict[str, dict] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        op = per_op.setdefault(r["op"], {"pass": 0, "fail": 0, "error": 0, "unsupported": 0, "skipped": 0,
                                         "formats": {}})
        op[r["status"]] = op.get(r["status"], 0) + 1
        f = op["formats"]
        prev = f.get(r["format"])
        rank = {"fail": 3, "error": 3, "pass": 2, "unsupported": 1, "skipped": 0}
        if prev is None or rank[r["status"]] > rank[prev]:
            f[r["format"]] = "fail" if r["status"] == "error" else r["status"]
    passed_ops = sorted((o for o, d in per_op.items() if d["pass"] and not d["fail"] and not d["error"]),
                        key=lambda o: abi.OP_NAMES.index(o) if o in abi.OP_NAMES else -1)
    failed_ops = sorted(o for o, d in per_op.items() if d["fail"] or d["error"])
    ok = not counts.get("fail") and not counts.get("error")
    return {"passed": ok, "counts": counts, "ops_passed": passed_ops, "ops_failed": failed_ops, "per_op": per_op}


def _check_request(levels: list[str], only_ops: Optional[list[str]], ranks: Optional[int]) -> None:
    bad = [lv for lv in levels if lv not in LEVELS + (MULTI_RANK,)]
    if bad:
        raise InputError(f"unknown level(s) {', '.join(bad)}; levels are {', '.join(LEVELS + (MULTI_RANK,))}")
    if ranks is not None and ranks < 2:
        raise InputError(f"ranks={ranks}: the multi-rank level needs at least 2 ranks")
    if MULTI_RANK in levels and ranks is None:
        raise InputError(f"{MULTI_RANK} (the collectives across ranks) needs the number of ranks: ranks=N, N >= 2")
    unknown = [op for op in only_ops or [] if op not in abi.OP_NAMES]
    if unknown:
        raise InputError(f"unknown op(s) {', '.join(unknown)}; the ABI's ops are {', '.join(abi.OP_NAMES)}")


def _any_check_ran(level_results: dict[str, list[dict]]) -> bool:
    return any(r["status"] in ("pass", "fail", "error") for rs in level_results.values() for r in rs)


def _write_atomically(path: Path, text: str) -> None:
    """Readers (and an interrupted run) see the old certificate or the new one, never a part of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _run_multi_rank(lib_path: str, facts: dict, ranks: int, seed: int, progress: Progress,
                    check_timeout: Optional[float]) -> list[dict]:
    """L4: the checks of multi_rank.py as an mpirun job of `ranks` processes."""
    progress(f"== {MULTI_RANK} ({ranks} ranks under mpirun)")
    comm_entries = ("comm_unique_id", "comm_create", "comm_destroy")
    if lib_path != REFERENCE and not all(e in facts.get("entries", []) for e in comm_entries):
        return [Outcome("*", MULTI_RANK, "*", "unsupported",
                        f"the library (ABI {facts.get('abi_version')}) has no communicators ({', '.join(comm_entries)} "
                        f"are ABI 1.4 entries it leaves NULL): there are no collectives to certify across ranks"
                        ).as_dict()]
    return run_l4(lib_path, ranks, timeout=check_timeout or CHECK_BUDGETS[MULTI_RANK], progress=progress, seed=seed)


def run_conformance(lib_path: str, levels: Iterable[str] = LEVELS, out: Optional[str] = None,
                    profile: str = "default", seed: int = 0, only_ops: Optional[Iterable[str]] = None,
                    isolate: bool = True, progress: Progress = _quiet, timeout: float = 3600,
                    check_timeout: Optional[float] = None, ranks: Optional[int] = None) -> dict:
    """Certify a backend library (or the special name "reference") and return the certificate;
    with `out`, also write it as JSON (replacing that file). Nothing raises for a bad library: its
    failures are results; unknown levels or ops raise InputError before anything runs.

    isolate=True runs the levels in child processes, where a check is killed after check_timeout
    seconds (default: CHECK_BUDGETS of its level) and the whole run after `timeout`; isolate=False
    runs them here, with no timeout at all. ranks=N (N >= 2) adds level L4, the collectives across N
    ranks: an mpirun job either way, stopped after check_timeout (default CHECK_BUDGETS["L4"]) seconds."""
    lib_path = str(lib_path)
    levels = [lv.upper() for lv in levels]
    if ranks is not None and MULTI_RANK not in levels:
        levels.append(MULTI_RANK)
    only_ops = list(only_ops) if only_ops else None
    _check_request(levels, only_ops, ranks)
    t0 = time.time()
    facts = _library_facts(lib_path, isolate)
    level_results: dict[str, list[dict]] = {}
    local = [lv for lv in levels if lv != MULTI_RANK]
    if lib_path != REFERENCE and not facts.get("loadable", True):
        for lv in levels:
            level_results[lv] = [_error("*", lv, "*", f"library cannot be loaded: {facts['load_error']}")]
    else:
        if isolate and local:
            level_results = _run_isolated(local, lib_path, profile, seed, only_ops, progress, timeout,
                                          check_timeout)
        elif local:
            for lv in local:
                progress(f"== {lv}")
                level_results[lv] = run_level(lv, lib_path, profile, seed, only_ops, progress)
        if MULTI_RANK in levels:
            level_results[MULTI_RANK] = _run_multi_rank(lib_path, facts, ranks, seed, progress, check_timeout)
    summaries = {lv: _summarise_level(r) for lv, r in level_results.items()}
    ran = _any_check_ran(level_results)
    claimed = facts.get("ops_claimed", [])
    cert = {
        "certificate": "deepinfer backend conformance",
        "deepinfer_version": __version__,
        "abi_version": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "system": platform.system(), "python": platform.python_version()},
        "library": {k: v for k, v in facts.items() if k != "ops_claimed"},
        "ops_claimed": claimed,
        "ops_unimplemented": [op for op in abi.OP_NAMES if op not in claimed],
        "levels_run": levels,
        "ranks": ranks,
        "profile": profile,
        "seed": seed,
        "only_ops": only_ops,
        "tolerances": {"version": TOL.TOLERANCES_VERSION, "values": TOL.table_as_dict(),
                       "sample_boundary_eps": TOL.SAMPLE_BOUNDARY_EPS, "router_tie_eps": TOL.ROUTER_TIE_EPS,
                       "indexer_tie_eps": TOL.INDEXER_TIE_EPS},
        "levels": {lv: {**summaries[lv], "results": level_results[lv]} for lv in levels},
        "ops_passed": {lv: summaries[lv]["ops_passed"] for lv in levels},
        "passed": ran and all(s["passed"] for s in summaries.values()),
        "seconds": round(time.time() - t0, 2),
    }
    if not ran:
        cert["note"] = NO_CHECK_RAN
    if out:
        _write_atomically(Path(out), json.dumps(cert, indent=1, default=str))
        cert["certificate_path"] = str(Path(out).resolve())
    return cert


def summary(cert: dict, verbose: bool = False) -> str:
    """A human-readable page of a certificate."""
    lib = cert["library"]
    lines = [f"deepinfer conformance {cert['deepinfer_version']} (ABI {cert['abi_version']}, tolerances "
             f"{cert['tolerances']['version']}, profile {cert['profile']})",
             f"library   {lib.get('name')} v{lib.get('version')}  abi {lib.get('abi_version')}  "
             f"{lib.get('path') or '(built in)'}"]
    if lib.get("sha256"):
        lines.append(f"sha256    {lib['sha256']}")
    lines.append(f"claims    {', '.join(cert['ops_claimed']) or '(nothing)'}")
    if cert["ops_unimplemented"]:
        lines.append(f"UNIMPL.   {', '.join(cert['ops_unimplemented'])}")
    for lv, d in cert["levels"].items():
        cnt = d["counts"]
        verdict = "PASS" if d["passed"] else "FAIL"
        c = ", ".join(f"{v} {k}" for k, v in sorted(cnt.items()))
        lines.append(f"{lv:3s} {verdict:4s}  {c}" + (f"  ({cert.get('ranks')} ranks)" if lv == MULTI_RANK else ""))
        for op, od in d["per_op"].items():
            bad = [f for f, s in od["formats"].items() if s == "fail"]
            uns = [f for f, s in od["formats"].items() if s == "unsupported"]
            if bad or verbose:
                lines.append(f"      {op:16s} pass {od['pass']:3d}  fail {od['fail'] + od['error']:3d}  "
                             f"unsupported {od['unsupported']:3d}" + (f"  failing: {', '.join(bad)}" if bad else ""))
            if uns and verbose:
                lines.append(f"      {'':16s} unsupported formats: {', '.join(uns)}")
        for r in d["results"]:
            if r["status"] in ("fail", "error"):
                msg = (r.get("message") or "").strip().splitlines()
                where = r["case"] if r["case"].startswith(r["op"]) or r["op"] == "*" else f"{r['op']}: {r['case']}"
                lines.append(f"      x {where} (seed {r['seed']}): {msg[0] if msg else ''}")
            elif r["status"] == "skipped" and r.get("message"):
                lines.append(f"      - skipped {r['case']}: {r['message']}")
            elif r["status"] == "unsupported" and r["format"] == "*" and r.get("message"):
                lines.append(f"      - unsupported {r['op']}: {r['message']}")
    lines.append(f"RESULT    {'PASS' if cert['passed'] else 'FAIL'}  ({cert['seconds']} s)"
                 + (f"  {cert['note']}" if cert.get("note") else ""))
    if cert.get("certificate_path"):
        lines.append(f"certificate written to {cert['certificate_path']}")
    return "\n".join(lines)
