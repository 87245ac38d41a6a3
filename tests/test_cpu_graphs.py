"""Graph capture on the CPU backend: ops issued on a captured stream are recorded (their argument
structs deep-copied) and replayed natively, so a decode step is one call from Python.

The conformance suite checks capture and replay op by op (L3); these tests check what it cannot:
that a replay owns every descriptor it needs after the host freed its own copies (moe_experts'
per-expert arrays and quantization descriptors included), that other streams run eagerly during a
capture, that a failing node names itself, and that the engine's greedy output is the same with
graphs and op by op."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import deepinfer
from deepinfer import abi
from deepinfer.backend import ffi
from deepinfer.errors import DeepinferError
from deepinfer.tensor import Quant, Tensor

NANO = "runtime/deepinfer/assets/deepseek-v3-nano"


@pytest.fixture()
def be(cpu_backend):
    """A fresh context on the CPU library with a stream of its own (graphs need one)."""
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    s = b.create_stream()
    b.set_stream(s)
    yield b
    b.set_stream(None)
    s.close()
    b.close()


def _q_experts(be, rng, E, I, H):
    """E experts of int4 group-64 weights (quantized by the library itself), as (gate, up, down)."""
    def q(n, k):
        w = be.upload(Tensor.from_numpy((rng.standard_normal((n, k)) * 0.1).astype(np.float32)))
        sc = be.empty((n, k // 64), "f32")
        t = Tensor(be.empty((n, k // 2), "uint8").buffer, (n, k), "int4", None, 0, Quant(sc, (1, 64)))
        be.call("quantize", x=w, out=t, scale_pow2=0)
        return t
    return [q(I, H) for _ in range(E)], [q(I, H) for _ in range(E)], [q(H, I) for _ in range(E)]


def test_replay_owns_its_descriptors(be):
    """moe_experts with quantized per-expert weights is captured from a one-off args struct; the
    struct, its descriptor arrays and quant descriptors are freed before the replays."""
    rng = np.random.default_rng(0)
    T, E, K, H, I = 3, 6, 2, 128, 64
    gate, up, down = _q_experts(be, rng, E, I, H)
    x = be.upload(Tensor.from_numpy(rng.standard_normal((T, H)).astype(np.float32)))
    ids = be.upload(Tensor.from_numpy(rng.integers(0, E, (T, K)).astype(np.int32)))
    tw = be.upload(Tensor.from_numpy(rng.random((T, K)).astype(np.float32)))
    out = be.empty((T, H), "f32")
    be.moe_experts(x=x, topk_ids=ids, topk_weights=tw, w_gate=gate, w_up=up, w_down=down, out=out,
                   num_experts=E, accumulate=0)
    want = be.to_numpy(out).copy()
    calls = [be.prepare("moe_experts", x=x, topk_ids=ids, topk_weights=tw, w_gate=gate, w_up=up, w_down=down,
                        out=out, num_experts=E, accumulate=0)]
    g = be.capture(calls)
    del calls
    be._array_cache.clear()      # the host's descriptor arrays are gone: the graph must own copies
    be._desc_cache.clear()
    gc.collect()
    for _ in range(2):
        be.write(out, np.full((T, H), np.nan, np.float32))
        g.launch()
        assert np.array_equal(be.to_numpy(out), want)
    # new inputs in the same buffers are what a replay reads
    x2 = rng.standard_normal((T, H)).astype(np.float32)
    be.write(x, x2)
    g.launch()
    got = be.to_numpy(out).copy()
    be.moe_experts(x=x, topk_ids=ids, topk_weights=tw, w_gate=gate, w_up=up, w_down=down, out=out,
                   num_experts=E, accumulate=0)
    assert np.array_equal(got, be.to_numpy(out)) and not np.array_equal(got, want)
    g.close()


def test_other_streams_run_during_a_capture(be):
    a = be.upload(Tensor.from_numpy(np.arange(8, dtype=np.float32)))
    out = be.empty((8,), "f32")
    other = be.create_stream()
    api, ctx = be._api, be._ctx
    assert api.graph_begin(ctx, be.stream.handle) == abi.OK
    try:
        # an op on another stream runs now; one on the captured stream waits for the launch
        args, keep = be._marshal("add", {"a": a, "b": a, "out": out})
        args.header.stream = other.handle
        assert getattr(api, "add")(ctx, args) == abi.OK
        assert np.array_equal(be.to_numpy(out), 2 * np.arange(8))
        be.write(out, np.zeros(8, np.float32))
        args2, keep2 = be._marshal("mul", {"a": a, "b": a, "out": out})
        args2.header.stream = be.stream.handle
        assert getattr(api, "mul")(ctx, args2) == abi.OK
        assert np.array_equal(be.to_numpy(out), np.zeros(8))      # recorded, not run
        # a second graph_begin on the capturing context is refused
        assert api.graph_begin(ctx, be.stream.handle) == abi.FAILED_PRECONDITION
    finally:
        gp = ffi.new("DI_Graph**")
        assert api.graph_end(ctx, be.stream.handle, gp) == abi.OK
    assert api.graph_launch(ctx, gp[0], be.stream.handle) == abi.OK
    assert np.array_equal(be.to_numpy(out), np.arange(8) ** 2)
    assert api.graph_destroy(ctx, gp[0]) == abi.OK
    other.close()


def test_a_failing_node_names_itself(be):
    """A node whose inputs became invalid after capture fails at launch with its index and the op's
    own message; nothing after it runs."""
    ids = be.upload(Tensor.from_numpy(np.array([[0, 1]], np.int32)))
    tw = be.upload(Tensor.from_numpy(np.ones((1, 2), np.float32)))
    x = be.upload(Tensor.from_numpy(np.ones((1, 64), np.float32)))
    out = be.empty((1, 64), "f32")
    w = [be.upload(Tensor.from_numpy(np.ones((32, 64), np.float32))) for _ in range(2)]
    wd = [be.upload(Tensor.from_numpy(np.ones((64, 32), np.float32))) for _ in range(2)]
    calls = [be.prepare("add", a=x, b=x, out=out),
             be.prepare("moe_experts", x=x, topk_ids=ids, topk_weights=tw, w_gate=w, w_up=w, w_down=wd, out=out,
                        num_experts=2, accumulate=0)]
    g = be.capture(calls)
    be.write(ids, np.array([[0, 7]], np.int32))   # 7: no such expert, skipped by the ABI's rule: still fine
    g.launch()
    be.write(ids, np.array([[0, 1]], np.int32))
    be.write(x, np.full((1, 64), np.nan, np.float32))
    g.launch()                                     # NaN in, NaN out: the op runs, not our business
    g.close()
    # an expert that is not resident at launch: FAILED_PRECONDITION from node 1, named
    calls = [be.prepare("add", a=x, b=x, out=out),
             be.prepare("moe_experts", x=x, topk_ids=ids, topk_weights=tw, w_gate=[w[0], None], w_up=[w[0], None],
                        w_down=[wd[0], None], out=out, num_experts=2, accumulate=0)]
    g = be.capture(calls)
    with pytest.raises(DeepinferError, match=r"node 1 of 2 failed: moe_experts: expert 1 not resident"):
        g.launch()
    g.close()


@pytest.mark.parametrize("precision", ["auto", "w4a8"])
def test_engine_greedy_same_with_and_without_graphs(cpu_backend, precision):
    """The runner captures every decode plan after its first run on the CPU; its greedy tokens equal
    the op-by-op path's, for several prompts in one batch and one at a time."""
    from deepinfer.engine import Engine

    lib = cpu_backend.info.path
    outs = {}
    for eager in (True, False):
        eng = Engine.from_pretrained(NANO, config={"backend": lib, "precision": precision, "max_batch": 4,
                                                   "enforce_eager": eager, "num_threads": 2})
        rng = np.random.default_rng(5)
        prompts = [list(map(int, rng.integers(3, 4096, n))) for n in (5, 17, 33, 9, 60, 2)]
        outs[eager] = eng.generate_ids(prompts, max_new_tokens=24, temperature=0.0, ignore_eos=True)
        if not eager:
            decode = [p for k, p in eng.runner.plans.items() if k.mode == "decode"]
            assert any(p.graph is not None for p in decode)
            assert all(p.graph is not None for p in decode if p.runs > 1)
        else:
            assert all(p.graph is None for p in eng.runner.plans.values())
    assert outs[True] == outs[False]
