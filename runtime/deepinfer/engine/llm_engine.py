"""The engine: requests in, text deltas out, one step at a time.

    engine.add_request(prompt, params) -> request id
    engine.step() -> [RequestOutput]      one scheduled step: new tokens and text of every request in it
    engine.abort(request id)              frees its blocks at once

Policy lives here and in the scheduler; the math lives in the model graph, run by the ModelRunner.
The engine only does integer bookkeeping (token ids, seeds) and text. `generate`, `stream`, `chat`
and `deepinfer.run` are loops over `step` that add their own requests (others keep running).
Not thread-safe: one thread drives it (the server's engine thread, see deepinfer.serve).
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence as Seq, Union

import numpy as np

from ..config import EngineConfig, SpecConfig
from ..errors import CheckpointError, ConfigError, DeepinferError, InputTypeError
from ..loader import get_backend
from ..model.hub import resolve_model
from ..parallel.group import ParallelGroup
from .. import validate as V
from .runner_factory import load_runner
from .constraints import Constraints
from .sample_controls import SampleControls
from .sampling import SamplingParams, step_seed
from .scheduler import Scheduler
from .speculative import Speculator
from .sequence import Sequence, Status
from .tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("deepinfer")


class QueueFullError(DeepinferError):
    """The engine's waiting queue is at max_queue requests (retry later, or raise max_queue)."""


def default_model_dir() -> Path:
    """The model that ships with deepinfer (runtime/deepinfer/assets/deepseek-v3-nano)."""
    return Path(__file__).resolve().parent.parent / "assets" / "deepseek-v3-nano"


def resolve_model_dir(model=None, revision: Optional[str] = None) -> Path:
    """The directory of a model argument: a directory as is, a hub id's snapshot in the Hugging
    Face cache (model.hub, at `revision`), or the embedded model for None."""
    if model:
        return resolve_model(model, revision)
    if revision:
        raise CheckpointError("revision applies to a hub id; the embedded model has none")
    return default_model_dir()


@dataclass
class RequestOutput:
    """What one step produced for one choice of a request."""

    request_id: str
    index: int                      # the choice (0 .. n-1)
    token_ids: list                 # tokens sampled this step (eos and stop tokens are not included)
    text: str                       # text they complete (held back while it could become a stop string)
    finished: bool = False
    finish_reason: Optional[str] = None    # "stop", "length" or "abort"
    logprobs: list = field(default_factory=list)   # per token: (logprob, [(token, logprob), ...] top alternatives)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


