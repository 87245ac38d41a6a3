"""Which routed experts one MoE layer keeps in its slots: the bookkeeping and the eviction policies of
the expert cache (model.expert_cache), free of memory and backends so that a benchmark can replay a
routing trace through exactly the code the engine runs.

A layer has `n` slots. Each step, `route(needed)` says which of the needed experts are resident
(hits) and picks a slot for each one that is not (a free slot, else the policy's victim among the
experts this step does not need; None when every slot holds a needed expert: the caller borrows a
shared overflow slot for the step). `prefetch(predicted)` places predicted experts ahead of their
use, never evicting one the coming step was predicted to need.

Policies:
  lru   evict the expert used longest ago.
  lfru  frequency-weighted recency: each expert's score is an exponentially decayed count of its
        uses (decay per step of the layer), and the lowest score is evicted, ties to the oldest.
        DeepSeek's routers favour a layer's hot experts for long stretches of text while LRU lets
        one burst of cold experts flush them; the decayed count keeps them. The half-life (DECAY)
        was chosen on the embedded model's training text, not the held-out text the benchmark uses.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

POLICIES = ("lfru", "lru")
DECAY = 0.9          # lfru: a use counts 0.9^age, age in steps of the layer (half-life ~6.6 steps)


class _LRU:
    def __init__(self, E: int):
        self.last = [-1.0] * E

    def use(self, e: int, now: int) -> None:
        self.last[e] = float(now)

    def prefetched(self, e: int, now: int) -> None:
        self.last[e] = float(now)

    def victim(self, cands: Iterable[int], now: int) -> int:
        return min(cands, key=lambda e: (self.last[e], e))


class _LFRU:
    def __init__(self, E: int, decay: Optional[float] = None):
        self.decay = DECAY if decay is None else decay
        self.freq = [0.0] * E       # decayed use count as of step last[e]
        self.last = [-1] * E

    def score(self, e: int, now: int) -> float:
        return self.freq[e] * self.decay ** max(now - self.last[e], 0)

    def use(self, e: int, now: int) -> None:
        self.freq[e] = self.score(e, now) + 1.0
        self.last[e] = now

    def prefetched(self, e: int, now: int) -> None:
        # a prefetch is not a use: the expert keeps its score, and only its recency is refreshed
        self.freq[e] = self.score(e, now)
        self.last[e] = now

    def victim(self, cands: Iterable[int], now: int) -> int:
        return min(cands, key=lambda e: (self.score(e, now), self.last[e], e))


def make_policy(name: str, E: int):
    if name == "lru":
        return _LRU(E)
    if name == "lfru":
        return _LFRU(E)
    raise ValueError(f"expert cache policy {name!r} is not one of {', '.join(POLICIES)}")


class LayerSlots:
    """The expert <-> slot map of one MoE layer and its eviction policy (no memory here)."""

    def __init__(self, E: int, n_slots: int, policy: str = "lfru"):
        if not 1 <= n_slots <= E:
            raise ValueError(f"a layer of {E} experts needs 1..{E} slots, not {n_slots}")
        self.E, self.n = E, n_slots
        self.slot_of = [-1] * E
        self.table = np.full(E, -1, np.int32)     # slot_of as an array (the kernel's id -> slot map)
        self.expert_in = [-1] * n_slots
        self.policy = make_policy(policy, E)
        self.now = 0
        self.predicted: set = set()      # experts prefetched for the coming step (not evictable by prefetch)
        self.unused_prefetch: set = set()  # resident through a prefetch and not used since

    def resident(self, e: int) -> bool:
        return self.slot_of[e] >= 0

    def _slot_for(self, keep: set) -> Optional[int]:
        free = [s for s in range(self.n) if self.expert_in[s] < 0]
        if free:
            return free[0]
        cands = [e for e in self.expert_in if e not in keep]
        if not cands:
            return None
        return self.slot_of[self.policy.victim(cands, self.now)]

    def _place(self, e: int, slot: int) -> int:
        """Put e in slot; returns the evicted expert (-1: none)."""
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
            self.table[old] = -1
            self.unused_prefetch.discard(old)
        self.expert_in[slot] = e
        self.slot_of[e] = slot
        self.table[e] = slot
        return old

    def route(self, needed: list) -> tuple:
        """One step of the layer over its distinct needed experts. Returns (hits, prefetch_used,
        loads, overflow): hits are resident experts, prefetch_used those of them resident through
        a prefetch, loads [(expert, slot, evicted)] the misses placed in the layer's slots and
        overflow the misses left for the shared overflow (all slots hold needed experts)."""
        self.now += 1
        use, now, slot_of = self.policy.use, self.now, self.slot_of
        if not self.unused_prefetch and all(slot_of[e] >= 0 for e in needed):
            # the common step once the cache is warm: every needed expert is resident
            for e in needed:
                use(e, now)
            if self.predicted:
                self.predicted = set()
            return needed, [], [], []
        keep = set(needed)
        hits, used_pf, loads, overflow = [], [], [], []
        for e in needed:
            if self.slot_of[e] >= 0:
                hits.append(e)
                if e in self.unused_prefetch:
                    used_pf.append(e)
                    self.unused_prefetch.discard(e)
        for e in needed:
            if self.slot_of[e] < 0:
                s = self._slot_for(keep)
                if s is None:
                    overflow.append(e)
                else:
                    loads.append((e, s, self._place(e, s)))
        for e in needed:
            self.policy.use(e, self.now)
        self.predicted = set()
        return hits, used_pf, loads, overflow

    def fill(self) -> list:
        """Place every expert that is not resident into a free slot (a layer with a slot for each of
        its experts: lazy loading's background fill); returns [(expert, slot)]. Evicts nothing."""
        free = [s for s in range(self.n) if self.expert_in[s] < 0]
        missing = [e for e in range(self.E) if self.slot_of[e] < 0]
        for e, s in zip(missing, free):
            self._place(e, s)
        return list(zip(missing, free))

    @property
    def full(self) -> bool:
        """Every expert of the layer is resident."""
        return all(s >= 0 for s in self.slot_of)

    def prefetch(self, predicted: list) -> list:
        """Place predicted experts that are not resident; returns [(expert, slot, evicted)]. The
        experts predicted for this step are kept; nothing else is spared (a wrong prediction evicts
        a resident expert: what precision measures)."""
        self.predicted = set(predicted)
        out = []
        for e in predicted:
            if self.slot_of[e] >= 0:
                continue
            s = self._slot_for(self.predicted)
            if s is None:
                break
            out.append((e, s, self._place(e, s)))
            self.unused_prefetch.add(e)
            self.policy.prefetched(e, self.now)
        return out
