"""ABI 1.0 to 1.7 side by side: 1.0, 1.1, 1.2, 1.3 and 1.4 libraries keep loading and passing under
this runtime, the current library still serves runtimes that only know an older minor (a 1.1 host sends
the smaller 1.1 DI_SampleArgs, a 1.2 host the 1.2 DI_MLADecodeArgs and DI_SiluMulArgs, a 1.3 host a
table it reads only up to layernorm, a 1.4 host the 1.4 DI_MoEExpertsArgs), the runtime refuses a field
newer than a library's minor instead of letting it be ignored (a 1.3 scalar such as silu_mul's limit
only when it is not zero; 1.5's expert_map and misses) and a communicator from a library that has none
(1.4), and the padding rule that made 1.0 unsafe to grow is gone (the check is shown to catch it in the
frozen 1.0 header). 1.6's fused op against 1.5 is in test_cases_fused.py, 1.7's sample controls against
1.6 in test_cases_sample_controls.py."""
from __future__ import annotations

import cffi
import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import run_conformance, summary
from deepinfer.loader import probe
from plugin_build import (ABI_V1_0_DIR, ABI_V1_1_DIR, ABI_V1_2_DIR, ABI_V1_3_DIR, ABI_V1_4_DIR, ABI_V1_5_DIR,
                          ABI_V1_6_DIR, PROFILE)

V1_0_TEXT = (ABI_V1_0_DIR / "deepinfer_abi.h").read_text()
V1_1_TEXT = (ABI_V1_1_DIR / "deepinfer_abi.h").read_text()
V1_2_TEXT = (ABI_V1_2_DIR / "deepinfer_abi.h").read_text()
V1_3_TEXT = (ABI_V1_3_DIR / "deepinfer_abi.h").read_text()
V1_4_TEXT = (ABI_V1_4_DIR / "deepinfer_abi.h").read_text()
V1_5_TEXT = (ABI_V1_5_DIR / "deepinfer_abi.h").read_text()
V1_6_TEXT = (ABI_V1_6_DIR / "deepinfer_abi.h").read_text()
OLD_TEXTS = {0: V1_0_TEXT, 1: V1_1_TEXT, 2: V1_2_TEXT, 3: V1_3_TEXT, 4: V1_4_TEXT, 5: V1_5_TEXT, 6: V1_6_TEXT}
# the DI_Api entries 1.4 appended: the five ops, then the communicator entries
API_V1_4_FIELDS = [f for f, _ in abi.ffi.typeof("DI_Api").fields if abi.API_ENTRY_SINCE.get(f) == 4]
COLLECTIVES = ["all_reduce", "all_gather", "all_to_all"]


def _padded_structs(f: cffi.FFI) -> dict:
    """struct name -> bytes not covered by any field (interior or tail padding)."""
    typedefs, _, _ = f.list_types()
    out = {}
    for name in typedefs:
        t = f.typeof(name)
        if t.kind != "struct" or t.fields is None:   # opaque handles: DI_Context, DI_Graph, DI_Comm (1.4)
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


def test_the_frozen_headers_are_the_versions_they_say():
    for minor, text in OLD_TEXTS.items():
        assert f"#define DI_ABI_MINOR {minor}\n" in text, minor
    assert abi.API_V1_3_FIELDS == ["hc_pre", "hc_post", "kv_compress", "indexer_topk", "sparse_attention",
                                   "layernorm"]
    assert API_V1_4_FIELDS == ["all_reduce", "all_gather", "all_to_all", "moe_dispatch", "moe_combine",
                               "comm_unique_id", "comm_create", "comm_destroy"]
    # 1.5 appended no DI_Api entry, only two fields of DI_MoEExpertsArgs; 1.6 one op entry; 1.7 six
    # fields of DI_SampleArgs and no entry
    assert abi.ABI_MINOR == 7 and not [f for f, m in abi.API_ENTRY_SINCE.items() if m in (5, 7)]
    assert [f for f, m in abi.API_ENTRY_SINCE.items() if m == 6] == ["mla_rope_cache_write"]
    assert [f for f, m in abi.OP_SPECS["sample"].appended if m == 7] == ["history", "prompt_lens", "penalties",
                                                                          "bias_ids", "bias", "token_mask"]
    assert [f for f, m in abi.OP_SPECS["moe_experts"].appended if m == 5] == ["expert_map", "misses"]
    # the frozen 1.3 header is HEAD's before 1.4: its table ends with layernorm, and it knows no communicator
    assert "DI_OP_COUNT_V1_3      = 23\n" in V1_3_TEXT and "DI_Comm" not in V1_3_TEXT
    # the frozen 1.4 header is HEAD's before 1.5: communicators, and moe_experts ends with swiglu_limit
    assert "DI_OP_COUNT_V1_4      = 28\n" in V1_4_TEXT and "DI_OP_COUNT_V1_5" not in V1_4_TEXT
    assert "DI_Comm" in V1_4_TEXT and "expert_map" not in V1_4_TEXT and "misses" not in V1_4_TEXT
    # the frozen 1.5 header is HEAD's before 1.6: expert_map, and no fused op
    assert "DI_OP_COUNT_V1_5      = 28   /*" in V1_5_TEXT and "DI_OP_COUNT_V1_6" not in V1_5_TEXT
    assert "expert_map" in V1_5_TEXT and "mla_rope_cache_write" not in V1_5_TEXT
    # the frozen 1.6 header is HEAD's before 1.7: the fused op, and sample ends with probs
    assert "DI_OP_COUNT_V1_6      = 29\n" in V1_6_TEXT and "DI_OP_COUNT_V1_7" not in V1_6_TEXT
    assert "mla_rope_cache_write" in V1_6_TEXT and "token_mask" not in V1_6_TEXT


