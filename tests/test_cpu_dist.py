"""The CPU library's ABI 1.4 ops (collectives and expert parallelism) against the reference backend.

Single process: moe_dispatch and moe_combine on random inputs over many shapes, and the three
collectives over a one-rank communicator (which needs no MPI), each compared with
backends/reference/dist.py; outputs are poisoned first, so an element the op forgets to write
fails. The argument checks answer with a message, never a crash.

Several processes: tests/dist_scripts/check_collectives.py under `mpirun -n 2` and `-n 4` runs the
collectives of the CPU library and of the reference on the same random data in every rank and
compares them (and the ranks' results with each other); a rank that dies must end the job, not
hang it. Those tests skip when mpirun or mpi4py is missing (pip install 'deepinfer[mpi]').
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import deepinfer
from deepinfer.errors import BackendCallError
from deepinfer.tensor import Tensor

NP = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "int32": np.int32, "uint8": np.uint8, "int8": np.int8,
      "f16": np.float16}
POISON_INT = -7777
SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "check_collectives.py"


@pytest.fixture(scope="module")
def be(cpu_backend):
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    if not all(b.has_op(op) for op in ("moe_dispatch", "moe_combine", "all_reduce")) or not b.supports_comm:
        pytest.skip("the CPU library predates ABI 1.4")
    yield b
    b.close()


@pytest.fixture(scope="module")
def ref():
    return deepinfer.get_backend("reference")


def t(a) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a))


def poisoned(backend, shape, dtype):
    return backend.empty(shape, dtype, fill=POISON_INT if dtype == "int32" else np.nan)


def close(got, want, dtype, what):
    """An f32 sum against the reference's f64 one, or bf16 results a rounding step apart at most."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in the result (an element left unwritten?)"
    rtol = 2 ** -7 if dtype == "bf16" else 1e-5
    scale = float(np.abs(want).max()) if want.size else 0.0
    bad = np.abs(got - want) > rtol * np.abs(want) + 1e-6 * scale
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} differ, e.g. got {got[bad][:4]} want {want[bad][:4]}"


# ------------------------------------------------------------------ moe_dispatch
def random_routing(rng, T, K, N, Er, holes=True):
    """top-k ids over N * Er experts, with -1 and out-of-range ids mixed in (skipped by dispatch)."""
    ids = rng.integers(0, N * Er, (T, K))
    if holes and T and K:
        mask = rng.random((T, K))
        ids[mask < 0.15] = -1
        ids[(mask >= 0.15) & (mask < 0.25)] = N * Er + rng.integers(0, 3)   # past the last expert
        ids[(mask >= 0.25) & (mask < 0.3)] = -(2 ** 31)
    return ids.astype(np.int32), rng.random((T, K)).astype(np.float32)


def dispatch(backend, x, ids, w, N, C, Er, dtype):
    T, H = x.shape
    K = ids.shape[1]
    outs = {"send_x": poisoned(backend, (N, C, H), dtype), "send_ids": poisoned(backend, (N, C, K), "int32"),
            "send_weights": poisoned(backend, (N, C, K), "f32"), "send_counts": poisoned(backend, (N,), "int32"),
            "route": poisoned(backend, (T, N), "int32")}
    backend.call("moe_dispatch", x=t(x.astype(NP[dtype])), topk_ids=t(ids), topk_weights=t(w),
                 experts_per_rank=Er, **outs)
    return {k: backend.to_numpy(v) for k, v in outs.items()}


