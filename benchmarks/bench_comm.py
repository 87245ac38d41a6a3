"""Collectives through a deepinfer backend (ABI 1.4), checked and then timed, beside NCCL's own
through torch.distributed in the same run.

    mpirun -n N python benchmarks/bench_comm.py [--backend cuda|cpu|reference|LIB.so] [--check]
        [--quick] [--no-torch] [--json OUT.json] [--md OUT.md]
    python benchmarks/bench_comm.py --spawn N ...     the same without mpirun: starts N ranks itself

Rank r binds its backend to device r (the local rank: OMPI_COMM_WORLD_LOCAL_RANK or LOCAL_RANK). The
ranks make one communicator (rank 0's comm_unique_id, handed to all over the control channel: MPI
under mpirun, torch's TCPStore under --spawn) and then:

  --check   correctness first, every rank on its own random data, each rank regenerating the others'
            (no data moves outside the library): all_reduce (f32, bf16, in place), all_gather,
            all_to_all whole and with counts, an expert-parallel round trip (moe_dispatch, all_to_all,
            the identity expert, all_to_all back, moe_combine) against the reference backend's
            dispatch, a graph captured with an all_reduce and a counted all_to_all and launched twice
            (devices with graphs), and counts out of range failing on every rank instead of hanging.
  timing    all_to_all with counts at MoE-dispatch sizes (7168-wide bf16 rows, 128..8192 rows per
            peer, every row sent) and all_reduce of [T, 7168] bf16 (T = 1..8192), each the median of
            batches of calls, the slowest rank's time. Beside them torch.distributed's
            all_to_all_single (with split sizes) and all_reduce on the same sizes: backend nccl on
            GPUs, gloo on CPU ranks (--no-torch skips it). Bandwidths as nccl-tests reports them:
            algbw = bytes per rank / time; busbw = algbw * (N-1)/N (all_to_all), 2(N-1)/N (all_reduce).
  --quick   small sizes (the CPU smoke test: mpirun -n 2 python benchmarks/bench_comm.py --backend cpu --quick)

Rank 0 prints a table and writes --json / --md. Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

RANK_ENVS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
SIZE_ENVS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_ENVS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK")
H = 7168   # DeepSeek V3's hidden size: the rows of MoE dispatch and the all_reduce of tensor parallelism


def _env_int(names, default):
    return next((int(os.environ[k]) for k in names if os.environ.get(k)), default)


# ------------------------------------------------------------------------------ the control channel
class Control:
    """How the ranks agree on small things (the comm id, timings, verdicts); never the data path.
    MPI's COMM_WORLD under mpirun; torch's TCPStore under --spawn (RANK, WORLD_SIZE, MASTER_*); alone
    otherwise."""

    def __init__(self):
        self.mpi = None
        self.store = None
        self._n = 0
        if any(os.environ.get(k) for k in SIZE_ENVS):
            from mpi4py import MPI   # first: a CPU library finds its libmpi already loaded

            self.mpi = MPI.COMM_WORLD
            self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        elif os.environ.get("WORLD_SIZE"):
            import torch.distributed as tdist

            self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            self.store = tdist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                                        self.size, self.rank == 0, timeout=__import__("datetime").timedelta(seconds=300))
        else:
            self.rank, self.size = 0, 1
        self.local_rank = _env_int(LOCAL_ENVS, self.rank)

    def allgather(self, obj) -> list:
        if self.mpi is not None:
            return self.mpi.allgather(obj)
        if self.store is None:
            return [obj]
        self._n += 1
        self.store.set(f"ag{self._n}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"ag{self._n}/{r}")) for r in range(self.size)]

    def bcast(self, obj, root: int = 0):
        if self.mpi is not None:
            return self.mpi.bcast(obj, root=root)
        return self.allgather(obj if self.rank == root else None)[root]

    def barrier(self) -> None:
        self.allgather(None)

    def abort(self, code: int) -> None:
        if self.mpi is not None:
            self.mpi.Abort(code)
        os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(n: int, argv: list) -> int:
    """Run this script as n ranks without mpirun (rank r: env RANK=r, LOCAL_RANK=r)."""
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        env.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast stays off
        procs.append(subprocess.Popen([sys.executable, __file__] + argv, env=env))
    rc = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code != 0:   # a rank failed: its peers would wait for it forever
                    rc = rc or code
                    for q in procs:
                        q.kill()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for q in procs:
            q.kill()
        rc = 130
    return rc


# ------------------------------------------------------------------------------ the backend
def open_backend(spec: str, device_id: int, threads: int):
    """The backend, rank r on device r; a CPU library has one device, shared by its ranks."""
    import deepinfer

    if spec == "cpu" or Path(spec).name == "libdeepinfer_cpu.so":
        device_id = 0
    if spec == "reference":
        return deepinfer.get_backend("reference")
    if os.sep in spec or spec.endswith(".so"):
        return deepinfer.loader.load_library(spec, device_id=device_id, num_threads=threads)
    return deepinfer.get_backend(spec, device_id=device_id, num_threads=threads)


class Ranks:
    """This rank's backend and communicator, and helpers over both."""

    def __init__(self, ctl: Control, be):
        self.ctl, self.be = ctl, be
        self.N, self.rank = ctl.size, ctl.rank
        cid = ctl.bcast(be.comm_unique_id() if ctl.rank == 0 else None)
        self.comm = be.comm_create(cid, self.N, self.rank)

    def up(self, a: np.ndarray):
        t = self.be.empty(a.shape, _dtname(a.dtype))
        if a.size:
            self.be.write(t, np.ascontiguousarray(a))
        return t

    def down(self, t) -> np.ndarray:
        return self.be.to_numpy(t)


