"""Collectives through a deepinfer backend (ABI 1.4), checked and then timed, beside NCCL's own
through torch.distributed in the same run.

    mpirun -n N python benchmarks/bench_comm.py [--backend cuda|cpu|reference|LIB.so] [--check]
        [--quick] [--no-torch] [--json OUT.json] [--md OUT.md]
    python benchmarks/bench_comm.py --spawn N ...     the same without mpirun: starts N ranks itself

Rank r binds its backend to device r (the local rank: OMPI_COMM_WORLD_LOCAL_RANK or LOCAL_RANK). The
ranks make one communicator (rank 0's comm_unique_id, handed to all over the control channel: MPI
under mpirun, torch's TCPStore under --spawn) and then:

  --check   correctness first: the checks of the conformance suite's multi-rank level
            (deepinfer/conformance/multi_rank.py, what `deepinfer conformance LIB --ranks N` runs),
            every rank on its own random data, regenerating the others' (no data moves outside the
            library), against the reference backend: all_reduce (f32, bf16, in place, the same bits on
            every rank), all_gather, all_to_all whole and with counts, an expert-parallel round trip
            (moe_dispatch, all_to_all, experts, all_to_all back, moe_combine), a graph captured with an
            all_reduce and a counted all_to_all and launched twice (libraries with graphs), and counts
            out of range failing instead of hanging (host libraries).
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
import datetime
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

from deepinfer.conformance import multi_rank as MR  # noqa: E402 (after the path above)
from deepinfer.parallel.launch import SIZE_ENVS  # noqa: E402

H = 7168   # DeepSeek V3's hidden size: the rows of MoE dispatch and the all_reduce of tensor parallelism


# ------------------------------------------------------------------------------ the control channel
class StoreChannel:
    """--spawn's control channel (the comm id, timings, verdicts; never the data path): torch's TCPStore
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Under mpirun it is multi_rank.MpiChannel."""

    def __init__(self):
        import torch.distributed as tdist

        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.store = tdist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                                    self.size, self.rank == 0, timeout=datetime.timedelta(seconds=300))
        self._n = 0

    def allgather(self, obj) -> list:
        self._n += 1
        self.store.set(f"ag{self._n}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"ag{self._n}/{r}")) for r in range(self.size)]

    def bcast(self, obj, root: int = 0):
        return self.allgather(obj if self.rank == root else None)[root]

    def barrier(self) -> None:
        self.allgather(None)

    def meet(self, timeout: float) -> bool:
        self._n += 1
        self.store.set(f"meet{self._n}/{self.rank}", b"")
        try:
            self.store.wait([f"meet{self._n}/{r}" for r in range(self.size)], datetime.timedelta(seconds=timeout))
        except Exception:   # torch's store timeout (its exception type differs between versions)
            return False
        return True

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        os._exit(code)   # spawn() stops the other ranks


def control():
    """MPI's COMM_WORLD under mpirun, torch's TCPStore under --spawn, one rank alone otherwise."""
    if any(os.environ.get(k) for k in SIZE_ENVS):
        return MR.MpiChannel()   # first: a CPU library finds its libmpi already loaded
    if os.environ.get("WORLD_SIZE"):
        return StoreChannel()
    return MR.LocalChannel()


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


# ------------------------------------------------------------------------------ timing
def median_time(call, sync, ctl, iters: int, warm: int = 2, batches: int = 5) -> float:
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

    def __init__(self, ctl, gpu: bool):
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


def peer_time(peer, make, ctl, iters: int):
    """torch's time for the call `make` builds, or None where torch cannot run it (gloo lacks some
    dtypes: every rank refuses alike, before any communication)."""
    try:
        return median_time(make(), peer.sync, ctl, iters)
    except Exception as e:
        if ctl.rank == 0:
            print(f"  (torch: {type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
        return None


def bench(R: MR.Ranks, args, peer) -> list:
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

    ctl = control()
    try:
        be = MR.open_backend(args.backend, ctl.local_rank, args.threads)
    except Exception:
        traceback.print_exc()
        ctl.abort(2)
        return 2
    R = MR.Ranks(ctl, be)
    gpu = be.device != "cpu"
    if ctl.rank == 0:
        print(f"bench_comm: {ctl.size} rank(s), backend {be.name} at {be.info.path or '(built in)'}, device "
              f"{be.device}; rank r on device r", flush=True)
    failed = 0
    if args.check or args.check_only:
        # the conformance suite's multi-rank checks; the communicator they make stays for the timings
        def report(res: dict) -> None:
            if ctl.rank == 0:
                print(MR.describe(res), flush=True)

        results = MR.run_checks(R, [c for c in MR.CHECKS if c.name != "comm_destroy"], on_result=report)
        failed = len(MR.failed(results))
        if ctl.rank == 0:
            print(f"checks: {'all passed' if not failed else f'{failed} check(s) failed'}", flush=True)
        if args.check_only or results[0]["status"] != "pass":   # no communicator: nothing to time
            return 1 if failed else 0
    if R.comm is None:
        try:
            R.connect()
        except Exception:
            traceback.print_exc()
            ctl.abort(2)
            return 2
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
