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

make_quantized() writes the checkpoint as DeepSeek publishes V4-Flash (fp8 e4m3 projections with
ue8m0 128x128 block scales, fp4 e2m1 routed experts with ue8m0 scales per 32 columns, BF16
compressor / indexer projections) at QUANT_DIMS; its oracle holds the dequantized weights.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

# 30 tokens: longer than the window (8), 7 CSA entries of 4 tokens (index_topk 3), 3 HCA entries of 8
PROMPT = [5, 17, 200, 3, 99, 42, 7, 130, 64, 11, 250, 8, 31, 77, 19, 144, 2, 61, 90, 33, 120, 47, 6, 222,
          13, 58, 181, 70, 9, 240]


def rel_err(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(1.0, np.abs(b).max()))


def check_cached_steps(m, be, ref, prompt=PROMPT) -> None:
    """A runner's logits against the oracle's `ref` of `prompt`: a whole prefill (sequence 0), then
    sequence 1 as a chunk of 5, a chunk of 6 and one token a step (its blocks come after seq 0's)."""
    got = be.to_numpy(m.forward([(0, prompt, 0)], all_logits=True))
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert rel_err(got, ref) < 1e-4
    m.forward([(1, prompt[:5], 0)])
    step = be.to_numpy(m.forward([(1, prompt[5:11], 5)], all_logits=True))
    assert rel_err(step, ref[5:11]) < 1e-4
    for i in range(11, len(prompt)):
        step = be.to_numpy(m.forward([(1, [prompt[i]], i)]))
        assert rel_err(step[0], ref[i]) < 1e-4, f"decode position {i}"


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
    _redraw(m, torch.Generator().manual_seed(seed), cfg)
    return m


def _redraw(m, gen: torch.Generator, cfg) -> None:
    """Unit-scale random weights (1/sqrt(fan_in)), norms near 1, hash tables of distinct experts."""
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


def _deepseek_state(sd: dict) -> dict:
    """A transformers state dict (experts per expert) under DeepSeek's own names."""
    st = {}
    for k, v in sd.items():
        d = deepseek_name(k)
        d = re.sub(r"\.ffn\.experts\.(\d+)\.wgate\.", r".ffn.experts.\1.w1.", d)
        d = re.sub(r"\.ffn\.experts\.(\d+)\.up_proj\.", r".ffn.experts.\1.w3.", d)
        d = re.sub(r"\.ffn\.experts\.(\d+)\.down_proj\.", r".ffn.experts.\1.w2.", d)
        st[d] = v
    return st