@pytest.mark.parametrize("minor", [0, 1, 2, 3, 4, 5, 6])
def test_older_structs_keep_their_sizes(minor):
    """Named reserved fields took the padding's place (1.1), 1.2 and 1.3 only appended DI_ARGS_SINCE
    fields (1.3's scalars with a reserved partner, so no struct has padding), 1.4 only added structs
    and DI_Api entries, 1.5 only appended DI_ARGS_SINCE fields (moe_experts' expert_map and misses) and
    1.6 only added a struct and a DI_Api entry (mla_rope_cache_write), 1.7 only appended DI_ARGS_SINCE
    fields (sample's controls):
    the current header's struct, cut at version 1.<minor>, has exactly that version's size and offsets,
    so a 1.<minor> library sees a struct_size it knows and a 1.<minor> host sends one the library takes."""
    old = _ffi(OLD_TEXTS[minor])
    by_struct = {abi.OP_SPECS[op].struct: op for op in abi.OP_NAMES}
    typedefs, _, _ = old.list_types()
    for name in typedefs:
        t = old.typeof(name)
        # opaque handles (DI_Context, DI_Graph, 1.4's DI_Comm) have no size; DI_Api is compared below
        if t.kind == "struct" and t.fields is not None and name != "DI_Api":
            size = abi.args_struct_size(by_struct[name], minor) if name in by_struct else abi.ffi.sizeof(name)
            assert old.sizeof(name) == size, name
            for f, _ in old.typeof(name).fields:
                assert old.offsetof(name, f) == abi.ffi.offsetof(name, f), (name, f)
    for f, _ in old.typeof("DI_Api").fields:
        assert abi.ffi.offsetof("DI_Api", f) == old.offsetof("DI_Api", f), f
    # every minor appended DI_Api entries except 1.5 and 1.7 (1.4's and 1.5's tables are the same size, as
    # are 1.6's and 1.7's)
    assert abi.ffi.sizeof("DI_Api") > old.sizeof("DI_Api") if minor < 6 else \
        abi.ffi.sizeof("DI_Api") == old.sizeof("DI_Api")
    assert _ffi(V1_4_TEXT).sizeof("DI_Api") == _ffi(V1_5_TEXT).sizeof("DI_Api")


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


def test_a_current_build_of_the_tiny_plugin_loads_and_passes(plugin_factory):
    """The sample third-party plugin rebuilt against the current header (it fills no 1.1 or 1.2 entry:
    they are optional) says 1.<current> and still passes; the suite notes what it lacks instead of failing it."""
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


def _host_tensor(f, t, arr, code):
    t.data = f.cast("void*", arr.ctypes.data)
    t.device_type, t.ndim = 1, arr.ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code, arr.dtype.itemsize * 8, 1
    for i, n in enumerate(arr.shape):
        t.shape[i], t.strides[i] = n, arr.strides[i] // arr.dtype.itemsize


def test_a_1_1_runtime_runs_sample_on_the_current_library(cpu_lib):
    """A host with the 1.1 header sends the 1.1 DI_SampleArgs (no probs). The current library takes that
    struct_size and never reads past it: the bytes after it here hold a complete, valid probs descriptor,
    which must be ignored (not written, no UNIMPLEMENTED)."""
    f = _ffi(V1_1_TEXT)
    lib = f.dlopen(str(cpu_lib))
    info = lib.deepinfer_plugin_info()
    assert (info.abi_major, info.abi_minor) == (1, abi.ABI_MINOR)
    api = info.get_api(1)
    opts = f.new("DI_ContextOptions*", {"struct_size": f.sizeof("DI_ContextOptions")})
    ctx = f.new("DI_Context**")
    assert api.context_create(opts, ctx) == 0
    try:
        rng = np.random.default_rng(3)
        B, V = 5, 40
        logits = rng.standard_normal((B, V)).astype(np.float32)
        temp = np.array([0, 1, 0.7, 0, 1.3], np.float32)
        top_k, top_p = np.zeros(B, np.int32), np.ones(B, np.float32)
        seeds = rng.integers(0, 2**63, B).astype(np.uint64)
        out = np.full(B, -1, np.int32)
        probs = np.full(B, np.nan, np.float32)
        n11 = f.sizeof("DI_SampleArgs")
        assert n11 == abi.args_struct_size("sample", 1) < abi.ffi.sizeof("DI_SampleArgs")
        # the 1.1 struct followed by what a 1.2 caller would have put in `probs`
        buf = abi.ffi.new("DI_SampleArgs*")
        full = buf
        _host_tensor(abi.ffi, full.probs, probs, 2)
        a = f.cast("DI_SampleArgs*", abi.ffi.cast("void*", buf))
        a.header.struct_size = n11
        for name, arr, code in (("logits", logits, 2), ("temperature", temp, 2), ("top_k", top_k, 0),
                                ("top_p", top_p, 2), ("seeds", seeds, 1), ("out", out, 0)):
            _host_tensor(f, getattr(a, name), arr, code)
        st = api.sample(ctx[0], a)
        assert st == 0, f.string(api.last_error(ctx[0]))
        assert np.all(np.isnan(probs)), "a field past the caller's struct_size was written"
        from deepinfer.reference.sampling import sample_row
        want = [sample_row(logits[b].astype(np.float64), float(temp[b]), 0, 1.0, int(seeds[b])) for b in range(B)]
        np.testing.assert_array_equal(out, want)
        # a struct_size between two versions' sizes is no caller's: refused
        a.header.struct_size = n11 + 8
        assert api.sample(ctx[0], a) == abi.INVALID_ARGUMENT
    finally:
        api.context_destroy(ctx[0])


