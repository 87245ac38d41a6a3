"""Grammar-constrained sequences (structured output) for the engine.

Each request's `structured` spec is compiled once (engine.structured, on llguidance: compiled grammars
are cached, so a burst of requests with one schema compiles it once) and every sequence of it gets a
matcher. A step's mask rows are filled on a worker thread started before the model runs, so on a
device the masks for step n are computed while step n's forward runs, and on the CPU backend the
fill overlaps the forward's native threads (llguidance releases the GIL). The sample op (ABI 1.7's
token_mask) applies them. After the draw each matcher consumes its row's token; a grammar that is
complete ends its sequence ("stop").

A spec may say `"after": "</think>"`: the grammar then starts once the output has produced that text's
tokens (a reasoning model's answer follows its reasoning; the reasoning itself is free).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from ..errors import ConfigError
from .structured import StructuredCompiler, fill_masks


class Constraints:
    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler = None
        self._pool: Optional[ThreadPoolExecutor] = None
        # mask_s: time inside the fills; wait_s: time the step loop waited for them after the forward
        self.stats = {"masks": 0, "mask_s": 0.0, "wait_s": 0.0}

    def _compile(self, spec: dict):
        if self._compiler is None:
            self._compiler = StructuredCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._compiler.compile({k: v for k, v in spec.items() if k != "after"})

    def attach(self, seqs: list, params) -> None:
        """Give each sequence of a request its matcher (ConfigError for a spec that does not compile)."""
        spec = params.structured
        if spec is None:
            return
        after = spec.get("after")
        marker = None
        if after is not None:
            if not isinstance(after, str) or not after:
                raise ConfigError(f"structured 'after' must be a non-empty string, not {after!r}")
            marker = self.tokenizer.encode(after, add_bos=False)
        grammar = self._compile(spec)
        for seq in seqs:
            seq.matcher = grammar.matcher()
            seq.matcher_after = marker
            seq.matcher_active = marker is None

    def start(self, rows: list, out) -> Optional[Future]:
        """Fill out[b] (int32 mask words) for every row whose sequence has an active matcher, on the
        worker thread; the others are left all-allowed. None when no row has one."""
        matchers = [s.matcher if s is not None and s.matcher is not None and s.matcher_active else None
                    for s in rows]
        if not any(m is not None for m in matchers):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-masks")
        self.stats["masks"] += 1
        return self._pool.submit(fill_masks, matchers, out, self.vocab_size)

    def wait(self, fut: Future) -> None:
        """Wait for a step's masks (after the forward), counting how long the fill took and how long
        the step loop waited for it."""
        t0 = time.perf_counter()
        self.stats["mask_s"] += fut.result()
        self.stats["wait_s"] += time.perf_counter() - t0

    def advance(self, seq, tok: int) -> Optional[str]:
        """Feed a sampled (non-eos) token to the sequence's matcher; a finish reason when the grammar is
        complete ("stop") or refused the token ("error"), else None."""
        m = seq.matcher
        if m is None:
            return None
        if not seq.matcher_active:
            marker = seq.matcher_after
            out = seq.output_ids
            if marker and len(out) >= len(marker) and out[-len(marker):] == marker:
                seq.matcher_active = True
            return None
        if not m.accept(tok):
            return "error"
        return "stop" if m.is_finished() else None
