"""The loader: discovery order, ranking by score, rejected candidates with reasons, the fallback policy,
unload/reload, and the pinned v1 struct layout of deepinfer_abi.h.

Plugins are compiled from tests/conformance/plugins/tiny_plugin.c with -D switches (name, score, ABI
major), so these tests need a C compiler and skip without one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))
from plugin_build import ABI_DIR, PLUGINS, compile_shared  # noqa: E402  (tests/conformance/)

from deepinfer import abi, discovery, loader  # noqa: E402
from deepinfer.backend import FallbackBackend, NativeBackend  # noqa: E402
from deepinfer.errors import BackendLoadError, UnsupportedOpError  # noqa: E402
from deepinfer.tensor import Tensor  # noqa: E402

LAYOUT_JSON = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1.json"        # 1.0, frozen
LAYOUT_JSON_V1_1 = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_1.json"   # 1.1, frozen
LAYOUT_JSON_V1_2 = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_2.json"   # 1.2, frozen
LAYOUT_JSON_V1_3 = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_3.json"   # 1.3, frozen
LAYOUT_JSON_V1_4 = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_4.json"   # 1.4, frozen
LAYOUT_JSON_V1_5 = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_5.json"   # 1.5, frozen
LAYOUT_JSON_V1_6 = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_6.json"   # 1.6, frozen
LAYOUT_JSON_CURRENT = Path(__file__).resolve().parent / "conformance" / "abi_layout_v1_7.json"
ffi = abi.ffi


@pytest.fixture(scope="module")
def build(cc, tmp_path_factory):
    """build(dirname, name, score=None, abi_major=None) -> a tiny plugin libdeepinfer_<name>.so in its own dir."""
    root = tmp_path_factory.mktemp("loader")

    def make(dirname: str, name: str, score=None, abi_major=None, score_reason=None) -> Path:
        defines = {"TEST_NAME": f'"{name}"'}
        if score is not None:
            defines["TEST_SCORE"] = score
        if score_reason is not None:
            defines["TEST_SCORE_REASON"] = f'"{score_reason}"'
        if abi_major is not None:
            defines["TEST_ABI_MAJOR"] = abi_major
        out = root / dirname / f"libdeepinfer_{name}.so"
        if not out.exists():
            compile_shared(cc, PLUGINS / "tiny_plugin.c", out, defines)
        return out

    return make


class _EP:
    def __init__(self, name, fn):
        self.name, self._fn = name, fn

    def load(self):
        return self._fn


@pytest.fixture
def isolated(monkeypatch):
    """No env var, no entry points, no bundled libraries unless a test adds them."""
    monkeypatch.delenv(loader.ENV_PATH, raising=False)
    monkeypatch.setattr(discovery, "bundled_lib_dirs", lambda: [])
    eps: list = []
    import importlib.metadata as md

    monkeypatch.setattr(md, "entry_points", lambda group=None, **kw: [e for e in eps if group == loader.ENTRY_POINT_GROUP])
    return eps


# ---------------------------------------------------------------------------- discovery


def test_discovery_order_explicit_env_entry_point_bundled(build, isolated, monkeypatch):
    a = build("explicit", "alpha")
    b = build("env", "beta")
    c = build("ep", "gamma")
    d = build("bundled", "delta")
    monkeypatch.setenv(loader.ENV_PATH, str(b.parent))             # a folder: every libdeepinfer_*.so in it
    isolated.append(_EP("gamma-pkg", lambda: str(c)))                 # an entry point returning a path
    monkeypatch.setattr(discovery, "bundled_lib_dirs", lambda: [d.parent])
    found = loader.discover([a])
    assert [(p.name, src) for p, src in found] == [
        (a.name, "explicit"), (b.name, "env"), (c.name, "entry-point"), (d.name, "bundled")]


def test_same_library_from_two_sources_is_one_candidate(build, isolated, monkeypatch):
    a = build("explicit", "alpha")
    monkeypatch.setenv(loader.ENV_PATH, os.pathsep.join([str(a), str(a.parent)]))
    found = loader.discover([a])
    assert found == [(a, "explicit")]


def test_entry_point_returning_a_list_and_a_broken_one(build, isolated, caplog):
    b, c = build("env", "beta"), build("ep", "gamma")
    isolated.append(_EP("broken", lambda: 1 / 0))
    isolated.append(_EP("two", lambda: [str(b), Path(c)]))
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        found = loader.discover()
    assert [(p.name, s) for p, s in found] == [(b.name, "entry-point"), (c.name, "entry-point")]
    assert any("entry point broken failed" in r.getMessage() for r in caplog.records)


def test_env_var_takes_files_and_folders_and_missing_paths(build, isolated, monkeypatch, tmp_path):
    b = build("env", "beta")
    missing = tmp_path / "libdeepinfer_missing.so"
    monkeypatch.setenv(loader.ENV_PATH, os.pathsep.join([str(b), str(missing), ""]))
    cands = {Path(c.path).name: c for c in loader.candidates() if c.path}
    assert cands[b.name].ok and cands[b.name].source == "env"
    assert not cands[missing.name].ok and "no such file" in cands[missing.name].reason


# ---------------------------------------------------------------------------- ranking


def test_a_negative_score_shows_the_librarys_reason(build, isolated, monkeypatch):
    # score() < 0 with a reason in last_error(NULL): the GPU libraries say why (no driver, wrong arch)
    why = build("why", "nodev", score=-1, score_reason="no usable ROCm device: hipErrorNoDevice")
    mute = build("mute", "mute", score=-1)
    monkeypatch.setenv(loader.ENV_PATH, os.pathsep.join([str(why), str(mute)]))
    by = {Path(c.path).name: c for c in loader.candidates() if c.path}
    assert not by[why.name].ok and not by[mute.name].ok
    assert by[why.name].reason.endswith("(score < 0): no usable ROCm device: hipErrorNoDevice")
    assert by[mute.name].reason.endswith("(score < 0)")


def test_a_missing_vendor_runtime_is_named(cc, isolated, tmp_path, monkeypatch):
    # a library linked against a runtime the machine lacks fails in dlopen; the reason says which and what to do
    # (a soname no machine has, so an installed ROCm cannot satisfy it)
    rt = tmp_path / "rt"
    compile_shared(cc, PLUGINS / "tiny_plugin.c", rt / "libamdhip64.so.99", {},
                   extra=["-Wl,-soname,libamdhip64.so.99"])
    lib = compile_shared(cc, PLUGINS / "tiny_plugin.c", tmp_path / "libdeepinfer_hip.so", {"TEST_NAME": '"hip"'},
                         extra=[f"-L{rt}", "-Wl,--no-as-needed", "-l:libamdhip64.so.99"])  # DT_NEEDED libamdhip64.so.99, not on the path
    monkeypatch.setenv(loader.ENV_PATH, str(lib))
    c = next(c for c in loader.candidates() if c.path == str(lib))
    assert not c.ok and "libamdhip64.so.99" in c.reason and "ROCm runtime is missing" in c.reason, c.reason


def test_ranking_by_score_and_rejections_last(build, isolated, monkeypatch):
    lo = build("rank", "lo", score=5)
    hi = build("rank", "hi", score=50)
    noscore = build("rank", "plain")            # no score(): the default for a CPU library (10)
    neg = build("rank", "cannot", score=-1)
    bad = build("rank", "future", abi_major=2)
    monkeypatch.setenv(loader.ENV_PATH, str(lo.parent))
    found = loader.candidates()
    names = [c.name for c in found]
    assert names[:4] == ["hi", "plain", "lo", "reference"], [c.summary() for c in found]
    by = {c.name: c for c in found}
    assert (by["hi"].score, by["plain"].score, by["lo"].score, by["reference"].score) == (50, 10, 5, 0)
    rejected = found[4:]
    assert {Path(c.path).name for c in rejected} == {neg.name, bad.name}
    assert all(not c.ok and c.reason for c in rejected)
    assert "score < 0" in next(c for c in rejected if c.path == str(neg)).reason
    assert f"ABI 2.{abi.ABI_MINOR}" in next(c for c in rejected if c.path == str(bad)).reason
    # the best usable library is what get_backend() gives without a name
    be = loader.get_backend()
    try:
        assert isinstance(be, NativeBackend) and be.name == "hi"
    finally:
        be.close()


def test_get_backend_by_name_and_unknown_name(build, isolated, monkeypatch):
    lo = build("rank", "lo", score=5)
    monkeypatch.setenv(loader.ENV_PATH, str(lo.parent))
    be = loader.get_backend("lo")
    try:
        assert be.name == "lo" and be.info.path == str(lo)
    finally:
        be.close()
    with pytest.raises(BackendLoadError, match="'nosuch' is not available.*Available: .*lo"):
        loader.get_backend("nosuch")


def test_nothing_found_means_the_reference(isolated):
    assert loader.get_backend().name == "reference"
    only = loader.candidates()
    assert [c.name for c in only] == ["reference"] and only[0].ops == abi.OP_NAMES


# ---------------------------------------------------------------------------- fallback policy


def test_no_fallback_unless_asked(build, isolated):
    tiny = build("fb", "tiny")
    be = loader.get_backend(str(tiny))
    try:
        assert isinstance(be, NativeBackend)
        with pytest.raises(UnsupportedOpError, match="does not implement rmsnorm"):
            be.rmsnorm(x=Tensor.from_numpy(np.ones((1, 4), np.float32)),
                       weight=Tensor.from_numpy(np.ones(4, np.float32)), out=Tensor.empty((1, 4), "f32"), eps=1e-6)
    finally:
        be.close()


def test_fallback_runs_missing_ops_on_the_reference_with_one_warning(build, isolated, caplog):
    tiny = build("fb", "tiny")
    be = loader.get_backend(str(tiny), fallback=True)
    assert isinstance(be, FallbackBackend)
    assert be.ops() == abi.OP_NAMES
    x = Tensor.from_numpy(np.array([[3.0, 4.0]], np.float32))
    w = Tensor.from_numpy(np.ones(2, np.float32))
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        for _ in range(3):
            out = Tensor.empty((1, 2), "f32", fill=np.nan)
            be.rmsnorm(x=x, weight=w, out=out, eps=0.0)
            np.testing.assert_allclose(out.numpy(), [[3 / np.sqrt(12.5), 4 / np.sqrt(12.5)]], rtol=1e-6)
        s = Tensor.empty((1, 2), "f32", fill=np.nan)
        be.add(a=x, b=x, out=s)                     # tiny has add: no fallback, no warning
    np.testing.assert_array_equal(s.numpy(), [[6.0, 8.0]])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "lacks rmsnorm" in warnings[0] and "reference" in warnings[0]
    be.primary.close()


# ---------------------------------------------------------------------------- unload / reload


def test_close_all_contexts_and_load_again(build, isolated):
    tiny = build("fb", "tiny")
    a, b = loader.load_library(tiny), loader.load_library(tiny)
    a.close()
    b.close()
    c = loader.load_library(tiny)
    try:
        out = Tensor.empty((2,), "f32", fill=np.nan)
        c.mul(a=Tensor.from_numpy(np.array([2.0, 3.0], np.float32)), b=Tensor.from_numpy(np.array([4.0, 5.0], np.float32)),
              out=out)
        np.testing.assert_array_equal(out.numpy(), [8.0, 15.0])
    finally:
        c.close()


# ---------------------------------------------------------------------------- the pinned struct layout


def layout_from_cffi() -> dict:
    """Sizes and field offsets of every struct of the header, as cffi parses it."""
    typedefs, _, _ = ffi.list_types()
    structs = {}
    for name in sorted(typedefs):
        t = ffi.typeof(name)
        if t.kind != "struct" or t.fields is None:   # opaque handles: DI_Context, DI_Graph, DI_Comm
            continue
        structs[name] = {"size": ffi.sizeof(name), "align": ffi.alignof(name),
                         "fields": {f: ffi.offsetof(name, f) for f, _ in t.fields}}
    enums = {}
    for m in re.finditer(r"enum\s+(\w+)\s*\{", abi.HEADER_TEXT):
        enum = ffi.typeof(f"enum {m.group(1)}")
        enums[m.group(1)] = dict(sorted(enum.relements.items(), key=lambda kv: kv[1]))
    return {"abi_version": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", "max_dims": abi.MAX_DIMS, "structs": structs,
            "enums": enums}


def layout_from_c(cc: str, tmp_path: Path, names: dict) -> dict:
    """The same numbers from the C compiler (sizeof / _Alignof / offsetof)."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "deepinfer_abi.h"', "int main(void) {"]
    for name, fields in names.items():
        lines.append(f'    printf("%s size %zu\\n", "{name}", sizeof({name}));')
        lines.append(f'    printf("%s align %zu\\n", "{name}", (size_t)_Alignof({name}));')
        for f in fields:
            lines.append(f'    printf("%s .{f} %zu\\n", "{name}", offsetof({name}, {f}));')
    lines += ["    return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    p = subprocess.run([cc, "-std=c11", "-I", str(ABI_DIR), str(src), "-o", str(exe)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    structs: dict = {}
    for line in out.splitlines():
        name, what, value = line.split()
        s = structs.setdefault(name, {"size": 0, "align": 0, "fields": {}})
        if what in ("size", "align"):
            s[what] = int(value)
        else:
            s["fields"][what[1:]] = int(value)
    return structs


def test_abi_layout_is_pinned(cc, tmp_path):
    """The compiler and cffi agree on every struct, the current version matches its pinned table, and
    it extends 1.0 to 1.6 compatibly: every struct of theirs keeps its field offsets and its size (an
    args struct may grow only by DI_ARGS_SINCE fields, and its old size stays a valid struct_size),
    DI_Api only grows at the end, and no enum value moves."""
    if ffi.sizeof("void*") != 8:
        pytest.skip("the pinned layouts are LP64 (64-bit Linux / macOS)")
    from_cffi = layout_from_cffi()
    if os.environ.get("DEEPINFER_UPDATE_ABI_LAYOUT") == "1":   # only when a new ABI version is cut on purpose
        LAYOUT_JSON_CURRENT.write_text(json.dumps(from_cffi, indent=1) + "\n")
    from_c = layout_from_c(cc, tmp_path, {n: list(s["fields"]) for n, s in from_cffi["structs"].items()})
    # the compiler and cffi agree (cffi reads the same header; a disagreement is a cdef problem)
    assert from_c == from_cffi["structs"]
    pinned = json.loads(LAYOUT_JSON_CURRENT.read_text())
    assert pinned["abi_version"] == f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", \
        "a new ABI minor needs its own pinned table (DEEPINFER_UPDATE_ABI_LAYOUT=1, reviewed)"
    assert from_cffi == pinned, "the layout changed without a new ABI version"
    # args structs that gained fields after their op (DI_ARGS_SINCE), by C name
    appended = {abi.OP_SPECS[op].struct: abi.OP_SPECS[op] for op in abi.OP_NAMES if abi.OP_SPECS[op].appended}
    for path, version in ((LAYOUT_JSON, "1.0"), (LAYOUT_JSON_V1_1, "1.1"), (LAYOUT_JSON_V1_2, "1.2"),
                          (LAYOUT_JSON_V1_3, "1.3"), (LAYOUT_JSON_V1_4, "1.4"),
                          (LAYOUT_JSON_V1_5, "1.5"), (LAYOUT_JSON_V1_6, "1.6")):
        old_pin = json.loads(path.read_text())
        assert old_pin["abi_version"] == version
        minor = int(version.split(".")[1])
        for name, old in old_pin["structs"].items():
            new = from_cffi["structs"][name]
            for f, off in old["fields"].items():
                assert new["fields"].get(f) == off, f"{name}.{f} moved or vanished since {version}"
            added = [f for f in new["fields"] if f not in old["fields"]]
            assert all(new["fields"][f] >= max(old["fields"].values()) for f in added), f"{name}: a field was inserted"
            if name == "DI_Api":
                continue
            spec = appended.get(name)
            if spec is None:
                assert (new["size"], new["align"]) == (old["size"], old["align"]), \
                    f"{name} changed size since {version}: {old['size']} -> {new['size']} (its libraries would reject it)"
            else:
                # the struct grew by DI_ARGS_SINCE fields only: a caller of `version` still sends its old size,
                # which the library accepts (fields past it are absent)
                assert abi.args_struct_size(spec.name, minor) == old["size"], name
                assert all(spec.field_since(f) > minor or f.startswith("reserved") for f in added), name
            if version == "1.0":
                assert all(f.startswith("reserved") or (spec and spec.field_since(f) > 1) for f in added), \
                    f"{name}: 1.1 may only name its padding"
        for enum, values in old_pin["enums"].items():
            for k, v in values.items():
                assert from_cffi["enums"][enum][k] == v, f"{enum}.{k} changed since {version}"
        assert from_cffi["max_dims"] == old_pin["max_dims"]


def test_no_struct_has_padding():
    """Every byte of every ABI struct belongs to a named field, so appending any field changes sizeof
    (and struct_size tells a library exactly which fields its caller knows)."""
    for name, s in layout_from_cffi()["structs"].items():
        t = ffi.typeof(name)
        end = 0
        for f, field in t.fields:
            off = ffi.offsetof(name, f)
            assert off == end, f"{name}: {off - end} padding byte(s) before {f}"
            end = off + ffi.sizeof(field.type)
        assert end == s["size"], f"{name}: {s['size'] - end} byte(s) of tail padding after its last field"


def test_frozen_plugin_info_layout():
    """DI_PluginInfo is frozen forever, whatever the ABI version: spelled out here on purpose."""
    p = 8 if ffi.sizeof("void*") == 8 else 4
    assert [(f, ffi.offsetof("DI_PluginInfo", f)) for f, _ in ffi.typeof("DI_PluginInfo").fields] == [
        ("struct_size", 0), ("abi_major", 4), ("abi_minor", 8), ("reserved", 12), ("name", 16),
        ("version", 16 + p), ("get_api", 16 + 2 * p), ("score", 16 + 3 * p)]
