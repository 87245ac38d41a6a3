"""The ModelRunner: a loaded model on one backend, run one step at a time: plan -> fill -> run -> logits.

It owns the weights (model.weights), the graph (model.deepseek), the KV cache (sized by
engine.kv_sizing), the block manager, the execution plans and the arena they share, the host
staging of each step's inputs, and graph capture. The scheduler hands it a batch of
(Sequence, start, n_tokens); it pads the batch up to a bucket (engine.plan_key), fills the inputs,
runs the plan and returns the logits.

Padding uses the ABI's own semantics: a padded token writes no cache (slot -1) and, in decode
mode, attends to nothing (kv_len 0); in prefill mode padded tokens trail the last real sequence
(causal attention keeps them out of every real token's output); padded sequences are empty
(cu_seqlens repeats) and their logits rows are never read.

Graphs: on a device backend with graph capture, the runner works on a stream of its own and each
decode plan is captured after its first (eager) run, so a decode step costs one input copy, one
graph launch, the sample op and one read of the sampled ids. Prefill plans run op by op (their
launch overhead is small next to their work). enforce_eager=True keeps every step op by op.

Beside it, each in a module of its own: the sampler (engine.sampling), the hidden-state and draft
stores of speculative decoding (engine.spec_store), the steps of a multi-rank job
(engine.multi_rank), and the offline API (engine.offline: forward / free / score / mtp_logits
with caller-chosen sequence ids), whose methods the runner hands over to under the same names.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Optional, Sequence as Seq

import numpy as np

from .. import quant_formats as QF
from ..errors import ConfigError
from ..model.checkpoint import Checkpoint
from ..model.graph import StepInputs, native_fused_ops
from ..model.expert_cache import ExpertCache, ExpertCacheConfig
from ..model.family import family_of
from ..model.plan import Arena, Plan, Tracer
from ..model.weights import is_mtp_layer
from ..tensor import Tensor
from .block_manager import BlockManager
from .kv_sizing import KVSizing
from .multi_rank import RankSteps
from .offline import OfflineRunner
from .plan_key import PlanKey, bucket
from .runner_config import RunnerConfig
from .sampling import Sampler
from .spec_store import SpecStore

MAX_CACHED_PLANS = 64


class ModelRunner:
    """A loaded DeepSeek model bound to one backend: weights, KV cache, block manager and plans.

    run() runs one step for a batch of (Sequence, start, n_tokens) and returns f32 logits [S, V] of
    each sequence's last token (all tokens' with all_logits=True). The returned Tensor is valid
    until the next call. config: a RunnerConfig (None: its defaults); group: this rank of a tensor /
    expert parallel job (parallel.group.ParallelGroup).
    """

    def __init__(self, checkpoint, backend, config: Optional[RunnerConfig] = None, group=None):
        rc = self.config = config if config is not None else RunnerConfig()
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        # group (parallel.group.ParallelGroup): this rank of a tensor / expert parallel job. Every rank
        # builds the same runner; rank 0 schedules and sends each step to the others (engine.multi_rank)
        self.group = group if group is not None and group.world > 1 else None
        rc.check()
        dtype, precision = rc.dtype, rc.precision
        self.ckpt, self.cfg, self.backend, self.dtype = ckpt, ckpt.config, backend, dtype
        c = self.cfg
        # weight format of the quantizable linears (None: as stored) and int8 activations for them
        self.precision = precision
        self.act_quant = precision is not None and QF.PRECISION_PATHS[precision].activations == "int8"
        self.max_batch = int(rc.max_batch)
        self.block_size = int(rc.block_size)
        self.max_seq_len = int(rc.max_seq_len or min(c.max_position_embeddings, 4096))
        self.max_blocks_per_seq = -(-self.max_seq_len // self.block_size)
        self.max_num_batched_tokens = int(rc.max_num_batched_tokens or max(512, self.max_batch))
        self.eos_token_id = c.eos_token_id
        self.bos_token_id = c.bos_token_id
        # graphs need a stream of our own (the default stream cannot be captured); the backend's
        # copies and ops all go there from now on, so nothing reorders around the captured steps
        self.use_graphs = bool(backend.supports_graphs and not rc.enforce_eager)
        self.stream = None
        if self.use_graphs:
            self.stream = backend.create_stream()
            backend.set_stream(self.stream)
        # the MTP layer is a block of the model's own kind (V3.2: with its indexer; V4: sliding window)
        self.has_mtp = bool(rc.load_mtp and c.has_mtp and self.group is None and is_mtp_layer(ckpt, c.num_hidden_layers))
        self.family = fam = family_of(c)
        # what the MTP layer reads of the main model's last step (model.family)
        self.hidden_width = fam.hidden_width(c)
        if fam.pow2_blocks and self.block_size & (self.block_size - 1):
            raise ConfigError(f"{fam.name} needs a power-of-two KV block size (compressed entries of 4 and 128 "
                              f"tokens map onto blocks); {self.block_size} is not: set kv_block_size to 16, 32 or 64")
        if rc.quantize_lm_head and QF.weight_format_of(precision) not in ("int8", "int4"):
            raise ConfigError(f"quantize_lm_head needs an int8, int4, w8a8 or w4a8 precision; this model runs "
                              f"{precision or 'as stored'}: set such a precision, or drop quantize_lm_head")
        self._check_family_ops(backend)
        ec = ExpertCacheConfig.parse(rc.expert_cache)
        self.ranks = RankSteps(self.group, backend, c, ec) if self.group is not None else None
        if ec is not None and not c.n_routed_experts:
            raise ConfigError("expert_cache: this model has no routed experts (n_routed_experts is 0); drop the option")
        loader = fam.weight_loader(
            ckpt, backend, dtype, precision, rc.group_size, quantize_lm_head=rc.quantize_lm_head,
            stream_experts=ec is not None, shared_as_routed=rc.shared_experts_routed,
            **({"shard": self.group.shard} if self.group is not None else {}))
        self.weights = loader.load(self.has_mtp)
        if self.group is not None:
            self.cfg = c = loader.cfg      # the dimensions this rank computes (heads / tp, ...)
        # routed experts on demand (model.expert_cache): the plans pause at every MoE layer for it
        self.experts: Optional[ExpertCache] = None
        if ec is not None:
            moe = [l.moe for l in self.weights.layers if l.moe is not None]
            if self.weights.mtp is not None and self.weights.mtp.layer.moe is not None:
                moe.append(self.weights.mtp.layer.moe)
            if not moe:
                raise ConfigError("expert_cache: this model has no MoE layer (first_k_dense_replace covers every "
                                  "layer), so it has no routed experts to stream; drop the option")
            self.experts = ExpertCache(backend, loader, moe, ec, top_k=c.num_experts_per_tok,
                                       max_tokens=max(self.max_num_batched_tokens, self.max_batch, 256),
                                       main_layers=c.num_hidden_layers)
        self.graph = fam.graph(c, self.weights, [], dtype, self.act_quant)
        self.graph.block_size = self.block_size
        self.graph.par = self.group       # the collectives of a split model (model.deepseek)
        self.graph.fused_ops = native_fused_ops(backend)
        self.arena = Arena(backend)
        self.plans: "OrderedDict[PlanKey, Plan]" = OrderedDict()
        # persistent final hidden states for the MTP head, and the stores of speculative decoding
        self.spec_store = SpecStore(backend, self.hidden_width, dtype, self.max_batch, c.vocab_size)
        self.sampler = Sampler(backend)
        self.offline = OfflineRunner(self)
        self.last_hidden: Optional[Tensor] = None
        self.last_plan: Optional[Plan] = None
        self._last_T = 0
        self.precision_reason = ""          # why this precision (engine.runner_factory.load_runner sets it)
        self.precision_lossy = False        # the weights compute something other than the stored ones
        self.num_cache_layers = c.num_hidden_layers + (1 if self.has_mtp else 0)
        self.kv_sizing = KVSizing(backend, fam, c, self.num_cache_layers, self.block_size, dtype,
                                  self.max_blocks_per_seq, self.max_batch, self.max_seq_len)
        nb = rc.num_cache_blocks
        explicit_kv = nb is not None
        if nb is None and rc.kv_cache_memory_fraction is not None:
            self._warm_up()
            nb = self.kv_sizing.blocks_from_free_memory(rc.kv_cache_memory_fraction)
        nb = int(nb or self.max_batch * self.max_blocks_per_seq)
        self.kv_sizing.check_fits(nb, explicit_kv)
        if self.ranks is not None:
            nb = self.ranks.agree_blocks(nb)   # rank 0's block manager hands out blocks every rank has
        self.kv = self.kv_sizing.new_cache(nb)
        self.graph.caches = self.kv.layers
        self.block_manager = BlockManager(nb, self.block_size, self.max_blocks_per_seq, rc.enable_prefix_cache)
        stored = c.quant_scheme.describe() if c.quant_scheme is not None else c.torch_dtype
        wq = f"{stored} weights" if precision is None else f"{precision} (from {stored})"
        self.precision_note = f"{wq}, {dtype} activations" + (", int8 per-token activations for int linears"
                                                              if self.act_quant else "") + \
            (", int8 lm_head" if rc.quantize_lm_head else "")

    def _check_family_ops(self, backend) -> None:
        """A family that needs newer ops and fields (V4 and V3.2: ABI 1.3's) says so before loading anything."""
        fam = self.family
        if not fam.required_ops and not fam.min_abi_minor:
            return
        name = fam.name
        missing = [op for op in fam.required_ops if not backend.has_op(op)]
        if missing or backend.abi_minor < fam.min_abi_minor:
            raise ConfigError(f"{name} needs ABI 1.{fam.min_abi_minor} ({', '.join(missing) or 'its new op fields'}); backend "
                              f"{backend.name} implements ABI 1.{backend.abi_minor}{' without them' if missing else ''}:"
                              f" update that library, or set fallback: true to run the missing ops on the reference")

    def _warm_up(self) -> None:
        """One step of the largest prefill on a one-block cache before the KV cache is sized
        (engine.kv_sizing.blocks_from_free_memory): its plan's arena is the peak activation memory,
        and device backends allocate their workspaces on first use. Slots -1 write no cache."""
        warm = self.kv_sizing.new_cache(1)
        self.graph.caches = warm.layers
        T = min(self.max_num_batched_tokens, self.max_batch * self.max_seq_len)
        p = self.plan("main", "prefill" if self._prefill_mode else "decode", bucket(T), 1)
        if self.backend.device != "cpu":
            p.host_input("ids")[:] = 0
            p.host_input("positions")[:] = np.arange(p.key.tokens) % self.max_seq_len
            p.host_input("slots")[:] = -1
            if self._prefill_mode:
                p.host_input("cu_seqlens")[:] = [0, p.key.tokens]
            else:   # block 0 of the one-block warm-up cache, every token attending to its own position
                p.host_input("block_table")[...] = 0
                p.host_input("token_seq")[:] = 0
                p.host_input("kv_len")[:] = np.arange(p.key.tokens) % self.block_size + 1
                self._fill_extra(p, p.host_input("positions"), p.host_input("slots"))
            p.host_input("last_idx")[:] = 0
            if self.experts is not None:
                self.experts.dry = True
            try:
                self._run_plan(p)
                self.backend.synchronize()
            finally:
                if self.experts is not None:
                    self.experts.dry = False
        self.plans.clear()                       # they point at the warm-up cache

    # ================================================================== plans
    def plan(self, kind: str, mode: str, T: int, S: int, all_logits: bool = False, keep_hidden: bool = False,
             pause_free: bool = False) -> Plan:
        """The plan of one kind of step (traced once per key). pause_free: an expert cache's step
        without pauses (model.expert_cache)."""
        key = PlanKey(kind, mode, T, S, all_logits, keep_hidden, pause_free)
        p = self.plans.get(key)
        if p is None:
            if keep_hidden or kind != "main":
                self._ensure_hidden(T)
            with (self.experts.tracing(pause_free) if self.experts is not None else contextlib.nullcontext()):
                p = self._trace(key)
            self.plans[key] = p
            while len(self.plans) > MAX_CACHED_PLANS:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        self.arena.ensure(p.arena_bytes)
        p.bind(self.arena, self.backend)
        return p

    def _trace(self, key: PlanKey) -> Plan:
        T, st = key.tokens, self.spec_store
        g = Tracer(self.backend)
        meta = StepInputs.declare(g, key.mode, T, key.seqs, self.max_blocks_per_seq, key.all_logits)
        if key.kind == "main":
            self.graph.forward(g, meta, st.main.narrow(0, 0, T) if key.keep_hidden else None)
        elif key.kind == "mtp":
            self.graph.mtp(g, meta, st.main.narrow(0, 0, T), st.mtp.narrow(0, 0, T))
        elif key.kind == "draft":
            # a recursive draft: the MTP layer on its own previous output, read and written in place
            self.graph.mtp(g, meta, st.draft.narrow(0, 0, T), st.draft.narrow(0, 0, T))
        else:   # "spec": verify the drafts and draft again (keep_hidden = draft logits gathered)
            self.graph.verify_and_draft(g, meta, st.main.narrow(0, 0, T), st.mtp.narrow(0, 0, T),
                                        st.draft_q if key.keep_hidden else None)
        return Plan.from_tracer(key, g)

    @property
    def _prefill_mode(self) -> bool:
        """Whether fresh sequences run the un-cached prefill path (V4 always reads its caches)."""
        return getattr(self.graph, "prefill_mode", True)

    def _fill_extra(self, p: Plan, pos, slots) -> None:
        """The inputs a family derives from positions and slots (V4's: model.family)."""
        if self.family.fill_inputs is not None:
            self.family.fill_inputs(p, self.cfg, self.block_size, pos, slots)

    def _ensure_hidden(self, T: int) -> None:
        """Hidden-state stores (engine.spec_store) of at least T rows; plans bound to stores it
        replaced must be traced again."""
        if self.spec_store.ensure(T):
            self._drop_plans_bound_to_stores()

    def _drop_plans_bound_to_stores(self) -> None:
        # NOTE: this keeps the main plans with keep_hidden too, though they write the old store: the
        # test read k[-1] of the 7-tuple, which was keep_hidden until pause_free was added after it
        self.plans = OrderedDict((k, p) for k, p in self.plans.items() if k.kind == "main" and not k.pause_free)

    # ================================================================== one step
    def run(self, batch: list, *, all_logits: bool = False, keep_hidden: bool = False, kind: str = "main",
            tokens: Optional[list] = None, inputs: Optional[dict] = None) -> Tensor:
        """One step over `batch`, a list of (Sequence, start, n_tokens): feeds seq.token_ids[start:
        start + n] (or tokens[row]) at positions start.. (blocks already granted by the block
        manager). Returns f32 logits [S, V] (or [T, V] with all_logits), a view valid until the
        next call. inputs: {name: (per-token values, padding value)} for a plan's extra inputs (the
        speculative step's); its other outputs are read with `output`."""
        if not batch:
            raise ValueError("a step needs at least one sequence")
        mode = "prefill" if self._prefill_mode and all(start == 0 for _, start, _ in batch) and kind != "spec" \
            else "decode"
        T = sum(n for _, _, n in batch)
        S = len(batch)
        Tb, Sb = bucket(T), bucket(S)
        ex = self.experts
        if ex is not None and ex.before_step():
            self.plans.clear()     # every expert is resident now: trace the steps again, without pauses
        # an expert cache whose recent steps found every expert in place: a decode step without
        # pauses, run again with them if a pair missed (it rewrites the cache rows the attempt wrote;
        # only main steps: a draft step reads and writes its hidden rows in place)
        pause_free = ex is not None and kind == "main" and mode == "decode" and ex.pause_free_ready()
        p = self._step_plan(batch, kind, mode, T, Tb, Sb, all_logits, keep_hidden, pause_free, tokens, inputs)
        self.execute(p)
        if pause_free and not ex.after_pause_free(Tb):
            p = self._step_plan(batch, kind, mode, T, Tb, Sb, all_logits, keep_hidden, False, tokens, inputs)
            self.execute(p)
        if keep_hidden:
            self.last_hidden = self.spec_store.main.narrow(0, 0, T)
        self.last_plan, self._last_T = p, T
        logits = p.bound_outputs["logits"]
        return logits.narrow(0, 0, T if all_logits else S)

    def _step_plan(self, batch, kind, mode, T, Tb, Sb, all_logits, keep_hidden, pause_free, tokens, inputs) -> Plan:
        """The step's plan with its inputs written (and announced to the other ranks)."""
        p = self.plan(kind, mode, Tb, Sb, all_logits, keep_hidden, pause_free)
        self._fill(p, batch, mode, T, Tb, Sb, tokens)
        if kind == "spec" and Tb > T:
            # a speculative step samples every row in the plan: padding attends to the first
            # sequence's position 0 (kv_len 1, no cache write) so that its rows stay finite
            p.host_input("kv_len")[T:] = 1
        for name, (vals, pad) in (inputs or {}).items():
            h = p.host_input(name)
            h[:T] = vals
            h[T:] = pad
        if self.ranks is not None:
            self.ranks.announce(p)     # the other ranks run the same plan on the same inputs
        return p

    def execute(self, p: Plan) -> None:
        """Run a filled plan; a decode plan is captured as a graph after its first eager run. Every
        rank of a job takes the same decisions here, in the same order."""
        if self.use_graphs and p.key.mode == "decode" and p.graph is None and p.runs >= 1:
            p.capture(self.backend)
        self._run_plan(p)

    def run_remote(self, key: tuple, inputs: dict) -> None:
        """Ranks other than 0: run the step rank 0 announced (parallel.group.serve_steps)."""
        RankSteps.replay(self, key, inputs)

    def output(self, name: str, rows: Optional[int] = None) -> Tensor:
        """An output of the last step's plan (its first `rows` rows; default: the step's tokens)."""
        return self.last_plan.bound_outputs[name].narrow(0, 0, self._last_T if rows is None else rows)

    def enable_speculation(self, num_draft: int) -> None:
        """Size the stores a speculative step reads and writes (engine.speculative, engine.spec_store)."""
        if self.spec_store.enable(num_draft, self.max_num_batched_tokens, self.weights.mtp is not None):
            self._drop_plans_bound_to_stores()

    def _run_plan(self, p: Plan) -> None:
        if not p.has_pauses:
            return p.run(self.backend)
        ex = self.experts
        first = p.first_pause
        if ex.hashed_first and first is not None and first[1] == 0:
            ex.start_step(p.host_input("ids"))

        def on_pause(pz):
            kind, pos = pz.tag
            if kind == "expert_ids":       # the routing is ready; the shared experts follow on the device
                ex.on_ids(pos, pz.tensors["ids"], pz.tensors.get("pred"))
                return
            ex.on_routed(pos, pz.tensors.get("ids"), pz.tensors.get("pred"))
            ex.on_experts(pos)

        p.run(self.backend, on_pause)
        ex.end_step()

    def _fill(self, p: Plan, batch: list, mode: str, T: int, Tb: int, Sb: int, tokens: Optional[list] = None) -> None:
        """Write a step's inputs. tokens: per batch row the ids fed (default seq.token_ids[start:start + n])."""
        if mode == "decode" and T == len(batch) and tokens is None:
            return self._fill_decode(p, batch, T)
        bm, pad = self.block_manager, Tb - T
        ids = np.zeros(Tb, np.int32)
        pos = np.zeros(Tb, np.int32)
        slots = np.full(Tb, -1, np.int32)
        last = np.zeros(Sb, np.int32)
        t = 0
        for r, (seq, start, n) in enumerate(batch):
            ids[t:t + n] = seq.token_ids[start:start + n] if tokens is None else tokens[r]
            pos[t:t + n] = np.arange(start, start + n)
            slots[t:t + n] = bm.slots(seq, start, start + n)
            t += n
            last[r] = t - 1
        if mode == "prefill":
            # padding trails the last real sequence (positions run on; causal attention ignores them)
            if pad:
                pos[T:] = np.minimum(pos[T - 1] + 1 + np.arange(pad), self.max_seq_len - 1)
            cu = np.full(Sb + 1, Tb, np.int32)
            cu[0] = 0
            acc = 0
            for r, (_, _, n) in enumerate(batch[:-1]):
                acc += n
                cu[r + 1] = acc
            p.host_input("cu_seqlens")[:] = cu
        else:
            table = p.host_input("block_table")
            table[...] = 0
            tseq = np.zeros(Tb, np.int32)
            kvl = np.zeros(Tb, np.int32)       # padded tokens: kv_len 0, no keys
            t = 0
            for r, (seq, start, n) in enumerate(batch):
                table[r, :len(seq.block_table)] = seq.block_table
                tseq[t:t + n] = r
                kvl[t:t + n] = np.arange(start + 1, start + n + 1)
                t += n
            p.host_input("token_seq")[:] = tseq
            p.host_input("kv_len")[:] = kvl
        p.host_input("ids")[:] = ids
        p.host_input("positions")[:] = pos
        p.host_input("slots")[:] = slots
        self._fill_extra(p, pos, slots)
        if "last_idx" in p.inputs:
            p.host_input("last_idx")[:] = last

    def _fill_decode(self, p: Plan, batch: list, T: int) -> None:
        """The common decode step, one new token per sequence, written straight into the host views
        (the general _fill builds arrays first; at a few hundred microseconds a step on a small model
        on the CPU, that bookkeeping showed)."""
        bs = self.block_size
        h = p.host_input
        ids, pos, slots, tseq, kvl = h("ids"), h("positions"), h("slots"), h("token_seq"), h("kv_len")
        table = h("block_table")
        starts = [start for _, start, _ in batch]
        ids[:T] = [seq.token_ids[start] for seq, start, _ in batch]
        pos[:T] = starts
        slots[:T] = [seq.block_table[start // bs] * bs + start % bs for seq, start, _ in batch]
        tseq[:T] = range(T)
        kvl[:T] = [start + 1 for start in starts]
        if T < len(ids):      # padded rows: no cache write, no keys
            ids[T:] = 0
            pos[T:] = 0
            slots[T:] = -1
            tseq[T:] = 0
            kvl[T:] = 0
        table[...] = 0
        for r, (seq, _, _) in enumerate(batch):
            table[r, :len(seq.block_table)] = seq.block_table
        self._fill_extra(p, pos, slots)
        if "last_idx" in p.inputs:
            last = h("last_idx")
            last[:T] = range(T)
            last[T:] = 0

    # ================================================================== reporting
    def expert_stats(self) -> dict:
        """The expert cache's counters (engine.stats()), {} without one."""
        return self.experts.report() if self.experts is not None else {}

    def memory_report(self) -> dict:
        return {
            "expert_cache_bytes": self.experts.slot_bytes if self.experts is not None else 0,
            "kv_cache_bytes": self.kv.nbytes,
            "kv_blocks": self.kv.num_blocks,
            "arena_bytes": self.arena.nbytes,
            "plans": {str(tuple(k)): {"arena_bytes": p.arena_bytes, "total_activation_bytes": p.total_activation_bytes,
                               "ops": len(p.calls)} for k, p in self.plans.items()},
        }

    # ================================================================== the sampler and the offline API
    # (engine.sampling, engine.offline), under the names tests, perplexity and benchmarks call
    def sample(self, logits: Tensor, temperature, top_k=None, top_p=None, seeds=None, with_probs: bool = False):
        return self.sampler.sample(logits, temperature, top_k, top_p, seeds, with_probs)

    def new_sequence(self) -> int:
        return self.offline.new_sequence()

    def free(self, seq_id: int) -> None:
        self.offline.free(seq_id)

    def forward(self, batch, tokens=None, starts=None, *, all_logits: bool = False,
                keep_hidden: bool = False) -> Tensor:
        return self.offline.forward(batch, tokens, starts, all_logits=all_logits, keep_hidden=keep_hidden)

    def mtp_logits(self, batch, next_tokens=None, starts=None, *, all_logits: bool = False) -> Tensor:
        return self.offline.mtp_logits(batch, next_tokens, starts, all_logits=all_logits)

    def score(self, ids: Seq[int], chunk: int = 256) -> np.ndarray:
        return self.offline.score(ids, chunk)
