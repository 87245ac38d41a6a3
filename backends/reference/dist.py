"""ABI 1.4: collectives over a communicator, and the two local halves of MoE expert parallelism.

The reference's communicator (ReferenceComm) is the MPI job the process runs in (mpi4py's
COMM_WORLD, loaded only when nranks > 1): the reference is an oracle, so every collective moves
whole arrays and does its arithmetic in float64 in rank order, identical on every rank. A
one-rank communicator needs no MPI at all, so the single-process conformance suite runs these ops
too (a sum over one rank, a gather of one, an all-to-all with oneself).

moe_dispatch / moe_combine are plain local ops: the packing before an all_to_all and the weighted
sum after the one that brings the expert outputs back (README section 9).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .common import check_arg, check_dim, check_shape, i32, read, read_index, span_bytes, write

COMM_MAGIC = b"deepinfer-reference-comm\0"


@dataclass
class ReferenceComm:
    """nranks processes of one MPI job (or one process alone)."""

    nranks: int
    rank: int
    id: bytes
    mpi: object = None            # mpi4py communicator, None for one rank
    closed: bool = field(default=False)


def unique_id() -> bytes:
    """128 bytes: the magic and a random tag (every rank must be handed the same bytes)."""
    tag = os.urandom(16)
    return (COMM_MAGIC + tag).ljust(128, b"\0")


def create_comm(id_bytes: bytes, nranks: int, rank: int) -> ReferenceComm:
    if len(id_bytes) != 128 or not id_bytes.startswith(COMM_MAGIC):
        raise ValueError("comm_create: the id was not made by the reference backend's comm_unique_id")
    if nranks < 1 or not 0 <= rank < nranks:
        raise ValueError(f"comm_create: rank {rank} of {nranks} ranks is out of range")
    if nranks == 1:
        return ReferenceComm(1, 0, id_bytes)
    from mpi4py import MPI   # noqa: PLC0415 (only a multi-rank job needs MPI)

    world = MPI.COMM_WORLD
    if world.Get_size() != nranks or world.Get_rank() != rank:
        raise ValueError(f"comm_create: this process is rank {world.Get_rank()} of an MPI job of "
                         f"{world.Get_size()}, not rank {rank} of {nranks}: start {nranks} processes with mpirun")
    comm = world.Dup()
    ids = np.empty((nranks, 128), np.uint8)
    comm.Allgather(np.frombuffer(id_bytes, np.uint8), ids)
    if not (ids == ids[0]).all():
        comm.Free()
        raise ValueError("comm_create: the ranks were handed different ids (every rank needs the bytes rank 0 made)")
    return ReferenceComm(nranks, rank, id_bytes, comm)


def destroy_comm(comm: ReferenceComm) -> None:
    if not comm.closed and comm.mpi is not None:
        comm.mpi.Free()
    comm.closed = True


def _comm(op: str, comm) -> ReferenceComm:
    if not isinstance(comm, ReferenceComm):
        raise TypeError(f"{op}: comm must be a communicator of the reference backend (comm_create), got "
                        f"{type(comm).__name__}")
    if comm.closed:
        raise ValueError(f"{op}: comm was destroyed")
    return comm


def _gather(comm: ReferenceComm, a: np.ndarray) -> np.ndarray:
    """[nranks, *a.shape]: every rank's array (the same shape on every rank)."""
    if comm.mpi is None:
        return a[None].copy()
    a = np.ascontiguousarray(a)
    out = np.empty((comm.nranks,) + a.shape, a.dtype)
    # as bytes: MPI has no bf16 / e4m3 (mpi4py refuses ml_dtypes arrays), and a gather only moves them
    comm.mpi.Allgather(a.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8))
    return out


