"""The output layer's precision: kept as stored (bf16 stays bf16 under the bf16 and quantized paths,
an exact conversion away from f32), or int8 per channel when quantize_lm_head asks for it."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.engine import Engine
from deepinfer.errors import ConfigError

NANO = "runtime/deepinfer/assets/deepseek-v3-nano"


def _engine(cpu_backend, **cfg):
    return Engine.from_pretrained(NANO, config={"backend": cpu_backend.info.path, "max_batch": 2, **cfg})


def _logits(eng, ids):
    r = eng.runner
    sid = r.new_sequence()
    out = r.backend.to_numpy(r.forward([sid], [ids], [0])).copy()
    r.free(sid)
    return out


def test_bf16_head_stays_bf16_and_computes_the_same(cpu_backend):
    ids = list(range(5, 40))
    bf = _engine(cpu_backend, precision="bf16")
    assert bf.runner.weights.lm_head.dtype.name == "bf16" and bf.runner.weights.embed.dtype.name == "bf16"
    f32 = _engine(cpu_backend, precision="f32")
    assert f32.runner.weights.lm_head.dtype.name == "f32"
    # the stored weights are bf16, so both paths multiply the same values: only summation order differs
    a, b = _logits(bf, ids), _logits(f32, ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


@pytest.mark.parametrize("precision", ["int8", "w4a8"])
def test_quantize_lm_head(cpu_backend, precision):
    ids = list(range(7, 50))
    plain = _engine(cpu_backend, precision=precision)
    q = _engine(cpu_backend, precision=precision, quantize_lm_head=True)
    head = q.runner.weights.lm_head
    assert head.dtype.name == "int8" and tuple(head.quant.block) == (1, 0)
    assert plain.runner.weights.lm_head.dtype.name == "bf16"
    assert "int8 lm_head" in q.runner.precision_note
    a, b = _logits(q, ids), _logits(plain, ids)
    # int8 per channel: about 1/254 of each row's largest weight, far below the logits' spread
    assert np.abs(a - b).max() < 0.05 * np.abs(b).std() * 10
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_quantize_lm_head_needs_an_integer_path(cpu_backend):
    with pytest.raises(ConfigError, match="quantize_lm_head needs an int8, int4, w8a8 or w4a8 precision"):
        _engine(cpu_backend, precision="bf16", quantize_lm_head=True)
    with pytest.raises(ConfigError, match="quantize_lm_head"):
        _engine(cpu_backend, precision="int8", quantize_lm_head="yes")
