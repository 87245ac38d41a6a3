"""The DeepSeek V4 model graph (V4-Flash, V4-Pro), every computation an op of the Backend.

Like model.deepseek, this module only describes one step: T tokens of S sequences traced onto a
Tracer. Every step reads the paged caches (prefill and decode alike): attention sees a sliding
window of the layer's per-token KV plus compressed entries, which only exist in the cache.

    X = hc_mult copies of embed(ids)                 the residual: N streams [T, N, H]
    per layer:  post, comb, a = hc_pre(X);  Y = hc_post(X, attention(rmsnorm(a)), post, comb)
                post, comb, m = hc_pre(Y);  X = hc_post(Y, MoE(rmsnorm(m)), post, comb)
    h = rmsnorm(hc_pre(X) with the head's weights);  logits = lm_head(h[last token of each sequence])
    MTP layer (speculative decoding), on the last X and the next tokens:
                X' = h_proj(hnorm(X)) + e_proj(enorm(embed(next)));  X' = block(X');  its own head

Attention (one shared key = value head of dim D, rope on its last Dr dims):
    qr = rmsnorm(q_a(x));  q = q_b(qr), each head RMS-normed (no weight), rope;  kv = rmsnorm(kv(x)), rope
    kv -> the layer's per-token cache.  CSA / HCA layers also compress: every token stages its
    values and gate logits (compressor kv_proj | gate_proj), and each token that closes a window
    of `ratio` tokens writes one entry: kv_compress, rmsnorm, rope at the window's first position.
    CSA layers run the lightning indexer (its own compressor of index_head_dim, queries from qr):
    indexer_topk picks index_topk entries per query. sparse_attention: window + entries + sinks.
    The output's rope dims are rotated back by -position (K = V carried rope into the values),
    then the grouped low-rank projection: o_groups linears o_a, one o_b.
MoE: router logits in f32, sqrtsoftplus scores, top-k of score + bias (hash layers: the experts
of the token id from the table), weights normalized and scaled; clipped SwiGLU in the shared and
routed experts. With an expert cache (model.expert_cache) the routed experts run over cache slots
and the step pauses before moe_experts, as in model.deepseek; the next layer's experts are guessed
for prefetch from this layer's streams (exactly, for a hash-routed next layer).

Per-step inputs besides model.deepseek's decode inputs (engine.model_runner fills them):
neg_positions [T] (-position), and per compression ratio r in use comp_slots_r [T] (the cache
entry slot the token's closed window writes, -1 if it closes none) and comp_pos_r [T] (that
window's first position).
"""
from __future__ import annotations

from typing import Optional

from ..tensor import Tensor
from .config import ModelConfig, RopeConfig
from .deepseek import ROPE_NONE, ROPE_YARN, DeepseekGraph, StepInputs, head_logits, linear, mlp
from .weights_v4 import CompressorWeights, HCWeights, V4AttentionWeights, V4LayerWeights, V4ModelWeights
from .. import abi

SQRTSOFTPLUS = abi.const("DI_SCORING_SQRTSOFTPLUS")
SCORING = {"softmax": abi.const("DI_SCORING_SOFTMAX"), "sigmoid": abi.const("DI_SCORING_SIGMOID"),
           "sqrtsoftplus": SQRTSOFTPLUS}


# the ABI 1.3 ops a V4 step calls (besides 1.3's fields of silu_mul, moe_experts and moe_router)
REQUIRED_OPS = ("hc_pre", "hc_post", "kv_compress", "indexer_topk", "sparse_attention")


def step_ratios(cfg: ModelConfig) -> list:
    """The compression ratios a V4 step needs entry slots for (one input pair each)."""
    return sorted({cfg.v4.ratio(i) for i in range(cfg.num_hidden_layers)} - {0})


