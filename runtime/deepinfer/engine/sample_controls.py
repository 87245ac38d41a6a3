"""The sample op's ABI 1.7 controls for one step: each row's history (penalties), logit bias and bans
(`logit_bias`, `min_tokens`), and its grammar's token mask (structured output), written into buffers
the op reads on the device.

Only the groups some row of the step needs are passed; a row that needs none gets neutral values
(penalties (1, 0, 0), no bias, every token allowed). A history row is written once and then only
appended to while it holds the same sequence, so a long generation costs one token per step here; a
row without a repetition penalty holds its output only (the prompt would change nothing), so long
prompts cost nothing. Buffers grow by powers of two and keep their size, so the op's bound call is
reused step after step.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..tensor import Tensor

def _cap(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n - 1).bit_length()))


class _Store:
    """Host arrays of one group (pinned on device backends) and their device twins, [B, cap] per array."""

    def __init__(self, backend, B: int, shapes: dict, fills: dict):
        self.backend = backend
        self.host, self.dev, self.np = {}, {}, {}
        device = backend.device != "cpu"
        for name, (shape, dtype) in shapes.items():
            d = backend.empty(shape, dtype)
            h = d
            if device:
                try:
                    h = backend.host_empty(shape, dtype)
                except Exception:    # no pinned memory in this library: a pageable copy
                    h = Tensor.empty(shape, dtype)
            self.dev[name], self.host[name] = d, h
            self.np[name] = h.numpy()
            self.np[name][...] = fills[name]

    def upload(self) -> None:
        for name, d in self.dev.items():
            if self.host[name] is not d:
                self.backend.copy_async(d, self.host[name])


class SampleControls:
    """The control tensors of a step of B rows over V logits; `build` fills them and returns the sample
    op's extra arguments."""

    def __init__(self, backend, B: int, V: int):
        self.backend, self.B, self.V = backend, B, V
        self.W = (V + 31) // 32
        self._hist: Optional[_Store] = None
        self._hist_rows: list = [None] * B      # (seq_id, with_prompt, tokens written) per row
        self._bias: Optional[_Store] = None
        self._mask: Optional[_Store] = None

    # ------------------------------------------------------------------ groups
    def _history_store(self, L: int) -> _Store:
        if self._hist is None or self._hist.np["history"].shape[1] < L:
            cap = _cap(L, 64)
            self._hist = _Store(self.backend, self.B, {"history": ((self.B, cap), "int32"),
                                                       "prompt_lens": ((self.B,), "int32"),
                                                       "penalties": ((self.B, 3), "f32")},
                                {"history": -1, "prompt_lens": 0, "penalties": 0})
            self._hist_rows = [None] * self.B
        return self._hist

    def _fill_history(self, rows: list) -> None:
        # per row: its sequence, and whether the prompt counts (a repetition penalty) or the output alone
        use = [(s, s.params.repetition_penalty != 1.0) if s is not None and "penalties" in s.params.control_groups
               else None for s in rows]
        toks = [None if u is None else (u[0].token_ids if u[1] else u[0].output_ids) for u in use]
        st = self._history_store(max((len(t) for t in toks if t is not None), default=0) or 1)
        h, pl, pen = st.np["history"], st.np["prompt_lens"], st.np["penalties"]
        for b, (u, t) in enumerate(zip(use, toks)):
            if u is None:
                if self._hist_rows[b] is not None:
                    h[b] = -1
                    self._hist_rows[b] = None
                pl[b], pen[b] = 0, (1.0, 0.0, 0.0)
                continue
            seq, with_prompt = u
            p = seq.params
            last = self._hist_rows[b]
            start = last[2] if last is not None and last[:2] == (seq.seq_id, with_prompt) and last[2] <= len(t) else 0
            if start == 0:
                h[b] = -1
            h[b, start:len(t)] = t[start:]
            self._hist_rows[b] = (seq.seq_id, with_prompt, len(t))
            pl[b] = seq.num_prompt_tokens if with_prompt else 0
            pen[b] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)

    def _fill_bias(self, rows: list, stop_ids) -> None:
        entries = []
        for seq in rows:
            e = {}
            if seq is not None:
                p = seq.params
                if p.logit_bias:
                    e.update(p.logit_bias)
                if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                    for t in (*(() if p.ignore_eos else stop_ids), *p.stop_token_ids):
                        e[t] = -np.inf     # banned until min_tokens were generated
            entries.append(e)
        N = max((len(e) for e in entries), default=1)
        if self._bias is None or self._bias.np["bias_ids"].shape[1] < N:
            cap = _cap(N, 8)
            self._bias = _Store(self.backend, self.B, {"bias_ids": ((self.B, cap), "int32"),
                                                       "bias": ((self.B, cap), "f32")}, {"bias_ids": -1, "bias": 0})
        ids, vals = self._bias.np["bias_ids"], self._bias.np["bias"]
        ids[...] = -1
        for b, e in enumerate(entries):
            if e:
                ids[b, :len(e)] = list(e.keys())
                vals[b, :len(e)] = list(e.values())

    def mask_rows(self) -> np.ndarray:
        """The [B, W] int32 mask rows the grammar matchers fill (all allowed until they do)."""
        if self._mask is None:
            self._mask = _Store(self.backend, self.B, {"token_mask": ((self.B, self.W), "int32")}, {"token_mask": -1})
        return self._mask.np["token_mask"]

    # ------------------------------------------------------------------ a step
    def build(self, rows: list, stop_ids, masked: bool) -> dict:
        """rows: the step's sequence per row (None: not sampled, or no controls); stop_ids: the model's
        eos ids (min_tokens bans them); masked: mask_rows() holds this step's masks. Returns the sample
        op's control arguments, uploaded."""
        groups = set()
        for seq in rows:
            if seq is not None:
                groups |= seq.params.control_groups
        if not masked:
            groups.discard("mask")
        kw = {}
        if "penalties" in groups:
            self._fill_history(rows)
            self._hist.upload()
            kw.update(self._hist.dev)
        if "bias" in groups:
            self._fill_bias(rows, stop_ids)
            self._bias.upload()
            kw.update(self._bias.dev)
        if "mask" in groups:
            self._mask.upload()
            kw.update(self._mask.dev)
        return kw
