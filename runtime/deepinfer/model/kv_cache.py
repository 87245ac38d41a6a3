"""The paged latent KV cache: per layer one tensor [num_blocks, block_size, kv_lora_rank + rope_dim]
and a block allocator shared by all layers (a sequence owns the same block ids in every layer).

Only integer bookkeeping lives here; the cache contents are written by the mla_cache_write op
and read by mla_decode through the block table.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from ..errors import DeepinferError


class CacheFullError(DeepinferError):
    """No free cache blocks left (raise kv_cache_tokens / num_cache_blocks or finish sequences)."""


class PagedKVCache:
    def __init__(self, backend, num_layers: int, num_blocks: int, block_size: int, width: int,
                 dtype: str, max_blocks_per_seq: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"cache needs blocks: num_blocks={num_blocks}, block_size={block_size}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.width, self.dtype, self.max_blocks_per_seq = width, dtype, max_blocks_per_seq
        # one allocation for all layers; each layer sees a view [NB, BS, W]
        # zero-filled: kernels may touch (never use) slots no sequence wrote, and garbage there can be NaN
        self.storage = backend.empty((num_layers, num_blocks, block_size, width), dtype, fill=0.0)
        self.layers = [self.storage.narrow(0, i, 1).view(num_blocks, block_size, width) for i in range(num_layers)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    def has(self, seq_id: int) -> bool:
        return seq_id in self.blocks

    def add(self, seq_id: int) -> None:
        if seq_id in self.blocks:
            raise ValueError(f"sequence {seq_id} already has cache blocks")
        self.blocks[seq_id] = []
        self.lengths[seq_id] = 0

    def length(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def reserve(self, seq_id: int, n_tokens: int) -> None:
        """Make room for positions [0, n_tokens) of the sequence (allocating blocks as needed)."""
        if seq_id not in self.blocks:
            self.add(seq_id)
        if n_tokens > self.max_seq_len:
            raise CacheFullError(f"sequence {seq_id} needs {n_tokens} positions > max_seq_len {self.max_seq_len}")
        blocks = self.blocks[seq_id]
        need = -(-n_tokens // self.block_size) - len(blocks)
        if need > len(self._free):
            raise CacheFullError(f"KV cache full: sequence {seq_id} needs {need} more blocks of {self.block_size} "
                                 f"tokens, {len(self._free)} free of {self.num_blocks}")
        for _ in range(max(need, 0)):
            blocks.append(self._free.pop())

    def set_length(self, seq_id: int, n: int) -> None:
        self.lengths[seq_id] = n

    def free(self, seq_id: int) -> None:
        """Give a sequence's blocks back; freeing an unknown or already-freed sequence is a no-op."""
        blocks = self.blocks.pop(seq_id, None)
        self.lengths.pop(seq_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def slots(self, seq_id: int, positions: Iterable[int]) -> list[int]:
        blocks, bs = self.blocks[seq_id], self.block_size
        return [blocks[p // bs] * bs + p % bs for p in positions]

    def block_table(self, seq_ids: list[int], out: np.ndarray) -> None:
        """Fill `out` [S, max_blocks_per_seq] int32 with each sequence's block ids (0 past the end:
        never read, since kv_len bounds every lookup)."""
        out[...] = 0
        for r, s in enumerate(seq_ids):
            b = self.blocks[s]
            out[r, : len(b)] = b
