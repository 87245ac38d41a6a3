"""The expert cache (model.expert_cache, its policy model.expert_cache.policy): routed MoE experts in bounded per-layer
slots, loaded on demand from the checkpoint files (source "disk") or from host images (source
"host"), with the next layer's experts prefetched.

What is checked:
  * the cached model computes bit for bit what the resident model computes (reference and CPU
    libraries; every capacity, source, policy and prefetch setting; the device path driven on a host
    backend; experts converted at load; quantized, fp8 and fused-layout checkpoints; the MTP layer);
  * its counters (hits, misses, prefetch, bytes streamed) add up;
  * its memory is bounded by the capacity, and capacities that cannot work are refused;
  * the configuration is validated (EngineConfig, --expert-cache);
  * the slot bookkeeping and the LRU / LFRU policies (pure Python);
  * plans that pause for the host, op by op and captured as one graph per segment;
  * loads under stress (slow reads, the fewest bounce buffers) and other step shapes (chunked
    prefill, score());
  * the engine and the `deepinfer run` command give the same text with the cache as without;
  * a dropped runner releases the cache's files.
The embedded model (deepseek-v3-nano: 16 routed experts top-4, 4 MoE layers + an MTP layer) runs
in a fraction of a second per case on the CPU library, a second or two on the reference backend.
"""
from __future__ import annotations

import gc
import io
import json
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import deepinfer
from deepinfer import cli
from deepinfer.config import EngineConfig
from deepinfer.engine import ModelRunner, RunnerConfig
from deepinfer.engine.llm_engine import Engine, default_model_dir
from deepinfer.errors import EXIT_USAGE, ConfigError
from deepinfer.model.expert_cache import ExpertCacheConfig
from deepinfer.model.expert_cache import native as native_reader
from deepinfer.model.expert_cache.policy import LayerSlots, make_policy
from deepinfer.model.plan import Arena, Plan, Tracer

NANO = default_model_dir()          # deepseek-v3-nano: 5 layers (first dense), 16 routed experts top-4, MTP
RUNNER = dict(max_batch=4, max_seq_len=128, max_num_batched_tokens=64)


# ============================================================================ helpers
def _backend(name: str, cpu_lib=None):
    """A fresh backend context (each runner owns its stream settings)."""
    if name == "reference":
        return deepinfer.get_backend("reference")
    return deepinfer.loader.load_library(cpu_lib.info.path, num_threads=2)


def _workload(r: ModelRunner, vocab: int) -> list:
    """Every logits array of: one prefill of three sequences of different lengths in one batch (60
    tokens x top-k touch more experts than a small cache has slots: the overflow path), then 10
    decode steps of the 3 sequences (a bucket of 4: one padded row), each followed by the MTP head
    when the model has one (its layer streams through the cache too)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (40, 7, 13)]
    sids = [r.new_sequence() for _ in prompts]
    out = [r.backend.to_numpy(r.forward(sids, prompts, [0, 0, 0])).copy()]
    toks = [[int(np.argmax(x))] for x in out[-1]]
    pos = [len(p) for p in prompts]
    mtp = r.weights.mtp is not None
    for _ in range(10):
        a = r.backend.to_numpy(r.forward(sids, toks, pos, keep_hidden=mtp)).copy()
        out.append(a)
        toks = [[int(np.argmax(x))] for x in a]
        if mtp:
            out.append(r.backend.to_numpy(r.mtp_logits(sids, toks)).copy())
        pos = [p + 1 for p in pos]
    return out


def _runner(path, backend, precision, expert_cache=None, **kw) -> ModelRunner:
    return ModelRunner(path, backend, RunnerConfig(precision=precision, expert_cache=expert_cache, **{**RUNNER, **kw}))


def _layers_and_experts(r: ModelRunner) -> tuple:
    rep = r.expert_stats()
    n_layers = rep["expert_total_bytes"] // (rep["expert_bytes"] * r.cfg.n_routed_experts)
    return n_layers, r.cfg.n_routed_experts


def _resident_pairs(r: ModelRunner) -> int:
    """(layer, expert) pairs now in some layer's slots."""
    return sum(sum(1 for s in L.slots.slot_of if s >= 0) for L in r.experts.layers)


def _check_counters(rep: dict, prefetch: bool, policy: str) -> None:
    """What holds after any run of a cached model (prefetch: whether it was on)."""
    need = rep["expert_needed"]
    assert need > 0
    assert rep["expert_hits"] + rep["expert_misses"] == need
    assert 0.0 <= rep["expert_hit_rate"] <= 1.0
    assert rep["expert_hit_rate"] == pytest.approx(rep["expert_hits"] / need)
    # every load (a miss, into a slot or the overflow, a prefetch, or lazy loading's background fill)
    # moves one expert image
    assert rep["expert_bytes_streamed"] == (rep["expert_misses"] + rep["expert_prefetch_issued"]
                                            + rep["expert_fill_loads"]) * rep["expert_bytes"]
    assert rep["expert_fill_loads"] == 0 or rep["expert_fill"]
    assert 0 <= rep["expert_overflow_loads"] <= rep["expert_misses"]
    assert 0 <= rep["expert_prefetch_used"] <= rep["expert_prefetch_issued"]
    assert 0 <= rep["expert_prefetch_late"] <= rep["expert_prefetch_issued"]
    assert rep["expert_prefetch"] is prefetch
    assert rep["expert_policy"] == policy
    if not prefetch:
        assert rep["expert_prefetch_issued"] == rep["expert_prefetch_used"] == rep["expert_predicted"] == 0
        assert rep["expert_prefetch_recall"] is None and rep["expert_prefetch_precision"] is None
    else:
        for k in ("expert_prefetch_recall", "expert_prefetch_precision"):
            assert rep[k] is None or 0.0 <= rep[k] <= 1.0


# the resident model's logits, computed once per (backend, model, precision)
_BASELINES: dict = {}


def _baseline(bname, cpu_lib, path, precision, vocab, **kw) -> list:
    key = (bname, str(path), precision, tuple(sorted(kw.items())))
    if key not in _BASELINES:
        # a cached model runs its shared experts as their own MLP (the cache streams the routed ones),
        # so the resident model it is compared with does too (resident, they join moe_experts and
        # their sum is rounded once: other bits)
        r = _runner(path, _backend(bname, cpu_lib), precision, shared_experts_routed=False, **kw)
        assert r.experts is None and r.weights.layers[1].moe.experts_gate is not None
        _BASELINES[key] = _workload(r, vocab)
    return _BASELINES[key]


def _assert_bit_identical(bname, cpu_lib, path, precision, ec, vocab, *, raw=None, **kw) -> ModelRunner:
    """The cached model's logits equal the resident model's at every step, bit for bit; returns the
    cached runner (after the run) for further checks. kw: more ModelRunner arguments (both models)."""
    want = _baseline(bname, cpu_lib, path, precision, vocab, **kw)
    r = _runner(path, _backend(bname, cpu_lib), precision, ec, **kw)
    cfg = ExpertCacheConfig.parse(ec)
    # the routed experts really stream: none was loaded with the other weights
    assert r.experts is not None
    assert all(l.moe.experts_gate is None for l in r.weights.layers if l.moe is not None)
    if raw is not None:
        assert r.experts.raw is raw      # raw file bytes, or images converted as the eager load converts
    if cfg.source is not None:
        assert r.experts.source == cfg.source
    if cfg.host_memory is not None:
        assert r.experts.host_memory is cfg.host_memory
    if cfg.prefetch is not None:
        assert r.experts.prefetch is cfg.prefetch
    if cfg.native_readers is False or r.experts.host_memory or not r.experts.raw or r.experts.source != "disk":
        assert r.experts.readers == "python"
    elif bname == "cpu" and native_reader.load() is not None:
        assert r.experts.readers == "native"       # device disk loads on the native readers
    got = _workload(r, vocab)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        assert np.isfinite(a).all()
        assert np.array_equal(a, b), f"step {i}: the cached model differs by {float(np.abs(a - b).max())}"
    rep = r.expert_stats()
    _check_counters(rep, r.experts.prefetch, cfg.policy)
    if r.experts.slots_per_layer < r.cfg.n_routed_experts:
        # the 60-token prefill routes to more experts than a layer has slots: the shared overflow ran
        assert rep["expert_overflow_loads"] > 0
    else:
        assert rep["expert_overflow_loads"] == 0 and r.experts.n_overflow == 0
    return r


def _with_watchdog(fn, seconds: float = 300.0):
    """fn() on a daemon thread; a failure instead of a hung suite if it never returns."""
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:      # re-raised on the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no result after {seconds:.0f} s: the loads deadlocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _device(capacity, source, **kw) -> ExpertCacheConfig:
    """The device path (pinned bounce buffers, copies on a copy stream, events) on a host backend."""
    return ExpertCacheConfig(capacity=capacity, source=source, host_memory=False, **kw)


# ============================================================================ 1. bit-identical logits
# unset source / prefetch take the backend's defaults (disk, and no prefetch on host backends for the
# embedded model's small experts; the device path prefetches by default)
CPU_CASES = [
    {"capacity": 0.25},
    {"capacity": 0.25, "source": "host", "policy": "lru", "prefetch": True},
    {"capacity": 0.5, "source": "disk", "policy": "lru", "prefetch": True},
    {"capacity": 0.5, "source": "host", "policy": "lfru"},
    {"capacity": 0.5, "source": "disk", "prefetch": True},
    {"capacity": 1.0, "source": "disk", "policy": "lru", "prefetch": False},
    {"capacity": 1.0, "source": "host", "prefetch": True},
    _device(0.5, "disk"),
    _device(0.5, "host"),
    _device(0.25, "disk", policy="lru", prefetch=False),
    _device(0.25, "disk", prefetch=True, native_readers=False),    # the Python readers' device path
]
REFERENCE_CASES = [
    {"capacity": 0.25, "source": "disk", "prefetch": True},
    {"capacity": 0.5, "source": "host", "policy": "lru"},
    {"capacity": 1.0, "source": "disk", "policy": "lfru", "prefetch": True},
    _device(0.5, "disk"),
]


