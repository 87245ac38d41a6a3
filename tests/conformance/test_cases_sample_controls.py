"""ABI 1.7's sample controls (history + prompt_lens + penalties, bias_ids + bias, token_mask): the header's
statement of them, the reference's arithmetic against a plain restatement of README section 8, the CPU
library's argument checks, a 1.6 host that still runs sample on the 1.7 library (bytes past its struct
are never read), and the runtime refusing the fields for a library that says 1.6."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.errors import BackendCallError, UnsupportedOpError
from deepinfer.reference import ReferenceBackend
from deepinfer.reference.sampling import controlled_row, sample_row
from deepinfer.tensor import Tensor
from test_abi_versions import V1_6_TEXT, _cpu_presented_as, _ffi, _host_tensor

FIELDS = ["history", "prompt_lens", "penalties", "bias_ids", "bias", "token_mask"]


def test_1_7_appends_six_optional_fields_to_sample():
    spec = abi.OP_SPECS["sample"]
    assert abi.ABI_MINOR == 7 and [f for f, m in spec.appended if m == 7] == FIELDS
    assert all(spec.arg(f).optional and not spec.arg(f).written for f in FIELDS)
    assert abi.args_struct_size("sample", 6) == _ffi(V1_6_TEXT).sizeof("DI_SampleArgs")


def _plain_controls(x, hist, pl, pen, bids, bias, allowed):
    """README section 8's controls written out token by token in float32, for one row."""
    x = x.astype(np.float32).copy()
    f32 = np.float32
    for t, v in zip(bids, bias):
        if 0 <= t < len(x):
            x[t] = f32(x[t] + v)
    valid = [t for t in hist if 0 <= t < len(x)]
    out = [t for t in hist[pl:] if 0 <= t < len(x)]
    r, fr, pr = (f32(v) for v in pen)
    for t in set(valid):
        if r != 1:
            x[t] = f32(x[t] / r) if x[t] > 0 else f32(x[t] * r)
        c = out.count(t)
        if c:
            x[t] = f32(f32(x[t] - f32(f32(c) * fr)) - pr)
    x[~allowed] = -np.inf
    return x


