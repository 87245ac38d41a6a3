"""The ranks of one job, as the runtime sees them.

Two channels, on purpose:
  - the control channel (mpi4py over the MPI job mpirun started): rank 0 runs the scheduler and
    sends every step's plan key and host inputs to the other ranks, which only execute; it also
    carries the communicator's id and a few start-up agreements (KV cache size, precision).
  - the backend's communicator (ABI 1.4 comm_create): the collectives inside a step, on the
    backend's stream (MPI in the CPU library, NCCL in the CUDA one).

The step message is raw bytes (a small JSON header naming the plan and each input's dtype and
shape, then the arrays), never pickle.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

import numpy as np

from ..errors import ConfigError
from .launch import world_from_env
from .shard import ShardPlan


_STOP = "stop"
_STEP = "step"


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError("several ranks need mpi4py and Open MPI: pip install 'deepinfer[mpi]'") from None
    return MPI


class ParallelGroup:
    """This process's place in a tensor_parallel x expert_parallel job (each 1 or the job's size)."""

    def __init__(self, tensor_parallel: int = 1, expert_parallel: int = 1):
        tp, ep = int(tensor_parallel), int(expert_parallel)
        world = max(tp, ep)
        for name, v in (("tensor_parallel", tp), ("expert_parallel", ep)):
            if v < 1 or v not in (1, world):
                raise ConfigError(f"{name} {v}: tensor_parallel and expert_parallel are each 1 or the number of "
                                  f"ranks ({world}); mixed sizes are not supported")
        MPI = _mpi()
        self.mpi = MPI.COMM_WORLD
        self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()
        if self.world != world:
            raise ConfigError(f"tensor_parallel {tp} / expert_parallel {ep} need {world} ranks, but this MPI job has "
                              f"{self.world}: start it with `mpirun -n {world}` (or let `deepinfer run|serve "
                              f"--tensor-parallel {world}` start it)")
        self.tp, self.ep = tp, ep
        self.shard = ShardPlan(self.rank, tp, ep)
        self.comm = None               # the backend's communicator (connect)
        self.stopped = False

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler, the tokenizer and the server; the others only execute steps."""
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its machine (its GPU)."""
        return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", world_from_env()[0]))

    def connect(self, backend) -> None:
        """Create the backend's communicator: rank 0 makes the id, the control channel hands it out."""
        if not backend.supports_comm:
            raise ConfigError(f"backend {backend.name} has no communicators (ABI 1.4 comm_create, all_reduce, "
                              f"all_to_all): update that library, or run on one rank")
        missing = [op for op in ("all_reduce", "all_gather", "all_to_all", "moe_dispatch", "moe_combine")
                   if not backend.has_op(op)]
        if missing:
            raise ConfigError(f"backend {backend.name} lacks {', '.join(missing)} (ABI 1.4), which several ranks need")
        buf = bytearray(backend.comm_unique_id()) if self.is_driver else bytearray(128)
        self.mpi.Bcast(buf, root=0)
        self.comm = backend.comm_create(bytes(buf), self.world, self.rank)

    # ------------------------------------------------------------------ start-up agreements
    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. KV blocks that fit on every one)."""
        MPI = _mpi()
        return int(self.mpi.allreduce(int(value), op=MPI.MIN))

    def from_driver(self, text: Optional[str]) -> str:
        """Rank 0's string on every rank (the precision it chose)."""
        data = (text or "").encode() if self.is_driver else b""
        n = np.array([len(data)], np.int64)
        self.mpi.Bcast(n, root=0)
        buf = bytearray(data) if self.is_driver else bytearray(int(n[0]))
        self.mpi.Bcast(buf, root=0)
        return bytes(buf).decode()

    # ------------------------------------------------------------------ steps
    def send_step(self, key: tuple, inputs: dict) -> None:
        """Rank 0: the plan about to run and its host inputs, to every other rank. key: the plan's
        key (engine.plan_key.PlanKey, a tuple), sent as the JSON list of its values."""
        names = sorted(inputs)
        arrays = [np.ascontiguousarray(inputs[n]) for n in names]
        head = {"kind": _STEP, "key": list(key),
                "inputs": [[n, a.dtype.str, list(a.shape)] for n, a in zip(names, arrays)]}
        self._send(json.dumps(head).encode(), b"".join(a.tobytes() for a in arrays))

    def stop(self) -> None:
        """Rank 0: tell the other ranks there are no more steps (they leave serve_steps)."""
        if self.world > 1 and self.is_driver and not self.stopped:
            self.stopped = True
            self._send(json.dumps({"kind": _STOP}).encode(), b"")

    def _send(self, head: bytes, body: bytes) -> None:
        sizes = np.array([len(head), len(body)], np.int64)
        self.mpi.Bcast(sizes, root=0)
        self.mpi.Bcast(bytearray(head), root=0)
        if body:
            self.mpi.Bcast(bytearray(body), root=0)

    def recv_step(self):
        """Other ranks: (plan key values as a tuple, {name: array}) of the next step, or None when
        rank 0 stopped."""
        sizes = np.zeros(2, np.int64)
        self.mpi.Bcast(sizes, root=0)
        head = bytearray(int(sizes[0]))
        self.mpi.Bcast(head, root=0)
        msg = json.loads(bytes(head))
        if msg["kind"] == _STOP:
            return None
        body = bytearray(int(sizes[1]))
        if sizes[1]:
            self.mpi.Bcast(body, root=0)
        inputs, off = {}, 0
        for name, dt, shape in msg["inputs"]:
            a = np.frombuffer(body, np.dtype(dt), count=int(np.prod(shape, dtype=np.int64)), offset=off)
            inputs[name] = a.reshape(shape)
            off += a.nbytes
        return tuple(msg["key"]), inputs

    def abort(self, code: int = 1) -> None:
        """End the whole job now (a rank that cannot go on must not leave the others waiting)."""
        try:
            sys.stderr.flush()
        finally:
            self.mpi.Abort(code)


def serve_steps(runner, group: ParallelGroup) -> int:
    """The loop of every rank but 0: run each step rank 0 announces, until it stops. Returns the
    number of steps run."""
    n = 0
    while True:
        msg = group.recv_step()
        if msg is None:
            return n
        key, inputs = msg
        runner.run_remote(key, inputs)
        n += 1