def test_a_1_1_build_of_the_tiny_plugin_loads_and_passes_under_1_2(plugin_factory):
    """The tiny plugin built against the frozen 1.1 header says 1.1 and passes L0 under this runtime;
    spec_verify is simply not in its table."""
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.tensor import Tensor

    lib = plugin_factory("libdeepinfer_tiny11f.so", abi="1.1", TEST_NAME='"tiny11f"')
    c = probe(lib)
    assert c.ok and c.abi_version == "1.1", c.reason
    assert "spec_verify" not in c.ops
    cert = run_conformance(str(lib), levels=("L0",), profile=PROFILE, isolate=False)
    assert cert["passed"], summary(cert)
    from deepinfer.loader import load_library
    be = load_library(lib)
    try:
        with pytest.raises(UnsupportedOpError, match="does not implement spec_verify"):
            be.spec_verify(logits=Tensor.from_numpy(np.zeros((1, 4), np.float32)))
    finally:
        be.close()


def _cpu_presented_as(cpu_lib, minor: int, struct_size: int):
    """The CPU library bound as a 1.<minor> library would present itself: a copy of its table with
    that abi_minor and struct_size (the entries past it count as absent)."""
    from deepinfer.backend import BackendInfo, NativeBackend

    ffi = abi.ffi
    lib = ffi.dlopen(str(cpu_lib))
    real = lib.deepinfer_plugin_info().get_api(1)
    api = ffi.new("DI_Api*")
    ffi.memmove(api, real, min(real.struct_size, ffi.sizeof("DI_Api")))
    api.abi_minor = minor
    api.struct_size = struct_size
    return NativeBackend(lib, api, BackendInfo(f"cpu1{minor}", "test", "cpu", str(cpu_lib), f"1.{minor}"))


def test_the_runtime_refuses_a_1_2_field_for_a_1_1_table(cpu_lib):
    """The CPU library's table presented as a 1.1 library's (abi_minor 1, the 1.1 struct_size): the
    runtime refuses sample's `probs` with a message that says why, and still runs sample without it."""
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.tensor import Tensor

    be = _cpu_presented_as(cpu_lib, 1, abi.ffi.offsetof("DI_Api", "spec_verify"))
    try:
        assert "spec_verify" not in be.ops() and "sample" in be.ops()
        logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
        kw = dict(logits=Tensor.from_numpy(logits), temperature=Tensor.from_numpy(np.zeros(1, np.float32)),
                  top_k=Tensor.from_numpy(np.zeros(1, np.int32)), top_p=Tensor.from_numpy(np.ones(1, np.float32)),
                  seeds=Tensor.from_numpy(np.zeros(1, np.uint64)), out=Tensor.empty((1,), "int32", fill=-1))
        for call in (lambda: be.sample(probs=Tensor.empty((1,), "f32"), **kw),
                     lambda: be.prepare("sample", probs=Tensor.empty((1,), "f32"), **kw)):
            with pytest.raises(UnsupportedOpError, match=r"`probs` is ABI 1\.2; backend 'cpu11' implements ABI 1\.1"):
                call()
        be.sample(**kw)
        assert kw["out"].numpy()[0] == 1
    finally:
        be.close()


# ---------------------------------------------------------------------------- 1.3 against 1.2


def _silu(v):
    return v / (1.0 + np.exp(-v))


