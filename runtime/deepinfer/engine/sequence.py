"""A Sequence: one request's tokens, how many of them the KV cache holds, and its cache blocks.

This is the one place a request's position lives: `num_computed` tokens of `token_ids` have their
KV in the cache, in `block_table`; the next step feeds `token_ids[num_computed:]` (a prompt chunk,
or the last sampled token).
"""
from __future__ import annotations

import enum
import itertools
import time
from typing import Optional

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"      # not admitted, or preempted (its blocks were given back)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_ids: list, params=None, request_id: Optional[str] = None, index: int = 0,
                 cacheable: bool = True, priority: int = 0):
        self.seq_id = next(_ids)
        self.priority = priority            # the scheduler's priority policy: lower runs first
        self.request_id = request_id if request_id is not None else f"seq-{self.seq_id}"
        self.index = index                  # which of a request's n choices (feeds the sampling seed)
        self.params = params
        self.token_ids: list = list(prompt_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed = 0               # tokens whose KV is in the cache
        self.num_cached = 0                 # of those, how many came from the prefix cache
        self.block_table: list = []
        self.block_hashes: list = []        # hash of each full block registered so far (prefix cache)
        self.cacheable = cacheable          # register full blocks in the prefix cache
        self.status = Status.WAITING
        self.finish_reason: Optional[str] = None
        self.detok = None                   # the engine's incremental detokenizer
        self.arrival = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.logprobs: list = []            # per output token, when asked for
        # structured output (engine.constraints): the grammar's matcher, and whether it constrains yet
        self.matcher = None
        self.matcher_after: Optional[list] = None   # token ids the output must produce before it does
        self.matcher_active = False
        # speculative decoding (engine.speculative): the drafts made after this sequence's last step
        self.drafts: list = []              # draft token ids
        self.draft_probs: list = []         # their draft probabilities (the scheduler's confidence)
        self.draft_q = False                # drafted by sampling: their logits are kept for spec_verify
        self.draft_len = -1                 # len(self) when drafted: drafts are stale once it moved on

    @property
    def rank(self) -> tuple:
        """Order under the priority policy: priority, then arrival (seq_id grows with it)."""
        return (self.priority, self.seq_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self):
        return (f"Sequence({self.request_id}#{self.index}, {self.status.value}, {self.num_computed}/{len(self)} "
                f"computed, {len(self.block_table)} blocks)")

    @property
    def output_ids(self) -> list:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the rest of the prompt, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int) -> None:
        self.token_ids.append(int(token))