def _contiguous(op: str, **tensors) -> None:
    """The collectives move whole buffers: their tensors must be contiguous (README section 9)."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (shape {list(t.shape)}, strides {list(t.strides)})")


def _disjoint(op: str, a_name: str, a, b_name: str, b) -> None:
    """a and b must not share bytes (the op reads one while it writes the other)."""
    if a is None or b is None or a.buffer is not b.buffer or not a.numel or not b.numel:
        return
    a0, b0 = a.offset, b.offset
    if a0 < b0 + span_bytes(b) and b0 < a0 + span_bytes(a):
        raise ValueError(f"{op}: {a_name} and {b_name} overlap; give them separate memory")


def _check_same_shapes(op: str, comm: ReferenceComm, shape: tuple) -> None:
    """Collectives need one shape on every rank: a mismatch is an error on all of them, not a hang."""
    if comm.mpi is None:
        return
    shapes = _gather(comm, np.array(list(shape) + [-1] * (7 - len(shape)), np.int64))
    if not (shapes == shapes[0]).all():
        raise ValueError(f"{op}: the ranks passed different shapes: " +
                         ", ".join(str([int(v) for v in s if v >= 0]) for s in shapes))


def all_reduce(comm=None, x=None, out=None) -> None:
    """out = sum over ranks of x, in float64 in rank order, rounded once (the same on every rank)."""
    op = "all_reduce"
    comm = _comm(op, comm)
    check_arg(op, "x", x)
    check_arg(op, "out", out)
    check_shape(op, "out", out, tuple(x.shape))
    check_dim(op, "out.dtype", out.dtype.name, x.dtype.name, "x.dtype")
    _contiguous(op, x=x, out=out)
    _check_same_shapes(op, comm, tuple(x.shape))
    parts = _gather(comm, read(x))
    total = np.zeros(x.shape)
    for r in range(comm.nranks):
        total += parts[r]
    write(out, total)


def all_gather(comm=None, x=None, out=None) -> None:
    """out[r] = x of rank r."""
    op = "all_gather"
    comm = _comm(op, comm)
    check_arg(op, "x", x)
    check_arg(op, "out", out)
    check_shape(op, "out", out, (comm.nranks,) + tuple(x.shape))
    check_dim(op, "out.dtype", out.dtype.name, x.dtype.name, "x.dtype")
    _contiguous(op, x=x, out=out)
    _disjoint(op, "x", x, "out", out)
    _check_same_shapes(op, comm, tuple(x.shape))
    parts = _gather(comm, np.array(x.numpy(), copy=True))
    out.numpy()[...] = parts


def all_to_all(comm=None, send=None, recv=None, send_counts=None, recv_counts=None) -> None:
    """Slot p of send goes to rank p, arriving in slot (this rank) of its recv; with counts only the
    first send_counts[p] rows travel (the reference leaves recv rows past recv_counts as they were)."""
    op = "all_to_all"
    comm = _comm(op, comm)
    for name, t in (("send", send), ("recv", recv), ("send_counts", send_counts), ("recv_counts", recv_counts)):
        check_arg(op, name, t)
    N = comm.nranks
    check_dim(op, "send.shape[0]", send.shape[0], N, "the communicator's ranks")
    check_shape(op, "recv", recv, tuple(send.shape))
    check_dim(op, "recv.dtype", recv.dtype.name, send.dtype.name, "send.dtype")
    if (send_counts is None) != (recv_counts is None):
        raise ValueError(f"{op}: send_counts and recv_counts go together (both present or both absent)")
    _contiguous(op, send=send, recv=recv)
    _disjoint(op, "send", send, "recv", recv)
    _check_same_shapes(op, comm, tuple(send.shape))
    C = send.shape[1]
    data = np.array(send.numpy(), copy=True)
    if send_counts is not None:
        check_shape(op, "send_counts", send_counts, (N,))
        check_shape(op, "recv_counts", recv_counts, (N,))
        counts = read_index(send_counts)
        if ((counts < 0) | (counts > C)).any():
            raise ValueError(f"{op}: send_counts {counts.tolist()} must lie in [0, C={C}]")
    else:
        counts = np.full(N, C, np.int64)
    everyone = _gather(comm, data)                     # [src, dst, C, ...]
    all_counts = _gather(comm, counts)                 # [src, dst]
    mine = comm.rank
    r = recv.numpy()
    for q in range(N):
        n = int(all_counts[q, mine])
        r[q, :n] = everyone[q, mine, :n]
    if recv_counts is not None:
        recv_counts.numpy()[...] = all_counts[:, mine].astype(np.int32)


def moe_dispatch(x=None, topk_ids=None, topk_weights=None, send_x=None, send_ids=None, send_weights=None,
                 send_counts=None, route=None, experts_per_rank=None) -> None:
    """Each token with an expert on rank p (= e // experts_per_rank) gets the next row of slot p:
    its x row, its top-k as rank p's local ids (-1 elsewhere) and weights (0 where -1)."""
    op = "moe_dispatch"
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("send_x", send_x),
                    ("send_ids", send_ids), ("send_weights", send_weights), ("send_counts", send_counts),
                    ("route", route)):
        check_arg(op, name, t)
    T, H = x.shape
    K = topk_ids.shape[1]
    N, C = send_x.shape[0], send_x.shape[1]
    Er = i32(experts_per_rank, op, "experts_per_rank")
    if Er < 1:
        raise ValueError(f"{op}: experts_per_rank={Er} must be >= 1")
    if N < 1:
        raise ValueError(f"{op}: send_x.shape[0] (ranks) must be >= 1")
    check_dim(op, "topk_ids.shape[0]", topk_ids.shape[0], T, "x.shape[0]")
    check_shape(op, "topk_weights", topk_weights, (T, K))
    if C < T:
        raise ValueError(f"{op}: send_x.shape[1]={C} < x.shape[0]={T}: a slot must hold every token")
    check_shape(op, "send_x", send_x, (N, C, H))
    check_dim(op, "send_x.dtype", send_x.dtype.name, x.dtype.name, "x.dtype")
    check_shape(op, "send_ids", send_ids, (N, C, K))
    check_shape(op, "send_weights", send_weights, (N, C, K))
    check_shape(op, "send_counts", send_counts, (N,))
    check_shape(op, "route", route, (T, N))
    ids, wts, xv = read_index(topk_ids), read(topk_weights), np.array(x.numpy(), copy=True)
    owner = np.where((ids >= 0) & (ids < N * Er), ids // Er, -1)
    out_ids = np.full((N, C, K), -1, np.int64)
    out_w = np.zeros((N, C, K))
    rt = np.full((T, N), -1, np.int64)
    counts = np.zeros(N, np.int64)
    sx = send_x.numpy()
    for t in range(T):
        for p in range(N):
            ks = np.nonzero(owner[t] == p)[0]
            if ks.size == 0:
                continue
            j = counts[p]
            counts[p] += 1
            rt[t, p] = j
            sx[p, j] = xv[t]
            out_ids[p, j, ks] = ids[t, ks] - p * Er
            out_w[p, j, ks] = wts[t, ks]
    send_ids.numpy()[...] = out_ids.astype(np.int32)
    write(send_weights, out_w)
    send_counts.numpy()[...] = counts.astype(np.int32)
    route.numpy()[...] = rt.astype(np.int32)


def moe_combine(back=None, route=None, out=None, accumulate=None) -> None:
    """out[t] (+)= sum over p = 0..N-1 of back[p, route[t, p]] where route[t, p] >= 0."""
    op = "moe_combine"
    for name, t in (("back", back), ("route", route), ("out", out)):
        check_arg(op, name, t)
    N, C, H = back.shape
    T = out.shape[0]
    check_shape(op, "out", out, (T, H))
    check_shape(op, "route", route, (T, N))
    _disjoint(op, "back", back, "out", out)
    rt = read_index(route)
    if ((rt < -1) | (rt >= C)).any():
        raise ValueError(f"{op}: route entries must be -1 or a row in [0, C={C})")
    bv = read(back)
    y = read(out) if i32(accumulate, op, "accumulate") else np.zeros((T, H))
    for p in range(N):
        rows = np.nonzero(rt[:, p] >= 0)[0]
        y[rows] += bv[p, rt[rows, p]]
    write(out, y)
