"""The parent side of L4: run_l4 starts the checks as an mpirun job of N ranks (multi_rank.py's main
on each), reads their protocol lines, and turns what they report, or how the job ended (a crash, a
stall, the timeout), into certificate results.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..loader import child_env
from ..parallel.launch import mpirun_argv, mpirun_env
from .harness import Outcome
from .levels import unavailable   # run_l4's check, also for callers that import it from here
from .multi_rank import JOB_TIMEOUT, LEVEL, RESULT, STALL, STALL_TIMEOUT, START
from .multi_rank_checks import CHECK_OPS


def _outcome(res: dict, nranks: int) -> dict:
    """A check's result as a certificate result (harness.Outcome, with each rank's status)."""
    lines = list(res["messages"])
    for r in res["ranks"]:
        if r["status"] in ("fail", "error"):
            lines += [f"rank {r['rank']}: {m}" for m in r["messages"]]
    if not lines and res["status"] in ("skipped", "unsupported"):
        lines = next((r["messages"] for r in res["ranks"] if r["messages"]), [])
    d = Outcome(res["op"], res["name"], f"{nranks} ranks", res["status"], "\n".join(lines),
                seconds=res.get("seconds", 0.0)).as_dict()
    d["what"] = res["what"]
    d["ranks"] = {str(r["rank"]): r["status"] for r in res["ranks"]}
    return d


def _stop(proc: subprocess.Popen) -> None:
    """End the job: mpirun takes SIGTERM as "kill every rank"; whatever is left of its session (the
    ranks run in process groups of their own) is killed after a grace period."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
        return
    except subprocess.TimeoutExpired:
        pass
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getsid(int(pid)) == proc.pid:
                    os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


def _read_job(proc: subprocess.Popen, timeout: float, progress) -> tuple[list[str], bool]:
    """The job's output lines (relaying the human ones to progress) until it ends; and whether it ran
    past `timeout` and was stopped."""
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    out: list[str] = []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _stop(proc)
            return out, True
        if line is None:
            proc.wait()
            return out, False
        out.append(line)
        if not line.startswith((START, RESULT, STALL)):
            progress(f"  {line}")


def _parse(lines: list[str], prefix: str) -> list[dict]:
    found = []
    for line in lines:
        i = line.find(prefix)
        if i >= 0:
            try:
                found.append(json.loads(line[i + len(prefix):]))
            except ValueError:
                pass
    return found


def _tail(lines: list[str], n: int = 8) -> str:
    """The last lines of the job's own output (mpirun's and the ranks'), without the protocol and rules."""
    keep = [line.replace("\x00", "").rstrip() for line in lines if not line.startswith((START, RESULT, STALL))]
    return "\n".join([line for line in keep if line.strip("- ")][-n:])


def _ended_early(lines: list[str], results: list[dict], rc: int, timed_out: bool, timeout: float,
                 nranks: int) -> list[dict]:
    """Outcomes of the checks a job that ended early did not report: an error for the one it was in,
    "skipped" for those after it."""
    done = {r["name"] for r in results}
    stalls = _parse(lines, STALL)
    running = next((s["check"] for s in reversed(_parse(lines, START)) if s["check"] not in done), None)
    if running is None and stalls:
        running = stalls[0]["check"]
    if timed_out:
        how = f"the {nranks}-rank job ran past {timeout:g} s and was stopped"
    elif stalls:
        how = "; ".join(f"rank {s['rank']} ended the job: the other ranks did not finish the check within "
                        f"{s['waited']:g} s of it (stuck in a collective, or dead)"
                        + (f"; rank {s['rank']}'s own result: {s['status']}: {'; '.join(s['messages'])}"
                           if s["messages"] else "") for s in stalls)
    else:
        how = f"the {nranks}-rank job ended with exit status {rc}"
    tail = _tail(lines)
    if running is None:
        where = "after the last check reported" if results else "before any check reported"
        return [Outcome("*", LEVEL, "*", "error", f"{how} {where}" + (f"\n{tail}" if tail else "")).as_dict()]
    out, after = [], False
    for name, op in CHECK_OPS.items():
        if name == running:
            out.append(Outcome(op, name, f"{nranks} ranks", "error",
                               f"{how}, during this check" + (f"\n{tail}" if tail else "")).as_dict())
            after = True
        elif after and name not in done:
            out.append(Outcome(op, name, f"{nranks} ranks", "skipped",
                               f"not run: the job ended in {running}").as_dict())
    return out


def run_l4(lib_path: str, nranks: int, timeout: float = JOB_TIMEOUT, stall_timeout: Optional[float] = None,
           progress: Callable[[str], None] = lambda m: None, seed: int = 0,
           command: Optional[list] = None) -> list[dict]:
    """Run the checks as an mpirun job of `nranks` ranks and return their results (certificate
    results, one per check); never raises for a bad library or a job that dies or hangs. `command`
    replaces `python -m deepinfer.conformance.multi_rank` (tests run a wrapper of main)."""
    why = unavailable()
    if why:
        return [Outcome("*", LEVEL, "*", "error", f"cannot start {nranks} ranks: {why}").as_dict()]
    stall = stall_timeout if stall_timeout is not None else min(STALL_TIMEOUT, timeout / 2)
    with tempfile.TemporaryDirectory(prefix="di-conf-l4-") as tmp:
        doc_path = Path(tmp) / "l4.json"
        argv = list(command or [sys.executable, "-m", "deepinfer.conformance.multi_rank"]) + [
            lib_path, "--json", str(doc_path), "--stall-timeout", f"{stall:g}", "--seed", str(seed)]
        progress(f"  mpirun -n {nranks} {' '.join(argv[1:3])} ...")
        proc = subprocess.Popen(mpirun_argv(nranks, argv), env=mpirun_env(child_env()), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        lines, timed_out = _read_job(proc, timeout, progress)
        doc = json.loads(doc_path.read_text()) if doc_path.is_file() and not timed_out else None
    results = doc["checks"] if doc else _parse(lines, RESULT)
    outcomes = [_outcome(r, nranks) for r in results]
    if doc is None:
        outcomes += _ended_early(lines, results, proc.returncode, timed_out, timeout, nranks)
    return outcomes