def load_backend_and_runner(model_dir: Path, config: EngineConfig, group=None):
    """The backend and the loaded model of one process (of one rank, with a ParallelGroup: rank r
    uses device device_id + its local rank)."""
    threads = config.num_threads
    if group is not None and not threads:
        # CPU ranks share the machine's cores: each takes its part rather than all of them
        threads = max(1, (os.cpu_count() or 1) // group.world)
    backend = get_backend(config.backend, fallback=config.fallback, device_id=config.device_id,
                          num_threads=threads, local_rank=group.local_rank if group is not None else 0)
    return backend, load_runner(model_dir, backend, config, group=group)


class Engine:
    """Load once, generate many times."""

    def __init__(self, model_dir: Path, config: EngineConfig, name: Optional[str] = None):
        self.model_dir = Path(model_dir)
        self.model_name = name or self.model_dir.name   # what the user called it (a hub id, a path)
        self.config = config
        if config.verbose:  # say which backend, precision and why on stderr
            log.setLevel(logging.INFO)
            if not logging.getLogger().handlers and not log.handlers:
                h = logging.StreamHandler()
                h.setFormatter(logging.Formatter("deepinfer: %(message)s"))
                log.addHandler(h)
        self.tokenizer = Tokenizer(self.model_dir)
        t0 = time.perf_counter()
        # several ranks (parallel.group): this is rank 0, the one that schedules; the others run
        # parallel.worker.run_worker with the same config and execute the steps it sends
        self.group = None
        if config.world_size > 1:
            self.group = ParallelGroup(config.tensor_parallel, config.expert_parallel)
            if not self.group.is_driver:
                raise ConfigError(f"rank {self.group.rank}: only rank 0 runs an Engine; the other ranks run "
                                  f"deepinfer.parallel.worker.run_worker(model, config) (deepinfer run|serve does)")
        self.backend, self.runner = load_backend_and_runner(self.model_dir, config, self.group)
        self.load_seconds = time.perf_counter() - t0
        self.block_manager = self.runner.block_manager
        self.scheduler = Scheduler(self.block_manager, config.max_batch, self.runner.max_num_batched_tokens,
                                   config.scheduling_policy)
        self.eos_ids = {i for i in (self.tokenizer.eos_id, self.runner.eos_token_id) if i is not None}
        self._requests: dict = {}        # request id -> its Sequences (one per choice)
        self._done_outputs: list = []    # outputs of requests that finished without a step (max_tokens 0)
        self._sample_controls: dict = {}  # batch rows -> SampleControls (penalties, bias, masks)
        self.constraints = Constraints(self.tokenizer, self.runner.cfg.vocab_size, self.eos_ids)
        self._ids = itertools.count()
        self.counters = {"steps": 0, "prompt_tokens": 0, "computed_prompt_tokens": 0, "generated_tokens": 0,
                      "requests_finished": 0, "requests_aborted": 0}
        self.spec = None
        spec_cfg = SpecConfig.parse(config.speculative)
        if spec_cfg is not None:
            self.spec = Speculator(self, spec_cfg)
            if spec_cfg.confidence == "auto":
                t0 = time.perf_counter()
                self.spec.profile()
                log.info("speculative: step times profiled in %.2f s (us): %s", time.perf_counter() - t0,
                         self.spec.costs.describe())
        log.info("engine: %s on %s (%s); KV cache %d blocks x %d tokens", self.model_dir.name, self.backend.name,
                 self.runner.precision_note, self.block_manager.num_blocks, self.block_manager.block_size)
        reason = self.runner.precision_reason
        self.precision_warned = bool(self.runner.precision_lossy and config.precision in ("auto", "fastest"))
        if self.precision_warned:
            # a default that changes what the checkpoint computes is never silent
            log.warning("%s", reason)
        elif reason:
            log.info("%s", reason)

    def close(self) -> None:
        """Let the other ranks of a split model go (they wait for the next step until told)."""
        if self.group is not None:
            self.group.stop()

    @classmethod
    def from_pretrained(cls, model=None, config=None, **overrides) -> "Engine":
        """`model`: a model directory, a hub id (`org/name`, resolved through the Hugging Face
        cache, see model.hub; `revision` in the config picks a branch, tag or commit), or None for
        the embedded model."""
        cfg = EngineConfig.from_any(config, **overrides)
        model_dir = resolve_model_dir(model, cfg.revision)
        return cls(model_dir, cfg, name=os.fspath(model) if model else None)

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: Union[str, Seq[int]], add_bos: Optional[bool] = None) -> list:
        """Token ids of a prompt: a str (UTF-8 text) or a sequence of token ids."""
        if isinstance(prompt, str):
            V.utf8("the prompt", prompt, err=ConfigError)
            ids = self.tokenizer.encode(prompt, add_bos=add_bos)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = list(prompt)
            bad = next((t for t in ids if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))), None)
            if bad is not None:
                raise InputTypeError(f"a prompt of token ids must hold integers only, not {type(bad).__name__} {bad!r}")
            ids = [int(t) for t in ids]
        else:
            raise InputTypeError(f"a prompt is a str or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            if self.tokenizer.bos_id is None:
                raise ConfigError("empty prompt and the tokenizer has no bos token")
            ids = [self.tokenizer.bos_id]
        return ids

    def check_request(self, ids: list, params: SamplingParams) -> None:
        """Raise ConfigError if the request can never run (the server turns it into a 400): before any
        output, not after a partial one."""
        vocab = self.runner.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or ()) if t >= vocab]
        if bad:
            raise ConfigError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab})")
        if params.has_controls and self.backend.abi_minor < 7:
            raise ConfigError(f"penalties, logit_bias, min_tokens and structured output need a backend library of "
                              f"ABI 1.7; {self.backend.name} implements ABI 1.{self.backend.abi_minor}")
        need = len(ids) + params.max_new_tokens
        limit = self.runner.max_seq_len
        if need > limit:
            raise ConfigError(f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} > "
                              f"max_seq_len {limit}")
        bm = self.block_manager
        if -(-need // bm.block_size) > bm.num_blocks:
            raise ConfigError(f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} needs {need} "
                              f"positions but the whole KV cache holds {bm.num_blocks * bm.block_size}; raise "
                              f"kv_cache_tokens or lower max_new_tokens")

    def add_request(self, prompt: Union[str, Seq[int]], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, n: int = 1, add_bos: Optional[bool] = None,
                    priority: int = 0, **options) -> str:
        """Queue a request (a prompt string or token ids) with n choices; returns its id. `priority`
        (scheduling_policy "priority" only; lower runs first). Raises ConfigError for a request that
        can never run and QueueFullError when max_queue requests wait."""
        params = params if params is not None else SamplingParams.from_options(**options)
        V.integer("n", n, 1, max(1, self.config.max_queue))
        V.integer("priority", priority, -(1 << 31), (1 << 31) - 1)
        if priority and self.config.scheduling_policy != "priority":
            raise ConfigError(f"priority {priority} needs scheduling_policy 'priority' (this engine serves "
                              f"requests in arrival order: 'fcfs')")
        ids = self.encode_prompt(prompt, add_bos)
        self.check_request(ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str):
            raise InputTypeError(f"request_id must be a str, not {type(rid).__name__}")
        if rid in self._requests:
            raise ConfigError(f"request id {rid!r} is already running")
        if len(self.scheduler.waiting) + n > self.config.max_queue:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting (max_queue "
                                 f"{self.config.max_queue}); retry later")
        seqs = []
        for i in range(n):
            seq = Sequence(ids, params, request_id=rid, index=i, priority=priority)
            seq.detok = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
            seqs.append(seq)
        self.constraints.attach(seqs, params)      # a schema that does not compile is a ConfigError here
        self._requests[rid] = seqs
        self.counters["prompt_tokens"] += len(ids) * n
        for seq in seqs:
            if params.max_new_tokens == 0:
                self._finish(seq, "length")
                self._done_outputs.append(self._output(seq, [], "", []))
            else:
                self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give its blocks back; False if it is unknown or already done."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._done_outputs)

    def is_running(self, request_id: str) -> bool:
        return request_id in self._requests

    # ------------------------------------------------------------------ one step
    def step(self) -> list:
        """Run one scheduled step; returns the outputs of every request it touched."""
        outs, self._done_outputs = self._done_outputs, []
        batch = self.scheduler.schedule()
        if not batch:
            return outs
        spec = self.spec
        # rows with sampling controls decode plainly: spec_verify has no penalties, bias or masks
        if spec is not None and self.scheduler.last_kind == "decode" and \
                not any(s.seq.params.has_controls for s in batch):
            t0 = time.perf_counter()      # a plain step's time includes the choice, as a spec step's does
            done = spec.decode_step(batch, time.monotonic)
            if done is not None:
                return outs + done
            outs = self._plain_step(batch, outs)
            spec.observe_plain(len(batch), time.perf_counter() - t0)
            return outs
        samples = [s.samples for s in batch]
        outs = self._plain_step(batch, outs)
        if spec is not None:
            spec.after_prefill(batch, samples)      # the MTP layer's cache for the prompt, and first drafts
        return outs

    def _plain_step(self, batch: list, outs: list) -> list:
        """A step without speculation: run the batch, sample one token for each sequence that ends
        its chunk at its last token."""
        self.counters["steps"] += 1
        prefill = self.spec is not None and self.scheduler.last_kind == "prefill"
        masks = self._start_masks(batch)         # grammar masks fill while the model runs
        logits = self.runner.run([(s.seq, s.start, s.num_tokens) for s in batch], keep_hidden=prefill)
        for s in batch:
            s.seq.num_computed = s.start + s.num_tokens
            self.block_manager.commit(s.seq)
            if s.start < s.seq.num_prompt_tokens:
                self.counters["computed_prompt_tokens"] += min(s.num_tokens, s.seq.num_prompt_tokens - s.start)
        sampled = [(i, s.seq) for i, s in enumerate(batch) if s.samples]
        if not sampled:
            return outs
        # every row is sampled in one op call (rows mid-prompt greedily; their tokens are dropped)
        temp, top_k, top_p, seeds = [], [], [], []
        want = {i: seq for i, seq in sampled}
        for i, s in enumerate(batch):
            p = s.seq.params if i in want else None
            temp.append(p.temperature if p else 0.0)
            top_k.append(p.top_k if p else 0)
            top_p.append(p.top_p if p else 1.0)
            seeds.append(step_seed(p.seed, s.seq.index, s.seq.num_output_tokens) if p else 0)
        if masks is not None:
            self.constraints.wait(masks)
        controls = self._controls(batch, want, masked=masks is not None)
        tokens = self.runner.sampler.sample(logits, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds,
                                            controls=controls)
        host = None
        if any(seq.params.logprobs is not None for _, seq in sampled):
            host = self.backend.to_numpy(logits)
        now = time.monotonic()
        for i, seq in sampled:
            outs.append(self.advance(seq, tokens[i], host[i] if seq.params.logprobs is not None else None,
                                      now))
        return outs

    def _control_buffers(self, B: int) -> SampleControls:
        ctl = self._sample_controls.get(B)
        if ctl is None:
            ctl = self._sample_controls[B] = SampleControls(self.backend, B, self.runner.cfg.vocab_size)
        return ctl

    def _start_masks(self, batch: list):
        """The step's grammar masks, filling on the constraints' worker (None: no row has a grammar)."""
        rows = [s.seq if s.samples and s.seq.matcher is not None else None for s in batch]
        if not any(r is not None for r in rows):
            return None
        return self.constraints.start(rows, self._control_buffers(len(batch)).mask_rows())

    def _controls(self, batch: list, want: dict, masked: bool) -> Optional[dict]:
        """The sample op's 1.7 control tensors of this step (engine.sample_controls), None when no row
        has any."""
        rows = [want.get(i) if i in want and want[i].params.has_controls else None for i in range(len(batch))]
        if not any(r is not None for r in rows):
            return None
        return self._control_buffers(len(batch)).build(rows, sorted(self.eos_ids), masked=masked) or None

    def advance(self, seq: Sequence, tok: int, row, now: float) -> RequestOutput:
        """Take one sampled token for `seq`: finish it on eos / a stop token / a stop string / its
        length, else append it; its RequestOutput. row: its logits row (None without logprobs).
        Plain steps and the speculator (engine.speculative.SpecEngine) both emit through here."""
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = now
        lp = []
        if row is not None:
            m = row.max()
            logz = m + np.log(np.exp(row - m).sum())
            top = np.argsort(-row, kind="stable")[:p.logprobs]
            lp = [(float(row[tok] - logz), [(int(t), float(row[t] - logz)) for t in top])]
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            self._finish(seq, "stop")
            return self._output(seq, [], seq.detok.flush(), [])
        if tok < 0:       # the sample op's controls banned every token (a grammar with no way on)
            log.warning("request %s: no token is allowed (structured output dead end); stopping it", seq.request_id)
            self._finish(seq, "error")
            return self._output(seq, [], seq.detok.flush(), [])
        seq.append(tok)
        self.counters["generated_tokens"] += 1
        text = seq.detok.push(tok)
        grammar = self.constraints.advance(seq, tok) if seq.matcher is not None else None
        if grammar is not None:
            if grammar == "error":
                log.warning("request %s: the grammar refused token %d; stopping it", seq.request_id, tok)
            self._finish(seq, grammar)
            text += seq.detok.flush()
        elif seq.detok.stopped:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= p.max_new_tokens:
            self._finish(seq, "length")
            text += seq.detok.flush()
        return self._output(seq, [tok], text, lp)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[seq.request_id]
            self.counters["requests_finished"] += 1

    def _output(self, seq: Sequence, toks: list, text: str, lp: list) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.index, toks, text, seq.is_finished, seq.finish_reason, lp,
                             seq.num_prompt_tokens, seq.num_output_tokens)

    # ------------------------------------------------------------------ offline API on top of step()
    # Each entry point checks its arguments and every prompt when it is called, so a bad request is an
    # error before any output (a generator's body would only run at its first next()); the requests
    # themselves are added when iteration starts, so an iterator never started costs nothing.
    def _prepare(self, prompts: list, params: SamplingParams, add_bos: Optional[bool] = None) -> list:
        ids = [self.encode_prompt(p, add_bos) for p in prompts]
        for x in ids:
            self.check_request(x, params)
        return ids

    def _run(self, prompt_ids: list, params: SamplingParams) -> Iterator:
        """Adds one request per prompt (token ids) and steps until they finish; yields (row, RequestOutput)."""
        rids = []
        try:
            for p in prompt_ids:
                rids.append(self.add_request(p, params))
            row = {rid: r for r, rid in enumerate(rids)}
            left = set(rids)
            while left:
                outs = self.step()
                if not outs and not self.scheduler.has_work():
                    raise RuntimeError("engine stalled with requests unfinished")   # a bug, never a hang
                for o in outs:
                    if o.request_id in row:
                        yield row[o.request_id], o
                        if o.finished:
                            left.discard(o.request_id)
        finally:
            for rid in rids:
                self.abort(rid)      # a no-op for finished ones; frees blocks if the caller stopped early

    def generate(self, prompt: str, **options) -> str:
        return "".join(self.stream(prompt, **options))

    def generate_batch(self, prompts: Seq[str], **options) -> list:
        """Several prompts of different lengths, run together."""
        prompts = _prompt_list(prompts, "generate_batch", "generate()")
        params = SamplingParams.from_options(**options)
        outs = ["" for _ in prompts]
        for row, o in self._run(self._prepare(prompts, params), params):
            outs[row] += o.text
        return outs

    def stream(self, prompt: str, callback: Optional[Callable[[str], None]] = None, **options) -> Iterator[str]:
        params = SamplingParams.from_options(**options)
        if not isinstance(prompt, str):
            raise InputTypeError(f"stream() and generate() take a str prompt, not {type(prompt).__name__} (token "
                                 f"ids: generate_ids(); several prompts: generate_batch())")
        return self._texts(self._run(self._prepare([prompt], params), params), callback)

    @staticmethod
    def _texts(outputs: Iterator, callback: Optional[Callable[[str], None]] = None) -> Iterator[str]:
        for _, o in outputs:
            if o.text:
                if callback:
                    callback(o.text)
                yield o.text

    def chat(self, messages: list, **options) -> str:
        return "".join(self.chat_stream(messages, **options))

    def chat_stream(self, messages: list, **options) -> Iterator[str]:
        params = SamplingParams.from_options(**options)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self._texts(self._run(self._prepare([text], params, add_bos=False), params))

    def generate_ids(self, prompt_ids: Seq[Seq[int]], **options) -> list:
        """Token-level generation (tests compare these with transformers' greedy output)."""
        prompt_ids = _prompt_list(prompt_ids, "generate_ids", "a list holding one list of ids")
        params = SamplingParams.from_options(**options)
        outs = [[] for _ in prompt_ids]
        for row, o in self._run(self._prepare(prompt_ids, params), params):
            outs[row] += o.token_ids
        return outs

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict:
        bm = self.block_manager
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": bm.num_used_blocks, "kv_blocks_total": bm.num_blocks,
                "prefix_cache_hit_tokens": bm.prefix_hits, "prefix_cache_query_tokens": bm.prefix_queries,
                "preemptions": self.scheduler.num_preemptions, "plans": len(self.runner.plans), **self.counters}

    def stats(self) -> dict:
        """metrics() plus load_seconds (weights onto the backend) and, with an expert cache, its
        counters: expert_hits, expert_misses, expert_prefetch_issued / _used / _late,
        expert_bytes_streamed, expert_wait_seconds, hit rate, prefetch recall and precision,
        expert_pause_free_steps / _retries (decode steps run without pauses, and those run again); with
        speculative decoding, spec_*: acceptance per draft position, mean accepted length (tokens
        a sequence gains per speculative step), verify tokens per step, plain steps the scheduler
        chose, the step-time table."""
        return {**self.metrics(), "load_seconds": self.load_seconds, **self.runner.expert_stats(),
                **(self.spec.report() if self.spec is not None else {})}


def _prompt_list(prompts, fn: str, single: str) -> list:
    """The prompts of a batch call as a list; a lone str is refused (it would run as one prompt per character)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise InputTypeError(f"{fn} takes a list of prompts, not {type(prompts).__name__}; for one prompt use {single}")
    return list(prompts)
