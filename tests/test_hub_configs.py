"""The config.json of every DeepSeek release: V2/V3-family ones parse at full size and, shrunk to
tiny dims with the same structure, build random checkpoints whose logits match transformers; V3.2
and V4 parse at full size (their tiny checkpoints: tests/tiny_checkpoints.py v32, tests/tiny_v4.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tiny_checkpoints
from deepinfer.errors import CheckpointError
from deepinfer.model import ModelConfig
from deepinfer.engine import ModelRunner, RunnerConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# name: (model_type, layers, routed experts, top-k, topk_method, q-LoRA, MTP layers, fp8 storage)
RELEASES = {
    "deepseek-v2": ("deepseek_v2", 60, 160, 6, "group_limited_greedy", 1536, 0, False),
    "deepseek-v2-lite": ("deepseek_v2", 27, 64, 6, "greedy", None, 0, False),
    "deepseek-v2.5": ("deepseek_v2", 60, 160, 6, "group_limited_greedy", 1536, 0, False),
    "deepseek-v3": ("deepseek_v3", 61, 256, 8, "noaux_tc", 1536, 1, True),
    "deepseek-v3-0324": ("deepseek_v3", 61, 256, 8, "noaux_tc", 1536, 1, True),
    "deepseek-r1": ("deepseek_v3", 61, 256, 8, "noaux_tc", 1536, 1, True),
    "deepseek-v3.1": ("deepseek_v3", 61, 256, 8, "noaux_tc", 1536, 1, True),
}
PROMPT = [5, 17, 200, 3, 99, 42, 7, 130]


def _assert_prefill_matches(path, hf, backend) -> None:
    """Our prefill logits of PROMPT against the transformers oracle's."""
    model = ModelRunner(path, backend, RunnerConfig(max_batch=1, max_seq_len=16, block_size=4))
    got = backend.to_numpy(model.forward([(0, PROMPT, 0)], all_logits=True))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
    assert np.isfinite(got).all()
    assert float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max())) < 1e-4


def _published(name: str) -> dict:
    return json.loads((tiny_checkpoints.HUB_CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_published_config_parses_at_full_size(name):
    mt, layers, experts, topk, method, q_lora, mtp, fp8 = RELEASES[name]
    c = ModelConfig.from_dict(_published(name), name)
    assert (c.model_type, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == (mt, layers, experts, topk)
    assert c.topk_method == method and c.q_lora_rank == q_lora and c.num_nextn_predict_layers == mtp
    assert c.rope.type == "yarn" and c.rope.factor == 40 and c.rope.original_max_position == 4096
    assert c.scoring_func == ("sigmoid" if mt == "deepseek_v3" else "softmax")
    assert (c.quant_scheme is not None) == fp8
    if fp8:
        assert c.quant_scheme.format == "fp8" and tuple(c.quant_scheme.block) == (128, 128)
    assert c.cache_width == 512 + 64 and c.qk_head_dim == 192


def test_v4_flash_config_parses_at_full_size():
    c = ModelConfig.from_dict(_published("deepseek-v4-flash"), "deepseek-v4-flash")
    v = c.v4
    assert c.model_type == "deepseek_v4" and c.num_hidden_layers == 43 and c.num_attention_heads == 64
    assert (v.head_dim, c.qk_rope_head_dim, v.o_groups, v.o_lora_rank, v.hc_mult) == (512, 64, 8, 1024, 4)
    # DeepSeek's compress_ratios (one entry more than layers: the MTP layer's) become layer types
    assert v.layer_types[:4] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention"] and v.layer_types[-1] == "compressed_sparse_attention"
    assert [v.ratio(i) for i in (0, 2, 3)] == [0, 4, 128]
    assert v.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert c.scoring_func == "sqrtsoftplus" and c.routed_scaling_factor == 1.5 and v.swiglu_limit == 10.0
    # yarn only on the compressed layers, without YaRN's mscale on cos / sin (as transformers)
    assert v.rope_main.type == "default" and v.rope_main.theta == 10000
    assert v.rope_compress.type == "yarn" and v.rope_compress.theta == 160000 and v.rope_compress.factor == 16
    assert v.rope_compress.attn_factor == 1.0
    assert c.quant_scheme is not None and c.quant_scheme.format == "fp8"


def test_v32_config_parses_at_full_size():
    c = ModelConfig.from_dict(_published("deepseek-v3.2-exp"), "deepseek-v3.2-exp")
    assert c.model_type == "deepseek_v32" and c.num_hidden_layers == 61 and c.cache_width == 512 + 64
    assert (c.dsa.index_n_heads, c.dsa.index_head_dim, c.dsa.index_topk) == (64, 128, 2048)
    assert c.topk_method == "noaux_tc" and c.scoring_func == "sigmoid" and c.rope.factor == 40


def test_v32_release_structure_matches_transformers(model_backend, tmp_path):
    path, hf = tiny_checkpoints.make_from_hub_config("deepseek-v3.2-exp", tmp_path / "v32", seed=7)
    _assert_prefill_matches(path, hf, model_backend)


def test_v32_keys_under_the_v3_model_type_are_refused():
    d = dict(_published("deepseek-v3.2-exp"), model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(CheckpointError, match="index_topk.*only deepseek_v32 models have"):
        ModelConfig.from_dict(d)


def test_unknown_architecture_lists_what_runs():
    with pytest.raises(CheckpointError, match="unsupported architecture.*deepseek_v2, deepseek_v3"):
        ModelConfig.from_dict({"model_type": "llama", "vocab_size": 8})


@pytest.mark.parametrize("layout", ["hub", "fused"])
@pytest.mark.parametrize("name", sorted(RELEASES))
def test_release_structure_matches_transformers(name, layout, model_backend, tmp_path):
    seed = sorted(RELEASES).index(name)
    path, hf = tiny_checkpoints.make_from_hub_config(name, tmp_path / name, seed=seed, layout=layout)
    from deepinfer.model import Checkpoint

    assert Checkpoint(path).layout == layout
    ours = ModelConfig.from_file(path / "config.json")
    pub = ModelConfig.from_dict(_published(name))
    for key in ("model_type", "topk_method", "scoring_func", "n_group", "topk_group", "num_experts_per_tok",
                "norm_topk_prob", "routed_scaling_factor", "rope"):
        assert getattr(ours, key) == getattr(pub, key), key   # the tiny model keeps the release's structure
    _assert_prefill_matches(path, hf, model_backend)
