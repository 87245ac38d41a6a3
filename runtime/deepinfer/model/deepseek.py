"""The DeepSeek V2 / V3 model graph, every computation an op of the Backend.

This module only describes the model: it traces one step onto a Tracer (model.plan) and owns no
state. Weights come typed from model.weights; the runner (engine.model_runner) owns the KV cache,
the plans, the arena and the inputs.

Shape of one step (T tokens of S sequences, hidden H, heads NH):

    x = embed(ids)                                   the running residual, updated in place
    per layer:  n = rmsnorm(x (+ previous sublayer output));  a = MLA(n)
                n = rmsnorm(x + a);  m = MLP(n) or MoE(n)
    h = rmsnorm(x + m);  logits = lm_head(h[last token of each sequence])   (f32)

MLA: q = q_b(rmsnorm(q_a(n))) or q_proj(n); [latent | k_pe] = kv_a(n); latent = rmsnorm(latent);
rope on q's last Dr dims and on k_pe; (latent, k_pe) go to the paged cache. A batch in which every
sequence starts at position 0 runs mla_prefill on the un-absorbed keys and values (kv_b(latent));
any other batch (decode, chunked prefill, speculative verification) runs mla_decode, which absorbs
kv_b into the query and reads the latent cache directly.

MoE: router logits in f32, moe_router (softmax greedy / group_limited_greedy / noaux_tc sigmoid
with e_score_correction_bias), shared experts first, then routed experts accumulated on top. With
an expert cache (model.expert_cache) the routed experts run over cache slots through the cache's
expert -> slot table on the device: the step pauses before moe_experts (the host reads the routing,
gets what is missing loaded and sends the layer's table), and the next layer's router may run
early, on this layer's residual, to predict what to pre-load while this layer computes; a
pause-free step (every expert expected in place) records its routing and misses instead.

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

from dataclasses import dataclass, replace
from typing import Optional

from .. import abi
from ..tensor import Quant, Tensor
from .config import ModelConfig
from .weights import AttentionWeights, LayerWeights, MLPWeights, ModelWeights, MoEWeights

ROPE_NONE, ROPE_YARN = abi.const("DI_ROPE_NONE"), abi.const("DI_ROPE_YARN")
SCORING = {"softmax": abi.const("DI_SCORING_SOFTMAX"), "sigmoid": abi.const("DI_SCORING_SIGMOID")}
GROUP_MAX, GROUP_SUM_TOP2 = abi.const("DI_GROUP_SCORE_MAX"), abi.const("DI_GROUP_SCORE_SUM_TOP2")


def dsa_cache_pools(cfg: ModelConfig, block_size: int, num_layers: Optional[int] = None) -> list:
    """V3.2's paged cache per layer (num_layers: the main layers, plus the MTP layer's when it runs):
    the MLA latent and the indexer's key of every token."""
    return [{"latent": (block_size, cfg.cache_width), "ikeys": (block_size, cfg.dsa.index_head_dim)}
            for _ in range(cfg.num_hidden_layers if num_layers is None else num_layers)]


def linear(g, x, w, out, act_quant: bool, bias=None) -> None:
    """linear, with x quantized to int8 per token first when the precision says so (w8a8 / w4a8)."""
    if act_quant and w.quant is not None and w.dtype.name in ("int8", "int4"):
        T, K = x.shape
        xq = g.empty((T, K), "int8", "x_int8")
        xq.quant = Quant(g.empty((T, 1), "f32", "x_scales"), (1, 0))
        g.quantize(x=x, out=xq, scale_pow2=0)
        x = xq
    g.linear(x=x, w=w, bias=bias, out=out)