class MTP:
    """A random V4 MTP layer (what DeepSeek ships as `mtp.0.*`; transformers drops it): a V4 block
    at layer index num_hidden_layers (sliding window attention, top-k MoE), e_proj / h_proj /
    enorm / hnorm, its own hyper-connection head and the shared head's norm. `reference_logits` is
    the oracle of our MTP head, written from transformers' V4 modules."""

    def __init__(self, m, seed: int):
        import copy

        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

        cfg = m.config
        self.m, L, H = m, cfg.num_hidden_layers, cfg.hidden_size
        bcfg = copy.deepcopy(cfg)
        bcfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]
        bcfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
        gen = torch.Generator().manual_seed(seed + 101)
        self.block = DeepseekV4DecoderLayer(bcfg, L).eval()
        _redraw(self.block, gen, cfg)
        self.hc_head = DeepseekV4HyperHead(cfg).eval()
        _redraw(self.hc_head, gen, cfg)
        self.own = {n: 1.0 + 0.1 * torch.randn(H, generator=gen) for n in ("enorm", "hnorm", "norm")}
        self.own.update({n: torch.randn(H, H, generator=gen) * H ** -0.5 for n in ("e_proj", "h_proj")})

    def deepseek_state(self) -> dict:
        """The MTP layer under DeepSeek's names (`mtp.0.attn.wq_a.weight`, `mtp.0.e_proj.weight`, ...)."""
        L = self.m.config.num_hidden_layers
        block = {f"model.layers.{L}.{k}": v for k, v in _per_expert_state(self.block).items()}
        st = {re.sub(rf"^layers\.{L}\.", "mtp.0.", k): v for k, v in _deepseek_state(block).items()}
        for k in ("enorm", "hnorm", "norm", "e_proj", "h_proj"):
            st[f"mtp.0.{k}.weight"] = self.own[k]
        for k in ("fn", "base", "scale"):
            st[f"mtp.0.hc_head_{k}"] = getattr(self.hc_head, f"hc_{k}").detach()
        return {k: v.detach().contiguous() for k, v in st.items()}

    def reference_logits(self, ids, next_ids) -> "torch.Tensor":
        """Logits of the MTP head at every position t of `ids`, given the main model's last streams
        there and the next tokens next_ids[t] (no cache: one forward over all positions)."""
        from transformers.masking_utils import create_sliding_window_causal_mask
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

        m, cfg = self.m, self.m.config
        H = cfg.hidden_size

        def norm(w, x):
            n = DeepseekV4RMSNorm(H, eps=cfg.rms_norm_eps)
            n.weight.data.copy_(w)
            return n(x)

        streams = {}
        hook = m.model.hc_head.register_forward_hook(lambda mod, inp, out: streams.setdefault("x", inp[0]))
        with torch.no_grad():
            m(torch.tensor([list(ids)]), use_cache=False)
            hook.remove()
            prev = streams["x"]                                   # [1, T, N, H]: before the head
            nxt = torch.tensor([list(next_ids)])
            e = norm(self.own["enorm"], m.model.embed_tokens(nxt)) @ self.own["e_proj"].T
            x = norm(self.own["hnorm"], prev) @ self.own["h_proj"].T + e.unsqueeze(2)
            pos = torch.arange(len(ids))[None]
            emb = m.model.embed_tokens(nxt)
            # config, embeddings, attention mask, cache: positional, as the cache argument's name changed
            # (`past_key_values` in transformers 5.17, the device's; `cache` later)
            mask = create_sliding_window_causal_mask(cfg, emb, None, None, position_ids=pos)
            pe = {t: m.model.rotary_emb(emb, position_ids=pos, layer_type=t) for t in ("main", "compress")}
            y = self.block(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=nxt)
            h = norm(self.own["norm"], self.hc_head(y))
            return (h @ m.lm_head.weight.T)[0].float()


def make(out: Path, seed: int = 0, layout: str = "hf", mtp: bool = False, **cfg_over):
    """Write a tiny V4 checkpoint to `out`; returns the transformers model (the oracle), and with
    mtp=True (DeepSeek's layout only: transformers' drops the MTP layer) (model, MTP)."""
    from safetensors.torch import save_file

    out = Path(out)
    if mtp:
        if layout != "deepseek":
            raise ValueError("an MTP layer is written in DeepSeek's layout only")
        cfg_over.setdefault("num_nextn_predict_layers", 1)
    m = hf_model(seed, **cfg_over)
    extra = MTP(m, seed) if mtp else None
    if layout == "hf":
        m.save_pretrained(out)
    elif layout == "fused":
        m.save_pretrained(out, save_original_format=False)
    elif layout == "deepseek":
        out.mkdir(parents=True, exist_ok=True)
        m.config.to_json_file(out / "config.json")
        st = _deepseek_state(_per_expert_state(m))
        if extra is not None:
            st.update(extra.deepseek_state())
        save_file(st, str(out / "model.safetensors"))
    else:
        raise ValueError(layout)
    return (m, extra) if mtp else m


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


# ---------------------------------------------------------------------------- DeepSeek's fp8 / fp4 release

# dims at which DeepSeek V4's quantization blocks mean something: 128x128 fp8 blocks (q_a, q_b, o_a,
# o_b, the shared experts and the indexer's q_b are whole blocks; kv_proj [64, 256] a partial row of
# them) and 32-column fp4 groups of the routed experts (H 256 = 8 groups, I 128 = 4). o_lora_rank
# 128 puts each group of the grouped output projection on its own 128-row blocks.
QUANT_DIMS = dict(hidden_size=256, moe_intermediate_size=128, head_dim=64, q_lora_rank=128, o_lora_rank=128,
                  index_head_dim=64, index_n_heads=4)
