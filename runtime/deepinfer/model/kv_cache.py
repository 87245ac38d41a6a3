"""The paged latent KV cache's memory: per layer one tensor [num_blocks, block_size, kv_lora_rank +
rope_dim], all layers in one allocation. A sequence owns the same block ids in every layer.

Only memory lives here. Which block belongs to whom (reference counts, prefix hashes) is the
BlockManager's (engine.block_manager); the contents are written by the mla_cache_write op and read
by mla_decode through the block table.
"""
from __future__ import annotations

from ..tensor import Tensor


def block_bytes(num_layers: int, block_size: int, width: int, dtype_bytes: int) -> int:
    """Bytes one block takes across all layers."""
    return num_layers * block_size * width * dtype_bytes


class PagedKVCache:
    def __init__(self, backend, num_layers: int, num_blocks: int, block_size: int, width: int,
                 dtype: str, max_blocks_per_seq: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"cache needs blocks: num_blocks={num_blocks}, block_size={block_size}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.width, self.dtype, self.max_blocks_per_seq = width, dtype, max_blocks_per_seq
        # zero-filled: kernels may touch (never use) slots no sequence wrote, and garbage there can be NaN
        self.storage = backend.empty((num_layers, num_blocks, block_size, width), dtype, fill=0.0)
        self.layers = [self.storage.narrow(0, i, 1).view(num_blocks, block_size, width) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size


def pools_block_bytes(layout: list, dtype_bytes: int) -> int:
    """Bytes one block takes across all layers of a pooled layout (PagedPools)."""
    return sum(e * w for pools in layout for e, w in pools.values()) * dtype_bytes


class PagedPools:
    """A paged cache whose layers hold several pools each (DeepSeek V4: per-token KV, compressor
    inputs, compressed entries; model.deepseek_v4.cache_pools): layout is per layer {name:
    (entries per block, width)}, and layers[i][name] is a tensor [num_blocks, entries, width]. All
    pools are indexed by the same block ids (a sequence's block table), in one allocation."""

    def __init__(self, backend, layout: list, num_blocks: int, block_size: int, dtype: str,
                 max_blocks_per_seq: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"cache needs blocks: num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.max_blocks_per_seq, self.layout = max_blocks_per_seq, layout
        per = sum(e * w for pools in layout for e, w in pools.values())
        # zero-filled, as PagedKVCache: kernels may touch slots no sequence wrote
        self.storage = backend.empty((num_blocks * per,), dtype, fill=0.0)
        item = self.storage.dtype.nbytes(1)
        self.layers, off = [], 0
        for pools in layout:
            views = {}
            for name, (e, w) in pools.items():
                views[name] = Tensor(self.storage.buffer, (num_blocks, e, w), dtype, None,
                                     self.storage.offset + off * item)
                off += num_blocks * e * w
            self.layers.append(views)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size