DISPATCH_CASES = [  # T, H, K, N, Er, C - T
    (0, 8, 2, 2, 3, 2),
    (1, 16, 1, 1, 4, 0),
    (5, 8, 3, 3, 2, 1),
    (7, 32, 1, 4, 1, 0),
    (16, 64, 6, 4, 8, 5),
    (33, 24, 8, 2, 16, 0),
    (12, 8, 4, 1, 1, 3),
]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("T,H,K,N,Er,extra", DISPATCH_CASES)
def test_moe_dispatch_matches_reference(be, ref, T, H, K, N, Er, extra, dtype):
    rng = np.random.default_rng(T * 1000 + H + K + N + Er)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = random_routing(rng, T, K, N, Er)
    C = T + extra
    got, want = (dispatch(b, x, ids, w, N, C, Er, dtype) for b in (be, ref))
    for k in ("send_ids", "send_counts", "route"):
        assert np.array_equal(got[k], want[k]), f"{k}: {got[k]} != {want[k]}"
    assert np.array_equal(got["send_weights"], want["send_weights"])
    counts = want["send_counts"]
    for p in range(N):   # rows past the count are unspecified: only the first count rows are data
        n = int(counts[p])
        assert np.array_equal(got["send_x"][p, :n].astype(np.float32), want["send_x"][p, :n].astype(np.float32))
    # and the reference itself against the spec's plain reading: each row is its token's x row
    for tok in range(T):
        for p in range(N):
            j = want["route"][tok, p]
            if j >= 0:
                assert np.array_equal(got["send_x"][p, j].astype(np.float32), x[tok].astype(NP[dtype]).astype(np.float32))


def test_moe_dispatch_bad_arguments(be):
    rng = np.random.default_rng(1)
    T, H, K, N, Er = 4, 8, 2, 2, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = random_routing(rng, T, K, N, Er)

    def call(C=T, Er=Er, xdt="f32", sxdt="f32", route_shape=(T, N), ids_shape=(N, T, K)):
        be.call("moe_dispatch", x=t(x.astype(NP[xdt])), topk_ids=t(ids), topk_weights=t(w),
                send_x=be.empty((N, C, H), sxdt), send_ids=be.empty(ids_shape if C == T else (N, C, K), "int32"),
                send_weights=be.empty((N, C, K), "f32"), send_counts=be.empty((N,), "int32"),
                route=be.empty(route_shape, "int32"), experts_per_rank=Er)

    for kw, msg in [({"C": T - 1}, "a slot must hold every token"), ({"Er": 0}, "experts_per_rank=0"),
                    ({"sxdt": "bf16"}, "send_x.dtype"), ({"route_shape": (T, N + 1)}, r"route.shape\[1\]=3, expected 2"),
                    ({"ids_shape": (N, T, K + 1)}, r"send_ids.shape\[2\]=3, expected 2")]:
        with pytest.raises(BackendCallError, match=msg):
            call(**kw)


# ------------------------------------------------------------------ moe_combine
COMBINE_CASES = [  # T, H, N, C
    (0, 8, 2, 3),
    (1, 16, 1, 1),
    (6, 8, 3, 6),
    (9, 40, 4, 12),
    (20, 128, 2, 25),
]


def combine(backend, back, route, out0, accumulate, bdt, odt):
    out = backend.empty(out0.shape, odt)
    backend.write(out, out0.astype(NP[odt]))
    backend.call("moe_combine", back=t(back.astype(NP[bdt])), route=t(route), out=out, accumulate=accumulate)
    return backend.to_numpy(out)


@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("bdt,odt", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32"), ("f32", "bf16")])
@pytest.mark.parametrize("T,H,N,C", COMBINE_CASES)
def test_moe_combine_matches_reference(be, ref, T, H, N, C, bdt, odt, accumulate):
    rng = np.random.default_rng(T * 100 + H + N + C + accumulate)
    back = rng.standard_normal((N, C, H)).astype(np.float32)
    route = rng.integers(-1, C, (T, N)).astype(np.int32)
    # accumulate: add into the values there; otherwise NaN there, which must be overwritten
    out0 = rng.standard_normal((T, H)).astype(np.float32) if accumulate else np.full((T, H), np.nan, np.float32)
    got, want = (combine(b, back, route, out0, accumulate, bdt, odt) for b in (be, ref))
    close(got, want, odt, f"moe_combine {bdt}->{odt} acc={accumulate}")


def test_dispatch_then_combine_round_trip(be):
    """Every expert returns its token's row times the weights of its k's: the combine is sum_k w_k x."""
    rng = np.random.default_rng(3)
    T, H, K, N, Er = 10, 16, 3, 3, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = random_routing(rng, T, K, N, Er)
    d = dispatch(be, x, ids, w, N, T, Er, "f32")
    back = d["send_x"] * d["send_weights"].sum(-1, keepdims=True)   # rows past the count: weights 0
    back = np.where(np.isnan(back), 0, back).astype(np.float32)
    out = combine(be, back, d["route"], np.zeros((T, H), np.float32), 0, "f32", "f32")
    valid = (ids >= 0) & (ids < N * Er)
    want = x * np.where(valid, w, 0).sum(-1, keepdims=True)
    close(out, want, "f32", "round trip")


def test_moe_combine_bad_route(be):
    back = be.empty((2, 3, 4), "f32", fill=0)
    out = be.empty((2, 4), "f32")
    for bad in (3, -2):
        with pytest.raises(BackendCallError, match=r"route\[1, 0\]=.* must be -1 or a row in \[0, C=3\)"):
            be.call("moe_combine", back=back, route=t(np.array([[0, 1], [bad, 0]], np.int32)), out=out, accumulate=0)
    with pytest.raises(BackendCallError, match="out.shape"):
        be.call("moe_combine", back=back, route=t(np.zeros((2, 2), np.int32)), out=be.empty((2, 5), "f32"))
    with pytest.raises(BackendCallError, match="route.shape"):
        be.call("moe_combine", back=back, route=t(np.zeros((2, 3), np.int32)), out=out)


# ------------------------------------------------------------------ a communicator of one rank
@pytest.fixture(scope="module")
def comms(be, ref):
    c = be.comm_create(be.comm_unique_id(), 1, 0)
    r = ref.comm_create(ref.comm_unique_id(), 1, 0)
    yield c, r
    c.close()
    r.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (0, 4)])