def test_a_1_2_runtime_runs_the_1_3_extended_ops_on_the_current_library(cpu_lib):
    """A host with the 1.2 header sends the 1.2 DI_SiluMulArgs and DI_MLADecodeArgs. The current library
    takes those sizes and never reads past them: the bytes after them here hold what a 1.3 caller would
    have put in `limit` and `indices`, which must be ignored (no clipping, dense attention)."""
    f = _ffi(V1_2_TEXT)
    lib = f.dlopen(str(cpu_lib))
    info = lib.deepinfer_plugin_info()
    assert (info.abi_major, info.abi_minor) == (1, abi.ABI_MINOR)
    api = info.get_api(1)
    opts = f.new("DI_ContextOptions*", {"struct_size": f.sizeof("DI_ContextOptions")})
    ctx = f.new("DI_Context**")
    assert api.context_create(opts, ctx) == 0
    try:
        rng = np.random.default_rng(5)
        # silu_mul: a limit of 0.25 past the 1.2 struct would clip almost every element
        gate = (rng.standard_normal((3, 16)) * 3).astype(np.float32)
        up = (rng.standard_normal((3, 16)) * 3).astype(np.float32)
        out = np.full((3, 16), np.nan, np.float32)
        n12 = f.sizeof("DI_SiluMulArgs")
        assert n12 == abi.args_struct_size("silu_mul", 2) < abi.ffi.sizeof("DI_SiluMulArgs")
        buf = abi.ffi.new("DI_SiluMulArgs*")
        buf.limit = 0.25
        a = f.cast("DI_SiluMulArgs*", abi.ffi.cast("void*", buf))
        a.header.struct_size = n12
        for name, arr in (("gate", gate), ("up", up), ("out", out)):
            _host_tensor(f, getattr(a, name), arr, 2)
        st = api.silu_mul(ctx[0], a)
        assert st == 0, f.string(api.last_error(ctx[0]))
        np.testing.assert_allclose(out, _silu(gate.astype(np.float64)) * up, rtol=1e-5, atol=1e-6)
        a.header.struct_size = n12 + 4     # between two versions' sizes: no caller's
        assert api.silu_mul(ctx[0], a) == abi.INVALID_ARGUMENT

        # mla_decode: an `indices` descriptor selecting one position past the 1.2 struct
        T, H, Dn, Dr, Dv, Dc, NB, BS = 2, 2, 4, 2, 4, 8, 3, 4
        q = rng.standard_normal((T, H, Dn + Dr)).astype(np.float32)
        wkv_b = (rng.standard_normal((H * (Dn + Dv), Dc)) / 3).astype(np.float32)
        cache = rng.standard_normal((NB, BS, Dc + Dr)).astype(np.float32)
        table = np.array([[2, 0, 1]], np.int32)
        token_seq, kv_len = np.zeros(T, np.int32), np.array([7, 10], np.int32)
        idx = np.zeros((T, 1), np.int32)
        got = np.full((T, H, Dv), np.nan, np.float32)
        mbuf = abi.ffi.new("DI_MLADecodeArgs*")
        _host_tensor(abi.ffi, mbuf.indices, idx, 0)
        m = f.cast("DI_MLADecodeArgs*", abi.ffi.cast("void*", mbuf))
        m.header.struct_size = f.sizeof("DI_MLADecodeArgs")
        assert m.header.struct_size == abi.args_struct_size("mla_decode", 2)
        for name, arr, code in (("q", q, 2), ("wkv_b", wkv_b, 2), ("cache", cache, 2), ("block_table", table, 0),
                                ("token_seq", token_seq, 0), ("kv_len", kv_len, 0), ("out", got, 2)):
            _host_tensor(f, getattr(m, name), arr, code)
        m.scale = 0.4
        st = api.mla_decode(ctx[0], m)
        assert st == 0, f.string(api.last_error(ctx[0]))
        from deepinfer.reference import ReferenceBackend
        from deepinfer.tensor import Tensor
        want = Tensor.empty((T, H, Dv), "f32")
        ReferenceBackend().mla_decode(q=Tensor.from_numpy(q), wkv_b=Tensor.from_numpy(wkv_b),
                                      cache=Tensor.from_numpy(cache), block_table=Tensor.from_numpy(table),
                                      token_seq=Tensor.from_numpy(token_seq), kv_len=Tensor.from_numpy(kv_len),
                                      out=want, scale=0.4)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)
    finally:
        api.context_destroy(ctx[0])


def test_a_1_2_build_of_the_tiny_plugin_loads_and_passes_under_1_3(plugin_factory):
    """The tiny plugin built against the frozen 1.2 header says 1.2 and passes L0 and L1 under this
    runtime; 1.3's ops are not in its table, and the runtime refuses silu_mul's 1.3 `limit` for it
    unless it is 0 (what a 1.2 caller's struct holds there)."""
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.loader import load_library
    from deepinfer.tensor import Tensor

    lib = plugin_factory("libdeepinfer_tiny12.so", abi="1.2", TEST_NAME='"tiny12"')
    c = probe(lib)
    assert c.ok and c.abi_version == "1.2", c.reason
    assert not set(abi.API_V1_3_FIELDS) & set(c.ops) and "silu_mul" in c.ops
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False, only_ops=["silu_mul"])
    assert cert["passed"], summary(cert)
    # the suite does not hold the 1.3 cases against it: they are "unsupported", not failures
    l1 = cert["levels"]["L1"]["results"]
    assert any("limit" in r["case"] and r["status"] == "unsupported" for r in l1)
    assert any("limit" not in r["case"] and r["status"] == "pass" for r in l1)
    be = load_library(lib)
    try:
        g = Tensor.from_numpy(np.array([[-1.0, 3.0]], np.float32))
        u = Tensor.from_numpy(np.array([[2.0, -4.0]], np.float32))
        out = Tensor.empty((1, 2), "f32", fill=np.nan)
        for call in (lambda: be.silu_mul(gate=g, up=u, out=out, limit=1.0),
                     lambda: be.prepare("silu_mul", gate=g, up=u, out=out, limit=np.float32(1.0))):
            with pytest.raises(UnsupportedOpError,
                               match=r"`limit` is ABI 1\.3; backend 'tiny12' implements ABI 1\.2 and cannot read it"):
                call()
        be.silu_mul(gate=g, up=u, out=out, limit=0.0)
        np.testing.assert_allclose(out.numpy(), _silu(np.array([[-1.0, 3.0]])) * [[2.0, -4.0]], rtol=1e-6)
        with pytest.raises(UnsupportedOpError, match="does not implement hc_pre"):
            be.hc_pre(x=g)
    finally:
        be.close()


