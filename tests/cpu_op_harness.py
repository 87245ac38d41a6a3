"""What the CPU op tests (tests/test_cpu_<family>.py) share: the CPU library and the reference as
module fixtures, inputs that may be column views of wider buffers, a call with poisoned outputs,
the tolerance rule and the expected-error check.

Every test makes fresh random inputs, runs the same call on the CPU library and on the NumPy
reference (each on its own copies; outputs poisoned with NaN or a sentinel, so an element the op
forgets to write fails), and compares: f32 results within a few f32 roundings of the reference's f64
math, bf16 results within a step of bf16, integer results exactly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import deepinfer
from deepinfer.errors import BackendCallError
from deepinfer.tensor import Tensor

NP = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "int32": np.int32}
POISON_INT = -7777


@pytest.fixture(scope="module")
def be(cpu_backend):
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    yield b
    b.close()


@pytest.fixture(scope="module")
def ref():
    r = deepinfer.get_backend("reference")
    missing = [op for op in ("hc_pre", "hc_post", "kv_compress", "indexer_topk", "sparse_attention", "layernorm")
               if not r.has_op(op)]
    if missing:
        pytest.skip(f"the reference backend lacks {missing}")
    return r


class In:
    """An input: values (cast to dtype), optionally a column view of a wider buffer (pad before, after)."""

    def __init__(self, values, dtype="f32", pad=(0, 0)):
        self.values = np.asarray(values)
        self.dtype, self.pad = dtype, pad

    def tensor(self) -> Tensor:
        v = self.values.astype(NP[self.dtype])
        if self.pad == (0, 0):
            return Tensor.from_numpy(np.ascontiguousarray(v))
        n = v.shape[-1]
        wide = np.full(v.shape[:-1] + (n + sum(self.pad),), 99, NP[self.dtype])   # garbage around the view
        wide[..., self.pad[0]:self.pad[0] + n] = v
        return Tensor.from_numpy(wide).narrow(-1, self.pad[0], n)

    def rounded(self) -> np.ndarray:
        """The values as the op sees them (after rounding to the dtype), in f64."""
        return self.values.astype(NP[self.dtype]).astype(np.float64)


def run(backend, op, ins: dict, outs: dict, **scalars) -> dict:
    """op on `backend` with fresh tensors; outs: name -> (shape, dtype), poisoned; returns their values."""
    kw = {k: (None if v is None else v.tensor()) for k, v in ins.items()}
    kw = {k: v for k, v in kw.items() if v is not None}
    o = {}
    for name, (shape, dt) in outs.items():
        o[name] = backend.empty(shape, dt, fill=POISON_INT if dt == "int32" else np.nan)
    backend.call(op, **kw, **o, **scalars)
    return {n: backend.to_numpy(t).astype(np.float64 if outs[n][1] != "int32" else np.int64) for n, t in o.items()}


def close(got, want, dtype, what="", rtol=None):
    """|got - want| <= rtol |want| + atol * rms(want), elementwise (an f32 or a bf16 result of f64 math)."""
    rtol = rtol if rtol is not None else (2e-2 if dtype == "bf16" else 2e-5)
    rms = float(np.sqrt(np.mean(want * want))) if want.size else 0.0
    assert not np.isnan(got).any(), f"{what}: NaN in the result (an element left unwritten?)"
    err = np.abs(got - want)
    bound = rtol * np.abs(want) + rtol * max(rms, 1e-30)
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements off, worst |diff| {err.max():.3g} "
                           f"(rms {rms:.3g})")


def both(be, ref, op, ins, outs, **scalars):
    return run(be, op, ins, outs, **scalars), run(ref, op, ins, outs, **scalars)


def expect_error(backend, op, ins, outs, status="INVALID_ARGUMENT", match=None, **scalars):
    with pytest.raises(BackendCallError) as e:
        run(backend, op, ins, outs, **scalars)
    assert e.value.status_name == status, str(e.value)
    if match:
        assert match in e.value.message, e.value.message
    return e.value


def _paged(rng, S, MB, NB):
    """A block table of S sequences x MB blocks, distinct random blocks of NB."""
    return rng.permutation(NB)[:S * MB].reshape(S, MB).astype(np.int32)
