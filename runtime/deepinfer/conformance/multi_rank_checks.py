"""L4's checks (multi_rank.py runs them, one process a rank): Ranks, what a check sees of this rank
and of every other one, and one function per check, each against what the reference makes of every
rank's inputs. The table CHECKS lists them in the order they run.
"""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import dtypes as D
from ..errors import BackendCallError
from ..reference import ReferenceBackend
from ..tensor import Tensor
from . import tolerances as TOL
from .cases import COMM_DTYPES, FLOATS, comm_values
from .compare import compare_close, compare_exact


# ====================================================================== what the checks share


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
