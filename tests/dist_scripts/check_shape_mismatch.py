"""Ranks that pass different shapes to a collective: the CPU library says so on every rank (no hang,
no wrong data), and the communicator still works afterwards. Run under mpirun (tests/test_parallel.py)."""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import deepinfer
from deepinfer.errors import BackendCallError
from deepinfer.tensor import Tensor


def main() -> int:
    world = MPI.COMM_WORLD
    N, R = world.Get_size(), world.Get_rank()
    cpu = deepinfer.get_backend("cpu")
    cid = world.bcast(cpu.comm_unique_id() if R == 0 else None, root=0)
    comm = cpu.comm_create(cid, N, R)

    def t(a):
        return Tensor.from_numpy(np.ascontiguousarray(a))

    H = 4 + (R == N - 1)           # the last rank disagrees
    calls = {"all_reduce": lambda: dict(x=t(np.ones((3, H), np.float32)), out=cpu.empty((3, H), "f32")),
             "all_gather": lambda: dict(x=t(np.ones((3, H), np.float32)), out=cpu.empty((N, 3, H), "f32")),
             "all_to_all": lambda: dict(send=t(np.ones((N, 3, H), np.float32)), recv=cpu.empty((N, 3, H), "f32"))}
    bad = 0
    for name, kw in calls.items():
        try:
            cpu.call(name, comm=comm, **kw())
            print(f"rank {R}: {name} with mismatched shapes did not fail", flush=True)
            bad += 1
        except BackendCallError as e:
            if "the ranks passed different shapes" not in str(e):
                print(f"rank {R}: {name}: unexpected message {e}", flush=True)
                bad += 1
    # the communicator is still good for calls that agree (empty ones included)
    o = cpu.empty((2, 3), "f32")
    cpu.call("all_reduce", comm=comm, x=t(np.full((2, 3), R, np.float32)), out=o)
    bad += int(not (cpu.to_numpy(o) == sum(range(N))).all())
    cpu.call("all_gather", comm=comm, x=t(np.ones((0,), np.float32)), out=cpu.empty((N, 0), "f32"))
    comm.close()
    bad = world.allreduce(bad)
    if R == 0:
        print("shape mismatch checks:", "ok" if bad == 0 else f"{bad} failures", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