def test_one_rank_all_reduce(be, ref, comms, shape, dtype):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(NP[dtype])
    res = []
    for b, c in zip((be, ref), comms):
        out = poisoned(b, shape, dtype)
        b.call("all_reduce", comm=c, x=t(x), out=out)
        res.append(b.to_numpy(out))
    assert np.array_equal(res[0].astype(np.float32), res[1].astype(np.float32))
    xin = t(x.copy())       # in place: out is x
    be.call("all_reduce", comm=comms[0], x=xin, out=xin)
    assert np.array_equal(be.to_numpy(xin).astype(np.float32), x.astype(np.float32))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int32", "uint8"])
def test_one_rank_all_gather(be, ref, comms, dtype):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 4)) * 50).astype(NP[dtype])
    res = []
    for b, c in zip((be, ref), comms):
        out = poisoned(b, (1, 3, 4), dtype) if dtype != "uint8" else b.empty((1, 3, 4), dtype, fill=7)
        b.call("all_gather", comm=c, x=t(x), out=out)
        res.append(b.to_numpy(out))
    assert np.array_equal(res[0].view(np.uint8), res[1].view(np.uint8))
    assert np.array_equal(res[0][0].view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("counts", [None, 0, 2, 5])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
def test_one_rank_all_to_all(be, ref, comms, counts, dtype):
    rng = np.random.default_rng(6)
    C = 5
    send = (rng.standard_normal((1, C, 3, 2)) * 20).astype(NP[dtype])
    res = []
    for b, c in zip((be, ref), comms):
        recv = b.empty(send.shape, dtype, fill=0)
        kw = {}
        if counts is not None:
            kw = {"send_counts": t(np.array([counts], np.int32)), "recv_counts": b.empty((1,), "int32", fill=POISON_INT)}
        b.call("all_to_all", comm=c, send=t(send), recv=recv, **kw)
        res.append((b.to_numpy(recv), b.to_numpy(kw["recv_counts"]) if kw else None))
    n = C if counts is None else counts
    assert np.array_equal(res[0][0][:, :n].view(np.uint8), res[1][0][:, :n].view(np.uint8))
    assert np.array_equal(res[0][0][:, :n].view(np.uint8), send[:, :n].view(np.uint8))
    if counts is not None:
        assert res[0][1].tolist() == res[1][1].tolist() == [counts]


def test_one_rank_collectives_in_a_graph(be, comms):
    """Collectives are ordinary nodes of a CPU graph: the replay reads the buffers (and counts) anew."""
    comm = comms[0]
    x, out = be.empty((4, 8), "f32", fill=1.5), be.empty((4, 8), "f32", fill=np.nan)
    send, recv = be.empty((1, 6, 8), "bf16", fill=2.0), be.empty((1, 6, 8), "bf16", fill=0)
    sc, rc = t(np.array([3], np.int32)), be.empty((1,), "int32", fill=POISON_INT)
    be.set_stream(be.create_stream())   # before prepare: a prepared call keeps its stream
    try:
        calls = [be.prepare("all_reduce", comm=comm, x=x, out=out),
                 be.prepare("all_to_all", comm=comm, send=send, recv=recv, send_counts=sc, recv_counts=rc)]
        g = be.capture(calls)
        assert np.isnan(be.to_numpy(out)).all(), "a captured op must not run before the launch"
        g.launch()
        assert (be.to_numpy(out) == 1.5).all() and be.to_numpy(rc).tolist() == [3]
        assert (be.to_numpy(recv)[0, :3] == 2.0).all() and (be.to_numpy(recv)[0, 3:] == 0).all()
        be.write(x, np.full((4, 8), -4.0, np.float32))
        sc.numpy()[0] = 6
        g.launch()
        assert (be.to_numpy(out) == -4.0).all() and be.to_numpy(rc).tolist() == [6]
        assert (be.to_numpy(recv)[0] == 2.0).all()
        g.close()
    finally:
        be.set_stream(None)


def test_collectives_bad_arguments(be, ref, comms):
    comm = comms[0]
    f = lambda *s: be.empty(s, "f32", fill=0)   # noqa: E731
    cases = [
        ("all_reduce", dict(x=f(3), out=f(4)), r"out.shape\[0\]=4"),
        ("all_reduce", dict(x=f(3), out=be.empty((3,), "bf16")), "out.dtype=bf16 != x.dtype=f32"),
        ("all_reduce", dict(x=f(3)), "out"),
        ("all_gather", dict(x=f(3), out=f(2, 3)), r"out.shape\[0\]=2, expected 1"),
        ("all_gather", dict(x=f(3), out=f(3)), "out.ndim=1"),
        ("all_gather", dict(x=f(3), out=f(1, 4)), r"out.shape\[1\]=4, expected 3"),
        ("all_gather", dict(x=f(3), out=f(1, 3, 1)), r"out.ndim=3, expected x.ndim \+ 1 = 2"),
        ("all_to_all", dict(send=f(2, 3), recv=f(2, 3)), r"send.shape\[0\]=2, expected 1 \(the communicator's ranks\)"),
        ("all_to_all", dict(send=f(1, 3), recv=f(1, 4)), r"recv.shape\[1\]=4"),
        ("all_to_all", dict(send=f(1, 3), recv=f(1, 3), send_counts=t(np.array([1], np.int32))), "go together"),
        ("all_to_all", dict(send=f(1, 3), recv=f(1, 3), send_counts=t(np.array([4], np.int32)),
                            recv_counts=be.empty((1,), "int32")), r"send_counts\[0\]=4 must lie in \[0, C=3\]"),
        ("all_to_all", dict(send=f(1, 3), recv=f(1, 3), send_counts=t(np.array([-1], np.int32)),
                            recv_counts=be.empty((1,), "int32")), r"send_counts\[0\]=-1"),
        ("all_to_all", dict(send=f(1, 3), recv=f(1, 3), send_counts=t(np.array([1, 1], np.int32)),
                            recv_counts=be.empty((2,), "int32")), r"send_counts.shape\[0\]=2, expected 1"),
    ]
    for op, kw, msg in cases:
        with pytest.raises((BackendCallError, ValueError, TypeError), match=msg):
            be.call(op, comm=comm, **kw)
    # a view that is not contiguous cannot travel as one run of bytes
    wide = f(1, 3, 8)
    with pytest.raises(BackendCallError, match="send must be contiguous"):
        be.call("all_to_all", comm=comm, send=wide.narrow(-1, 0, 4), recv=f(1, 3, 4))
    # out partly overlapping x: neither in place nor apart
    buf = f(8)
    with pytest.raises(BackendCallError, match="overlaps"):
        be.call("all_reduce", comm=comm, x=buf.narrow(0, 0, 6), out=buf.narrow(0, 2, 6))
    # no communicator, a destroyed one, another backend's
    with pytest.raises(BackendCallError, match="comm is NULL"):
        be.call("all_reduce", x=f(3), out=f(3))
    gone = be.comm_create(be.comm_unique_id(), 1, 0)
    gone.close()
    with pytest.raises(ValueError, match="comm was destroyed"):
        be.call("all_reduce", comm=gone, x=f(3), out=f(3))
    with pytest.raises(ValueError, match="comm belongs to"):
        be.call("all_reduce", comm=comms[1], x=f(3), out=f(3))


def test_comm_create_bad_arguments(be):
    cid = be.comm_unique_id()
    assert len(cid) == 128 and cid.startswith(b"deepinfer-cpu-mpi-comm\0") and cid != be.comm_unique_id()
    assert cid[23 + 16:] == bytes(128 - 39)
    for (n, r), msg in [((0, 0), "nranks=0 must be >= 1"), ((2, 2), r"rank=2 is outside \[0, nranks=2\)"),
                        ((1, -1), "rank=-1")]:
        with pytest.raises(BackendCallError, match=msg):
            be.comm_create(cid, n, r)
    with pytest.raises(BackendCallError, match="not made by this library's comm_unique_id"):
        be.comm_create(deepinfer.get_backend("reference").comm_unique_id(), 1, 0)


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=120)