def _id(ec) -> str:
    c = ExpertCacheConfig.parse(ec)
    pf = {None: "pf-default", True: "pf", False: "nopf"}[c.prefetch]
    return (f"{c.capacity}-{c.source or 'default'}-{c.policy}-{pf}"
            + ("-device" if c.host_memory is False else "") + ("-python-readers" if c.native_readers is False else ""))


@pytest.mark.parametrize("ec", CPU_CASES, ids=_id)
def test_bit_identical_cpu(ec, cpu_backend):
    # precision bf16 on the bf16 model: the experts are used as stored, images are raw file bytes
    _assert_bit_identical("cpu", cpu_backend, NANO, "bf16", ec, 4096, raw=True)


@pytest.mark.parametrize("ec", REFERENCE_CASES, ids=_id)
def test_bit_identical_reference(ec):
    _assert_bit_identical("reference", None, NANO, "bf16", ec, 4096, raw=True)


CONVERT_CASES = [  # (backend, precision, activation dtype, cache)
    ("cpu", "int8", "f32", {"capacity": 0.25, "source": "disk", "prefetch": True}),
    ("cpu", "int8", "f32", {"capacity": 0.5, "source": "host"}),
    ("cpu", "int8", "f32", _device(0.5, "disk")),
    ("cpu", "w4a8", "bf16", {"capacity": 0.25, "policy": "lru"}),     # int4 groups, int8 activations
    ("reference", "int8", "f32", {"capacity": 0.5, "source": "disk", "policy": "lru"}),
]


@pytest.mark.parametrize("bname, precision, dtype, ec", CONVERT_CASES,
                         ids=[f"{b}-{p}-{d}-{_id(e)}" for b, p, d, e in CONVERT_CASES])
def test_bit_identical_when_experts_are_converted_at_load(bname, precision, dtype, ec, cpu_backend):
    """A quantizing precision on the bf16 model: each expert is quantized on the backend when loaded
    (the images are not file bytes), and must equal the resident model's quantized experts."""
    _assert_bit_identical(bname, cpu_backend, NANO, precision, ec, 4096, raw=False, dtype=dtype)


@pytest.fixture(scope="module")
def int4_asym_dir(tmp_path_factory):
    """The embedded model quantized to int4 with zero points: an expert image has 9 parts (q, scales
    and zeros of gate, up and down), each its own byte range of the files."""
    from deepinfer import quantizer

    d = tmp_path_factory.mktemp("ec_int4") / "int4asym"
    quantizer.quantize_model(NANO, d, "int4", group=64, symmetric=False, clip_search=False)
    return d


@pytest.mark.parametrize("ec", [{"capacity": 0.25, "source": "disk"},
                                {"capacity": 0.5, "source": "host", "prefetch": True},
                                _device(0.5, "disk", policy="lru")], ids=_id)
def test_bit_identical_quantized_checkpoint_as_stored(ec, int4_asym_dir, cpu_backend):
    r = _assert_bit_identical("cpu", cpu_backend, int4_asym_dir, None, ec, 4096, raw=True)
    assert [(p.weight, p.kind) for p in r.experts.layout.parts] == \
        [(w, k) for w in range(3) for k in ("q", "scales", "zeros")]


@pytest.fixture(scope="module")
def fused_dirs(tmp_path_factory):
    """Tiny random checkpoints whose routed experts are stored fused (one gate_up_proj and one
    down_proj tensor per layer): f32 v3 with a fused MTP layer, and v3 with fp8 experts whose
    fused scale tensors split on 128-row blocks."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tiny_checkpoints
    from deepinfer.model import Checkpoint

    out = {}
    for family in ("v3", "v3fp8e128"):
        d, _, _ = tiny_checkpoints.make(family, tmp_path_factory.mktemp(f"ec_fused_{family}"), layout="fused")
        assert Checkpoint(d).layout == "fused"
        out[family] = d
    return out


FUSED_CASES = [("cpu", "v3", {"capacity": 0.25, "prefetch": True}), ("cpu", "v3", _device(0.5, "disk")),
               ("reference", "v3", {"capacity": 0.5, "source": "host", "policy": "lru"}),
               ("cpu", "v3fp8e128", {"capacity": 0.25, "source": "disk"}),
               ("cpu", "v3fp8e128", _device(0.5, "host", prefetch=False))]


@pytest.mark.parametrize("bname, family, ec", FUSED_CASES,
                         ids=[f"{b}-{f}-{_id(e)}" for b, f, e in FUSED_CASES])
def test_bit_identical_fused_layout(bname, family, ec, fused_dirs, cpu_backend):
    # precision None: as stored; each expert is a plain byte range inside the fused tensors
    r = _assert_bit_identical(bname, cpu_backend, fused_dirs[family], None, ec, 256, raw=True)
    if family == "v3":      # its MTP layer (fused too) streams through the cache: mtp_logits was compared
        assert r.weights.mtp is not None and r.weights.mtp.layer.moe.streamed is not None


V32_CASES = [("cpu", {"capacity": 0.25, "prefetch": True}), ("cpu", _device(0.5, "disk")),
             ("reference", {"capacity": 0.5, "source": "host"})]


@pytest.mark.parametrize("bname, ec", V32_CASES, ids=[f"{b}-{_id(e)}" for b, e in V32_CASES])
def test_bit_identical_v32_with_its_mtp_layer(bname, ec, tiny_checkpoint, cpu_backend):
    """DeepSeek V3.2 (the DSA indexer in every layer): its main and MTP layers' experts stream, and
    the logits and mtp_logits equal the resident model's."""
    path, _, _ = tiny_checkpoint("v32")
    r = _assert_bit_identical(bname, cpu_backend, path, None, ec, 256, raw=True)
    assert r.cfg.dsa is not None and r.weights.mtp is not None and r.weights.mtp.layer.moe.streamed is not None


# ============================================================================ 2. counters
def test_capacity_one_loads_each_expert_once(cpu_backend):
    """capacity 1.0 without prefetch (and without the background fill) is lazy loading: an expert is
    read the first time it is routed and never again, so the misses are exactly the experts now
    resident, and the same requests run again are all hits."""
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 1.0, "prefetch": False, "fill": False})
    n_layers, E = _layers_and_experts(r)
    assert r.experts.slots_per_layer == E and r.experts.n_overflow == 0
    r.experts.trace = []                    # every pause: (layer pos, distinct experts needed, predicted)
    _workload(r, 4096)
    first = r.expert_stats()
    _check_counters(first, False, "lfru")
    distinct = {(pos, e) for pos, needed, _ in r.experts.trace for e in needed}
    assert first["expert_needed"] == sum(len(needed) for _, needed, _ in r.experts.trace)
    assert first["expert_misses"] == len(distinct) == _resident_pairs(r) <= n_layers * E
    assert first["expert_overflow_loads"] == 0 and first["expert_prefetch_issued"] == 0
    _workload(r, 4096)                      # the same tokens route to the same experts
    again = r.expert_stats()
    assert again["expert_misses"] == first["expert_misses"]
    assert again["expert_bytes_streamed"] == first["expert_bytes_streamed"]
    assert again["expert_hits"] - first["expert_hits"] == again["expert_needed"] - first["expert_needed"] > 0


def test_prefetch_counters(cpu_backend):
    """With prefetch at half capacity, the next layer's router issues loads, some of which are used;
    at capacity 1.0 every load (miss or prefetch) still happens once per expert."""
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.5, "prefetch": True, "policy": "lru"})
    _workload(r, 4096)
    rep = r.expert_stats()
    _check_counters(rep, True, "lru")
    assert rep["expert_prefetch_issued"] > 0 and rep["expert_prefetch_used"] > 0
    assert rep["expert_predicted"] > 0 and 0 < rep["expert_prefetch_recall"] <= 1
    full = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 1.0, "prefetch": True, "fill": False})
    assert full.experts.prefetch
    _workload(full, 4096)
    rep = full.expert_stats()
    assert rep["expert_misses"] + rep["expert_prefetch_issued"] == _resident_pairs(full)


def test_engine_stats(cpu_backend):
    eng = Engine.from_pretrained(None, config={"backend": cpu_backend.info.path, "num_threads": 2,
                                               "expert_cache": {"capacity": 0.5}})
    before = eng.stats()
    assert before["expert_needed"] == 0 and before["expert_hit_rate"] is None
    eng.generate("Once upon a time", max_new_tokens=6, temperature=0.0)
    s = eng.stats()
    for k in ("expert_hits", "expert_misses", "expert_prefetch_issued", "expert_prefetch_used",
              "expert_bytes_streamed", "load_seconds", "expert_hit_rate", "generated_tokens"):
        assert k in s, k
    assert isinstance(s["load_seconds"], float) and s["load_seconds"] > 0
    assert s["expert_hits"] + s["expert_misses"] == s["expert_needed"] > 0
    assert 0.0 <= s["expert_hit_rate"] <= 1.0
    assert s["expert_bytes_streamed"] == (s["expert_misses"] + s["expert_prefetch_issued"]) * s["expert_bytes"]
    plain = Engine.from_pretrained(None, config={"backend": cpu_backend.info.path, "num_threads": 2})
    assert "load_seconds" in plain.stats() and not any(k.startswith("expert_") for k in plain.stats())


