"""The scheduler: which sequences run in the next step, and how many tokens each feeds.

Queues: `waiting` (FIFO: new requests, and preempted ones at the front) and `running` (admitted,
holding KV blocks). Each step is either a prefill step or a decode step, never both, so a fresh
prompt runs through the prefill path (mla_prefill) as it would alone:

- prefill: sequences still inside their prompt, then waiting ones in arrival order, each feeding
  the next chunk of its prompt within a budget of `max_num_batched_tokens` tokens (chunked
  prefill: a long prompt is spread over several steps and never blocks the engine for long).
  Admission stops at `max_num_seqs` running sequences or when the cache has no room.
- decode: every running sequence feeds its last sampled token. When the cache has no block for a
  sequence's next position, the most recently admitted sequence is preempted: its blocks are given
  back and it goes to the front of the queue, to be recomputed from its tokens later (nothing is
  lost: a Sequence keeps its prompt and every token generated so far).

Policies: "fcfs" as above; "priority" keeps `waiting` ordered by (priority, arrival), preempts the
running sequence of the lowest priority (latest arrival among equals) instead of the latest admitted,
and lets a waiting sequence of a higher priority than a running one take its place when the batch is
full or the cache has no room for it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..errors import CacheFullError

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int          # first position fed (== seq.num_computed)
    num_tokens: int     # tokens fed this step

    @property
    def samples(self) -> bool:
        """This chunk ends at the sequence's last token: its logits give the next token."""
        return self.start + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs"):
        self.bm = block_manager
        self.priority = policy == "priority"
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0
        self.last_kind = ""

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        if self.priority:
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Insert into `waiting` by rank (priority policy): after every sequence that ranks before it."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].rank > seq.rank:
            i -= 1
        self.waiting.insert(i, seq)

    def _victim(self) -> Sequence:
        """The running sequence a preemption takes: the latest admitted, or (priority) the lowest ranked."""
        return max(self.running, key=lambda q: q.rank) if self.priority else self.running[-1]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of either queue and give its blocks back (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.release(seq)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list:
        """The next step's batch; self.last_kind says whether it is a "prefill" or a "decode" step."""
        batch = self._prefill()
        self.last_kind = "prefill"
        if not batch:
            batch = self._decode()
            self.last_kind = "decode"
        return batch

    def _prefill(self) -> list:
        budget, batch = self.max_num_batched_tokens, []
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                n = min(seq.num_pending, budget)
                if not self.bm.can_grow(seq, seq.num_computed + n):
                    break
                self.bm.grow(seq, seq.num_computed + n)
                batch.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs and not self._make_room(seq, batch):
                break
            self.bm.allocate(seq)                       # prefix-cache hits: those tokens are done
            n = min(seq.num_pending, budget)
            if not self.bm.can_grow(seq, seq.num_computed + n):
                self.bm.release(seq)
                if self._make_room(seq, batch):
                    continue
                if not self.running and not batch:
                    # nothing runs that could ever free a block: the cache is too small for it
                    raise_cache_too_small(self.bm, seq)
                break
            self.bm.grow(seq, seq.num_computed + n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return batch

    def _decode(self) -> list:
        batch = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self.bm.can_grow(seq, len(seq)):
                victim = self._victim()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.bm.grow(seq, len(seq))
                batch.append(ScheduledSeq(seq, seq.num_computed, seq.num_pending))
                i += 1
                continue
            break       # seq itself was preempted: it was the last running one
        return batch

    def _make_room(self, seq: Sequence, batch: list) -> bool:
        """Priority policy: preempt the lowest-ranked running sequence for `seq` when it ranks after
        `seq` and is not in this step's batch; whether one was."""
        if not self.priority or not self.running:
            return False
        victim = self._victim()
        if victim.rank <= seq.rank or any(s.seq is victim for s in batch):
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        seq.status = Status.WAITING
        if self.priority:
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1


def raise_cache_too_small(bm: BlockManager, seq: Sequence):
    raise CacheFullError(f"KV cache of {bm.num_blocks} blocks x {bm.block_size} tokens cannot hold one sequence of "
                         f"{len(seq)} tokens; raise kv_cache_tokens")
