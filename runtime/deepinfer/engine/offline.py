"""The offline API: forward / free / score / mtp_logits by caller-chosen sequence ids.

Tests, perplexity (deepinfer.evaluate) and benchmarks drive the model step by step through it,
without the engine's scheduler. It keeps a Sequence per id, so positions still live in one place
(engine.sequence), and runs each step through the runner (ModelRunner.run); the runner's methods
of the same names hand over to it.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import numpy as np

from ..tensor import Tensor
from .sequence import Sequence


class OfflineRunner:
    """The offline API of one ModelRunner."""

    def __init__(self, runner):
        self.runner = runner
        self.seqs: dict = {}                # caller's sequence id -> Sequence
        self.last_layout: Optional[list] = None   # (seq id, tokens, start) of the last keep_hidden forward
        self.last_steps: Optional[list] = None    # and its (Sequence, start, n) steps, for mtp_logits

    def new_sequence(self) -> int:
        """A fresh sequence id for forward()."""
        return Sequence([], cacheable=False).seq_id

    def free(self, seq_id: int) -> None:
        """Give a sequence's blocks back; freeing an unknown or already-freed sequence is a no-op."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.runner.block_manager.release(seq)

    def forward(self, batch, tokens=None, starts=None, *, all_logits: bool = False,
                keep_hidden: bool = False) -> Tensor:
        """One step by sequence ids. Either forward([(seq_id, tokens, start)]) or
        forward(seq_ids, tokens_per_seq, starts). Positions >= start of a sequence are overwritten
        (a rejected draft). Returns f32 logits [S, V] (or [T, V] with all_logits), a view valid until
        the next call. keep_hidden keeps the final hidden states (last_hidden) for mtp_logits."""
        items = self._normalize(batch, tokens, starts)
        bm = self.runner.block_manager
        steps = []
        for sid, toks, start in items:
            seq = self.seqs.get(sid)
            if seq is None:
                seq = self.seqs[sid] = Sequence([], cacheable=False)
            bm.truncate(seq, start)
            del seq.token_ids[start:]
            seq.token_ids.extend(int(t) for t in toks)
            bm.grow(seq, start + len(toks))
            steps.append((seq, start, len(toks)))
        logits = self.runner.run(steps, all_logits=all_logits, keep_hidden=keep_hidden)
        for seq, start, n in steps:
            seq.num_computed = start + n
        self.last_layout = [(sid, len(toks), start) for sid, toks, start in items] if keep_hidden else None
        self.last_steps = steps if keep_hidden else None
        return logits

    def _normalize(self, batch, tokens, starts) -> list:
        if tokens is None:
            items = [(b.seq_id, b.tokens, b.start) if hasattr(b, "tokens") else tuple(b) for b in batch]
        else:
            if starts is None:
                starts = [self.seqs[s].num_computed if s in self.seqs else 0 for s in batch]
            if not (len(batch) == len(tokens) == len(starts)):
                raise ValueError("seq_ids, tokens and starts must have the same length")
            items = list(zip(batch, tokens, starts))
        if not items:
            raise ValueError("forward() needs at least one sequence")
        if len(items) > self.runner.max_batch:
            raise ValueError(f"{len(items)} sequences > max_batch {self.runner.max_batch}")
        V = self.runner.cfg.vocab_size
        seen = set()
        for sid, toks, start in items:
            if sid in seen:
                raise ValueError(f"sequence {sid} appears twice in one batch")
            seen.add(sid)
            if len(toks) == 0:
                raise ValueError(f"sequence {sid} has no new tokens")
            cached = self.seqs[sid].num_computed if sid in self.seqs else 0
            if start < 0 or start > cached:
                raise ValueError(f"sequence {sid} starts at {start} but only {cached} positions are cached")
            bad = [t for t in toks if not 0 <= int(t) < V]
            if bad:
                raise ValueError(f"sequence {sid}: token id {bad[0]} outside the vocabulary [0, {V})")
        return items

    def mtp_logits(self, batch, next_tokens=None, starts=None, *, all_logits: bool = False) -> Tensor:
        """Draft logits of the MTP head for the step just run with keep_hidden=True.

        For each sequence give the tokens that follow the previous step's tokens (the previous
        step's tokens shifted left by one, then the token sampled from its logits), same count and
        same start. Logits at position i predict the token at i + 2. The MTP layer keeps its own
        cache layer, written here, so call it after every step whose draft you want."""
        if self.runner.weights.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers = 0 or weights absent)")
        if self.runner.last_hidden is None or self.last_layout is None:
            raise RuntimeError("mtp_logits needs the hidden states of a forward(..., keep_hidden=True) call")
        if next_tokens is None:
            items = [(b.seq_id, b.tokens, b.start) if hasattr(b, "tokens") else tuple(b) for b in batch]
        else:
            if starts is None:
                starts = [st for (_, _, st) in self.last_layout]
            items = list(zip(batch, next_tokens, starts))
        layout = [(sid, len(toks), start) for sid, toks, start in items]
        if layout != self.last_layout:
            raise ValueError(f"mtp_logits batch {layout} must match the last forward's {self.last_layout}")
        # the MTP step reads the same positions and blocks with the shifted tokens
        steps = []
        for (sid, toks, start), (seq, _, n) in zip(items, self.last_steps):
            shadow = Sequence([0] * start + [int(t) for t in toks], cacheable=False)
            shadow.block_table = seq.block_table
            steps.append((shadow, start, n))
        return self.runner.run(steps, all_logits=all_logits, kind="mtp")

    def score(self, ids: Seq[int], chunk: int = 256) -> np.ndarray:
        """Logits of every position of one token sequence, as a host f32 array [len, V]
        (perplexity); long inputs run as chunked prefill through the cache."""
        sid = self.new_sequence()
        rows = []
        try:
            for s in range(0, len(ids), chunk):
                part = list(ids[s:s + chunk])
                rows.append(self.runner.backend.to_numpy(self.forward([(sid, part, s)], all_logits=True)))
        finally:
            self.free(sid)
        return np.concatenate(rows) if rows else np.zeros((0, self.runner.cfg.vocab_size), np.float32)