def test_a_current_build_of_the_tiny_plugin_clips_silu_mul(plugin_factory):
    """The tiny plugin rebuilt against the 1.3 header implements silu_mul's limit (L1's limit cases) and
    takes a 1.2 caller's smaller struct (L0's older-struct_size check)."""
    lib = plugin_factory("libdeepinfer_tiny13.so", abi="current", TEST_NAME='"tiny13"')
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False, only_ops=["silu_mul"])
    assert cert["passed"], summary(cert)
    l0 = {r["case"]: r["status"] for r in cert["levels"]["L0"]["results"] if r["op"] == "silu_mul"}
    older = [k for k in l0 if k.startswith("struct_size of ABI 1.2")]
    assert older and all(l0[k] == "pass" for k in older), l0
    assert any("limit" in r["case"] and r["status"] == "pass" for r in cert["levels"]["L1"]["results"])


def test_the_runtime_refuses_1_3_fields_for_a_1_2_table(cpu_lib):
    """The CPU library's table presented as a 1.2 library's: every 1.3 field of an older op is refused
    with a message that says why (a scalar only when it is not zero), and the 1.3 ops are not offered."""
    from deepinfer.conformance import cases as C
    from deepinfer.conformance.harness import Materialized
    from deepinfer.errors import UnsupportedOpError

    be = _cpu_presented_as(cpu_lib, 2, abi.ffi.offsetof("DI_Api", "hc_pre"))
    try:
        assert not set(abi.API_V1_3_FIELDS) & set(be.ops()) and "spec_verify" in be.ops()
        for op, fields in (("mla_decode", ["indices"]), ("moe_router", ["token_ids", "hash_table"]),
                           ("moe_experts", ["swiglu_limit"]), ("silu_mul", ["limit"])):
            case = C.a_full_case(op)
            m = Materialized(be, case)
            with pytest.raises(UnsupportedOpError, match=rf"`{fields[0]}` is ABI 1\.3; backend 'cpu12' implements "
                                                         rf"ABI 1\.2"):
                be.call(op, **m.kwargs)
            # without every field newer than 1.2 (the full case also sets 1.5's expert_map and misses)
            plain = C.without_fields(case, [f for f, m_ in abi.OP_SPECS[op].appended if m_ > 2])
            m = Materialized(be, plain)
            kw = dict(m.kwargs)
            if op in ("moe_experts", "silu_mul"):
                kw[fields[0]] = 0.0          # a zero scalar is what a 1.2 caller sends: allowed
            be.call(op, **kw)
    finally:
        be.close()


# ---------------------------------------------------------------------------- 1.4 against 1.3


def test_a_1_3_runtime_runs_the_current_library(cpu_lib):
    """A host with the 1.3 header loads the current library: the table is longer than the one it knows
    (it never reads the communicator entries), and a 1.3 op runs through the 1.3 structs."""
    f = _ffi(V1_3_TEXT)
    lib = f.dlopen(str(cpu_lib))
    info = lib.deepinfer_plugin_info()
    assert (info.abi_major, info.abi_minor) == (1, abi.ABI_MINOR)
    api = info.get_api(1)
    assert api.struct_size >= f.sizeof("DI_Api") + len(API_V1_4_FIELDS) * f.sizeof("void*")
    opts = f.new("DI_ContextOptions*", {"struct_size": f.sizeof("DI_ContextOptions")})
    ctx = f.new("DI_Context**")
    assert api.context_create(opts, ctx) == 0
    try:
        rng = np.random.default_rng(11)
        x = (rng.standard_normal((3, 16)) + 2).astype(np.float32)
        w = rng.standard_normal(16).astype(np.float32)
        b = rng.standard_normal(16).astype(np.float32)
        out = np.full((3, 16), np.nan, np.float32)
        a = f.new("DI_LayerNormArgs*")
        a.header.struct_size = f.sizeof("DI_LayerNormArgs")
        for name, arr in (("x", x), ("weight", w), ("bias", b), ("out", out)):
            _host_tensor(f, getattr(a, name), arr, 2)
        a.eps = 1e-5
        st = api.layernorm(ctx[0], a)
        assert st == 0, f.string(api.last_error(ctx[0]))
        x64 = x.astype(np.float64)
        want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * w + b
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    finally:
        api.context_destroy(ctx[0])


def test_a_1_3_build_of_the_tiny_plugin_loads_and_passes_under_1_4(plugin_factory):
    """The tiny plugin built against the frozen 1.3 header (TEST_COMM asks for communicators, which a 1.3
    header cannot have) says 1.3 and passes L0 and L1 under this runtime; the 1.4 ops are not in its table,
    and the backend says plainly that it has no communicators: a multi-rank run cannot start on it."""
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.loader import load_library
    from deepinfer.tensor import Tensor

    lib = plugin_factory("libdeepinfer_tiny13f.so", abi="1.3", TEST_NAME='"tiny13f"', TEST_COMM=None)
    c = probe(lib)
    assert c.ok and c.abi_version == "1.3", c.reason
    assert not set(API_V1_4_FIELDS) & set(c.ops) and "silu_mul" in c.ops
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False,
                           only_ops=["silu_mul", "all_reduce", "moe_dispatch"])
    assert cert["passed"], summary(cert)
    l0 = {r["case"]: r for r in cert["levels"]["L0"]["results"]}
    assert l0["1.4 entries: not offered by an older library"]["message"] == "ABI 1.3"
    assert not any(k.startswith("comm_unique_id") for k in l0)
    l1 = cert["levels"]["L1"]["results"]
    assert {r["op"] for r in l1 if r["status"] == "unsupported"} == {"all_reduce", "moe_dispatch"}
    assert any(r["op"] == "silu_mul" and r["status"] == "pass" for r in l1)
    be = load_library(lib)
    try:
        assert not be.supports_comm
        with pytest.raises(UnsupportedOpError, match=r"ABI 1\.3\) lacks comm_unique_id"):
            be.comm_unique_id()
        with pytest.raises(UnsupportedOpError, match="lacks comm_unique_id"):
            be.comm_create(bytes(128), 1, 0)
        x = Tensor.from_numpy(np.ones((2, 4), np.float32))
        with pytest.raises(UnsupportedOpError, match="does not implement all_reduce"):
            be.all_reduce(comm=None, x=x, out=x)
    finally:
        be.close()


