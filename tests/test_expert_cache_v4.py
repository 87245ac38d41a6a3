"""The expert cache on DeepSeek V4 (model.expert_cache with model.deepseek_v4): the routed experts of
a tiny random V4 checkpoint (tests/tiny_v4.py: hash-routed layers 0-1, top-k layers 2-3, clipped
SwiGLU, hc_mult streams) stream through bounded per-layer slots, and every logit equals the resident
model's bit for bit: every capacity, both sources and policies, prefetch on and off, the device path
driven on a host backend, lazy loading's switch to pause-free plans, DeepSeek's own layout (renamed
at open: the disk reads still find each expert's bytes) and transformers' fused one, and the fp4
experts of DeepSeek's release, read raw as stored or converted at load, and the MTP layer's experts.

Prefetch guesses layer i+1's experts from layer i's streams (the next layer's ffn hyper-connection,
norm and router, as if its attention added nothing); a hash-routed next layer is guessed exactly
from the token ids, which test_hash_layers_are_prefetched_exactly checks on the trace."""
from __future__ import annotations

import pytest

from deepinfer.engine import ModelRunner, RunnerConfig

import tiny_v4
from test_expert_cache import (DEVICE_LIB, _assert_bit_identical, _backend, _check_counters, _device, _id, _workload,
                               _pause_free_workload, assert_bit_identical_on_device)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# block size 4 puts several blocks in every compression window's reach; 64 batched tokens hold the
# 60-token prefill of _workload
KW = dict(block_size=4)
_DIRS: dict = {}


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    def get(kind="hf"):
        if kind not in _DIRS:
            path = tmp_path_factory.mktemp(f"ec_v4_{kind}")
            if kind == "quantized":
                tiny_v4.make_quantized(path, seed=5)
            elif kind == "mtp":        # DeepSeek's layout with its `mtp.0` layer
                tiny_v4.make(path, seed=5, layout="deepseek", mtp=True)
            else:
                tiny_v4.make(path, seed=5, layout=kind)
            _DIRS[kind] = path
        return _DIRS[kind]
    return get


CASES = [  # (backend, layout, precision, cache, experts read raw from the files)
    ("cpu", "hf", None, {"capacity": 0.25}, True),
    ("cpu", "hf", None, {"capacity": 0.5, "source": "disk", "prefetch": True}, True),
    ("cpu", "hf", None, {"capacity": 0.5, "source": "host", "policy": "lru", "prefetch": True}, True),
    ("cpu", "hf", None, _device(0.5, "disk"), True),
    ("cpu", "hf", "int8", {"capacity": 0.5, "prefetch": True}, False),
    ("reference", "hf", None, {"capacity": 0.25, "source": "disk", "prefetch": True}, True),
    ("cpu", "deepseek", None, {"capacity": 0.25, "source": "disk", "prefetch": True}, True),
    ("cpu", "fused", None, _device(0.25, "host"), True),
    # the MTP layer's experts stream too (_workload runs its head after every decode step)
    ("cpu", "mtp", None, {"capacity": 0.5, "source": "disk", "prefetch": True}, True),
    ("reference", "mtp", None, _device(0.25, "host"), True),
    # DeepSeek's release: fp4 e2m1 experts with ue8m0 scales, streamed as stored or converted to bf16
    ("cpu", "quantized", None, {"capacity": 0.5, "source": "disk", "prefetch": True}, True),
    ("cpu", "quantized", "bf16", {"capacity": 0.25, "source": "host"}, False),
    ("reference", "quantized", None, _device(0.5, "disk"), True),
]


@pytest.mark.parametrize("bname, layout, precision, ec, raw", CASES,
                         ids=[f"{b}-{l}-{p or 'stored'}-{_id(e)}" for b, l, p, e, _ in CASES])
