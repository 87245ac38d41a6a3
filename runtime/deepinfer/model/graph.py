"""What every DeepSeek family's traced model shares: the step's inputs, the linear / MLP / router /
head pieces, the MoE layer (its experts run by a strategy of model.moe_strategy), the collectives
of a split model and the speculative step.

A family's graph (model.deepseek: V2 / V3 / V3.2, model.deepseek_v4: V4) is a subclass that adds
its attention and its block (MLA with a plain residual, or V4's hyper-connections) and says how
its router and experts are parameterized (router_options, expert_options, swiglu_limit). A graph
only describes one step of T tokens of S sequences, traced onto a Tracer (model.plan); it owns no
state: the runner (engine.model_runner) owns the caches, the plans, the arena and the inputs, and
sets `block_size`, `par` and `caches` on it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .. import abi
from ..tensor import Quant, Tensor
from .config import ModelConfig, RopeConfig
from .moe_strategy import experts_for
from .weights import MLPWeights, MoEWeights

ROPE_NONE, ROPE_YARN = abi.const("DI_ROPE_NONE"), abi.const("DI_ROPE_YARN")
# fused ops (ABI 1.6) a graph runs in place of the ops they stand for, where the backend has them
FUSED_OPS = ("mla_rope_cache_write",)


def native_fused_ops(backend) -> frozenset:
    """The fused ops the backend's own library implements. A FallbackBackend's reference copy does not
    count: running the fused op there would only be slower than the primary's unfused ops."""
    primary = getattr(backend, "primary", backend)
    return frozenset(op for op in FUSED_OPS if primary.has_op(op))


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