def test_the_runtime_offers_no_communicator_for_a_1_3_table(cpu_lib):
    """The CPU library's table presented as a 1.3 library's (abi_minor 3, the 1.3 struct_size): the 1.4
    ops are not offered and neither are communicators, whatever lies past the table's end."""
    from deepinfer.errors import UnsupportedOpError

    be = _cpu_presented_as(cpu_lib, 3, abi.ffi.offsetof("DI_Api", "all_reduce"))
    try:
        assert not set(API_V1_4_FIELDS) & set(be.ops()) and "layernorm" in be.ops()
        assert not be.supports_comm
        with pytest.raises(UnsupportedOpError, match=r"backend 'cpu13' \(ABI 1\.3\) lacks comm_unique_id"):
            be.comm_create(bytes(128), 2, 0)
    finally:
        be.close()


def test_a_current_build_of_the_tiny_plugin_with_communicators_passes(plugin_factory):
    """tiny with TEST_COMM (one-rank communicators, the collectives as copies) passes L0's communicator
    checks and L1's collective cases; through the Backend a communicator is a Comm bound to its library."""
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.loader import load_library
    from deepinfer.reference import ReferenceBackend
    from deepinfer.tensor import Tensor

    lib = plugin_factory("libdeepinfer_tinycomm.so", abi="current", TEST_NAME='"tinycomm"', TEST_COMM=None)
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False, only_ops=COLLECTIVES)
    assert cert["passed"], summary(cert)
    l0 = {(r["op"], r["case"]): r for r in cert["levels"]["L0"]["results"]}
    assert l0[("*", "comm_unique_id / comm_create / comm_destroy: NULLs, nranks and rank out of range, "
                    "one-rank communicators")]["message"] == "two one-rank communicators created and destroyed"
    for op in COLLECTIVES:
        assert l0[(op, "comm NULL -> INVALID_ARGUMENT")]["status"] == "pass"
        assert l0[(op, "comm not made by comm_create (zero-filled, or arbitrary bytes) -> INVALID_ARGUMENT")][
            "status"] == "pass"
        assert l0[(op, "tensors that are not contiguous (column slices) -> INVALID_ARGUMENT")]["status"] == "pass"
    l1 = cert["levels"]["L1"]["results"]
    assert {r["op"] for r in l1 if r["status"] == "pass"} == set(COLLECTIVES)
    be = load_library(lib)
    try:
        assert be.supports_comm
        cid = be.comm_unique_id()
        assert len(cid) == 128 and cid != be.comm_unique_id()
        with pytest.raises(UnsupportedOpError, match="one rank only"):
            be.comm_create(cid, 2, 0)      # rank 0 of 2 would wait for rank 1: tiny says it cannot
        comm = be.comm_create(cid, 1, 0)
        assert (comm.nranks, comm.rank) == (1, 0)
        x = Tensor.from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
        out = Tensor.empty((2, 4), "f32", fill=np.nan)
        be.all_reduce(comm=comm, x=x, out=out)
        np.testing.assert_array_equal(out.numpy(), x.numpy())
        ref = ReferenceBackend()
        other = ref.comm_create(ref.comm_unique_id(), 1, 0)
        with pytest.raises(ValueError, match="comm belongs to 'reference'"):
            be.all_reduce(comm=other, x=x, out=out)
        comm.close()
        with pytest.raises(ValueError, match="comm was destroyed"):
            be.all_reduce(comm=comm, x=x, out=out)
    finally:
        be.close()


@pytest.mark.parametrize("variant", ["TEST_COMM_NO_CHECK", "TEST_COMM_NO_CREATE"])
def test_l0_fails_a_library_whose_communicators_break_the_rules(plugin_factory, variant):
    """TEST_COMM_NO_CHECK: all_reduce trusts any non-NULL comm, so a forged one runs (all_gather and
    all_to_all happen to refuse it for its rank count). TEST_COMM_NO_CREATE: the collectives without
    comm_create (the six entries are all or none); L1 then does not run them at all."""
    lib = plugin_factory(f"libdeepinfer_tiny_{variant.lower()}.so", abi="current", TEST_NAME='"tinybad"',
                         TEST_COMM=None, **{variant: None})
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False, only_ops=COLLECTIVES)
    assert not cert["passed"]
    failed = {(r["op"], r["case"]) for r in cert["levels"]["L0"]["results"] if r["status"] != "pass"}
    l1 = cert["levels"]["L1"]["results"]
    if variant == "TEST_COMM_NO_CHECK":
        assert failed == {("all_reduce", "comm not made by comm_create (zero-filled, or arbitrary bytes) -> "
                                         "INVALID_ARGUMENT")}, failed
        assert all(r["status"] == "pass" for r in l1)
    else:
        assert ("*", "1.4 communicators: comm_unique_id, comm_create, comm_destroy and the three collectives all "
                     "six or none") in failed
        assert {op for op, case in failed if case == "a collective: its checks need a one-rank communicator"} == \
            set(COLLECTIVES)
        assert l1 and all(r["status"] == "unsupported" and "has no communicators" in r["message"] for r in l1)


