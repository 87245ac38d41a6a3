"""Tiny random DeepSeek checkpoints made with transformers, and the transformers models that serve
as their oracles.

Families:
  v2      deepseek_v2, q-LoRA, softmax routing, group_limited_greedy, yarn rope (mscale 0.707)
  v2lite  deepseek_v2, no q-LoRA, softmax greedy, norm_topk_prob false, plain rope
  v3      deepseek_v3, q-LoRA, sigmoid noaux_tc with groups and a non-zero e_score_correction_bias,
          yarn rope, plus an MTP layer (layer index num_hidden_layers) in its own shard
  v3fp8   the V3 layout at dims >= 128 with every projection stored as official fp8 (e4m3 with
          128x128 weight_scale_inv blocks, partial edge blocks included); the oracle runs the
          dequantized weights
  v3bf16  the v3 checkpoint stored in bf16; the oracle runs in bf16
  v32     deepseek_v32: v3 plus DeepSeek Sparse Attention (a lightning indexer of 8 heads per layer;
          index_topk 4, so from the fifth token on each query attends to 4 chosen positions), plus
          an MTP layer that is a V3.2 block (its own indexer) in its own shard
  v3fp8e128  v3fp8 with moe_intermediate_size 128, so a fused gate_up scale tensor splits between
          gate and up on 128-row blocks (the only fused fp8 layout that has per-expert views)
  v3fp8probe  v3fp8e128 with intermediate_size 384 and kv_lora_rank 128 (multiples of 128):
          tools/probe_fp8_fused_layout.py loads it with transformers' fp8 integration on a GPU and
          saves it back fused, giving tests/data/transformers_fp8_fused

Layouts of the routed experts (make(..., layout=)):
  hub     one tensor per expert, `experts.{e}.{gate,up,down}_proj.weight`: what DeepSeek publishes
          and what transformers 5 `save_pretrained` writes by default
  fused   `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], written by transformers
          itself (`save_pretrained(..., save_original_format=False)`); for fp8 families built by hand
          with the `_scale_inv` companions shaped as transformers' integrations/finegrained_fp8.py
          allocates them ([E, max(ceil(2I/128), 2), ceil(H/128)] and [E, ceil(H/128), ceil(I/128)])

Weights are re-drawn with unit-scale statistics (1/sqrt(fan_in)) so logits are well separated and
greedy continuations do not hinge on near-ties.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

MTP_SHARD = "model-mtp.safetensors"

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def family_config(family: str):
    from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV32Config

    if family == "v32":
        return DeepseekV32Config(**BASE, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
                                 norm_topk_prob=True, routed_scaling_factor=2.5, index_topk=4, index_head_dim=24,
                                 index_n_heads=8, num_nextn_predict_layers=1,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                  "original_max_position_embeddings": 64, "beta_fast": 32,
                                                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    if family == "v2":
        return DeepseekV2Config(**BASE, q_lora_rank=48, n_shared_experts=2, topk_method="group_limited_greedy",
                                n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=16.0,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
    if family == "v2lite":
        return DeepseekV2Config(**BASE, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family in ("v3", "v3bf16"):
        return DeepseekV3Config(**BASE, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
                                norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=1,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    if family in ("v3fp8", "v3fp8e128", "v3fp8probe"):
        d = dict(BASE)
        d.update(hidden_size=256, intermediate_size=384 if family == "v3fp8probe" else 320,
                 moe_intermediate_size=96 if family == "v3fp8" else 128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2,
                 kv_lora_rank=128 if family == "v3fp8probe" else 160, qk_rope_head_dim=32, qk_nope_head_dim=64,
                 v_head_dim=64)
        return DeepseekV3Config(**d, q_lora_rank=192, n_shared_experts=1, n_group=4, topk_group=2,
                                norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=0,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    raise ValueError(family)


def _redraw(named_params, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in named_params:
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _weights(module):
    # parameters plus the router bias buffer; rope's inv_freq buffers must stay as computed
    return list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers()
                                              if n.endswith("e_score_correction_bias")]


def _hf_model(family: str, seed: int):
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM

    cfg = family_config(family)
    cfg._attn_implementation = "eager"
    cls = {"deepseek_v2": DeepseekV2ForCausalLM, "deepseek_v32": DeepseekV32ForCausalLM}.get(cfg.model_type,
                                                                                         DeepseekV3ForCausalLM)
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    _redraw(_weights(m), gen)
    return m


def _mtp_state(model, gen: torch.Generator, layout: str = "hub") -> dict:
    """Random weights of one MTP layer in DeepSeek's checkpoint layout (layer index L), its routed
    experts per expert (layout "hub") or fused like the main layers (layout "fused")."""
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    if cfg.model_type == "deepseek_v32":
        import copy

        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

        # a V3.2 block with its indexer; MoE like every DeepSeek MTP layer (mlp_layer_types stops at L)
        bcfg = copy.deepcopy(cfg)
        bcfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
        block = DeepseekV32DecoderLayer(bcfg, L)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        block = DeepseekV3DecoderLayer(cfg, L)
    _redraw(_weights(block), gen)
    sd = {}
    # save the block in the per-expert layout transformers writes for the main layers
    for k, v in block.state_dict().items():
        if layout == "fused":
            sd[k] = v
        elif k == "mlp.experts.gate_up_proj":
            I = cfg.moe_intermediate_size
            for e in range(v.shape[0]):
                sd[f"mlp.experts.{e}.gate_proj.weight"] = v[e, :I]
                sd[f"mlp.experts.{e}.up_proj.weight"] = v[e, I:]
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                sd[f"mlp.experts.{e}.down_proj.weight"] = v[e]
        else:
            sd[k] = v
    sd["enorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=gen)
    sd["hnorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=gen)
    sd["eh_proj.weight"] = torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5
    sd["shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=gen)
    sd["shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    sd["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    return {f"model.layers.{L}.{k}": v.detach().contiguous() for k, v in sd.items()}, block


def _write_index(out: Path, mtp: dict) -> None:
    """Add the MTP tensors to the checkpoint as one more shard listed in the index."""
    from safetensors.torch import save_file

    save_file(mtp, str(out / MTP_SHARD), metadata={"format": "pt"})
    idx_path = out / "model.safetensors.index.json"
    if idx_path.exists():
        idx = json.loads(idx_path.read_text())
    else:
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = list(f.keys())
        (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
        idx = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}
    for k in mtp:
        idx["weight_map"][k] = MTP_SHARD
    idx_path.write_text(json.dumps(idx, indent=2))


def quantize_fp8_blocks(w: torch.Tensor, block: int = 128):
    """Official DeepSeek fp8: e4m3 weights and one f32 weight_scale_inv per 128x128 block."""
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    scale = torch.empty(nb, kb, dtype=torch.float32)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    deq = torch.empty(N, K, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = blk.abs().max().item() / 448.0 or 1.0
            qb = (blk / s).to(torch.float8_e4m3fn)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qb
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = qb.float() * s
    return q, scale, deq


FP8_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
                "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _check_layout(out: Path, layout: str) -> None:
    """transformers before 5 (or one without save_original_format) writes another layout: say so."""
    import transformers
    from safetensors import safe_open

    keys = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys.update(h.keys())
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    if fused != (layout == "fused"):
        raise RuntimeError(f"transformers {transformers.__version__} save_pretrained wrote the "
                           f"{'fused' if fused else 'hub'} expert layout where {layout} was asked; the tests need "
                           f"transformers 5 with save_original_format")


def _fuse_fp8(st: dict, num_experts: int) -> dict:
    """The per-expert fp8 tensors of `st` regrouped into transformers' fused layout."""
    out, done = {}, set()
    for k in st:
        if ".mlp.experts.0.gate_proj.weight" not in k or k.endswith("_scale_inv"):
            continue
        pre = k[: -len("0.gate_proj.weight")]
        for sfx in ("", "_scale_inv"):
            gate_up = [torch.cat([st[f"{pre}{e}.gate_proj.weight{sfx}"], st[f"{pre}{e}.up_proj.weight{sfx}"]])
                       for e in range(num_experts)]
            out[f"{pre}gate_up_proj{sfx}"] = torch.stack(gate_up).contiguous()
            out[f"{pre}down_proj{sfx}"] = torch.stack(
                [st[f"{pre}{e}.down_proj.weight{sfx}"] for e in range(num_experts)]).contiguous()
            done.update(f"{pre}{e}.{p}.weight{sfx}" for e in range(num_experts) for p in ("gate_proj", "up_proj",
                                                                                         "down_proj"))
    out.update({k: v for k, v in st.items() if k not in done})
    return out


