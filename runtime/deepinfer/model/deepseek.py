"""The DeepSeek V2 / V3 model graph, every computation an op of the Backend.

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
with e_score_correction_bias), shared experts first, then routed experts accumulated on top.

MTP (V3's extra layer L = num_hidden_layers): h' = eh_proj([enorm(embed(next_tokens)) ; hnorm(h)]),
one decoder block with its own cache layer, then shared_head.norm and shared_head.head. `h` is the
main model's final-normed hidden state (as vLLM and SGLang feed it).

Differences from transformers we chose: the group mask of group-limited routing is -inf (as in
DeepSeek's model.py and transformers' V3); transformers' V2 uses 0.0, which only matters when
top_k exceeds the experts of the kept groups. `norm_topk_prob` is honoured for V2 configs (as in
DeepSeek's own V2 code; transformers' V2 ignores it).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np

from .. import abi
from .. import quant_formats as QF
from ..errors import CheckpointError
from ..tensor import Quant, Tensor
from .checkpoint import Checkpoint
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .plan import Arena, Plan, Tracer

ROPE_NONE, ROPE_YARN = abi.const("DI_ROPE_NONE"), abi.const("DI_ROPE_YARN")
SCORING = {"softmax": abi.const("DI_SCORING_SOFTMAX"), "sigmoid": abi.const("DI_SCORING_SIGMOID")}
GROUP_MAX, GROUP_SUM_TOP2 = abi.const("DI_GROUP_SCORE_MAX"), abi.const("DI_GROUP_SCORE_SUM_TOP2")
MAX_CACHED_PLANS = 64
PRECISIONS = (None,) + tuple(QF.PRECISION_PATHS)


@dataclass
class SeqInput:
    """One sequence of a step: its id, its new tokens and the position of the first of them."""

    seq_id: int
    tokens: Sequence[int]
    start: int = 0


class DeepseekModel:
    """A loaded DeepSeek model bound to one backend, with its paged KV cache and execution plans.

    forward() runs one step for a batch of sequences and returns f32 logits [S, V] of each sequence's
    last token (all tokens' with all_logits=True). The returned Tensor is valid until the next call.
    """

    def __init__(self, checkpoint, backend, *, max_batch: int = 8, max_seq_len: Optional[int] = None,
                 num_cache_blocks: Optional[int] = None, block_size: int = 16, dtype: str = "f32",
                 load_mtp: bool = True, precision: Optional[str] = None, group_size: int = 64):
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"activation dtype must be 'f32' or 'bf16', not {dtype!r}")
        self.ckpt, self.cfg, self.backend, self.dtype = ckpt, ckpt.config, backend, dtype
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
        # weight format of the quantizable linears (None: as stored) and int8 activations for them
        self.precision = precision
        self.weight_format = QF.weight_format_of(precision)
        self.act_quant = precision is not None and QF.PRECISION_PATHS[precision].activations == "int8"
        self.group_size = int(group_size)
        c = self.cfg
        self.max_batch = int(max_batch)
        self.block_size = int(block_size)
        self.max_seq_len = int(max_seq_len or min(c.max_position_embeddings, 4096))
        self.max_blocks_per_seq = -(-self.max_seq_len // self.block_size)
        self.eos_token_id = c.eos_token_id
        self.bos_token_id = c.bos_token_id
        self.has_mtp = bool(load_mtp and c.has_mtp and f"model.layers.{c.num_hidden_layers}.eh_proj.weight" in ckpt)
        self._load_weights()
        n_cache_layers = c.num_hidden_layers + (1 if self.has_mtp else 0)
        nb = int(num_cache_blocks or self.max_batch * self.max_blocks_per_seq)
        self.kv = PagedKVCache(backend, n_cache_layers, nb, self.block_size, c.cache_width, dtype,
                               self.max_blocks_per_seq)
        self.arena = Arena(backend)
        self.plans: "OrderedDict[tuple, Plan]" = OrderedDict()
        self._hidden: Optional[Tensor] = None     # persistent final hidden states for the MTP head
        self.last_hidden: Optional[Tensor] = None
        self._sample_bufs: dict[int, dict] = {}
        self._ids = itertools.count()
        stored = c.quant_scheme.describe() if c.quant_scheme is not None else c.torch_dtype
        wq = f"{stored} weights" if precision is None else f"{precision} (from {stored})"
        self.precision_note = f"{wq}, {dtype} activations" + (", int8 per-token activations for int linears"
                                                              if self.act_quant else "")

    # ================================================================== weights
    def _w(self, name, shape):
        """A linear weight in the model's precision: as stored, dequantized to a float precision, or
        quantized at load with the backend's quantize op (projections, MLP and expert weights only)."""
        from .. import quant_formats as QF

        be, fmt = self.backend, self.weight_format
        if fmt is None or not QF.is_quantizable(name, shape):
            t = self.ckpt.weight(name, shape, self.dtype)
            if t.quant is not None and not QF.is_quantizable(name, shape) and fmt is not None:
                return self._dequantized(be.upload(t), self.dtype)
            return be.upload(t)
        t = self.ckpt.weight(name, shape)
        if fmt in ("f32", "bf16"):
            # float precisions keep these weights in that dtype (activations may differ)
            return self._dequantized(be.upload(t), fmt) if t.quant is not None else be.upload(
                self.ckpt.weight(name, shape, fmt))
        qdt, block = {"int8": ("int8", (1, 0)), "int4": ("int4", (1, self.group_size)),
                      "fp8": ("e4m3", (128, 128))}[fmt]
        if t.quant is not None:
            if t.dtype.name == qdt and tuple(t.quant.block) == block:
                return be.upload(t)
            raise CheckpointError(f"{self.ckpt.file_of(name)}: {name!r} is stored as {t.quant.describe(t.dtype)}; "
                                  f"precision {self.precision} would re-quantize it (load it as stored, bf16 or f32)")
        N, K = shape
        grid = (-(-N // block[0]) if block[0] else 1, -(-K // block[1]) if block[1] else 1)
        q = be.empty((N, K), qdt)
        q.quant = Quant(be.empty(grid, "f32"), block)
        be.quantize(x=be.upload(t), out=q, scale_pow2=0)
        return q

    def _dequantized(self, t, dtype):
        out = self.backend.empty(t.shape, dtype)
        self.backend.dequantize(x=t, out=out)
        return out

    def _linear(self, g, x, w, out, bias=None):
        """linear, with x quantized to int8 per token first when the precision says so (w8a8 / w4a8)."""
        if self.act_quant and w.quant is not None and w.dtype.name in ("int8", "int4"):
            T, K = x.shape
            xq = g.empty((T, K), "int8", "x_int8")
            xq.quant = Quant(g.empty((T, 1), "f32", "x_scales"), (1, 0))
            g.quantize(x=x, out=xq, scale_pow2=0)
            x = xq
        g.linear(x=x, w=w, bias=bias, out=out)

    def _t(self, name, shape, dtype=None):
        return self.backend.upload(self.ckpt.tensor(name, shape, dtype or self.dtype))

    def _opt(self, name, shape, dtype=None):
        return self._t(name, shape, dtype) if name in self.ckpt else None

    def _load_weights(self) -> None:
        c, H = self.cfg, self.cfg.hidden_size
        self.embed = self._t("model.embed_tokens.weight", (c.vocab_size, H))
        self.norm = self._t("model.norm.weight", (H,))
        if "lm_head.weight" in self.ckpt:
            self.lm_head = self._w("lm_head.weight", (c.vocab_size, H))
        elif c.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            raise CheckpointError(f"{self.ckpt.dir}: tensor 'lm_head.weight' is missing from the checkpoint")
        self.layers = [self._load_layer(i) for i in range(c.num_hidden_layers)]
        self.mtp = None
        if self.has_mtp:
            L = c.num_hidden_layers
            p = f"model.layers.{L}."
            m = self._load_layer(L)
            m.enorm = self._t(p + "enorm.weight", (H,))
            m.hnorm = self._t(p + "hnorm.weight", (H,))
            m.eh_proj = self._w(p + "eh_proj.weight", (H, 2 * H))
            m.head_norm = self._t(p + "shared_head.norm.weight", (H,))
            m.head = (self._w(p + "shared_head.head.weight", (c.vocab_size, H))
                      if p + "shared_head.head.weight" in self.ckpt else self.lm_head)
            m.embed = (self._t(p + "embed_tokens.weight", (c.vocab_size, H))
                       if p + "embed_tokens.weight" in self.ckpt else self.embed)
            self.mtp = m

    def _load_layer(self, i: int) -> SimpleNamespace:
        c, H, NH = self.cfg, self.cfg.hidden_size, self.cfg.num_attention_heads
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w = SimpleNamespace(index=i)
        w.ln1 = self._t(p + "input_layernorm.weight", (H,))
        w.ln2 = self._t(p + "post_attention_layernorm.weight", (H,))
        if c.q_lora_rank:
            w.q_a = self._w(a + "q_a_proj.weight", (c.q_lora_rank, H))
            w.q_a_bias = self._opt(a + "q_a_proj.bias", (c.q_lora_rank,))
            w.q_a_norm = self._t(a + "q_a_layernorm.weight", (c.q_lora_rank,))
            w.q_b = self._w(a + "q_b_proj.weight", (NH * c.qk_head_dim, c.q_lora_rank))
        else:
            w.q = self._w(a + "q_proj.weight", (NH * c.qk_head_dim, H))
        w.kv_a = self._w(a + "kv_a_proj_with_mqa.weight", (c.cache_width, H))
        w.kv_a_bias = self._opt(a + "kv_a_proj_with_mqa.bias", (c.cache_width,))
        w.kv_a_norm = self._t(a + "kv_a_layernorm.weight", (c.kv_lora_rank,))
        w.kv_b = self._w(a + "kv_b_proj.weight", (NH * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        if w.kv_b.quant is not None:
            # mla_decode takes a plain kv_b: dequantize once, on the backend
            w.kv_b_dense = self._dequantized(w.kv_b, self.dtype)
        else:
            w.kv_b_dense = w.kv_b
        w.o = self._w(a + "o_proj.weight", (H, NH * c.v_head_dim))
        w.o_bias = self._opt(a + "o_proj.bias", (H,))
        m = p + "mlp."
        w.moe = c.is_moe_layer(i)
        if w.moe:
            E, I = c.n_routed_experts, c.moe_intermediate_size
            # the router runs in f32 like transformers (its weight is kept f32 there too)
            w.gate = self._t(m + "gate.weight", (E, H), "f32")
            w.gate_bias = (self._t(m + "gate.e_score_correction_bias", (E,), "f32")
                           if c.topk_method == "noaux_tc" else None)
            w.experts_gate = [self._w(f"{m}experts.{e}.gate_proj.weight", (I, H)) for e in range(E)]
            w.experts_up = [self._w(f"{m}experts.{e}.up_proj.weight", (I, H)) for e in range(E)]
            w.experts_down = [self._w(f"{m}experts.{e}.down_proj.weight", (H, I)) for e in range(E)]
            w.shared = None
            if c.n_shared_experts:
                Is = I * c.n_shared_experts
                s = m + "shared_experts."
                w.shared = SimpleNamespace(gate=self._w(s + "gate_proj.weight", (Is, H)),
                                           up=self._w(s + "up_proj.weight", (Is, H)),
                                           down=self._w(s + "down_proj.weight", (H, Is)))
        else:
            I = c.intermediate_size
            w.mlp = SimpleNamespace(gate=self._w(m + "gate_proj.weight", (I, H)),
                                    up=self._w(m + "up_proj.weight", (I, H)),
                                    down=self._w(m + "down_proj.weight", (H, I)))
        return w

    # ================================================================== graph pieces
    def _rope(self, g, x, positions):
        r = self.cfg.rope
        g.rope(x=x, positions=positions, out=x, interleaved=int(self.cfg.rope_interleave),
               scaling=ROPE_YARN if r.type == "yarn" else ROPE_NONE, theta=r.theta, factor=r.factor,
               original_max_position=r.original_max_position, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
               attn_factor=r.attn_factor)

    def _attention(self, g, w, x, meta) -> Tensor:
        c, T, dt = self.cfg, meta.T, self.dtype
        NH, Dn, Dr, Dv, Dc = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        q = g.empty((T, NH * c.qk_head_dim), dt, "q")
        if c.q_lora_rank:
            qa = g.empty((T, c.q_lora_rank), dt, "q_a")
            self._linear(g, x, w.q_a, qa, w.q_a_bias)
            g.rmsnorm(x=qa, weight=w.q_a_norm, out=qa, eps=c.rms_norm_eps)
            self._linear(g, qa, w.q_b, q)
        else:
            self._linear(g, x, w.q, q)
        q3 = q.view(T, NH, c.qk_head_dim)
        self._rope(g, q3.narrow(2, Dn, Dr), meta.positions)
        kva = g.empty((T, Dc + Dr), dt, "kv_a")
        self._linear(g, x, w.kv_a, kva, w.kv_a_bias)
        latent = g.empty((T, Dc), dt, "latent")
        g.rmsnorm(x=kva.narrow(1, 0, Dc), weight=w.kv_a_norm, out=latent, eps=c.rms_norm_eps)
        k_pe = kva.narrow(1, Dc, Dr)
        self._rope(g, k_pe, meta.positions)
        cache = self.kv.layers[w.index]
        g.mla_cache_write(latent=latent, k_pe=k_pe, slots=meta.slots, cache=cache)
        o = g.empty((T, NH, Dv), dt, "attn")
        if meta.mode == "prefill":
            kv = g.empty((T, NH * (Dn + Dv)), dt, "kv")
            self._linear(g, latent, w.kv_b, kv)
            g.mla_prefill(q=q3, kv=kv.view(T, NH, Dn + Dv), k_pe=k_pe, cu_seqlens=meta.cu_seqlens, out=o,
                          scale=c.softmax_scale)
        else:
            g.mla_decode(q=q3, wkv_b=w.kv_b_dense, cache=cache, block_table=meta.block_table,
                         token_seq=meta.token_seq, kv_len=meta.kv_len, out=o, scale=c.softmax_scale)
        out = g.empty((T, c.hidden_size), dt, "attn_out")
        self._linear(g, o.view(T, NH * Dv), w.o, out, w.o_bias)
        return out

    def _mlp(self, g, m, x, T, out=None) -> Tensor:
        I = m.gate.shape[0]
        gate = g.empty((T, I), self.dtype, "gate")
        up = g.empty((T, I), self.dtype, "up")
        self._linear(g, x, m.gate, gate)
        self._linear(g, x, m.up, up)
        g.silu_mul(gate=gate, up=up, out=gate)
        if out is None:
            out = g.empty((T, self.cfg.hidden_size), self.dtype, "mlp_out")
        self._linear(g, gate, m.down, out)
        return out

    def _moe(self, g, w, x, T) -> Tensor:
        c = self.cfg
        E, K = c.n_routed_experts, c.num_experts_per_tok
        logits = g.empty((T, E), "f32", "router_logits")
        g.linear(x=x, w=w.gate, out=logits)
        ids = g.empty((T, K), "int32", "topk_ids")
        wts = g.empty((T, K), "f32", "topk_weights")
        grouped = c.topk_method in ("group_limited_greedy", "noaux_tc") and c.n_group > 1
        g.moe_router(logits=logits, bias=w.gate_bias, topk_ids=ids, topk_weights=wts,
                     scoring=SCORING[c.scoring_func], n_group=c.n_group if grouped else 1,
                     topk_group=c.topk_group if grouped else 1,
                     group_score=GROUP_SUM_TOP2 if c.topk_method == "noaux_tc" else GROUP_MAX,
                     norm_topk_prob=int(bool(c.norm_topk_prob) and K > 1),
                     routed_scaling_factor=c.routed_scaling_factor)
        out = g.empty((T, c.hidden_size), self.dtype, "moe_out")
        if w.shared is not None:
            self._mlp(g, w.shared, x, T, out=out)
        g.moe_experts(x=x, topk_ids=ids, topk_weights=wts, num_experts=E, accumulate=int(w.shared is not None),
                      w_gate=w.experts_gate, w_up=w.experts_up, w_down=w.experts_down, out=out)
        return out

    def _block(self, g, w, resid, delta, meta) -> Tensor:
        """One decoder layer; `resid` is updated in place, the layer's MLP output is returned."""
        c, T = self.cfg, meta.T
        n = g.empty((T, c.hidden_size), self.dtype, "norm")
        if delta is None:
            g.rmsnorm(x=resid, weight=w.ln1, out=n, eps=c.rms_norm_eps)
        else:
            g.rmsnorm(x=delta, residual=resid, residual_out=resid, weight=w.ln1, out=n, eps=c.rms_norm_eps)
        a = self._attention(g, w, n, meta)
        n2 = g.empty((T, c.hidden_size), self.dtype, "norm")
        g.rmsnorm(x=a, residual=resid, residual_out=resid, weight=w.ln2, out=n2, eps=c.rms_norm_eps)
        return self._moe(g, w, n2, T) if w.moe else self._mlp(g, w.mlp, n2, T)

    def _inputs(self, g, mode, T, S, all_logits):
        meta = SimpleNamespace(mode=mode, T=T, S=S)
        meta.ids = g.input("ids", (T,))
        meta.positions = g.input("positions", (T,))
        meta.slots = g.input("slots", (T,))
        if mode == "prefill":
            meta.cu_seqlens = g.input("cu_seqlens", (S + 1,))
        else:
            meta.block_table = g.input("block_table", (S, self.max_blocks_per_seq))
            meta.token_seq = g.input("token_seq", (T,))
            meta.kv_len = g.input("kv_len", (T,))
        meta.last_idx = None if all_logits else g.input("last_idx", (S,))
        return meta

    def _head(self, g, norm_w, resid, delta, head_w, meta, hidden_out=None):
        """Final norm of (resid + delta), then f32 logits of the wanted rows."""
        c, T = self.cfg, meta.T
        n = hidden_out if hidden_out is not None else g.empty((T, c.hidden_size), self.dtype, "final_norm")
        g.rmsnorm(x=delta, residual=resid, residual_out=resid, weight=norm_w, out=n, eps=c.rms_norm_eps)
        rows = n
        if meta.last_idx is not None:
            # the embedding op is a row gather: the last token of each sequence
            rows = g.empty((meta.S, c.hidden_size), self.dtype, "last_hidden")
            g.embedding(ids=meta.last_idx, table=n, out=rows)
        logits = g.empty((rows.shape[0], c.vocab_size), "f32", "logits")
        g.linear(x=rows, w=head_w, out=logits)
        g.output("logits", logits)

    def _trace_main(self, g, mode, T, S, all_logits, keep_hidden):
        c = self.cfg
        meta = self._inputs(g, mode, T, S, all_logits)
        x = g.empty((T, c.hidden_size), self.dtype, "residual")
        g.embedding(ids=meta.ids, table=self.embed, out=x)
        delta = None
        for w in self.layers:
            delta = self._block(g, w, x, delta, meta)
        hidden_out = self._hidden_store(T).narrow(0, 0, T) if keep_hidden else None
        self._head(g, self.norm, x, delta, self.lm_head, meta, hidden_out)

    def _trace_mtp(self, g, mode, T, S, all_logits):
        c, m, H = self.cfg, self.mtp, self.cfg.hidden_size
        meta = self._inputs(g, mode, T, S, all_logits)
        e = g.empty((T, H), self.dtype, "mtp_embed")
        g.embedding(ids=meta.ids, table=m.embed, out=e)
        g.rmsnorm(x=e, weight=m.enorm, out=e, eps=c.rms_norm_eps)
        hn = g.empty((T, H), self.dtype, "mtp_hnorm")
        g.rmsnorm(x=self._hidden.narrow(0, 0, T), weight=m.hnorm, out=hn, eps=c.rms_norm_eps)
        cat = g.empty((T, 2 * H), self.dtype, "mtp_cat")
        g.concat(a=e, b=hn, out=cat)
        x = g.empty((T, H), self.dtype, "residual")
        self._linear(g, cat, m.eh_proj, x)
        delta = self._block(g, m, x, None, meta)
        self._head(g, m.head_norm, x, delta, m.head, meta)

    def _hidden_store(self, T: int) -> Tensor:
        if self._hidden is None or self._hidden.shape[0] < T:
            n = max(T, 2 * self.max_batch, 64 if self._hidden is None else 2 * self._hidden.shape[0])
            self._hidden = self.backend.empty((n, self.cfg.hidden_size), self.dtype)
            # plans bound to the old store must be traced again
            self.plans = OrderedDict((k, p) for k, p in self.plans.items() if not (k[-1] or k[0] == "mtp"))
        return self._hidden

    # ================================================================== plans
    def plan(self, kind: str, mode: str, T: int, S: int, all_logits: bool = False, keep_hidden: bool = False) -> Plan:
        key = (kind, mode, T, S, all_logits, keep_hidden)
        p = self.plans.get(key)
        if p is None:
            if keep_hidden or kind == "mtp":
                self._hidden_store(T)
            g = Tracer(self.backend)
            if kind == "main":
                self._trace_main(g, mode, T, S, all_logits, keep_hidden)
            else:
                self._trace_mtp(g, mode, T, S, all_logits)
            p = Plan.from_tracer(key, g)
            self.plans[key] = p
            while len(self.plans) > MAX_CACHED_PLANS:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        self.arena.ensure(p.arena_bytes)
        p.bind(self.arena, self.backend)
        return p

    # ================================================================== running
    def new_sequence(self) -> int:
        return next(self._ids)

    def free(self, seq_id: int) -> None:
        self.kv.free(seq_id)

    def _normalize(self, batch, tokens, starts) -> list[SeqInput]:
        if tokens is None:
            seqs = [b if isinstance(b, SeqInput) else SeqInput(*b) for b in batch]
        else:
            if starts is None:
                starts = [self.kv.length(s) for s in batch]
            if not (len(batch) == len(tokens) == len(starts)):
                raise ValueError("seq_ids, tokens and starts must have the same length")
            seqs = [SeqInput(s, t, p) for s, t, p in zip(batch, tokens, starts)]
        if not seqs:
            raise ValueError("forward() needs at least one sequence")
        if len(seqs) > self.max_batch:
            raise ValueError(f"{len(seqs)} sequences > max_batch {self.max_batch}")
        V = self.cfg.vocab_size
        seen = set()
        for s in seqs:
            if s.seq_id in seen:
                raise ValueError(f"sequence {s.seq_id} appears twice in one batch")
            seen.add(s.seq_id)
            if len(s.tokens) == 0:
                raise ValueError(f"sequence {s.seq_id} has no new tokens")
            if s.start < 0 or s.start > self.kv.length(s.seq_id):
                raise ValueError(f"sequence {s.seq_id} starts at {s.start} but only {self.kv.length(s.seq_id)} "
                                 "positions are cached")
            bad = [t for t in s.tokens if not 0 <= int(t) < V]
            if bad:
                raise ValueError(f"sequence {s.seq_id}: token id {bad[0]} outside the vocabulary [0, {V})")
        return seqs

    def _fill(self, p: Plan, seqs: list[SeqInput], mode: str) -> None:
        ids, pos, slots, tseq, kvl, last, cu = [], [], [], [], [], [], [0]
        for r, s in enumerate(seqs):
            n = len(s.tokens)
            ps = range(s.start, s.start + n)
            ids.extend(int(t) for t in s.tokens)
            pos.extend(ps)
            slots.extend(self.kv.slots(s.seq_id, ps))
            tseq.extend([r] * n)
            kvl.extend(q + 1 for q in ps)
            cu.append(cu[-1] + n)
            last.append(cu[-1] - 1)
        p.host_input("ids")[:] = ids
        p.host_input("positions")[:] = pos
        p.host_input("slots")[:] = slots
        if mode == "prefill":
            p.host_input("cu_seqlens")[:] = cu
        else:
            self.kv.block_table([s.seq_id for s in seqs], p.host_input("block_table"))
            p.host_input("token_seq")[:] = tseq
            p.host_input("kv_len")[:] = kvl
        if "last_idx" in p.inputs:
            p.host_input("last_idx")[:] = last

    def forward(self, batch, tokens=None, starts=None, *, all_logits: bool = False,
                keep_hidden: bool = False) -> Tensor:
        """One step. Either forward([SeqInput | (seq_id, tokens, start)]) or
        forward(seq_ids, tokens_per_seq, starts). Returns f32 logits [S, V] (or [T, V] with
        all_logits), a view valid until the next call. keep_hidden keeps the final hidden states
        (model.last_hidden) for mtp_logits."""
        seqs = self._normalize(batch, tokens, starts)
        for s in seqs:
            self.kv.reserve(s.seq_id, s.start + len(s.tokens))
        mode = "prefill" if all(s.start == 0 for s in seqs) else "decode"
        T = sum(len(s.tokens) for s in seqs)
        p = self.plan("main", mode, T, len(seqs), all_logits, keep_hidden)
        self._fill(p, seqs, mode)
        p.run(self.backend)
        for s in seqs:
            self.kv.set_length(s.seq_id, s.start + len(s.tokens))
        self.last_hidden = self._hidden.narrow(0, 0, T) if keep_hidden else None
        self._last_layout = [(s.seq_id, len(s.tokens), s.start) for s in seqs] if keep_hidden else None
        return p.bound_outputs["logits"]

    def mtp_logits(self, batch, next_tokens=None, starts=None, *, all_logits: bool = False) -> Tensor:
        """Draft logits of the MTP head for the step just run with keep_hidden=True.

        For each sequence give the tokens that follow the previous step's tokens (the previous
        step's tokens shifted left by one, then the token sampled from its logits), same count and
        same start. Logits at position i predict the token at i + 2. The MTP layer keeps its own
        cache, written here, so call it after every step whose draft you want."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers = 0 or weights absent)")
        if self.last_hidden is None:
            raise RuntimeError("mtp_logits needs the hidden states of a forward(..., keep_hidden=True) call")
        seqs = self._normalize_mtp(batch, next_tokens, starts)
        layout = [(s.seq_id, len(s.tokens), s.start) for s in seqs]
        if layout != self._last_layout:
            raise ValueError(f"mtp_logits batch {layout} must match the last forward's {self._last_layout}")
        mode = "prefill" if all(s.start == 0 for s in seqs) else "decode"
        T = sum(len(s.tokens) for s in seqs)
        p = self.plan("mtp", mode, T, len(seqs), all_logits, False)
        self._fill(p, seqs, mode)
        p.run(self.backend)
        return p.bound_outputs["logits"]

    def score(self, ids: Sequence[int], chunk: int = 256) -> np.ndarray:
        """Logits of every position of one token sequence, as a host f32 array [len, V]
        (perplexity); long inputs run as chunked prefill through the cache."""
        sid = self.new_sequence()
        rows = []
        try:
            for s in range(0, len(ids), chunk):
                part = list(ids[s:s + chunk])
                rows.append(self.backend.to_numpy(self.forward([(sid, part, s)], all_logits=True)))
        finally:
            self.free(sid)
        return np.concatenate(rows) if rows else np.zeros((0, self.cfg.vocab_size), np.float32)

    def _normalize_mtp(self, batch, tokens, starts):
        if tokens is None:
            return [b if isinstance(b, SeqInput) else SeqInput(*b) for b in batch]
        if starts is None:
            starts = [st for (_, _, st) in self._last_layout]
        return [SeqInput(s, t, p) for s, t, p in zip(batch, tokens, starts)]

    def sample(self, logits: Tensor, temperature, top_k=None, top_p=None, seeds=None) -> list[int]:
        """One token per row of logits through the backend's sample op."""
        B = logits.shape[0]
        bufs = self._sample_bufs.get(B)
        if bufs is None:
            be = self.backend
            bufs = {"temperature": be.empty((B,), "f32"), "top_k": be.empty((B,), "int32"),
                    "top_p": be.empty((B,), "f32"), "seeds": be.empty((B,), "uint64"), "out": be.empty((B,), "int32")}
            self._sample_bufs[B] = bufs
        vals = {"temperature": np.asarray(temperature, np.float32),
                "top_k": np.asarray(top_k if top_k is not None else [0] * B, np.int32),
                "top_p": np.asarray(top_p if top_p is not None else [1.0] * B, np.float32),
                "seeds": np.asarray(seeds if seeds is not None else [0] * B, np.uint64)}
        for k, v in vals.items():
            self.backend.write(bufs[k], v.reshape(B))
        self.backend.sample(logits=logits, out=bufs["out"], **{k: bufs[k] for k in vals})
        return [int(t) for t in self.backend.to_numpy(bufs["out"])]

    # ================================================================== reporting
    def memory_report(self) -> dict:
        return {
            "kv_cache_bytes": self.kv.nbytes,
            "arena_bytes": self.arena.nbytes,
            "plans": {str(k): {"arena_bytes": p.arena_bytes, "total_activation_bytes": p.total_activation_bytes,
                               "ops": len(p.calls)} for k, p in self.plans.items()},
        }