# ---------------------------------------------------------------------------- 1.5 against 1.4


def _moe_inputs(rng, T, E, K, H, I):
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    gate = [(rng.standard_normal((I, H)) / np.sqrt(H)).astype(np.float32) for _ in range(E)]
    up = [(rng.standard_normal((I, H)) / np.sqrt(H)).astype(np.float32) for _ in range(E)]
    down = [(rng.standard_normal((H, I)) / np.sqrt(I)).astype(np.float32) for _ in range(E)]
    return x, ids, wts, gate, up, down


def _reference_moe(x, ids, wts, gate, up, down, **extra) -> np.ndarray:
    from deepinfer.reference import ReferenceBackend
    from deepinfer.tensor import Tensor

    T = Tensor.from_numpy
    out = Tensor.empty(x.shape, "f32")
    ReferenceBackend().moe_experts(x=T(x), topk_ids=T(ids), topk_weights=T(wts), num_experts=len(gate), accumulate=0,
                                   w_gate=[T(w) for w in gate], w_up=[T(w) for w in up], w_down=[T(w) for w in down],
                                   out=out, **extra)
    return out.numpy()


def test_a_1_4_runtime_runs_moe_experts_on_the_current_library(cpu_lib):
    """A host with the 1.4 header sends the 1.4 DI_MoEExpertsArgs (it ends after swiglu_limit). The current
    library takes that struct_size and never reads past it: the bytes after it here hold what a 1.5 caller
    would have put in `expert_map` (a permutation) and `misses`, which must be ignored (topk_ids are
    descriptor ids, misses never written). The 1.4 host reads the table's prefix (1.6 appended an entry)."""
    f = _ffi(V1_4_TEXT)
    lib = f.dlopen(str(cpu_lib))
    info = lib.deepinfer_plugin_info()
    assert (info.abi_major, info.abi_minor) == (1, abi.ABI_MINOR)
    api = info.get_api(1)
    assert api.struct_size == abi.ffi.sizeof("DI_Api") > f.sizeof("DI_Api")
    opts = f.new("DI_ContextOptions*", {"struct_size": f.sizeof("DI_ContextOptions")})
    ctx = f.new("DI_Context**")
    assert api.context_create(opts, ctx) == 0
    try:
        rng = np.random.default_rng(15)
        T, E, K, H, I = 4, 3, 2, 16, 8
        x, ids, wts, gate, up, down = _moe_inputs(rng, T, E, K, H, I)
        table = np.array([2, 0, 1], np.int32)
        misses = np.full((T, K), 7, np.int32)
        out = np.full((T, H), np.nan, np.float32)
        n14 = f.sizeof("DI_MoEExpertsArgs")
        assert n14 == abi.args_struct_size("moe_experts", 4) == abi.ffi.offsetof("DI_MoEExpertsArgs", "expert_map")
        # the 1.4 struct followed by a complete, valid expert_map and misses
        buf = abi.ffi.new("DI_MoEExpertsArgs*")
        _host_tensor(abi.ffi, buf.expert_map, table, 0)
        _host_tensor(abi.ffi, buf.misses, misses, 0)
        a = f.cast("DI_MoEExpertsArgs*", abi.ffi.cast("void*", buf))
        a.header.struct_size = n14
        for name, arr, code in (("x", x, 2), ("topk_ids", ids, 0), ("topk_weights", wts, 2), ("out", out, 2)):
            _host_tensor(f, getattr(a, name), arr, code)
        arrays = []
        for name, ws in (("w_gate", gate), ("w_up", up), ("w_down", down)):
            arr = f.new("DI_Tensor[]", E)
            for e, w in enumerate(ws):
                _host_tensor(f, arr[e], w, 2)
            arrays.append(arr)
            setattr(a, name, arr)
        a.num_experts, a.accumulate = E, 0
        st = api.moe_experts(ctx[0], a)
        assert st == 0, f.string(api.last_error(ctx[0]))
        assert np.all(misses == 7), "misses lies past the caller's struct_size but was written"
        want = _reference_moe(x, ids, wts, gate, up, down)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        # the map would have changed the result: the library really did not read it
        from deepinfer.tensor import Tensor
        mapped = _reference_moe(x, ids, wts, gate, up, down, expert_map=Tensor.from_numpy(table),
                                misses=Tensor.empty((T, K), "int32"))
        assert not np.allclose(mapped, want, rtol=1e-2)
        a.header.struct_size = n14 + 8     # between two versions' sizes: no caller's
        assert api.moe_experts(ctx[0], a) == abi.INVALID_ARGUMENT
    finally:
        api.context_destroy(ctx[0])


