"""The precision choice (auto, fastest, forced), against fake capability tables and fake backends."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer import abi
from deepinfer import precision as P
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError

YES, NO, SLOW = abi.SUPPORT_YES, abi.SUPPORT_NO, abi.SUPPORT_SLOW
GiB = 2**30
ALL_YES = {p: YES for p in P.ALL_PRECISIONS}
def fastest(*args, **kw):
    return P.choose_precision(*args, policy="fastest", **kw)


SIZES = {"f32": 32 * GiB, "bf16": 16 * GiB, "fp8": 8 * GiB, "int8": 8 * GiB, "w8a8": 8 * GiB,
         "int4": 4.5 * GiB, "w4a8": 4.5 * GiB}


def test_cpu_order_with_vnni():
    p, why = fastest(ALL_YES, SIZES, 64 * GiB, device="cpu", vnni=True)
    assert p == "w4a8" and "w4a8" in why


def test_cpu_order_without_vnni():
    p, _ = fastest(ALL_YES, SIZES, 64 * GiB, device="cpu", vnni=False)
    assert p == "int4"
    caps = {**ALL_YES, "int4": NO}
    assert fastest(caps, SIZES, 64 * GiB, device="cpu", vnni=False)[0] == "int8"
    assert fastest(caps, SIZES, 64 * GiB, device="cpu", vnni=True)[0] == "w4a8"


def test_cpu_falls_back_down_the_order():
    caps = {"f32": YES, "bf16": YES, "int8": YES}
    assert fastest(caps, SIZES, 64 * GiB, device="cpu")[0] == "int8"
    assert fastest({"f32": YES, "bf16": YES}, SIZES, 64 * GiB, device="cpu")[0] == "bf16"
    assert fastest({"f32": YES}, SIZES, 64 * GiB, device="cpu")[0] == "f32"


def test_cuda_order():
    assert fastest(ALL_YES, SIZES, 80 * GiB, device="cuda")[0] == "fp8"
    assert fastest({**ALL_YES, "fp8": NO}, SIZES, 80 * GiB, device="cuda")[0] == "int4"
    assert fastest({"bf16": YES, "f32": YES}, SIZES, 80 * GiB, device="cuda")[0] == "bf16"


def test_memory_decides_when_the_fastest_does_not_fit():
    sizes = {**SIZES, "fp8": 10 * GiB, "int4": 6 * GiB}
    p, why = fastest(ALL_YES, sizes, 8 * GiB, device="cuda")
    assert p == "int4" and "fp8" in why and "does not fit" in why
    # nothing fits: the smallest runnable format, with a warning
    p, why = fastest({"bf16": YES, "f32": YES}, SIZES, 1 * GiB, device="cpu")
    assert p == "bf16" and "nothing fits" in why


def test_slow_paths_come_after_fast_ones():
    caps = {**ALL_YES, "w4a8": SLOW, "int4": SLOW}
    p, _ = fastest(caps, SIZES, 64 * GiB, device="cpu", vnni=True)
    assert p == "w8a8"
    p, why = fastest({"int4": SLOW}, SIZES, 64 * GiB, device="cpu")
    assert p == "int4" and "SLOW" in why


def test_allowed_limits_candidates():
    allowed = P.producible(P.QF.make_scheme("int8"))
    assert set(allowed) == {"int8", "w8a8", "bf16", "f32"}
    p, _ = fastest(ALL_YES, SIZES, 64 * GiB, device="cpu", vnni=True, allowed=allowed)
    assert p == "w8a8"


def test_forced_precision():
    p, why = P.choose_precision(ALL_YES, SIZES, 64 * GiB, device="cpu", forced="bf16")
    assert p == "bf16" and "forced" in why
    with pytest.raises(ConfigError, match=r"cannot run op linear with weights fp8 e4m3 block 128x128"):
        P.choose_precision({**ALL_YES, "fp8": NO}, SIZES, 64 * GiB, device="cpu", forced="fp8",
                           backend_name="cpu")
    with pytest.raises(ConfigError, match=r"int4 sym group 32.*int8 per-token activations"):
        P.choose_precision({**ALL_YES, "w4a8": NO}, SIZES, 64 * GiB, forced="w4a8", group_size=32)
    with pytest.raises(ConfigError, match="not one of"):
        P.choose_precision(ALL_YES, SIZES, 64 * GiB, forced="int3")
    _, why = P.choose_precision(ALL_YES, SIZES, 1 * GiB, forced="f32")
    assert "exceed" in why
    with pytest.raises(ConfigError, match="cannot be made from this checkpoint"):
        P.choose_precision(ALL_YES, SIZES, 64 * GiB, forced="fp8", allowed=("int4", "bf16"))


def test_nothing_runnable_is_an_error():
    with pytest.raises(ConfigError, match="cannot run op linear"):
        P.choose_precision({}, SIZES, 64 * GiB, device="cpu")


# ---------------------------------------------------------------------------- with a backend


class FakeBackend:
    """Answers op_query for linear from a table keyed by (activation dtype, weight format)."""

    def __init__(self, table, device="cpu", ops=("linear", "quantize"), features=None, memory=None):
        self.table, self.device, self._ops = table, device, ops
        self.name = "fake"
        attrs = {}
        if features is not None:
            attrs["cpu.features"] = features
        if memory is not None:
            attrs["device.memory_bytes"] = str(memory)
        self.info = SimpleNamespace(attributes=attrs)
        self.queries = []

    def has_op(self, op):
        return op in self._ops

    def upload(self, t):
        return t

    def query(self, op, x, w, out):
        fmt = w.dtype.name
        if w.quant is not None and fmt == "int4":
            fmt = f"int4/g{w.quant.block[1]}"
        key = (x.dtype.name, fmt)
        self.queries.append(key)
        return self.table.get(key, NO), 0


def test_capabilities_from_queries():
    b = FakeBackend({("f32", "f32"): YES, ("f32", "bf16"): YES, ("f32", "int4/g64"): YES, ("int8", "int8"): SLOW})
    caps = P.backend_capabilities(b, group_size=64)
    assert caps == {"f32": YES, "bf16": YES, "fp8": NO, "int8": NO, "int4": YES, "w8a8": SLOW, "w4a8": NO}
    assert P.backend_capabilities(b, group_size=32)["int4"] == NO   # the probe carries the group
    assert ("int8", "int8") in b.queries
    no_quantize = FakeBackend(b.table, ops=("linear",))
    assert P.backend_capabilities(no_quantize)["w8a8"] == NO       # int8 activations need the quantize op


def test_capabilities_query_failure_is_no():
    class Raising(FakeBackend):
        def query(self, op, **kw):
            raise RuntimeError("broken library")

    assert set(P.backend_capabilities(Raising({})).values()) == {NO}


def test_has_vnni():
    assert P.has_vnni(FakeBackend({}, features="avx2 fma avx512f avx512vnni"))
    assert P.has_vnni(FakeBackend({}, features="avx2 avxvnni"))
    assert not P.has_vnni(FakeBackend({}, features="avx2 fma"))


def test_memory_budget(tmp_path):
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    assert P.memory_budget(FakeBackend({}), None, str(mi)) == (8000000 * 1024, "MemAvailable in /proc/meminfo")
    assert P.memory_budget(FakeBackend({}), 12345)[0] == 12345
    gpu = FakeBackend({}, device="cuda", memory=100 * GiB)
    assert P.memory_budget(gpu)[0] == int(100 * GiB * 0.9)
    with pytest.raises(ConfigError, match="memory_budget_bytes"):
        P.memory_budget(FakeBackend({}, device="cuda"))
    with pytest.raises(ConfigError, match="positive"):
        P.memory_budget(FakeBackend({}), -1)


def test_weight_bytes():
    shapes = {"model.layers.0.self_attn.q_proj.weight": (256, 128), "model.embed_tokens.weight": (100, 128),
              "model.norm.weight": (128,)}
    plain = 100 * 128 + 128
    assert P.weight_bytes(shapes, "f32") == 4 * (256 * 128 + plain)
    assert P.weight_bytes(shapes, "bf16") == 2 * (256 * 128 + plain)
    assert P.weight_bytes(shapes, "int8") == 256 * 128 + 4 * 256 + 2 * plain
    assert P.weight_bytes(shapes, "int4", group_size=64) == 256 * 64 + 4 * 256 * 2 + 2 * plain
    assert P.weight_bytes(shapes, "int4", 64, symmetric=False) == 256 * 64 + 5 * 256 * 2 + 2 * plain
    assert P.weight_bytes(shapes, "fp8") == 256 * 128 + 4 * 2 + 2 * plain


def test_resolve_with_engine_config():
    table = {("f32", "f32"): YES, ("f32", "bf16"): YES, ("f32", "int8"): YES, ("f32", "int4/g64"): YES,
             ("int8", "int4/g64"): YES, ("int8", "int8"): YES}
    shapes = {"model.layers.0.mlp.down_proj.weight": (4096, 4096)}
    vnni = FakeBackend(table, features="avx512vnni")
    cfg = EngineConfig.from_any({"memory_budget_bytes": 64 * GiB, "precision": "fastest"})
    assert P.resolve(vnni, cfg, shapes)[0] == "w4a8"
    plain = FakeBackend(table, features="avx2")
    assert P.resolve(plain, cfg, shapes)[0] == "int4"
    tight = EngineConfig.from_any({"memory_budget_bytes": 4096 * 4096, "precision": "fastest"})   # int8 needs a bit more
    assert P.resolve(plain, tight, shapes)[0] == "int4"
    tiny = EngineConfig.from_any({"memory_budget_bytes": 4096 * 4096 // 2, "precision": "fastest"})  # nor int4
    assert "nothing fits" in P.resolve(plain, tiny, shapes)[1]
    # an int8 checkpoint: int4 is not on the table
    assert P.resolve(plain, cfg, shapes, checkpoint_scheme={"quant_method": "deepinfer", "format": "int8"})[0] == "int8"
    forced = EngineConfig.from_any({"precision": "fp8"})
    with pytest.raises(ConfigError, match="op linear"):
        P.resolve(plain, forced, shapes)


def test_reference_backend_runs_every_precision():
    from deepinfer.reference import ReferenceBackend

    caps = P.backend_capabilities(ReferenceBackend())
    assert all(v != NO for v in caps.values()), caps


def test_producible():
    assert P.producible(None) == P.ALL_PRECISIONS
    assert P.producible(P.QF.make_scheme("int4", 32)) == ("int4", "w4a8", "bf16", "f32")
    assert P.producible(P.QF.make_scheme("int4", 32, symmetric=False)) == ("int4", "bf16", "f32")
    official = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert P.producible(P.QF.parse_quantization_config(official)) == ("fp8", "bf16", "f32")


def test_quantized_checkpoint_runs_as_stored():
    fp8 = P.producible(P.QF.parse_quantization_config(
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}))
    for policy in ("auto", "fastest"):
        assert P.choose_precision(ALL_YES, SIZES, 64 * GiB, device="cpu", vnni=True, allowed=fp8, policy=policy,
                                  stored="fp8")[0] == "fp8"
    int8 = P.producible(P.QF.make_scheme("int8"))
    assert fastest(ALL_YES, SIZES, 80 * GiB, device="cuda", allowed=int8)[0] == "int8"
    p, why = P.choose_precision(ALL_YES, SIZES, 80 * GiB, device="cuda", allowed=int8, stored="int8")
    assert p == "int8" and "own precision" in why and "lossy" not in why
    # a float checkpoint never lands on fp8 on the CPU when asked for speed: int8 is as small and faster there
    assert fastest({**ALL_YES, "int4": NO, "w4a8": NO, "w8a8": NO}, SIZES, 64 * GiB, device="cpu")[0] == "int8"


def test_cpu_library_answers_every_probe(cpu_backend):
    """The probe descriptors are well-formed for a real ABI library (a malformed one would read as NO)."""
    cpu = cpu_backend
    for g in (32, 64, 128):
        caps = P.backend_capabilities(cpu, group_size=g)
        assert caps["f32"] == YES and caps["int8"] == YES and caps["int4"] == YES, caps
    assert P.backend_capabilities(cpu, symmetric=False)["int4"] == YES


# ---------------------------------------------------------------------------- auto keeps the stored precision

COSTS = {"source": "test table", "paths": [
    {"precision": "f32", "group": None, "ppl_change_pct": 0.0, "top1_agreement": 1.0},
    {"precision": "bf16", "group": None, "ppl_change_pct": 0.0, "top1_agreement": 1.0},
    {"precision": "fp8", "group": None, "ppl_change_pct": 0.3, "top1_agreement": 0.96},
    {"precision": "int8", "group": None, "ppl_change_pct": 0.06, "top1_agreement": 0.987},
    {"precision": "w8a8", "group": None, "ppl_change_pct": 0.01, "top1_agreement": 0.975},
    {"precision": "int4", "group": 32, "ppl_change_pct": 0.8, "top1_agreement": 0.882},
    {"precision": "int4", "group": 64, "ppl_change_pct": 1.7, "top1_agreement": 0.873},
    {"precision": "w4a8", "group": 64, "ppl_change_pct": 1.65, "top1_agreement": 0.8727},
]}


def auto(*args, **kw):
    return P.choose_precision(*args, policy="auto", costs=COSTS, **kw)


def test_auto_keeps_the_stored_precision_when_it_fits():
    for device in ("cpu", "cuda"):
        p, why = auto(ALL_YES, SIZES, 64 * GiB, device=device, vnni=True, stored="bf16", stored_as="bf16")
        assert p == "bf16" and "own precision (bf16)" in why and "lossy" not in why
    p, why = auto(ALL_YES, SIZES, 64 * GiB, stored="f32")
    assert p == "f32" and "lossy" not in why
    # the default of the engine config is auto
    assert EngineConfig().precision == "auto"


def test_auto_takes_the_most_accurate_path_that_fits():
    order = P.accuracy_order(P.ALL_PRECISIONS, 64, COSTS)
    assert order == ["f32", "bf16", "int8", "w8a8", "fp8", "int4", "w4a8"]
    # bf16 weights of 16 GiB in 10 GiB: int8 is the most accurate that fits, quoted with its measured cost
    p, why = auto(ALL_YES, SIZES, 10 * GiB, device="cpu", vnni=True, stored="bf16")
    assert p == "int8"
    assert "bf16 (16.00 GiB does not fit)" in why and "f32 (32.00 GiB does not fit)" in why
    assert "lossy (measured cost: perplexity +0.06%, top-1 agreement 98.7% vs bf16 weights (test table))" in why
    p, why = auto(ALL_YES, SIZES, 5 * GiB, device="cpu", vnni=True, stored="bf16")
    assert p == "int4" and "top-1 agreement 87.3%" in why
    p, why = auto(ALL_YES, SIZES, 5 * GiB, stored="bf16", group_size=128)
    assert p == "int4" and "measured cost at group 64" in why
    # a bf16 checkpoint on a backend without a bf16 path: f32 holds it exactly
    p, why = auto({**ALL_YES, "bf16": NO}, SIZES, 64 * GiB, stored="bf16", stored_as="bf16")
    assert p == "f32" and "exactly" in why and "cannot run it" in why and "lossy" not in why
    # nothing fits: the smallest, still labelled lossy
    p, why = auto(ALL_YES, SIZES, 1 * GiB, stored="bf16")
    assert p in ("int4", "w4a8") and "nothing fits" in why and "lossy" in why


def test_auto_on_a_quantized_checkpoint():
    fp8 = P.producible(P.QF.parse_quantization_config(
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}))
    p, why = auto(ALL_YES, SIZES, 64 * GiB, device="cuda", allowed=fp8, stored="fp8", stored_as="fp8 e4m3")
    assert p == "fp8" and "own precision" in why
    # a backend without fp8: dequantized to f32 (exact) when it fits, else bf16 (near-lossless)
    p, why = auto({**ALL_YES, "fp8": NO}, SIZES, 64 * GiB, allowed=fp8, stored="fp8")
    assert p == "f32" and "lossy" not in why
    p, why = auto({**ALL_YES, "fp8": NO}, SIZES, 20 * GiB, allowed=fp8, stored="fp8")
    assert p == "bf16" and "near-lossless" in why


def test_forced_lossy_precision_quotes_its_cost():
    _, why = P.choose_precision(ALL_YES, SIZES, 64 * GiB, forced="w4a8", stored="bf16", costs=COSTS)
    assert "forced" in why and "top-1 agreement 87.3%" in why
    _, why = P.choose_precision(ALL_YES, SIZES, 64 * GiB, forced="f32", stored="bf16", costs=COSTS)
    assert "lossy" not in why
    with pytest.raises(ConfigError, match="policy"):
        P.choose_precision(ALL_YES, SIZES, 64 * GiB, policy="smallest")


def test_stored_precision_reads_the_weight_dtypes():
    import ml_dtypes
    import numpy as np

    lin = "model.layers.0.mlp.down_proj.weight"
    emb = "model.embed_tokens.weight"
    bf, f32, f16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float16)
    assert P.stored_precision({lin: (bf, (64, 64)), emb: (f32, (256, 64))}) == ("bf16", "bf16")
    assert P.stored_precision({lin: (f32, (64, 64))}) == ("f32", "f32")
    assert P.stored_precision({lin: (f16, (64, 64))}) == ("f32", "float16")
    up = "model.layers.0.mlp.up_proj.weight"
    assert P.stored_precision({lin: (bf, (64, 64)), up: (f32, (64, 64))}) == ("f32", "bfloat16+float32")
    assert P.stored_precision({}, P.QF.make_scheme("int4", 32))[0] == "int4"


def test_packaged_accuracy_table_matches_the_benchmark_results():
    """The engine's copy is tools/accuracy_table.py's digest of the committed results."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    try:
        import accuracy_table
    finally:
        sys.path.remove(str(root / "tools"))
    results = json.loads((root / "benchmarks" / "results" / "accuracy_nano.json").read_text())
    assert P.accuracy_costs() == accuracy_table.cost_table(results), \
        "runtime/deepinfer/assets/accuracy_costs.json is stale: python tools/accuracy_table.py --package-only"
    measured = {r["precision"] for r in P.accuracy_costs()["paths"]}
    assert measured == set(P.ALL_PRECISIONS)
    assert P.accuracy_order(P.ALL_PRECISIONS)[:2] == ["f32", "bf16"]


def test_resolve_auto_keeps_bf16():
    table = {("f32", "f32"): YES, ("f32", "bf16"): YES, ("f32", "int8"): YES, ("f32", "int4/g64"): YES,
             ("int8", "int4/g64"): YES, ("int8", "int8"): YES}
    shapes = {"model.layers.0.mlp.down_proj.weight": (4096, 4096)}
    be = FakeBackend(table, features="avx512vnni")
    cfg = EngineConfig.from_any({"memory_budget_bytes": 64 * GiB})
    p, why = P.resolve(be, cfg, shapes, stored=("bf16", "bf16"))
    assert p == "bf16" and "own precision" in why
    tight = EngineConfig.from_any({"memory_budget_bytes": 4096 * 4096 * 2 - 1})   # bf16 needs 2 bytes a weight
    p, why = P.resolve(be, tight, shapes, stored=("bf16", "bf16"))
    assert p == "int8" and "lossy" in why