def test_bit_identical(bname, layout, precision, ec, raw, v4_dir, cpu_backend):
    vocab = 256
    r = _assert_bit_identical(bname, cpu_backend, v4_dir(layout), precision, ec, vocab, raw=raw, **KW)
    mtp = r.weights.mtp is not None
    assert mtp == (layout == "mtp")
    assert r.family.name == "DeepSeek V4" and len(r.experts.layers) == r.cfg.num_hidden_layers + mtp    # every V4 layer is MoE


def test_hash_layers_are_prefetched_exactly(v4_dir, cpu_backend):
    """Layers 0 and 1 route by token id (hash_moe): layer 0's experts are prefetched from the ids
    before each step starts, layer 1's are predicted at layer 0's pause; both are the truth at every
    step. The top-k layers' guesses are real predictions: right more often than not, never told the
    answer."""
    r = ModelRunner(v4_dir("hf"), _backend("cpu", cpu_backend),
                    RunnerConfig(expert_cache={"capacity": 0.5, "prefetch": True}, max_batch=4, max_seq_len=128,
                                 max_num_batched_tokens=64, **KW))
    assert r.cfg.v4.mlp_layer_types[:3] == ["hash_moe", "hash_moe", "moe"]
    r.experts.trace = []
    _workload(r, 256)
    guessed: dict = {}
    steps = 0
    for pos, needed, predicted in r.experts.trace:
        if pos == -1:                   # before the step: layer 0's experts from the token ids
            steps += 1
        if predicted is not None:
            guessed[(steps, pos + 1)] = set(predicted)
        if (steps, pos) in guessed and pos >= 0:
            guessed[(steps, pos)] = (guessed[(steps, pos)], set(needed))
    assert steps == 11                  # the prefill and 10 decode steps, each through every layer
    hashed = [v for (s, pos), v in guessed.items() if pos in (0, 1)]
    assert len(hashed) == 2 * steps and all(p == n for p, n in hashed)
    topk = [v for (s, pos), v in guessed.items() if pos >= 2]
    assert len(topk) == 2 * steps
    hit = sum(len(p & n) for p, n in topk) / sum(len(n) for _, n in topk)
    assert 0.5 < hit < 1.0, hit
    _check_counters(r.expert_stats(), True, "lfru")


@pytest.mark.parametrize("bname, layout, ec, always", [
    ("cpu", "hf", {"capacity": 1.0, "fill": False}, False),
    ("cpu", "hf", {"capacity": 0.5, "source": "disk", "prefetch": True}, True),
    ("cpu", "mtp", _device(0.25, "host"), True),
    ("reference", "hf", {"capacity": 0.5, "source": "host"}, True)],
    ids=["cpu-in-place", "cpu-retry", "cpu-mtp-retry-device-path", "reference-retry"])
def test_pause_free_steps(bname, layout, ec, always, v4_dir, cpu_backend):
    """V4's graph without pauses (hash-routed layers included: their ids come from the token ids on
    the device), and steps that miss run again with pauses: the logits stay the resident model's."""
    r = _pause_free_workload(bname, cpu_backend, v4_dir(layout), None, ec, 256, always=always, **KW)
    rep = r.expert_stats()
    if always:
        assert rep["expert_pause_free_retries"] >= 3
    else:     # capacity 1.0 without fill: an expert routed for the first time still misses
        assert rep["expert_pause_free_steps"] >= 3


@pytest.mark.skipif(not DEVICE_LIB, reason="needs DEEPINFER_CUDA_LIB (a GPU backend library)")
@pytest.mark.parametrize("ec", [{"capacity": 0.25, "source": "disk"}, {"capacity": 0.5, "source": "host"},
                                {"capacity": 1.0}], ids=_id)
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("act", ["bf16", "f32"])        # bf16: what the engine runs on a device
def test_bit_identical_device(ec, eager, act, v4_dir):
    assert_bit_identical_on_device(v4_dir("quantized"), None, ec, 256, enforce_eager=eager, dtype=act, **KW)
