"""How a MoE layer's routed experts run: one strategy object per layer and step, chosen from where the
experts live, so that the model code only asks for "the routed experts on x".

The graph routes (router logits, moe_router), allocates the layer's output and hands both to the
strategy, which emits the rest of the layer's ops: the shared experts, the routed experts added on
top, and whatever the placement needs around them (vLLM's modular MoE kernel splits it the same way:
prepare / finalize around an experts kernel).

    ResidentExperts   every expert's weights in memory (or a filled expert cache, whose slots are in
                      expert order): shared experts, then moe_experts accumulated on top, or the shared
                      experts inside that moe_experts where they were loaded as routed ones; under tensor
                      parallelism every rank holds I / tp columns of every expert, so one all_reduce
    CachedExperts     the experts stream through an expert cache (model.expert_cache): the step pauses
                      where the host reads the routing, loads the misses and sends the layer's
                      expert -> slot table, which moe_experts reads on the device; a pause-free step
                      records its routing and misses instead of pausing
    ExpertParallel    the experts spread over the ranks: moe_dispatch + all_to_all (prepare),
                      moe_experts on this rank's experts, all_to_all + moe_combine (finalize)

A strategy reads the graph's helpers (mlp, all_reduce, its dtype, par) and the keyword arguments
its family gives moe_experts (graph.expert_options: V4's clipped SwiGLU).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..tensor import Tensor
from .weights import MoEWeights


class RoutedExperts:
    """A strategy: `strategy(g, x, ids, wts, out, predict)` emits the layer's expert ops after the
    router and returns the layer's output (`out`, the [T, H] tensor the graph allocated for it,
    unless the strategy says otherwise)."""

    def __init__(self, graph, w: MoEWeights):
        self.graph, self.w = graph, w

    def route_into(self, g, T: int) -> tuple:
        """(ids, weights): where the router writes them (None: a new tensor)."""
        return None, None

    def predicts(self) -> bool:
        """Whether this layer's step guesses the next layer's experts (prefetch)."""
        return False


class ResidentExperts(RoutedExperts):
    """Routed experts whose weights are all in place: the shared experts, then moe_experts on top.
    Shared experts loaded as routed ones (MoEWeights.shared_experts) run in the same moe_experts:
    the router writes the first K columns of [T, K + S] ids and weights whose last S columns are
    constant inputs (experts E .. E + S - 1, weight 1)."""

    def __init__(self, graph, w: MoEWeights, weights: tuple):
        super().__init__(graph, w)
        self.gate, self.up, self.down = weights
        self.routing = None      # (ids, weights) [T, K + S] with the shared experts' columns

    def route_into(self, g, T: int) -> tuple:
        if self.w.shared_experts is None:
            return None, None
        E, K, S = len(self.gate), self.graph.cfg.num_experts_per_tok, len(self.w.shared_experts[0])
        tail = np.arange(E, E + S, dtype=np.int32)
        ids = g.constant(f"shared_expert_ids_{T}_{K}_{E}_{S}", np.tile(np.r_[np.full(K, -1, np.int32), tail], (T, 1)))
        wts = g.constant(f"shared_expert_weights_{T}_{K}_{S}",
                         np.tile(np.r_[np.zeros(K, np.float32), np.ones(S, np.float32)], (T, 1)), "f32")
        self.routing = ids, wts
        return ids.narrow(1, 0, K), wts.narrow(1, 0, K)

    def __call__(self, g, x, ids, wts, out, predict: Optional[Callable] = None) -> Tensor:
        gr, w = self.graph, self.w
        gate, up, down = self.gate, self.up, self.down
        if self.routing is not None:
            ids, wts = self.routing
            sg, su, sd = w.shared_experts
            gate, up, down = list(gate) + sg, list(up) + su, list(down) + sd
        elif w.shared is not None:
            gr.mlp(g, w.shared, x, x.shape[0], out=out, reduce=False)
        g.moe_experts(x=x, topk_ids=ids, topk_weights=wts, num_experts=len(gate),
                      accumulate=int(w.shared is not None), w_gate=gate, w_up=up, w_down=down,
                      out=out, **gr.expert_options)
        # tensor parallel without expert parallelism: every expert's I / tp columns, partial sums
        gr.all_reduce(g, out)
        return out


class CachedExperts(RoutedExperts):
    """Routed experts streamed through an expert cache (StreamedLayer `s`, model.expert_cache).

    One pause, after the shared experts, where the host reads the routing (and the next layer's
    guessed experts, to prefetch), gets the missing experts loaded and sends the layer's
    expert -> slot table; on a device (s.early_read) the routing goes to the host at a pause of its
    own right after the router, and the shared experts run while the host decides. A pause-free
    step (every expert expected in place) records its routing and misses for the host instead."""

    def __init__(self, graph, w: MoEWeights):
        super().__init__(graph, w)
        self.s = w.streamed
        self.record = None       # (ids, misses) [T, K] of a pause-free step

    def route_into(self, g, T: int) -> tuple:
        s = self.s
        if s.pause_free:
            self.record = s.record(T, s.pos)
            return self.record[0], None
        return None, None

    def predicts(self) -> bool:
        return bool(self.s.predict) and not self.s.pause_free

    def __call__(self, g, x, ids, wts, out, predict: Optional[Callable] = None) -> Tensor:
        """predict: traces the next layer's router and returns its ids (None: no next MoE layer)."""
        gr, w, s = self.graph, self.w, self.s
        T, K = x.shape[0], gr.cfg.num_experts_per_tok
        paused = self.record is None
        routing = {}
        if paused:
            routing = dict(ids=ids, pred=predict() if predict is not None and s.predict else None)
            if s.early_read:
                g.pause(("expert_ids", s.pos), **routing)     # ExpertCache.on_ids
                routing = {}
        if w.shared is not None:
            gr.mlp(g, w.shared, x, T, out=out)
        if paused:
            g.pause(("experts", s.pos), **routing)
        misses = self.record[1] if not paused else g.empty((T, K), "int32", "expert_misses")
        # moe_experts over the cache's slot descriptors through its table on the device (expert_map,
        # ABI 1.5); a pair whose expert is absent is skipped and flagged in misses
        g.moe_experts(x=x, topk_ids=ids, topk_weights=wts, num_experts=len(s.w_gate),
                      accumulate=int(w.shared is not None), w_gate=s.w_gate, w_up=s.w_up, w_down=s.w_down,
                      out=out, expert_map=s.expert_map, misses=misses, **gr.expert_options)
        return out