def test_defaults_per_backend(cpu_backend):
    """Unset source and prefetch: on a host-memory backend, disk, and prefetch only for experts of
    HOST_PREFETCH_MIN_BYTES or more (the embedded model's are 192 KiB: no predicting router is
    traced); on the device path, prefetch, and host images unless loading lazily."""
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.5})
    assert r.experts.host_memory and r.experts.source == "disk" and r.experts.prefetch is False
    assert not any(l.moe.streamed.predict for l in r.weights.layers if l.moe is not None)
    rep = r.expert_stats()
    assert rep["expert_source"] == "disk" and rep["expert_prefetch"] is False and rep["expert_policy"] == "lfru"
    d = _runner(NANO, _backend("cpu", cpu_backend), "bf16", ExpertCacheConfig(capacity=0.5, host_memory=False))
    assert not d.experts.host_memory and d.experts.prefetch is True
    assert d.experts.source == "host"            # the embedded model's experts fit the host's memory
    # every main MoE layer but the last predicts the next one's experts; the MTP layer runs in its own plan
    assert [l.moe.streamed.predict for l in d.weights.layers[1:]] == [True, True, True, False]
    assert d.weights.mtp.layer.moe.streamed.predict is False
    lazy = _runner(NANO, _backend("cpu", cpu_backend), "bf16", ExpertCacheConfig(capacity=1.0, host_memory=False))
    assert lazy.experts.source == "disk"         # lazy loading reads nothing up front
    # the same model with f32 experts (384 KiB) prefetches on a host backend once the threshold is below that
    from deepinfer.model.expert_cache import config as X

    old = X.HOST_PREFETCH_MIN_BYTES
    X.HOST_PREFETCH_MIN_BYTES = 300 << 10
    try:
        assert _runner(NANO, _backend("cpu", cpu_backend), "f32", {"capacity": 0.5}).experts.prefetch is True
        assert _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.5}).experts.prefetch is False
    finally:
        X.HOST_PREFETCH_MIN_BYTES = old


# ============================================================================ 3. the memory bound
@pytest.mark.parametrize("capacity", [0.04, 0.25, 0.3, 0.5, 0.75, 1.0])
def test_slots_follow_a_fractional_capacity(capacity, cpu_backend):
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": capacity})
    n_layers, E = _layers_and_experts(r)
    n = round(capacity * E)
    ex, rep = r.experts, r.expert_stats()
    assert ex.slots_per_layer == rep["expert_cache_slots_per_layer"] == n
    assert all(L.slots.n == n for L in ex.layers)
    nb = rep["expert_bytes"]
    assert all(L.pool.nbytes == n * nb for L in ex.layers)           # each layer's slots: one allocation
    assert ex.n_overflow == E - n                                   # a step can route to every expert
    assert rep["expert_cache_bytes"] == nb * (n * n_layers + ex.n_overflow) == r.memory_report()["expert_cache_bytes"]
    assert rep["expert_cache_bytes"] <= rep["expert_total_bytes"]
    if capacity <= 0.25:
        assert rep["expert_cache_bytes"] < rep["expert_total_bytes"] / 2
    # every streamed layer's kernel sees E expert descriptors (slots, overflow, aliases of slot 0)
    for l in r.weights.layers[1:]:
        assert len(l.moe.streamed.w_gate) == len(l.moe.streamed.w_up) == len(l.moe.streamed.w_down) == E


def test_total_expert_bytes_match_the_resident_model(cpu_backend):
    """The cache's notion of "all routed expert bytes" (what a fractional capacity is a fraction of)
    is what the resident model holds: the bf16 images have no padding."""
    res = _runner(NANO, _backend("cpu", cpu_backend), "bf16")
    moe = [l.moe for l in res.weights.layers if l.moe is not None] + [res.weights.mtp.layer.moe]
    resident = sum(w.nbytes for m in moe for ws in (m.experts_gate, m.experts_up, m.experts_down) for w in ws)
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.25})
    assert r.expert_stats()["expert_total_bytes"] == resident
    assert r.expert_stats()["expert_cache_bytes"] < resident


def test_byte_capacity(cpu_backend):
    """An integer capacity > 1 is a byte budget for everything the cache allocates: the most slots
    per layer k such that k slots in every MoE layer plus the shared overflow (the experts a step may
    route to beyond k: E - k here, a step can touch them all) fit; too few bytes is a ConfigError
    that names the minimum."""
    probe = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.25})
    n_layers, E = _layers_and_experts(probe)
    nb = probe.experts.expert_bytes

    def cost(k):                      # bytes of k slots per layer plus an overflow of E - k
        return (k * n_layers + (E - k)) * nb

    for cap, want in ((cost(3), 3), (cost(4) - 1, 3), (cost(1), 1), (float(cost(5)), 5), (100 * cost(E), E),
                      (cost(E), E)):
        r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": cap})
        assert r.experts.slots_per_layer == want, cap
        assert r.expert_stats()["expert_cache_bytes"] <= cap
        assert r.experts.n_overflow == E - want
    with pytest.raises(ConfigError, match=rf"capacity \d+ bytes holds no expert per layer.*at least {cost(1)}"):
        _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": cost(1) - 1})
    with pytest.raises(ConfigError, match="holds no expert per layer"):
        _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.02})    # round(0.32) = 0 slots


def test_byte_capacity_bounds_the_cache_memory(cpu_backend):
    """A capacity given in bytes is a memory budget: the cache's memory (its report's
    expert_cache_bytes: every layer's slots plus the shared overflow) fits in it, and the layer
    pools and the overflow pool the backend allocated add up to that report."""
    probe = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.25})
    n_layers, E = _layers_and_experts(probe)
    nb = probe.experts.expert_bytes
    for slots in (3, 8):
        cap = (slots * n_layers + E - slots) * nb + nb // 2
        r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": cap})
        rep = r.expert_stats()
        ex = r.experts
        allocated = sum(L.pool.nbytes for L in ex.layers) + (ex.overflow.nbytes if ex.overflow is not None else 0)
        assert allocated == rep["expert_cache_bytes"] <= cap, (
            f"capacity {cap} bytes, but the cache holds {rep['expert_cache_bytes']} bytes "
            f"({rep['expert_cache_slots_per_layer']} slots x {n_layers} layers + "
            f"{rep['expert_cache_overflow_slots']} overflow slots, {nb} bytes each)")


# ============================================================================ 4. configuration
BAD_CONFIGS = [
    ({"capacity": 0.5, "size": 3}, "unknown expert_cache option"),
    ({"Capacity": 0.5}, "unknown expert_cache option"),
    ({"source": "gpu"}, "source must be one of host, disk"),
    ({"policy": "mru"}, "policy must be one of lfru, lru"),
    ({"policy": "LRU"}, "policy must be one of"),
    ({"capacity": 0}, "must be > 0"),
    ({"capacity": 0.0}, "must be > 0"),
    ({"capacity": -0.5}, "must be > 0"),
    ({"capacity": -4096}, "must be > 0"),
    ({"capacity": True}, "must be a number"),
    ({"capacity": "0.5"}, "must be a number"),
    ({"capacity": None}, "must be a number"),
    ({"capacity": float("nan")}, "must be a number"),
    ({"capacity": 1.5}, "must be an integer"),
    ({"capacity": 4096.5}, "must be an integer"),
    ({"capacity": float("inf")}, "must be an integer"),
    ({"prefetch": "yes"}, "prefetch must be true or false"),
    ({"prefetch": 1}, "prefetch must be true or false"),
    ({"pause_free": "no"}, "pause_free must be true or false"),
    (0.5, "expert_cache must be an object"),
    ("disk", "expert_cache must be an object"),
    ([{"capacity": 0.5}], "expert_cache must be an object"),
    (True, "expert_cache must be an object"),
]


@pytest.mark.parametrize("value, fragment", BAD_CONFIGS, ids=[repr(v) for v, _ in BAD_CONFIGS])
def test_engine_config_rejects_bad_expert_cache(value, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        EngineConfig.from_any({"expert_cache": value})


GOOD_CONFIGS = [    # (capacity, source, prefetch, policy); None: chosen per backend
    ({}, (1.0, None, None, "lfru")),
    ({"capacity": 0.5}, (0.5, None, None, "lfru")),
    ({"capacity": 1}, (1.0, None, None, "lfru")),               # 1 is the whole, not one byte
    ({"capacity": 1 << 30}, (1 << 30, None, None, "lfru")),
    ({"capacity": 1e9}, (10 ** 9, None, None, "lfru")),         # an integral float above 1: bytes
    ({"capacity": 0.25, "source": "host", "prefetch": False, "policy": "lru"}, (0.25, "host", False, "lru")),
    ({"source": "disk", "policy": "lfru", "prefetch": True}, (1.0, "disk", True, "lfru")),
    ({"capacity": 0.5, "pause_free": False}, (0.5, None, None, "lfru")),
]


@pytest.mark.parametrize("value, want", GOOD_CONFIGS, ids=[json.dumps(v) for v, _ in GOOD_CONFIGS])
def test_engine_config_accepts_valid_expert_cache(value, want):
    cfg = EngineConfig.from_any({"expert_cache": value})
    assert cfg.expert_cache == value
    c = ExpertCacheConfig.parse(cfg.expert_cache)
    assert (c.capacity, c.source, c.prefetch, c.policy) == want
    assert type(c.capacity) is type(want[0])          # a fraction stays a float, bytes are an int
    assert c.pause_free is value.get("pause_free")
    assert EngineConfig.from_any({}).expert_cache is None and ExpertCacheConfig.parse(None) is None


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A tiny V3 checkpoint whose every layer is dense (first_k_dense_replace = num_hidden_layers)
    while its config still names 8 routed experts; no MTP layer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tiny_checkpoints
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    d = dict(tiny_checkpoints.BASE)
    d.update(num_hidden_layers=2, first_k_dense_replace=2)
    cfg = DeepseekV3Config(**d, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5, num_mtp_layers=0)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("ec_dense") / "dense"
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(out)
    from deepinfer.model import Checkpoint

    ck = Checkpoint(out)
    assert ck.config.n_routed_experts == 8 and not any(".experts." in n or ".gate." in n for n in ck.names())
    return out


def test_model_without_routed_experts_rejects_the_cache(dense_dir, tmp_path):
    """n_routed_experts 0: a dense model, for which the option is an error that says so."""
    import shutil

    zero = tmp_path / "zero"
    shutil.copytree(dense_dir, zero)
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["n_routed_experts"] = 0
    (zero / "config.json").write_text(json.dumps(cfg))
    be = deepinfer.get_backend("reference")
    ModelRunner(zero, be, RunnerConfig(max_batch=2, max_seq_len=32))        # loads without the cache
    with pytest.raises(ConfigError, match="no routed experts"):
        ModelRunner(zero, be, RunnerConfig(max_batch=2, max_seq_len=32, expert_cache={"capacity": 0.5}))


def test_model_with_no_moe_layer_rejects_the_cache(dense_dir):
    """Routed experts in the config but no MoE layer at all (first_k_dense_replace covers every layer):
    there is nothing to cache, which must be the same clear ConfigError, not a crash."""
    be = deepinfer.get_backend("reference")
    ModelRunner(dense_dir, be, RunnerConfig(max_batch=2, max_seq_len=32))   # a valid dense model
    with pytest.raises(ConfigError, match="expert_cache"):
        ModelRunner(dense_dir, be, RunnerConfig(max_batch=2, max_seq_len=32, expert_cache={"capacity": 0.5}))


# ============================================================================ 5. LayerSlots and the policies
def _consistent(ls: LayerSlots) -> None:
    for s, e in enumerate(ls.expert_in):
        if e >= 0:
            assert ls.slot_of[e] == s
    for e, s in enumerate(ls.slot_of):
        if s >= 0:
            assert ls.expert_in[s] == e
    assert ls.unused_prefetch <= {e for e in ls.expert_in if e >= 0}
    assert ls.table.tolist() == ls.slot_of          # the kernel's id -> slot map mirrors slot_of


def test_layer_slots_sizes_and_policy_names():
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match="needs 1..8 slots"):
            LayerSlots(8, bad)
    with pytest.raises(ValueError, match="is not one of lfru, lru"):
        make_policy("fifo", 8)
    LayerSlots(8, 8, "lru")
    LayerSlots(8, 1, "lfru")


