"""The device tensors that carry hidden states and draft logits from one step to the next.

The MTP layer reads the main model's final hidden states of a step (keep_hidden), and drafting
reads the MTP layer's own: plans are traced against these persistent stores, so they outlive any
one plan's arena. Speculative decoding (engine.speculative) adds a row per drafting sequence for
recursive drafts, the draft logits spec_verify reads for sampled drafts, and the row gathers that
move rows between them.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError
from ..tensor import Tensor
from .plan_key import bucket


class SpecStore:
    """main / mtp: [n, H] hidden states of the main model and of the MTP layer (n grows with the
    steps that keep them); draft: [bucket(max_batch), H], a row per drafting sequence; draft_q:
    [num_draft * max_batch, V] f32 draft logits (allocated at the first sampled draft)."""

    def __init__(self, backend, width: int, dtype: str, max_batch: int, vocab_size: int):
        self.backend, self.width, self.dtype = backend, width, dtype
        self.max_batch, self.vocab_size = max_batch, vocab_size
        self.main: Optional[Tensor] = None
        self.mtp: Optional[Tensor] = None
        self.draft: Optional[Tensor] = None
        self.draft_q: Optional[Tensor] = None
        self.gather_ids: Optional[Tensor] = None
        self.num_draft = 0

    def ensure(self, T: int) -> bool:
        """Stores of at least T rows; True when main and mtp were allocated again (the plans
        traced against the old ones must be traced again)."""
        grown = self.main is None or self.main.shape[0] < T
        if grown:
            n = max(T, 2 * self.max_batch, 64 if self.main is None else 2 * self.main.shape[0])
            # zero-filled: a step-time profile (engine.speculative) runs plans on rows nothing wrote
            self.main = self.backend.empty((n, self.width), self.dtype, fill=0.0)
            self.mtp = self.backend.empty((n, self.width), self.dtype, fill=0.0)
        if self.draft is None:
            self.draft = self.backend.empty((bucket(self.max_batch), self.width), self.dtype, fill=0.0)
        return grown

    def enable(self, num_draft: int, max_num_batched_tokens: int, has_mtp: bool) -> bool:
        """Size the stores a speculative step reads and writes; returns ensure()'s answer."""
        if not has_mtp:
            raise ConfigError("speculative decoding with MTP needs the checkpoint's MTP layer: this model has none "
                              "(num_nextn_predict_layers is 0, or its weights are absent, or speculative.mtp is "
                              "false); drop the speculative option")
        if not self.backend.has_op("spec_verify"):
            raise ConfigError(f"speculative decoding needs the spec_verify op (ABI 1.2), which backend "
                              f"{self.backend.name} lacks; update that library, or set fallback: true to run "
                              f"it on the reference")
        self.num_draft = int(num_draft)
        rows = max(max_num_batched_tokens, self.max_batch * (self.num_draft + 1))
        grown = self.ensure(bucket(rows))
        self.gather_ids = self.backend.empty((bucket(rows),), "int32")
        return grown

    def draft_logits(self) -> Tensor:
        """[num_draft * max_batch, V] f32: each drafting sequence's draft logits, row depth *
        max_batch + slot (allocated at the first sampled draft: greedy drafts never need it)."""
        if self.draft_q is None:
            self.draft_q = self.backend.empty((self.num_draft * self.max_batch, self.vocab_size), "f32")
        return self.draft_q

    def gather_rows(self, src: Tensor, rows: list, dst: Tensor) -> None:
        """dst[i] = src[rows[i]] for i < len(rows) (the embedding op is a row gather)."""
        n = len(rows)
        if n == 0:
            return
        ids = self.gather_ids.narrow(0, 0, n)
        self.backend.write(ids, np.asarray(rows, np.int32))
        self.backend.call("embedding", ids=ids, table=src, out=dst.narrow(0, 0, n))

    def scatter_draft_rows(self, src: Tensor, rows: list, slots: list, depth: int) -> None:
        """Keep draft logits: draft_logits() row depth * max_batch + slots[i] = src[rows[i]]."""
        store = self.draft_logits()
        base = depth * self.max_batch
        # slots are arbitrary: one gather per run of consecutive slots
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and slots[j] == slots[j - 1] + 1:
                j += 1
            self.gather_rows(src, rows[i:j], store.narrow(0, base + slots[i], j - i))
            i = j

    def keep_draft_hidden(self, rows: list) -> None:
        """draft[i] = the MTP layer's hidden state at row rows[i] of the last step (the start of
        recursive drafting)."""
        self.gather_rows(self.mtp, rows, self.draft)

    def compact_drafting(self, keep: list) -> None:
        """draft[:len(keep)] = draft[keep]: the rows of the sequences still drafting, moved through
        the mtp store (a gather cannot run in place)."""
        self.gather_rows(self.draft, keep, self.mtp)
        self.gather_rows(self.mtp, list(range(len(keep))), self.draft)
