"""The GPU backend's ABI 1.3 kernels (backends/cuda/src/hyper.cuh, norm.cuh, sparse.cuh: hc_pre, hc_post, layernorm,
kv_compress, indexer_topk's scores and top-k selection, sparse_attention and the cleaning of
`indices`) run on the CPU: tests/gpu_emu/test_v4_ops.cpp compiles them against tests/gpu_emu/host_emu.h
(one emulated thread block at a time), launches them block by block as hyper.cu, norm.cu and sparse.cu do and compares
them with serial float64 transcriptions of abi/README.md section 8. It is where those kernels run
without a GPU (the HIP build shares them); the device run (backends/cuda/device.sh v4) checks them
against the reference backend. Needs a C++17 compiler; skips without one."""
from __future__ import annotations

import subprocess

import pytest

from test_gpu_emu import _build, _cxx


def test_v4_kernels_on_the_cpu(tmp_path):
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = _build(cxx, "test_v4_ops.cpp", tmp_path / "v4_ops")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "all checks passed" in run.stdout


# the order of each op's scalars in tests/gpu_emu/test_v4_cases.cpp's input
V4_CASE_OPS = {"hc_pre": ("eps", "hc_eps", "sinkhorn_iters"), "hc_post": (), "kv_compress": ("ratio", "overlap"),
               "indexer_topk": ("scale", "ratio", "block_size"), "sparse_attention": ("scale", "window", "ratio"),
               "layernorm": ("eps",)}


def _write_v4_case(path, case):
    """The case's tensors in the op table's field order (contiguous; outputs poisoned), then its
    scalars; returns (name, dtype, shape) of every present tensor, the order they come back in."""
    import ml_dtypes
    import numpy as np
    from deepinfer import abi

    dts = {"f32": (1, np.float32), "bf16": (3, ml_dtypes.bfloat16), "int32": (12, np.int32)}
    args = abi.OP_SPECS[case.op].args
    parts = [np.array([list(V4_CASE_OPS).index(case.op), len(args)], np.int32).tobytes()]
    layout = []
    for a in args:
        t = case.tensors.get(a.name)
        if t is None:
            parts.append(np.int32(0).tobytes())
            continue
        code, npt = dts[t.dtype]
        if t.values is None:
            arr = np.full(t.shape, 0x7F7F7F7F, np.int32) if t.dtype == "int32" else np.full(t.shape, np.nan, npt)
        else:
            arr = np.ascontiguousarray(np.asarray(t.values).astype(npt))
        parts += [np.array([1, code, len(t.shape)], np.int32).tobytes(), np.array(t.shape, np.int64).tobytes(),
                  np.int64(arr.nbytes).tobytes(), arr.tobytes()]
        layout.append((a.name, arr.dtype, tuple(t.shape)))
    scalars = [float(case.scalars[k]) for k in V4_CASE_OPS[case.op]]
    parts += [np.int32(len(scalars)).tobytes(), np.array(scalars, np.float64).tobytes()]
    path.write_bytes(b"".join(parts))
    return layout


@pytest.mark.slow
def test_v4_kernels_against_the_reference_on_conformance_cases(tmp_path):
    """Every default-profile conformance case of the six 1.3 ops through the emulated kernels (the
    launches of sparse.cu, with more splits than a GPU would get for these sizes so the merges run),
    judged against the reference backend as the conformance suite judges a device library."""
    import numpy as np
    from deepinfer.conformance import cases as C
    from deepinfer.conformance import tolerances as TOL
    from deepinfer.conformance.harness import ReferenceCache, _cmp_indexer, compare_close
    from deepinfer.reference import ReferenceBackend

    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = _build(cxx, "test_v4_cases.cpp", tmp_path / "v4_cases")
    ref = ReferenceCache(ReferenceBackend())
    failures, ran = [], 0
    for op in V4_CASE_OPS:
        for i, case in enumerate(C.cases_for(op, "default", 0)):
            want, err = ref.outcome(case)
            if err is not None:
                assert case.expect != "OK", (case.name, err)
                continue
            src, dst = tmp_path / f"{op}{i}.in", tmp_path / f"{op}{i}.out"
            layout = _write_v4_case(src, case)
            run = subprocess.run([str(exe), str(src), str(dst)], capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, (case.name, run.stderr[-3000:])
            raw, off, got = dst.read_bytes(), 0, {}
            for name, dt, shape in layout:
                n = int(np.prod(shape)) * dt.itemsize
                got[name] = np.frombuffer(raw[off:off + n], dt).reshape(shape)
                off += n
            for name in case.check:
                if case.compare == "indexer":
                    msg = _cmp_indexer(case, got[name], want[name])
                else:
                    tol = TOL.lookup(op, case.tol_keys.get(name, case.tol_key))
                    msg, _, _ = compare_close(got[name], want[name], tol, name)
                if msg:
                    failures.append(f"{case.name}: {msg}")
            ran += 1
    assert not failures, "\n".join(failures[:20])
    assert ran > 100
