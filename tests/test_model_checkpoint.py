"""Config parsing and checkpoint loading: every malformed input is a CheckpointError that names the
file (and the tensor), and loading never modifies the model directory."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct

import numpy as np
import pytest

import safetensors_edit
from deepinfer.errors import CheckpointError
from deepinfer.model import Checkpoint, ModelConfig
from deepinfer.engine import ModelRunner, RunnerConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

V3_HUB = {  # keys as DeepSeek publishes them for V3 (shrunk)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1000,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
    "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_config_from_deepseek_hub_keys():
    c = ModelConfig.from_dict(V3_HUB)
    assert c.rope.type == "yarn" and c.rope.factor == 40 and c.rope.original_max_position == 4096
    m = 0.1 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(32 ** -0.5 * m * m)
    assert c.rope.attn_factor == pytest.approx(1.0)
    assert c.weight_block_size == (128, 128) and c.has_mtp
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert c.cache_width == 48 and c.scoring_func == "sigmoid" and c.topk_method == "noaux_tc"


def test_config_v2_lite_and_transformers_keys():
    d = dict(V3_HUB, model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy", n_group=1,
             topk_group=1, norm_topk_prob=False)
    for k in ("scoring_func", "quantization_config", "rope_scaling", "rope_theta"):
        d.pop(k)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    c = ModelConfig.from_dict(d)
    assert c.q_lora_rank is None and c.scoring_func == "softmax" and c.rope.type == "default"
    assert c.softmax_scale == pytest.approx(32 ** -0.5) and c.weight_block_size is None
    # yarn without mscale_all_dim: cos/sin scaled by transformers' default attention factor
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                            "original_max_position_embeddings": 64}
    assert ModelConfig.from_dict(d).rope.attn_factor == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize("bad,needle", [
    ({"model_type": "llama"}, "'llama'"),
    ({"topk_method": "random"}, "topk_method"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
    ({"n_group": 3}, "n_group"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_experts_per_tok": 5}, "kept groups"),   # 5 > 2 kept groups x 2 experts
])
def test_config_errors_name_file_and_value(tmp_path, bad, needle):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**V3_HUB, **bad}))
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_file(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_config_not_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_file(p)


def _hashes(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture
def v2lite_copy(tiny_copy):
    return tiny_copy("v2lite")


def test_loading_never_writes(v2lite_copy):
    import deepinfer

    before = _hashes(v2lite_copy)
    m = ModelRunner(v2lite_copy, deepinfer.get_backend("reference"), RunnerConfig(max_batch=1, max_seq_len=16))
    m.forward([(0, [1, 2, 3], 0)])
    assert _hashes(v2lite_copy) == before


@pytest.mark.parametrize("damage,needle", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:5], "truncated"),
    (lambda b: struct.pack("<Q", 10 ** 9) + b[8:], "header length"),
    (lambda b: b[:8] + b"\xff" * 16 + b[24:], "corrupt safetensors header"),
])
def test_corrupt_safetensors(v2lite_copy, damage, needle):
    st = v2lite_copy / "model.safetensors"
    st.write_bytes(damage(st.read_bytes()))
    before = _hashes(v2lite_copy)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(v2lite_copy)
    assert str(st) in str(e.value) and needle in str(e.value)
    assert _hashes(v2lite_copy) == before


def test_missing_tensor(v2lite_copy):
    import deepinfer

    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    safetensors_edit.edit(v2lite_copy / "model.safetensors", lambda h: h.pop(name))
    with pytest.raises(CheckpointError) as e:
        ModelRunner(v2lite_copy, deepinfer.get_backend("reference"), RunnerConfig(max_batch=1, max_seq_len=16))
    assert name in str(e.value) and "missing" in str(e.value)


def test_shape_mismatch(v2lite_copy):
    import deepinfer

    name = "model.layers.0.self_attn.o_proj.weight"

    def swap(h):
        h[name]["shape"] = list(reversed(h[name]["shape"]))
    safetensors_edit.edit(v2lite_copy / "model.safetensors", swap)
    with pytest.raises(CheckpointError) as e:
        ModelRunner(v2lite_copy, deepinfer.get_backend("reference"), RunnerConfig(max_batch=1, max_seq_len=16))
    msg = str(e.value)
    assert name in msg and "model.safetensors" in msg and "shape" in msg


def test_unknown_dtype_and_bad_offsets(v2lite_copy):
    st = v2lite_copy / "model.safetensors"
    orig = st.read_bytes()
    safetensors_edit.edit(st, lambda h: h["model.norm.weight"].update(dtype="Q7"))
    with pytest.raises(CheckpointError, match="unknown dtype 'Q7'"):
        Checkpoint(v2lite_copy)
    st.write_bytes(orig)
    safetensors_edit.edit(st, lambda h: h["model.norm.weight"].update(data_offsets=[0, 12]))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        Checkpoint(v2lite_copy)


def test_unknown_architecture_dir(v2lite_copy):
    p = v2lite_copy / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "model_type": "mixtral"}))
    with pytest.raises(CheckpointError, match="mixtral"):
        Checkpoint(v2lite_copy)


def test_missing_shard_and_files(tiny_checkpoint, tmp_path):
    src, _, _ = tiny_checkpoint("v3")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    (dst / "model-mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-mtp.safetensors"):
        Checkpoint(dst)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(V3_HUB))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint(tmp_path / "empty")


def test_memory_mapped(tiny_checkpoint):
    src, _, _ = tiny_checkpoint("v3")
    ck = Checkpoint(src)
    a = ck.array("model.embed_tokens.weight")
    assert isinstance(a.base, np.memmap) or isinstance(a, np.memmap) or not a.flags.owndata
    assert not a.flags.writeable
