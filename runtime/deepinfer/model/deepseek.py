"""The DeepSeek V2 / V3 model graph, every computation an op of the Backend.

This module only describes the model: it traces one step onto a Tracer (model.plan) and owns no
state. Weights come typed from model.weights; the pieces every family shares (linear, MLP, router,
MoE, head, the speculative step) are model.graph's; the runner (engine.model_runner) owns the KV
cache, the plans, the arena and the inputs.

Shape of one step (T tokens of S sequences, hidden H, heads NH):

    x = embed(ids)                                   the running residual, updated in place
    per layer:  n = rmsnorm(x (+ previous sublayer output));  a = MLA(n)
                n = rmsnorm(x + a);  m = MLP(n) or MoE(n)
    h = rmsnorm(x + m);  logits = lm_head(h[last token of each sequence])   (f32)

MLA: q = q_b(rmsnorm(q_a(n))) or q_proj(n); [latent | k_pe] = kv_a(n); latent = rmsnorm(latent);
rope on q's last Dr dims and on k_pe; (latent, k_pe) go to the paged cache (those four in one
mla_rope_cache_write where the backend has that ABI 1.6 fused op). A batch in which every
sequence starts at position 0 runs mla_prefill on the un-absorbed keys and values (kv_b(latent));
any other batch (decode, chunked prefill, speculative verification) runs mla_decode, which absorbs
kv_b into the query and reads the latent cache directly.

MoE: router logits in f32, moe_router (softmax greedy / group_limited_greedy / noaux_tc sigmoid
with e_score_correction_bias), shared experts first, then routed experts accumulated on top (or
both in one moe_experts, model.weights.WeightLoader._shared_as_experts); how
the routed experts run (resident, through an expert cache with its pauses, or spread over the
ranks) is the layer's strategy in model.moe_strategy. With an expert cache the next layer's router
may run early, on this layer's residual, to predict what to pre-load while this layer computes.

DSA (V3.2): every layer's lightning indexer keeps one key per token in its own cache pool (wk, LayerNorm,
rope on its first Dr dims, pairs (i, i + Dr/2)); indexer_topk scores the cached tokens with the
indexer queries (wq_b of the q LoRA) and per-head weights, and mla_decode attends to the index_topk
best only. Such a model always runs the decode path (its caches are pools: model.kv_cache.PagedPools).

MTP (V3's extra layer L = num_hidden_layers): h' = eh_proj([enorm(embed(next_tokens)) ; hnorm(h)]),
one decoder block with its own cache layer, then shared_head.norm and shared_head.head. `h` is the
main model's final-normed hidden state (as vLLM and SGLang feed it).

Differences from transformers we chose: the group mask of group-limited routing is -inf (as in
DeepSeek's model.py and transformers' V3); transformers' V2 uses 0.0, which only matters when
top_k exceeds the experts of the kept groups. `norm_topk_prob` is honoured for V2 configs (as in
DeepSeek's own V2 code; transformers' V2 ignores it).
"""
from __future__ import annotations

from typing import Optional

from .. import abi
from ..tensor import Tensor
from .config import ModelConfig
from .graph import ModelGraph, StepInputs
from .weights import AttentionWeights, LayerWeights, ModelWeights, MoEWeights

SCORING = {"softmax": abi.const("DI_SCORING_SOFTMAX"), "sigmoid": abi.const("DI_SCORING_SIGMOID")}
GROUP_MAX, GROUP_SUM_TOP2 = abi.const("DI_GROUP_SCORE_MAX"), abi.const("DI_GROUP_SCORE_SUM_TOP2")


def dsa_cache_pools(cfg: ModelConfig, block_size: int, num_layers: Optional[int] = None) -> list:
    """V3.2's paged cache per layer (num_layers: the main layers, plus the MTP layer's when it runs):
    the MLA latent and the indexer's key of every token."""
    return [{"latent": (block_size, cfg.cache_width), "ikeys": (block_size, cfg.dsa.index_head_dim)}
            for _ in range(cfg.num_hidden_layers if num_layers is None else num_layers)]