def test_a_1_4_build_of_the_tiny_plugin_loads_and_passes_under_1_5(plugin_factory):
    """The tiny plugin built against the frozen 1.4 header (with its one-rank communicators) says 1.4 and
    passes L0 and L1 under this runtime, communicator checks included: a 1.4 library is a library of this
    runtime. It has no moe_experts, so no 1.5 case applies to it."""
    from deepinfer.loader import load_library

    lib = plugin_factory("libdeepinfer_tiny14f.so", abi="1.4", TEST_NAME='"tiny14f"', TEST_COMM=None)
    c = probe(lib)
    assert c.ok and c.abi_version == "1.4", c.reason
    assert set(API_V1_4_FIELDS[:3]) <= set(c.ops) and "moe_experts" not in c.ops
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile=PROFILE, isolate=False,
                           only_ops=["silu_mul", "all_reduce", "moe_experts"])
    assert cert["passed"], summary(cert)
    l0 = {r["case"]: r for r in cert["levels"]["L0"]["results"]}
    assert "1.4 entries: not offered by an older library" not in l0
    assert l0["1.4 communicators: comm_unique_id, comm_create, comm_destroy and the three collectives all six or "
              "none"]["status"] == "pass"
    older = [k for k, r in l0.items() if r["op"] == "silu_mul" and k.startswith("struct_size of ABI 1.2")]
    assert older and all(l0[k]["status"] == "pass" for k in older)
    l1 = cert["levels"]["L1"]["results"]
    assert {r["op"] for r in l1 if r["status"] == "pass"} == {"silu_mul", "all_reduce"}
    assert {r["op"] for r in l1 if r["status"] == "unsupported"} == {"moe_experts"}
    be = load_library(lib)
    try:
        assert be.abi_minor == 4 and be.supports_comm
    finally:
        be.close()


def test_the_runtime_refuses_1_5_fields_for_a_1_4_table(cpu_lib):
    """The CPU library's table presented as a 1.4 library's (abi_minor 4, the 1.4 table's size):
    moe_experts' expert_map (read) and misses (written) are refused with a message that
    says why, through call and prepare, and the suite calls a mapped case "unsupported"; the same call
    without them runs (1.3's swiglu_limit included)."""
    from deepinfer.conformance import cases as C
    from deepinfer.conformance.harness import Materialized, ReferenceCache, check_case
    from deepinfer.errors import UnsupportedOpError
    from deepinfer.reference import ReferenceBackend

    be = _cpu_presented_as(cpu_lib, 4, _ffi(V1_4_TEXT).sizeof("DI_Api"))
    try:
        # the 1.4 table ends before 1.6's fused op
        assert be.abi_minor == 4 and be.ops() == abi.OP_NAMES[:abi.const("DI_OP_COUNT_V1_5")]
        case = C.a_full_case("moe_experts")
        m = Materialized(be, case)
        for call in (lambda kw: be.call("moe_experts", **kw), lambda kw: be.prepare("moe_experts", **kw)):
            with pytest.raises(UnsupportedOpError, match=r"`expert_map` is ABI 1\.5; backend 'cpu14' implements ABI "
                                                         r"1\.4 and cannot read it"):
                call(m.kwargs)
            only_misses = {k: v for k, v in m.kwargs.items() if k != "expert_map"}
            with pytest.raises(UnsupportedOpError, match=r"`misses` is ABI 1\.5; backend 'cpu14' implements ABI "
                                                         r"1\.4 and cannot write it"):
                call(only_misses)
        poisoned = np.ascontiguousarray(m.read("misses")).view(np.uint8)
        assert np.all(poisoned == 0x7F), "a refused call wrote misses"
        plain = C.without_fields(case, ["expert_map", "misses"])
        assert plain.scalars["swiglu_limit"]
        m2 = Materialized(be, plain)
        be.call("moe_experts", **m2.kwargs)
        ref = ReferenceCache(ReferenceBackend())
        np.testing.assert_allclose(m2.read("out"), ref.results(plain)["out"], rtol=1e-4, atol=1e-5)
        mapped = [c for c in C.cases_for("moe_experts", "quick") if "expert_map" in c.tensors][:2]
        for c in mapped:
            o = check_case(be, c, ref)
            assert o.status == "unsupported" and "newer than the library's ABI 1.4" in o.message, o.message
    finally:
        be.close()


def test_the_current_library_takes_the_map_and_a_1_4_callers_struct(cpu_lib):
    """The CPU library (1.5) under L0: a 1.4 caller's struct_size is accepted with the map's bytes past
    it ignored (misses not written, the result of the same call without the map), and expert_map and
    misses are both or neither."""
    cert = run_conformance(str(cpu_lib), levels=("L0",), profile=PROFILE, isolate=False, only_ops=["moe_experts"])
    l0 = {r["case"]: r for r in cert["levels"]["L0"]["results"] if r["op"] == "moe_experts"}
    n14 = abi.args_struct_size("moe_experts", 4)
    for case in (f"struct_size of ABI 1.4 ({n14}) -> accepted, fields of 1.5 ignored",
                 "expert_map without misses -> INVALID_ARGUMENT (1.5: both or neither)",
                 "misses without expert_map -> INVALID_ARGUMENT (1.5: both or neither)"):
        assert l0[case]["status"] == "pass", l0[case]