def cache_pools(cfg: ModelConfig, block_size: int, num_layers: Optional[int] = None) -> list:
    """Per layer (num_layers: the main layers, plus the MTP layer's when it runs), {pool name:
    (entries per block, width)} of the paged cache (model.kv_cache).
    kv: the per-token key = value; stage / istage: per-token compressor inputs (values and gate
    logits of the attention's and the indexer's compressor); comp / ikeys: compressed entries,
    max(1, block_size / ratio) a block, each in the block of its window's last token."""
    v, out = cfg.v4, []
    for i in range(cfg.num_hidden_layers if num_layers is None else num_layers):
        r = v.ratio(i)
        pools = {"kv": (block_size, v.head_dim)}
        if r:
            per = max(1, block_size // r)
            W = (2 if v.is_csa(i) else 1) * v.head_dim
            pools["stage"] = (block_size, 2 * W)
            pools["comp"] = (per, v.head_dim)
            if v.is_csa(i):
                pools["istage"] = (block_size, 4 * v.index_head_dim)
                pools["ikeys"] = (per, v.index_head_dim)
        out.append(pools)
    return out


class DeepseekV4Graph:
    """DeepSeek V4 as code: one step of T tokens of S sequences traced onto `g` (a Tracer).
    caches: per layer a dict of the pools of cache_pools, as backend tensors [NB, entries, width]."""

    prefill_mode = False   # every step reads the cache: no un-cached prefill path

    def __init__(self, cfg: ModelConfig, weights: V4ModelWeights, caches: list, dtype: str, act_quant: bool):
        self.cfg, self.w, self.caches, self.dtype = cfg, weights, caches, dtype
        self.act_quant = act_quant
        self.block_size = None    # set with the caches (engine.model_runner)

    # ------------------------------------------------------------------ small pieces
    def linear(self, g, x, w, out):
        linear(g, x, w, out, self.act_quant)

    def rope(self, g, x, positions, r: RopeConfig):
        g.rope(x=x, positions=positions, out=x, interleaved=1,
               scaling=ROPE_YARN if r.type == "yarn" else ROPE_NONE, theta=r.theta, factor=r.factor,
               original_max_position=r.original_max_position, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
               attn_factor=r.attn_factor)

    def stream(self, X: Tensor, n: int) -> Tensor:
        """Stream n of the residual X [T, N, H] as a [T, H] view."""
        T, N, H = X.shape
        return Tensor(X.buffer, (T, H), X.dtype, (N * H, 1), X.offset + X.dtype.nbytes(n * H))

    def hc_pre(self, g, X, hc: HCWeights, with_mix: bool = True):
        c, T = self.cfg, X.shape[0]
        N, H = X.shape[1], X.shape[2]
        out = g.empty((T, H), self.dtype, "hc_in")
        post = g.empty((T, N), "f32", "hc_post") if with_mix else None
        comb = g.empty((T, N, N), "f32", "hc_comb") if with_mix else None
        g.hc_pre(x=X, fn=hc.fn, base=hc.base, scale=hc.scale, out=out, post=post, comb=comb, eps=c.rms_norm_eps,
                 hc_eps=c.v4.hc_eps, sinkhorn_iters=c.v4.hc_sinkhorn_iters)
        return post, comb, out

    # ------------------------------------------------------------------ compressor
    def compress(self, g, cw: CompressorWeights, x, stage, entries, meta: StepInputs, rope: RopeConfig, r: int):
        """Stage this step's compressor inputs, then write the entries of the windows it closes."""
        T, W, D = meta.T, cw.width, cw.out_dim
        st = g.empty((T, 2 * W), self.dtype, "stage")
        if cw.kv_gate is not None:
            self.linear(g, x, cw.kv_gate, st)
        else:
            self.linear(g, x, cw.kv, st.narrow(1, 0, W))
            self.linear(g, x, cw.gate, st.narrow(1, W, W))
        g.mla_cache_write(latent=st.narrow(1, 0, W), k_pe=st.narrow(1, W, W), slots=meta.slots, cache=stage)
        e = g.empty((T, D), self.dtype, "entry")
        g.kv_compress(staged=stage, position_bias=cw.position_bias, block_table=meta.block_table,
                      token_seq=meta.token_seq, positions=meta.positions, out=e, ratio=r, overlap=int(cw.overlap))
        g.rmsnorm(x=e, weight=cw.norm, out=e, eps=self.cfg.rms_norm_eps)
        Dr = self.cfg.qk_rope_head_dim
        comp_pos, comp_slots = self.extra[f"comp_pos_{r}"], self.extra[f"comp_slots_{r}"]
        self.rope(g, e.narrow(1, D - Dr, Dr), comp_pos, rope)
        g.mla_cache_write(latent=e.narrow(1, 0, D - Dr), k_pe=e.narrow(1, D - Dr, Dr), slots=comp_slots,
                          cache=entries)

    # ------------------------------------------------------------------ attention
    def attention(self, g, i: int, w: V4AttentionWeights, x, meta: StepInputs) -> Tensor:
        c, v, T, dt = self.cfg, self.cfg.v4, meta.T, self.dtype
        NH, D, Dr = c.num_attention_heads, v.head_dim, c.qk_rope_head_dim
        pools, rope, r = self.caches[i], v.rope(i), v.ratio(i)
        qa = g.empty((T, c.q_lora_rank), dt, "q_a")
        self.linear(g, x, w.q_a, qa)
        g.rmsnorm(x=qa, weight=w.q_a_norm, out=qa, eps=c.rms_norm_eps)
        q = g.empty((T, NH * D), dt, "q")
        self.linear(g, qa, w.q_b, q)
        # each head RMS-normed without a weight (transformers' q_b_norm)
        g.rmsnorm(x=q.view(T * NH, D), weight=self.w.ones, out=q.view(T * NH, D), eps=c.rms_norm_eps)
        q3 = q.view(T, NH, D)
        self.rope(g, q3.narrow(2, D - Dr, Dr), meta.positions, rope)
        kv = g.empty((T, D), dt, "kv")
        self.linear(g, x, w.kv, kv)
        g.rmsnorm(x=kv, weight=w.kv_norm, out=kv, eps=c.rms_norm_eps)
        self.rope(g, kv.narrow(1, D - Dr, Dr), meta.positions, rope)
        g.mla_cache_write(latent=kv.narrow(1, 0, D - Dr), k_pe=kv.narrow(1, D - Dr, Dr), slots=meta.slots,
                          cache=pools["kv"])
        comp, idx = None, None
        if r:
            self.compress(g, w.compressor, x, pools["stage"], pools["comp"], meta, rope, r)
            comp = pools["comp"]
        if w.indexer is not None:
            ix, NI, Di = w.indexer, v.index_n_heads, v.index_head_dim
            self.compress(g, ix.compressor, x, pools["istage"], pools["ikeys"], meta, rope, r)
            iq = g.empty((T, NI * Di), dt, "index_q")
            self.linear(g, qa, ix.q_b, iq)
            iq3 = iq.view(T, NI, Di)
            self.rope(g, iq3.narrow(2, Di - Dr, Dr), meta.positions, rope)
            iw = g.empty((T, NI), "f32", "index_weights")
            g.linear(x=x, w=ix.weights_proj, out=iw)
            idx = g.empty((T, v.index_topk), "int32", "index_topk")
            g.indexer_topk(q=iq3, weights=iw, keys=pools["ikeys"], block_table=meta.block_table,
                           token_seq=meta.token_seq, kv_len=meta.kv_len, out=idx, scale=(Di * NI) ** -0.5,
                           ratio=r, block_size=self.block_size)
        o = g.empty((T, NH, D), dt, "attn")
        g.sparse_attention(q=q3, kv_cache=pools["kv"], comp_cache=comp, indices=idx, sinks=w.sinks,
                           block_table=meta.block_table, token_seq=meta.token_seq, kv_len=meta.kv_len, out=o,
                           scale=D ** -0.5, window=v.sliding_window, ratio=max(r, 1))
        # values are the keys, rope included: rotate the output's rope dims back to position 0
        self.rope(g, o.narrow(2, D - Dr, Dr), self.extra["neg_positions"], rope)
        G, R = v.o_groups, v.o_lora_rank
        og = o.view(T, NH * D)
        per = NH * D // G
        oa = g.empty((T, G * R), dt, "o_a")
        for k in range(G):
            self.linear(g, og.narrow(1, k * per, per), w.o_a[k], oa.narrow(1, k * R, R))
        out = g.empty((T, c.hidden_size), dt, "attn_out")
        self.linear(g, oa, w.o_b, out)
        return out

    # ------------------------------------------------------------------ MoE
    def route(self, g, w, x, meta: StepInputs, name: str = "topk", ids=None):
        """Router logits in f32, then moe_router (hash layers: the token ids' experts from the
        table): (topk_ids, topk_weights) [T, K] (ids: where the ids go, default a new tensor)."""
        c, T = self.cfg, meta.T
        E, K = c.n_routed_experts, c.num_experts_per_tok
        logits = g.empty((T, E), "f32", "router_logits")
        g.linear(x=x, w=w.gate, out=logits)
        if ids is None:
            ids = g.empty((T, K), "int32", f"{name}_ids")
        wts = g.empty((T, K), "f32", f"{name}_weights")
        hashed = w.hash_table is not None
        # transformers' V4 routers always normalize the selected weights
        g.moe_router(logits=logits, bias=w.gate_bias, topk_ids=ids, topk_weights=wts, scoring=SCORING[c.scoring_func],
                     n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                     routed_scaling_factor=c.routed_scaling_factor,
                     token_ids=meta.ids if hashed else None, hash_table=w.hash_table)
        return ids, wts

    def predict(self, g, Y, nxt: V4LayerWeights, meta: StepInputs) -> Tensor:
        """The next layer's experts guessed from this layer's streams Y (after its attention): the
        next layer's MoE input as if its attention added nothing (its ffn hyper-connection and norm
        applied to Y), routed by its router. Exact for a hash-routed next layer (token ids only)."""
        _, _, m = self.hc_pre(g, Y, nxt.ffn_hc)
        g.rmsnorm(x=m, weight=nxt.ln2, out=m, eps=self.cfg.rms_norm_eps)
        ids, _ = self.route(g, nxt.moe, m, meta, "predicted")
        return ids

    def moe(self, g, w, x, meta: StepInputs, pred=None) -> Tensor:
        """Shared experts, then the routed experts accumulated on top (clipped SwiGLU in both).
        Streamed experts (model.expert_cache) pause before moe_experts as in model.deepseek: the
        host reads the routing (and `pred`, the next layer's guessed experts, to prefetch), gets
        the misses loaded and sends the layer's expert -> slot table; a pause-free step records its
        routing and misses instead."""
        c, T = self.cfg, meta.T
        E, K, lim = c.n_routed_experts, c.num_experts_per_tok, c.v4.swiglu_limit
        s, acc = w.streamed, int(w.shared is not None)
        streamed = s is not None and s.direct is None
        record = s.record(T, s.pos) if streamed and s.pause_free else None
        ids, wts = self.route(g, w, x, meta, ids=record[0] if record else None)
        out = g.empty((T, c.hidden_size), self.dtype, "moe_out")
        routing = dict(ids=ids, pred=pred)
        if streamed and record is None and s.early_read:
            # a device: the shared experts run while the host reads the routing (model.deepseek)
            g.pause(("expert_ids", s.pos), **routing)
            routing = {}
        if w.shared is not None:
            mlp(g, w.shared, x, out, self.dtype, self.act_quant, lim)
        if not streamed:
            gate, up, down = (w.experts_gate, w.experts_up, w.experts_down) if s is None else s.direct
            g.moe_experts(x=x, topk_ids=ids, topk_weights=wts, num_experts=E, accumulate=acc,
                          w_gate=gate, w_up=up, w_down=down, out=out, swiglu_limit=lim)
            return out
        if record is None:
            g.pause(("experts", s.pos), **routing)
        misses = record[1] if record is not None else g.empty((T, K), "int32", "expert_misses")
        DeepseekGraph.streamed_experts(g, s, x, ids, wts, out, misses, acc, swiglu_limit=lim)
        return out

    # ------------------------------------------------------------------ the step
    def declare_inputs(self, g, meta: StepInputs) -> None:
        """The step's V4 inputs (once per plan: a speculative plan runs the main model and the MTP
        layer over the same rows)."""
        names = ["neg_positions"] + [f"comp_{k}_{r}" for r in step_ratios(self.cfg) for k in ("slots", "pos")]
        self.extra = {n: g.inputs[n] if n in g.inputs else g.input(n, (meta.T,)) for n in names}

    def layer(self, g, w: V4LayerWeights, X, meta: StepInputs, nxt: Optional[V4LayerWeights] = None,
              out: Optional[Tensor] = None):
        """One block; `nxt`: the following layer, whose experts this one may guess (streamed experts);
        `out` [T, N, H]: where the output streams go (default: a new tensor)."""
        c, T = self.cfg, meta.T
        N, H = c.v4.hc_mult, c.hidden_size
        post, comb, a = self.hc_pre(g, X, w.attn_hc)
        g.rmsnorm(x=a, weight=w.ln1, out=a, eps=c.rms_norm_eps)
        y = self.attention(g, w.index, w.attn, a, meta)
        Y = g.empty((T, N, H), self.dtype, "streams")
        g.hc_post(x=X, y=y, post=post, comb=comb, out=Y)
        s = w.moe.streamed
        pred = self.predict(g, Y, nxt, meta) if (s is not None and s.direct is None and s.predict
                                                 and not s.pause_free and nxt is not None) else None
        post, comb, m = self.hc_pre(g, Y, w.ffn_hc)
        g.rmsnorm(x=m, weight=w.ln2, out=m, eps=c.rms_norm_eps)
        y = self.moe(g, w.moe, m, meta, pred)
        X2 = out if out is not None else g.empty((T, N, H), self.dtype, "streams")
        g.hc_post(x=Y, y=y, post=post, comb=comb, out=X2)
        return X2

    def head(self, g, X, hc: HCWeights, norm_w, head_w, meta: StepInputs, name: str = "logits") -> Tensor:
        """The streams collapsed by the hyper-connection head, normed, then f32 logits (output `name`)."""
        c = self.cfg
        _, _, h = self.hc_pre(g, X, hc, with_mix=False)
        n = g.empty((meta.T, c.hidden_size), self.dtype, "final_norm")
        g.rmsnorm(x=h, weight=norm_w, out=n, eps=c.rms_norm_eps)
        return head_logits(g, n, head_w, meta, c.vocab_size, name)

    def forward(self, g, meta: StepInputs, hidden_out: Optional[Tensor] = None) -> Tensor:
        """The main model; `hidden_out` [T, N * H] receives the last layer's streams (before the
        hyper-connection head: what the MTP layer reads). Returns the logits (plan output "logits")."""
        if meta.mode != "decode":
            raise ValueError("DeepSeek V4 steps read the paged cache: trace them in decode mode")
        c, w, T = self.cfg, self.w, meta.T
        N, H = c.v4.hc_mult, c.hidden_size
        self.declare_inputs(g, meta)
        X = g.empty((T, N, H), self.dtype, "streams")
        for n in range(N):
            g.embedding(ids=meta.ids, table=w.embed, out=self.stream(X, n))
        last = len(w.layers) - 1
        for i, layer in enumerate(w.layers):
            X = self.layer(g, layer, X, meta, w.layers[i + 1] if i < last else None,
                           out=hidden_out.view(T, N, H) if i == last and hidden_out is not None else None)
        return self.head(g, X, w.hc_head, w.norm, w.lm_head, meta)

    def mtp(self, g, meta: StepInputs, hidden: Tensor, hidden_out: Optional[Tensor] = None,
            name: str = "logits") -> Tensor:
        """The MTP layer on streams `hidden` [T, N * H] (the main model's last streams, or for a
        recursive draft the MTP layer's own) and the next tokens (meta.ids):

            X[t, n] = h_proj(hnorm(hidden[t, n])) + e_proj(enorm(embed(ids[t])))   for every stream n
            X = block(X)  (sliding window attention, top-k MoE)  -> hidden_out
            logits = head(norm(hc_head(X)))

        as DeepSeek's V4 MTP module computes it. `hidden_out` may alias `hidden`: that is read first
        and written last (the block's hc_post writes it from a tensor of its own)."""
        c, m, T = self.cfg, self.w.mtp, meta.T
        N, H = c.v4.hc_mult, c.hidden_size
        self.declare_inputs(g, meta)
        e = g.empty((T, H), self.dtype, "mtp_embed")
        g.embedding(ids=meta.ids, table=m.embed, out=e)
        g.rmsnorm(x=e, weight=m.enorm, out=e, eps=c.rms_norm_eps)
        ep = g.empty((T, H), self.dtype, "mtp_e_proj")
        self.linear(g, e, m.e_proj, ep)
        hn = g.empty((T * N, H), self.dtype, "mtp_hnorm")
        g.rmsnorm(x=hidden.view(T * N, H), weight=m.hnorm, out=hn, eps=c.rms_norm_eps)
        X = g.empty((T, N, H), self.dtype, "streams")
        self.linear(g, hn, m.h_proj, X.view(T * N, H))
        for n in range(N):
            g.add(a=self.stream(X, n), b=ep, out=self.stream(X, n))
        X = self.layer(g, m.layer, X, meta, None, out=hidden_out.view(T, N, H) if hidden_out is not None else None)
        return self.head(g, X, m.hc_head, m.head_norm, m.head, meta, name)

    # one speculative step (engine.speculative): the same plan as V3's over V4's forward and mtp
    verify_and_draft = DeepseekGraph.verify_and_draft