def mlp(g, m: MLPWeights, x, out, dtype: str, act_quant: bool, limit: float = 0.0) -> Tensor:
    """out = down(silu(gate x) * up x); limit > 0 clips gate and up first (V4's clipped SwiGLU)."""
    T, I = x.shape[0], m.gate.shape[0]
    gate = g.empty((T, I), dtype, "gate")
    if m.gate_up is not None:
        gu = g.empty((T, 2 * I), dtype, "gate_up")
        linear(g, x, m.gate_up, gu, act_quant)
        g.silu_mul(gate=gu.narrow(1, 0, I), up=gu.narrow(1, I, I), out=gate, limit=limit)
    else:
        up = g.empty((T, I), dtype, "up")
        linear(g, x, m.gate, gate, act_quant)
        linear(g, x, m.up, up, act_quant)
        g.silu_mul(gate=gate, up=up, out=gate, limit=limit)
    linear(g, gate, m.down, out, act_quant)
    return out


def head_logits(g, n, head_w, meta: "StepInputs", vocab: int, name: str = "logits") -> Tensor:
    """f32 logits (plan output `name`) of the final-normed hidden states n [T, H]: every row, or the
    last token of each sequence (meta.last_idx)."""
    rows = n
    if meta.last_idx is not None:
        # the embedding op is a row gather: the last token of each sequence
        rows = g.empty((meta.S, n.shape[1]), n.dtype, "last_hidden")
        g.embedding(ids=meta.last_idx, table=n, out=rows)
    logits = g.empty((rows.shape[0], vocab), "f32", name)
    g.linear(x=rows, w=head_w, out=logits)
    g.output(name, logits)
    return logits


@dataclass
class StepInputs:
    """The per-step input tensors of a traced step (written by the host before each run).

    prefill mode (every sequence starts at 0): cu_seqlens [S + 1]. decode mode (anything else:
    decode, chunked prefill, prefix-cache hits, speculative verification): block_table [S, MB],
    token_seq [T], kv_len [T]. last_idx [S] picks each sequence's last token for the head (None:
    logits of every token)."""

    mode: str
    T: int
    S: int
    ids: Tensor
    positions: Tensor
    slots: Tensor
    cu_seqlens: Optional[Tensor] = None
    block_table: Optional[Tensor] = None
    token_seq: Optional[Tensor] = None
    kv_len: Optional[Tensor] = None
    last_idx: Optional[Tensor] = None

    @classmethod
    def declare(cls, g, mode: str, T: int, S: int, max_blocks_per_seq: int, all_logits: bool) -> "StepInputs":
        m = cls(mode, T, S, g.input("ids", (T,)), g.input("positions", (T,)), g.input("slots", (T,)))
        if mode == "prefill":
            m.cu_seqlens = g.input("cu_seqlens", (S + 1,))
        else:
            m.block_table = g.input("block_table", (S, max_blocks_per_seq))
            m.token_seq = g.input("token_seq", (T,))
            m.kv_len = g.input("kv_len", (T,))
        m.last_idx = None if all_logits else g.input("last_idx", (S,))
        return m


