"""One rank of tests/test_cpu_dist_ops.py's multi-rank check: run under `mpirun -n N`.

Every rank makes a reference communicator (backends/reference/dist.py, over mpi4py) and a CPU
library one, runs each collective on both with the same random data, and compares: all_reduce
within f32 / bf16 rounding of the reference's f64 sum (and bit-identical on every rank), all_gather
and all_to_all exactly. Then what only the CPU library promises: collectives replayed from a CPU
graph, and mistakes made on one rank (different ids, bad counts) failing on every rank instead of
leaving the others blocked. Prints "rank r: collectives OK" and exits 0, or prints each mismatch
and exits 1; an exception on one rank aborts the job (its peers would otherwise wait for it).

    --lib PATH       the CPU library (default: deepinfer.get_backend("cpu"))
    --die-rank R     rank R exits (status 3) before the first collective: the job must end
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from mpi4py import MPI   # first: it initializes MPI, and the CPU library finds its libmpi loaded

import ml_dtypes
import numpy as np

import deepinfer
from deepinfer.errors import BackendCallError
from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor

NP = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "int32": np.int32, "uint8": np.uint8, "int8": np.int8}
WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
FAILURES: list = []


def fail(what: str) -> None:
    FAILURES.append(what)
    print(f"rank {RANK}: FAIL: {what}", flush=True)


def t(a) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a))


def same_on_every_rank(what: str, a: np.ndarray) -> None:
    everyone = WORLD.allgather(np.ascontiguousarray(a).tobytes())
    if any(b != everyone[0] for b in everyone):
        fail(f"{what}: the ranks got different results")


def check_close(what: str, got, want, dtype: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rtol = 2 ** -7 if dtype == "bf16" else 1e-5
    scale = float(np.abs(want).max()) if want.size else 0.0
    bad = np.isnan(got) | (np.abs(got - want) > rtol * np.abs(want) + 1e-6 * scale)
    if bad.any():
        fail(f"{what}: {int(bad.sum())} of {bad.size} differ, e.g. got {got[bad][:4]} want {want[bad][:4]}")


def check_equal(what: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape or got.tobytes() != want.tobytes():
        fail(f"{what}: differs from the reference")


# The reference moves arrays with mpi4py, which refuses ml_dtypes' bfloat16 (a BufferError in
# dist._gather): for the byte-moving collectives it gets the same bytes as float16 instead.
AS_REF = {"bf16": ("f16", np.float16)}


def ref_view(dtype: str, a: np.ndarray):
    """(dtype name, array) the reference is given for the bytes of `a`"""
    if dtype in AS_REF:
        name, npt = AS_REF[dtype]
        return name, a.view(npt)
    return dtype, a


def make_comms(cpu, ref):
    rid = WORLD.bcast(ref.comm_unique_id() if RANK == 0 else None, root=0)
    cid = WORLD.bcast(cpu.comm_unique_id() if RANK == 0 else None, root=0)
    return cpu.comm_create(cid, N, RANK), ref.comm_create(rid, N, RANK)


def check_all_reduce(cpu, ref, cc, rc, rng) -> None:
    for dtype in ("f32", "bf16"):
        for shape in [(5,), (3, 17), (0, 4), (2, 3, 64), (1 << 18,)]:
            x = rng.standard_normal(shape).astype(NP[dtype])
            out = {}
            for b, c in ((cpu, cc), (ref, rc)):
                o = b.empty(shape, dtype, fill=np.nan)
                b.call("all_reduce", comm=c, x=t(x), out=o)
                out[b] = b.to_numpy(o)
            what = f"all_reduce {dtype} {shape}"
            check_close(what, out[cpu], out[ref], dtype)
            same_on_every_rank(what, out[cpu])
            xin = t(x.copy())   # in place
            cpu.call("all_reduce", comm=cc, x=xin, out=xin)
            check_equal(what + " in place", cpu.to_numpy(xin), out[cpu])


def check_all_gather(cpu, ref, cc, rc, rng) -> None:
    for dtype in ("f32", "bf16", "int32", "uint8"):
        for shape in [(4,), (3, 5), (2, 0), (2, 2, 33)]:
            x = (rng.standard_normal(shape) * 40).astype(NP[dtype])
            out = {}
            for b, c in ((cpu, cc), (ref, rc)):
                dt, xv = ref_view(dtype, x) if b is ref else (dtype, x)
                o = b.empty((N,) + shape, dt, fill=0)
                b.call("all_gather", comm=c, x=t(xv), out=o)
                out[b] = b.to_numpy(o).view(np.uint8)
            check_equal(f"all_gather {dtype} {shape}", out[cpu], out[ref])
            if x.size and out[cpu][RANK].tobytes() != x.tobytes():
                fail(f"all_gather {dtype} {shape}: out[{RANK}] is not this rank's x")


def check_all_to_all(cpu, ref, cc, rc, rng) -> None:
    for dtype in ("f32", "bf16", "int8"):
        for C, row in [(1, (4,)), (6, (3, 2)), (0, (5,)), (9, ())]:
            send = (rng.standard_normal((N, C) + row) * 40).astype(NP[dtype])
            for counted in (False, True):
                counts = rng.integers(0, C + 1, N).astype(np.int32)
                if counted and C and N > 1:   # the edges too: nothing and everything
                    counts[0], counts[-1] = 0, C
                res = {}
                for b, c in ((cpu, cc), (ref, rc)):
                    dt, sv = ref_view(dtype, send) if b is ref else (dtype, send)
                    recv = b.empty(send.shape, dt, fill=0)
                    kw = {}
                    if counted:
                        kw = dict(send_counts=t(counts), recv_counts=b.empty((N,), "int32", fill=-7))
                    b.call("all_to_all", comm=c, send=t(sv), recv=recv, **kw)
                    res[b] = (b.to_numpy(recv).view(np.uint8), b.to_numpy(kw["recv_counts"]) if counted else None)
                what = f"all_to_all {dtype} C={C} row={row} counts={counts.tolist() if counted else None}"
                if counted:
                    check_equal(what + " recv_counts", res[cpu][1], res[ref][1])
                    for q in range(N):   # rows past recv_counts[q] are unspecified
                        n = int(res[ref][1][q])
                        check_equal(f"{what} slot {q}", res[cpu][0][q, :n], res[ref][0][q, :n])
                else:
                    check_equal(what, res[cpu][0], res[ref][0])


def check_graph(cpu, cc, rng) -> None:
    """An all_reduce and a counted all_to_all captured into a CPU graph, launched twice."""
    C, H = 4, 8
    x, out = cpu.empty((3, H), "f32", fill=0), cpu.empty((3, H), "f32", fill=np.nan)
    send, recv = cpu.empty((N, C, H), "bf16", fill=0), cpu.empty((N, C, H), "bf16", fill=0)
    sc, rcnt = t(np.zeros(N, np.int32)), cpu.empty((N,), "int32", fill=-7)
    cpu.set_stream(cpu.create_stream())   # before prepare: a prepared call keeps its stream
    calls = [cpu.prepare("all_reduce", comm=cc, x=x, out=out),
             cpu.prepare("all_to_all", comm=cc, send=send, recv=recv, send_counts=sc, recv_counts=rcnt)]
    g = cpu.capture(calls)
    for it in range(2):
        cpu.write(x, np.full((3, H), RANK + it, np.float32))
        cpu.write(send, np.arange(N * C * H).reshape(N, C, H).astype(ml_dtypes.bfloat16) + RANK)
        sc.numpy()[...] = (np.arange(N) + RANK + it) % (C + 1)
        g.launch()
        want = sum(r + it for r in range(N))
        if not (cpu.to_numpy(out) == want).all():
            fail(f"graph launch {it}: all_reduce gave {cpu.to_numpy(out)[0, :3]}, want {want}")
        got_counts = cpu.to_numpy(rcnt)
        want_counts = [(RANK + q + it) % (C + 1) for q in range(N)]
        if got_counts.tolist() != want_counts:
            fail(f"graph launch {it}: recv_counts {got_counts.tolist()} != {want_counts}")
        r = cpu.to_numpy(recv).astype(np.float32)
        for q in range(N):
            n = want_counts[q]
            w = (np.arange(N * C * H).reshape(N, C, H)[RANK, :n] + q).astype(ml_dtypes.bfloat16).astype(np.float32)
            if not np.array_equal(r[q, :n], w):
                fail(f"graph launch {it}: slot {q} of recv")
    g.close()
    cpu.set_stream(None)


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
    # different row sizes on different ranks
    H = 2 + (RANK == N - 1)
    try:
        cpu.call("all_to_all", comm=cc, send=cpu.empty((N, C, H), "f32", fill=0), recv=cpu.empty((N, C, H), "f32"),
                 send_counts=t(np.ones(N, np.int32)), recv_counts=cpu.empty((N,), "int32"))
        fail("all_to_all with different shapes on the ranks did not fail here")
    except BackendCallError as e:
        if "the ranks passed different shapes" not in str(e):
            fail(f"all_to_all shapes: unexpected message {e}")
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
    ref = ReferenceBackend()
    cc, rc = make_comms(cpu, ref)
    if RANK == a.die_rank:
        print(f"rank {RANK}: exiting before the first collective, as asked", flush=True)
        os._exit(3)
    rng = np.random.default_rng(1000 + RANK)          # each rank its own data
    check_all_reduce(cpu, ref, cc, rc, rng)
    check_all_gather(cpu, ref, cc, rc, rng)
    check_all_to_all(cpu, ref, cc, rc, rng)
    check_graph(cpu, cc, rng)
    check_errors_fail_everywhere(cpu, cc)
    cc.close()
    rc.close()
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
