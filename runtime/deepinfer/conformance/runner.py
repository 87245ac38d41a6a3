"""run_conformance: the levels, the certificate, the summary.

  L0  ABI behaviour through cffi directly (abi_checks.py)
  L1  every claimed op and format against the reference on generated shapes (cases.py)
  L2  bit-exact dequantization of every quantized format
  L3  streams and graph capture, for libraries that have them (device_checks.py)

A level that crashes the process would take the certificate with it, so by default each level runs
in a child Python process; a crash is then a failed level that names the check it was in.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from .. import __version__, abi
from ..loader import file_sha256
from . import cases as C
from . import tolerances as TOL
from .harness import Outcome, Recorder, ReferenceCache, check_case

LEVELS = ("L0", "L1", "L2", "L3")
REFERENCE = "reference"

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


# ====================================================================== targets


def open_target(lib_path: str):
    """The backend under test: the reference itself (self-check) or a library bound by the loader."""
    if lib_path == REFERENCE:
        from ..reference import ReferenceBackend

        return ReferenceBackend()
    from ..loader import load_library

    return load_library(lib_path)


def reference_backend():
    from ..reference import ReferenceBackend

    return ReferenceBackend()


# ====================================================================== L1 and L2


def _ops_to_test(target, only_ops: Optional[Iterable[str]]) -> list[str]:
    ops = [op for op in abi.OP_NAMES if target.has_op(op)]
    if only_ops:
        ops = [op for op in ops if op in set(only_ops)]
    return ops


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
    return out


def run_l1(target, profile="default", seed=0, only_ops=None, rec: Optional[Recorder] = None) -> list[Outcome]:
    rec = rec or Recorder()
    out: list[Outcome] = []
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
        from .abi_checks import run_l0

        return [o.as_dict() for o in run_l0(lib_path, rec)]
    if level == "L3":
        if lib_path == REFERENCE:
            return _skipped(rec, "L3", "the reference has no streams or graphs")
        from .device_checks import run_l3

        return [o.as_dict() for o in run_l3(lib_path, rec)]
    target = open_target(lib_path)
    try:
        if level == "L1":
            res = run_l1(target, profile, seed, only_ops, rec)
        elif level == "L2":
            res = run_l2(target, profile, seed, rec)
        else:
            raise ValueError(f"unknown level {level!r}; levels are {', '.join(LEVELS)}")
    finally:
        target.close()
    return [o.as_dict() for o in res]


MAX_CRASHES = 25


def _run_isolated(levels, lib_path, profile, seed, only_ops, progress: Progress, timeout: float) -> dict:
    """The levels in one child process; after a crash a new child resumes after the check that crashed."""
    done: dict[str, list[dict]] = {lv: [] for lv in levels}
    statuses: dict[str, str] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="di-conf-") as tmp:
        for attempt in range(MAX_CRASHES + 1):
            sink = Path(tmp) / f"results{attempt}.jsonl"
            prev = Path(tmp) / f"previous{attempt}.json"
            prev.write_text(json.dumps(statuses))
            cmd = [sys.executable, "-m", "deepinfer.conformance._child", ",".join(levels), lib_path, profile,
                   str(seed), ",".join(only_ops or []), str(prev), str(sink)]
            env = dict(os.environ)
            pkg_root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            started: Optional[str] = None
            lines: list[str] = []
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            timer = threading.Timer(max(1.0, timeout - (time.time() - t0)), proc.kill)
            timer.start()
            try:
                for line in proc.stdout:
                    line = line.rstrip("\n")
                    if line.startswith("START "):
                        started = line[6:]
                        continue
                    lines.append(line)
                    progress(line)
                rc = proc.wait()
            finally:
                timer.cancel()
            for x in (sink.read_text().splitlines() if sink.exists() else []):
                r = json.loads(x)
                statuses[r.pop("key")] = r["status"]
                done.setdefault(r.pop("level"), []).append(r)
            if rc == 0:
                return done
            how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
            tail = "\n".join(lines[-6:]).strip()
            timed_out = time.time() - t0 > timeout
            if started is None or started in statuses or timed_out:
                why = "timed out" if timed_out else f"died ({how})"
                lv = started.split("|", 1)[0] if started else levels[0]
                done.setdefault(lv, []).append(Outcome("*", lv, "*", "error", f"the conformance run {why}" + (
                    f" during {started}" if started else "") + (f"\n{tail}" if tail else "")).as_dict())
                return done
            lv, op, name, cseed = started.split("|", 3)
            crash = Outcome(op, name, "crash", "error", f"the library crashed the process ({how}) in this check"
                            + (f"\n{tail}" if tail else ""), seed=int(cseed))
            statuses[started] = "error"
            done.setdefault(lv, []).append(crash.as_dict())
            progress(f"  CRASH ({how}) in {lv} {op}: {name}; resuming after it")
        done[levels[-1]].append(Outcome("*", "run", "*", "error", f"gave up after {MAX_CRASHES} crashes").as_dict())
        return done


# ====================================================================== the certificate


def _library_facts(lib_path: str) -> dict:
    if lib_path == REFERENCE:
        from ..reference import ReferenceBackend

        be = ReferenceBackend()
        return {"path": None, "sha256": None, "name": "reference", "version": __version__,
                "abi_version": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", "device": "cpu", "attributes": {},
                "ops_claimed": be.ops()}
    from ..loader import probe

    c = probe(Path(lib_path))
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


def run_conformance(lib_path: str, levels: Iterable[str] = LEVELS, out: Optional[str] = None,
                    profile: str = "default", seed: int = 0, only_ops: Optional[Iterable[str]] = None,
                    isolate: bool = True, progress: Progress = _quiet, timeout: float = 3600) -> dict:
    """Certify a backend library (or the special name "reference") and return the certificate;
    with `out`, also write it as JSON. Nothing raises for a bad library: its failures are results."""
    lib_path = str(lib_path)
    levels = [lv.upper() for lv in levels]
    for lv in levels:
        if lv not in LEVELS:
            raise ValueError(f"unknown level {lv!r}; levels are {', '.join(LEVELS)}")
    only_ops = list(only_ops) if only_ops else None
    t0 = time.time()
    facts = _library_facts(lib_path)
    level_results: dict[str, list[dict]] = {}
    if lib_path != REFERENCE and not facts.get("loadable", True):
        for lv in levels:
            level_results[lv] = [Outcome("*", lv, "*", "error", f"library cannot be loaded: {facts['load_error']}")
                                 .as_dict()]
    else:
        if isolate:
            level_results = _run_isolated(levels, lib_path, profile, seed, only_ops, progress, timeout)
        else:
            for lv in levels:
                progress(f"== {lv}")
                level_results[lv] = run_level(lv, lib_path, profile, seed, only_ops, progress)
    summaries = {lv: _summarise_level(r) for lv, r in level_results.items()}
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
        "profile": profile,
        "seed": seed,
        "only_ops": only_ops,
        "tolerances": {"version": TOL.TOLERANCES_VERSION, "values": TOL.table_as_dict(),
                       "sample_boundary_eps": TOL.SAMPLE_BOUNDARY_EPS, "router_tie_eps": TOL.ROUTER_TIE_EPS},
        "levels": {lv: {**summaries[lv], "results": level_results[lv]} for lv in levels},
        "ops_passed": {lv: summaries[lv]["ops_passed"] for lv in levels},
        "passed": all(s["passed"] for s in summaries.values()),
        "seconds": round(time.time() - t0, 2),
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(cert, indent=1, default=str))
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
        lines.append(f"{lv:3s} {verdict:4s}  {c}")
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
    lines.append(f"RESULT    {'PASS' if cert['passed'] else 'FAIL'}  ({cert['seconds']} s)")
    if cert.get("certificate_path"):
        lines.append(f"certificate written to {cert['certificate_path']}")
    return "\n".join(lines)