class ExpertParallel(RoutedExperts):
    """The routed experts spread over the ranks (rank r holds experts [r * Er, (r + 1) * Er)).

    Every rank holds all T tokens (attention is replicated or all-reduced), so each sends only its
    slice of Ts = ceil(T / N) tokens: moe_dispatch packs a row per (token, owning rank), all_to_all
    carries the rows (with counts) and their local ids and weights (whole slots: the padding rows say
    -1), moe_experts runs this rank's experts on what arrived, all_to_all sends the outputs back and
    moe_combine sums each token's parts. The slices' results are then put together: added into the
    shared experts' partial sums before their all_reduce (tensor parallel), or all-gathered
    (replicated attention, or no shared experts)."""

    def __init__(self, graph, w: MoEWeights):
        super().__init__(graph, w)
        self.par = graph.par

    def __call__(self, g, x, ids, wts, out, predict: Optional[Callable] = None) -> Tensor:
        gr, w, N = self.graph, self.w, self.par.world
        T = x.shape[0]
        Ts = -(-T // N)
        s0 = min(self.par.rank * Ts, T)
        Tr = min(Ts, T - s0)          # this rank's tokens (0 for a trailing rank of a small batch)
        back, route = self.exchange(g, x.narrow(0, s0, Tr), ids.narrow(0, s0, Tr), wts.narrow(0, s0, Tr), Ts)
        if gr.tp > 1 and w.shared is not None:
            # the shared experts' partial sums plus, on this rank's slice, the routed result: one all_reduce
            gr.mlp(g, w.shared, x, T, out=out, reduce=False)
            g.moe_combine(back=back, route=route, out=out.narrow(0, s0, Tr), accumulate=1)
            gr.all_reduce(g, out)
            return out
        H, dt = x.shape[1], gr.dtype
        mine = g.empty((Ts, H), dt, "ep_mine")
        g.moe_combine(back=back, route=route, out=mine.narrow(0, 0, Tr), accumulate=0)
        every = g.empty((N, Ts, H), dt, "ep_gathered")
        g.all_gather(comm=self.par.comm, x=mine, out=every)
        routed = every.view(N * Ts, H).narrow(0, 0, T)      # token t sits at row t
        if w.shared is None:
            return routed
        gr.mlp(g, w.shared, x, T, out=out)                  # all-reduced when tensor parallel
        g.add(a=out, b=routed, out=out)
        return out

    def exchange(self, g, x, ids, wts, Ts: int) -> tuple:
        """This rank's slice of rows out to the experts' ranks and the results back: (back [N, Ts, H],
        route [Tr, N]), which moe_combine sums per token."""
        gr, w, comm, N = self.graph, self.w, self.par.comm, self.par.world
        H, K, dt = x.shape[1], gr.cfg.num_experts_per_tok, gr.dtype
        Er = len(w.experts_gate)
        send_x = g.empty((N, Ts, H), dt, "ep_send_x")
        send_ids = g.empty((N, Ts, K), "int32", "ep_send_ids")
        send_w = g.empty((N, Ts, K), "f32", "ep_send_weights")
        counts = g.empty((N,), "int32", "ep_send_counts")
        route = g.empty((x.shape[0], N), "int32", "ep_route")
        g.moe_dispatch(x=x, topk_ids=ids, topk_weights=wts, send_x=send_x, send_ids=send_ids, send_weights=send_w,
                       send_counts=counts, route=route, experts_per_rank=Er)
        recv_x = g.empty((N, Ts, H), dt, "ep_recv_x")
        recv_ids = g.empty((N, Ts, K), "int32", "ep_recv_ids")
        recv_w = g.empty((N, Ts, K), "f32", "ep_recv_weights")
        recv_counts = g.empty((N,), "int32", "ep_recv_counts")
        g.all_to_all(comm=comm, send=send_x, recv=recv_x, send_counts=counts, recv_counts=recv_counts)
        g.all_to_all(comm=comm, send=send_ids, recv=recv_ids)
        g.all_to_all(comm=comm, send=send_w, recv=recv_w)
        y = g.empty((N, Ts, H), dt, "ep_expert_out")
        g.moe_experts(x=recv_x.view(N * Ts, H), topk_ids=recv_ids.view(N * Ts, K),
                      topk_weights=recv_w.view(N * Ts, K), num_experts=Er, accumulate=0,
                      w_gate=w.experts_gate, w_up=w.experts_up, w_down=w.experts_down, out=y.view(N * Ts, H))
        back = g.empty((N, Ts, H), dt, "ep_back")
        back_counts = g.empty((N,), "int32", "ep_back_counts")
        g.all_to_all(comm=comm, send=y, recv=back, send_counts=recv_counts, recv_counts=back_counts)
        return back, route


def experts_for(graph, w: MoEWeights):
    """The strategy of one MoE layer in the step being traced: expert parallel when the ranks split
    the experts, an expert cache's while it streams them, else resident weights (a filled cache's
    slots in expert order count as resident)."""
    if graph.ep > 1:
        return ExpertParallel(graph, w)
    s = w.streamed
    if s is None:
        return ResidentExperts(graph, w, (w.experts_gate, w.experts_up, w.experts_down))
    if s.direct is not None:
        return ResidentExperts(graph, w, s.direct)
    return CachedExperts(graph, w)
