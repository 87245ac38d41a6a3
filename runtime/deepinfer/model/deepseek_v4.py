"""The DeepSeek V4 model graph (V4-Flash, V4-Pro), every computation an op of the Backend.

Like model.deepseek (and on the same base, model.graph), this module only describes one step: T tokens of S sequences traced onto a
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
routed experts, which run by the layer's strategy (model.moe_strategy) as in model.deepseek. With
an expert cache the next layer's experts are guessed for prefetch from this layer's streams
(exactly, for a hash-routed next layer).

Per-step inputs besides model.deepseek's decode inputs (engine.model_runner fills them):
neg_positions [T] (-position), and per compression ratio r in use comp_slots_r [T] (the cache
entry slot the token's closed window writes, -1 if it closes none) and comp_pos_r [T] (that
window's first position).
"""
from __future__ import annotations

from typing import Optional

from .. import abi
from ..tensor import Tensor
from .config import ModelConfig, RopeConfig
from .graph import ModelGraph, StepInputs
from .moe_strategy import experts_for
from .weights import MoEWeights
from .weights_v4 import CompressorWeights, HCWeights, V4AttentionWeights, V4LayerWeights, V4ModelWeights

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


class DeepseekV4Graph(ModelGraph):
    """DeepSeek V4 as code: one step of T tokens of S sequences traced onto `g` (a Tracer).
    caches: per layer a dict of the pools of cache_pools, as backend tensors [NB, entries, width]."""

    prefill_mode = False   # every step reads the cache: no un-cached prefill path

    def __init__(self, cfg: ModelConfig, weights: V4ModelWeights, caches: list, dtype: str, act_quant: bool):
        super().__init__(cfg, weights, caches, dtype, act_quant)
        # clipped SwiGLU in the shared and the routed experts
        self.swiglu_limit = cfg.v4.swiglu_limit
        self.expert_options = {"swiglu_limit": cfg.v4.swiglu_limit}

    # ------------------------------------------------------------------ small pieces
    def rope(self, g, x, positions, r: RopeConfig, interleaved: int = 1) -> None:
        super().rope(g, x, positions, r, interleaved)

    def stream(self, X: Tensor, n: int) -> Tensor:
        """Stream n of the residual X [T, N, H] as a [T, H] view."""
        T, N, H = X.shape
        return Tensor(X.buffer, (T, H), X.dtype, (N * H, 1), X.offset + X.dtype.nbytes(n * H))

    def hc_pre(self, g, X, hc: HCWeights, with_mix: bool = True):
        """The hyper-connection's mix of the streams X [T, N, H] into one sublayer input [T, H], and
        (with_mix) the weights hc_post puts the sublayer's output back with: (post, comb, input)."""
        c, T = self.cfg, X.shape[0]
        N, H = X.shape[1], X.shape[2]
        out = g.empty((T, H), self.dtype, "hc_in")
        post = g.empty((T, N), "f32", "hc_post") if with_mix else None
        comb = g.empty((T, N, N), "f32", "hc_comb") if with_mix else None
        g.hc_pre(x=X, fn=hc.fn, base=hc.base, scale=hc.scale, out=out, post=post, comb=comb, eps=c.rms_norm_eps,
                 hc_eps=c.v4.hc_eps, sinkhorn_iters=c.v4.hc_sinkhorn_iters)
        return post, comb, out

    def hc_post(self, g, X, y, post, comb, out: Optional[Tensor] = None) -> Tensor:
        """The streams X with the sublayer output y put back (out: where, default a new tensor)."""
        out = g.empty(X.shape, self.dtype, "streams") if out is None else out
        g.hc_post(x=X, y=y, post=post, comb=comb, out=out)
        return out

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
        self.norm(g, e, cw.norm, out=e)
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
        qa = self.proj(g, x, w.q_a, "q_a")
        self.norm(g, qa, w.q_a_norm, out=qa)
        q = self.proj(g, qa, w.q_b, "q")
        # each head RMS-normed without a weight (transformers' q_b_norm)
        self.norm(g, q.view(T * NH, D), self.w.ones, out=q.view(T * NH, D))
        q3 = q.view(T, NH, D)
        self.rope(g, q3.narrow(2, D - Dr, Dr), meta.positions, rope)
        kv = self.proj(g, x, w.kv, "kv")
        self.norm(g, kv, w.kv_norm, out=kv)
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
            iq3 = self.proj(g, qa, ix.q_b, "index_q").view(T, NI, Di)
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
        return self.proj(g, oa, w.o_b, "attn_out")

    # ------------------------------------------------------------------ MoE
    def router_options(self, w: MoEWeights, meta: StepInputs) -> dict:
        """sqrtsoftplus scores, top-k of score + bias, or for a hash layer the token ids' experts from
        the table; transformers' V4 routers always normalize the selected weights."""
        hashed = w.hash_table is not None
        return dict(scoring=SCORING[self.cfg.scoring_func], n_group=1, topk_group=1, group_score=0,
                    norm_topk_prob=1, routed_scaling_factor=self.cfg.routed_scaling_factor,
                    token_ids=meta.ids if hashed else None, hash_table=w.hash_table)

    def predict(self, g, Y, nxt: V4LayerWeights, meta: StepInputs) -> Tensor:
        """The next layer's experts guessed from this layer's streams Y (after its attention): the
        next layer's MoE input as if its attention added nothing (its ffn hyper-connection and norm
        applied to Y), routed by its router. Exact for a hash-routed next layer (token ids only)."""
        _, _, m = self.hc_pre(g, Y, nxt.ffn_hc)
        self.norm(g, m, nxt.ln2, out=m)
        ids, _ = self.route(g, nxt.moe, m, meta, "predicted")
        return ids

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
        post, comb, a = self.hc_pre(g, X, w.attn_hc)
        self.norm(g, a, w.ln1, out=a)
        Y = self.hc_post(g, X, self.attention(g, w.index, w.attn, a, meta), post, comb)
        # the next layer's experts are guessed from Y, before this layer's MoE input is made
        experts = experts_for(self, w.moe)
        pred = self.predict(g, Y, nxt, meta) if nxt is not None and experts.predicts() else None
        post, comb, m = self.hc_pre(g, Y, w.ffn_hc)
        self.norm(g, m, w.ln2, out=m)
        y = self.moe(g, w.moe, m, meta, (lambda: pred) if pred is not None else None, experts)
        return self.hc_post(g, Y, y, post, comb, out)

    def head(self, g, X, hc: HCWeights, norm_w, head_w, meta: StepInputs, name: str = "logits") -> Tensor:
        """The streams collapsed by the hyper-connection head, normed, then f32 logits (output `name`)."""
        _, _, h = self.hc_pre(g, X, hc, with_mix=False)
        return self.logits(g, self.norm(g, h, norm_w, "final_norm"), head_w, meta, name)

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
        e = self.embed(g, meta.ids, m.embed, "mtp_embed")
        self.norm(g, e, m.enorm, out=e)
        ep = self.proj(g, e, m.e_proj, "mtp_e_proj")
        hn = self.norm(g, hidden.view(T * N, H), m.hnorm, "mtp_hnorm")
        X = g.empty((T, N, H), self.dtype, "streams")
        self.linear(g, hn, m.h_proj, X.view(T * N, H))
        for n in range(N):
            g.add(a=self.stream(X, n), b=ep, out=self.stream(X, n))
        X = self.layer(g, m.layer, X, meta, None, out=hidden_out.view(T, N, H) if hidden_out is not None else None)
        return self.head(g, X, m.hc_head, m.head_norm, m.head, meta, name)