def test_lru_evicts_the_least_recently_used():
    ls = LayerSlots(E=6, n_slots=3, policy="lru")
    hits, used, loads, over = ls.route([0, 1, 2])
    assert hits == [] and used == [] and over == []
    assert loads == [(0, 0, -1), (1, 1, -1), (2, 2, -1)]           # free slots first, nothing evicted
    assert ls.route([1]) == ([1], [], [], [])
    assert ls.route([0]) == ([0], [], [], [])                       # recency now: 0, then 1, then 2
    hits, _, loads, _ = ls.route([3])
    assert hits == [] and loads == [(3, 2, 2)]                      # 3 takes the slot of 2
    hits, _, loads, _ = ls.route([4])
    assert loads == [(4, 1, 1)]                                     # then of 1 (0 was used after it)
    assert ls.route([0]) == ([0], [], [], [])
    _consistent(ls)
    assert sorted(ls.expert_in) == [0, 3, 4]


def test_lfru_keeps_a_hot_expert_that_lru_evicts():
    """Expert 0 is used five steps running, then 1 and 2 once each: LRU evicts 0 for 2 (used longest
    ago), LFRU evicts 1 (its decayed count is far lower) and the next use of 0 is a hit."""
    seq = [[0]] * 5 + [[1], [2], [0]]
    out = {}
    for policy in ("lru", "lfru"):
        ls = LayerSlots(E=4, n_slots=2, policy=policy)
        res = [ls.route(step) for step in seq]
        out[policy] = res
        _consistent(ls)
    assert out["lru"][6][2] == [(2, 0, 0)] and out["lfru"][6][2] == [(2, 1, 1)]
    assert out["lru"][7][0] == [] and out["lru"][7][2] == [(0, 1, 1)]     # a miss: 0 was flushed
    assert out["lfru"][7][0] == [0] and out["lfru"][7][2] == []           # a hit


def test_lfru_decays_old_uses():
    """Uses count with a decay, not as a raw count: 30 uses of 0 long ago (a decayed score of ~3.0)
    weigh less than 10 recent uses of 1 (~5.9), so 0 is the victim, which plain LFU would keep."""
    ls = LayerSlots(E=4, n_slots=2, policy="lfru")
    for _ in range(30):
        ls.route([0])
    for _ in range(10):
        ls.route([1])
    hits, _, loads, _ = ls.route([2])   # both slots taken: the victim is 0 or 1
    assert loads == [(2, 0, 0)]
    assert ls.resident(1) and ls.resident(2) and not ls.resident(0)


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_route_never_evicts_a_needed_expert(policy):
    rng = random.Random(1)
    E, n = 12, 4
    ls = LayerSlots(E, n, policy)
    for _ in range(400):
        needed = rng.sample(range(E), rng.randint(1, 7))
        before = {e for e in range(E) if ls.resident(e)}
        hits, used, loads, over = ls.route(needed)
        assert hits == [e for e in needed if e in before]
        assert sorted(hits + [e for e, _, _ in loads] + over) == sorted(needed)
        for e, s, evicted in loads:
            assert evicted not in needed and ls.expert_in[s] == e
        if over:
            # only when every slot holds an expert this step needs
            assert all(e in needed for e in ls.expert_in)
            assert len(over) == len(needed) - n
        assert all(ls.resident(e) for e in needed if e not in over)
        _consistent(ls)


def test_route_overflow_when_all_slots_are_needed():
    ls = LayerSlots(E=8, n_slots=2, policy="lfru")
    hits, used, loads, over = ls.route([5, 6, 7, 1])
    assert hits == [] and loads == [(5, 0, -1), (6, 1, -1)] and over == [7, 1]
    hits, used, loads, over = ls.route([5, 6, 2])
    assert hits == [5, 6] and loads == [] and over == [2]            # 5 and 6 are needed: nothing to evict
    assert not ls.resident(7) and not ls.resident(2)


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_prefetch_spares_predicted_experts_and_counts_use_once(policy):
    ls = LayerSlots(E=8, n_slots=3, policy=policy)
    ls.route([0, 1, 2])
    placed = ls.prefetch([1, 3])              # 1 is resident: only 3 loads, evicting 0 or 2, never 1
    assert len(placed) == 1 and placed[0][0] == 3 and placed[0][2] in (0, 2)
    assert ls.resident(1) and ls.resident(3)
    assert ls.unused_prefetch == {3}
    hits, used, loads, over = ls.route([3, 1])
    assert hits == [3, 1] and used == [3] and loads == [] and over == []   # 1 was resident anyway
    hits, used, _, _ = ls.route([3, 1])
    assert hits == [3, 1] and used == []                                # reported once only
    # more predictions than slots: the prefetch stops, never evicting one predicted for this step
    ls2 = LayerSlots(E=8, n_slots=2, policy=policy)
    ls2.route([6])
    placed = ls2.prefetch([0, 1, 2])
    assert placed == [(0, 1, -1), (1, 0, 6)]          # a free slot, then the unpredicted 6; 2 finds none
    assert ls2.resident(0) and ls2.resident(1) and not ls2.resident(2)
    # a prefetched expert evicted before use is no longer reported
    hits, used, loads, over = ls2.route([4, 5])
    assert used == [] and ls2.unused_prefetch == set()
    _consistent(ls2)


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_prefetch_random_sequences(policy):
    rng = random.Random(7)
    E, n = 10, 4
    ls = LayerSlots(E, n, policy)
    pending = set()          # prefetched and not yet reported as used
    for _ in range(300):
        predicted = rng.sample(range(E), rng.randint(0, 6))
        placed = ls.prefetch(predicted)
        for e, s, evicted in placed:
            assert e in predicted and evicted not in predicted
        pending = (pending | {e for e, _, _ in placed}) & {e for e in range(E) if ls.resident(e)}
        assert ls.unused_prefetch == pending
        if len(predicted) <= n:
            assert all(ls.resident(e) for e in predicted)
        needed = rng.sample(range(E), rng.randint(1, 5))
        hits, used, loads, over = ls.route(needed)
        assert set(used) == pending & set(needed) and len(used) == len(set(used))
        pending -= set(needed)
        pending &= {e for e in range(E) if ls.resident(e)}
        _consistent(ls)


# ============================================================================ 6. plans that pause
def _paused_plan(be):
    """x -> a = x + x, b = x * x | pause "mid" (reads a, b; the host writes k) | c = b + k | pause
    "end" (reads c) | pause "again" (an empty segment) | d = c * c (the output)."""
    tr = Tracer(be)
    x = tr.input("x", (8,), "f32")
    k = tr.input("k", (8,), "f32")
    a = tr.empty((8,), "f32", "a")
    tr.add(a=x, b=x, out=a)
    b = tr.empty((8,), "f32", "b")
    # a is not read by any op after this point: only the pause keeps it alive (else b may reuse it)
    tr.mul(a=x, b=x, out=b)
    tr.pause("mid", a=a, b=b)
    c = tr.empty((8,), "f32", "c")
    tr.add(a=b, b=k, out=c)
    tr.pause("end", c=c)
    tr.pause("again")
    d = tr.empty((8,), "f32", "d")
    tr.mul(a=c, b=c, out=d)
    tr.output("d", d)
    return _bound(tr, be, ("test",))


def _bound(tr: Tracer, be, key) -> tuple:
    """(the plan of a tracer, bound to an arena of its own, the arena)."""
    p = Plan.from_tracer(key, tr)
    arena = Arena(be)
    arena.ensure(p.arena_bytes)
    p.bind(arena, be)
    return p, arena


