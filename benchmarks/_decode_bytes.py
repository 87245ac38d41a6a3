"""Bytes a decode step reads, by part, from a loaded model's weights: the one accounting the GPU
end-to-end benchmark and the CPU peer benchmark both report against memory bandwidth."""
from __future__ import annotations

import dataclasses


def nbytes(t) -> int:
    """Storage bytes of a tensor (with its scales and zeros), a list of them, or None."""
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    n = int(t.nbytes)
    q = getattr(t, "quant", None)
    if q is not None:
        n += nbytes(q.scales) + nbytes(q.zeros)
    return n


def step_bytes(weights, cfg, B: int, context: int) -> dict:
    """Bytes one decode step of B sequences at `context` tokens reads, by part: every attention and
    dense weight (decode reads kv_b through its dense copy, which mla_decode absorbs, never the
    quantized one), router, shared experts, the distinct routed experts B tokens are expected to
    touch, norms, lm_head, B embedding rows and the KV cache (bf16 entries)."""
    w, c = weights, cfg
    parts = {"attention": 0, "dense_mlp": 0, "shared_experts": 0, "routed_experts": 0, "router": 0,
             "lm_head": nbytes(w.lm_head), "embedding_rows": B * (nbytes(w.embed) // c.vocab_size), "norms": 0}
    E, K = c.n_routed_experts or 1, c.num_experts_per_tok or 1
    distinct = E * (1 - (1 - K / E) ** B)
    for L in w.layers:
        a = L.attn
        # q / q_a and kv_a are views of x_proj when it is there: counted once
        fused = ("q", "q_a", "kv_a") if getattr(a, "x_proj", None) is not None else ()
        parts["attention"] += sum(nbytes(getattr(a, f.name)) for f in dataclasses.fields(a)
                                  if f.name != "kv_b" and f.name not in fused)
        parts["norms"] += nbytes(L.ln1) + nbytes(L.ln2)
        if L.mlp is not None:
            parts["dense_mlp"] += nbytes(L.mlp.gate) + nbytes(L.mlp.up) + nbytes(L.mlp.down)
        if L.moe is not None:
            m = L.moe
            parts["router"] += nbytes(m.gate) + nbytes(m.gate_bias)
            if m.shared is not None:
                parts["shared_experts"] += nbytes(m.shared.gate) + nbytes(m.shared.up) + nbytes(m.shared.down)
            if m.shared_experts is not None:     # the shared experts loaded as routed ones
                parts["shared_experts"] += sum(nbytes(t) for ts in m.shared_experts for t in ts)
            per_expert = nbytes(m.experts_gate[0]) + nbytes(m.experts_up[0]) + nbytes(m.experts_down[0])
            parts["routed_experts"] += int(distinct * per_expert)
    parts["kv_cache"] = B * context * len(w.layers) * c.cache_width * 2
    parts["total"] = sum(parts.values())
    return parts
