"""Tiny random DeepSeek V4 checkpoints made with transformers, and the transformers models that
serve as their oracles.

The config is a Flash-like layer mix at toy sizes: sliding, CSA, HCA and CSA layers; hash-routed
MoE in the first two layers and top-k MoE after; hc_mult streams; a sliding window of 8 tokens,
CSA windows of 4 and HCA windows of 8 tokens, so a prompt of 30 tokens is longer than the window
and than several compression windows, and index_topk 3 makes the indexer choose among them.

Layouts (make(..., layout=)):
  hf        what transformers' save_pretrained writes by default: DeepSeek's module names under
            `model.` with `head.weight` (its conversion mapping reversed), experts per expert
  deepseek  DeepSeek's own names as published (`embed.weight`, `layers.N.attn.wq_a.weight`,
            `layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`, ...), no `model.` prefix
  fused     transformers' module names with fused experts (save_original_format=False)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def v4_config(hc_mult: int = 2, **over):
    from transformers import DeepseekV4Config

    kw = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, head_dim=32, q_lora_rank=48, partial_rotary_factor=0.5,
              num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, sliding_window=8,
              layer_types=list(LAYER_TYPES),
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=hc_mult, o_groups=2, o_lora_rank=24,
              index_n_heads=8, index_head_dim=24, index_topk=3, num_nextn_predict_layers=0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1},
              max_position_embeddings=256, bos_token_id=0, eos_token_id=1, swiglu_limit=1.5)
    kw.update(over)
    return DeepseekV4Config(**kw)


def hf_model(seed: int = 0, **cfg_over):
    from transformers import DeepseekV4ForCausalLM

    cfg = v4_config(**cfg_over)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        for name, p in list(m.named_parameters()) + list(m.named_buffers()):
            if "inv_freq" in name:
                continue          # rope's frequencies stay as computed
            if name.endswith("tid2eid"):
                rows = [torch.randperm(E, generator=gen)[:K] for _ in range(p.shape[0])]
                p.copy_(torch.stack(rows))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return m


# transformers' module names -> DeepSeek's own (the inverse of model.v4_names, written out here
# independently so the test checks that mapping rather than reusing it)
_TO_DEEPSEEK = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"), (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"), (r"^model\.norm\.weight$", "norm.weight"),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"), (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"), (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."), (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."), (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"^model\.layers\.", "layers."),
]


def deepseek_name(n: str) -> str:
    for p, r in _TO_DEEPSEEK:
        n = re.sub(p, r, n)
    return n


def _per_expert_state(m) -> dict:
    """transformers' state dict with the fused experts split per expert (hub names)."""
    out = {}
    for k, v in m.state_dict().items():
        v = v.detach().contiguous()
        if k.endswith("experts.gate_up_proj"):
            I = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k[:-len("gate_up_proj")] + f"{e}.gate_proj.weight"] = v[e, :I].clone()
                out[k[:-len("gate_up_proj")] + f"{e}.up_proj.weight"] = v[e, I:].clone()
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                out[k[:-len("down_proj")] + f"{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


def make(out: Path, seed: int = 0, layout: str = "hf", **cfg_over):
    """Write a tiny V4 checkpoint to `out`; returns the transformers model (the oracle)."""
    from safetensors.torch import save_file

    out = Path(out)
    m = hf_model(seed, **cfg_over)
    if layout == "hf":
        m.save_pretrained(out)
    elif layout == "fused":
        m.save_pretrained(out, save_original_format=False)
    elif layout == "deepseek":
        out.mkdir(parents=True, exist_ok=True)
        m.config.to_json_file(out / "config.json")
        st = {}
        for k, v in _per_expert_state(m).items():
            d = deepseek_name(k)
            d = re.sub(r"\.ffn\.experts\.(\d+)\.wgate\.", r".ffn.experts.\1.w1.", d)
            d = re.sub(r"\.ffn\.experts\.(\d+)\.up_proj\.", r".ffn.experts.\1.w3.", d)
            d = re.sub(r"\.ffn\.experts\.(\d+)\.down_proj\.", r".ffn.experts.\1.w2.", d)
            st[d] = v
        save_file(st, str(out / "model.safetensors"))
    else:
        raise ValueError(layout)
    return m


def full_logits(m, ids) -> "torch.Tensor":
    """transformers' logits of every position, one forward without a cache (the oracle)."""
    with torch.no_grad():
        return m(torch.tensor([list(ids)]), use_cache=False).logits[0].float()


def greedy(m, ids, n: int) -> list:
    """n greedy tokens by repeated full forwards (no cache: the oracle's own cache is not what we test)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        t = int(full_logits(m, ids)[-1].argmax())
        out.append(t)
        ids.append(t)
    return out