class ModelGraph:
    """The pieces every family's graph uses; a subclass adds attention, its block, forward and mtp."""

    prefill_mode = True      # fresh sequences may run the un-cached prefill path (mla_prefill)
    swiglu_limit = 0.0       # > 0: the MLPs clip gate and up first (V4)
    expert_options: dict = {}    # extra keyword arguments of the routed experts' moe_experts

    def __init__(self, cfg: ModelConfig, weights, caches: list, dtype: str, act_quant: bool):
        self.cfg, self.w, self.caches, self.dtype = cfg, weights, caches, dtype
        self.act_quant = act_quant      # int8 per-token activations for int8/int4 linears (w8a8, w4a8)
        self.block_size = None          # tokens per cache block (set by the runner with the caches)
        # parallel.group.ParallelGroup of a split model, or None: this rank's cfg has NH / tp heads and
        # its MLPs I / tp, and each sublayer's partial output is all-reduced (set by the runner)
        self.par = None
        # the fused ops (FUSED_OPS) to use instead of their unfused ops (set by the runner)
        self.fused_ops: frozenset = frozenset()

    # ------------------------------------------------------------------ a split model
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

    # ------------------------------------------------------------------ small pieces
    def linear(self, g, x, w, out, bias=None) -> None:
        linear(g, x, w, out, self.act_quant, bias)

    def proj(self, g, x, w, name: str, bias=None) -> Tensor:
        """x @ w.T (+ bias) into a new activation `name` [T, rows of w]."""
        out = g.empty((x.shape[0], w.shape[0]), self.dtype, name)
        self.linear(g, x, w, out, bias)
        return out

    def norm(self, g, x, weight, name: str = "norm", residual=None, out=None) -> Tensor:
        """rmsnorm(x) * weight into a new activation `name` (or into `out`, which may be x). With
        `residual`: residual += x first, in place, and the sum is normed (a pre-norm block's
        residual add, fused)."""
        out = g.empty(x.shape, self.dtype, name) if out is None else out
        add = {} if residual is None else dict(residual=residual, residual_out=residual)
        g.rmsnorm(x=x, weight=weight, out=out, eps=self.cfg.rms_norm_eps, **add)
        return out

    def embed(self, g, ids, table, name: str, dtype: Optional[str] = None) -> Tensor:
        """The rows `ids` of `table` (a gather: the embedding op) into a new activation `name`."""
        out = g.empty((ids.shape[0], table.shape[1]), dtype or self.dtype, name)
        g.embedding(ids=ids, table=table, out=out)
        return out

    def rope(self, g, x, positions, r: Optional[RopeConfig] = None, interleaved: Optional[int] = None) -> None:
        """Rotary embedding of x in place (default: the model's rope and pair layout)."""
        g.rope(x=x, positions=positions, out=x, **self.rope_fields(r, interleaved))

    def rope_fields(self, r: Optional[RopeConfig] = None, interleaved: Optional[int] = None) -> dict:
        """The rope scalars of an args struct (DI_RopeArgs' and the fused ops' that rotate)."""
        r = self.cfg.rope if r is None else r
        return dict(interleaved=int(self.cfg.rope_interleave) if interleaved is None else interleaved,
                    scaling=ROPE_YARN if r.type == "yarn" else ROPE_NONE, theta=r.theta, factor=r.factor,
                    original_max_position=r.original_max_position, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                    attn_factor=r.attn_factor)

    # ------------------------------------------------------------------ MLP and MoE
    def mlp(self, g, m: MLPWeights, x, T, out=None, reduce: bool = True) -> Tensor:
        """A dense MLP; under tensor parallelism each rank's I / tp columns give a partial sum,
        all-reduced here unless the caller adds more partial sums first (reduce=False)."""
        if out is None:
            out = g.empty((T, self.cfg.hidden_size), self.dtype, "mlp_out")
        mlp(g, m, x, out, self.dtype, self.act_quant, self.swiglu_limit)
        if reduce:
            self.all_reduce(g, out)
        return out

    def router_options(self, w: MoEWeights, meta: StepInputs) -> dict:
        """moe_router's scoring and selection arguments (the family's)."""
        raise NotImplementedError

    def route(self, g, w: MoEWeights, x, meta: StepInputs, name: str = "topk", ids=None, wts=None):
        """Router logits in f32, then moe_router: (topk_ids, topk_weights) [T, K] (ids, wts: where
        they go, default new tensors)."""
        T, E, K = meta.T, self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        logits = g.empty((T, E), "f32", "router_logits")
        g.linear(x=x, w=w.gate, out=logits)
        if ids is None:
            ids = g.empty((T, K), "int32", f"{name}_ids")
        if wts is None:
            wts = g.empty((T, K), "f32", f"{name}_weights")
        g.moe_router(logits=logits, bias=w.gate_bias, topk_ids=ids, topk_weights=wts,
                     **self.router_options(w, meta))
        return ids, wts

    def moe(self, g, w: MoEWeights, x, meta: StepInputs, predict=None, experts=None) -> Tensor:
        """The shared experts plus the routed experts on x [T, H]: routed here, run by the layer's
        strategy (model.moe_strategy; `experts`: one already chosen). predict: traces the next
        layer's router and returns its ids, for a strategy that prefetches."""
        experts = experts_for(self, w) if experts is None else experts
        into_ids, into_wts = experts.route_into(g, meta.T)
        ids, wts = self.route(g, w, x, meta, ids=into_ids, wts=into_wts)
        out = g.empty((meta.T, self.cfg.hidden_size), self.dtype, "moe_out")
        return experts(g, x, ids, wts, out, predict)

    # ------------------------------------------------------------------ the head
    def logits(self, g, n, head_w, meta: StepInputs, name: str = "logits") -> Tensor:
        """f32 logits (plan output `name`) of the final-normed hidden states n [T, H]: every row, or
        the last token of each sequence (meta.last_idx)."""
        rows = n if meta.last_idx is None else self.embed(g, meta.last_idx, n, "last_hidden")
        logits = g.empty((rows.shape[0], self.cfg.vocab_size), "f32", name)
        g.linear(x=rows, w=head_w, out=logits)
        g.output(name, logits)
        return logits

    # ------------------------------------------------------------------ the step
    def forward(self, g, meta: StepInputs, hidden_out: Optional[Tensor] = None) -> Tensor:
        raise NotImplementedError

    def mtp(self, g, meta: StepInputs, hidden: Tensor, hidden_out: Optional[Tensor] = None,
            name: str = "logits") -> Tensor:
        raise NotImplementedError

    def verify_and_draft(self, g, meta: StepInputs, hidden: Tensor, mtp_hidden: Tensor,
                         draft_table: Optional[Tensor]) -> None:
        """One speculative decoding step (engine.speculative), traced as one plan: every row is a
        position of some sequence (its last token, then the drafts under test).

            logits = main model (all rows)                       -> hidden [T, width]
            out, accepted = spec_verify(logits, drafts)          out[t]: the token at position t + 1
            draft logits = MTP(hidden, ids = out)                -> mtp_hidden [T, width]
            next drafts, their probabilities = sample(draft logits)

        The MTP's next token at a row is exactly spec_verify's out there: for an accepted draft
        the draft itself, at the first rejected row the correction, after the last draft the bonus
        token. Rows past a sequence's first rejection compute what nobody reads, and their cache
        writes (main and MTP layer) sit past the sequence's new length, where the next step writes
        first. So the draft for each sequence's next step is the sample at row
        (first row + accepted drafts), with no host round trip inside the step.
        draft_table: the previous step's draft logits [rows, V] (f32), gathered per row by the
        input "draft_src" as spec_verify's draft_logits (sampled rows); None: greedy drafts only."""
        T = meta.T
        logits = self.forward(g, meta, hidden)
        q = None
        if draft_table is not None:
            q = g.empty((T, self.cfg.vocab_size), "f32", "draft_q")
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