# what DeepSeek-V4-Flash's config.json says; it writes "expert_dtype": "fp4" at the top level
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}
# the linears DeepSeek ships in BF16 without a scale (transformers' _keep_in_fp32_modules of V4)
BF16_LINEARS = ("self_attn.compressor.kv_proj.weight", "self_attn.compressor.gate_proj.weight",
                "self_attn.compressor.indexer.kv_proj.weight", "self_attn.compressor.indexer.gate_proj.weight",
                "self_attn.compressor.indexer.scorer.weights_proj.weight")
FP8_LINEARS = ("q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "o_a_proj.weight", "o_b_proj.weight",
               "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")
# e2m1 codes 0..15 (sign bit 3), as DeepSeek's inference/convert.py and transformers' Fp8Dequantize list them
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (1 where x is 0): a ue8m0 scale."""
    x = x.double()
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(torch.where(x > 0, x, 1.0)))), 1.0).float()


def _e8m0(s: torch.Tensor) -> torch.Tensor:
    """Powers of two as torch.float8_e8m0fnu (the biased exponent byte, built by hand)."""
    e = torch.log2(s.double()).round().to(torch.int64)
    assert torch.equal(torch.exp2(e.double()).float(), s.float()) and int(e.min()) >= -127 and int(e.max()) <= 127
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp8_ue8m0(w: torch.Tensor, block: int = 128):
    """e4m3 weights with one power-of-two scale per 128x128 block (DeepSeek V4's dense layers):
    (q e4m3 [N, K], scales e8m0 [ceil(N/128), ceil(K/128)], dequantized f32 [N, K])."""
    w = w.detach().float()
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    pad = torch.zeros(nb * block, kb * block)
    pad[:N, :K] = w
    amax = pad.abs().reshape(nb, block, kb, block).amax(dim=(1, 3))
    s = _pow2_at_least(amax / 448.0)
    full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :K]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, _e8m0(s), q.float() * full


def quantize_fp4_ue8m0(w: torch.Tensor, group: int = 32):
    """e2m1 weights with one power-of-two scale per row and `group` columns (DeepSeek V4's routed
    experts), stored as DeepSeek does: (I8 [N, K/2] with element 2i in the low nibble of byte i,
    scales e8m0 [N, K/group], dequantized f32 [N, K]). Rounding to e2m1 is ml_dtypes' (to nearest,
    ties to even)."""
    import ml_dtypes

    w = w.detach().float()
    N, K = w.shape
    assert K % group == 0 and K % 2 == 0
    g = w.reshape(N, K // group, group)
    s = _pow2_at_least(g.abs().amax(dim=-1) / 6.0)
    x = (g / s[..., None]).reshape(N, K).numpy()
    codes = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    lut = torch.tensor(E2M1_VALUES)
    deq = lut[torch.from_numpy(codes.astype(np.int64))] * s.repeat_interleave(group, 1)
    return torch.from_numpy(packed.view(np.int8)), _e8m0(s), deq


def make_quantized(out: Path, seed: int = 0, layout: str = "deepseek", expert_dtype_at: str = "top", **cfg_over):
    """A tiny V4 checkpoint as DeepSeek publishes V4-Flash: the attention projections, the indexer's
    q_b_proj and the shared experts fp8 e4m3 with ue8m0 128x128 block scales, the routed experts fp4
    e2m1 (I8 [N, K/2]) with ue8m0 scales per row and 32 columns, the compressor / indexer kv_proj,
    gate_proj and the indexer's weights_proj BF16 without a scale; routers, norms, embeddings,
    lm_head, hyper-connections, sinks and position biases as they are (f32). QUANT_DIMS unless
    overridden. Returns the transformers model holding the dequantized (and BF16-rounded) weights:
    the oracle.

    layout: deepseek     DeepSeek's names, scales as `X.scale` (what V4-Flash ships)
            transformers transformers' module names, per expert, scales as `X.weight_scale_inv`
            fused        transformers' names with its fused experts: `experts.gate_up_proj` I8 [E, 2I, H/2]
                         + `gate_up_proj_scale_inv` [E, 2I, H/32], `experts.down_proj` [E, H, I/2] + [E, H, I/32]
    expert_dtype_at: "top" (config.json's top level, as V4-Flash) or "quantization_config" (as
    transformers saves it)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m = hf_model(seed, **{**QUANT_DIMS, **cfg_over})
    flat = _per_expert_state(m)
    stored, oracle = {}, {}          # transformers name -> {suffix: tensor}, transformers name -> f32 values
    for k, v in flat.items():
        if re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", k):
            q, s, deq = quantize_fp4_ue8m0(v)
            stored[k] = {"": q, "scale": s}
            oracle[k] = deq
        elif k.endswith(BF16_LINEARS):
            b = v.to(torch.bfloat16)
            stored[k] = {"": b}
            oracle[k] = b.float()
        elif k.endswith(FP8_LINEARS) and not k.startswith("mtp."):
            q, s, deq = quantize_fp8_ue8m0(v)
            stored[k] = {"": q, "scale": s}
            oracle[k] = deq
        else:
            stored[k] = {"": v}
    st = {}
    for k, parts in stored.items():
        for sfx, t in parts.items():
            if layout == "deepseek":
                d = deepseek_name(k)
                d = re.sub(r"\.ffn\.experts\.(\d+)\.wgate\.", r".ffn.experts.\1.w1.", d)
                d = re.sub(r"\.ffn\.experts\.(\d+)\.up_proj\.", r".ffn.experts.\1.w3.", d)
                d = re.sub(r"\.ffn\.experts\.(\d+)\.down_proj\.", r".ffn.experts.\1.w2.", d)
                name = d[: -len("weight")] + "scale" if sfx else d
            elif layout in ("transformers", "fused"):
                name = k + "_scale_inv" if sfx else k
            else:
                raise ValueError(layout)
            st[name] = t.contiguous()
    if layout == "fused":
        st = _fuse_experts(st, m.config.n_routed_experts)
    save_file(st, str(out / "model.safetensors"))
    m.config.to_json_file(out / "config.json")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("expert_dtype", None)
    if expert_dtype_at == "top":
        cfg["quantization_config"] = dict(QUANT_CONFIG)
        cfg["expert_dtype"] = "fp4"
    else:
        cfg["quantization_config"] = {**QUANT_CONFIG, "expert_dtype": "fp4"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _load_values(m, oracle)
    return m


def _fuse_experts(st: dict, E: int) -> dict:
    """Per-expert fp4 tensors (transformers' names) regrouped into transformers' fused layout."""
    out, done = {}, set()
    for k in list(st):
        m = re.match(r"^(.*\.mlp\.experts\.)0\.gate_proj\.weight$", k)
        if m is None:
            continue
        pre = m[1]
        for sfx in ("", "_scale_inv"):
            gu = [torch.cat([st[f"{pre}{e}.gate_proj.weight{sfx}"].view(torch.uint8),
                             st[f"{pre}{e}.up_proj.weight{sfx}"].view(torch.uint8)]) for e in range(E)]
            dn = [st[f"{pre}{e}.down_proj.weight{sfx}"].view(torch.uint8) for e in range(E)]
            dt = st[f"{pre}0.gate_proj.weight{sfx}"].dtype
            out[f"{pre}gate_up_proj{sfx}"] = torch.stack(gu).view(dt).contiguous()
            out[f"{pre}down_proj{sfx}"] = torch.stack(dn).view(dt).contiguous()
            done.update(f"{pre}{e}.{p}.weight{sfx}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj"))
    out.update({k: v for k, v in st.items() if k not in done})
    return out


def _load_values(m, values: dict) -> None:
    """Copy per-expert / per-projection values (transformers' names) into the model's parameters."""
    sd = m.state_dict()
    I = m.config.moe_intermediate_size
    with torch.no_grad():
        for k, v in values.items():
            mm = re.match(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", k)
            if mm is None:
                sd[k].copy_(v)
                continue
            e, proj = int(mm[2]), mm[3]
            if proj == "down":
                sd[mm[1] + "down_proj"][e].copy_(v)
            else:
                sd[mm[1] + "gate_up_proj"][e, (0 if proj == "gate" else I):(I if proj == "gate" else 2 * I)].copy_(v)
