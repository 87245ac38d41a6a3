"""A third-party plugin built from the header alone is found through DEEPINFER_BACKEND_PATH,
passes conformance for the four ops it implements, and is reported UNIMPLEMENTED for the rest."""
from __future__ import annotations

import json

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.conformance import run_conformance, summary
from deepinfer.errors import UnsupportedOpError
from deepinfer.loader import candidates, load_library
from deepinfer.tensor import Tensor

TINY_OPS = ["embedding", "add", "mul", "silu_mul"]


def test_tiny_is_discovered_through_the_env_var(tiny_lib, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BACKEND_PATH", str(tiny_lib.parent))
    found = [c for c in candidates() if c.path and c.path.endswith(tiny_lib.name)]
    assert len(found) == 1, [c.summary() for c in candidates()]
    c = found[0]
    assert c.ok, c.reason
    assert c.source == "env" and c.name == "tiny" and c.abi_version == "1.0"
    assert c.ops == TINY_OPS
    assert c.attributes["device.name"].startswith("host CPU")


def test_tiny_passes_conformance_for_what_it_claims(tiny_lib, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BACKEND_PATH", str(tiny_lib.parent))
    path = next(c.path for c in candidates() if c.ok and c.name == "tiny")
    out = tmp_path / "tiny.json"
    cert = run_conformance(path, out=str(out), profile="quick")
    assert cert["passed"], summary(cert)
    cert = json.loads(out.read_text())
    assert cert["ops_claimed"] == TINY_OPS
    assert cert["ops_unimplemented"] == [op for op in abi.OP_NAMES if op not in TINY_OPS]
    assert cert["ops_passed"]["L1"] == TINY_OPS
    # every NULL entry was checked to come back UNIMPLEMENTED through the Backend
    null_checks = [r for r in cert["levels"]["L0"]["results"] if r["case"].startswith("NULL entry")]
    assert sorted(r["op"] for r in null_checks) == sorted(cert["ops_unimplemented"])
    assert all(r["status"] == "pass" and r["message"] == "UNIMPLEMENTED" for r in null_checks)
    # L2 has nothing to certify without dequantize, L3 does not apply to a host library without graphs
    assert cert["levels"]["L2"]["counts"] == {"unsupported": 1}
    assert cert["levels"]["L3"]["counts"] == {"skipped": 1}


def test_tiny_unimplemented_op_raises_unsupported(tiny_lib):
    be = load_library(tiny_lib)
    try:
        assert not be.has_op("rmsnorm")
        x = Tensor.from_numpy(np.ones((2, 4), np.float32))
        with pytest.raises(UnsupportedOpError) as e:
            be.rmsnorm(x=x, weight=Tensor.from_numpy(np.ones(4, np.float32)), out=Tensor.empty((2, 4), "f32"), eps=1e-6)
        assert e.value.status_name == "UNIMPLEMENTED" and "rmsnorm" in str(e.value)
        y = Tensor.from_numpy(np.full((2, 4), 2.0, np.float32))
        out = Tensor.empty((2, 4), "f32", fill=np.nan)
        be.add(a=x, b=y, out=out)
        np.testing.assert_array_equal(out.numpy(), 3.0)
    finally:
        be.close()


def test_l3_streams_and_graph_capture(plugin_factory):
    lib = plugin_factory("libdeepinfer_tinygraph.so", TEST_GRAPHS=None, TEST_NAME='"tinygraph"')
    cert = run_conformance(str(lib), levels=("L0", "L3"), profile="quick", isolate=False)
    assert cert["passed"], summary(cert)
    names = [r["case"] for r in cert["levels"]["L3"]["results"]]
    assert names.count("runs on the given stream") == len(TINY_OPS)
    assert "graph capture and replay" in names and "two contexts from two threads at once" in names


def test_l3_catches_a_replay_that_does_nothing(plugin_factory):
    lib = plugin_factory("libdeepinfer_tinynoop.so", TEST_GRAPHS=None, TEST_GRAPH_NOOP=None, TEST_NAME='"tinynoop"')
    cert = run_conformance(str(lib), levels=("L3",), profile="quick", isolate=False)
    assert not cert["passed"]
    bad = [r for r in cert["levels"]["L3"]["results"] if r["status"] == "fail"]
    assert [r["case"] for r in bad] == ["graph capture and replay"]
    assert "differs from the eager result" in bad[0]["message"]