def _dtname(dt) -> str:
    import ml_dtypes

    return {np.dtype(np.float32): "f32", np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.int32): "int32",
            np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8"}[np.dtype(dt)]


# ------------------------------------------------------------------------------ checks
class Checks:
    def __init__(self, R: Ranks):
        self.R = R
        self.failures: list = []

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"rank {self.R.rank}: FAIL: {what}", flush=True)

    def data(self, rank: int, tag: str, shape, dtype):
        """Rank `rank`'s input `tag`: every rank can make every other rank's."""
        import ml_dtypes

        seed = (rank * 1_000_003 + sum(map(ord, tag)) * 7919 + len(shape)) % (2 ** 32)
        a = np.random.default_rng(seed).standard_normal(shape) * 8
        return a.astype({"f32": np.float32, "bf16": ml_dtypes.bfloat16, "int32": np.int32, "uint8": np.uint8,
                         "int8": np.int8}[dtype])

    def all_reduce(self) -> None:
        R = self.R
        for dtype in ("f32", "bf16"):
            for shape in [(5,), (3, 17), (2, 3, 64), (1 << 16,)]:
                tag = f"ar{dtype}{shape}"
                x = self.data(R.rank, tag, shape, dtype)
                want = sum(self.data(r, tag, shape, dtype).astype(np.float64) for r in range(R.N))
                out = R.be.empty(shape, dtype)
                R.be.call("all_reduce", comm=R.comm, x=R.up(x), out=out)
                got = R.down(out).astype(np.float64)
                rtol = 2 ** -7 if dtype == "bf16" else 1e-5
                bad = np.abs(got - want) > rtol * np.abs(want) + 1e-5 * float(np.abs(want).max())
                if bad.any():
                    self.fail(f"all_reduce {dtype} {shape}: {int(bad.sum())} of {bad.size} differ")
                xin = R.up(x)
                R.be.call("all_reduce", comm=R.comm, x=xin, out=xin)
                if not np.array_equal(R.down(xin).astype(np.float64), got):
                    self.fail(f"all_reduce {dtype} {shape} in place differs from out of place")
                everyone = R.ctl.allgather(got.tobytes())
                if any(b != everyone[0] for b in everyone):
                    self.fail(f"all_reduce {dtype} {shape}: the ranks got different sums")

    def all_gather(self) -> None:
        R = self.R
        for dtype in ("f32", "bf16", "int32", "uint8"):
            for shape in [(4,), (3, 5), (2, 2, 33)]:
                tag = f"ag{dtype}{shape}"
                out = R.be.empty((R.N,) + shape, dtype)
                R.be.call("all_gather", comm=R.comm, x=R.up(self.data(R.rank, tag, shape, dtype)), out=out)
                want = np.stack([self.data(r, tag, shape, dtype) for r in range(R.N)])
                if R.down(out).tobytes() != want.tobytes():
                    self.fail(f"all_gather {dtype} {shape}")

    def counts_of(self, rank: int, C: int, tag: str) -> np.ndarray:
        c = np.random.default_rng(rank * 31 + len(tag)).integers(0, C + 1, self.R.N).astype(np.int32)
        if C and self.R.N > 1:
            c[0], c[-1] = 0, C   # the edges: nothing and everything
        return c

    def all_to_all(self) -> None:
        R = self.R
        for dtype in ("f32", "bf16", "int8"):
            for C, row in [(1, (4,)), (6, (3, 2)), (0, (5,)), (9, ())]:
                tag = f"a2a{dtype}{C}{row}"
                shape = (R.N, C) + row
                for counted in (False, True):
                    recv = R.be.empty(shape, dtype, fill=0)
                    kw = {}
                    if counted:
                        kw = dict(send_counts=R.up(self.counts_of(R.rank, C, tag)), recv_counts=R.be.empty((R.N,), "int32"))
                    R.be.call("all_to_all", comm=R.comm, send=R.up(self.data(R.rank, tag, shape, dtype)), recv=recv, **kw)
                    got = R.down(recv)
                    rc = R.down(kw["recv_counts"]) if counted else None
                    for q in range(R.N):
                        n = int(self.counts_of(q, C, tag)[R.rank]) if counted else C
                        if counted and int(rc[q]) != n:
                            self.fail(f"all_to_all {dtype} C={C}: recv_counts[{q}]={int(rc[q])}, want {n}")
                        want = self.data(q, tag, shape, dtype)[R.rank, :n]
                        if got[q, :n].tobytes() != want.tobytes():
                            self.fail(f"all_to_all {dtype} C={C} row={row} counted={counted}: slot {q}")

    def ep_round_trip(self) -> None:
        """moe_dispatch -> all_to_all -> the identity expert -> all_to_all back -> moe_combine: every
        token comes back times the number of ranks that own one of its experts; the dispatch itself
        against the reference backend's."""
        from deepinfer.reference import ReferenceBackend
        from deepinfer.tensor import Tensor

        R = self.R
        N, Er, K, T, Hs = R.N, 4, 4, 37, 96
        rng = np.random.default_rng(500 + R.rank)
        ids = rng.integers(0, N * Er, size=(T, K)).astype(np.int32)
        ids[rng.random((T, K)) < 0.1] = -1
        wts = rng.random((T, K)).astype(np.float32)
        x = self.data(R.rank, "ep", (T, Hs), "bf16")
        C = T
        sx, sids, swts = R.be.empty((N, C, Hs), "bf16"), R.be.empty((N, C, K), "int32"), R.be.empty((N, C, K), "f32")
        cnt, route = R.be.empty((N,), "int32"), R.be.empty((T, N), "int32")
        R.be.call("moe_dispatch", x=R.up(x), topk_ids=R.up(ids), topk_weights=R.up(wts), send_x=sx, send_ids=sids,
                  send_weights=swts, send_counts=cnt, route=route, experts_per_rank=Er)
        ref = {k: Tensor.empty(s, d) for k, s, d in (("send_x", (N, C, Hs), "bf16"), ("send_ids", (N, C, K), "int32"),
                                                     ("send_weights", (N, C, K), "f32"), ("send_counts", (N,), "int32"),
                                                     ("route", (T, N), "int32"))}
        ReferenceBackend().call("moe_dispatch", x=Tensor.from_numpy(x), topk_ids=Tensor.from_numpy(ids),
                                topk_weights=Tensor.from_numpy(wts), experts_per_rank=Er, **ref)
        ref = {k: np.array(v.numpy()) for k, v in ref.items()}
        got_counts = R.down(cnt)
        for name, t in (("send_counts", cnt), ("route", route), ("send_ids", sids), ("send_weights", swts)):
            if not np.array_equal(R.down(t), ref[name]):
                self.fail(f"moe_dispatch: {name} differs from the reference")
        gx = R.down(sx)
        for p in range(N):
            n = int(ref["send_counts"][p])
            if gx[p, :n].tobytes() != ref["send_x"][p, :n].tobytes():
                self.fail(f"moe_dispatch: send_x slot {p} differs from the reference")
        recv, rcnt = R.be.empty((N, C, Hs), "bf16"), R.be.empty((N,), "int32")
        R.be.call("all_to_all", comm=R.comm, send=sx, recv=recv, send_counts=cnt, recv_counts=rcnt)
        back, bcnt = R.be.empty((N, C, Hs), "bf16"), R.be.empty((N,), "int32")
        R.be.call("all_to_all", comm=R.comm, send=recv, recv=back, send_counts=rcnt, recv_counts=bcnt)
        if not np.array_equal(R.down(bcnt), got_counts):
            self.fail("ep round trip: the counts that came back differ from those sent")
        out = R.be.empty((T, Hs), "f32")
        R.be.call("moe_combine", back=back, route=route, out=out, accumulate=0)
        owners = np.array([len({int(e) // Er for e in ids[t] if 0 <= e < N * Er}) for t in range(T)], np.float64)
        want = x.astype(np.float64) * owners[:, None]
        if not np.allclose(R.down(out).astype(np.float64), want, rtol=1e-6, atol=1e-6):
            self.fail("ep round trip: moe_combine of the identity expert is not x times its owner ranks")

    def graph(self) -> None:
        """An all_reduce and a counted all_to_all captured once and launched twice (GPU backends)."""
        R = self.R
        be = R.be
        if not be.supports_graphs:
            return
        import ml_dtypes

        N, C, Hs = R.N, 4, 8
        x, out = be.empty((3, Hs), "f32", fill=0), be.empty((3, Hs), "f32", fill=0)
        send, recv = be.empty((N, C, Hs), "bf16", fill=0), be.empty((N, C, Hs), "bf16", fill=0)
        sc, rcnt = be.empty((N,), "int32", fill=0), be.empty((N,), "int32", fill=0)
        be.set_stream(be.create_stream())   # before prepare: a prepared call keeps its stream
        calls = [be.prepare("all_reduce", comm=R.comm, x=x, out=out),
                 be.prepare("all_to_all", comm=R.comm, send=send, recv=recv, send_counts=sc, recv_counts=rcnt)]
        g = be.capture(calls)
        base = np.arange(N * C * Hs).reshape(N, C, Hs)
        for it in range(2):
            be.write(x, np.full((3, Hs), R.rank + it, np.float32))
            be.write(send, (base + R.rank).astype(ml_dtypes.bfloat16))
            be.write(sc, ((np.arange(N) + R.rank + it) % (C + 1)).astype(np.int32))
            g.launch()
            be.synchronize()
            want = sum(r + it for r in range(N))
            if not (R.down(out) == want).all():
                self.fail(f"graph launch {it}: all_reduce gave {R.down(out)[0, :3]}, want {want}")
            want_counts = [(R.rank + q + it) % (C + 1) for q in range(N)]
            if R.down(rcnt).tolist() != want_counts:
                self.fail(f"graph launch {it}: recv_counts {R.down(rcnt).tolist()} != {want_counts}")
            r = R.down(recv).astype(np.float32)
            for q in range(N):
                n = want_counts[q]
                w = (base[R.rank, :n] + q).astype(ml_dtypes.bfloat16).astype(np.float32)
                if not np.array_equal(r[q, :n], w):
                    self.fail(f"graph launch {it}: slot {q} of recv")
        g.close()
        be.set_stream(None)

    def bad_counts(self) -> None:
        """Counts out of range on rank 0: an error on rank 0 and on the rank they were for (N-1; a
        library may fail the others too), and no rank hangs. Host libraries only: a device library's
        counts stay in device memory (it moves whole slots and never reads them on the host), and
        the reference's bad rank raises before the exchange and leaves its peers waiting."""
        from deepinfer.errors import BackendCallError

        R = self.R
        if R.be.name == "reference" or R.be.device != "cpu":
            return
        C = 3
        counts = np.ones(R.N, np.int32)
        if R.rank == 0:
            counts[-1] = C + 1
        try:
            R.be.call("all_to_all", comm=R.comm, send=R.be.empty((R.N, C, 2), "f32", fill=0),
                      recv=R.be.empty((R.N, C, 2), "f32"), send_counts=R.up(counts), recv_counts=R.be.empty((R.N,), "int32"))
            if R.rank in (0, R.N - 1):   # rank 0 sent the bad count to rank N-1
                self.fail("all_to_all with rank 0's send_counts out of range did not fail here")
        except BackendCallError as e:
            if R.rank == 0 and "send_counts" not in str(e):
                self.fail(f"all_to_all bad counts: the message does not name send_counts: {e}")
        R.ctl.barrier()

    def run(self) -> list:
        for name in ("all_reduce", "all_gather", "all_to_all", "ep_round_trip", "graph", "bad_counts"):
            try:
                getattr(self, name)()
            except Exception as e:   # one failing check must not leave the peers waiting in the next
                self.fail(f"{name}: {type(e).__name__}: {e}")
                traceback.print_exc()
                self.R.ctl.abort(2)
        return self.failures


# ------------------------------------------------------------------------------ timing
def median_time(call, sync, ctl: Control, iters: int, warm: int = 2, batches: int = 5) -> float:
    """Seconds per call: the median over batches of `iters` calls, the slowest rank's."""
    for _ in range(warm):
        call()
    sync()
    ts = []
    for _ in range(batches):
        ctl.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        ts.append((time.perf_counter() - t0) / iters)
    return max(ctl.allgather(statistics.median(ts)))


class TorchPeer:
    """torch.distributed on the same ranks: NCCL's own collectives (gloo on CPU ranks)."""

    def __init__(self, ctl: Control, gpu: bool):
        import datetime

        import torch
        import torch.distributed as tdist

        self.torch, self.tdist, self.gpu = torch, tdist, gpu
        if gpu:
            torch.cuda.set_device(ctl.local_rank)
        port = ctl.bcast(free_port() if ctl.rank == 0 else None)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        tdist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{addr}:{port}", rank=ctl.rank,
                                 world_size=ctl.size, timeout=datetime.timedelta(seconds=300))
        self.dev = torch.device("cuda", ctl.local_rank) if gpu else torch.device("cpu")

    def sync(self):
        if self.gpu:
            self.torch.cuda.synchronize()

    def all_to_all(self, N: int, rows: int, width: int):
        t = self.torch
        inp = t.randn(N * rows, width, device=self.dev).to(t.bfloat16)
        out = t.empty_like(inp)
        splits = [rows] * N
        return lambda: self.tdist.all_to_all_single(out, inp, splits, splits)

    def all_reduce(self, tokens: int, width: int):
        t = self.torch
        x = t.randn(tokens, width, device=self.dev).to(t.bfloat16)
        return lambda: self.tdist.all_reduce(x)

    def close(self):
        self.tdist.destroy_process_group()


def peer_time(peer, make, ctl: Control, iters: int):
    """torch's time for the call `make` builds, or None where torch cannot run it (gloo lacks some
    dtypes: every rank refuses alike, before any communication)."""
    try:
        return median_time(make(), peer.sync, ctl, iters)
    except Exception as e:
        if ctl.rank == 0:
            print(f"  (torch: {type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
        return None


def bench(R: Ranks, args, peer) -> list:
    be, ctl, N = R.be, R.ctl, R.N
    width = 256 if args.quick else H
    a2a_rows = (4, 16, 64) if args.quick else (128, 256, 512, 1024, 2048, 4096, 8192)
    ar_tokens = (1, 16, 64) if args.quick else (1, 16, 128, 1024, 8192)
    rows_out = []
    sync = be.synchronize

    def row(op, size, nbytes, bus, ours, theirs):
        r = {"op": op, "size": size, "bytes_per_rank": nbytes, "ours_us": ours * 1e6,
             "ours_algbw_GBs": nbytes / ours / 1e9, "ours_busbw_GBs": nbytes / ours / 1e9 * bus}
        if theirs is not None:
            r.update(torch_us=theirs * 1e6, torch_busbw_GBs=nbytes / theirs / 1e9 * bus, ours_over_torch=theirs / ours)
        rows_out.append(r)
        if ctl.rank == 0:
            print(f"  {op:28s} {size:>14s}  ours {r['ours_us']:10.1f} us {r['ours_busbw_GBs']:8.2f} GB/s"
                  + (f"   torch {r['torch_us']:10.1f} us {r['torch_busbw_GBs']:8.2f} GB/s" if theirs else ""),
                  flush=True)

    import ml_dtypes

    for rows in a2a_rows:
        shape = (N, rows, width)
        send = be.empty(shape, "bf16", fill=0.5)
        recv = be.empty(shape, "bf16")
        sc = R.up(np.full(N, rows, np.int32))
        rc = be.empty((N,), "int32")
        nbytes = N * rows * width * 2
        iters = max(2, min(50, int(2e9 // max(nbytes, 1)))) if not args.quick else 3
        for counted in (True, False):
            kw = dict(send_counts=sc, recv_counts=rc) if counted else {}
            call = be.prepare("all_to_all", comm=R.comm, send=send, recv=recv, **kw)
            ours = median_time(call, sync, ctl, iters)
            theirs = None
            if peer is not None and counted:
                theirs = peer_time(peer, lambda: peer.all_to_all(N, rows, width), ctl, iters)
            row("all_to_all" + (" counts" if counted else " whole slots"), f"{rows}x{width}", nbytes,
                (N - 1) / N if N > 1 else 1.0, ours, theirs)
        del send, recv
    for tokens in ar_tokens:
        x = R.up(np.full((tokens, width), 1.0, ml_dtypes.bfloat16))
        nbytes = tokens * width * 2
        iters = max(3, min(200, int(4e9 // max(nbytes, 1)))) if not args.quick else 5
        call = be.prepare("all_reduce", comm=R.comm, x=x, out=x)
        ours = median_time(call, sync, ctl, iters)
        theirs = peer_time(peer, lambda: peer.all_reduce(tokens, width), ctl, iters) if peer is not None else None
        row("all_reduce bf16", f"{tokens}x{width}", nbytes, 2 * (N - 1) / N if N > 1 else 1.0, ours, theirs)
    return rows_out


def markdown(meta: dict, rows: list) -> str:
    lines = [f"# bench_comm: {meta['ranks']} ranks, backend {meta['backend']} ({meta['device']})", "",
             " · ".join(x for x in (meta.get("gpu", ""), f"torch peer: {meta['torch_peer']}", meta["when"]) if x), "",
             "| op | size (rows x width, bf16) | bytes per rank | ours µs | ours busbw GB/s | torch µs | "
             "torch busbw GB/s | torch time / ours |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = (f"{r['torch_us']:.1f} | {r['torch_busbw_GBs']:.2f} | {r['ours_over_torch']:.2f}"
             if "torch_us" in r else "– | – | –")
        lines.append(f"| {r['op']} | {r['size']} | {r['bytes_per_rank']} | {r['ours_us']:.1f} | "
                     f"{r['ours_busbw_GBs']:.2f} | {t} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda", help="cuda, cpu, reference, or a library's path")
    ap.add_argument("--threads", type=int, default=1, help="num_threads of a CPU library")
    ap.add_argument("--check", action="store_true", help="check the collectives before timing them")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed's side")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--spawn", type=int, default=0, help="start this many ranks without mpirun")
    args = ap.parse_args()
    if args.spawn:
        argv, skip = [], False
        for a in sys.argv[1:]:
            if skip or a.startswith("--spawn="):
                skip = False
                continue
            if a == "--spawn":
                skip = True
                continue
            argv.append(a)
        return spawn(args.spawn, argv)

    ctl = Control()
    try:
        be = open_backend(args.backend, ctl.local_rank, args.threads)
        R = Ranks(ctl, be)
    except Exception:
        traceback.print_exc()
        ctl.abort(2)
        return 2
    gpu = be.device != "cpu"
    if ctl.rank == 0:
        print(f"bench_comm: {ctl.size} rank(s), backend {be.name} at {be.info.path or '(built in)'}, device "
              f"{be.device}; rank r on device r", flush=True)
    failed = 0
    if args.check or args.check_only:
        fails = Checks(R).run()
        failed = sum(ctl.allgather(len(fails)))
        if ctl.rank == 0:
            print(f"checks: {'all passed' if not failed else f'{failed} failure(s) in the job'}", flush=True)
        if args.check_only:
            return 1 if failed else 0
    peer = None
    if not args.no_torch:
        try:
            peer = TorchPeer(ctl, gpu)
        except Exception as e:   # no torch, or no NCCL in it: our side alone
            if ctl.rank == 0:
                print(f"torch.distributed peer unavailable ({type(e).__name__}: {e}); timing ours alone", flush=True)
            peer = None
        ok = ctl.allgather(peer is not None)
        if not all(ok):
            peer = None
    rows = bench(R, args, peer)
    if peer is not None:
        peer.close()
    R.comm.close()
    if ctl.rank == 0:
        meta = {"ranks": ctl.size, "backend": be.name, "library": be.info.path, "device": be.device,
                "torch_peer": ("nccl" if gpu else "gloo") if peer is not None else "none",
                "quick": args.quick, "checks_failed": failed, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        if gpu:
            meta["gpu"] = be.info.attributes.get("device.name", "")
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if args.md:
            args.md.write_text(markdown(meta, rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