def test_the_reference_does_what_section_8_says():
    rng = np.random.default_rng(11)
    for _ in range(20):
        V, L = int(rng.integers(1, 70)), int(rng.integers(1, 30))
        x = (rng.standard_normal(V) * 3).astype(np.float32)
        hist = rng.integers(-2, V + 2, L)
        pl = int(rng.integers(0, L + 1))
        pen = np.array([rng.choice([1.0, 1.5, 0.6]), rng.choice([0.0, 0.7, -1.2]), rng.choice([0.0, 1.0])], np.float32)
        bids = rng.choice(np.arange(-3, V + 3), min(4, V + 6), replace=False)
        bias = rng.choice(np.array([-np.inf, -3.0, 2.5, 100.0], np.float32), len(bids))
        allowed = rng.random(V) < 0.7
        words = np.zeros((V + 31) // 32, np.uint32)
        for v in np.flatnonzero(allowed):
            words[v >> 5] |= np.uint32(1 << (v & 31))
        got = controlled_row(x, 0, hist[None], np.array([pl]), pen[None], bids[None], bias[None], words[None])
        np.testing.assert_array_equal(got, _plain_controls(x, list(hist), pl, pen, bids, bias, allowed))


def _kw(B=2, V=8, **extra):
    rng = np.random.default_rng(5)
    kw = dict(logits=Tensor.from_numpy(rng.standard_normal((B, V)).astype(np.float32)),
              temperature=Tensor.from_numpy(np.zeros(B, np.float32)), top_k=Tensor.from_numpy(np.zeros(B, np.int32)),
              top_p=Tensor.from_numpy(np.ones(B, np.float32)), seeds=Tensor.from_numpy(np.zeros(B, np.uint64)),
              out=Tensor.empty((B,), "int32", fill=-7))
    kw.update({k: Tensor.from_numpy(v) for k, v in extra.items()})
    return kw


def _history(B=2, L=3, pen=(1.0, 0.5, 0.5)):
    return dict(history=np.zeros((B, L), np.int32), prompt_lens=np.zeros(B, np.int32),
                penalties=np.tile(np.array(pen, np.float32), (B, 1)))


@pytest.mark.parametrize("bad, message", [
    (dict(history=np.zeros((2, 3), np.int32)), "history, prompt_lens and penalties go together"),
    (dict(bias_ids=np.zeros((2, 1), np.int32)), "bias_ids and bias go together"),
    (dict(_history(pen=(0.0, 0.0, 0.0))), "repetition penalty"),
    (dict(_history(pen=(1.0, np.inf, 0.0))), "finite"),
    (dict(_history(), prompt_lens=np.array([0, 4], np.int32)), "prompt_lens"),
    (dict(bias_ids=np.zeros((2, 1), np.int32), bias=np.array([[np.nan], [0]], np.float32)), "NaN"),
    (dict(token_mask=np.zeros((2, 2), np.int32)), "token_mask"),
])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_bad_controls_are_invalid_argument(cpu_backend, backend, bad, message):
    be = cpu_backend if backend == "cpu" else ReferenceBackend()
    with pytest.raises((BackendCallError, ValueError), match=message):
        be.sample(**_kw(**bad))


def test_a_fully_banned_row_returns_minus_one(cpu_backend):
    mask = np.zeros((2, 1), np.int32)
    mask[0, 0] = 1 << 5      # row 0 may only draw token 5; row 1 nothing
    for be in (cpu_backend, ReferenceBackend()):
        kw = _kw(token_mask=mask, probs=np.full(2, np.nan, np.float32))
        be.sample(**kw)
        assert kw["out"].numpy().tolist() == [5, -1]
        assert kw["probs"].numpy()[1] == 0.0


def test_a_1_6_runtime_runs_sample_on_the_current_library(cpu_lib):
    """A host with the 1.6 header sends the 1.6 DI_SampleArgs (it ends after probs). The bytes after it hold
    a mask that bans every token: ignored, so the plain draw comes back."""
    f = _ffi(V1_6_TEXT)
    lib = f.dlopen(str(cpu_lib))
    api = lib.deepinfer_plugin_info().get_api(1)
    opts = f.new("DI_ContextOptions*", {"struct_size": f.sizeof("DI_ContextOptions")})
    ctx = f.new("DI_Context**")
    assert api.context_create(opts, ctx) == 0
    try:
        rng = np.random.default_rng(8)
        B, V = 4, 37
        logits = rng.standard_normal((B, V)).astype(np.float32)
        temp = np.array([0, 1, 0.7, 0], np.float32)
        top_k, top_p = np.zeros(B, np.int32), np.ones(B, np.float32)
        seeds = rng.integers(0, 2**63, B).astype(np.uint64)
        out = np.full(B, -7, np.int32)
        mask = np.zeros((B, 2), np.int32)
        buf = abi.ffi.new("DI_SampleArgs*")
        _host_tensor(abi.ffi, buf.token_mask, mask, 0)
        a = f.cast("DI_SampleArgs*", abi.ffi.cast("void*", buf))
        a.header.struct_size = f.sizeof("DI_SampleArgs")
        for name, arr, code in (("logits", logits, 2), ("temperature", temp, 2), ("top_k", top_k, 0),
                                ("top_p", top_p, 2), ("seeds", seeds, 1), ("out", out, 0)):
            _host_tensor(f, getattr(a, name), arr, code)
        assert api.sample(ctx[0], a) == 0, f.string(api.last_error(ctx[0]))
        want = [sample_row(logits[b].astype(np.float64), float(temp[b]), 0, 1.0, int(seeds[b])) for b in range(B)]
        np.testing.assert_array_equal(out, want)
    finally:
        api.context_destroy(ctx[0])


def test_the_runtime_refuses_1_7_fields_for_a_1_6_table(cpu_lib):
    """The CPU library presented as 1.6 (the same table size: 1.7 appended no entry): each control is
    refused with a message that says why, the suite calls a controls case unsupported, and sample without
    them runs."""
    be = _cpu_presented_as(cpu_lib, 6, _ffi(V1_6_TEXT).sizeof("DI_Api"))
    try:
        assert be.abi_minor == 6
        for extra in (_history(), dict(token_mask=np.zeros((2, 1), np.int32))):
            for call in (lambda kw: be.sample(**kw), lambda kw: be.prepare("sample", **kw)):
                with pytest.raises(UnsupportedOpError, match=r"is ABI 1\.7; backend 'cpu16' implements ABI 1\.6"):
                    call(_kw(**extra))
        kw = _kw()
        be.sample(**kw)
        assert -1 < kw["out"].numpy()[0] < 8
        case = next(c for c in C.cases_for("sample", "quick", 0) if c.fmt == "controls")
        o = check_case(be, case, ReferenceCache(ReferenceBackend()))
        assert o.status == "unsupported", o.message
    finally:
        be.close()
