"""L4: the collectives across ranks (abi/README.md section 9), one process a rank under mpirun.

    mpirun -n N python -m deepinfer.conformance.multi_rank LIB [--json OUT] [--threads T] [--stall-timeout S]

`deepinfer conformance LIB --ranks N` starts this job (run_l4, multi_rank_launch.py) and records its
checks as level L4 of the certificate; benchmarks/bench_comm.py --check runs the same checks before it
times the collectives. LIB is a library's path, a backend's name ("cpu", "cuda") or "reference". This
module is one rank's program (the control channel, running the checks, main); the checks themselves
are in multi_rank_checks.py.

Every rank loads LIB (a device library on device = its local rank), rank 0 makes the communicator's
id and the control channel (mpi4py's COMM_WORLD, never the data path) hands it to the others, and
then every rank runs each check on random data of its own, regenerating the other ranks' inputs from
their seeds, so that nothing moves between the ranks except through the library. What the library
must produce is what the reference backend produces from all the ranks' inputs: its sum in float64 in
rank order (all_reduce, within the tolerance table's all_reduce bounds), its copies (all_gather,
all_to_all: bit for bit), its moe_dispatch and moe_combine (backends/reference).

  load            every rank loads the library (this module only; bench_comm loads its own)
  comm_create     a communicator of N ranks from rank 0's comm_unique_id
  all_reduce      f32 and bf16, 1 to 6 dims and empty, out of place and in place; every rank the same bits
  all_gather      every dtype the collectives move (DI_DTS_COMM), bit for bit
  all_to_all      whole slots and counted (counts of 0 and C among them), recv_counts, every DI_DTS_COMM dtype
  expert_parallel libraries with moe_dispatch and moe_combine: one MoE layer's traffic over N ranks
                  (README "One MoE layer over N ranks", a host-side stand-in for moe_experts):
                  moe_dispatch, all_to_all of the rows, ids and weights, all_to_all back, moe_combine
                  onto a partial sum; each step against the reference's dispatch and combine
  graph           libraries with graph capture: an all_reduce and a counted all_to_all captured once
                  and launched twice with new inputs
  bad_counts      host libraries (the reference aside): send_counts out of range on rank 0 fail there
                  and on the rank they were for, and no rank hangs
  comm_destroy    every rank destroys its communicator

Only comm_create uses the control channel inside a check (to hand out the id): after each check the
ranks meet (MpiChannel.meet) and only then exchange their verdicts and what must agree between them.
A rank whose peers do not arrive within stall_timeout seconds (one of them is stuck in a collective
that this rank left with an error, or died) prints what it knows and ends the job (MPI_Abort), so a
failing check never leaves a rank waiting for ever; a check that fails alike on every rank (a library
whose communicators hold one rank only) just fails, and the next checks run or are skipped. Rank 0
prints each check's result as it ends, on a line "L4-RESULT <json>" (what the parent keeps if the
job dies later), and writes --json at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from ..errors import BackendCallError
from ..loader import get_backend
# the checks, also for callers that import them from here (bench_comm.py, tests/dist_scripts)
from .multi_rank_checks import CHECK_OPS, CHECKS, Check, Ranks, Skip, _describe

LEVEL = "L4"
STALL_TIMEOUT = 60.0      # seconds a rank waits for its peers after a check before it ends the job
JOB_TIMEOUT = 300.0       # seconds the whole job may take (levels.CHECK_BUDGETS["L4"])
MAX_MESSAGES = 12         # failures kept per rank and check

# the lines the ranks print for the parent (run_l4), each a JSON object after the prefix
START, RESULT, STALL = "L4-START ", "L4-RESULT ", "L4-STALL "

LOCAL_RANK_ENVS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK")


# ====================================================================== the control channel


class MpiChannel:
    """How the ranks of an mpirun job agree on small things (the comm id, verdicts): mpi4py's
    COMM_WORLD. Importing mpi4py initializes MPI, before any library is loaded: the CPU library then
    finds the libmpi that mpi4py loaded."""

    def __init__(self):
        from mpi4py import MPI

        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        env = next((os.environ[k] for k in LOCAL_RANK_ENVS if os.environ.get(k)), None)
        self.local_rank = int(env) if env is not None else self.world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()

    def allgather(self, obj) -> list:
        return self.world.allgather(obj)

    def bcast(self, obj, root: int = 0):
        return self.world.bcast(obj, root=root)

    def barrier(self) -> None:
        self.world.Barrier()

    def meet(self, timeout: float) -> bool:
        """Wait until every rank calls meet; False when they have not within `timeout` seconds."""
        req = self.world.Ibarrier()
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while not req.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return True

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.world.Abort(code)


class LocalChannel:
    """One rank alone (no launcher)."""

    rank, size, local_rank = 0, 1, 0

    def allgather(self, obj) -> list:
        return [obj]

    def bcast(self, obj, root: int = 0):
        return obj

    def barrier(self) -> None:
        pass

    def meet(self, timeout: float) -> bool:
        return True

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        os._exit(code)


# ====================================================================== one rank's side


def open_backend(spec: str, local_rank: int, threads: int = 1):
    """The backend under test on this rank: a device library on device `local_rank`, a host library
    (one device, shared by the ranks) with `threads` threads a rank."""
    return get_backend(spec, local_rank=local_rank, num_threads=threads)


# ---------------------------------------------------------------------- running them


_ORDER = {"skipped": 0, "unsupported": 1, "pass": 2, "fail": 3, "error": 4}


def _worst(statuses) -> str:
    return max(statuses, key=_ORDER.__getitem__, default="skipped")


def _run_here(R: Ranks, check: Check, ready: dict) -> tuple[str, list[str]]:
    """(status, messages) of one check on this rank."""
    missing = [need for need in check.needs if not ready[need]]
    if missing:
        why = {"backend": "the library did not load on every rank",
               "comm": "no communicator of every rank (comm_create did not succeed everywhere)"}
        return "skipped", [f"not run: {why[missing[0]]}"]
    R.failures, R.agreed = [], {}
    try:
        check.run(R)
    except Skip as s:
        return s.status, [s.reason]
    except BackendCallError as e:   # the library failed a call that every rank made alike
        return "fail", R.failures[:MAX_MESSAGES - 1] + [f"call failed: {e}"]
    except Exception as e:   # noqa: BLE001 (a result; the ranks meet next, or the job ends)
        traceback.print_exc(file=sys.stderr)
        return "error", R.failures[:MAX_MESSAGES - 1] + [_describe(e)]
    return ("fail" if R.failures else "pass"), R.failures[:MAX_MESSAGES] + (
        [f"... and {len(R.failures) - MAX_MESSAGES} more"] if len(R.failures) > MAX_MESSAGES else [])


def _merge(check: Check, everyone: list[dict], seconds: float) -> dict:
    """One check's result from every rank's part."""
    status = _worst(m["status"] for m in everyone)
    messages = []
    common = set.intersection(*(set(m["agreed"]) for m in everyone)) if everyone else set()
    for what in sorted(common):
        if len({m["agreed"][what] for m in everyone}) > 1:
            messages.append(f"{what}: the ranks got different results (every rank must receive the same bits)")
    if messages:
        status = _worst([status, "fail"])
        if len(messages) > MAX_MESSAGES:
            messages = messages[:MAX_MESSAGES] + [f"... and {len(messages) - MAX_MESSAGES} more"]
    return {"name": check.name, "op": check.op, "what": check.what, "status": status, "messages": messages,
            "ranks": [{"rank": m["rank"], "status": m["status"], "messages": m["messages"]} for m in everyone],
            "seconds": round(seconds, 3)}


def print_line(prefix: str, obj: dict) -> None:
    """One protocol line, written whole (the parent reads the ranks' output through mpirun)."""
    sys.stdout.write(prefix + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def run_checks(R: Ranks, checks=CHECKS, stall_timeout: float = STALL_TIMEOUT,
               on_start: Optional[Callable[[Check], None]] = None,
               on_result: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Run `checks` on every rank in turn; every rank returns the same list of results. A rank whose
    peers do not meet it after a check within `stall_timeout` seconds prints an "L4-STALL" line and
    ends the job (ctl.abort)."""
    results = []
    ready = {"backend": R.be is not None, "comm": R.comm is not None}
    for check in checks:
        if on_start:
            on_start(check)
        t0 = time.perf_counter()
        status, messages = _run_here(R, check, ready)
        mine = {"rank": R.rank, "status": status, "messages": messages, "agreed": dict(R.agreed),
                "backend": R.be is not None, "comm": R.comm is not None}
        if not R.ctl.meet(stall_timeout):
            print_line(STALL, {"check": check.name, "rank": R.rank, "waited": stall_timeout, "status": status,
                               "messages": messages})
            print(f"rank {R.rank}: the other ranks did not finish {check.name} within {stall_timeout:g} s "
                  f"(stuck in a collective, or dead): ending the job", file=sys.stderr, flush=True)
            R.ctl.abort(3)
        everyone = R.ctl.allgather(mine)
        ready = {k: all(m[k] for m in everyone) for k in ready}
        result = _merge(check, everyone, time.perf_counter() - t0)
        results.append(result)
        if on_result:
            on_result(result)
    return results


def failed(results: list[dict]) -> list[dict]:
    return [r for r in results if r["status"] in ("fail", "error")]


def describe(result: dict) -> str:
    """A check's result in one line, and one more per failure."""
    lines = [f"{result['name']:16s} {result['status'].upper():11s} {result['seconds']:7.2f} s"]
    for m in result["messages"]:
        lines.append(f"    {m}")
    for r in result["ranks"]:
        if r["status"] in ("fail", "error") or (result["status"] in ("skipped", "unsupported") and r["rank"] == 0):
            lines += [f"    rank {r['rank']}: {m}" for m in r["messages"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.conformance.multi_rank",
                                 description="One rank of the multi-rank conformance level (run it under mpirun -n N).")
    ap.add_argument("library", help="a library's path, a backend's name, or 'reference'")
    ap.add_argument("--json", type=Path, help="rank 0 writes every check's result here")
    ap.add_argument("--threads", type=int, default=1, help="threads of a host library, each rank (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT,
                    help=f"seconds a rank waits for the others after a check before it ends the job (default "
                         f"{STALL_TIMEOUT:g})")
    a = ap.parse_args(argv)
    ctl = MpiChannel()
    R = Ranks(ctl, seed=a.seed)

    def load(R: Ranks) -> None:
        R.be = open_backend(a.library, ctl.local_rank, a.threads)

    checks = (Check("load", "load", "every rank loads the library (a device library on device = its local rank)", load,
                    ()),) + CHECKS
    t0 = time.time()

    def started(c: Check) -> None:
        if ctl.rank == 0:
            print_line(START, {"check": c.name})

    def reported(res: dict) -> None:
        if ctl.rank == 0:
            print(describe(res), flush=True)
            print_line(RESULT, res)

    results = run_checks(R, checks, a.stall_timeout, started, reported)
    ok = not failed(results)
    if ctl.rank == 0:
        be = R.be
        info = None if be is None else {"name": be.name, "device": be.device, "path": getattr(be.info, "path", None)}
        doc = {"level": LEVEL, "ranks": ctl.size, "library": a.library, "backend": info, "passed": ok,
               "seconds": round(time.time() - t0, 2), "checks": results}
        if a.json:
            a.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"{LEVEL} across {ctl.size} ranks: {'PASS' if ok else 'FAIL'}", flush=True)
    if R.be is not None:
        R.be.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
