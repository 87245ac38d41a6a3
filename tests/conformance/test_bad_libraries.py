"""Broken libraries and malformed calls: each is rejected with a specific message, nothing crashes."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import run_conformance, summary
from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import Materialized
from deepinfer.errors import BackendCallError, BackendLoadError, UnsupportedOpError
from deepinfer.loader import candidates, load_library, probe
from deepinfer.tensor import Quant, Tensor

ffi = abi.ffi


@pytest.fixture(scope="module")
def bad_libs(plugin_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    text = d / "libdeepinfer_text.so"
    text.write_text("this is not a shared library\n")
    truncated = d / "libdeepinfer_truncated.so"
    truncated.write_bytes(b"\x7fELF" + b"\x00" * 60)
    return {
        "text": (text, "not a shared library"),
        "truncated": (truncated, "cannot be loaded"),
        "no_bootstrap": (plugin_factory("libdeepinfer_nosym.so", TEST_NO_BOOTSTRAP=None),
                         "does not export deepinfer_plugin_info"),
        "abi0": (plugin_factory("libdeepinfer_abi0.so", TEST_ABI_MAJOR=0, TEST_NAME='"abizero"'),
                 "built for deepinfer ABI 0.0"),
        "abi2": (plugin_factory("libdeepinfer_abi2.so", TEST_ABI_MAJOR=2, TEST_NAME='"abitwo"'),
                 "built for deepinfer ABI 2.0"),
    }


@pytest.mark.parametrize("kind", ["text", "truncated", "no_bootstrap", "abi0", "abi2"])
def test_bad_library_is_rejected_with_a_reason(bad_libs, kind):
    path, why = bad_libs[kind]
    c = probe(path)
    assert not c.ok and why in c.reason, c.reason
    assert str(path) in c.reason
    with pytest.raises(BackendLoadError, match=why):
        load_library(path)


def test_version_mismatch_messages_say_what_to_do(bad_libs):
    assert "rebuild the library against abi/deepinfer_abi.h 1.x" in probe(bad_libs["abi0"][0]).reason
    assert "upgrade deepinfer" in probe(bad_libs["abi2"][0]).reason


def test_rejected_candidates_are_listed_last_with_reasons(bad_libs, tiny_lib, monkeypatch):
    import os

    paths = [str(p) for p, _ in bad_libs.values()] + [str(tiny_lib)]
    monkeypatch.setenv("DEEPINFER_BACKEND_PATH", os.pathsep.join(paths))
    found = candidates()
    ours = [c for c in found if c.path in paths]
    assert len(ours) == len(paths)
    ok = [c for c in found if c.ok]
    rejected = [c for c in found if not c.ok]
    assert found == ok + rejected          # every usable one ranks before every rejected one
    assert any(c.name == "tiny" for c in ok)
    for p, why in bad_libs.values():
        c = next(c for c in rejected if c.path == str(p))
        assert why in c.reason and c.summary().startswith("REJECTED")


@pytest.mark.parametrize("kind", ["text", "abi2"])
def test_conformance_of_a_bad_library_fails_cleanly(bad_libs, kind, tmp_path):
    path, why = bad_libs[kind]
    cert = run_conformance(str(path), levels=("L0", "L1"), out=str(tmp_path / "c.json"), profile="quick")
    assert cert["passed"] is False
    assert why in cert["library"]["load_error"]
    for lv in ("L0", "L1"):
        assert cert["levels"][lv]["counts"] == {"error": 1}
        assert why in cert["levels"][lv]["results"][0]["message"]
    assert (tmp_path / "c.json").is_file()


def test_a_crashing_library_is_reported_not_fatal(plugin_factory):
    """A plugin that skips argument checks segfaults on NULL data; the suite records the crash, resumes
    after it, and still reports everything else."""
    lib = plugin_factory("libdeepinfer_novalid.so", TEST_NO_VALIDATION=None, TEST_NAME='"novalid"')
    cert = run_conformance(str(lib), levels=("L0", "L1"), profile="quick")
    assert cert["passed"] is False
    l0 = cert["levels"]["L0"]["results"]
    crashes = [r for r in l0 if r["format"] == "crash"]
    assert crashes and all("crashed the process (signal" in r["message"] for r in crashes)
    assert any("data NULL" in r["case"] for r in crashes)
    assert any(r["status"] == "fail" and "got OK, expected INVALID_ARGUMENT" in r.get("message", "") for r in l0)
    # checks after each crash still ran, and the numerics of what it claims still pass
    assert sum(r["status"] == "pass" for r in l0) > 30
    assert cert["levels"]["L1"]["passed"], summary(cert)


# ---------------------------------------------------------------------------- malformed calls


@pytest.fixture(params=["tiny", "cpu"])
def lib_backend(request, tiny_lib):
    path = tiny_lib if request.param == "tiny" else request.getfixturevalue("cpu_lib")
    be = load_library(path)
    yield be
    be.close()


def _f32(shape, v=1.0):
    return Tensor.from_numpy(np.full(shape, v, np.float32))


def test_wrong_dtype_is_rejected(lib_backend):
    with pytest.raises(BackendCallError) as e:
        lib_backend.add(a=_f32((2, 4)), b=Tensor.from_numpy(np.ones((2, 4), np.int32)), out=_f32((2, 4)))
    assert e.value.status_name in ("INVALID_ARGUMENT", "UNIMPLEMENTED") and e.value.message


def test_wrong_shape_is_rejected_and_names_the_argument(lib_backend):
    out = Tensor.empty((2, 4), "f32", fill=np.nan)
    with pytest.raises(BackendCallError) as e:
        lib_backend.add(a=_f32((2, 4)), b=_f32((2, 5)), out=out)
    assert e.value.status_name == "INVALID_ARGUMENT"
    assert "b" in e.value.message or "shape" in e.value.message
    assert np.isnan(out.numpy()).all()        # validated before writing


def test_bad_last_stride_is_rejected(lib_backend):
    buf = np.ones(16, np.float32)
    strided = Tensor(buf, (2, 4), "f32", strides=(8, 2))
    with pytest.raises(BackendCallError) as e:
        lib_backend.add(a=strided, b=_f32((2, 4)), out=_f32((2, 4)))
    assert e.value.status_name == "INVALID_ARGUMENT" and "stride" in e.value.message


def test_null_pointers_are_invalid_argument_with_a_message(lib_backend):
    api, ctx = lib_backend._api, lib_backend._ctx
    assert api.add(ctx, ffi.NULL) == abi.INVALID_ARGUMENT
    assert ffi.string(api.last_error(ctx))
    m = Materialized(lib_backend, C.binary("add", 1, (2, 3), "f32"))
    args, keep = lib_backend._marshal("add", m.kwargs)
    assert api.add(ffi.NULL, args) == abi.INVALID_ARGUMENT
    assert ffi.string(api.last_error(ffi.NULL))
    args.a.data = ffi.NULL
    assert api.add(ctx, args) == abi.INVALID_ARGUMENT
    assert b"a" in ffi.string(api.last_error(ctx))


def test_unsupported_quant_format_is_unimplemented(lib_backend):
    if lib_backend.has_op("dequantize"):
        case = C.dequantize(5, (2, 64), "int4/g32/sym/f32")
        m = Materialized(lib_backend, case)
        args, keep = lib_backend._marshal("dequantize", m.kwargs)
        ffi.cast("DI_Quant*", args.x.quant).scheme = 99
        assert lib_backend._api.dequantize(lib_backend._ctx, args) == abi.UNIMPLEMENTED
        assert ffi.string(lib_backend._api.last_error(lib_backend._ctx))
    else:
        # tiny takes plain values only: a quantized operand is a format it does not implement
        q = Tensor.from_numpy(np.ones((2, 4), np.int8), quant=Quant(_f32((2, 1)), (1, 0)))
        with pytest.raises(UnsupportedOpError) as e:
            lib_backend.add(a=q, b=_f32((2, 4)), out=_f32((2, 4)))
        assert "quantized" in e.value.message
