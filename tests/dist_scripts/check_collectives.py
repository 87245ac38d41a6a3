"""One rank of tests/test_cpu_dist.py's multi-rank check: run under `mpirun -n N`.

The collectives are checked by the conformance suite's multi-rank level (deepinfer/conformance/
multi_rank.py, what `deepinfer conformance LIB --ranks N` runs): all_reduce, all_gather, all_to_all,
an expert-parallel round trip, graphs and bad counts against what the reference computes from every
rank's inputs, on the CPU library and on the reference itself (its collectives over mpi4py). Then what
only the CPU library promises beyond them: mistakes made on one rank (different ids, different
shapes, a rank claiming another's number) failing on every rank with its messages instead of leaving
the others blocked. Prints "rank r: collectives OK" and exits 0, or prints each failure and exits 1;
an exception on one rank aborts the job (its peers would otherwise wait for it).

    --lib PATH       the CPU library (default: deepinfer.get_backend("cpu"))
    --die-rank R     rank R exits (status 3) before the first collective: the job must end
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from mpi4py import MPI   # first: it initializes MPI, and the CPU library finds its libmpi loaded

import numpy as np

import deepinfer
from deepinfer.conformance import multi_rank as MR
from deepinfer.errors import BackendCallError
from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
FAILURES: list = []


def fail(what: str) -> None:
    FAILURES.append(what)
    print(f"rank {RANK}: FAIL: {what}", flush=True)


def t(a) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a))


def report(be, results: list) -> None:
    """The multi-rank level's failures on `be` as this script's."""
    for res in MR.failed(results):
        fail(f"{be.name}: " + MR.describe(res).replace("\n", "\n  "))


def check_errors_fail_everywhere(cpu, cc) -> None:
    """A mistake on one rank makes every rank's call fail (with a message), and nobody hangs."""
    C = 3
    counts = np.ones(N, np.int32)
    if RANK == 0:
        counts[-1] = C + 1
    try:
        cpu.call("all_to_all", comm=cc, send=cpu.empty((N, C, 2), "f32", fill=0), recv=cpu.empty((N, C, 2), "f32"),
                 send_counts=t(counts), recv_counts=cpu.empty((N,), "int32"))
        fail("all_to_all with rank 0's counts out of range did not fail here")
    except BackendCallError as e:
        want = "must lie in [0, C=3]" if RANK == 0 else "rank 0 passed send_counts outside [0, C]"
        if want not in str(e):
            fail(f"all_to_all bad counts: unexpected message {e}")
    # different row sizes on different ranks, in every collective (counted all_to_all and the rest)
    H = 2 + (RANK == N - 1)
    calls = {
        "all_to_all (counts)": ("all_to_all", dict(
            send=cpu.empty((N, C, H), "f32", fill=0), recv=cpu.empty((N, C, H), "f32"),
            send_counts=t(np.ones(N, np.int32)), recv_counts=cpu.empty((N,), "int32"))),
        "all_to_all": ("all_to_all", dict(send=cpu.empty((N, C, H), "f32", fill=0), recv=cpu.empty((N, C, H), "f32"))),
        "all_reduce": ("all_reduce", dict(x=cpu.empty((C, H), "f32", fill=1), out=cpu.empty((C, H), "f32"))),
        "all_gather": ("all_gather", dict(x=cpu.empty((C, H), "f32", fill=1), out=cpu.empty((N, C, H), "f32"))),
    }
    for what, (op, kw) in calls.items():
        try:
            cpu.call(op, comm=cc, **kw)
            fail(f"{what} with different shapes on the ranks did not fail here")
        except BackendCallError as e:
            if "the ranks passed different shapes" not in str(e):
                fail(f"{what} shapes: unexpected message {e}")
    # the communicator still serves calls that agree (an empty one too)
    out = cpu.empty((2, 3), "f32")
    cpu.call("all_reduce", comm=cc, x=t(np.full((2, 3), RANK, np.float32)), out=out)
    if not (cpu.to_numpy(out) == sum(range(N))).all():
        fail("all_reduce after the shape mismatches gave a wrong sum")
    cpu.call("all_gather", comm=cc, x=t(np.ones((0,), np.float32)), out=cpu.empty((N, 0), "f32"))
    # every rank handed a different id
    try:
        cpu.comm_create(cpu.comm_unique_id(), N, RANK)
        fail("comm_create with a different id on every rank succeeded")
    except BackendCallError as e:
        if "the ranks were handed different ids" not in str(e):
            fail(f"comm_create ids: unexpected message {e}")
    # rank 0 claims to be rank 1: every rank refuses (no one waits in MPI_Comm_dup)
    cid = WORLD.bcast(cpu.comm_unique_id() if RANK == 0 else None, root=0)
    try:
        cpu.comm_create(cid, N, 1 if RANK == 0 else RANK)
        fail("comm_create with two ranks claiming rank 1 succeeded")
    except BackendCallError as e:
        if "process 0 of the MPI job" not in str(e):
            fail(f"comm_create ranks: unexpected message {e}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=None)
    ap.add_argument("--die-rank", type=int, default=-1)
    a = ap.parse_args()
    cpu = deepinfer.loader.load_library(a.lib, num_threads=1) if a.lib else deepinfer.get_backend("cpu")
    ctl = MR.MpiChannel()
    R = MR.Ranks(ctl, cpu)
    R.connect()
    if RANK == a.die_rank:
        print(f"rank {RANK}: exiting before the first collective, as asked", flush=True)
        os._exit(3)
    # the communicator is made above and destroyed below, after the CPU library's own checks
    report(cpu, MR.run_checks(R, [c for c in MR.CHECKS if c.name not in ("comm_create", "comm_destroy")]))
    check_errors_fail_everywhere(cpu, R.comm)
    R.comm.close()
    ref = ReferenceBackend()
    report(ref, MR.run_checks(MR.Ranks(ctl, ref)))
    failed = WORLD.allreduce(len(FAILURES))
    if failed:
        print(f"rank {RANK}: {len(FAILURES)} failure(s) here, {failed} in the job", flush=True)
        return 1
    print(f"rank {RANK}: collectives OK", flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:   # the peers would wait for this rank in their next collective: end the job
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        WORLD.Abort(2)
    sys.exit(code)