def _run_paused(p, be, xv, kv, seen):
    p.host_input("x")[:] = xv

    def on_pause(pz):
        seen.append(pz.tag)
        if pz.tag == "mid":
            assert set(pz.tensors) == {"a", "b"}
            np.testing.assert_array_equal(be.to_numpy(pz.tensors["a"]), xv + xv)
            np.testing.assert_array_equal(be.to_numpy(pz.tensors["b"]), xv * xv)
            p.pause_input("k")[:] = kv            # an input written in the middle of the step
            p.send_pause_input("k", be)
        elif pz.tag == "end":
            np.testing.assert_array_equal(be.to_numpy(pz.tensors["c"]), xv * xv + kv)
        else:
            assert pz.tag == "again" and pz.tensors == {}

    p.run(be, on_pause)
    return be.to_numpy(p.bound_outputs["d"]).copy()


def test_pause_without_prior_write_is_an_error():
    tr = Tracer(None)
    a = tr.empty((4,), "f32")
    with pytest.raises(RuntimeError, match="pause 'p' reads .* before any op wrote it"):
        tr.pause("p", a=a)


@pytest.mark.parametrize("bname", ["reference", "cpu"])
def test_plan_runs_segment_by_segment(bname, cpu_backend):
    be = _backend(bname, cpu_backend)
    p, _ = _paused_plan(be)
    assert p.has_pauses
    segs = p.prepared(be)
    assert [pz.tag if pz else None for _, pz in segs] == ["mid", "end", "again", None]
    assert [len(calls) for calls, _ in segs] == [2, 1, 0, 1]
    rng = np.random.default_rng(0)
    for _ in range(2):
        xv, kv = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
        seen = []
        d = _run_paused(p, be, xv, kv, seen)
        assert seen == ["mid", "end", "again"]
        np.testing.assert_array_equal(d, (xv * xv + kv) ** 2)
    with pytest.raises(RuntimeError, match="got no on_pause"):
        p.run(be)
    # a plan without pauses still runs without on_pause
    tr = Tracer(be)
    x = tr.input("x", (4,), "f32")
    y = tr.empty((4,), "f32")
    tr.add(a=x, b=x, out=y)
    tr.output("y", y)
    q, _ = _bound(tr, be, ("plain",))
    q.host_input("x")[:] = [1, 2, 3, 4]
    assert not q.has_pauses
    q.run(be)
    np.testing.assert_array_equal(be.to_numpy(q.bound_outputs["y"]), [2, 4, 6, 8])


def test_captured_segments_replay_the_same(cpu_backend):
    """On the CPU library a plan with pauses is captured as one graph per segment (none for an empty
    one); replays read fresh inputs, including the one the host writes in a pause."""
    be = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    stream = be.create_stream()
    be.set_stream(stream)
    try:
        assert be.supports_graphs
        p, _ = _paused_plan(be)
        rng = np.random.default_rng(1)
        xv, kv = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
        eager = _run_paused(p, be, xv, kv, [])
        p.capture(be)
        assert isinstance(p.graph, list) and len(p.graph) == 4
        assert p.graph[2] is None and all(g is not None for i, g in enumerate(p.graph) if i != 2)
        seen = []
        np.testing.assert_array_equal(_run_paused(p, be, xv, kv, seen), eager)
        assert seen == ["mid", "end", "again"]
        for _ in range(2):
            xv, kv = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
            np.testing.assert_array_equal(_run_paused(p, be, xv, kv, []), (xv * xv + kv) ** 2)
    finally:
        be.set_stream(None)
        stream.close()


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
def test_runner_captures_each_segment_of_a_cached_decode_plan(device_path, cpu_backend):
    """The CPU runner captures decode plans after their first run; with the cache a plan pauses
    once per MoE layer, so its graph is a list with one entry per segment. On the device path a
    layer pauses twice: after the router (the routing goes to the host) and before moe_experts (the
    shared experts between them run while the host decides)."""
    ec = _device(0.5, "disk") if device_path else {"capacity": 0.5}
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", ec)
    assert r.use_graphs
    _workload(r, 4096)
    decode = [(k, p) for k, p in r.plans.items() if k.mode == "decode" and p.runs > 1]
    assert {k[0] for k, _ in decode} == {"main", "mtp"}
    for k, p in decode:
        segs = p.prepared(r.backend)
        layers = range(4) if k[0] == "main" else [4]     # the main model's 4 MoE layers, or the MTP layer
        per = [("expert_ids",), ("experts",)] if device_path else [("experts",)]
        want = [kind + (pos,) for pos in layers for kind in per]
        assert p.has_pauses and len(segs) == len(want) + 1 and segs[-1][1] is None
        assert [tuple(pz.tag) for _, pz in segs[:-1]] == want      # (binding turns the tag into a list)
        assert isinstance(p.graph, list) and len(p.graph) == len(segs)


# ============================================================================ loads under stress, other step shapes
def _on_reader_reads(monkeypatch, before) -> None:
    """Every checkpoint read on a cache reader thread first calls before() (a slow disk, a failing
    one); reads on other threads go straight through."""
    import threading

    from deepinfer.model.expert_cache.sources import ExpertSources

    pread = ExpertSources.pread

    def wrapped(ranges, dst):
        if threading.current_thread().name.startswith("deepinfer-experts"):
            before()
        pread(ranges, dst)

    monkeypatch.setattr(ExpertSources, "pread", staticmethod(wrapped))


def _drain(ex) -> None:
    """Wait for every load of the cache still in flight (pending ones, and those given up), then take
    back their bounce buffers."""
    for L in ex.layers:
        for slot in list(L.pending):
            ex.loads.finish(L, slot, compute_waits=False)
    for ld in ex.loads.reading:     # loads given up when their slot went to another expert
        ld.read.exception(timeout=30)
    ex.loads.pump()
    ex.loads.pump()


def _slow_native_reads(monkeypatch, seconds: float) -> None:
    """The native readers wait `seconds` before every piece they read (a slow disk)."""
    from deepinfer.model.expert_cache.loads import Loads

    start = Loads.start_native

    def slowed(self, required):
        start(self, required)
        self.native.delay(seconds)

    monkeypatch.setattr(Loads, "start_native", slowed)


def _needs_native():
    if native_reader.load() is None:
        pytest.skip(f"native expert readers unavailable: {native_reader.unavailable_reason()}")


# the three reader set-ups: host-memory backends' reader thread; a device's Python readers; its native ones
READERS = [(None, False), (False, False), (False, None)]
READER_IDS = ["host-path", "device-path-python-readers", "device-path-native-readers"]


@pytest.mark.parametrize("host_memory, native", READERS, ids=READER_IDS)
def test_slow_reads_are_waited_for(host_memory, native, cpu_backend, monkeypatch):
    """Reads on the reader thread(s) take milliseconds (a slow disk): a layer whose experts are
    still arriving waits for them, so the results stay bit-identical (a layer that ran on a slot
    before its bytes arrived would compute with another expert's weights)."""
    import time

    if native is None:
        _needs_native()
        _slow_native_reads(monkeypatch, 0.003)
    else:
        _on_reader_reads(monkeypatch, lambda: time.sleep(0.003))
    ec = ExpertCacheConfig(capacity=0.5, source="disk", prefetch=True, host_memory=host_memory,
                           native_readers=native)
    r = _assert_bit_identical("cpu", cpu_backend, NANO, "bf16", ec, 4096, raw=True)
    assert r.expert_stats()["expert_prefetch_issued"] > 0
    assert r.experts.readers == ("native" if native is None else "python")


def test_few_bounce_buffers(cpu_backend, monkeypatch):
    """The device path reads disk experts through a bounded set of pinned bounce buffers (here the
    minimum, 2) while many loads are in flight: loads queue for a buffer on the main thread, nothing
    deadlocks."""
    from deepinfer.model.expert_cache import loads as EC

    monkeypatch.setattr(EC, "BOUNCE_BYTES", 1)
    # a deadlock would hang the suite: the run gets a (generous) watchdog that turns it into a failure
    r = _with_watchdog(lambda: _assert_bit_identical("cpu", cpu_backend, NANO, "bf16",
                                                     _device(0.25, "disk", prefetch=True), 4096, raw=True))
    assert r.expert_stats()["expert_misses"] + r.expert_stats()["expert_prefetch_issued"] > 2
    # once the loads still in flight (prefetches nobody waited for yet) are done, every buffer is back
    ex = r.experts
    _drain(ex)
    assert len(ex.loads.bounce_free) == 2