CHILD_TWO_RANKS = """
import sys, deepinfer
be = deepinfer.loader.load_library(sys.argv[1] if len(sys.argv) > 1 else {path!r})
try:
    be.comm_create(be.comm_unique_id(), 2, 0)
except Exception as e:
    print("ERROR:", e)
else:
    print("created")
"""


def test_two_ranks_outside_mpirun_is_a_clear_error(be):
    """Without mpirun (and whether or not Open MPI can be found) a 2-rank communicator is refused
    with a message that says what to do; the process neither crashes nor hangs. Run in a child: it
    may initialize MPI."""
    r = _child(CHILD_TWO_RANKS.format(path=be.info.path), {})
    assert r.returncode == 0 and "ERROR:" in r.stdout, r.stdout + r.stderr
    assert ("start 2 processes with mpirun" in r.stdout or "pip install 'deepinfer[mpi]'" in r.stdout), r.stdout


def test_mpi_that_is_not_open_mpi_is_refused(be):
    """DEEPINFER_MPI_LIB naming a library without Open MPI's symbols: UNIMPLEMENTED, saying so."""
    r = _child(CHILD_TWO_RANKS.format(path=be.info.path), {"DEEPINFER_MPI_LIB": "libm.so.6"})
    assert r.returncode == 0 and "ERROR:" in r.stdout, r.stdout + r.stderr
    if "start 2 processes" not in r.stdout:   # a libmpi already loaded by NOLOAD would win; here none is
        assert "is not Open MPI" in r.stdout and "pip install 'deepinfer[mpi]'" in r.stdout, r.stdout


