"""DeepSeek V4 checkpoints as DeepSeek publishes them (tests/tiny_v4.make_quantized): fp8 e4m3
projections with ue8m0 (F8_E8M0) 128x128 block scales, fp4 e2m1 routed experts (I8 [N, K/2], two
per byte, low nibble first) with ue8m0 scales per row and 32 columns, the compressor / indexer
projections in BF16 without a scale; `expert_dtype: fp4` beside or inside quantization_config.

The parser and readers (quant_formats, checkpoint), the sizes precision.resolve works with, and on
every backend: prefill, chunked prefill and decode logits equal to transformers running the same
dequantized weights, loaded as stored and at precision bf16, in DeepSeek's, transformers' per-expert
and transformers' fused layouts."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

from deepinfer import precision as P
from deepinfer import quant_formats as QF
from deepinfer.engine import ModelRunner, RunnerConfig
from deepinfer.errors import CheckpointError

import tiny_v4

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT, rel_err = tiny_v4.PROMPT, tiny_v4.rel_err
_CKPT: dict = {}
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
E2M1 = np.array(tiny_v4.E2M1_VALUES, np.float32)


@pytest.fixture(scope="module")
def v4q(tmp_path_factory):
    """(path, transformers oracle, its logits of PROMPT) per layout, made once per module."""
    def get(layout="deepseek", expert_dtype_at="top"):
        key = (layout, expert_dtype_at)
        if key not in _CKPT:
            path = tmp_path_factory.mktemp(f"v4q_{layout}_{expert_dtype_at}")
            m = tiny_v4.make_quantized(path, seed=3, layout=layout, expert_dtype_at=expert_dtype_at)
            _CKPT[key] = (path, m, tiny_v4.full_logits(m, PROMPT).numpy())
        return _CKPT[key]
    return get


def _header(path) -> dict:
    raw = (path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


# ---------------------------------------------------------------------------- the config


def test_quantization_config_scale_fmt_and_expert_dtype():
    s = QF.parse_quantization_config(dict(tiny_v4.QUANT_CONFIG))
    assert (s.format, s.scale_fmt, s.expert_dtype, s.fp4_experts) == ("fp8", "ue8m0", "fp8", False)
    s = QF.parse_quantization_config({**tiny_v4.QUANT_CONFIG, "expert_dtype": "fp4"})
    assert s.fp4_experts and s.block == (128, 128)
    assert QF.parse_quantization_config(s.to_config()) == s                 # what resolve() is handed back
    assert "fp4 e2m1 group 32" in s.describe() and "ue8m0" in s.describe()
    # the V3 release (no scale_fmt, no expert_dtype) is unchanged
    v3 = QF.parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]})
    assert (v3.scale_fmt, v3.expert_dtype) == ("float", "fp8") and "expert_dtype" not in v3.to_config()
    for bad in ({"expert_dtype": "fp6"}, {"scale_fmt": "e8m0"}):
        with pytest.raises(CheckpointError, match=next(iter(bad))):
            QF.parse_quantization_config({**tiny_v4.QUANT_CONFIG, **bad})
    # DeepSeek-V4-Flash's config.json has expert_dtype beside quantization_config; one inside wins
    top = {"quantization_config": dict(tiny_v4.QUANT_CONFIG), "expert_dtype": "fp4"}
    assert QF.quantization_config_of(top)["expert_dtype"] == "fp4"
    inside = {"quantization_config": {**tiny_v4.QUANT_CONFIG, "expert_dtype": "fp8"}, "expert_dtype": "fp4"}
    assert QF.quantization_config_of(inside)["expert_dtype"] == "fp8"
    assert QF.quantization_config_of({"expert_dtype": "fp4"}) is None         # a float checkpoint stays float


@pytest.mark.parametrize("at", ["top", "quantization_config"])
def test_config_reads_expert_dtype_where_deepseek_and_transformers_put_it(at, v4q):
    from deepinfer.model.config import ModelConfig

    path, _, _ = v4q("deepseek", at)
    s = ModelConfig.from_file(path / "config.json").quant_scheme
    assert s.fp4_experts and s.scale_fmt == "ue8m0"


# ---------------------------------------------------------------------------- the formats, by hand


def _fp4_arrays(values: np.ndarray, scales: np.ndarray):
    """values [N, K] on the e2m1 grid -> DeepSeek's I8 [N, K/2] (element 2i in the low nibble, as
    torch's float4_e2m1fn_x2 and DeepSeek's convert.py have it) and F8_E8M0 scales."""
    codes = np.array([int(np.flatnonzero(E2M1 == v)[0]) if v != 0 else 0 for v in values.reshape(-1)],
                     np.uint8).reshape(values.shape)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scales.astype(ml_dtypes.float8_e8m0fnu)


def test_fp4_weight_is_read_as_stored_low_nibble_first():
    rng = np.random.default_rng(0)
    N, K = 4, 64
    vals = rng.choice(E2M1, size=(N, K)).astype(np.float32)
    scales = np.exp2(rng.integers(-4, 4, size=(N, K // 32))).astype(np.float32)
    packed, s8 = _fp4_arrays(vals, scales)
    store = {"w.weight": packed, "w.weight_scale_inv": s8}
    scheme = {**tiny_v4.QUANT_CONFIG, "expert_dtype": "fp4"}
    t = QF.weight_from_checkpoint(store.__getitem__, "w.weight", scheme, shape=(N, K))
    assert t.dtype.name == "e2m1" and t.shape == (N, K)
    assert t.quant.block == (1, 32) and t.quant.scales.dtype.name == "e8m0"
    assert np.shares_memory(t.buffer, packed)                       # the stored bytes, not a copy
    assert np.array_equal(np.asarray(t.numpy(), np.float32), vals)  # element 2i is the low nibble
    from backends.reference.quant import dequantize_array

    want = vals * np.repeat(scales, 32, axis=1)
    assert np.array_equal(dequantize_array(t), want)
    # one byte spelled out: 0x21 holds 0.5 (code 1) then 1.0 (code 2)
    one = {"w.weight": np.array([[0x21] * 16], np.uint8).view(np.int8),
           "w.weight_scale_inv": np.ones((1, 1), ml_dtypes.float8_e8m0fnu)}
    t1 = QF.weight_from_checkpoint(one.__getitem__, "w.weight", scheme)
    assert list(np.asarray(t1.numpy(), np.float32)[0, :2]) == [0.5, 1.0]
    # and back: the same two tensors
    out = QF.weight_to_checkpoint("w.weight", t)
    assert out["w.weight"].dtype == np.int8 and np.array_equal(out["w.weight"], packed)
    assert np.array_equal(out["w.weight_scale_inv"].view(np.uint8), s8.view(np.uint8))


def test_fp4_scales_as_bytes_floats_and_bad_ones():
    vals = np.tile(E2M1[:8], (2, 4)).astype(np.float32)                     # [2, 32]
    packed, s8 = _fp4_arrays(vals, np.array([[2.0], [0.25]], np.float32))
    scheme = {**tiny_v4.QUANT_CONFIG, "expert_dtype": "fp4"}

    def read(scale):
        store = {"w.weight": packed, "w.weight_scale_inv": scale}
        return QF.weight_from_checkpoint(store.__getitem__, "w.weight", scheme)

    want = vals * np.array([[2.0], [0.25]], np.float32)
    from backends.reference.quant import dequantize_array

    # ue8m0 held as raw bytes (U8), as some checkpoints store them; f32 powers of two
    for scale in (s8.view(np.uint8), np.array([[2.0], [0.25]], np.float32)):
        t = read(scale)
        assert t.quant.scales.dtype.name == "e8m0" and np.array_equal(dequantize_array(t), want)
    with pytest.raises(CheckpointError, match="powers of two"):
        read(np.array([[3.0], [0.25]], np.float32))
    with pytest.raises(CheckpointError, match="NaN"):
        read(np.full((2, 1), 255, np.uint8).view(ml_dtypes.float8_e8m0fnu))
    with pytest.raises(CheckpointError, match="scales per row"):
        read(np.ones((2, 3), ml_dtypes.float8_e8m0fnu))
    with pytest.raises(CheckpointError, match="no 'w.weight_scale_inv'"):
        QF.weight_from_checkpoint({"w.weight": packed}.__getitem__, "w.weight", scheme)
    with pytest.raises(CheckpointError, match="cannot hold"):
        QF.weight_from_checkpoint({"w.weight": packed, "w.weight_scale_inv": s8}.__getitem__, "w.weight",
                                  scheme, shape=(2, 48))


def test_fp8_weight_with_ue8m0_scales():
    w = (np.arange(128 * 256, dtype=np.float32).reshape(128, 256) % 7 - 3).astype(ml_dtypes.float8_e4m3fn)
    s = np.array([[0.5, 4.0]], np.float32)
    for stored in (s.astype(ml_dtypes.float8_e8m0fnu), s.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)):
        t = QF.weight_from_checkpoint({"x.weight": w, "x.weight_scale_inv": stored}.__getitem__, "x.weight",
                                      tiny_v4.QUANT_CONFIG)
        # the ABI's fp8_block takes f32 scales: ue8m0 widens exactly
        assert t.dtype.name == "e4m3" and t.quant.scales.dtype.name == "f32"
        assert np.array_equal(t.quant.scales.numpy(), s)
    # bytes are ue8m0 scales only when the config says so
    v3 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(CheckpointError, match="ue8m0"):
        QF.weight_from_checkpoint({"x.weight": w, "x.weight_scale_inv": s.astype(ml_dtypes.float8_e8m0fnu)
                                   .view(np.uint8)}.__getitem__, "x.weight", v3)


def test_safetensors_f4_dtype_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    from deepinfer.model.checkpoint import SafetensorsFile

    save_file({"w": torch.zeros(2, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(CheckpointError, match="F4.*I8"):
        SafetensorsFile(tmp_path / "x.safetensors")


# ---------------------------------------------------------------------------- the tiny checkpoint


def test_checkpoint_holds_deepseeks_formats_and_reads_them(v4q):
    from deepinfer.model.checkpoint import Checkpoint

    path, _, _ = v4q()
    h = _header(path)
    dtype_shape = {k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"}
    assert dtype_shape["layers.1.ffn.experts.3.w3.weight"] == ("I8", [128, 128])      # up_proj [128, 256]
    assert dtype_shape["layers.1.ffn.experts.3.w3.scale"] == ("F8_E8M0", [128, 8])
    assert h["layers.1.attn.wq_b.weight"]["dtype"] == "F8_E4M3" and h["layers.1.attn.wq_b.scale"]["dtype"] == "F8_E8M0"
    assert h["layers.1.attn.compressor.wkv.weight"]["dtype"] == "BF16" and "layers.1.attn.compressor.wkv.scale" not in h
    ck = Checkpoint(path)
    t = ck.weight(EXPERT, (128, 256))
    assert t.dtype.name == "e2m1" and t.quant.block == (1, 32) and t.quant.scales.shape == (128, 8)
    q_b = ck.weight("model.layers.1.self_attn.q_b_proj.weight", (256, 128))
    assert q_b.dtype.name == "e4m3" and q_b.quant.block == (128, 128) and q_b.quant.scales.shape == (2, 1)
    kv = ck.weight("model.layers.1.self_attn.compressor.kv_proj.weight", (128, 256))
    assert kv.quant is None and kv.dtype.name == "bf16"
    # sizes: packed K/2 read back as K; the side tensors are not model tensors
    entries = ck.entries()
    shapes = QF.logical_shapes(entries, ck.array)
    assert shapes[EXPERT] == (128, 256) and EXPERT + "_scale_inv" not in shapes
    assert P.stored_precision(entries, ck.config.quant_scheme)[0] == "fp8"
    assert QF.is_quantizable(EXPERT, (128, 256)) and QF.is_quantizable("model.layers.1.self_attn.o_a_proj.weight",
                                                                       (256, 128))
    assert not QF.is_quantizable("model.layers.1.self_attn.compressor.indexer.gate_proj.weight", (128, 256))
    # as stored, the routed experts take what they take on disk (e2m1 bytes + one e8m0 per 32)
    experts = {n: sh for n, sh in shapes.items() if ".mlp.experts." in n}
    on_disk = sum(int(np.prod(s)) * np.dtype(dt).itemsize for n, (dt, s) in entries.items() if ".mlp.experts." in n)
    assert len(experts) == 4 * 8 * 3 and P.weight_bytes(experts, "fp8", fp4_experts=True) == on_disk
    assert P.weight_bytes(shapes, "fp8") - P.weight_bytes(shapes, "fp8", fp4_experts=True) > on_disk // 2


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_prefill_then_decode_match_transformers(precision, model_backend, v4q):
    path, _, ref = v4q()
    be = model_backend
    m = ModelRunner(path, be, RunnerConfig(max_batch=2, max_seq_len=64, block_size=4, precision=precision))
    up = m.weights.layers[1].moe.experts_up[3]
    if precision is None:
        assert up.dtype.name == "e2m1" and up.quant.scales.dtype.name == "e8m0"       # as stored
        assert m.weights.layers[1].attn.q_b.dtype.name == "e4m3"
    else:
        assert up.dtype.name == "bf16" and up.quant is None and m.weights.layers[1].attn.q_b.quant is None
    # the same values (ue8m0 scales keep e4m3 / e2m1 products exact in bf16), f32 activations
    tiny_v4.check_cached_steps(m, be, ref)


@pytest.mark.parametrize("layout", ["transformers", "fused"])
def test_transformers_layouts_load_the_same_model(layout, model_backend, v4q):
    path, _, ref = v4q(layout, "quantization_config")
    be = model_backend
    m = ModelRunner(path, be, RunnerConfig(max_batch=1, max_seq_len=64, block_size=4))
    assert m.weights.layers[2].moe.experts_down[5].dtype.name == "e2m1"
    got = be.to_numpy(m.forward([(0, PROMPT, 0)], all_logits=True))
    assert rel_err(got, ref) < 1e-4


def test_engine_precision_auto_keeps_the_stored_formats(v4q):
    import deepinfer
    from deepinfer.config import EngineConfig
    from deepinfer.engine import load_runner

    path, _, ref = v4q()
    be = deepinfer.get_backend("reference")
    m = load_runner(path, be, EngineConfig(max_batch=1, max_seq_len=32, precision="auto"))
    assert m.precision is None and not m.precision_lossy
    assert "fp4 e2m1" in m.precision_reason and m.weights.layers[3].moe.experts_gate[0].dtype.name == "e2m1"
    m = load_runner(path, be, EngineConfig(max_batch=1, max_seq_len=32, precision="bf16"))
    assert m.precision == "bf16" and m.weights.layers[3].moe.experts_gate[0].dtype.name == "bf16"
    with pytest.raises(Exception, match="int4"):
        load_runner(path, be, EngineConfig(max_batch=1, max_seq_len=32, precision="int4"))


def test_backend_without_fp4_falls_back_to_a_float_precision(v4q):
    """A backend whose linear cannot take e2m1 cannot run the checkpoint as stored: auto dequantizes."""
    import deepinfer
    from deepinfer.config import EngineConfig

    class NoFp4:
        def __init__(self, be):
            self._be = be

        def __getattr__(self, k):
            return getattr(self._be, k)

        def query(self, op, **args):
            w = args.get("w")
            if op == "linear" and w is not None and w.dtype.name == "e2m1":
                from deepinfer import abi

                return abi.SUPPORT_NO, "no fp4 here"
            return self._be.query(op, **args)

    be = NoFp4(deepinfer.get_backend("reference"))
    caps = P.backend_capabilities(be, fp4_experts=True, precisions=("fp8", "bf16"))
    assert caps["fp8"] == 0 and caps["bf16"] != 0
    assert P.backend_capabilities(be, precisions=("fp8",))["fp8"] != 0       # V3's fp8 needs no fp4
    path, _, _ = v4q()
    from deepinfer.model.checkpoint import Checkpoint

    ck = Checkpoint(path)
    shapes = QF.logical_shapes(ck.entries(), ck.array)
    prec, why = P.resolve(be, EngineConfig(precision="auto", memory_budget_bytes=2**34), shapes,
                          ck.config.quant_scheme.to_config(), stored=P.stored_precision(ck.entries(),
                                                                                        ck.config.quant_scheme))
    assert prec in ("bf16", "f32") and "cannot run it" in why