def test_pieces_cover_an_expert_image(cpu_backend):
    """A device disk load is read in pieces of CHUNK_BYTES of the image (each sent to the slot as soon
    as it is read): the pieces together read exactly the bytes one read of the whole expert does,
    whatever the piece size, and each piece's runs lie inside its own image range."""
    from deepinfer.model.expert_cache.sources import pieces as _pieces

    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", _device(0.5, "disk"))
    ex = r.experts
    nb = ex.layout.nbytes
    for L, e in ((ex.layers[0], 0), (ex.layers[-1], ex.E - 1)):
        runs = ex.sources.expert_ranges(L, e)
        want = np.zeros(nb, np.uint8)
        ex.sources.pread(runs, want)
        for chunk in (4096, 10_000, 65536, nb, 4 * nb):
            pieces = _pieces(runs, nb, chunk)
            assert len(pieces) == -(-nb // chunk) and all(n <= chunk for _, _, n in pieces)
            got = np.zeros(nb, np.uint8)
            for prs, at, n in pieces:
                for _, _, parts in prs:
                    assert all(at <= a and a + k <= at + n for a, k in parts)
                ex.sources.pread(prs, got)
            assert np.array_equal(got, want), chunk
    ex.close()


@pytest.mark.parametrize("native", [False, None], ids=["python-readers", "native-readers"])
def test_device_path_reads_in_pieces_on_many_threads(native, cpu_backend, monkeypatch):
    """Small pieces (12 per expert), slow reads on 8 reader threads, prefetches given up when their
    slot goes to another expert: the logits stay bit-identical to the resident model's, and every
    bounce buffer comes back."""
    import time

    from deepinfer.model.expert_cache import loads as EC

    if native is None:
        _needs_native()
        _slow_native_reads(monkeypatch, 0.0005)
    else:
        _on_reader_reads(monkeypatch, lambda: time.sleep(0.0005))
    monkeypatch.setattr(EC, "CHUNK_BYTES", 16384)
    r = _with_watchdog(lambda: _assert_bit_identical("cpu", cpu_backend, NANO, "bf16",
                                                     _device(0.25, "disk", prefetch=True, native_readers=native),
                                                     4096, raw=True))
    ex = r.experts
    assert ex.read_threads == EC.DEVICE_READ_THREADS
    assert all(len(v) == 12 for v in ex.loads.chunks.values())
    st = r.expert_stats()
    assert st["expert_prefetch_issued"] > 0 and st["expert_misses"] > 0 and st["expert_loads_given_up"] > 0
    _drain(ex)
    assert not ex.loads.reading and not ex.loads.copying and not ex.loads.queued


@pytest.mark.parametrize("host_memory", [None, False], ids=["host-path", "device-path-python-readers"])
def test_a_failed_read_is_an_error_not_a_hang(host_memory, cpu_backend, monkeypatch):
    """A checkpoint read that fails on a reader thread (a disk gone, a file truncated under us)
    reaches the step that needs the expert as that OSError, whichever piece failed; nothing waits
    forever for a load that will not come."""
    from deepinfer.model.expert_cache import loads as EC

    calls = {"n": 0}

    def failing():
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("simulated: the checkpoint's disk went away")

    _on_reader_reads(monkeypatch, failing)
    monkeypatch.setattr(EC, "CHUNK_BYTES", 65536)
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16",
                ExpertCacheConfig(capacity=0.25, source="disk", prefetch=True, host_memory=host_memory,
                                  native_readers=False))
    rng = np.random.default_rng(5)

    def run():
        sid = r.new_sequence()
        for i, t in enumerate(rng.integers(3, 4096, 64).tolist()):
            r.forward([(sid, [t], i)])

    with pytest.raises(OSError, match="disk went away"):
        _with_watchdog(run)


def test_readers_take_misses_before_prefetches():
    """The reader threads take jobs by priority, in submission order within one: a miss submitted
    after queued prefetches is read before them, and the background fill comes last."""
    import threading

    from deepinfer.model.expert_cache.loads import PRIORITY
    from deepinfer.model.expert_cache.readers import ReaderThreads as _Readers

    rd = _Readers(1, "deepinfer-experts-test")
    gate, order = threading.Event(), []
    rd.submit(0, gate.wait, 10)                       # holds the one thread while the queue fills
    fs = [rd.submit(PRIORITY[k], order.append, name) for k, name in
          (("fill", "fill"), ("prefetch", "p1"), ("prefetch", "p2"), ("miss", "m1"), ("overflow", "o1"))]
    gate.set()
    for f in fs:
        f.result(timeout=10)
    assert order == ["m1", "o1", "p1", "p2", "fill"]
    boom = rd.submit(0, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(timeout=10)
    rd.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        rd.submit(0, print)


def test_an_installed_build_bundles_the_native_readers():
    """Wherever pip installed the CPU backend, the expert cache's native readers are installed
    beside it (CMake builds both), and the runtime finds them there."""
    from deepinfer.loader import bundled_lib_dirs

    dirs = [d for d in bundled_lib_dirs() if (d / "libdeepinfer_cpu.so").is_file()]
    if not dirs:
        pytest.skip("no installed build of the CPU backend (run from a source tree)")
    assert any((d / native_reader.LIB_NAME).is_file() for d in dirs), dirs
    if not os.environ.get(native_reader.ENV_LIB):
        assert native_reader.load() is not None, native_reader.unavailable_reason()


def _native_pool(cpu_backend, threads: int):
    """NativeReaders on a CPU backend context, copying on a stream of its own."""
    _needs_native()
    be = _backend("cpu", cpu_backend)
    return be, native_reader.NativeReaders(be, be.create_stream(), threads)


def _native_load(be, rd, fd: int, nbytes: int, chunk: int, priority: int):
    """A load of a file's first nbytes into a fresh poisoned destination: (job, its destination, the event)."""
    from deepinfer.model.expert_cache.sources import merged as _merged, pieces as _pieces

    plan = native_reader.Plan(_pieces(_merged([(fd, 0, nbytes, 0)]), nbytes, chunk))
    bounce, dst, ev = be.host_empty((nbytes,), "uint8"), be.empty((nbytes,), "uint8"), be.create_event()
    be.copy_async(dst, _tensor(np.full(nbytes, 0xAB, np.uint8)))
    be.synchronize()
    return rd.submit(priority, plan, bounce, dst, ev), dst, ev


def _tensor(a: np.ndarray):
    from deepinfer.tensor import Tensor

    return Tensor(a, a.shape, "uint8")


def test_native_readers_order_cancel_and_bytes(cpu_backend, tmp_path):
    """The native readers take loads by priority, in submission order within one (a miss passes
    queued prefetches, the fill comes last); a load given up while queued issues no copy and leaves
    its slot as it was; every other load's bytes arrive whole, in pieces, through the backend's copies."""
    import time

    from deepinfer.model.expert_cache.loads import PRIORITY

    be, rd = _native_pool(cpu_backend, 1)
    data = np.random.default_rng(7).integers(0, 256, 200_000, dtype=np.uint8)
    path = tmp_path / "experts.bin"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        rd.hold(True)                              # the one reader takes nothing while the queue fills
        kinds = ["fill", "prefetch", "prefetch", "miss", "prefetch", "overflow"]
        loads = [_native_load(be, rd, fd, 150_000 + 1000 * i, 7000, PRIORITY[k]) for i, k in enumerate(kinds)]
        given_up = loads[4][0]
        given_up.cancel()
        t0 = time.perf_counter()
        assert not loads[3][0].wait(0.02) and not loads[3][0].done()     # held: the wait times out
        assert time.perf_counter() - t0 >= 0.015
        rd.hold(False)
        for job, _, _ in loads:
            job.result(timeout=30)
        order = sorted(range(len(kinds)), key=lambda i: loads[i][0].done_order())
        assert [i for i in order if i != 4] == [3, 5, 1, 2, 0]
        assert not given_up.copied()
        for i, (job, dst, ev) in enumerate(loads):
            n = 150_000 + 1000 * i
            ev.synchronize()
            got = be.to_numpy(dst)
            if i == 4:
                assert (got == 0xAB).all()           # never written
            else:
                assert job.copied() and job.error() is None
                assert np.array_equal(got, data[:n])
    finally:
        rd.shutdown()
        os.close(fd)


def test_native_readers_report_a_short_read(cpu_backend, tmp_path):
    """A file shorter than the load asks for (truncated under us) fails that load with an error
    that says so: nothing hangs, nothing is copied from bytes never read."""
    be, rd = _native_pool(cpu_backend, 2)
    path = tmp_path / "short.bin"
    np.zeros(1000, np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        job, dst, _ = _native_load(be, rd, fd, 50_000, 8192, 0)
        with pytest.raises(OSError, match="short read"):
            job.result(timeout=30)
        assert "truncated" in job.error()
    finally:
        rd.shutdown()
        os.close(fd)
    with pytest.raises(RuntimeError, match="shut down"):
        _native_load(be, rd, fd, 10, 10, 0)


def test_native_readers_shut_down_with_loads_queued(cpu_backend, tmp_path):
    """Shutting the readers down gives up what is still queued: every load ends (done, no copy
    for those never started) and the threads stop; nothing waits forever."""
    be, rd = _native_pool(cpu_backend, 2)
    path = tmp_path / "experts.bin"
    np.ones(100_000, np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        rd.hold(True)
        jobs = [_native_load(be, rd, fd, 100_000, 4096, 1)[0] for _ in range(4)]
        _with_watchdog(rd.shutdown, 60)
        assert all(j.done() and not j.copied() for j in jobs)
    finally:
        os.close(fd)


def test_native_read_errors_reach_the_step(cpu_backend, monkeypatch, tmp_path):
    """A checkpoint read that fails on a native reader (here: every expert file is one that ends
    early) reaches the step that needs the expert as an OSError; nothing waits forever."""
    from deepinfer.model.expert_cache.sources import ExpertSources

    _needs_native()
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    monkeypatch.setattr(ExpertSources, "fd", lambda self, path: self.fds.setdefault(
        "short", os.open(short, os.O_RDONLY)))
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", _device(0.25, "disk", prefetch=True))
    assert r.experts.readers == "native"
    rng = np.random.default_rng(5)

    def run():
        sid = r.new_sequence()
        for i, t in enumerate(rng.integers(3, 4096, 16).tolist()):
            r.forward([(sid, [t], i)])

    with pytest.raises(OSError, match="short read"):
        _with_watchdog(run)


def test_chunked_prefill_and_score(cpu_backend):
    """Multi-token steps of sequences already started (chunked prefill, score()'s chunks) with the
    cache give the resident model's logits of every position."""
    rng = np.random.default_rng(4)
    ids = rng.integers(3, 4096, 120).tolist()             # chunks of 48, 48 and 24 tokens
    want = _runner(NANO, _backend("cpu", cpu_backend), "bf16").score(ids, chunk=48)
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.25, "policy": "lru", "prefetch": True})
    got = r.score(ids, chunk=48)
    assert got.shape == (120, 4096) and np.array_equal(want, got)
    assert r.expert_stats()["expert_overflow_loads"] > 0


# ============================================================================ 7. the command line
def _cli(argv, monkeypatch, capsys) -> tuple:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _stats_line(err: str) -> dict:
    lines = [l for l in err.splitlines() if l.startswith("deepinfer: stats ")]
    assert len(lines) == 1, err
    return json.loads(lines[0][len("deepinfer: stats "):])


def test_cli_run_with_expert_cache(monkeypatch, capsys):
    argv = ["run", "--verbose", "Once upon a time", "--max-new-tokens", "8"]
    rc, plain, err = _cli(argv, monkeypatch, capsys)
    assert rc == 0, err
    assert "expert_hits" not in _stats_line(err)
    rc, cached, err = _cli(["run", "--verbose", "--expert-cache", '{"capacity": 0.5}', "Once upon a time",
                            "--max-new-tokens", "8"], monkeypatch, capsys)
    assert rc == 0, err
    assert "Traceback" not in err
    assert cached == plain and cached.startswith("Once upon a time") and len(cached) > len("Once upon a time\n")
    s = _stats_line(err)
    assert s["expert_hits"] + s["expert_misses"] == s["expert_needed"] > 0
    assert s["expert_cache_slots_per_layer"] == 8 and s["generated_tokens"] >= 1


@pytest.mark.parametrize("value, fragment", [
    ("{bad", "--expert-cache: not valid JSON"),
    ("", "--expert-cache: not valid JSON"),               # given but empty: not "no cache"
    ('{"capacity": 0.5', "--expert-cache: not valid JSON"),
    ("[0.5]", "expert_cache must be an object"),
    ('{"capacity": 0}', "expert_cache.capacity must be > 0"),
    ('{"capacity": 2.5}', "must be an integer"),
    ('{"size": 1}', "unknown expert_cache option"),
    ('{"source": "ssd"}', "expert_cache.source must be one of"),
    ('{"capacity": 4096}', "holds no expert per layer"),        # valid JSON and type, too small for the model
])
def test_cli_bad_expert_cache(value, fragment, monkeypatch, capsys):
    rc, out, err = _cli(["run", "x", "--max-new-tokens", "2", "--backend", "reference", "--expert-cache", value],
                        monkeypatch, capsys)
    assert rc == EXIT_USAGE, (rc, err)
    assert fragment in err, err
    assert "Traceback" not in err and out == ""


# ============================================================================ 8. the engine
PROMPTS = ["Once upon a time", "The little dog", "She opened the door and saw", "1, 2, 3,"]


def test_engine_generate_same_with_and_without_the_cache(cpu_backend):
    base = dict(backend=cpu_backend.info.path, num_threads=2)
    plain = Engine.from_pretrained(None, config=base)
    cached = Engine.from_pretrained(None, config={**base, "expert_cache": {"capacity": 0.5}})
    assert cached.runner.experts is not None and plain.runner.experts is None
    for prompt in PROMPTS[:2]:
        a = plain.generate(prompt, max_new_tokens=12, temperature=0.0)
        b = cached.generate(prompt, max_new_tokens=12, temperature=0.0)
        assert a == b and a
    # several prompts run together (a batched prefill, then decode in a padded bucket)
    assert plain.generate_batch(PROMPTS, max_new_tokens=10, temperature=0.0) == \
        cached.generate_batch(PROMPTS, max_new_tokens=10, temperature=0.0)
    s = cached.stats()
    assert s["expert_hits"] + s["expert_misses"] == s["expert_needed"] > 0


def test_engine_chunked_prefill_same_with_and_without_the_cache(cpu_backend):
    """Prompts longer than a step's token budget (prefilled in chunks, mixed with other requests'
    decode steps) and more requests than max_batch: the engine's greedy tokens do not change."""
    base = dict(backend=cpu_backend.info.path, num_threads=2, max_batch=3, max_num_batched_tokens=32)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 4096, n).tolist() for n in (100, 5, 70, 33, 9)]
    outs = []
    for ec in (None, {"capacity": 0.25, "policy": "lru", "prefetch": True}, {"capacity": 0.5, "source": "host"}):
        eng = Engine.from_pretrained(None, config={**base, "expert_cache": ec})
        outs.append(eng.generate_ids(prompts, max_new_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o) == 16 for o in outs[0])
    assert outs[1] == outs[0] and outs[2] == outs[0]


