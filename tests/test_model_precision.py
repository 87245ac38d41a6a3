"""Loading at a precision other than the checkpoint's: weights quantized at load by the backend's
quantize op give the same logits as an f32 model holding their dequantized values; int8
activations (w8a8 / w4a8) stay close to the weight-only result; load_model picks a precision."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deepinfer.engine import ModelRunner, RunnerConfig, load_runner
from deepinfer.tensor import Tensor

pytestmark = pytest.mark.usefixtures("torch_one_thread")

IDS = [5, 17, 200, 3, 99, 42, 7, 130]


def _logits(m, ids=IDS):
    m.forward([(0, ids[:5], 0)])
    rows = [m.backend.to_numpy(m.forward([(0, [ids[i]], i)]))[0] for i in range(5, len(ids))]
    m.free(0)
    return np.array(rows)


def _dequantize_all(model, be):
    """Replace every quantized weight of `model` by its f32 dequantization (backend op)."""
    def deq(t):
        if isinstance(t, list):
            return [deq(x) for x in t]
        if dataclasses.is_dataclass(t):
            for f in dataclasses.fields(t):
                setattr(t, f.name, deq(getattr(t, f.name)))
            return t
        if isinstance(t, Tensor) and t.quant is not None:
            out = be.empty(t.shape, "f32")
            be.dequantize(x=t, out=out)
            return out
        return t
    for layer in model.weights.layers:
        deq(layer)


@pytest.mark.parametrize("precision", ["int8", "int4", "fp8"])
def test_quantized_at_load_equals_its_dequantized_weights(precision, model_backend, tiny_checkpoint):
    path, _, _ = tiny_checkpoint("v3")
    be = model_backend
    q = ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=16, precision=precision))
    w = q.weights.layers[1].moe.experts_up[3]
    assert w.quant is not None and w.dtype.name == {"int8": "int8", "int4": "int4", "fp8": "e4m3"}[precision]
    assert q.weights.lm_head.quant is None and q.weights.layers[1].moe.gate.quant is None    # head and router stay float
    ref = ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=16))
    ref.weights.layers = q.weights.layers                       # share the quantized weights, then dequantize them
    got = _logits(q)
    _dequantize_all(ref, be)
    want = _logits(ref)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("precision,weights", [("w8a8", "int8"), ("w4a8", "int4")])
def test_int8_activations_stay_close(precision, weights, model_backend, tiny_checkpoint):
    path, _, _ = tiny_checkpoint("v2lite")
    be = model_backend
    a8 = _logits(ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=16, precision=precision)))
    w_only = _logits(ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=16, precision=weights)))
    scale = np.abs(w_only).max()
    assert 0 < np.abs(a8 - w_only).max() < 0.1 * scale      # activation rounding shows, but only a little


def test_bf16_weights_f32_activations(model_backend, tiny_checkpoint):
    path, _, _ = tiny_checkpoint("v2")
    be = model_backend
    m = ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=16, precision="bf16"))
    assert m.weights.layers[0].attn.o.dtype.name == "bf16" and m.weights.norm.dtype.name == "f32"
    f = _logits(ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=16)))
    assert np.abs(_logits(m) - f).max() < 3e-2 * np.abs(f).max()


def test_load_model_from_engine_config(tiny_checkpoint):
    import deepinfer
    from deepinfer.config import EngineConfig

    path, _, _ = tiny_checkpoint("v3fp8")
    be = deepinfer.get_backend("reference")
    m = load_runner(path, be, EngineConfig(max_batch=2, max_seq_len=32, precision="fp8"))
    assert m.precision is None and m.weights.layers[0].attn.q_b.dtype.name == "e4m3"   # fp8 as stored
    assert m.kv.max_seq_len >= 32 and m.max_batch == 2
    m = load_runner(path, be, EngineConfig(max_batch=1, max_seq_len=16, precision="bf16"))
    assert m.weights.layers[0].attn.q_b.dtype.name == "bf16" and m.weights.layers[0].attn.q_b.quant is None
    with pytest.raises(Exception, match="int4"):
        load_runner(path, be, EngineConfig(max_batch=1, max_seq_len=16, precision="int4"))