class DeepseekGraph(ModelGraph):
    """The model as code: one step of T tokens of S sequences traced onto `g` (a Tracer)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, caches: list, dtype: str, act_quant: bool):
        super().__init__(cfg, weights, caches, dtype, act_quant)
        # V3.2 selects what each query attends from the cache: no un-cached prefill path
        self.prefill_mode = cfg.dsa is None

    def dsa_indexer(self, g, w: AttentionWeights, pools: dict, x, qa, meta: StepInputs) -> Tensor:
        """V3.2: cache this step's indexer keys, then the index_topk positions each token attends."""
        c, T, ix = self.cfg, meta.T, w.indexer
        NI, Di, Dr = c.dsa.index_n_heads, c.dsa.index_head_dim, c.qk_rope_head_dim
        k = self.proj(g, x, ix.wk, "index_k")
        g.layernorm(x=k, weight=ix.k_norm, bias=ix.k_norm_bias, out=k, eps=1e-6)
        self.rope(g, k.narrow(1, 0, Dr), meta.positions, interleaved=0)
        g.mla_cache_write(latent=k.narrow(1, 0, Dr), k_pe=k.narrow(1, Dr, Di - Dr), slots=meta.slots,
                          cache=pools["ikeys"])
        q3 = self.proj(g, qa, ix.wq_b, "index_q").view(T, NI, Di)
        self.rope(g, q3.narrow(2, 0, Dr), meta.positions, interleaved=0)
        wts = g.empty((T, NI), "f32", "index_weights")
        g.linear(x=x, w=ix.weights_proj, out=wts)
        idx = g.empty((T, c.dsa.index_topk), "int32", "index_topk")
        g.indexer_topk(q=q3, weights=wts, keys=pools["ikeys"], block_table=meta.block_table,
                       token_seq=meta.token_seq, kv_len=meta.kv_len, out=idx, scale=(Di * NI) ** -0.5, ratio=1,
                       block_size=self.block_size)
        return idx

    def attention(self, g, w: AttentionWeights, cache, x, meta: StepInputs) -> Tensor:
        c, T, dt = self.cfg, meta.T, self.dtype
        pools = None
        if isinstance(cache, dict):      # V3.2: the latent cache and the indexer's keys
            pools, cache = cache, cache["latent"]
        NH, Dn, Dr, Dv, Dc = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        Nq = c.q_lora_rank or NH * c.qk_head_dim       # rows of the projection that reads x besides kv_a
        if w.x_proj is not None:
            # one linear for q (or q_a) and kv_a: their outputs are column ranges of one buffer
            xo = self.proj(g, x, w.x_proj, "x_proj")
            first, kva = xo.narrow(1, 0, Nq), xo.narrow(1, Nq, Dc + Dr)
        else:
            first = self.proj(g, x, w.q_a if c.q_lora_rank else w.q, "q_a" if c.q_lora_rank else "q", w.q_a_bias)
            kva = self.proj(g, x, w.kv_a, "kv_a", w.kv_a_bias)
        qa = None
        if c.q_lora_rank:
            qa = self.norm(g, first, w.q_a_norm, "q_a_norm")
            q3 = self.proj(g, qa, w.q_b, "q").view(T, NH, c.qk_head_dim)
        else:
            # [T, NH, Dn + Dr] over the q columns (rows may be longer than NH * (Dn + Dr))
            q3 = Tensor(first.buffer, (T, NH, c.qk_head_dim), dt, (first.strides[0], c.qk_head_dim, 1), first.offset)
        latent, k_pe = self.mla_prologue(g, w, q3, kva, cache, meta)
        idx = self.dsa_indexer(g, w, pools, x, qa, meta) if w.indexer is not None else None
        o = g.empty((T, NH, Dv), dt, "attn")
        if meta.mode == "prefill":
            kv = self.proj(g, latent, w.kv_b, "kv")
            g.mla_prefill(q=q3, kv=kv.view(T, NH, Dn + Dv), k_pe=k_pe, cu_seqlens=meta.cu_seqlens, out=o,
                          scale=c.softmax_scale)
        else:
            g.mla_decode(q=q3, wkv_b=w.kv_b_dense, cache=cache, block_table=meta.block_table,
                         token_seq=meta.token_seq, kv_len=meta.kv_len, out=o, scale=c.softmax_scale, indices=idx)
        out = self.proj(g, o.view(T, NH * Dv), w.o, "attn_out", w.o_bias)
        self.all_reduce(g, out)        # tensor parallel: each rank's heads gave a partial sum
        return out

    def mla_prologue(self, g, w: AttentionWeights, q3, kva, cache, meta: StepInputs) -> tuple:
        """rope on q's last Dr dims; latent = rmsnorm(kva[:, :Dc]); rope on k_pe = kva[:, Dc:]; both into
        the cache. Returns (latent, k_pe), which only the prefill path reads again. One fused op where
        the backend has it (ABI 1.6): prefill has it write the pair back into kva, in place."""
        c = self.cfg
        Dc, Dr, Dn = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim
        if "mla_rope_cache_write" in self.fused_ops:
            prefill = meta.mode == "prefill"
            g.mla_rope_cache_write(q=q3, kv=kva, norm_weight=w.kv_a_norm, positions=meta.positions,
                                   slots=meta.slots, cache=cache, kv_out=kva if prefill else None,
                                   eps=c.rms_norm_eps, **self.rope_fields())
            return kva.narrow(1, 0, Dc), kva.narrow(1, Dc, Dr)
        self.rope(g, q3.narrow(2, Dn, Dr), meta.positions)
        latent = self.norm(g, kva.narrow(1, 0, Dc), w.kv_a_norm, "latent")
        k_pe = kva.narrow(1, Dc, Dr)
        self.rope(g, k_pe, meta.positions)
        g.mla_cache_write(latent=latent, k_pe=k_pe, slots=meta.slots, cache=cache)
        return latent, k_pe

    def router_options(self, w: MoEWeights, meta: StepInputs) -> dict:
        c = self.cfg
        grouped = c.topk_method in ("group_limited_greedy", "noaux_tc") and c.n_group > 1
        return dict(scoring=SCORING[c.scoring_func], n_group=c.n_group if grouped else 1,
                    topk_group=c.topk_group if grouped else 1,
                    group_score=GROUP_SUM_TOP2 if c.topk_method == "noaux_tc" else GROUP_MAX,
                    norm_topk_prob=int(bool(c.norm_topk_prob) and c.num_experts_per_tok > 1),
                    routed_scaling_factor=c.routed_scaling_factor)

    def predict(self, g, resid, nxt: LayerWeights, meta: StepInputs) -> Tensor:
        """Prefetch: the next layer's experts guessed by its router on this layer's residual, normed
        as that layer norms it."""
        ids, _ = self.route(g, nxt.moe, self.norm(g, resid, nxt.ln2, "predict_norm"), meta, "predicted")
        return ids

    def block(self, g, w: LayerWeights, resid, delta, meta: StepInputs,
              next_layer: Optional[LayerWeights] = None) -> Tensor:
        """One decoder layer; `resid` is updated in place, the layer's MLP output is returned.
        `next_layer`: the following layer, whose router may predict its experts (streamed experts)."""
        # the previous sublayer's output is added to the residual by this layer's first norm
        n = self.norm(g, resid, w.ln1) if delta is None else self.norm(g, delta, w.ln1, residual=resid)
        a = self.attention(g, w.attn, self.caches[w.index], n, meta)
        n2 = self.norm(g, a, w.ln2, residual=resid)
        if w.moe is None:
            return self.mlp(g, w.mlp, n2, meta.T)
        guess = next_layer is not None and next_layer.moe is not None
        return self.moe(g, w.moe, n2, meta, (lambda: self.predict(g, resid, next_layer, meta)) if guess else None)

    def head(self, g, norm_w, resid, delta, head_w, meta: StepInputs, hidden_out=None, name: str = "logits"):
        """Final norm of (resid + delta), then f32 logits of the wanted rows (plan output `name`)."""
        n = self.norm(g, delta, norm_w, "final_norm", residual=resid, out=hidden_out)
        return self.logits(g, n, head_w, meta, name)

    def forward(self, g, meta: StepInputs, hidden_out: Optional[Tensor] = None) -> Tensor:
        """The main model; `hidden_out` [T, H] receives the final-normed hidden states (for MTP).
        Returns the logits (plan output "logits")."""
        w = self.w
        x = self.embed(g, meta.ids, w.embed, "residual")
        delta = None
        for i, layer in enumerate(w.layers):
            nxt = w.layers[i + 1] if i + 1 < len(w.layers) else None
            delta = self.block(g, layer, x, delta, meta, nxt)
        return self.head(g, w.norm, x, delta, w.lm_head, meta, hidden_out)

    def mtp(self, g, meta: StepInputs, hidden: Tensor, hidden_out: Optional[Tensor] = None,
            name: str = "logits") -> Tensor:
        """The MTP layer on hidden states `hidden` [T, H] (the main model's, or for a recursive
        draft the MTP layer's own) and the next tokens (meta.ids). `hidden_out` [T, H] receives
        its final-normed output (shared_head.norm), which feeds the next recursive draft, as
        SGLang's NextN steps do. May alias `hidden`: that is read first and written last."""
        m, T, H = self.w.mtp, meta.T, self.cfg.hidden_size
        e = self.embed(g, meta.ids, m.embed, "mtp_embed")
        self.norm(g, e, m.enorm, out=e)
        hn = self.norm(g, hidden, m.hnorm, "mtp_hnorm")
        cat = g.empty((T, 2 * H), self.dtype, "mtp_cat")
        g.concat(a=e, b=hn, out=cat)
        x = self.proj(g, cat, m.eh_proj, "residual")
        delta = self.block(g, m.layer, x, None, meta)
        return self.head(g, m.head_norm, x, delta, m.head, meta, hidden_out, name)