# ============================================================================ resources (not in the brief's list)
def _open_files_under(d: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(d)):
                n += 1
        except OSError:
            pass
    return n


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_dropping_a_cached_runner_closes_its_files(cpu_backend, tmp_path):
    """The disk source reads through file descriptors of its own; a runner that is dropped must not
    keep them open (a server or a test suite builds many engines in one process)."""
    import shutil

    d = tmp_path / "nano"
    shutil.copytree(NANO, d)
    gc.collect()
    assert _open_files_under(d) == 0
    r = _runner(d, _backend("cpu", cpu_backend), "bf16", {"capacity": 0.25, "source": "disk"})
    r.forward([r.new_sequence()], [[5, 6, 7, 8, 9]], [0])
    assert _open_files_under(d) > 0
    del r
    gc.collect()
    assert _open_files_under(d) == 0, "the expert cache's checkpoint file descriptors outlive the runner"


# ============================================================================ the warm-up step runs dry
def test_dry_steps_load_nothing_and_route_nowhere(cpu_backend):
    """The device warm-up that sizes the KV cache runs a prefill with the cache dry: no expert is
    read (lazy loading stays lazy) and every pair is routed nowhere, so the step computes the
    model without its routed experts; the next real step loads and matches the resident model."""
    r = _runner(NANO, _backend("cpu", cpu_backend), "bf16", {"capacity": 1.0})
    r.experts.dry = True
    dry = r.backend.to_numpy(r.forward([(1, [5, 6, 7, 8], 0)])).copy()
    rep = r.expert_stats()
    assert rep["expert_bytes_streamed"] == 0 and rep["expert_needed"] == 0 and np.isfinite(dry).all()
    r.experts.dry = False
    r.free(1)
    got = r.backend.to_numpy(r.forward([(2, [5, 6, 7, 8], 0)])).copy()
    base = _runner(NANO, _backend("cpu", cpu_backend), "bf16")
    want = base.backend.to_numpy(base.forward([(2, [5, 6, 7, 8], 0)])).copy()
    assert np.array_equal(got, want) and not np.array_equal(dry, want)
    assert r.expert_stats()["expert_misses"] > 0


# ============================================================================ a device library
# DEEPINFER_CUDA_LIB=... (backends/cuda/device.sh expert-cache on the GPU machine): the same
# bit-identity on the device, where the copy stream, events and pinned buffers are real
DEVICE_LIB = os.environ.get("DEEPINFER_CUDA_LIB")
DEVICE_CASES = [
    {"capacity": 0.25, "source": "host"},
    {"capacity": 0.25, "source": "disk", "policy": "lru", "prefetch": False},
    {"capacity": 0.5, "source": "disk"},
    {"capacity": 0.5, "source": "host", "prefetch": True, "policy": "lfru"},
    {"capacity": 1.0},
]


@pytest.mark.skipif(not DEVICE_LIB, reason="needs DEEPINFER_CUDA_LIB (a GPU backend library)")
@pytest.mark.parametrize("ec", DEVICE_CASES, ids=_id)
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("act", ["bf16", "f32"])        # bf16: what the engine runs on a device
def test_bit_identical_device(ec, eager, act):
    assert_bit_identical_on_device(NANO, "bf16", ec, 4096, enforce_eager=eager, dtype=act)


def assert_bit_identical_on_device(path, precision, ec, vocab, **kw) -> None:
    """On the DEVICE_LIB library (real copy stream, events, pinned buffers): the cached model's
    logits equal the resident model's at every step of _workload, and the counters add up."""
    def lib():
        return deepinfer.loader.load_library(DEVICE_LIB)

    want = _workload(_runner(path, lib(), precision, **kw), vocab)
    r = _runner(path, lib(), precision, ec, **kw)
    assert r.experts is not None and not r.experts.host_memory
    got = _workload(r, vocab)
    for i, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, b), f"step {i}: the cached model differs by {float(np.abs(a - b).max())}"
    _check_counters(r.expert_stats(), r.experts.prefetch, ExpertCacheConfig.parse(ec).policy)


def test_device_path_without_streams_is_a_clear_error(cpu_backend, monkeypatch):
    """A device library without ABI 1.1's streams / events cannot overlap copies: a ConfigError that
    says so at load, not a failure in the middle of a step."""
    from deepinfer.errors import UnsupportedOpError

    be = _backend("cpu", cpu_backend)

    def no_streams():
        raise UnsupportedOpError("stream_create", 3, "UNIMPLEMENTED", "this library lacks stream_create")

    monkeypatch.setattr(be, "create_stream", no_streams)
    with pytest.raises(ConfigError, match="needs streams, events and asynchronous copies"):
        _runner(NANO, be, "bf16", ExpertCacheConfig(capacity=0.5, host_memory=False), enforce_eager=True)


# ============================================================================ lazy loading's background fill
@pytest.mark.parametrize("ec", [{"capacity": 1.0}, _device(1.0, "disk"), _device(1.0, "host")], ids=_id)
def test_fill_then_steps_without_pauses(ec, cpu_backend):
    """Lazy loading (capacity 1.0) fills the experts nobody routed yet in the background after the
    first step; once every expert is resident the plans are traced again without pauses (the eager
    model's step over the cache's memory). Logits equal the resident model's before, across and
    after the switch."""
    be = _backend("cpu", cpu_backend)
    r = _runner(NANO, be, "bf16", ec)
    base = _runner(NANO, _backend("cpu", cpu_backend), "bf16")
    assert r.experts.fill and not r.experts.direct
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 4096, 9).tolist()
    got, want = [], []
    for runner, out in ((r, got), (base, want)):
        sid = runner.new_sequence()
        out.append(runner.backend.to_numpy(runner.forward([(sid, prompt, 0)])).copy())
        tok, pos = int(np.argmax(out[-1][0])), len(prompt)
        for _ in range(40):
            out.append(runner.backend.to_numpy(runner.forward([(sid, [tok], pos)])).copy())
            tok, pos = int(np.argmax(out[-1][0])), pos + 1
            if runner is r and r.experts.direct and len(out) > 35:
                break
    assert r.experts.direct, "the background fill never completed"
    assert all(not p.has_pauses for p in r.plans.values())     # retraced without pauses
    assert all(np.array_equal(a, b) for a, b in zip(got, want[:len(got)]))
    rep = r.expert_stats()
    n_layers, E = _layers_and_experts(r)
    assert _resident_pairs(r) == n_layers * E
    assert rep["expert_direct"] is True and rep["expert_fill_loads"] > 0
    assert rep["expert_bytes_streamed"] == n_layers * E * rep["expert_bytes"]     # each expert read once


