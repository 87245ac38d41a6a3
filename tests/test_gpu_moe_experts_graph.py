"""moe_experts inside a captured graph, on a GPU library (skipped without one).

The tensor-core path of a GPU backend must route, group and compute on the device: a graph captured
once must follow whatever routing the ids buffer holds at replay. The test captures the op, then
writes new routing (and new activations) into the same buffers and replays: the result must match
the reference for the new routing. Run on the GPU machine with
    DEEPINFER_CUDA_LIB=/path/libdeepinfer_cuda.so pytest tests/test_gpu_moe_experts_graph.py
"""
from __future__ import annotations

import os
import dataclasses

import numpy as np
import pytest

import deepinfer
from deepinfer import abi
from deepinfer.conformance import cases as C
from deepinfer.conformance import tolerances as TOL
from deepinfer.conformance.device_checks import _poison_outputs, _set_host_or_device
from deepinfer.conformance.harness import Materialized, compare_close, run_on

LIB = os.environ.get("DEEPINFER_CUDA_LIB")
pytestmark = pytest.mark.skipif(not LIB, reason="needs DEEPINFER_CUDA_LIB (a GPU backend library)")
ffi = abi.ffi


@pytest.fixture(scope="module")
def gpu():
    be = deepinfer.loader.load_library(LIB)
    yield be
    be.close()


def _expect(be, status, what):
    assert status == abi.OK, f"{what}: {abi.STATUS_NAMES.get(status)}: {be._error_message(be._ctx)}"


def _with_routing(case, rng, E, resident):
    """The same weights with new ids, weights and activations."""
    T, K = case.tensors["topk_ids"].shape
    ids = np.stack([rng.choice(resident, K, replace=False) for _ in range(T)]).astype(np.int32)
    t = dict(case.tensors)
    t["topk_ids"] = C.ints(ids)
    t["topk_weights"] = C.TSpec("f32", (T, K), rng.uniform(0.1, 1.0, (T, K)).astype(np.float32))
    t["x"] = C.plain(rng, case.tensors["x"].shape, "bf16")
    return dataclasses.replace(case, tensors=t)


@pytest.mark.parametrize("wfmt", ["bf16", "int4/g128/sym/f16", "e4m3/128x128/f32", "int8/channel/f32"])
@pytest.mark.parametrize("T", [1, 5, 200])
def test_moe_experts_replays_new_routing(gpu, wfmt, T):
    E, K = 16, 4
    case = C.moe_experts(7, T, E, K, 256, 128, "bf16", wfmt, routing="all")
    ref = deepinfer.get_backend("reference")
    tol = TOL.CURRENT[case.op][case.tol_key]
    m = Materialized(gpu, case)
    s = ffi.new("DI_Stream*")
    _expect(gpu, gpu._api.stream_create(gpu._ctx, s), "stream_create")
    stream = s[0]
    g = ffi.new("DI_Graph**")
    try:
        args, keep = gpu._bind(case.op, m.kwargs)
        args.header.stream = stream
        _expect(gpu, gpu._api.graph_begin(gpu._ctx, stream), "graph_begin")
        st = gpu._api.moe_experts(gpu._ctx, args)
        _expect(gpu, gpu._api.graph_end(gpu._ctx, stream, g), "graph_end")
        _expect(gpu, st, "moe_experts while capturing")
        rng = np.random.default_rng(11)
        for replay, c in enumerate([case, _with_routing(case, rng, E, list(range(E))),
                                    _with_routing(case, rng, E, list(range(0, E, 3)))]):
            for name in ("topk_ids", "topk_weights", "x"):
                _set_host_or_device(gpu, m.held[name], np.asarray(c.tensors[name].values))
            _poison_outputs(gpu, m)
            _expect(gpu, gpu._api.graph_launch(gpu._ctx, g[0], stream), "graph_launch")
            _expect(gpu, gpu._api.stream_synchronize(gpu._ctx, stream), "stream_synchronize")
            want, err = run_on(ref, c)
            assert err is None
            msg, _, _ = compare_close(m.read("out"), want.read("out"), tol, f"replay {replay} out")
            assert msg is None, msg
    finally:
        if g[0] != ffi.NULL:
            gpu._api.graph_destroy(gpu._ctx, g[0])
        gpu._api.stream_destroy(gpu._ctx, stream)
