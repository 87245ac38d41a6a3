"""ABI 1.0 and 1.1 side by side: a 1.0 library keeps loading and passing under this runtime, a 1.1
library still serves a runtime that only knows 1.0, and the padding rule that made 1.0 unsafe to
grow is gone (the check is shown to catch it in the frozen 1.0 header)."""
from __future__ import annotations

import cffi
import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import run_conformance, summary
from deepinfer.loader import probe
from plugin_build import ABI_V1_0_DIR, PROFILE

V1_0_TEXT = (ABI_V1_0_DIR / "deepinfer_abi.h").read_text()


def _padded_structs(f: cffi.FFI) -> dict:
    """struct name -> bytes not covered by any field (interior or tail padding)."""
    typedefs, _, _ = f.list_types()
    out = {}
    for name in typedefs:
        t = f.typeof(name)
        if t.kind != "struct" or name in ("DI_Context", "DI_Graph"):
            continue
        covered = sum(f.sizeof(fld.type) for _, fld in t.fields)
        if covered != f.sizeof(name):
            out[name] = f.sizeof(name) - covered
    return out


def _ffi(text: str) -> cffi.FFI:
    f = cffi.FFI()
    f.cdef(abi._cdef_text(text))
    return f


def test_padding_check_catches_the_1_0_structs_and_passes_1_1():
    assert _padded_structs(_ffi(V1_0_TEXT)) == {"DI_RMSNormArgs": 4, "DI_QuantizeArgs": 4, "DI_MLAPrefillArgs": 4,
                                                "DI_MLADecodeArgs": 4}
    assert _padded_structs(abi.ffi) == {}


def test_1_1_structs_keep_the_1_0_sizes():
    """Named reserved fields took the padding's place: a 1.0 library sees the struct_size it knows."""
    old = _ffi(V1_0_TEXT)
    typedefs, _, _ = old.list_types()
    for name in typedefs:
        if old.typeof(name).kind == "struct" and name not in ("DI_Context", "DI_Graph", "DI_Api"):
            assert old.sizeof(name) == abi.ffi.sizeof(name), name
    assert abi.ffi.offsetof("DI_Api", "sample") == old.offsetof("DI_Api", "sample")
    assert abi.ffi.sizeof("DI_Api") > old.sizeof("DI_Api")


def test_a_1_0_runtime_runs_a_1_1_library(cpu_lib):
    """A host that only has the 1.0 header (its cdef, its struct sizes) loads the 1.1 CPU library and
    runs v1.0 ops, including one whose struct gained a reserved field."""
    f = _ffi(V1_0_TEXT)
    lib = f.dlopen(str(cpu_lib))
    info = lib.deepinfer_plugin_info()
    assert (info.abi_major, info.abi_minor) == (1, abi.ABI_MINOR)
    api = info.get_api(1)
    assert api.struct_size >= f.sizeof("DI_Api")   # a newer table: the 1.0 host reads its prefix only
    opts = f.new("DI_ContextOptions*", {"struct_size": f.sizeof("DI_ContextOptions")})
    ctx = f.new("DI_Context**")
    assert api.context_create(opts, ctx) == 0
    try:
        def tensor(t, arr):
            t.data = f.cast("void*", arr.ctypes.data)
            t.device_type, t.ndim = 1, arr.ndim
            t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 32, 1
            for i, n in enumerate(arr.shape):
                t.shape[i], t.strides[i] = n, arr.strides[i] // 4

        x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        w = np.linspace(0.5, 1.5, 8, dtype=np.float32)
        out = np.full((3, 8), np.nan, np.float32)
        a = f.new("DI_RMSNormArgs*")
        a.header.struct_size = f.sizeof("DI_RMSNormArgs")
        tensor(a.x, x), tensor(a.weight, w), tensor(a.out, out)
        a.eps = 1e-6
        st = api.rmsnorm(ctx[0], a)
        assert st == 0, f.string(api.last_error(ctx[0]))
        want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(out, want, rtol=1e-5)
        b = f.new("DI_BinaryArgs*")
        b.header.struct_size = f.sizeof("DI_BinaryArgs")
        s = np.zeros_like(x)
        tensor(b.a, x), tensor(b.b, x), tensor(b.out, s)
        assert api.add(ctx[0], b) == 0
        np.testing.assert_array_equal(s, x + x)
    finally:
        api.context_destroy(ctx[0])


def test_a_1_1_build_of_the_tiny_plugin_loads_and_passes(plugin_factory):
    """The sample third-party plugin rebuilt against the 1.1 header (it fills no 1.1 entry: they are
    optional) says 1.1 and still passes; the suite notes what it lacks instead of failing it."""
    lib = plugin_factory("libdeepinfer_tiny11.so", abi="current", TEST_NAME='"tiny11"')
    c = probe(lib)
    assert c.ok and c.abi_version == f"1.{abi.ABI_MINOR}", c.reason
    cert = run_conformance(str(lib), levels=("L0",), profile=PROFILE, isolate=False)
    assert cert["passed"], summary(cert)
    msgs = {r["case"]: r.get("message", "") for r in cert["levels"]["L0"]["results"]}
    assert msgs["events: create, record, wait, query, synchronize, destroy, NULLs"] == "no events"
    assert "1.1 entries: not offered by a 1.0 library" not in msgs


def test_the_1_0_tiny_plugin_is_certified_without_1_1_checks(tiny_lib):
    c = probe(tiny_lib)
    assert c.ok and c.abi_version == "1.0"
    cert = run_conformance(str(tiny_lib), levels=("L0",), profile=PROFILE, isolate=False)
    assert cert["passed"], summary(cert)
    cases = [r["case"] for r in cert["levels"]["L0"]["results"]]
    assert "1.1 entries: not offered by a 1.0 library" in cases
    assert not any(c.startswith("events:") for c in cases)


def test_a_1_0_library_says_what_it_lacks(tiny_lib):
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.loader import load_library

    be = load_library(tiny_lib)
    try:
        with pytest.raises(UnsupportedOpError, match=r"ABI 1\.0\) lacks event_create"):
            be.create_event()
        with pytest.raises(UnsupportedOpError, match="lacks host_alloc"):
            be.host_empty((4,), "f32")
        assert be.device_count() == 1     # 1.0 had no device_count: the one device it runs on
    finally:
        be.close()
