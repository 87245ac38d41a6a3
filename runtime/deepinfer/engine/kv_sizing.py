"""How big the KV cache is, and allocating it: bytes per block, what fits in free memory.

The runner asks here for the cache of a given number of blocks, checks an explicit size against
the free memory, and (kv_cache_memory_fraction) turns the memory left after its warm-up step into
a number of blocks. A family whose cache is several pools per layer (V4, V3.2) says so through
model.family's cache_pools; V2 / V3 keep one latent tensor per layer.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..errors import ConfigError
from ..model.kv_cache import PagedKVCache, PagedPools, block_bytes, pools_block_bytes

log = logging.getLogger("deepinfer")


class KVSizing:
    """The KV cache geometry of one runner: cache layers, block size, activation dtype, pools."""

    def __init__(self, backend, family, cfg, num_layers: int, block_size: int, dtype: str,
                 max_blocks_per_seq: int, max_batch: int, max_seq_len: int):
        self.backend, self.family, self.cfg = backend, family, cfg
        self.num_layers, self.block_size, self.dtype = num_layers, block_size, dtype
        self.max_blocks_per_seq, self.max_batch, self.max_seq_len = max_blocks_per_seq, max_batch, max_seq_len

    def pool_layout(self) -> Optional[list]:
        """Per layer {pool: (entries per block, width)} for models whose cache is several pools (V4,
        V3.2), None for the one latent tensor per layer of V2 / V3."""
        pools = self.family.cache_pools
        return None if pools is None else pools(self.cfg, self.block_size, self.num_layers)

    def new_cache(self, num_blocks: int):
        layout = self.pool_layout()
        if layout is not None:
            return PagedPools(self.backend, layout, num_blocks, self.block_size, self.dtype, self.max_blocks_per_seq)
        return PagedKVCache(self.backend, self.num_layers, num_blocks, self.block_size, self.cfg.cache_width,
                            self.dtype, self.max_blocks_per_seq)

    def block_bytes(self) -> int:
        """Bytes one KV block takes over all cache layers."""
        item = 4 if self.dtype == "f32" else 2
        layout = self.pool_layout()
        if layout is not None:
            return pools_block_bytes(layout, item)
        return block_bytes(self.num_layers, self.block_size, self.cfg.cache_width, item)

    def check_fits(self, num_blocks: int, explicit: bool) -> None:
        """Refuse a KV cache larger than the free memory before allocating it: an allocation that
        fails (or a host that starts swapping) says far less than what fits."""
        per = self.block_bytes()
        free, _ = self.backend.memory_info()
        if free and num_blocks * per > free:
            fits = free // per * self.block_size
            asked = (f"kv_cache_tokens {num_blocks * self.block_size}" if explicit else
                     f"max_batch {self.max_batch} x max_seq_len {self.max_seq_len}")
            raise ConfigError(f"a KV cache for {asked} needs {num_blocks * per / 2**30:.2f} GiB but "
                              f"{free / 2**30:.2f} GiB are free on {self.backend.name}; at most {fits} tokens "
                              f"fit (blocks of {self.block_size}): lower it")

    def blocks_from_free_memory(self, fraction: float) -> int:
        """KV blocks that fit in `fraction` of the memory free now (the runner calls this after a
        warm-up step of its largest prefill, whose arena is the peak activation memory). Device
        backends take that much; host backends stop at max_batch full-length sequences (RAM is
        shared with everything else)."""
        free, total = self.backend.memory_info()
        per = self.block_bytes()
        nb = int(free * float(fraction)) // per
        if self.backend.device == "cpu":
            nb = min(nb, self.max_batch * self.max_blocks_per_seq)
        if nb < self.max_blocks_per_seq:   # a setting that cannot work, not a full cache at run time
            raise ConfigError(f"{fraction:.0%} of the {free / 2**30:.2f} GiB free after loading holds {nb} KV blocks "
                              f"of {self.block_size} tokens, fewer than one sequence of max_seq_len "
                              f"{self.max_seq_len} needs ({self.max_blocks_per_seq}); lower max_seq_len or set "
                              f"kv_cache_tokens")
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB) from %.0f%% of %.2f GiB free", nb, self.block_size,
                 nb * per / 2**20, 100 * fraction, free / 2**30)
        return nb
