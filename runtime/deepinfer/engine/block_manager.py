"""KV cache blocks: a free list, reference counts, and a prefix cache of full blocks.

A full block (block_size tokens) is known by the hash of its tokens chained to the hash of the
block before it, so equal prefixes give equal hashes. A new sequence whose first blocks hash to
blocks already in the cache shares them (reference count + 1) and skips computing those tokens:
a system prompt shared by many requests is prefilled once. A block whose count drops to zero goes
back to the free list but keeps its contents and hash until it is handed out again, so a prefix
seen recently is still found after its requests finished (least recently freed is reused first).

Blocks are never written once full, so sharing is safe: only the block holding a sequence's last,
partial positions is written, and that block is never shared (at least the last prompt token is
always computed, in a block of its own sequence).
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Optional

import numpy as np

from ..errors import CacheFullError
from .sequence import Sequence


def block_hash(prev: Optional[bytes], tokens) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if prev is not None:
        h.update(prev)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class Block:
    __slots__ = ("id", "ref", "hash", "tokens")

    def __init__(self, id: int):
        self.id, self.ref, self.hash, self.tokens = id, 0, None, None


class _Blocks(dict):
    """Block records by id, each made when first looked up: a device KV cache has millions of blocks
    (4.4 million on an H200 for the embedded model), and making them all at start costs seconds and
    most of a GiB of host memory for blocks a run may never touch."""

    def __missing__(self, bid: int) -> Block:
        b = self[bid] = Block(bid)
        return b


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int, enable_prefix_cache: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"the KV cache needs blocks: num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks, self.block_size, self.max_blocks_per_seq = num_blocks, block_size, max_blocks_per_seq
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = _Blocks()
        self.free: deque = deque(range(num_blocks))      # popleft: least recently freed first
        self.by_hash: dict = {}
        self.prefix_hits = 0                              # tokens served from the prefix cache
        self.prefix_queries = 0                           # prompt tokens looked up

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def _take(self) -> int:
        bid = self.free.popleft()
        b = self.blocks[bid]
        if b.hash is not None and self.by_hash.get(b.hash) == bid:
            del self.by_hash[b.hash]                      # its old contents are about to be overwritten
        b.hash = b.tokens = None
        b.ref = 1
        return bid

    def _cached_prefix(self, seq: Sequence) -> list:
        """Blocks of the prefix cache that hold seq's first full blocks (at most all but the block of
        its last token, which must be computed to get logits)."""
        if not (self.enable_prefix_cache and seq.cacheable):
            return []
        bs, hits, prev = self.block_size, [], None
        for i in range((len(seq) - 1) // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(prev, toks)
            bid = self.by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != toks:
                break
            hits.append((bid, h))
            prev = h
        return hits

    def allocate(self, seq: Sequence) -> int:
        """Give a waiting sequence its prefix-cache hits; returns the number of tokens they cover."""
        if seq.block_table:
            raise ValueError(f"{seq} already holds blocks")
        if len(seq) > self.max_seq_len:
            raise CacheFullError(f"sequence of {len(seq)} tokens > max_seq_len {self.max_seq_len}")
        hits = self._cached_prefix(seq)
        for bid, h in hits:
            b = self.blocks[bid]
            if b.ref == 0:
                self.free.remove(bid)
            b.ref += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
        n = len(hits) * self.block_size
        self.prefix_queries += len(seq) - 1
        self.prefix_hits += n
        seq.num_computed = seq.num_cached = n
        return n

    def can_grow(self, seq: Sequence, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, n_tokens: int) -> None:
        """Blocks for positions [0, n_tokens) of seq."""
        if n_tokens > self.max_seq_len:
            raise CacheFullError(f"sequence needs {n_tokens} positions > max_seq_len {self.max_seq_len}")
        need = self.blocks_for(n_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise CacheFullError(f"KV cache full: a sequence needs {need} more blocks of {self.block_size} tokens, "
                                 f"{len(self.free)} free of {self.num_blocks}")
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take())

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks seq's computed tokens now fill (call after each step)."""
        if not (self.enable_prefix_cache and seq.cacheable):
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, toks)
            b = self.blocks[seq.block_table[i]]
            b.hash, b.tokens = h, toks
            self.by_hash.setdefault(h, b.id)          # an equal block already cached keeps serving
            seq.block_hashes.append(h)

    def release(self, seq: Sequence) -> None:
        """Give seq's blocks back (a finished, aborted or preempted sequence); idempotent."""
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref -= 1
            if b.ref == 0:
                if b.hash is None:
                    self.free.appendleft(bid)         # nothing worth keeping: reuse it first
                else:
                    self.free.append(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = seq.num_cached = 0

    def truncate(self, seq: Sequence, n_tokens: int) -> None:
        """Forget positions >= n_tokens of seq (a rejected draft); blocks past them stay its own."""
        keep = n_tokens // self.block_size
        for bid in seq.block_table[keep:len(seq.block_hashes)]:
            b = self.blocks[bid]
            if b.ref > 1:
                raise ValueError(f"cannot rewind {seq} into block {bid}: other sequences share it")
            if self.by_hash.get(b.hash) == bid:
                del self.by_hash[b.hash]
            b.hash = b.tokens = None
        del seq.block_hashes[keep:]
        seq.num_computed = min(seq.num_computed, n_tokens)

    def slots(self, seq: Sequence, start: int, stop: int) -> list:
        bt, bs = seq.block_table, self.block_size
        return [bt[p // bs] * bs + p % bs for p in range(start, stop)]