class DeepseekGraph:
    """The model as code: one step of T tokens of S sequences traced onto `g` (a Tracer)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, caches: list, dtype: str, act_quant: bool):
        self.cfg, self.w, self.caches, self.dtype = cfg, weights, caches, dtype
        self.act_quant = act_quant      # int8 per-token activations for int8/int4 linears (w8a8, w4a8)
        # V3.2 selects what each query attends from the cache: no un-cached prefill path
        self.prefill_mode = cfg.dsa is None
        self.block_size = None          # tokens per cache block (set by the runner; the indexer needs it)
        # parallel.group.ParallelGroup of a split model, or None: this rank's cfg has NH / tp heads and
        # its MLPs I / tp, and each sublayer's partial output is all-reduced (set by the runner)
        self.par = None

    @property
    def tp(self) -> int:
        return self.par.tp if self.par is not None else 1

    @property
    def ep(self) -> int:
        return self.par.ep if self.par is not None else 1

    def all_reduce(self, g, x) -> None:
        """x = the sum of every rank's x (in place), when tensor parallelism split what made it."""
        if self.tp > 1:
            g.all_reduce(comm=self.par.comm, x=x, out=x)

    def linear(self, g, x, w, out, bias=None):
        linear(g, x, w, out, self.act_quant, bias)

    def rope(self, g, x, positions):
        r = self.cfg.rope
        g.rope(x=x, positions=positions, out=x, interleaved=int(self.cfg.rope_interleave),
               scaling=ROPE_YARN if r.type == "yarn" else ROPE_NONE, theta=r.theta, factor=r.factor,
               original_max_position=r.original_max_position, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
               attn_factor=r.attn_factor)

    def dsa_indexer(self, g, w: AttentionWeights, pools: dict, x, qa, meta: StepInputs) -> Tensor:
        """V3.2: cache this step's indexer keys, then the index_topk positions each token attends."""
        c, T, dt, ix = self.cfg, meta.T, self.dtype, w.indexer
        NI, Di, Dr = c.dsa.index_n_heads, c.dsa.index_head_dim, c.qk_rope_head_dim
        r = c.rope
        rope = dict(interleaved=0, scaling=ROPE_YARN if r.type == "yarn" else ROPE_NONE, theta=r.theta,
                    factor=r.factor, original_max_position=r.original_max_position, beta_fast=r.beta_fast,
                    beta_slow=r.beta_slow, attn_factor=r.attn_factor)
        k = g.empty((T, Di), dt, "index_k")
        self.linear(g, x, ix.wk, k)
        g.layernorm(x=k, weight=ix.k_norm, bias=ix.k_norm_bias, out=k, eps=1e-6)
        g.rope(x=k.narrow(1, 0, Dr), positions=meta.positions, out=k.narrow(1, 0, Dr), **rope)
        g.mla_cache_write(latent=k.narrow(1, 0, Dr), k_pe=k.narrow(1, Dr, Di - Dr), slots=meta.slots,
                          cache=pools["ikeys"])
        q = g.empty((T, NI * Di), dt, "index_q")
        self.linear(g, qa, ix.wq_b, q)
        q3 = q.view(T, NI, Di)
        g.rope(x=q3.narrow(2, 0, Dr), positions=meta.positions, out=q3.narrow(2, 0, Dr), **rope)
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
            xo = g.empty((T, Nq + Dc + Dr), dt, "x_proj")
            self.linear(g, x, w.x_proj, xo)
            first, kva = xo.narrow(1, 0, Nq), xo.narrow(1, Nq, Dc + Dr)
        else:
            first = g.empty((T, Nq), dt, "q_a" if c.q_lora_rank else "q")
            self.linear(g, x, w.q_a if c.q_lora_rank else w.q, first, w.q_a_bias)
            kva = g.empty((T, Dc + Dr), dt, "kv_a")
            self.linear(g, x, w.kv_a, kva, w.kv_a_bias)
        qa = None
        if c.q_lora_rank:
            qa = g.empty((T, c.q_lora_rank), dt, "q_a_norm")
            g.rmsnorm(x=first, weight=w.q_a_norm, out=qa, eps=c.rms_norm_eps)
            q = g.empty((T, NH * c.qk_head_dim), dt, "q")
            self.linear(g, qa, w.q_b, q)
            q3 = q.view(T, NH, c.qk_head_dim)
        else:
            # [T, NH, Dn + Dr] over the q columns (rows may be longer than NH * (Dn + Dr))
            q3 = Tensor(first.buffer, (T, NH, c.qk_head_dim), dt, (first.strides[0], c.qk_head_dim, 1), first.offset)
        self.rope(g, q3.narrow(2, Dn, Dr), meta.positions)
        latent = g.empty((T, Dc), dt, "latent")
        g.rmsnorm(x=kva.narrow(1, 0, Dc), weight=w.kv_a_norm, out=latent, eps=c.rms_norm_eps)
        k_pe = kva.narrow(1, Dc, Dr)
        self.rope(g, k_pe, meta.positions)
        g.mla_cache_write(latent=latent, k_pe=k_pe, slots=meta.slots, cache=cache)
        idx = self.dsa_indexer(g, w, pools, x, qa, meta) if w.indexer is not None else None
        o = g.empty((T, NH, Dv), dt, "attn")
        if meta.mode == "prefill":
            kv = g.empty((T, NH * (Dn + Dv)), dt, "kv")
            self.linear(g, latent, w.kv_b, kv)
            g.mla_prefill(q=q3, kv=kv.view(T, NH, Dn + Dv), k_pe=k_pe, cu_seqlens=meta.cu_seqlens, out=o,
                          scale=c.softmax_scale)
        else:
            g.mla_decode(q=q3, wkv_b=w.kv_b_dense, cache=cache, block_table=meta.block_table,
                         token_seq=meta.token_seq, kv_len=meta.kv_len, out=o, scale=c.softmax_scale, indices=idx)
        out = g.empty((T, c.hidden_size), dt, "attn_out")
        self.linear(g, o.view(T, NH * Dv), w.o, out, w.o_bias)
        self.all_reduce(g, out)        # tensor parallel: each rank's heads gave a partial sum
        return out

    def mlp(self, g, m: MLPWeights, x, T, out=None, reduce: bool = True) -> Tensor:
        """A dense MLP; under tensor parallelism each rank's I / tp columns give a partial sum,
        all-reduced here unless the caller adds more partial sums first (reduce=False)."""
        if out is None:
            out = g.empty((T, self.cfg.hidden_size), self.dtype, "mlp_out")
        mlp(g, m, x, out, self.dtype, self.act_quant)
        if reduce:
            self.all_reduce(g, out)
        return out

    def route(self, g, w: MoEWeights, x, T, name: str = "topk", ids=None):
        """Router logits in f32, then moe_router: (topk_ids, topk_weights) [T, K] (ids: where the
        ids go, default a new tensor)."""
        c = self.cfg
        E, K = c.n_routed_experts, c.num_experts_per_tok
        logits = g.empty((T, E), "f32", "router_logits")
        g.linear(x=x, w=w.gate, out=logits)
        if ids is None:
            ids = g.empty((T, K), "int32", f"{name}_ids")
        wts = g.empty((T, K), "f32", f"{name}_weights")
        grouped = c.topk_method in ("group_limited_greedy", "noaux_tc") and c.n_group > 1
        g.moe_router(logits=logits, bias=w.gate_bias, topk_ids=ids, topk_weights=wts,
                     scoring=SCORING[c.scoring_func], n_group=c.n_group if grouped else 1,
                     topk_group=c.topk_group if grouped else 1,
                     group_score=GROUP_SUM_TOP2 if c.topk_method == "noaux_tc" else GROUP_MAX,
                     norm_topk_prob=int(bool(c.norm_topk_prob) and K > 1),
                     routed_scaling_factor=c.routed_scaling_factor)
        return ids, wts

    def moe(self, g, w: MoEWeights, x, T, resid=None, next_layer: Optional[LayerWeights] = None) -> Tensor:
        c = self.cfg
        E, K = c.n_routed_experts, c.num_experts_per_tok
        s = w.streamed
        streamed = s is not None and s.direct is None
        # a pause-free step (model.expert_cache) records its routing and misses for the host
        record = s.record(T, s.pos) if streamed and s.pause_free else None
        ids, wts = self.route(g, w, x, T, ids=record[0] if record else None)
        out = g.empty((T, c.hidden_size), self.dtype, "moe_out")
        if self.ep > 1:
            return self.moe_expert_parallel(g, w, x, T, ids, wts, out)
        if not streamed:
            # resident experts (or a filled expert cache: its slots in expert order, no pause)
            gate, up, down = (w.experts_gate, w.experts_up, w.experts_down) if s is None else s.direct
            if w.shared is not None:
                self.mlp(g, w.shared, x, T, out=out, reduce=False)
            g.moe_experts(x=x, topk_ids=ids, topk_weights=wts, num_experts=E, accumulate=int(w.shared is not None),
                          w_gate=gate, w_up=up, w_down=down, out=out)
            # tensor parallel without expert parallelism: every expert's I / tp columns, partial sums
            self.all_reduce(g, out)
            return out
        # streamed experts (model.expert_cache): one pause, after the shared experts, where the host
        # reads the routing, gets missing experts loaded and sends the layer's expert -> slot table,
        # which moe_experts reads on the device (none in a pause-free step: the table is in place)
        routing = {}
        if record is None:
            pred = None
            if s.predict and resid is not None and next_layer is not None and next_layer.moe is not None:
                # prefetch: the next layer's router on this layer's residual, normed as that layer norms it
                pn = g.empty((T, c.hidden_size), self.dtype, "predict_norm")
                g.rmsnorm(x=resid, weight=next_layer.ln2, out=pn, eps=c.rms_norm_eps)
                pred, _ = self.route(g, next_layer.moe, pn, T, "predicted")
            routing = dict(ids=ids, pred=pred)
            if s.early_read:
                # a device: the routing is sent to the host now and the shared experts run while the
                # host decides; the step stops only before moe_experts (ExpertCache.on_ids)
                g.pause(("expert_ids", s.pos), **routing)
                routing = {}
        if w.shared is not None:
            self.mlp(g, w.shared, x, T, out=out)
        if record is None:
            g.pause(("experts", s.pos), **routing)
        misses = record[1] if record is not None else g.empty((T, K), "int32", "expert_misses")
        self.streamed_experts(g, s, x, ids, wts, out, misses, accumulate=int(w.shared is not None))
        return out

    @staticmethod
    def streamed_experts(g, s, x, ids, wts, out, misses, accumulate: int, **extra) -> None:
        """moe_experts over an expert cache's slot descriptors, through its table on the device
        (expert_map, ABI 1.5); a pair whose expert is absent is skipped and flagged in misses."""
        g.moe_experts(x=x, topk_ids=ids, topk_weights=wts, num_experts=len(s.w_gate), accumulate=accumulate,
                      w_gate=s.w_gate, w_up=s.w_up, w_down=s.w_down, out=out, expert_map=s.expert_map,
                      misses=misses, **extra)

    def moe_expert_parallel(self, g, w: MoEWeights, x, T, ids, wts, out) -> Tensor:
        """The routed experts spread over the ranks (rank r holds experts [r * Er, (r + 1) * Er)).

        Every rank holds all T tokens (attention is replicated or all-reduced), so each sends only
        its slice of Ts = ceil(T / N) tokens: moe_dispatch packs a row per (token, owning rank),
        all_to_all carries the rows (with counts) and their local ids and weights (whole slots: the
        padding rows say -1), moe_experts runs this rank's experts on what arrived, all_to_all sends
        the outputs back and moe_combine sums each token's parts. The slices' results are then
        put together: added into the shared experts' partial sums before their all_reduce (tensor
        parallel), or all-gathered (replicated attention, or no shared experts)."""
        c, par, dt = self.cfg, self.par, self.dtype
        N, H, K = par.world, c.hidden_size, c.num_experts_per_tok
        Er = len(w.experts_gate)
        Ts = -(-T // N)
        s0 = min(par.rank * Ts, T)
        Tr = min(Ts, T - s0)          # this rank's tokens (0 for a trailing rank of a small batch)
        send_x = g.empty((N, Ts, H), dt, "ep_send_x")
        send_ids = g.empty((N, Ts, K), "int32", "ep_send_ids")
        send_w = g.empty((N, Ts, K), "f32", "ep_send_weights")
        counts = g.empty((N,), "int32", "ep_send_counts")
        route = g.empty((Tr, N), "int32", "ep_route")
        g.moe_dispatch(x=x.narrow(0, s0, Tr), topk_ids=ids.narrow(0, s0, Tr), topk_weights=wts.narrow(0, s0, Tr),
                       send_x=send_x, send_ids=send_ids, send_weights=send_w, send_counts=counts, route=route,
                       experts_per_rank=Er)
        recv_x = g.empty((N, Ts, H), dt, "ep_recv_x")
        recv_ids = g.empty((N, Ts, K), "int32", "ep_recv_ids")
        recv_w = g.empty((N, Ts, K), "f32", "ep_recv_weights")
        recv_counts = g.empty((N,), "int32", "ep_recv_counts")
        g.all_to_all(comm=par.comm, send=send_x, recv=recv_x, send_counts=counts, recv_counts=recv_counts)
        g.all_to_all(comm=par.comm, send=send_ids, recv=recv_ids)
        g.all_to_all(comm=par.comm, send=send_w, recv=recv_w)
        y = g.empty((N, Ts, H), dt, "ep_expert_out")
        g.moe_experts(x=recv_x.view(N * Ts, H), topk_ids=recv_ids.view(N * Ts, K),
                      topk_weights=recv_w.view(N * Ts, K), num_experts=Er, accumulate=0,
                      w_gate=w.experts_gate, w_up=w.experts_up, w_down=w.experts_down, out=y.view(N * Ts, H))
        back = g.empty((N, Ts, H), dt, "ep_back")
        back_counts = g.empty((N,), "int32", "ep_back_counts")
        g.all_to_all(comm=par.comm, send=y, recv=back, send_counts=recv_counts, recv_counts=back_counts)
        if self.tp > 1 and w.shared is not None:
            # the shared experts' partial sums plus, on this rank's slice, the routed result: one all_reduce
            self.mlp(g, w.shared, x, T, out=out, reduce=False)
            g.moe_combine(back=back, route=route, out=out.narrow(0, s0, Tr), accumulate=1)
            self.all_reduce(g, out)
            return out
        mine = g.empty((Ts, H), dt, "ep_mine")
        g.moe_combine(back=back, route=route, out=mine.narrow(0, 0, Tr), accumulate=0)
        every = g.empty((N, Ts, H), dt, "ep_gathered")
        g.all_gather(comm=par.comm, x=mine, out=every)
        routed = every.view(N * Ts, H).narrow(0, 0, T)      # token t sits at row t
        if w.shared is None:
            return routed
        self.mlp(g, w.shared, x, T, out=out)                # all-reduced when tensor parallel
        g.add(a=out, b=routed, out=out)
        return out

    def block(self, g, w: LayerWeights, resid, delta, meta: StepInputs,
              next_layer: Optional[LayerWeights] = None) -> Tensor:
        """One decoder layer; `resid` is updated in place, the layer's MLP output is returned.
        `next_layer`: the following layer, whose router may predict its experts (streamed experts)."""
        c, T = self.cfg, meta.T
        n = g.empty((T, c.hidden_size), self.dtype, "norm")
        if delta is None:
            g.rmsnorm(x=resid, weight=w.ln1, out=n, eps=c.rms_norm_eps)
        else:
            g.rmsnorm(x=delta, residual=resid, residual_out=resid, weight=w.ln1, out=n, eps=c.rms_norm_eps)
        a = self.attention(g, w.attn, self.caches[w.index], n, meta)
        n2 = g.empty((T, c.hidden_size), self.dtype, "norm")
        g.rmsnorm(x=a, residual=resid, residual_out=resid, weight=w.ln2, out=n2, eps=c.rms_norm_eps)
        return self.moe(g, w.moe, n2, T, resid, next_layer) if w.moe is not None else self.mlp(g, w.mlp, n2, T)

    def head(self, g, norm_w, resid, delta, head_w, meta: StepInputs, hidden_out=None, name: str = "logits"):
        """Final norm of (resid + delta), then f32 logits of the wanted rows (plan output `name`)."""
        c, T = self.cfg, meta.T
        n = hidden_out if hidden_out is not None else g.empty((T, c.hidden_size), self.dtype, "final_norm")
        g.rmsnorm(x=delta, residual=resid, residual_out=resid, weight=norm_w, out=n, eps=c.rms_norm_eps)
        return head_logits(g, n, head_w, meta, c.vocab_size, name)

    def forward(self, g, meta: StepInputs, hidden_out: Optional[Tensor] = None) -> Tensor:
        """The main model; `hidden_out` [T, H] receives the final-normed hidden states (for MTP).
        Returns the logits (plan output "logits")."""
        w = self.w
        x = g.empty((meta.T, self.cfg.hidden_size), self.dtype, "residual")
        g.embedding(ids=meta.ids, table=w.embed, out=x)
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
        c, m, T, H = self.cfg, self.w.mtp, meta.T, self.cfg.hidden_size
        e = g.empty((T, H), self.dtype, "mtp_embed")
        g.embedding(ids=meta.ids, table=m.embed, out=e)
        g.rmsnorm(x=e, weight=m.enorm, out=e, eps=c.rms_norm_eps)
        hn = g.empty((T, H), self.dtype, "mtp_hnorm")
        g.rmsnorm(x=hidden, weight=m.hnorm, out=hn, eps=c.rms_norm_eps)
        cat = g.empty((T, 2 * H), self.dtype, "mtp_cat")
        g.concat(a=e, b=hn, out=cat)
        x = g.empty((T, H), self.dtype, "residual")
        self.linear(g, cat, m.eh_proj, x)
        delta = self.block(g, m.layer, x, None, meta)
        return self.head(g, m.head_norm, x, delta, m.head, meta, hidden_out, name)

    def verify_and_draft(self, g, meta: StepInputs, hidden: Tensor, mtp_hidden: Tensor,
                         draft_table: Optional[Tensor]) -> None:
        """One speculative decoding step (engine.speculative), traced as one plan: every row is a
        position of some sequence (its last token, then the drafts under test).

            logits = main model (all rows)                       -> hidden [T, H]
            out, accepted = spec_verify(logits, drafts)          out[t]: the token at position t + 1
            draft logits = MTP(hidden, ids = out)                -> mtp_hidden [T, H]
            next drafts, their probabilities = sample(draft logits)

        The MTP's next token at a row is exactly spec_verify's out there: for an accepted draft
        the draft itself, at the first rejected row the correction, after the last draft the bonus
        token. Rows past a sequence's first rejection compute what nobody reads, and their cache
        writes (main and MTP layer) sit past the sequence's new length, where the next step writes
        first. So the draft for each sequence's next step is the sample at row
        (first row + accepted drafts), with no host round trip inside the step.
        draft_table: the previous step's draft logits [rows, V] (f32), gathered per row by the
        input "draft_src" as spec_verify's draft_logits (sampled rows); None: greedy drafts only."""
        T, V = meta.T, self.cfg.vocab_size
        logits = self.forward(g, meta, hidden)
        q = None
        if draft_table is not None:
            q = g.empty((T, V), "f32", "draft_q")
            g.embedding(ids=g.input("draft_src", (T,)), table=draft_table, out=q)
        out = g.empty((T,), "int32", "verified")
        acc = g.empty((T,), "int32", "accepted")
        # a row's sampling parameters are its request's, for the verification and the next draft alike
        params = dict(temperature=g.input("temperature", (T,), "f32"), top_k=g.input("top_k", (T,)),
                      top_p=g.input("top_p", (T,), "f32"))
        g.spec_verify(logits=logits, draft_logits=q, draft_ids=g.input("draft_ids", (T,)),
                      seeds=g.input("seeds", (T,), "uint64"), out=out, accepted=acc, **params)
        dl = self.mtp(g, replace(meta, ids=out, last_idx=None), hidden, mtp_hidden, "draft_logits")
        dtok = g.empty((T,), "int32", "draft_tokens")
        dprob = g.empty((T,), "f32", "draft_probs")
        g.sample(logits=dl, seeds=g.input("draft_seeds", (T,), "uint64"), out=dtok, probs=dprob, **params)
        for name, t in (("verified", out), ("accepted", acc), ("draft_tokens", dtok), ("draft_probs", dprob)):
            g.output(name, t)