def test_fill_options():
    assert ExpertCacheConfig.parse({"capacity": 1.0, "fill": False}).fill is False
    assert ExpertCacheConfig.parse({}).fill is None
    with pytest.raises(ConfigError, match="needs capacity 1.0"):
        ExpertCacheConfig.parse({"capacity": 0.5, "fill": True})
    with pytest.raises(ConfigError, match="fill must be true or false"):
        ExpertCacheConfig.parse({"fill": "yes"})


# ============================================================================ precision "auto" with a cache
def test_auto_precision_counts_only_what_the_cache_holds(cpu_backend):
    """precision auto sizes the weights against the memory budget; with an expert cache the routed
    experts count at the cache's share, so a budget too small for the whole bf16 model but large
    enough for it with a quarter of its experts keeps the checkpoint's bf16 (no lossy fallback)."""
    from deepinfer import precision as P
    from deepinfer.model import Checkpoint
    from deepinfer import quant_formats as QF

    ck = Checkpoint(NANO)
    shapes = QF.logical_shapes(ck.entries(), ck.array)
    full = P.weight_bytes(shapes, "bf16", 64, True, 4)
    cached = P.resident_weight_bytes(shapes, "bf16", {"capacity": 0.25}, 64, True, 4)
    experts = P.weight_bytes({n: s for n, s in shapes.items() if ".mlp.experts." in n}, "bf16", 64, True, 4)
    assert full - experts < cached < full
    # a byte capacity is what the cache allocates (at most every expert plus the overflow)
    assert P.resident_weight_bytes(shapes, "bf16", {"capacity": 1 << 20}, 64, True, 4) == full - experts + (1 << 20)
    budget = (cached + full) // 2
    base = {"backend": "cpu", "memory_budget_bytes": budget, "max_batch": 1, "max_seq_len": 128}
    plain = Engine.from_pretrained(None, config=base)
    assert plain.runner.precision not in (None, "bf16")          # bf16 does not fit: a lossy path
    streamed = Engine.from_pretrained(None, config={**base, "expert_cache": {"capacity": 0.25}})
    assert streamed.runner.precision is None or streamed.runner.precision == "bf16"
    assert "bf16" in streamed.runner.precision_note and "expert cache" in streamed.runner.precision_reason


# ============================================================================ pause-free steps
def _pause_free_workload(bname, cpu_lib, path, precision, ec, vocab, *, always=False, lib=None, **kw):
    """_workload on a cached runner, against the resident model. always: every decode step first
    tries to run without pauses (the back-off disabled), so steps that miss are run again with
    pauses. Returns the cached runner."""
    want = _baseline(bname, cpu_lib, path, precision, vocab, **kw) if lib is None else \
        _workload(_runner(path, lib(), precision, **kw), vocab)
    r = _runner(path, _backend(bname, cpu_lib) if lib is None else lib(), precision, ec, **kw)
    if always:
        r.experts.pause_free_steps.after = 0       # stays 0: doubling 0 is 0, and a clean count of 0 reaches it
    got = _workload(r, vocab)
    for i, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, b), f"step {i}: the cached model differs by {float(np.abs(a - b).max())}"
    rep = r.expert_stats()
    _check_counters(rep, r.experts.prefetch, ExpertCacheConfig.parse(ec).policy)
    return r


PAUSE_FREE_CASES = [  # (backend, cache)
    ("cpu", {"capacity": 1.0, "fill": False}),
    ("cpu", _device(1.0, "disk", fill=False)),
    ("reference", {"capacity": 1.0, "fill": False, "source": "host"}),
]


@pytest.mark.parametrize("bname,ec", PAUSE_FREE_CASES, ids=lambda x: x if isinstance(x, str) else _id(x))
def test_pause_free_steps_once_every_expert_is_in_place(bname, ec, cpu_backend):
    """Every expert resident after the prefill (capacity 1.0 without the background fill): after two
    decode steps that load nothing the steps run without pauses, the kernels finding each expert's
    slot in the table on the device, and the logits stay the resident model's."""
    r = _pause_free_workload(bname, cpu_backend, NANO, "bf16", ec, 4096)
    rep = r.expert_stats()
    assert rep["expert_pause_free"] is True
    assert rep["expert_pause_free_steps"] >= 3 and rep["expert_pause_free_retries"] == 0
    # the pause-free steps' routing reached the policy: every expert they needed counted as a hit
    assert rep["expert_hits"] + rep["expert_misses"] == rep["expert_needed"]
    assert any(k.pause_free for k in r.plans)               # a pause-free plan was traced and kept


RETRY_CASES = [  # (backend, model, cache)
    ("cpu", "nano", {"capacity": 0.25}),
    ("cpu", "nano", {"capacity": 0.5, "source": "host", "policy": "lru", "prefetch": True}),
    ("cpu", "nano", _device(0.25, "disk")),
    ("cpu", "nano", _device(0.5, "host", policy="lru", prefetch=False)),
    ("reference", "nano", {"capacity": 0.5, "source": "disk"}),
    ("cpu", "v32", {"capacity": 0.5, "source": "disk", "prefetch": True}),
]


@pytest.mark.parametrize("bname,model,ec", RETRY_CASES,
                         ids=lambda x: x if isinstance(x, str) else _id(x))
def test_a_pause_free_step_that_misses_is_run_again(bname, model, ec, cpu_backend, tiny_checkpoint):
    """Every decode step first runs without pauses; with a partial cache most of them route to an
    expert that is not resident: moe_experts skips and flags those pairs, the host sees the flags
    after the step and runs it again with pauses, which rewrites the cache rows the failed attempt
    wrote. The logits (and the MTP head's, which reads those rows) stay the resident model's."""
    path, vocab = (NANO, 4096) if model == "nano" else (tiny_checkpoint(model)[0], 256)
    prec = "bf16" if model == "nano" else None
    r = _pause_free_workload(bname, cpu_backend, path, prec, ec, vocab, always=True)
    rep = r.expert_stats()
    assert rep["expert_pause_free_retries"] >= 3
    assert rep["expert_pause_free_steps"] + rep["expert_pause_free_retries"] >= 8


def test_pause_free_off_pauses_every_step(cpu_backend):
    r = _pause_free_workload("cpu", cpu_backend, NANO, "bf16", {"capacity": 1.0, "fill": False,
                                                                  "pause_free": False}, 4096)
    rep = r.expert_stats()
    assert rep["expert_pause_free"] is False and rep["expert_pause_free_steps"] == 0
    assert not any(k.pause_free for k in r.plans)


def test_pause_free_backs_off_after_misses():
    """The back-off on the bookkeeping alone: a miss doubles the clean paused steps the next try
    waits for, a clean pause-free step halves it again (never below the start)."""
    from deepinfer.model.expert_cache import ExpertCache
    from deepinfer.model.expert_cache import pause_free as EC

    class Fake:
        pass
    ec = Fake()
    ec.stats = {"expert_pause_free_retries": 0}
    pf = ec.pause_free_steps = EC.PauseFreeSteps(None, True, [], 1, ec.stats)
    pf.after, pf.clean = EC.PAUSE_FREE_AFTER, 5
    pf.records = {1: (None, np.array([[[[0]]], [[[1]]]], np.int32), None)}
    pf.recorded = {1: {0}}
    ec.route_seconds = 0.0
    for want in (4, 8, 16):
        assert ExpertCache.after_pause_free(ec, 1) is False
        assert pf.after == want and pf.clean == 0
    pf.after = EC.PAUSE_FREE_AFTER_MAX
    assert ExpertCache.after_pause_free(ec, 1) is False and pf.after == EC.PAUSE_FREE_AFTER_MAX
    assert ec.stats["expert_pause_free_retries"] == 4


@pytest.mark.skipif(not DEVICE_LIB, reason="needs DEEPINFER_CUDA_LIB (a GPU backend library)")
@pytest.mark.parametrize("ec,always", [({"capacity": 1.0, "fill": False}, False),
                                       ({"capacity": 0.25, "source": "disk"}, True),
                                       ({"capacity": 0.5, "source": "host", "prefetch": True}, True)],
                         ids=["all-in-place", "retry-0.25-disk", "retry-0.5-host"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_pause_free_on_device(ec, always, eager):
    """On the device: pause-free steps (captured as one graph each) equal the resident model's, and
    those that miss are run again with pauses."""
    r = _pause_free_workload(None, None, NANO, "bf16", ec, 4096, always=always, enforce_eager=eager, dtype="bf16",
                             lib=lambda: deepinfer.loader.load_library(DEVICE_LIB))
    rep = r.expert_stats()
    if always:
        assert rep["expert_pause_free_retries"] > 0
        assert rep["expert_pause_free_steps"] + rep["expert_pause_free_retries"] >= 5
    else:
        assert rep["expert_pause_free_steps"] >= 3


def test_a_library_older_than_1_5_is_refused(cpu_backend, monkeypatch):
    """The cache hands moe_experts its table (expert_map, ABI 1.5): on an older library it says so at
    load instead of failing in the first step."""
    be = _backend("cpu", cpu_backend)
    monkeypatch.setattr(type(be), "abi_minor", property(lambda self: 4))
    with pytest.raises(ConfigError, match=r"needs moe_experts' expert_map \(ABI 1.5\).*ABI 1.4"):
        _runner(NANO, be, "bf16", {"capacity": 0.5})