def make(family: str, out: Path, seed: int = 0, layout: str = "hub"):
    """Write the checkpoint of `family` to `out` with routed experts in `layout` ("hub" or "fused");
    returns (out, transformers oracle model, mtp block). The same family and seed give the same
    weights in either layout."""
    from safetensors.torch import save_file

    if layout not in ("hub", "fused"):
        raise ValueError(layout)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    m = _hf_model(family, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mtp_block = None
    if family in ("v3fp8", "v3fp8e128", "v3fp8probe"):
        m.save_pretrained(out)   # for config.json; the weights are replaced below
        for p in out.glob("*.safetensors*"):
            p.unlink()
        sd = m.state_dict()
        deq_sd = {}
        # the per-expert layout as transformers saves it
        flat = {}
        I = m.config.moe_intermediate_size
        for k, v in sd.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                pre = k[: -len("gate_up_proj")]
                for e in range(v.shape[0]):
                    flat[f"{pre}{e}.gate_proj.weight"] = v[e, :I]
                    flat[f"{pre}{e}.up_proj.weight"] = v[e, I:]
            elif k.endswith("mlp.experts.down_proj"):
                pre = k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    flat[f"{pre}{e}.down_proj.weight"] = v[e]
            else:
                flat[k] = v
        st = {}
        for k, v in flat.items():
            if k.endswith(FP8_SUFFIXES) and "mlp.gate." not in k:
                q, s, deq = quantize_fp8_blocks(v)
                st[k] = q.contiguous()
                st[k + "_scale_inv"] = s.contiguous()
                deq_sd[k] = deq
            else:
                st[k] = v.detach().contiguous()
        if layout == "fused":
            st = _fuse_fp8(st, m.config.n_routed_experts)
        save_file(st, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        # the oracle runs the dequantized weights
        _load_flat(m, deq_sd)
        return out, m, None
    if family == "v3bf16":
        inv = m.model.rotary_emb.inv_freq.clone()
        m = m.to(torch.bfloat16)
        # .to() rounds rope's frequency buffer too, which loading a bf16 checkpoint does not do
        m.model.rotary_emb.inv_freq = inv
    shard = "150KB" if family == "v3" else "50GB"
    # save_original_format=False keeps transformers' in-memory (fused) expert tensors
    m.save_pretrained(out, max_shard_size=shard, save_original_format=layout == "hub")
    _check_layout(out, layout)
    if family in ("v3", "v3bf16", "v32"):
        mtp, mtp_block = _mtp_state(m, gen, layout)
        if family == "v3bf16":
            mtp = {k: v.to(torch.bfloat16) for k, v in mtp.items()}
            mtp_block = mtp_block.to(torch.bfloat16)
        _write_index(out, mtp)
    return out, m, mtp_block


def _load_flat(m, flat: dict) -> None:
    """Copy per-expert / per-projection tensors back into the transformers model's parameters."""
    sd = m.state_dict()
    I = m.config.moe_intermediate_size
    with torch.no_grad():
        for k, v in flat.items():
            if ".mlp.experts." in k:
                pre, rest = k.split(".mlp.experts.")
                e, proj = rest.split(".")[:2]
                e = int(e)
                if proj == "gate_proj":
                    sd[f"{pre}.mlp.experts.gate_up_proj"][e, :I].copy_(v)
                elif proj == "up_proj":
                    sd[f"{pre}.mlp.experts.gate_up_proj"][e, I:].copy_(v)
                else:
                    sd[f"{pre}.mlp.experts.down_proj"][e].copy_(v)
            else:
                sd[k].copy_(v)


def mtp_reference_logits(model, block, hidden: torch.Tensor, next_ids: torch.Tensor, state: dict) -> torch.Tensor:
    """The MTP head in torch from transformers' building blocks: the oracle for mtp_logits.

    hidden: [1, T, H] final-normed hidden states of the main model; next_ids: [1, T] the tokens
    at positions 1..T; state: the MTP tensors (names without the layer prefix)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    cfg = model.config
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    dt = hidden.dtype

    def norm(w, x):
        n = DeepseekV3RMSNorm(H, eps).to(dt)
        with torch.no_grad():
            n.weight.copy_(w)
        return n(x)

    with torch.no_grad():
        e = norm(state["enorm.weight"], model.model.embed_tokens(next_ids))
        h = norm(state["hnorm.weight"], hidden)
        x = torch.nn.functional.linear(torch.cat([e, h], -1), state["eh_proj.weight"])
        T = x.shape[1]
        pos = torch.arange(T)[None]
        pe = model.model.rotary_emb(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None].to(dt)
        y = block(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        y = norm(state["shared_head.norm.weight"], y)
        return torch.nn.functional.linear(y, state["shared_head.head.weight"]).float()


# ---------------------------------------------------------------------------- published configs

HUB_CONFIGS = Path(__file__).resolve().parent / "data" / "hub_configs"
# the dims a published config is shrunk to; every other key (routing, groups, top-k, rope scaling,
# dense-layer count, q-LoRA on or off, MTP) stays as published
TINY_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=16,
                 bos_token_id=0, eos_token_id=1)


def shrink_hub_config(d: dict) -> dict:
    """A published config.json at tiny dims with the same structure (for a random checkpoint)."""
    d = dict(d)
    d.update(TINY_DIMS)
    if d.get("q_lora_rank") is not None:
        d["q_lora_rank"] = 48
    d["first_k_dense_replace"] = min(int(d.get("first_k_dense_replace", 0)), 1)   # keep a dense layer
    if "index_topk" in d:    # V3.2's indexer: 4 of the prompt's positions, 8 heads (few exact score ties)
        d.update(index_topk=4, index_head_dim=24, index_n_heads=8)
    d.pop("quantization_config", None)   # the f32 oracle: fp8 storage is tested by the v3fp8 families
    d.pop("auto_map", None)              # the remote-code classes: transformers' own are the oracle
    d["torch_dtype"] = "float32"
    return d


def make_from_hub_config(name: str, out: Path, seed: int = 0, layout: str = "hub"):
    """A random f32 checkpoint of the published config `name` (tests/data/hub_configs/NAME.json)
    shrunk to tiny dims, routed experts in `layout`; returns (out, transformers oracle)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = shrink_hub_config(json.loads((HUB_CONFIGS / f"{name}.json").read_text()))
    model_type = d.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **d)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _redraw(_weights(m), torch.Generator().manual_seed(seed))
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    m.save_pretrained(out, save_original_format=layout == "hub")
    _check_layout(out, layout)
    return out, m


def transformers_greedy(model, ids, n: int, eos=None) -> list[int]:
    """transformers' greedy continuation of `ids` (up to n tokens, stopping before `eos`), recomputing
    the whole prefix each step: its uncached forward is the oracle."""
    x = list(ids)
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([x])).logits[0, -1].argmax())
            if t == eos:
                break
            x.append(t)
    return x[len(ids):]


def add_tokenizer(out: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer over the tiny vocabulary ("<s>" = 0, "</s>" = 1, then "t2".."tN"), so
    the engine's text API (deepinfer.run) can drive a tiny checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, indent=2))