# ------------------------------------------------------------------ several ranks under mpirun
def _mpirun_or_skip():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed (pip install 'deepinfer[mpi]')")
    from deepinfer.errors import ConfigError
    from deepinfer.parallel.launch import find_mpirun, mpirun_argv, mpirun_env
    try:
        find_mpirun()
    except ConfigError as e:
        pytest.skip(str(e))
    return mpirun_argv, mpirun_env


def _run_ranks(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    mpirun_argv, mpirun_env = _mpirun_or_skip()
    cmd = mpirun_argv(n, [sys.executable, str(SCRIPT), *args])
    try:
        return subprocess.run(cmd, env=mpirun_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the {n}-rank job ran past {timeout} s (a hang?):\n{e.stdout}\n{e.stderr}")


@pytest.mark.parametrize("n", [2, 3, 4])   # 3: Open MPI's reductions for a non-power of two
def test_collectives_under_mpirun(be, n):
    r = _run_ranks(n, "--lib", be.info.path)
    assert r.returncode == 0, f"{n}-rank check failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert r.stdout.count("collectives OK") == n, r.stdout + r.stderr


def test_a_dead_rank_ends_the_job(be):
    """Rank 1 exits before a collective: mpirun must stop the others (non-zero exit), not let them
    wait in the all_reduce forever."""
    r = _run_ranks(2, "--lib", be.info.path, "--die-rank", "1", timeout=120)
    assert r.returncode != 0, f"the job exited 0 though rank 1 died:\n{r.stdout}\n{r.stderr}"
    assert "collectives OK" not in r.stdout
