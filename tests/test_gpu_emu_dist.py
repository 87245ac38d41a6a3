"""The GPU backend's expert-parallel kernels (backends/cuda/src/dist_kernels.cuh: moe_dispatch's
per-rank scan and row copy, moe_combine's sum in rank order) run on the CPU: tests/gpu_emu/test_dist_ops.cpp
compiles them against tests/gpu_emu/host_emu.h and launches them block by block as dist.cu does.
The first test is its self-check (strided views, every row-copy width, scans over several chunks);
the second feeds random cases through it and judges them against the reference backend
(backends/reference/dist.py). The collectives themselves are NCCL's and run only on a GPU
(backends/cuda/device.sh dist). Needs a C++17 compiler; skips without one."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from test_gpu_emu import _build, _cxx

DT_IDS = {"f32": 1, "bf16": 3}


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    return _build(cxx, "test_dist_ops.cpp", tmp_path_factory.mktemp("dist") / "dist_ops")


def test_dist_kernels_self_check(exe):
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "all checks passed" in run.stdout


def _np_dtype(name):
    import ml_dtypes

    return {"f32": np.float32, "bf16": ml_dtypes.bfloat16}[name]


def _run(exe, tmp_path, tag, header, arrays, out_specs):
    src, dst = tmp_path / f"{tag}.in", tmp_path / f"{tag}.out"
    src.write_bytes(np.array(header, np.int64).tobytes() + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    run = subprocess.run([str(exe), str(src), str(dst)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (tag, run.stderr[-3000:])
    raw, off, got = dst.read_bytes(), 0, []
    for dt, shape in out_specs:
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        got.append(np.frombuffer(raw[off:off + n], dt).reshape(shape))
        off += n
    assert off == len(raw)
    return got


def _dispatch_case(rng, T, H, K, N, Er, C, dt):
    E = N * Er
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    # some ids outside [0, E): no rank's
    ids[rng.random((T, K)) < 0.1] = -1
    ids[rng.random((T, K)) < 0.05] = E + 3
    wts = rng.random((T, K)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(_np_dtype(dt))
    return x, ids, wts


@pytest.mark.parametrize("T,H,K,N,Er,C,dt", [
    (1, 64, 8, 1, 16, 1, "bf16"),          # decode, one rank
    (7, 48, 4, 4, 8, 9, "f32"),
    (64, 128, 8, 8, 32, 64, "bf16"),       # V3-like top-8 over 8 ranks
    (300, 24, 6, 3, 5, 310, "bf16"),       # past 256 tokens: the 1024-thread scan
    (40, 33, 2, 2, 3, 40, "f32"),          # odd H: narrow copies
    (0, 16, 2, 2, 2, 3, "f32"),            # no tokens
])
def test_moe_dispatch_matches_the_reference(exe, tmp_path, T, H, K, N, Er, C, dt):
    from deepinfer.reference import ReferenceBackend
    from deepinfer.tensor import Tensor

    rng = np.random.default_rng(T * 1000 + H)
    x, ids, wts = _dispatch_case(rng, T, H, K, N, Er, C, dt)
    ref = ReferenceBackend()
    want = {"send_x": Tensor.empty((N, C, H), dt), "send_ids": Tensor.empty((N, C, K), "int32"),
            "send_weights": Tensor.empty((N, C, K), "f32"), "send_counts": Tensor.empty((N,), "int32"),
            "route": Tensor.empty((T, N), "int32")}
    ref.call("moe_dispatch", x=Tensor.from_numpy(x), topk_ids=Tensor.from_numpy(ids),
             topk_weights=Tensor.from_numpy(wts), experts_per_rank=Er, **want)
    want = {k: np.array(v.numpy()) for k, v in want.items()}
    npdt = _np_dtype(dt)
    got = _run(exe, tmp_path, "dispatch", [0, T, H, K, N, C, Er, DT_IDS[dt]], [x, ids, wts],
               [(npdt, (N, C, H)), (np.int32, (N, C, K)), (np.float32, (N, C, K)), (np.int32, (N,)),
                (np.int32, (T, N))])
    sx, sids, swts, counts, route = got
    np.testing.assert_array_equal(counts, want["send_counts"])
    np.testing.assert_array_equal(route, want["route"])
    np.testing.assert_array_equal(sids, want["send_ids"])         # -1 in every row past the count
    np.testing.assert_array_equal(swts, want["send_weights"])     # 0 there
    for p in range(N):                                            # send_x rows past the count: unspecified
        n = int(counts[p])
        np.testing.assert_array_equal(sx[p, :n].view(np.uint8), want["send_x"][p, :n].view(np.uint8))


@pytest.mark.parametrize("T,H,N,C,bdt,odt,acc", [
    (1, 64, 1, 1, "bf16", "bf16", 0),
    (9, 300, 4, 12, "bf16", "f32", 1),     # H past one block of threads
    (33, 40, 8, 33, "f32", "bf16", 1),
    (16, 7, 3, 20, "f32", "f32", 0),
])
def test_moe_combine_matches_the_reference(exe, tmp_path, T, H, N, C, bdt, odt, acc):
    from deepinfer.reference import ReferenceBackend
    from deepinfer.tensor import Tensor

    rng = np.random.default_rng(T * 100 + H)
    back = rng.standard_normal((N, C, H)).astype(_np_dtype(bdt))
    route = rng.integers(0, C, size=(T, N)).astype(np.int32)
    route[rng.random((T, N)) < 0.3] = -1
    out0 = rng.standard_normal((T, H)).astype(_np_dtype(odt))
    want = Tensor.from_numpy(out0.copy())
    ReferenceBackend().call("moe_combine", back=Tensor.from_numpy(back), route=Tensor.from_numpy(route), out=want,
                            accumulate=acc)
    (got,) = _run(exe, tmp_path, "combine", [1, N, C, H, T, DT_IDS[bdt], DT_IDS[odt], acc], [back, route, out0],
                  [(_np_dtype(odt), (T, H))])
    # the f32 sum in rank order, rounded once to out's dtype, against the reference's float64 sum
    g, w = got.astype(np.float64), np.array(want.numpy()).astype(np.float64)
    tol = 8e-3 if odt == "bf16" else 1e-5
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
