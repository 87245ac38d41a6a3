"""DeepSeek V4 tensor names: DeepSeek's own layout to the one the loader reads (transformers').

DeepSeek publishes V4 as `embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
`hc_head_fn`, ... and transformers' save_pretrained writes a mix of both (`model.layers.N.attn...`,
`head.weight`). transformers' conversion_mapping.py ("deepseek_v4") lists the renames; applied in
order, they give its module names (`model.layers.N.self_attn.q_a_proj.weight`, ...), which are what
model.weights_v4 reads. Fused experts (`mlp.experts.gate_up_proj`, transformers' in-memory form) are
split per expert by the checkpoint reader as for V3.

The MTP layer `mtp.K.*` becomes layer num_hidden_layers + K, as for V3 (`model.layers.{L}.`): its
decoder block takes the per-layer renames, and its own pieces keep V3's names where V3 has them
(`norm` -> `shared_head.norm`, `head` -> `shared_head.head`, `emb.tok_emb` -> `embed_tokens`) and
their own otherwise (`e_proj`, `h_proj`, `enorm`, `hnorm`, `hc_head_*` -> `hc_head.hc_*`).
"""
from __future__ import annotations

import re
from typing import Optional

# (pattern, replacement), in the order transformers applies them
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"),
    (r"^hc_head_base$", "hc_head.hc_base"),
    (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"),
    (r"\.hc_attn_base$", ".attn_hc.base"),
    (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"),
    (r"\.hc_ffn_base$", ".ffn_hc.base"),
    (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
]
_COMPILED = [(re.compile(p), r) for p, r in _RENAMES]


# the MTP layer's own tensors (not part of its decoder block), renamed before the per-layer renames
_MTP_OWN = [
    (re.compile(r"^norm\.weight$"), "shared_head.norm.weight"),
    (re.compile(r"^head\.weight$"), "shared_head.head.weight"),
    (re.compile(r"^emb\.tok_emb\.weight$"), "embed_tokens.weight"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.hc_\1"),
]
_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")


def canonical(name: str, num_layers: Optional[int] = None) -> str:
    """The transformers module name of a V4 tensor stored under `name` (either layout).
    num_layers: the model's num_hidden_layers, where the MTP layers' numbering starts (None: MTP
    tensors keep their names)."""
    m = _MTP_NAME.match(name)
    if m:
        if num_layers is None:
            return name
        rest = m.group(2)
        for pat, rep in _MTP_OWN:
            if pat.match(rest):
                return f"model.layers.{num_layers + int(m.group(1))}." + pat.sub(rep, rest)
        name = f"layers.{num_layers + int(m.group(1))}.{rest}"
    n = name[len("model."):] if name.startswith("model.") else name
    for pat, rep in _COMPILED:
        n = pat.sub(rep, n)
    return n if n == "lm_head.weight" else "model." + n


def renames(names, num_layers: Optional[int] = None) -> dict:
    """{stored name: canonical name} for the names that change (an empty dict: nothing to rename).
    DeepSeek stores a quantized weight's block scales beside it as `<stem>.scale`; they become V3's
    `<stem>.weight_scale_inv`, which the loader reads (the hyper-connections' own `scale`
    parameters have no `.weight` sibling and keep their name)."""
    names = set(names)
    out = {}
    for n in names:
        if n.endswith(".scale") and n[:-len(".scale")] + ".weight" in names:
            c = canonical(n[:-len(".scale")] + ".weight", num_layers) + "_scale_inv"
        else:
            c = canonical(n, num_layers)
        if c != n:
            out[n] = c
    return out
